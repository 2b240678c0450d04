"""The one interface of a pipeline runner: what training code calls, whatever the layout.

Three runners implement it: :class:`pipejax.engine.Pipeline` (one device, stage by stage),
:class:`pipejax.stacking.StackedPipeline` (runs of identical stages as stacked groups) and
:class:`pipejax.sharding.ShardedPipeline` (over a device mesh). Each keeps the state in a layout
of its own; :meth:`Runner.to_logical` gives the device-independent
:class:`~pipejax.engine.PipelineState` that checkpoints hold, so any runner resumes any other's.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np

from pipejax import accounting, checks

if TYPE_CHECKING:
  from pipejax.engine import Pipeline, PipelineState

PyTree = Any
State = Any  # a runner's state in its own layout


class Runner(Protocol):
  """A pipeline runner. ``pipeline`` is the single-device :class:`~pipejax.engine.Pipeline` with
  the model, the method and the micro-batch shape; the runner advances its state.

  Metrics (of :meth:`tick`, and of :meth:`run` stacked along the time axis): ``loss`` and the
  loss's own metrics (e.g. ``accuracy``) of the sample that met the loss this tick, ``valid``
  (False while the pipeline fills), ``sample`` (its index) and ``finite`` (one flag per stage).
  """

  pipeline: Pipeline

  @abc.abstractmethod
  def init(self, rng: jax.Array, fill_value: float = 0.0) -> State:
    """A fresh state in the runner's layout: the same numbers as ``pipeline.init(rng)``."""

  @abc.abstractmethod
  def run(self, state: State, inputs, labels, valid=None) -> tuple[State, dict]:
    """Advances ``T`` ticks; inputs and labels have a leading time axis of size T.

    The state is donated: do not use the ``state`` passed in afterwards. ``valid`` (bool per
    tick; default all True) feeds empty slots where False (drain, synchronous bubbles).
    """

  @abc.abstractmethod
  def tick(self, state: State, inputs, labels, valid=True) -> tuple[State, dict]:
    """One tick: stage 0 takes micro-batch ``(inputs, labels)``; metrics without a time axis."""

  @abc.abstractmethod
  def to_logical(self, state: State) -> PipelineState:
    """The device-independent :class:`~pipejax.engine.PipelineState` (what checkpoints hold)."""

  @abc.abstractmethod
  def from_logical(self, logical_state: PipelineState) -> State:
    """A logical state laid out in the runner's layout."""

  @abc.abstractmethod
  def every_slot_full(self, state: State) -> bool:
    """True when every delay-line slot and forward register holds a real micro-batch.

    Then, if every micro-batch fed next is real too, every backward of the coming ticks is real:
    it reads either a slot that is full now or one written from the new micro-batches.
    """

  def drain(self, state: State) -> tuple[State, dict | None]:
    """Finishes every backward in flight by feeding 2(S-1) empty ticks; ``(state, metrics)``."""
    pipeline = self.pipeline
    ticks = accounting.fill_ticks(pipeline.num_stages)
    if ticks == 0:
      return state, None
    empty = lambda spec: np.zeros((ticks,) + spec.shape, spec.dtype)
    return self.run(state, jax.tree.map(empty, pipeline.example_inputs),
                    jax.tree.map(empty, pipeline.example_labels), np.zeros((ticks,), bool))

  def schedule(self, inputs, labels) -> tuple[PyTree, PyTree, np.ndarray]:
    """Lays a stream of K micro-batches (leading axis K) onto ticks for this method.

    Asynchronous methods take one micro-batch per tick. The synchronous mode feeds groups of M
    followed by 2(S-1) empty ticks (fill and drain): returns (inputs, labels, valid) per tick.
    """
    count = checks.stream_length(inputs, labels)
    m = self.pipeline.method.micro_batches_per_step
    if m is None:
      return inputs, labels, np.ones((count,), bool)
    checks.check_whole_groups(count, m)
    gap = accounting.bubble_ticks(self.pipeline.num_stages, m)
    groups = count // m

    def spread(a):
      a = np.asarray(a).reshape((groups, m) + a.shape[1:])
      pad = np.zeros((groups, gap) + a.shape[2:], a.dtype)
      return np.concatenate([a, pad], axis=1).reshape((groups * (m + gap),) + a.shape[2:])

    valid = spread(np.ones((count,), bool))
    return jax.tree.map(spread, inputs), jax.tree.map(spread, labels), valid
