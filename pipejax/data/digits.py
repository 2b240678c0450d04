"""scikit-learn's bundled handwritten digits (1797 8×8 images, 10 classes), for the smallest runs.

No download: the data ships inside scikit-learn. Pixels are the dataset's integer counts 0..16,
stored as uint8 ``(8, 8, 1)``. The train/test split is fixed (a permutation seeded with 0, the
last 360 examples, 20%, for test), so accuracies are comparable between runs and machines.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from pipejax.data.source import ArraySource, Normalization

NUM_TEST = 360
SPLIT_SEED = 0
# Mean and std of all 1797 images (pixel counts 0..16).
NORMALIZATION = Normalization(mean=(4.884,), std=(6.017,))


def load_digits() -> tuple[ArraySource, ArraySource]:
  """The fixed train (1437) and test (360) splits; examples are ``(8, 8, 1)`` uint8 in 0..16."""
  images, labels = _images_and_labels()
  images = images.astype(np.uint8)[..., None]
  labels = labels.astype(np.int32)
  order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
  train, test = order[:-NUM_TEST], order[-NUM_TEST:]
  return (ArraySource(images[train], labels[train], 10, "digits:train",
                      normalization=NORMALIZATION),
          ArraySource(images[test], labels[test], 10, "digits:test", normalization=NORMALIZATION))


def _images_and_labels() -> tuple[np.ndarray, np.ndarray]:
  """scikit-learn's ``load_digits()`` images and targets.

  Read straight from the table it ships where it is found: importing scikit-learn takes about
  1.5 s of a 2-core CPU (most of it scipy.stats), numpy reads the table in milliseconds.
  Elsewhere, its loader.
  """
  table = bundled_table()
  if table is None:
    from sklearn import datasets  # pylint: disable=g-import-not-at-top  (slow import)
    digits = datasets.load_digits()
    return digits.images, digits.target
  return table[:, :-1].reshape(-1, 8, 8), table[:, -1]


def bundled_table() -> np.ndarray | None:
  """The rows of scikit-learn's ``datasets/data/digits.csv.gz`` (64 pixels, then the class),
  found without importing scikit-learn; None where it is not there."""
  spec = importlib.util.find_spec("sklearn")
  for folder in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
    if os.path.isfile(path):
      return np.loadtxt(path, delimiter=",")
  return None
