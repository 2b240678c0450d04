"""Tests of pipejax.data: readers, registry, chunk streams and their exact resume."""

import builtins
import gzip
import json
import logging
import os
import random
import re
import struct
import time

import numpy as np
import pytest

from pipejax import data
from pipejax.data import augment as augment_lib
from pipejax.data import fashion_mnist
from pipejax.data import text

IDX_DIR = fashion_mnist.DEFAULT_DIR


# ---------------------------------------------------------------------------------------------
# Fashion-MNIST from the Debian package's IDX files.


@pytest.fixture(scope="module")
def fashion():
  if not os.path.isdir(IDX_DIR):
    pytest.skip("dataset-fashion-mnist is not installed on this machine")
  return data.load("fashion_mnist_idx")


def test_fashion_mnist_idx_real_files(fashion):
  train, test = fashion
  assert len(train) == 60000 and len(test) == 10000
  assert train.images.shape == (60000, 28, 28, 1) and test.images.shape == (10000, 28, 28, 1)
  assert train.images.dtype == np.uint8 and train.example_shape == (28, 28, 1)
  assert train.num_classes == 10
  np.testing.assert_array_equal(np.bincount(train.labels, minlength=10), [6000] * 10)
  np.testing.assert_array_equal(np.bincount(test.labels, minlength=10), [1000] * 10)
  # The images are real (not blank), and the normalisation constants are this data's statistics.
  pixels = train.images[:10000].astype(np.float64)
  assert abs(pixels.mean() - train.normalization.mean[0]) < 1.0
  assert abs(pixels.std() - train.normalization.std[0]) < 1.0
  inputs, _ = data.DataStream(train, 100, seed=0).next_chunk(20)
  assert abs(inputs.mean()) < 0.05 and abs(inputs.std() - 1.0) < 0.05


def _write_idx(directory, split="train", *, count=3, rows=28, cols=28, image_magic=2051,
               label_magic=2049, label_count=None, cut_images=0, images=None):
  """Writes a small, valid-unless-told-otherwise pair of IDX .gz files."""
  rng = np.random.default_rng(0)
  if images is None:
    images = rng.integers(0, 256, (count, rows, cols), dtype=np.uint8)
  label_count = count if label_count is None else label_count
  labels = (np.arange(label_count) % 10).astype(np.uint8)
  image_bytes = struct.pack(">IIII", image_magic, count, rows, cols) + images.tobytes()
  if cut_images:
    image_bytes = image_bytes[:-cut_images]
  names = fashion_mnist.FILES[split]
  with gzip.open(os.path.join(directory, names[0]), "wb") as f:
    f.write(image_bytes)
  with gzip.open(os.path.join(directory, names[1]), "wb") as f:
    f.write(struct.pack(">II", label_magic, label_count) + labels.tobytes())
  return images, labels


def test_idx_reader_round_trips_small_files(tmp_path):
  train_images, train_labels = _write_idx(tmp_path, "train", count=5)
  test_images, _ = _write_idx(tmp_path, "test", count=2, images=np.arange(2 * 784, dtype=np.uint8)
                              .reshape(2, 28, 28))
  train, test = data.load("fashion_mnist_idx", data_dir=tmp_path)
  np.testing.assert_array_equal(train.images[..., 0], train_images)
  np.testing.assert_array_equal(train.labels, train_labels)
  # Row-major order: pixel (r, c) of image i is byte 784 i + 28 r + c.
  assert test.images[1, 2, 3, 0] == (784 + 2 * 28 + 3) % 256


def test_idx_missing_directory_says_how_to_install(tmp_path):
  with pytest.raises(data.DataError, match="apt-get install dataset-fashion-mnist") as info:
    data.load("fashion_mnist_idx", data_dir=tmp_path / "nowhere")
  assert isinstance(info.value, ValueError)
  assert "data_dir" in str(info.value) and "nowhere" in str(info.value)


