"""tfds splits (cifar10, cifar100, imagenet2012, fashion_mnist) as random-access sources.

We read with ``tfds.data_source`` rather than ``tfds.load``/``tf.data``:

* it needs no TensorFlow (1.2 GB we do not otherwise need; docs/design.md §9): it reads the built
  ``array_record`` files and decodes examples to numpy itself;
* it is random access, so the data position of a run is two ints (epoch, index in epoch) and a
  resumed run reads exactly the examples, in the same order, with the same augmentation, as the
  run that never stopped; a ``tf.data`` iterator's position is an opaque TF checkpoint instead.

A data set that is not built in ``data_dir`` is downloaded and built there (``download=True``,
the default), as tfds does, in the ``array_record`` format that random access needs. Where that
cannot work (no internet, or no TensorFlow, which tfds needs to build most data sets), it fails
at once (tfds' download retries are turned off: they wait minutes) with a :class:`DataError` that
says why and how to build the data set on another machine (``tfds build ...
--file_format=array_record``) and where to point ``data_dir``. ``download=False`` only reads.
Tests use ``tfds.testing.mock_data``, which fakes ``tfds.data_source`` without TensorFlow.

Preprocessing: CIFAR and Fashion-MNIST examples are stored uint8 at their native size; CIFAR's
``default_augment`` is pad-4 + random crop + flip. ImageNet images vary in size: eval takes the
central 87.5% square and resizes it to ``image_size`` (default 224); train augmentation is a
random-resized crop to ``image_size`` plus flip (:mod:`pipejax.data.augment`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np

from pipejax.data import augment as augment_lib
from pipejax.data.errors import DataError
from pipejax.data.source import Augment, Normalization, Source


@dataclasses.dataclass(frozen=True)
class _Spec:
  num_classes: int
  test_split: str
  native_shape: tuple[int, ...] | None  # None: images vary in size and are resized
  normalization: Normalization


def _per_255(values):
  return tuple(255.0 * v for v in values)


# Per-channel statistics of each training set, as published (fractions of 255).
SPECS = {
    "cifar10": _Spec(10, "test", (32, 32, 3), Normalization(
        mean=_per_255((0.4914, 0.4822, 0.4465)), std=_per_255((0.2470, 0.2435, 0.2616)))),
    "cifar100": _Spec(100, "test", (32, 32, 3), Normalization(
        mean=_per_255((0.5071, 0.4865, 0.4409)), std=_per_255((0.2673, 0.2564, 0.2762)))),
    "fashion_mnist": _Spec(10, "test", (28, 28, 1), Normalization(
        mean=_per_255((0.2860,)), std=_per_255((0.3530,)))),
    "imagenet2012": _Spec(1000, "validation", None, Normalization(
        mean=_per_255((0.485, 0.456, 0.406)), std=_per_255((0.229, 0.224, 0.225)))),
}
DEFAULT_IMAGENET_SIZE = 224


def _import_tfds():
  """Imports tfds with downloads made to fail at once instead of retrying for ~200 s.

  A machine without internet then learns so in about a second (the name does not resolve), not
  after minutes of retries.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.core.download import downloader  # pylint: disable=g-import-not-at-top

  downloader.MAX_RETRIES = 0
  return tfds


def _first_line(error: Exception) -> str:
  return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"


def _not_prepared_message(name: str, split: str, data_dir: str | None, error: Exception,
                          prepared: bool, download_error: Exception | None = None) -> str:
  where = data_dir or "tfds' default data_dir (~/tensorflow_datasets or $TFDS_DATA_DIR)"
  if prepared:
    reason = f"it is built there but cannot be read by index: {_first_line(error)}"
  elif download_error is not None:
    reason = ("it is not built there, and downloading and building it here failed: "
              f"{_first_line(download_error)}")
  else:
    reason = "it is not built there, and downloads are off (download=False)"
  manual = (" imagenet2012 cannot be downloaded by tfds: first put ILSVRC2012_img_train.tar and "
            "ILSVRC2012_img_val.tar from image-net.org in DIR/downloads/manual/."
            if name == "imagenet2012" else "")
  return (f"tfds data set '{name}' (split '{split}') is not available for random access in "
          f"{where} ({reason}). Where this machine cannot download (no internet) or build (tfds "
          "needs TensorFlow to build most data sets), build it on a machine with internet "
          f"(`pip install tensorflow-cpu tensorflow-datasets`, then `tfds build {name} "
          f"--file_format=array_record --data_dir=DIR`, or in Python "
          f"`tfds.builder('{name}', data_dir=DIR, file_format='array_record')"
          f".download_and_prepare()`), copy DIR here and point `data_dir` at it (the config "
          f"field: --config.data_dir=DIR, or pipejax.data.load('{name}', data_dir=DIR)). A data "
          "set built in the default TFRecord format must be rebuilt with "
          "--file_format=array_record."
          f"{manual}")


def _is_prepared(tfds, name: str, data_dir: str | None) -> bool:
  try:
    return bool(tfds.builder(name, data_dir=data_dir).is_prepared())
  except Exception:  # pylint: disable=broad-except
    return False  # Only picks the wording of an error message that is raised anyway.


