"""Fashion-MNIST from the IDX ``.gz`` files of the Debian package ``dataset-fashion-mnist``.

``apt-get install dataset-fashion-mnist`` puts the four files of Xiao et al. 2017 in
``/usr/share/datasets/fashion-mnist/``; any directory holding the same four files works. This is
the Fashion-MNIST that real runs use on machines without a data hub (docs/design.md §9); the tfds
``fashion_mnist`` reads the same files once built.

IDX format (big-endian): magic ``0x00000803`` (2051) for images followed by count, rows, columns,
or magic ``0x00000801`` (2049) for labels followed by count; then one unsigned byte per pixel or
label. Headers, counts and file lengths are checked, so a damaged file is an error that names it.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib

import numpy as np

from pipejax.data.errors import DataError
from pipejax.data.source import ArraySource, Normalization

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049
NUM_CLASSES = 10
# Mean and std of the 60000 training images, in pixel units (0.2860 and 0.3530 of 255).
NORMALIZATION = Normalization(mean=(72.94,), std=(90.02,))
CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
               "Sneaker", "Bag", "Ankle boot")


def _missing_message(what: str) -> str:
  return (f"Fashion-MNIST IDX data not found: {what}. Install the Debian package with "
          f"`apt-get install dataset-fashion-mnist` (it puts the four files in {DEFAULT_DIR}/), "
          "or point `data_dir` (--config.data_dir on the command line, or "
          "pipejax.data.load('fashion_mnist_idx', data_dir=...)) at a directory holding "
          f"{', '.join(FILES['train'] + FILES['test'])}.")


def _read_gz(path: str) -> bytes:
  try:
    with gzip.open(path, "rb") as f:
      return f.read()
  except (OSError, EOFError, zlib.error) as e:
    # gzip raises BadGzipFile (an OSError) for a wrong header and EOFError for a cut-off stream.
    raise DataError(f"Damaged Fashion-MNIST file {path}: it is not a complete gzip stream "
                    f"({type(e).__name__}: {e}). Reinstall it (`apt-get install --reinstall "
                    "dataset-fashion-mnist`) or replace the file.") from e


def read_idx_images(path: str) -> np.ndarray:
  """Reads an IDX image file (``.gz``) into a ``(n, rows, cols)`` uint8 array.

  Raises:
    DataError: naming ``path``, if the file is missing, not gzip, has a wrong magic number or
      its length does not match its header.
  """
  data = _read_gz(path)
  if len(data) < 16:
    raise DataError(f"Damaged Fashion-MNIST file {path}: {len(data)} bytes is shorter than the "
                    "16-byte IDX image header.")
  magic, count, rows, cols = struct.unpack(">IIII", data[:16])
  if magic != IMAGES_MAGIC:
    raise DataError(f"Damaged Fashion-MNIST file {path}: magic number {magic}, expected "
                    f"{IMAGES_MAGIC} for an IDX image file (is it a label file?).")
  expected = 16 + count * rows * cols
  if len(data) != expected:
    raise DataError(f"Damaged Fashion-MNIST file {path}: header says {count} images of "
                    f"{rows}x{cols} ({expected} bytes) but the file has {len(data)} bytes "
                    "(truncated or padded).")
  return np.frombuffer(data, np.uint8, offset=16).reshape(count, rows, cols)


def read_idx_labels(path: str) -> np.ndarray:
  """Reads an IDX label file (``.gz``) into a ``(n,)`` uint8 array.

  Raises:
    DataError: naming ``path``, as :func:`read_idx_images`.
  """
  data = _read_gz(path)
  if len(data) < 8:
    raise DataError(f"Damaged Fashion-MNIST file {path}: {len(data)} bytes is shorter than the "
                    "8-byte IDX label header.")
  magic, count = struct.unpack(">II", data[:8])
  if magic != LABELS_MAGIC:
    raise DataError(f"Damaged Fashion-MNIST file {path}: magic number {magic}, expected "
                    f"{LABELS_MAGIC} for an IDX label file (is it an image file?).")
  if len(data) != 8 + count:
    raise DataError(f"Damaged Fashion-MNIST file {path}: header says {count} labels but the "
                    f"file holds {len(data) - 8} (truncated or padded).")
  return np.frombuffer(data, np.uint8, offset=8)


def _load_split(data_dir: str, split: str) -> ArraySource:
  images_file, labels_file = (os.path.join(data_dir, name) for name in FILES[split])
  for path in (images_file, labels_file):
    if not os.path.isfile(path):
      raise DataError(_missing_message(f"no file {path}"))
  images = read_idx_images(images_file)
  labels = read_idx_labels(labels_file)
  if images.shape[1:] != (28, 28):
    raise DataError(f"Damaged Fashion-MNIST file {images_file}: images are "
                    f"{images.shape[1]}x{images.shape[2]}, expected 28x28.")
  if images.shape[0] != labels.shape[0]:
    raise DataError(f"Fashion-MNIST {split} files do not match: {images_file} has "
                    f"{images.shape[0]} images but {labels_file} has {labels.shape[0]} labels.")
  if labels.size and labels.max() >= NUM_CLASSES:
    raise DataError(f"Damaged Fashion-MNIST file {labels_file}: label {labels.max()} is not in "
                    f"0..{NUM_CLASSES - 1}.")
  return ArraySource(images[..., None], labels, NUM_CLASSES, f"fashion_mnist_idx:{split}",
                     normalization=NORMALIZATION)


def load_fashion_mnist_idx(data_dir: str | os.PathLike | None = None
                           ) -> tuple[ArraySource, ArraySource]:
  """Loads the train (60000) and test (10000) splits; examples are ``(28, 28, 1)`` uint8.

  Args:
    data_dir: Directory of the four IDX ``.gz`` files; default
      ``/usr/share/datasets/fashion-mnist``.

  Raises:
    DataError: if the directory or a file is missing (the message says how to install them) or
      a file is damaged (the message names it).
  """
  data_dir = os.fspath(data_dir) if data_dir is not None else DEFAULT_DIR
  if not os.path.isdir(data_dir):
    raise DataError(_missing_message(f"no directory {data_dir}"))
  return _load_split(data_dir, "train"), _load_split(data_dir, "test")