def test_idx_missing_file_is_named(tmp_path):
  _write_idx(tmp_path, "train")  # No test files.
  with pytest.raises(data.DataError, match="t10k-images-idx3-ubyte.gz") as info:
    data.load("fashion_mnist_idx", data_dir=tmp_path)
  assert "apt-get install dataset-fashion-mnist" in str(info.value)


@pytest.mark.parametrize("kwargs, file_name, words", [
    (dict(image_magic=2049), "train-images-idx3-ubyte.gz", "magic number 2049"),
    (dict(label_magic=2051), "train-labels-idx1-ubyte.gz", "magic number 2051"),
    (dict(cut_images=100), "train-images-idx3-ubyte.gz", "truncated"),
    (dict(label_count=4), "train", "3 images but"),
    (dict(rows=27, cols=28), "train-images-idx3-ubyte.gz", "27x28"),
])
def test_idx_damaged_files_are_clear_errors(tmp_path, kwargs, file_name, words):
  _write_idx(tmp_path, "train", **kwargs)
  _write_idx(tmp_path, "test")
  with pytest.raises(data.DataError, match=words) as info:
    data.load("fashion_mnist_idx", data_dir=tmp_path)
  assert file_name in str(info.value)


def test_idx_cut_gzip_stream_is_named(tmp_path):
  _write_idx(tmp_path, "train")
  _write_idx(tmp_path, "test")
  path = tmp_path / fashion_mnist.FILES["train"][0]
  path.write_bytes(path.read_bytes()[:200])
  with pytest.raises(data.DataError, match="train-images-idx3-ubyte.gz.*gzip"):
    data.load("fashion_mnist_idx", data_dir=tmp_path)


# ---------------------------------------------------------------------------------------------
# DataStream: shapes, shuffling, exact resume.


def _image_source(num_examples=10, shape=(8, 8, 3)):
  """Distinct random images; label = example id, so streams can be checked by label."""
  images = np.random.default_rng(123).integers(0, 256, (num_examples, *shape), dtype=np.uint8)
  return data.ArraySource(images, np.arange(num_examples), num_examples, "toy",
                          normalization=data.Normalization((10.0, 20.0, 30.0), (2.0, 4.0, 8.0)))


def test_chunk_shapes_dtypes_and_normalisation():
  source = _image_source()
  inputs, labels = data.DataStream(source, batch_size=3, seed=0).next_chunk(2)
  assert inputs.shape == (2, 3, 8, 8, 3) and inputs.dtype == np.float32
  assert labels.shape == (2, 3) and labels.dtype == np.int32
  expected = (source.images[labels.reshape(-1)].astype(np.float32)
              - np.float32([10, 20, 30])) / np.float32([2, 4, 8])
  np.testing.assert_array_equal(inputs.reshape(6, 8, 8, 3), expected)
  # Batch size 1 keeps its axis.
  inputs, labels = data.DataStream(source, batch_size=1, seed=0).next_chunk(4)
  assert inputs.shape == (4, 1, 8, 8, 3) and labels.shape == (4, 1)


def test_every_example_once_per_epoch_and_reshuffled_each_epoch():
  source = _image_source(num_examples=12)
  # 5 does not divide 12: micro-batches straddle the epoch boundaries.
  stream = data.DataStream(source, batch_size=5, seed=7)
  _, labels = stream.next_chunk(12)  # 60 examples = 5 epochs.
  epochs = labels.reshape(5, 12)
  for order in epochs:
    np.testing.assert_array_equal(np.sort(order), np.arange(12))
  assert len({tuple(order) for order in epochs}) == 5, "each epoch must have its own order"
  np.testing.assert_array_equal(epochs[1], data.epoch_permutation(7, 1, 12))
  assert stream.get_state()["epoch"] == 5 and stream.get_state()["index_in_epoch"] == 0


