"""Random-access sources of labelled examples, and the per-channel normalisation they carry.

A :class:`Source` is a finite, ordered, random-access collection: ``len(source)`` examples, each
read by its integer index. Random access (rather than a stream) is what makes the data position
of a training run a pair of ints (epoch, index in epoch), so a checkpoint can resume it exactly.

Examples are stored in their compact form (uint8 pixels for images) and turned into float32 only
per chunk, by :class:`Normalization`, so a data set costs one byte per pixel in memory.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Protocol, Sequence

import numpy as np

from pipejax.data.errors import DataError


@dataclasses.dataclass(frozen=True)
class Normalization:
  """Per-channel ``(x - mean) / std`` in float32, channels last.

  ``mean`` and ``std`` are in the units the examples are stored in (0..255 for uint8 images), one
  entry per channel (the last axis of an example).
  """

  mean: tuple[float, ...]
  std: tuple[float, ...]

  def __post_init__(self):
    if len(self.mean) != len(self.std) or not self.mean:
      raise DataError(f"Normalization needs one mean and one std per channel, got mean={self.mean} "
                      f"and std={self.std}.")
    if any(s <= 0 for s in self.std):
      raise DataError(f"Normalization std must be positive, got {self.std}.")

  @classmethod
  def identity(cls, num_channels: int) -> Normalization:
    """The normalisation that only converts to float32."""
    return cls(mean=(0.0,) * num_channels, std=(1.0,) * num_channels)

  def __call__(self, x: np.ndarray) -> np.ndarray:
    """Normalises ``x`` (any leading axes, channels last) to float32."""
    mean = np.asarray(self.mean, np.float32)
    std = np.asarray(self.std, np.float32)
    return (np.asarray(x, np.float32) - mean) / std


class Augment(Protocol):
  """Train-time augmentation of one example.

  ``rng`` is a generator owned by this example at this position of the run (see
  :class:`pipejax.data.DataStream`), so the same call gives the same result on resume. The input
  is the source's raw example (:meth:`Source.raw`, possibly of varying size); the output must
  have the source's ``example_shape`` and the raw example's dtype.
  """

  def __call__(self, example: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    ...


class Source(abc.ABC):
  """A finite random-access data set split.

  Attributes:
    name: Data set and split, for messages (e.g. ``"cifar10:train"``).
    num_classes: Labels are ints in ``[0, num_classes)``.
    label_shape: Shape of one example's label: ``()`` for a class, ``(T,)`` for per-token
      labels (:class:`pipejax.data.text.TextSource`).
    example_shape: Shape of one example as it leaves :meth:`take` or an augmentation, channels
      last (e.g. ``(32, 32, 3)``, ``(40, 1)``).
    normalization: Per-channel constants of this data set, applied per chunk.
    default_augment: The standard train-time augmentation of this data set (``None`` if none);
      :class:`pipejax.data.DataStream` applies it only when asked to.
  """

  name: str
  num_classes: int
  example_shape: tuple[int, ...]
  normalization: Normalization
  default_augment: Augment | None = None
  label_shape: tuple[int, ...] = ()

  @abc.abstractmethod
  def __len__(self) -> int:
    """Number of examples."""

  @abc.abstractmethod
  def raw(self, index: int) -> tuple[np.ndarray, int]:
    """The stored example at ``index`` (before :meth:`fit`; may vary in size) and its label."""

  def fit(self, example: np.ndarray) -> np.ndarray:
    """Deterministic (eval-time) preparation of a raw example to ``example_shape``.

    The identity for data sets whose examples all have one size; ImageNet resizes and crops.
    """
    return example

  def take(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Examples at ``indices`` prepared with :meth:`fit`, stacked, and their int32 labels."""
    examples, labels = [], []
    for index in np.asarray(indices, np.int64).reshape(-1):
      example, label = self.raw(int(index))
      examples.append(self.fit(example))
      labels.append(label)
    if not examples:
      return (np.zeros((0, *self.example_shape), np.uint8), np.zeros((0,), np.int32))
    return np.stack(examples), np.asarray(labels, np.int32)

  def __repr__(self):
    return (f"{type(self).__name__}(name={self.name!r}, len={len(self)}, "
            f"example_shape={self.example_shape}, num_classes={self.num_classes})")


