"""The pipeline engine: fine-grained Pipelined Backpropagation as a pure function over a pytree.

Timing (docs/design.md §2). Sample n enters stage 0 at tick n; stage s forwards it at tick n+s and
backwards it at tick n + 2(S-1) - s, so stage s applies D_s = 2(S-1-s) updates in between and keeps
the inputs of D_s + 1 samples in its delay line. A tick reads only what the previous tick wrote:

* stage s's input is the ``forward_out`` register of stage s-1 (stage 0's is the new micro-batch);
* the cotangent of stage s's output is the ``backward_out`` register of stage s+1 (the last stage
  meets the loss instead, in the same tick as its forward);
* the micro-batch to backward is the oldest entry of stage s's own delay line.

So every stage of a tick is independent of the others: the loop over stages could run them in
any order or on different devices (``pipejax.parallel.sharding`` does exactly that).

:class:`Pipeline` is the one local runner. What is static about the pipeline is
``pipejax.core.spec``'s; its initial state ``pipejax.core.initial``'s; one stage's forward,
backward and update ``pipejax.core.stage_maths``'; the routing between parts
``pipejax.core.parts``'; which stages stack ``pipejax.core.stackable``'s and the stacked state
``pipejax.core.stacked_layout``'s; what every runner writes once (``run``, ``drain``, ...)
``pipejax.core.runner.Runner``'s; the boundary checks ``pipejax.core.checks``'.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.core import accounting, checks, parts, stackable
from pipejax.core.initial import StateInit
from pipejax.core.runner import Runner
from pipejax.core.spec import PipelineSpec
from pipejax.core.stacked_layout import StackedLayout, StackedState
from pipejax.core.stage_maths import StageMaths, TickOptions
from pipejax.core.stages import Model
from pipejax.core.state import Batch, Packet, PipelineState, slots_full
from pipejax.methods import Method

PyTree = Any
State = PipelineState | StackedState


class Pipeline(Runner):
  """The local runner: a :class:`~pipejax.core.spec.PipelineSpec` ticked part by part on one
  device.

  Construction traces every stage abstractly (the spec), so a stage that does not fit the next
  one, S = 0 or an empty micro-batch is an error here, before anything runs. ``init``, ``tick``,
  ``run`` and ``drain`` are then pure functions of the state.

  A *part* is consecutive stages a tick advances as one (``pipejax.core.parts``). By default every
  stage is a part of its own and the state is the logical
  :class:`~pipejax.core.state.PipelineState`. With ``stack``, identical consecutive stages tick
  as one stacked part under ``vmap`` (docs/design.md §6.1): the same numbers in fewer operations
  per tick and a compile time that does not grow with the part's length, in the stacked layout
  (:class:`~pipejax.core.stacked_layout.StackedState`); :meth:`to_logical` and
  :meth:`from_logical` move between the two, so either resumes the other's checkpoints.

  Args:
    model, method, example_inputs, example_labels, track_weight_discrepancy: the
      :class:`~pipejax.core.spec.PipelineSpec`'s.
    stack: False: every stage a part of its own; True: identical consecutive stages stacked
      (:func:`pipejax.core.stackable.find_parts`; a pipeline with none stays stage by stage);
      or each part's ``(start, stop)`` stages, contiguous and covering every stage, a part of two
      or more stages stacked (its stages must be identical).
  """

  def __init__(self, model: Model, method: Method, example_inputs: PyTree,
               example_labels: PyTree, track_weight_discrepancy: bool = False,
               stack: bool | Sequence[tuple[int, int]] = False):
    spec = PipelineSpec(model, method, example_inputs, example_labels, track_weight_discrepancy)
    self._lay_out(spec, StateInit(spec), stack)

  def _lay_out(self, spec: PipelineSpec, initial: StateInit, stack) -> None:
    self.spec, self.initial, self.maths = spec, initial, StageMaths(spec)
    if stack is True:
      stack = stackable.find_parts(initial)
    elif stack is False or stack is None:
      stack = [(s, s + 1) for s in range(spec.num_stages)]
    self.part_spans = tuple((int(a), int(z)) for a, z in stack)
    checks.check_part_spans(self.part_spans, spec.num_stages)
    self.parts = parts.cut_parts(self.part_spans, spec.delays, 0, spec.num_stages)
    self._stacked = StackedLayout(initial, self.part_spans) if self.stacked else None
    self._logical = None if self.stacked else self
    self._jit_tick, self._jit_run, self._jit_run_full = self._compile()

  def restacked(self, stack: bool | Sequence[tuple[int, int]] = True) -> Pipeline:
    """This pipeline with its parts laid out anew (``stack`` as the constructor's): it shares
    this one's spec and compiled initial state, so no stage is traced again. ``restacked(False)``
    is the pipeline stage by stage, in the logical layout (itself when it stacks nothing)."""
    if stack is False and self._logical is not None:
      return self._logical
    other = object.__new__(type(self))
    other._lay_out(self.spec, self.initial, stack)
    if stack is False:
      self._logical = other
    return other

  # What every runner's user reads of the spec.

  @property
  def stacked(self) -> bool:
    """Whether any part is stacked (holds two or more stages)."""
    return any(part.stacked for part in self.parts)

  @property
  def model(self) -> Model:
    return self.spec.model

  @property
  def method(self) -> Method:
    return self.spec.method

  @property
  def example_inputs(self) -> PyTree:
    return self.spec.example_inputs

  @property
  def example_labels(self) -> PyTree:
    return self.spec.example_labels

  @property
  def num_stages(self) -> int:
    return self.spec.num_stages

  @property
  def delays(self) -> list[int]:
    return self.spec.delays

  @property
  def micro_batch_size(self) -> int:
    return self.spec.micro_batch_size

  # ------------------------------------------------------------------ state

  def init(self, rng: jax.Array, fill_value: float = 0.0) -> State:
    """A fresh pipeline: initial weights, optimizer states, empty delay lines and registers.

    Empty slots hold ``fill_value`` (floating leaves; integer leaves hold 0) and are flagged
    invalid. Tests fill them with NaN to prove that nothing empty ever reaches weights or metrics.
    Every layout starts from the same bits (:class:`~pipejax.core.initial.StateInit`). A state
    larger than the device's memory is refused before anything is allocated.
    """
    if self._stacked is not None:
      return self._stacked.init(rng, fill_value)
    return self.initial(rng, fill_value)

  @property
  def state_spec(self) -> PipelineState:
    """The abstract logical state (ShapeDtypeStructs): what ``to_logical`` gives."""
    return self.initial.state_spec

  @property
  def _layout_spec(self) -> State:
    return self.state_spec if self._stacked is None else self._stacked.state_spec

  def held_stash_bytes(self, state: State) -> int:
    """Bytes of stashed activations actually held in ``state``'s delay lines."""
    return accounting.held_stash_bytes(state.parts)

  def to_logical(self, state: State) -> PipelineState:
    """The logical state: ``state`` itself stage by stage, its stacked parts cut otherwise."""
    if self._stacked is None:
      checks.check_not_donated(state)
      return state
    self.check_state(state)
    return self._stacked.unstack(state)

  def from_logical(self, logical_state: PipelineState) -> State:
    if self._stacked is None:
      checks.check_not_donated(logical_state)
      return logical_state
    checks.check_state(logical_state, self.state_spec, self.num_stages)
    return self._stacked.jit_stack(logical_state)

  def check_state(self, state: State) -> None:
    """Refuses a state of another layout or pipeline, or one whose buffers a run consumed."""
    if self._stacked is not None and isinstance(state, PipelineState):
      raise checks.PipelineError(
          "This is a logical PipelineState; a Pipeline with stacked parts ticks the stacked "
          "state of its init(), or pipe.from_logical(state) of a logical one.")
    checks.check_state(state, self._layout_spec, self.num_stages)

  def every_slot_full(self, state: State) -> bool:
    """See :meth:`pipejax.core.runner.Runner.every_slot_full`."""
    checks.check_on_host("every_slot_full", state)
    checks.check_not_donated(state)
    return slots_full(state.parts)

  def host_params(self, state: State) -> list[PyTree]:
    """See :meth:`pipejax.core.runner.Runner.host_params`: a stacked part's rows cut on the
    host."""
    self.check_state(state)
    logical, by_part = self.state_spec, jax.device_get([p.params for p in state.parts])
    out = []
    for part, host in zip(self.parts, by_part):
      if not part.stacked:
        out.append(host)
        continue
      leaves = jax.tree.leaves(host)
      out.extend(jax.tree.unflatten(jax.tree.structure(logical.stages[s].params),
                                    [leaf[i] for leaf in leaves])
                 for i, s in enumerate(range(part.start, part.stop)))
    return out

  def weights_finite(self, state: State) -> np.ndarray:
    """See :meth:`pipejax.core.runner.Runner.weights_finite`."""
    self.check_state(state)
    return np.asarray(parts.parts_finite(self.parts, state.parts))

  # ------------------------------------------------------------------ one tick

  def _tick(self, state: State, batch: Batch, every_slot_full: bool = False):
    inbound = Packet(batch.inputs, batch.labels, jnp.asarray(batch.valid, bool), state.tick)
    new_parts, part_metrics = parts.advance_parts(
        self.maths, self.delays, self.parts, state.parts, inbound, None, state.tick, state.rng,
        TickOptions(every_slot_full=every_slot_full))
    return type(state)(new_parts, state.tick + 1, state.rng), parts.tick_metrics(part_metrics)

  def metric_shapes(self) -> dict:
    """ShapeDtypeStructs of one tick's metrics (what ``tick`` returns), computed abstractly."""
    batch = Batch(self.example_inputs, self.example_labels, jax.ShapeDtypeStruct((), bool))
    return jax.eval_shape(self._tick, self._layout_spec, batch)[1]


class StackedPipeline(Pipeline):
  """Replaced by ``pipeline.restacked(part_spans or True)``, or ``Pipeline(..., stack=True)``:
  stacking is an option of the one local runner, :class:`Pipeline`. Calling it returns that
  :class:`Pipeline`."""

  def __new__(cls, pipeline: Pipeline, part_spans=None) -> Pipeline:  # type: ignore[misc]
    warnings.warn("StackedPipeline(pipe, part_spans) is replaced by "
                  "pipe.restacked(part_spans or True), or Pipeline(..., stack=True): stacking is "
                  "an option of the one local runner.", DeprecationWarning, stacklevel=2)
    return pipeline.restacked(True if part_spans is None else part_spans)