def test_same_seed_same_stream_other_seed_other_stream():
  source = _image_source()
  aug = augment_lib.PadCropFlip(pad=2)
  first = data.DataStream(source, 2, seed=3, augment=aug).next_chunk(7)
  np.random.seed(99)  # The global RNG must play no part.
  random.seed(99)
  second = data.DataStream(source, 2, seed=3, augment=aug).next_chunk(7)
  other = data.DataStream(source, 2, seed=4, augment=aug).next_chunk(7)
  np.testing.assert_array_equal(first[0], second[0])
  np.testing.assert_array_equal(first[1], second[1])
  assert not np.array_equal(first[1], other[1])


def test_exact_resume_across_epoch_boundary_with_augmentation():
  source = _image_source(num_examples=10)
  aug = augment_lib.PadCropFlip(pad=2)
  reference = data.DataStream(source, batch_size=3, seed=5, augment=aug)
  before = reference.next_chunk(3)  # 9 examples: 1 short of the epoch's end.
  saved = json.loads(json.dumps(reference.get_state()))
  assert saved["epoch"] == 0 and saved["index_in_epoch"] == 9
  after = [reference.next_chunk(4) for _ in range(3)]  # Crosses into epochs 1, 2, 3, 4.
  assert reference.epoch == 4

  resumed = data.DataStream(source, batch_size=3, seed=5, augment=aug)
  resumed.set_state(saved)
  for expected in after:
    got = resumed.next_chunk(4)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
  assert resumed.get_state() == reference.get_state()

  # The position, not the chunking, decides the data: 1-tick chunks give the same stream.
  by_ticks = data.DataStream(source, batch_size=3, seed=5, augment=aug)
  by_ticks.set_state(saved)
  inputs = np.concatenate([by_ticks.next_chunk(1)[0] for _ in range(12)])
  np.testing.assert_array_equal(inputs, np.concatenate([chunk[0] for chunk in after]))
  # And the augmentation did something (else this test would not cover it).
  plain = data.DataStream(source, batch_size=3, seed=5)
  plain.set_state(saved)
  assert not np.array_equal(plain.next_chunk(4)[0], after[0][0])
  assert not np.array_equal(before[0][0], after[0][0][:3])


def test_set_state_refuses_other_run_or_malformed_state():
  source = _image_source(num_examples=10)
  stream = data.DataStream(source, batch_size=2, seed=1)
  state = stream.get_state()
  with pytest.raises(data.DataError, match="12 examples"):
    stream.set_state({**state, "num_examples": 12})
  with pytest.raises(data.DataError, match="seed 2"):
    stream.set_state({**state, "seed": 2})
  with pytest.raises(data.DataError, match="out of range"):
    stream.set_state({"epoch": 0, "index_in_epoch": 10})
  with pytest.raises(data.DataError, match="integer"):
    stream.set_state({"epoch": 0.5, "index_in_epoch": 1})
  with pytest.raises(data.DataError, match="index_in_epoch"):
    stream.set_state({"epoch": 0})
  # Values that went through an orbax/numpy checkpoint are accepted.
  stream.set_state({"epoch": np.int64(2), "index_in_epoch": np.array(3, np.int32)})
  assert (stream.epoch, stream.index_in_epoch) == (2, 3)


def test_eval_batches_cover_split_in_order_with_padding_mask():
  source = _image_source(num_examples=10)
  batches = list(data.eval_batches(source, 4))
  assert len(batches) == 3
  assert all(inputs.shape == (4, 8, 8, 3) and inputs.dtype == np.float32
             for inputs, _, _ in batches)
  labels = np.concatenate([labels for _, labels, _ in batches])
  masks = np.concatenate([mask for _, _, mask in batches])
  np.testing.assert_array_equal(labels[masks], np.arange(10))
  np.testing.assert_array_equal(masks, [True] * 10 + [False] * 2)
  np.testing.assert_array_equal(batches[-1][0][2:], 0.0)
  np.testing.assert_array_equal(batches[0][0], source.normalization(source.images[:4]))


# ---------------------------------------------------------------------------------------------
# Augmentations.