class ArraySource(Source):
  """A split held in memory as one array of examples and one of labels.

  Args:
    images: ``(n, *example_shape)`` examples, channels last; uint8 for images (kept as is and
      normalised per chunk) or float.
    labels: ``(n,)`` integer labels in ``[0, num_classes)``.
    num_classes: Number of classes.
    name: Data set and split, for messages.
    normalization: Per-channel constants; default: none (only the conversion to float32).
    default_augment: The standard train-time augmentation of this data set, if any.

  Raises:
    DataError: if the arrays do not fit together or a label is out of range.
  """

  def __init__(self, images: np.ndarray, labels: np.ndarray, num_classes: int, name: str, *,
               normalization: Normalization | None = None,
               default_augment: Augment | None = None):
    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.ndim < 2:
      raise DataError(f"{name}: images must be (n, *example_shape) with a channel axis last, got "
                      f"shape {images.shape}.")
    if labels.shape != images.shape[:1]:
      raise DataError(f"{name}: {images.shape[0]} images but labels of shape {labels.shape}; "
                      "there must be one label per image.")
    if not np.issubdtype(labels.dtype, np.integer):
      raise DataError(f"{name}: labels must be integers, got dtype {labels.dtype}.")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
      raise DataError(f"{name}: labels must lie in [0, {num_classes}), found "
                      f"[{labels.min()}, {labels.max()}].")
    self.name = name
    self.num_classes = int(num_classes)
    self.example_shape = tuple(images.shape[1:])
    self.normalization = normalization or Normalization.identity(images.shape[-1])
    if len(self.normalization.mean) != images.shape[-1]:
      raise DataError(f"{name}: {len(self.normalization.mean)} normalisation channels for examples "
                      f"with {images.shape[-1]} channels (last axis of {self.example_shape}).")
    self.default_augment = default_augment
    # Read-only views: streams hand out slices, and nobody should edit a shared data set in place.
    self.images = images.view()
    self.images.flags.writeable = False
    self.labels = labels.astype(np.int32)
    self.labels.flags.writeable = False

  def __len__(self) -> int:
    return self.images.shape[0]

  def raw(self, index: int) -> tuple[np.ndarray, int]:
    return self.images[index], int(self.labels[index])

  def take(self, indices) -> tuple[np.ndarray, np.ndarray]:
    # One fancy-indexing gather instead of the per-example loop of the base class.
    indices = np.asarray(indices, np.int64).reshape(-1)
    return self.images[indices], self.labels[indices]


class Subset(Source):
  """The first ``size`` examples of another source (smoke runs, quick experiments)."""

  def __init__(self, source: Source, size: int):
    if not 1 <= size:
      raise DataError(f"A subset needs at least one example; got size={size}.")
    self.source = source
    self.size = min(int(size), len(source))
    self.name = f"{source.name}[:{self.size}]"
    self.num_classes = source.num_classes
    self.example_shape = source.example_shape
    self.normalization = source.normalization
    self.default_augment = source.default_augment
    self.label_shape = source.label_shape

  def __len__(self) -> int:
    return self.size

  def raw(self, index: int) -> tuple[np.ndarray, int]:
    if not 0 <= index < self.size:
      raise IndexError(index)
    return self.source.raw(index)

  def fit(self, example: np.ndarray) -> np.ndarray:
    return self.source.fit(example)

  def take(self, indices) -> tuple[np.ndarray, np.ndarray]:
    indices = np.asarray(indices, np.int64).reshape(-1)
    if indices.size and (indices.min() < 0 or indices.max() >= self.size):
      raise IndexError(f"index out of range for {self.name}")
    return self.source.take(indices)
