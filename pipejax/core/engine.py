"""The pipeline engine: fine-grained Pipelined Backpropagation as a pure function over a pytree.

Timing (docs/design.md §2). Sample n enters stage 0 at tick n; stage s forwards it at tick n+s and
backwards it at tick n + 2(S-1) - s, so stage s applies D_s = 2(S-1-s) updates in between and keeps
the inputs of D_s + 1 samples in its delay line. A tick reads only what the previous tick wrote:

* stage s's input is the ``forward_out`` register of stage s-1 (stage 0's is the new micro-batch);
* the cotangent of stage s's output is the ``backward_out`` register of stage s+1 (the last stage
  meets the loss instead, in the same tick as its forward);
* the micro-batch to backward is the oldest entry of stage s's own delay line.

So every stage of a tick is independent of the others: the loop over stages below could run them
in any order or on different devices (``pipejax.parallel.sharding`` does exactly that).

Each stage, each tick: forward the new input with ``method.forward_weights``; write the input
into slot ``t mod (D+1)`` of the delay line; read slot ``(t+1) mod (D+1)`` (written D ticks ago);
recompute the stage on it with ``method.backward_weights`` and take the VJP; update with the
stage's own optax transformation. Slots that hold no sample (fill, drain, synchronous bubbles) are
marked invalid, and an invalid backward leaves weights and optimizer state untouched: until stage
s has seen its first backward its updates are exactly zero, and its optimizer step count is the
number of samples it has learned from.

Stages with state (``pipejax.core.stages.Variables``: running statistics). The forward variables a
stage's forward saw travel with the input in the delay line, so the backward's recompute sees
exactly what the forward saw and computes the same function. The backward variables are read live
(as the last backward left them) and advanced by the increment the VJP returns. Within a tick
both passes read the variables as the previous tick left them: the forward's update and the
backward's increment concern different samples and disjoint variables, so their order does not
matter (the last stage's forward is its recompute: its forward variables come from there). An
empty slot updates no variable, like no weight. Stateless stages carry ``None``.

A stage's tick is three steps: :meth:`Pipeline.forward_step` (forward and the delay-line entry),
the delay line's write and read, and :meth:`Pipeline.backward_step` (recompute, VJP, update).
The stage's index and delay enter both as values, so a stack of identical stages runs the same two
steps under ``vmap``. What is static about the pipeline is ``pipejax.core.spec``'s; its initial
state ``pipejax.core.initial``'s; the routing between stages and stacks ``pipejax.core.parts``';
running it ``pipejax.core.runner.Runner``'s; the boundary checks
``pipejax.core.checks``'.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipejax.core import accounting, checks, parts
from pipejax.core.initial import StateInit
from pipejax.core.parts import TickOptions
from pipejax.core.runner import Runner
from pipejax.core.spec import PipelineSpec
from pipejax.core.stages import Model, Variables
from pipejax.core.state import (Batch, DelayLine, Forward, Packet, PipelineState, StageState,
                                slots_full)
from pipejax.methods import Method

PyTree = Any

def all_finite(tree) -> jax.Array:
  """Whether every floating leaf of ``tree`` is finite (True for a tree with none)."""
  leaves = [jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(tree)
            if jnp.issubdtype(a.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


@jax.jit
def _stages_finite(stages) -> jax.Array:
  """One flag per stage: are its weights and optimizer state finite."""
  return jnp.stack([all_finite((st.params, st.opt_state)) for st in stages])


def _relative_distance(a, b) -> jax.Array:
  """``|a - b| / |b|`` over every leaf of two weight trees (0 where ``b`` is all zeros)."""
  def squares(tree):
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))
  diff, norm = squares(jax.tree.map(jnp.subtract, a, b)), squares(b)
  return jnp.where(norm > 0, jnp.sqrt(diff / jnp.where(norm > 0, norm, 1.0)), 0.0)


def _advance_variables(variables: Variables, forwarded: PyTree, forward_valid, increment: PyTree,
                       backward_valid, every_slot_full: bool) -> Variables:
  """The variables after one tick: the forward's update and the backward's increment, each kept
  only when its pass worked on a real micro-batch."""
  forward = forwarded
  backward = jax.tree.map(jnp.add, variables.backward, increment)
  if not every_slot_full:
    forward = optax.tree_utils.tree_where(forward_valid, forward, variables.forward)
    backward = optax.tree_utils.tree_where(backward_valid, backward, variables.backward)
  return Variables(forward, backward)


class Pipeline(Runner):
  """The single-device runner: a :class:`~pipejax.core.spec.PipelineSpec` ticked stage by stage.

  Construction traces every stage abstractly (the spec), so a stage that does not fit the next
  one, S = 0 or an empty micro-batch is an error here, before anything runs. ``init``, ``tick``,
  ``run`` and ``drain`` are then pure functions of a :class:`PipelineState`.

  Args:
    model, method, example_inputs, example_labels, track_weight_discrepancy: the
      :class:`~pipejax.core.spec.PipelineSpec`'s.
  """

  def __init__(self, model: Model, method: Method, example_inputs: PyTree,
               example_labels: PyTree, track_weight_discrepancy: bool = False):
    self.spec = PipelineSpec(model, method, example_inputs, example_labels,
                             track_weight_discrepancy)
    self.initial = StateInit(self.spec)
    self._jit_tick, self._jit_run, self._jit_run_full = self._compile()

  # What every runner's user reads of the spec.

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

  @property
  def pipeline(self) -> Pipeline:
    return self

  # ------------------------------------------------------------------ state

  def init(self, rng: jax.Array, fill_value: float = 0.0) -> PipelineState:
    """A fresh pipeline: initial weights, optimizer states, empty delay lines and registers.

    Empty slots hold ``fill_value`` (floating leaves; integer leaves hold 0) and are flagged
    invalid. Tests fill them with NaN to prove that nothing empty ever reaches weights or metrics.
    Every runner starts from this one compiled program (:class:`~pipejax.core.initial.StateInit`),
    so every layout starts from the same bits. A state larger than the device's memory is refused
    before anything is allocated.
    """
    return self.initial(rng, fill_value)

  @property
  def state_spec(self) -> PipelineState:
    """The abstract state ``init`` makes (ShapeDtypeStructs)."""
    return self.initial.state_spec

  def held_stash_bytes(self, state: PipelineState) -> int:
    """Bytes of stashed activations actually held in ``state``'s delay lines."""
    return accounting.held_stash_bytes(state.stages)

  # ------------------------------------------------------------------ one tick

  @staticmethod
  def stage_key(rng, index, number):
    """The key of stage ``number``'s randomness for sample ``index`` (the same in both passes)."""
    return jax.random.fold_in(jax.random.fold_in(rng, index), number)

  def forward_step(self, s: int, st: StageState, inbound: Packet, rng: jax.Array,
                   number=None, delay=None) -> Forward:
    """Stage s forwards the new micro-batch; returns it and the entry its delay line stores.

    ``s`` picks the stage's code; ``number`` (default ``s``) and ``delay`` (default D_s) may be
    traced values, the same code then serving a stacked run of identical stages. The last stage
    forwards nothing here: its forward is its backward's recompute.
    """
    number, delay = (s if number is None else number), (self.delays[s] if delay is None else delay)
    variables = st.variables
    forward_params = self.method.forward_weights(st.params, st.opt_state, delay)
    out, ok, forwarded = None, jnp.array(True), None
    if s != self.num_stages - 1:
      y, forwarded = self.spec.model.stages[s].forward(
          forward_params, inbound.x, self.stage_key(rng, inbound.index, number), variables)
      out = Packet(y, inbound.labels, inbound.valid, inbound.index)
      ok = jnp.logical_or(~inbound.valid, all_finite(y))
    entry = st.delay_line.entry(inbound, forward_params,
                                None if variables is None else variables.forward)
    return Forward(forward_params, out, ok, forwarded, entry)

  def _gradients(self, s: int, st: StageState, oldest: DelayLine, backward_params, labels,
                 cotangent, key):
    """The VJP of stage s recomputed on its stashed input.

    Returns ``(grads, backward_out, increment, forwarded_variables, loss_metrics, ok)``: the
    weight gradient, the cotangent for stage s-1 (None for stage 0), the backward variables'
    increment and the last stage's forward variables (None when stateless), the loss's metrics
    (last stage only) and whether the backward stayed finite.
    """
    stage, variables = self.spec.model.stages[s], st.variables
    is_first, is_last = s == 0, s == self.num_stages - 1

    # A stateful stage also differentiates with respect to its backward variables: that
    # cotangent is their increment.
    def recompute(w, x):
      if variables is None:
        return stage.forward(w, x, key, None)
      params, backward_variables = w
      return stage.forward(params, x, key, Variables(oldest.variables, backward_variables))

    trainable = backward_params if variables is None else (backward_params, variables.backward)
    valid, backward_out, forwarded, metrics = oldest.valid, None, None, {}
    if is_last:
      def loss_of(w, x):
        y, forward_variables = recompute(w, x)
        loss, aux = self.spec.model.loss(y, labels)
        return loss, (aux, forward_variables)
      loss, vjp, (aux, forwarded) = jax.vjp(loss_of, trainable, oldest.x, has_aux=True)
      grads, backward_out = vjp(jnp.ones_like(loss))
      metrics = {"loss": jnp.where(valid, loss, 0.0),
                 **{k: jnp.where(valid, v, 0.0) for k, v in aux.items()},
                 "valid": valid, "sample": oldest.index}
      ok = jnp.logical_or(~valid, jnp.isfinite(loss))
    elif is_first:  # nobody needs d loss / d data: skip that product.
      _, vjp, _ = jax.vjp(lambda w: recompute(w, oldest.x), trainable, has_aux=True)
      (grads,) = vjp(cotangent)
      ok = jnp.array(True)
    else:
      _, vjp, _ = jax.vjp(recompute, trainable, oldest.x, has_aux=True)
      grads, backward_out = vjp(cotangent)
      ok = jnp.logical_or(~valid, all_finite(backward_out))
    if is_first:
      backward_out = None
    increment = None
    if variables is not None:
      grads, increment = grads
    return grads, backward_out, increment, forwarded, metrics, ok

  def _update(self, st: StageState, grads, backward_params, valid, delay, options: TickOptions):
    """The stage's own optax step; an empty slot changes nothing.

    The guard is a select: a ``lax.cond`` copies every weight and optimizer slot through its
    branches. NaN gradients from empty slots are never selected, so they need no scrubbing.
    """
    if options.reduce_grads is not None:
      grads = options.reduce_grads(grads)
    extra = {"gradient_params": backward_params} if self.method.pass_gradient_weights else {}
    updates, opt_state = self.method.optimizer(delay).update(grads, st.opt_state, st.params,
                                                             **extra)
    params = optax.apply_updates(st.params, updates)
    if not options.every_slot_full:
      params, opt_state = optax.tree_utils.tree_where(valid, (params, opt_state),
                                                      (st.params, st.opt_state))
    return params, opt_state

  def backward_step(self, s: int, st: StageState, forward: Forward, oldest: DelayLine,
                    inbound: Packet, cotangent: PyTree, rng: jax.Array, number=None, delay=None,
                    options: TickOptions = TickOptions()):
    """Stage s backwards the ``oldest`` entry of its delay line and updates.

    Returns the stage state without its delay line (``delay_line=None``: the caller writes its
    own) and the stage's metrics. ``number`` and ``delay`` as in :meth:`forward_step`.
    """
    number, delay = (s if number is None else number), (self.delays[s] if delay is None else delay)
    method, valid = self.method, oldest.valid
    backward_params = (oldest.weights if method.stash_forward_weights
                       else method.backward_weights(st.params, st.opt_state, delay))
    grads, backward_out, increment, forwarded, metrics, backward_ok = self._gradients(
        s, st, oldest, backward_params, inbound.labels, cotangent,
        self.stage_key(rng, oldest.index, number))
    if self.spec.track_weight_discrepancy:
      metrics["weight_discrepancy"] = jnp.where(
          valid, _relative_distance(oldest.weights, backward_params), 0.0)
    variables = st.variables
    if variables is not None:
      is_last = s == self.num_stages - 1
      variables = _advance_variables(
          variables, forwarded if is_last else forward.variables,
          valid if is_last else inbound.valid, increment, valid, options.every_slot_full)
    params, opt_state = self._update(st, grads, backward_params, valid, delay, options)
    # A NaN weight shows in the stage's own output within a tick; checking activations instead of
    # every weight keeps the tick's cost independent of the parameter count.
    metrics["finite"] = jnp.logical_and(forward.ok, backward_ok)
    return StageState(params, opt_state, None, forward.out, backward_out, variables), metrics

  def _tick(self, state: PipelineState, batch: Batch, every_slot_full: bool = False):
    inbound = Packet(batch.inputs, batch.labels, jnp.asarray(batch.valid, bool), state.tick)
    stages, part_metrics = parts.advance_parts(
        self, self.delays, parts.single_stages(0, self.num_stages), state.stages, inbound, None,
        state.tick, state.rng, TickOptions(every_slot_full=every_slot_full))
    return PipelineState(stages, state.tick + 1, state.rng), parts.tick_metrics(part_metrics)

  def metric_shapes(self) -> dict:
    """ShapeDtypeStructs of one tick's metrics (what ``tick`` returns), computed abstractly."""
    batch = Batch(self.example_inputs, self.example_labels, jax.ShapeDtypeStruct((), bool))
    return jax.eval_shape(self._tick, self.state_spec, batch)[1]

  def every_slot_full(self, state: PipelineState) -> bool:
    """See :meth:`pipejax.core.runner.Runner.every_slot_full`."""
    checks.check_on_host("every_slot_full", state)
    checks.check_not_donated(state)
    return slots_full(state.stages)

  def host_params(self, state: PipelineState) -> list[PyTree]:
    """See :meth:`pipejax.core.runner.Runner.host_params`."""
    self.check_state(state)
    return jax.device_get([st.params for st in state.stages])

  def weights_finite(self, state: PipelineState) -> np.ndarray:
    """See :meth:`pipejax.core.runner.Runner.weights_finite`."""
    self.check_state(state)
    return np.asarray(_stages_finite(state.stages))

  # ------------------------------------------------------------------ layout

  def to_logical(self, state: PipelineState) -> PipelineState:
    """The state itself: on one device the layout is the logical one."""
    checks.check_not_donated(state)
    return state

  def from_logical(self, logical_state: PipelineState) -> PipelineState:
    checks.check_not_donated(logical_state)
    return logical_state

  def check_state(self, state: PipelineState) -> None:
    """Refuses a state of another pipeline, or one whose buffers an earlier run() consumed."""
    checks.check_state(state, self.state_spec, self.num_stages)