def test_cifar_pad_crop_flip_changes_images_and_keeps_shape():
  image = np.random.default_rng(0).integers(1, 256, (32, 32, 3), dtype=np.uint8)  # No zeros.
  crop_flip = augment_lib.PadCropFlip(pad=4)
  outputs = [crop_flip(image, np.random.default_rng(i)) for i in range(40)]
  assert all(out.shape == (32, 32, 3) and out.dtype == np.uint8 for out in outputs)
  assert sum(not np.array_equal(out, image) for out in outputs) >= 35

  # Flip only: every output is the image or its mirror, and both occur.
  flips = [augment_lib.PadCropFlip(pad=0)(image, np.random.default_rng(i)) for i in range(20)]
  mirrored = [np.array_equal(out, image[:, ::-1]) for out in flips]
  assert all(m or np.array_equal(out, image) for m, out in zip(mirrored, flips))
  assert 0 < sum(mirrored) < 20

  # Crop only: every output is a 32x32 window of the zero-padded image, at varying offsets.
  padded = np.pad(image, [(4, 4), (4, 4), (0, 0)])
  offsets = set()
  for i in range(40):
    out = augment_lib.PadCropFlip(pad=4, flip=False)(image, np.random.default_rng(i))
    matches = [(y, x) for y in range(9) for x in range(9)
               if np.array_equal(padded[y:y + 32, x:x + 32], out)]
    assert len(matches) == 1
    offsets.add(matches[0])
  assert len(offsets) > 10


def test_imagenet_crops():
  rng = np.random.default_rng(0)
  image = np.zeros((60, 90, 3), np.uint8)
  image[10:50, 25:65] = 255  # A bright central square; the centre crop sees only it.
  centre = augment_lib.center_crop_resize(image, 16, crop_fraction=0.5)
  assert centre.shape == (16, 16, 3) and centre.dtype == np.uint8
  assert centre.min() == 255
  gradient = np.broadcast_to(np.arange(90, dtype=np.uint8)[None, :, None], (60, 90, 3)).copy()
  crop = augment_lib.RandomResizedCropFlip(size=12)
  outputs = [crop(gradient, np.random.default_rng(i)) for i in range(10)]
  assert all(out.shape == (12, 12, 3) and out.dtype == np.uint8 for out in outputs)
  assert len({out.tobytes() for out in outputs}) == 10
  # Flipped crops of a left-to-right ramp run right to left.
  directions = {np.sign(int(out[0, -1, 0]) - int(out[0, 0, 0])) for out in outputs}
  assert directions == {-1, 1}
  grey = augment_lib.center_crop_resize(rng.integers(0, 256, (20, 30, 1), dtype=np.uint8), 8)
  assert grey.shape == (8, 8, 1)


# ---------------------------------------------------------------------------------------------
# tfds sources, faked by tfds.testing.mock_data (no TensorFlow, no files).


@pytest.fixture(scope="module")
def tfds():
  return pytest.importorskip("tensorflow_datasets")


@pytest.mark.parametrize("name, shape, num_classes, test_split", [
    ("cifar10", (32, 32, 3), 10, "test"),
    ("cifar100", (32, 32, 3), 100, "test"),
    ("fashion_mnist", (28, 28, 1), 10, "test"),
    ("imagenet2012", (24, 24, 3), 1000, "validation"),
])
def test_tfds_sources_with_mock_data(tfds, name, shape, num_classes, test_split):
  with tfds.testing.mock_data(num_examples=5, policy=tfds.testing.MockPolicy.USE_CODE):
    train, test = data.load(name, image_size=24 if name == "imagenet2012" else None)
    assert len(train) == 5 and len(test) == 5
    assert test.name == f"{name}:{test_split}"
    assert train.example_shape == shape and train.num_classes == num_classes
    stream = data.DataStream(train, batch_size=2, seed=0, augment=train.default_augment)
    inputs, labels = stream.next_chunk(4)  # 8 examples: crosses an epoch boundary.
    assert inputs.shape == (4, 2, *shape) and inputs.dtype == np.float32
    assert labels.dtype == np.int32 and labels.min() >= 0 and labels.max() < num_classes
    state = stream.get_state()
    expected = stream.next_chunk(3)
    stream.set_state(state)
    np.testing.assert_array_equal(stream.next_chunk(3)[0], expected[0])
    batches = list(data.eval_batches(test, 4))
    assert [mask.sum() for _, _, mask in batches] == [4, 1]
    assert batches[0][0].shape == (4, *shape)


