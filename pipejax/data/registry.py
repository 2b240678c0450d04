"""``load(name)``: every data set pipejax knows, by name, as a (train, test) pair of sources."""

from __future__ import annotations

import os
import re
from typing import Callable

from pipejax.data.errors import DataError
from pipejax.data.source import Source


def _fashion_mnist_idx(data_dir, **kw):
  from pipejax.data import fashion_mnist  # pylint: disable=g-import-not-at-top
  return fashion_mnist.load_fashion_mnist_idx(data_dir, **kw)


def _tfds(name):
  def load_fn(data_dir, image_size=None, **kw):
    # Imported here: tfds is slow to import and only these four names need it.
    from pipejax.data import tfds_source  # pylint: disable=g-import-not-at-top
    return tfds_source.load_tfds(name, data_dir=data_dir, image_size=image_size, **kw)
  return load_fn


def _mnist1d(data_dir, **kw):
  del data_dir  # Generated in memory.
  from pipejax.data import mnist1d  # pylint: disable=g-import-not-at-top
  return mnist1d.load_mnist1d(**kw)


def _digits(data_dir, **kw):
  del data_dir  # Ships inside scikit-learn.
  from pipejax.data import digits  # pylint: disable=g-import-not-at-top
  return digits.load_digits(**kw)


def _fortunes(data_dir, **kw):
  from pipejax.data import text  # pylint: disable=g-import-not-at-top
  return text.load_fortunes(data_dir, **kw)


# name -> (loader, native image side or None). Only imagenet2012 takes a free image_size.
_LOADERS: dict[str, tuple[Callable, int | None]] = {
    "fashion_mnist_idx": (_fashion_mnist_idx, 28),
    "fashion_mnist": (_tfds("fashion_mnist"), 28),
    "cifar10": (_tfds("cifar10"), 32),
    "cifar100": (_tfds("cifar100"), 32),
    "imagenet2012": (_tfds("imagenet2012"), None),
    "mnist1d": (_mnist1d, None),
    "digits": (_digits, 8),
    "fortunes": (_fortunes, None),
}
NAMES = tuple(_LOADERS)
"""The names :func:`load` takes, one per data set."""
TFDS_NAMES = ("fashion_mnist", "cifar10", "cifar100", "imagenet2012")
AUGMENTED_NAMES = ("cifar10", "cifar100", "imagenet2012")
"""The data sets whose training split has a standard augmentation (its ``default_augment``)."""


def load(name: str, *, data_dir: str | os.PathLike | None = None, image_size: int | None = None,
         download: bool = True, **kw) -> tuple[Source, Source]:
  """Loads a data set as ``(train_source, test_source)``.

  Args:
    name: ``fashion_mnist_idx`` (Debian package files), ``fashion_mnist``, ``cifar10``,
      ``cifar100``, ``imagenet2012`` (tfds, built in ``data_dir``), ``mnist1d`` (generated) or
      ``digits`` (scikit-learn), or ``fortunes`` (byte-level text of the Debian package
      ``fortunes``, for language models; pipejax.data.text).
    data_dir: Where the files are: the IDX directory for ``fashion_mnist_idx`` (default
      ``/usr/share/datasets/fashion-mnist``), the tfds data_dir for tfds names (default: tfds'
      own); ignored by ``mnist1d`` and ``digits``, which need no files.
    image_size: Side of ImageNet examples (default 224). Other data sets keep their native size;
      passing it to them is an error unless it equals that size.
    download: tfds names: download and build a data set missing from ``data_dir`` (needs
      internet, and TensorFlow for most data sets); False: fail at once, saying how to build it.
    **kw: Loader options: ``num_samples``, ``seed``, ``train_split`` for ``mnist1d``;
      ``context``, ``validation_every`` for ``fortunes``.

  Raises:
    DataError: for an unknown name (the message lists the known ones), a missing or damaged
      data set (the message says how to get it), or an ``image_size`` the data set cannot take.
  """
  if name not in _LOADERS:
    raise DataError(f"Unknown data set '{name}'; the known ones are {', '.join(NAMES)}.")
  loader, native_size = _LOADERS[name]
  if name in TFDS_NAMES:
    kw["download"] = download
  if name == "imagenet2012":
    return loader(data_dir, image_size=image_size, **kw)
  if image_size is not None and image_size != native_size:
    raise DataError(f"Data set '{name}' has a fixed example size; image_size={image_size} only "
                    "applies to imagenet2012 (leave it unset).")
  return _call(name, loader, data_dir, kw)


def _call(name: str, loader: Callable, data_dir, kw: dict) -> tuple[Source, Source]:
  """``loader(data_dir, **kw)``, with an option the data set does not take said in one line."""
  try:
    return loader(data_dir, **kw)
  except TypeError as e:
    match = re.search(r"unexpected keyword argument '(\w+)'", str(e))
    if match is None or match.group(1) not in kw:
      raise
    raise DataError(f"Data set '{name}' takes no option {match.group(1)!r} (a keyword of load; "
                    "in a training config, a key of config.data_kwargs). load's docstring lists "
                    "each data set's options.") from None
