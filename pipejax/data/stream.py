"""The training stream of micro-batch chunks, with an exactly resumable position, and eval batches.

The pipeline engine runs many ticks per call of ``jax.lax.scan`` and consumes one micro-batch of
``b`` examples per tick, so :meth:`DataStream.next_chunk` hands out ``(ticks, b, *example_shape)``
float32 inputs and ``(ticks, b)`` int32 labels at once.

Everything random is a pure function of the seed and the position, never of a global RNG or of
how the examples were gathered into chunks:

* epoch ``e`` visits the examples in the order ``np.random.default_rng([PERM, seed, e])
  .permutation(n)``;
* the augmentation of the example at position ``i`` of epoch ``e`` draws from
  ``np.random.default_rng([AUG, seed, e, i])``

(``PERM`` and ``AUG`` are fixed 32-bit tags that keep the two families of generators apart). The
position is therefore the whole state: two ints, saved in the checkpoint by
:meth:`DataStream.get_state`, and restoring it gives bit-identical chunks whatever chunk sizes were
used before or after.

Several processes (hosts) split one stream without talking to each other: every process keeps the
same stream, advances it by the whole chunk, and reads only the *rows* of each micro-batch its own
devices consume (``next_chunk(ticks, rows=...)``). Row ``j`` of tick ``t`` of a chunk starting at
position ``p`` is the example at position ``p + t * b + j``, whichever process reads it. The
micro-batches are therefore the same for any number of processes, and the saved position (the
global one, equal on every process) resumes on any other number.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from pipejax.data.errors import DataError
from pipejax.data.source import Augment, Source

# Leading words of the seed sequences. SeedSequence pads short entropy with zeros, so
# [seed, e] and [seed, e, 0] would collide; distinct leading tags rule that out.
_PERM_TAG = 0x5045524D  # "PERM"
_AUG_TAG = 0x41554721  # "AUG!"
_UINT32 = 2**32


def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
  """The order in which epoch ``epoch`` visits the ``num_examples`` examples."""
  return np.random.default_rng([_PERM_TAG, seed, epoch]).permutation(num_examples)


def augment_rng(seed: int, epoch: int, index_in_epoch: int) -> np.random.Generator:
  """The generator of the augmentation at position ``index_in_epoch`` of epoch ``epoch``."""
  return np.random.default_rng([_AUG_TAG, seed, epoch, index_in_epoch])


def _state_int(state: Mapping, key: str) -> int:
  """Reads an integer from a saved state that may have passed through JSON or numpy."""
  if key not in state:
    raise DataError(f"Data-stream state {dict(state)} has no '{key}'; it must come from "
                    "DataStream.get_state().")
  value = np.asarray(state[key])
  if value.shape != () or value.dtype.kind not in "iu":
    raise DataError(f"Data-stream state '{key}' must be an integer, got {state[key]!r}.")
  return int(value)


class DataStream:
  """Shuffled, optionally augmented micro-batches of a source, in chunks of ticks.

  Args:
    source: The training split.
    batch_size: Micro-batch size ``b`` (examples per tick); 1 is allowed.
    seed: Seed of the shuffling and of the augmentation, in ``[0, 2**32)``.
    augment: Per-example augmentation (e.g. ``source.default_augment``); ``None`` for none,
      in which case examples are prepared by ``source.fit``.

  Example:
    >>> from pipejax import data
    >>> train, test = data.load("digits")
    >>> stream = DataStream(train, batch_size=4, seed=0)
    >>> inputs, labels = stream.next_chunk(16)
    >>> inputs.shape, inputs.dtype, labels.shape
    ((16, 4, 8, 8, 1), dtype('float32'), (16, 4))
    >>> stream.get_state()
    {'epoch': 0, 'index_in_epoch': 64, 'seed': 0, 'num_examples': 1437}
  """

  def __init__(self, source: Source, batch_size: int, seed: int, augment: Augment | None = None):
    if batch_size < 1:
      raise DataError(f"batch_size must be at least 1, got {batch_size}.")
    if not 0 <= seed < _UINT32:
      # Larger ints would span two seed words and could alias another (seed, epoch) pair.
      raise DataError(f"seed must lie in [0, 2**32), got {seed}.")
    if len(source) == 0:
      raise DataError(f"Source {source.name} is empty; there is nothing to train on.")
    self.source = source
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.augment = augment
    self._epoch = 0
    self._index_in_epoch = 0
    self._permutation_epoch = -1
    self._permutation = np.zeros((0,), np.int64)

  @property
  def epoch(self) -> int:
    """Epoch of the next example to be handed out."""
    return self._epoch

  @property
  def index_in_epoch(self) -> int:
    """Position within its epoch of the next example to be handed out."""
    return self._index_in_epoch

  def get_state(self) -> dict[str, int]:
    """The data position, as plain ints (JSON-serialisable) for the checkpoint.

    ``seed`` and ``num_examples`` ride along so that restoring into a stream over another data
    set or seed is an error rather than a silently different run.
    """
    return {"epoch": self._epoch, "index_in_epoch": self._index_in_epoch, "seed": self.seed,
            "num_examples": len(self.source)}

  def set_state(self, state: Mapping) -> None:
    """Moves to the position saved by :meth:`get_state`.

    Raises:
      DataError: if the state is malformed or was saved for another data set size or seed.
    """
    epoch = _state_int(state, "epoch")
    index = _state_int(state, "index_in_epoch")
    num_examples = len(self.source)
    if "num_examples" in state and _state_int(state, "num_examples") != num_examples:
      raise DataError(f"The data-stream state was saved for a split of {state['num_examples']} "
                      f"examples but {self.source.name} has {num_examples}; resuming would not "
                      "continue the same run. Point the run at the same data set as before.")
    if "seed" in state and _state_int(state, "seed") != self.seed:
      raise DataError(f"The data-stream state was saved with seed {state['seed']} but this stream "
                      f"has seed {self.seed}; resuming would not continue the same run.")
    if not (0 <= epoch < _UINT32 and 0 <= index < num_examples):
      raise DataError(f"Data-stream state out of range: epoch={epoch}, index_in_epoch={index} "
                      f"for {num_examples} examples.")
    self._epoch, self._index_in_epoch = epoch, index

  def _permutation_of(self, epoch: int) -> np.ndarray:
    # Cache one epoch: a chunk almost always lies within the current epoch.
    if self._permutation_epoch != epoch:
      self._permutation = epoch_permutation(self.seed, epoch, len(self.source))
      self._permutation_epoch = epoch
    return self._permutation

  def _advance(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Consumes ``count`` positions; returns each one's (epoch, position in epoch, example)."""
    num_examples = len(self.source)
    epochs, positions, indices = [], [], []
    while count > 0:
      take = min(count, num_examples - self._index_in_epoch)
      start = self._index_in_epoch
      epochs.append(np.full((take,), self._epoch, np.int64))
      positions.append(np.arange(start, start + take))
      indices.append(self._permutation_of(self._epoch)[start:start + take])
      count -= take
      self._index_in_epoch += take
      if self._index_in_epoch == num_examples:
        # Roll over at once so that the saved position is canonical.
        self._epoch += 1
        self._index_in_epoch = 0
    return np.concatenate(epochs), np.concatenate(positions), np.concatenate(indices)

  def next_chunk(self, num_ticks: int, rows=None) -> tuple[np.ndarray, np.ndarray]:
    """The next ``num_ticks`` micro-batches, crossing epoch boundaries seamlessly.

    Args:
      num_ticks: micro-batches to hand out (the stream advances by ``num_ticks * batch_size``).
      rows: the rows of each micro-batch to read (sorted, in ``[0, batch_size)``), for a
        process that feeds only part of every micro-batch; default all of them. The other rows'
        examples are skipped, not loaded.

    Returns:
      ``inputs`` of shape ``(num_ticks, len(rows), *example_shape)``, normalised float32, and
      ``labels`` of shape ``(num_ticks, len(rows), *label_shape)``, int32 (``len(rows)`` is
      ``batch_size`` by default; ``label_shape`` is the source's, ``()`` for classes).
    """
    if num_ticks < 1:
      raise DataError(f"num_ticks must be at least 1, got {num_ticks}.")
    chosen = np.arange(self.batch_size) if rows is None else np.asarray(rows, np.int64)
    if chosen.ndim != 1 or not len(chosen) or np.any(np.diff(chosen) <= 0) or \
        chosen[0] < 0 or chosen[-1] >= self.batch_size:
      raise DataError(f"rows must be increasing rows of a micro-batch of {self.batch_size}, "
                      f"i.e. in [0, {self.batch_size}); got {rows!r}.")
    epochs, positions, indices = (a.reshape(num_ticks, self.batch_size)[:, chosen].reshape(-1)
                                  for a in self._advance(num_ticks * self.batch_size))
    if self.augment is None:
      examples, labels = self.source.take(indices)
    else:
      examples, labels = self._augmented(epochs, positions, indices)
    shape = self.source.example_shape
    if examples.shape[1:] != shape:
      raise DataError(f"{self.source.name}: examples came out with shape {examples.shape[1:]}, "
                      f"expected {shape}; the augmentation must keep the example shape.")
    inputs = self.source.normalization(examples)
    return (inputs.reshape(num_ticks, len(chosen), *shape),
            labels.astype(np.int32).reshape(num_ticks, len(chosen), *labels.shape[1:]))

  def skip(self, num_ticks: int) -> None:
    """Advances past ``num_ticks`` micro-batches without loading them."""
    self._advance(num_ticks * self.batch_size)

  def _augmented(self, epochs, positions, indices) -> tuple[np.ndarray, np.ndarray]:
    examples, labels = [], []
    for epoch, position, index in zip(epochs, positions, indices):
      example, label = self.source.raw(int(index))
      examples.append(self.augment(example, augment_rng(self.seed, int(epoch), int(position))))
      labels.append(label)
    return np.stack(examples), np.asarray(labels, np.int32)


def eval_batches(source: Source, batch_size: int
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """All examples of ``source`` in order, in batches of exactly ``batch_size``.

  Every batch has the same shape, so a jitted eval step compiles once: the last batch is padded
  with zero inputs and label 0, and ``mask`` tells the real examples from the padding. Sum a
  metric over ``mask`` and divide by ``len(source)``.

  Yields:
    ``(inputs, labels, mask)``: ``(batch_size, *example_shape)`` normalised float32,
    ``(batch_size,)`` int32 and ``(batch_size,)`` bool.
  """
  if batch_size < 1:
    raise DataError(f"batch_size must be at least 1, got {batch_size}.")
  num_examples = len(source)
  for start in range(0, num_examples, batch_size):
    count = min(batch_size, num_examples - start)
    examples, labels = source.take(np.arange(start, start + count))
    inputs = source.normalization(examples)
    mask = np.zeros((batch_size,), bool)
    mask[:count] = True
    if count < batch_size:
      inputs = np.concatenate(
          [inputs, np.zeros((batch_size - count, *inputs.shape[1:]), np.float32)])
      labels = np.concatenate([labels, np.zeros((batch_size - count, *labels.shape[1:]),
                                                np.int32)])
    yield inputs, labels.astype(np.int32), mask