def test_cifar_default_augmentation_on_mock_data(tfds):
  with tfds.testing.mock_data(num_examples=8, policy=tfds.testing.MockPolicy.USE_CODE):
    train, _ = data.load("cifar10")
    assert isinstance(train.default_augment, augment_lib.PadCropFlip)
    plain = data.DataStream(train, 4, seed=0).next_chunk(2)
    augmented = data.DataStream(train, 4, seed=0, augment=train.default_augment).next_chunk(2)
  np.testing.assert_array_equal(plain[1], augmented[1])  # Same examples in the same order...
  assert augmented[0].shape == plain[0].shape
  differs = [not np.array_equal(a, p) for a, p in zip(augmented[0].reshape(8, -1),
                                                     plain[0].reshape(8, -1))]
  assert sum(differs) >= 6  # ...but cropped and flipped.


@pytest.mark.parametrize("name", ["cifar10", "imagenet2012"])
def test_tfds_missing_data_set_without_downloads_fails_at_once(tfds, tmp_path, name):
  start = time.monotonic()
  with pytest.raises(data.DataError) as info:
    data.load(name, data_dir=tmp_path, download=False)
  assert time.monotonic() - start < 10, "must not wait for download retries"
  message = str(info.value)
  assert f"tfds build {name} --file_format=array_record" in message
  assert str(tmp_path) in message and "data_dir" in message and "not built" in message
  assert "download=False" in message
  assert ("downloads/manual" in message) == (name == "imagenet2012")
  assert not any(tmp_path.iterdir()), "nothing may be written or downloaded"


def test_tfds_missing_data_set_is_downloaded_and_a_failed_download_explained(
    tfds, tmp_path, monkeypatch):
  asked = []

  def download_and_prepare(builder, *args, **kwargs):
    # What a machine without internet sees: the host name does not resolve, after tfds has
    # made its temporary download and build directories.
    asked.append((builder.name, builder.data_dir))
    (tmp_path / "downloads" / "cs.toronto.edu_cifar10.tmp.1a2b").mkdir(parents=True)
    (tmp_path / "cifar10" / "3.0.2.incomplete7").mkdir(parents=True)
    raise ConnectionError("Failed to resolve 'storage.googleapis.com'")

  (tmp_path / "downloads" / "manual").mkdir(parents=True)  # the user's own: must stay
  (tmp_path / "mnist").mkdir()
  monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", download_and_prepare)
  with pytest.raises(data.DataError) as info:
    data.load("cifar10", data_dir=tmp_path)
  assert asked and asked[0][0] == "cifar10" and asked[0][1].startswith(str(tmp_path))
  left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  assert left == ["downloads", "downloads/manual", "mnist"], "the failed attempt left files"
  message = str(info.value)
  assert "downloading and building it here failed: ConnectionError: Failed to resolve" in message
  assert "tfds build cifar10 --file_format=array_record" in message and str(tmp_path) in message


def test_tfds_image_size_only_for_imagenet(tfds):
  with tfds.testing.mock_data(num_examples=2, policy=tfds.testing.MockPolicy.USE_CODE):
    with pytest.raises(data.DataError, match="image_size"):
      data.load("cifar10", image_size=64)
    assert data.load("cifar10", image_size=32)[0].example_shape == (32, 32, 3)
    assert data.load("imagenet2012")[0].example_shape == (224, 224, 3)


# ---------------------------------------------------------------------------------------------
# Generated and bundled data sets, and the registry.


