"""One stage's tick: forward, recompute, VJP and update, as pure functions of its state.

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

A stage's tick is three steps: :meth:`StageMaths.forward_step` (forward and the delay-line entry),
the delay line's write and read (``pipejax.core.parts``), and :meth:`StageMaths.backward_step`
(recompute, VJP, update). The stage's index and delay enter both as values, so a stacked part of
identical stages runs the same two steps under ``vmap``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from pipejax.core.spec import PipelineSpec
from pipejax.core.stages import Variables
from pipejax.core.state import DelayLine, Forward, Packet, StageState

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TickOptions:
  """How a tick advances its parts: fixed when the tick is traced, the same for every stage.

  Attributes:
    reduce_grads: combines the weight gradient across pipeline replicas (``lax.pmean`` over a
      ``data`` mesh axis); None on one replica.
    every_slot_full: promises that the micro-batch backwarded is a real one (see
      :meth:`~pipejax.core.runner.Runner.run`), which drops the guard that keeps empty slots
      from updating weights.
    delay_line_entries: return, in place of each delay line, the entry this tick writes into it
      (:meth:`~pipejax.core.state.DelayLine.write` of it at ``tick``, or
      :meth:`~pipejax.core.parts.Rings.write` for a stacked part's rows, gives the line): a mesh
      writes that one slot in place after its ``lax.switch``.
  """

  reduce_grads: Callable[[PyTree], PyTree] | None = None
  every_slot_full: bool = False
  delay_line_entries: bool = False


def all_finite(tree) -> jax.Array:
  """Whether every floating leaf of ``tree`` is finite (True for a tree with none)."""
  leaves = [jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(tree)
            if jnp.issubdtype(a.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def stage_key(rng, index, number):
  """The key of stage ``number``'s randomness for sample ``index`` (the same in both passes)."""
  return jax.random.fold_in(jax.random.fold_in(rng, index), number)


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


class StageMaths:
  """Each stage's forward, backward and update over a :class:`~pipejax.core.spec.PipelineSpec`:
  what every layout's tick runs, for one stage or, under ``vmap``, a stacked part's rows.

  ``s`` picks a stage's code; its ``number`` (default ``s``) and ``delay`` (default D_s) may be
  traced values, the same code then serving every row of a stacked part.
  """

  def __init__(self, spec: PipelineSpec):
    self.spec = spec

  stage_key = staticmethod(stage_key)

  def forward_step(self, s: int, st: StageState, inbound: Packet, rng: jax.Array,
                   number=None, delay=None) -> Forward:
    """Stage s forwards the new micro-batch; returns it and the entry its delay line stores.

    The last stage forwards nothing here: its forward is its backward's recompute.
    """
    number = s if number is None else number
    delay = self.spec.delays[s] if delay is None else delay
    variables = st.variables
    forward_params = self.spec.method.forward_weights(st.params, st.opt_state, delay)
    out, ok, forwarded = None, jnp.array(True), None
    if s != self.spec.num_stages - 1:
      y, forwarded = self.spec.model.stages[s].forward(
          forward_params, inbound.x, stage_key(rng, inbound.index, number), variables)
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
    is_first, is_last = s == 0, s == self.spec.num_stages - 1

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
    method = self.spec.method
    extra = {"gradient_params": backward_params} if method.pass_gradient_weights else {}
    updates, opt_state = method.optimizer(delay).update(grads, st.opt_state, st.params, **extra)
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
    own) and the stage's metrics.
    """
    number = s if number is None else number
    delay = self.spec.delays[s] if delay is None else delay
    method, valid = self.spec.method, oldest.valid
    backward_params = (oldest.weights if method.stash_forward_weights
                       else method.backward_weights(st.params, st.opt_state, delay))
    grads, backward_out, increment, forwarded, metrics, backward_ok = self._gradients(
        s, st, oldest, backward_params, inbound.labels, cotangent,
        stage_key(rng, oldest.index, number))
    if self.spec.track_weight_discrepancy:
      metrics["weight_discrepancy"] = jnp.where(
          valid, _relative_distance(oldest.weights, backward_params), 0.0)
    variables = st.variables
    if variables is not None:
      is_last = s == self.spec.num_stages - 1
      variables = _advance_variables(
          variables, forwarded if is_last else forward.variables,
          valid if is_last else inbound.valid, increment, valid, options.every_slot_full)
    params, opt_state = self._update(st, grads, backward_params, valid, delay, options)
    # A NaN weight shows in the stage's own output within a tick; checking activations instead of
    # every weight keeps the tick's cost independent of the parameter count.
    metrics["finite"] = jnp.logical_and(forward.ok, backward_ok)
    return StageState(params, opt_state, None, forward.out, backward_out, variables), metrics
