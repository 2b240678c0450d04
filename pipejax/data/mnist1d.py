"""MNIST-1D (Greydanus 2020): 40-sample 1-D signals of the ten digits, generated locally.

We call ``mnist1d.data.make_dataset`` (never ``get_dataset``, which tries the network first).
Examples are float32 of shape ``(40, 1)``: length × channels, channels last like the image data
sets, so a 1-D convolution takes them as they are and an MLP flattens them. ``make_dataset``
already centres the signals and scales them to unit std, so normalisation is only the cast.

The generator is deterministic given ``seed`` (defaults: 5000 samples, 4000/1000 split, seed 42,
the published data set's settings). It reseeds numpy's and Python's global RNGs; we save and
restore both so loading data never disturbs anyone else's randomness.
"""

from __future__ import annotations

import random

import numpy as np

from pipejax.data.errors import DataError
from pipejax.data.source import ArraySource, Normalization

NUM_CLASSES = 10


def load_mnist1d(num_samples: int = 5000, seed: int = 42, train_split: float = 0.8
                 ) -> tuple[ArraySource, ArraySource]:
  """Generates MNIST-1D; examples are ``(40, 1)`` float32.

  Args:
    num_samples: Total examples (train + test); rounded down to a multiple of 10 (one share per
      class). 5000 takes ~1 s, 70000 ~12 s.
    seed: Generator seed (42 reproduces the published data set).
    train_split: Fraction of examples in the train split.

  Raises:
    DataError: if ``num_samples`` leaves a split empty.
  """
  from mnist1d import data as mnist1d_data  # pylint: disable=g-import-not-at-top

  num_samples = (int(num_samples) // NUM_CLASSES) * NUM_CLASSES
  num_train = int(num_samples * train_split)
  if num_train < 1 or num_train >= num_samples:
    raise DataError(f"MNIST-1D with num_samples={num_samples} and train_split={train_split} "
                    "leaves a split empty; use at least 20 samples and 0 < train_split < 1.")
  args = mnist1d_data.get_dataset_args()
  args.num_samples = num_samples
  args.seed = int(seed)
  args.train_split = train_split
  numpy_state, python_state = np.random.get_state(), random.getstate()
  try:
    dataset = mnist1d_data.make_dataset(args)
  finally:
    np.random.set_state(numpy_state)
    random.setstate(python_state)
  normalization = Normalization.identity(1)
  return (ArraySource(dataset["x"].astype(np.float32)[..., None], dataset["y"], NUM_CLASSES,
                      "mnist1d:train", normalization=normalization),
          ArraySource(dataset["x_test"].astype(np.float32)[..., None], dataset["y_test"],
                      NUM_CLASSES, "mnist1d:test", normalization=normalization))