def test_mnist1d_small_and_deterministic():
  numpy_state = np.random.get_state()
  train, test = data.load("mnist1d", num_samples=200, seed=1)
  assert np.array_equal(np.random.get_state()[1], numpy_state[1]), "global RNG was disturbed"
  assert len(train) == 160 and len(test) == 40
  assert train.example_shape == (40, 1) and train.images.dtype == np.float32
  assert set(np.unique(train.labels)) <= set(range(10)) and len(np.unique(train.labels)) >= 8
  again, _ = data.load("mnist1d", num_samples=200, seed=1)
  other, _ = data.load("mnist1d", num_samples=200, seed=2)
  np.testing.assert_array_equal(again.images, train.images)
  assert not np.array_equal(other.images, train.images)
  inputs, _ = data.DataStream(train, 8, seed=0).next_chunk(2)
  assert inputs.shape == (2, 8, 40, 1)


def test_digits_fixed_split():
  train, test = data.load("digits")
  assert len(train) == 1437 and len(test) == 360
  assert train.example_shape == (8, 8, 1) and train.images.dtype == np.uint8
  assert train.images.max() == 16
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  digits = load_digits()
  whole = np.concatenate([train.images, test.images]).reshape(1797, 64)
  labels = np.concatenate([train.labels, test.labels])
  rows = np.concatenate([whole, labels[:, None]], axis=1)
  original = np.concatenate([digits.data, digits.target[:, None]], axis=1).astype(np.int64)
  np.testing.assert_array_equal(np.unique(rows, axis=0), np.unique(original, axis=0))
  assert len(set(np.unique(test.labels))) == 10
  np.testing.assert_array_equal(data.load("digits")[1].images, test.images)


def test_digits_read_without_scikit_learn_are_its_loaders_in_its_order(monkeypatch):
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  from pipejax.data import digits as digits_lib  # pylint: disable=g-import-not-at-top
  table = digits_lib.bundled_table()
  assert table is not None  # the installed scikit-learn keeps the table where we look
  reference = load_digits()
  np.testing.assert_array_equal(table[:, :-1], reference.data)
  np.testing.assert_array_equal(table[:, -1], reference.target)
  # Where the table is not found, scikit-learn's loader gives the same splits.
  train, test = data.load("digits")
  monkeypatch.setattr(digits_lib, "bundled_table", lambda: None)
  train_again, test_again = data.load("digits")
  np.testing.assert_array_equal(train_again.images, train.images)
  np.testing.assert_array_equal(test_again.labels, test.labels)


def test_unknown_name_lists_known_ones():
  with pytest.raises(data.DataError, match="Unknown data set 'mnist'") as info:
    data.load("mnist")
  for name in data.NAMES:
    assert name in str(info.value)
  assert set(data.NAMES) == {"fashion_mnist_idx", "fashion_mnist", "cifar10", "cifar100",
                             "imagenet2012", "mnist1d", "digits", "fortunes"}
  with pytest.raises(data.DataError, match="image_size"):
    data.load("digits", image_size=28)


# ---------------------------------------------------------------------------------------------
# The fortunes corpus: what its directory may hold, and a split that each fortune decides alone.


def fortunes_dir(directory, topics=(("alpha", 2000), ("beta", 2000)), newline="\n"):
  """A fortunes directory of over 1 MB: topic files of numbered fortunes, and their indexes."""
  directory.mkdir()
  for name, count in topics:
    body = "".join(f"{name} fortune {k}:\n{'words ' * 50}\n%\n" for k in range(count))
    (directory / name).write_bytes(body.replace("\n", newline).encode())
    (directory / f"{name}.dat").write_bytes(b"\0" * 64)
  return directory


def fortunes_of(split: bytes) -> list[bytes]:
  return [f for f in split.split(text.SEPARATOR) if f]


def topics_of(split: bytes) -> set[bytes]:
  return {f.split(b" ")[0] for f in fortunes_of(split)}