class TfdsSource(Source):
  """One split of a built tfds data set, read by index with ``tfds.data_source``.

  Args:
    name: One of ``cifar10``, ``cifar100``, ``imagenet2012``, ``fashion_mnist``.
    split: A tfds split (``"train"``, ``"test"``, ``"validation"``, or a slice like
      ``"train[:90%]"``).
    data_dir: Where the data set is built; ``None`` for tfds' default.
    image_size: ImageNet only: side of the square examples (default 224).
    download: Download and build the data set in ``data_dir`` when it is not built there.

  Raises:
    DataError: if the name is not one of the four, ``image_size`` is given for another data
      set, or the data set is not built in ``data_dir`` and cannot be downloaded and built (the
      message says why, and how to build it elsewhere).
  """

  def __init__(self, name: str, split: str, *, data_dir: str | os.PathLike | None = None,
               image_size: int | None = None, download: bool = True):
    if name not in SPECS:
      raise DataError(f"No tfds source '{name}'; the known ones are {', '.join(sorted(SPECS))}.")
    spec = SPECS[name]
    if spec.native_shape is not None:
      if image_size is not None and image_size != spec.native_shape[0]:
        raise DataError(f"{name} images are {spec.native_shape[0]}x{spec.native_shape[1]}; "
                        f"image_size={image_size} is not supported (leave it unset).")
      self.example_shape = spec.native_shape
      self.image_size = None
      self.default_augment: Augment | None = (augment_lib.PadCropFlip(pad=4)
                                              if name.startswith("cifar") else None)
    else:
      self.image_size = int(image_size or DEFAULT_IMAGENET_SIZE)
      if self.image_size < 1:
        raise DataError(f"image_size must be positive, got {image_size}.")
      self.example_shape = (self.image_size, self.image_size, 3)
      self.default_augment = augment_lib.RandomResizedCropFlip(size=self.image_size)
    self.name = f"{name}:{split}"
    self.dataset_name = name
    self.num_classes = spec.num_classes
    self.normalization = spec.normalization
    data_dir = os.fspath(data_dir) if data_dir is not None else None
    tfds = _import_tfds()
    try:
      self._data = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except Exception as e:  # pylint: disable=broad-except
      # tfds reports a data set it cannot serve in several ways (a NotImplementedError about the
      # TFRecord format when nothing is built, FileNotFoundError, ValueError for a bad split);
      # all get the same advice, with the reason told apart by whether anything is built.
      prepared = _is_prepared(tfds, name, data_dir)
      if prepared or not download:
        raise DataError(_not_prepared_message(name, split, data_dir, e, prepared)) from e
      self._data = _download_and_open(tfds, name, split, data_dir, e)

  def __len__(self) -> int:
    return len(self._data)

  def raw(self, index: int) -> tuple[np.ndarray, int]:
    record = self._data[index]
    return np.asarray(record["image"], np.uint8), int(record["label"])

  def fit(self, example: np.ndarray) -> np.ndarray:
    if self.image_size is None:
      return example
    return augment_lib.center_crop_resize(example, self.image_size)


def _download_and_open(tfds, name: str, split: str, data_dir: str | None, read_error: Exception):
  root = os.path.expanduser(data_dir or tfds.core.constants.DATA_DIR)
  existing = _top_entries(root)
  try:
    tfds.builder(name, data_dir=data_dir, file_format="array_record").download_and_prepare()
    return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
  except Exception as e:  # pylint: disable=broad-except
    # No internet, no TensorFlow, a full disk, a manual download tfds cannot do: the message
    # names the cause and the way round it, and the attempt leaves nothing behind.
    _remove_new_entries(root, existing)
    raise DataError(_not_prepared_message(name, split, data_dir, read_error, False, e)) from e


def _top_entries(root: str) -> set[str] | None:
  """The paths one and two levels under ``root`` (tfds' ``downloads/...`` and ``NAME/VERSION``);
  None when ``root`` does not exist."""
  if not os.path.isdir(root):
    return None
  entries = set()
  for name in os.listdir(root):
    path = os.path.join(root, name)
    entries.add(path)
    if os.path.isdir(path):
      entries.update(os.path.join(path, child) for child in os.listdir(path))
  return entries


def _remove_new_entries(root: str, existing: set[str] | None) -> None:
  """Removes what a failed download created under ``root``; never what was there before."""
  if existing is None:
    shutil.rmtree(root, ignore_errors=True)
    return
  for path in sorted(_top_entries(root) - existing, key=len, reverse=True):
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
      os.remove(path)


def load_tfds(name: str, *, data_dir: str | os.PathLike | None = None,
              image_size: int | None = None,
              download: bool = True) -> tuple[TfdsSource, TfdsSource]:
  """The train split and the test split (``validation`` for ImageNet) of a tfds data set."""
  spec = SPECS.get(name)
  if spec is None:
    raise DataError(f"No tfds source '{name}'; the known ones are {', '.join(sorted(SPECS))}.")
  return tuple(TfdsSource(name, split, data_dir=data_dir, image_size=image_size,
                          download=download) for split in ("train", spec.test_split))