@pytest.mark.parametrize("newline, bom", [("\r\n", False), ("\r", False), ("\r\n", True)])
def test_a_corpus_with_other_line_ends_splits_as_its_unix_copy(tmp_path, newline, bom):
  unix = text.split_fortunes(str(fortunes_dir(tmp_path / "unix")))
  corpus = fortunes_dir(tmp_path / "other", newline=newline)
  if bom:  # as Windows editors save UTF-8
    for name in ("alpha", "beta"):
      (corpus / name).write_bytes(b"\xef\xbb\xbf" + (corpus / name).read_bytes())
  other = text.split_fortunes(str(corpus))
  assert b"\r" not in other[0] + other[1]
  assert other == unix


def test_every_topic_with_two_fortunes_of_its_own_is_in_both_splits(tmp_path):
  small = [(f"small{k:02d}", 2 + k % 3) for k in range(40)]
  corpus = fortunes_dir(tmp_path / "f", topics=(("alpha", 2000), ("beta", 2000), *small,
                                                ("single", 1)))
  train, validation = text.split_fortunes(str(corpus))
  topics = {name.encode() for name, _ in small} | {b"alpha", b"beta"}
  assert topics <= topics_of(train) and topics <= topics_of(validation)
  held_out, trained = fortunes_of(validation), fortunes_of(train)
  assert len(held_out) + len(trained) == 4000 + sum(count for _, count in small) + 1
  assert not set(held_out) & set(trained)
  assert 0.08 < len(held_out) / (len(held_out) + len(trained)) < 0.12


def test_the_split_of_a_fortune_is_its_text_s_hash(tmp_path):
  train, validation = text.split_fortunes(str(fortunes_dir(tmp_path / "f")))
  held_out, trained = fortunes_of(validation), fortunes_of(train)
  assert all(text.held_out(f, 10) for f in held_out)  # the big topics need no help
  assert not any(text.held_out(f, 10) for f in trained)
  assert len(held_out) == sum(text.held_out(f"alpha fortune {k}:\n{'words ' * 50}".encode(), 10)
                              + text.held_out(f"beta fortune {k}:\n{'words ' * 50}".encode(), 10)
                              for k in range(2000))
  assert text.held_out(b"pipejax", 10) == (
      int.from_bytes(__import__("hashlib").sha256(b"pipejax").digest(), "big") % 10 == 0)


def test_stray_files_leave_the_split_of_the_corpus_alone(tmp_path, caplog):
  corpus = fortunes_dir(tmp_path / "f")
  before = text.split_fortunes(str(corpus))
  (corpus / ".DS_Store").write_bytes(b"\0\0\0\1Bud1" + bytes(range(256)))
  (corpus / ".notes").write_text("a note, not a fortune\n%\n")
  (corpus / "empty").write_text("")
  caplog.set_level(logging.WARNING)
  assert text.split_fortunes(str(corpus)) == before
  assert ".DS_Store" in caplog.text and ".notes" in caplog.text
  assert "empty holds no fortune" in caplog.text
  # A topic that sorts first brings its own fortunes and moves no other fortune.
  (corpus / "aardvark").write_text(
      "".join(f"aardvark fortune {k}: {'more ' * 30}\n%\n" for k in range(300)))
  train, validation = text.split_fortunes(str(corpus))
  assert set(fortunes_of(before[1])) <= set(fortunes_of(validation))
  assert set(fortunes_of(before[0])) <= set(fortunes_of(train))
  assert b"aardvark" in topics_of(train) and b"aardvark" in topics_of(validation)


def test_a_binary_file_in_the_corpus_is_refused_by_name(tmp_path):
  corpus = fortunes_dir(tmp_path / "f")
  (corpus / "gamma.gz").write_bytes(gzip.compress(b"gamma fortune\n%\n" * 100))
  with pytest.raises(data.DataError, match=r"gamma\.gz is not a text file \(a NUL byte at "
                     r"offset \d+\).*remove it"):
    text.split_fortunes(str(corpus))


def test_a_directory_of_hidden_files_only_says_what_it_skipped(tmp_path):
  corpus = tmp_path / "f"
  corpus.mkdir()
  (corpus / ".DS_Store").write_bytes(b"\0\1")
  (corpus / ".alpha.swp").write_text("alpha fortune\n%\n")
  with pytest.raises(data.DataError, match=r"no fortune files in .*f, only hidden files: "
                     r"\.DS_Store, \.alpha\.swp\): install"):
    text.split_fortunes(str(corpus))


def test_a_corpus_of_symbolic_links_is_read_through_them(tmp_path):
  original = fortunes_dir(tmp_path / "original")
  links = tmp_path / "links"
  links.mkdir()
  for entry in original.iterdir():
    os.symlink(entry, links / entry.name)
  os.symlink(original / "alpha", links / "alpha.u8")  # the same file twice: read once
  assert text.split_fortunes(str(links)) == text.split_fortunes(str(original))
  assert text.load_fortunes(links, context=32)[0].files == \
      text.load_fortunes(original, context=32)[0].files == {"alpha": 644890, "beta": 642890}
  os.symlink(tmp_path / "nowhere", links / "gamma")
  with pytest.raises(data.DataError, match=r"gamma is a symbolic link to .*nowhere, which does "
                     r"not exist.*remove the link"):
    text.split_fortunes(str(links))


def test_an_unreadable_corpus_file_is_named(tmp_path, monkeypatch):
  corpus = fortunes_dir(tmp_path / "f")
  locked = str(corpus / "beta")
  if os.geteuid() == 0:  # root reads every file: an open that fails as it does for other users
    real_open = builtins.open

    def open_as_another_user(path, *args, **kwargs):
      if os.fspath(path) == locked:
        raise PermissionError(13, "Permission denied", locked)
      return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_as_another_user)
  else:
    os.chmod(locked, 0)
  with pytest.raises(data.DataError, match=rf"The fortune file {re.escape(locked)} cannot be "
                     r"read \(.*Permission denied.*\): make it readable"):
    text.split_fortunes(str(corpus))


def test_a_corpus_directory_that_cannot_be_listed_or_is_a_file_is_named(tmp_path, monkeypatch):
  corpus = fortunes_dir(tmp_path / "f")
  with pytest.raises(data.DataError, match=rf"{re.escape(str(corpus / 'alpha'))} is a file, not "
                     r"a directory"):
    text.split_fortunes(str(corpus / "alpha"))
  listdir = os.listdir

  def listdir_as_another_user(path):
    if os.fspath(path) == str(corpus):
      raise PermissionError(13, "Permission denied", str(corpus))
    return listdir(path)

  monkeypatch.setattr(os, "listdir", listdir_as_another_user)
  with pytest.raises(data.DataError, match=rf"The fortunes directory {re.escape(str(corpus))} "
                     r"cannot be listed \(.*Permission denied.*\): make it readable"):
    text.split_fortunes(str(corpus))


def test_a_file_that_is_not_utf8_is_read_as_bytes_and_named(tmp_path, caplog):
  corpus = fortunes_dir(tmp_path / "f")
  (corpus / "latin").write_bytes("caf\u00e9 fortune: d\u00e9j\u00e0 vu\n%\n".encode("latin-1"))
  caplog.set_level(logging.WARNING)
  train, validation = text.split_fortunes(str(corpus))
  assert b"caf\xe9 fortune" in train + validation
  assert re.search(r"latin is not UTF-8 \(byte 3\)", caplog.text)


def test_files_without_separator_lines_are_refused_not_an_empty_split(tmp_path, caplog):
  corpus = tmp_path / "books"
  corpus.mkdir()
  for name in ("one", "two", "three"):
    (corpus / name).write_text(f"{name}: " + "a line of a book\n" * 25_000)
  caplog.set_level(logging.WARNING)
  with pytest.raises(data.DataError, match=r"3 fortunes in .*books leave no validation "
                     r"fortune.*lines holding only '%'"):
    data.load("fortunes", data_dir=str(corpus), context=32)
  assert re.search(r"books/one has no line holding only '%': its 425005 bytes are one fortune",
                   caplog.text)
