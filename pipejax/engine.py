"""The pipeline engine: fine-grained Pipelined Backpropagation as a pure function over a pytree.

Timing (docs/design.md §2). Sample n enters stage 0 at tick n; stage s forwards it at tick n+s and
backwards it at tick n + 2(S-1) - s, so stage s applies D_s = 2(S-1-s) updates in between and keeps
the inputs of D_s + 1 samples in its delay line. A tick reads only what the previous tick wrote:

* stage s's input is the ``forward_out`` register of stage s-1 (stage 0's is the new micro-batch);
* the cotangent of stage s's output is the ``backward_out`` register of stage s+1 (the last stage
  meets the loss instead, in the same tick as its forward);
* the micro-batch to backward is the oldest entry of stage s's own delay line.

So every stage of a tick is independent of the others: the loop over stages below could run them
in any order or on different devices (``pipejax.sharding`` does exactly that).

Each stage, each tick: forward the new input with ``method.forward_weights``; write the input
into slot ``t mod (D+1)`` of the delay line; read slot ``(t+1) mod (D+1)`` (written D ticks ago);
recompute the stage on it with ``method.backward_weights`` and take the VJP; update with the
stage's own optax transformation. Slots that hold no sample (fill, drain, synchronous bubbles) are
marked invalid, and an invalid backward leaves weights and optimizer state untouched: until stage
s has seen its first backward its updates are exactly zero, and its optimizer step count is the
number of samples it has learned from.

Stages with state (``pipejax.stages.Variables``: running statistics). The forward variables a
stage's forward saw travel with the input in the delay line, so the backward's recompute sees
exactly what the forward saw and computes the same function. The backward variables are read live
(as the last backward left them) and advanced by the increment the VJP returns. Within a tick
both passes read the variables as the previous tick left them: the forward's update and the
backward's increment concern different samples and disjoint variables, so their order does not
matter (the last stage's forward is its recompute: its forward variables come from there). An
empty slot updates no variable, like no weight. Stateless stages carry ``None`` and run the same
computation as before stages had state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipejax import accounting
from pipejax.methods import Method
from pipejax.stages import Model, Variables, softmax_cross_entropy

PyTree = Any


class PipelineError(ValueError):
  """Bad input at the pipeline's boundary; the message says what is wrong and how to fix it."""


class Packet(NamedTuple):
  """A micro-batch in flight between stages: activations and what travels with them."""

  x: PyTree
  labels: PyTree
  valid: jax.Array  # bool[]: False for the empty slots of fill, drain and synchronous bubbles.
  index: jax.Array  # int32[]: tick at which the sample entered; seeds its per-stage randomness.


class DelayLine(NamedTuple):
  """A ring buffer of the D_s + 1 inputs (and, for PipeDream, weights) a stage holds in flight.

  Slot ``t mod (D_s + 1)`` is written at tick t and read back D_s ticks later, as slot
  ``(t + 1) mod (D_s + 1)`` of tick t + D_s (the same slot when D_s = 0).
  """

  x: PyTree  # leaves of shape (D_s + 1, b, ...)
  valid: jax.Array  # (D_s + 1,) bool
  index: jax.Array  # (D_s + 1,) int32
  weights: PyTree  # (D_s + 1, ...) weight copies for weight stashing, else None
  variables: PyTree = None  # (D_s + 1, ...) the forward variables each forward saw; None: stateless

  @property
  def slots(self) -> int:
    return self.valid.shape[0]

  def entry(self, packet: Packet, weights: PyTree = None, variables: PyTree = None) -> DelayLine:
    """What one tick stores: the packet's input, flag and index, and the weights and variables
    its forward used where this line keeps them, as single leaves (no slot axis)."""
    as_stored = lambda line, value: None if line is None else jax.tree.map(
        lambda b, a: jnp.asarray(a, b.dtype), line, value)
    return DelayLine(as_stored(self.x, packet.x), as_stored(self.valid, packet.valid),
                     as_stored(self.index, packet.index), as_stored(self.weights, weights),
                     as_stored(self.variables, variables))

  def write(self, tick, entry: DelayLine) -> DelayLine:
    """Stores ``entry`` in slot ``tick mod (D_s + 1)``.

    ``dynamic_update_index_in_dim`` writes the slot in place; ``.at[slot].set`` would compile to a
    scatter that also reads the old slot (to guard against an out-of-range index).
    """
    slot = tick % self.slots
    return jax.tree.map(lambda b, a: jax.lax.dynamic_update_index_in_dim(b, a, slot, 0),
                        self, entry)

  def read(self, tick, entry: DelayLine) -> DelayLine:
    """The entry written D_s ticks before ``tick``, when this tick writes ``entry``.

    It is read from the line as it is before this tick's write (slot ``(t + 1) mod (D_s + 1)`` is
    not the slot written; with D_s = 0 the entry read is ``entry`` itself), so no read depends on
    the write. On a mesh, a stage's code runs inside a ``lax.switch`` whose results XLA cannot
    write into its operands; there the switch returns only the entry and the line is written
    after it (``pipejax.sharding``).
    """
    if self.slots == 1:
      return entry
    slot = (tick + 1) % self.slots
    return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, slot, 0, keepdims=False), self)


class StageState(NamedTuple):
  params: PyTree
  opt_state: PyTree
  delay_line: DelayLine
  forward_out: Packet | None  # what this stage forwarded last tick (None for the last stage)
  backward_out: PyTree | None  # d loss / d input from last tick (None for stage 0)
  variables: Variables | None = None  # the stage's non-trainable state (None: stateless)


class PipelineState(NamedTuple):
  stages: tuple[StageState, ...]
  tick: jax.Array  # int32: ticks done so far; the next micro-batch is sample number `tick`.
  rng: jax.Array  # uint32 key; per-sample, per-stage keys are folded from it.


class Batch(NamedTuple):
  """One tick's micro-batch (or, with a leading time axis, many ticks' worth)."""

  inputs: PyTree  # (b, ...) per tick
  labels: PyTree  # (b, ...) per tick
  valid: jax.Array  # bool per tick: False feeds an empty slot (drain, bubbles)


def jit(fn, **kwargs):
  """``jax.jit`` with the compiler options every pipeline program is built with.

  On a CPU, XLA's default copy insertion copies every loop-carried weight whose old value is read
  by work the update does not depend on (the forward, the input gradient, a weight stash): two
  extra passes over the weights per tick, about a fifth of PB's tick at micro-batch 1 (see
  docs/performance.md). Region-based copy insertion sees that those reads end before the in-place
  update and keeps no copy. It changes which buffers are copied, never a value. On a GPU the same
  analysis removed 11 of the 109 kernels of an 8-stage tick (docs/performance.md §5).
  """
  option = _REGION_ANALYSIS_OPTION.get(jax.default_backend())
  if option:
    kwargs.setdefault("compiler_options", {option: True})
  return jax.jit(fn, **kwargs)


_REGION_ANALYSIS_OPTION = {"cpu": "xla_cpu_copy_insertion_use_region_analysis",
                           "gpu": "xla_gpu_copy_insertion_use_region_analysis"}


DONATED_STATE_MESSAGE = (
    "The state passed in was donated to an earlier run() call, which freed its buffers. Use the "
    "state that call returned (state, metrics = pipe.run(state, ...)), or keep a copy "
    "(jax.tree.map(jnp.copy, state)) before running if you need the old one.")


def raw_key(rng) -> jax.Array:
  """The uint32 key a state keeps, from a raw key (``jax.random.PRNGKey``), a typed one
  (``jax.random.key``) or an int seed: the state's layout must not depend on which one a user
  has."""
  if isinstance(rng, (int, np.integer)):
    return jax.random.PRNGKey(rng)
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(rng)
  return rng


def _all_finite(tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(tree)
            if jnp.issubdtype(a.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _relative_distance(a, b) -> jax.Array:
  """``|a - b| / |b|`` over every leaf of two weight trees (0 where ``b`` is all zeros)."""
  def squares(tree):
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))
  diff, norm = squares(jax.tree.map(jnp.subtract, a, b)), squares(b)
  return jnp.where(norm > 0, jnp.sqrt(diff / jnp.where(norm > 0, norm, 1.0)), 0.0)


def _spec(tree):
  """Shapes and dtypes of a tree of arrays, ShapeDtypeStructs or Python/numpy values.

  The array's own dtype, not JAX's canonical one: a float64 batch must not pass silently as the
  float32 the pipeline was built for.
  """
  def leaf(a):
    dtype = a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
    return jax.ShapeDtypeStruct(np.shape(a), dtype)
  return jax.tree.map(leaf, tree)


def _canonical(spec):
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, jax.dtypes.canonicalize_dtype(a.dtype)), spec)


def _describe(tree) -> str:
  return str(jax.tree.map(lambda a: f"{tuple(a.shape)} {jnp.dtype(a.dtype).name}", tree))


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


class PipelineRunner:
  """The one interface of a pipeline, on one device (:class:`Pipeline`) or over a device mesh
  (:class:`pipejax.sharding.ShardedPipeline`); training code needs nothing else.

  * ``init(rng)``: a fresh state, in the runner's own layout;
  * ``run(state, inputs, labels, valid=None)``: ``T`` ticks, ``(state, metrics stacked along T)``;
    the state is donated;
  * ``tick(state, inputs, labels, valid=True)``: one tick;
  * ``drain(state)``: finishes every backward in flight (written once, here);
  * ``to_logical(state)``: the device-independent :class:`PipelineState` (what checkpoints hold);
  * ``from_logical(logical_state)``: back into the runner's layout.

  ``pipeline`` is the single-device :class:`Pipeline` with the model, method and micro-batch shape.
  """

  pipeline: Pipeline

  def init(self, rng: jax.Array, fill_value: float = 0.0):
    raise NotImplementedError

  def run(self, state, inputs, labels, valid=None):
    raise NotImplementedError

  def tick(self, state, inputs, labels, valid=True):
    raise NotImplementedError

  def to_logical(self, state) -> PipelineState:
    raise NotImplementedError

  def from_logical(self, logical_state: PipelineState):
    raise NotImplementedError

  def drain(self, state):
    """Finishes every backward in flight by feeding 2(S-1) empty ticks; ``(state, metrics)``."""
    pipeline = self.pipeline
    ticks = accounting.fill_ticks(pipeline.num_stages)
    if ticks == 0:
      return state, None
    empty = lambda spec: np.zeros((ticks,) + spec.shape, spec.dtype)
    return self.run(state, jax.tree.map(empty, pipeline.example_inputs),
                    jax.tree.map(empty, pipeline.example_labels), np.zeros((ticks,), bool))


@dataclasses.dataclass(frozen=True, eq=False)
class Pipeline(PipelineRunner):
  """A model, a method and the shape of one micro-batch: everything static about a pipeline.

  Construction traces every stage abstractly, so a stage that does not fit the next one, S = 0 or
  an empty micro-batch is an error here, before anything runs. ``init``, ``tick``, ``run`` and
  ``drain`` are then pure functions of a :class:`PipelineState`.

  Args:
    model: the stages and the loss.
    method: weight views and per-stage update rule (``pipejax.methods``).
    example_inputs: one micro-batch of inputs, shape ``(b, ...)`` (arrays or ShapeDtypeStructs).
    example_labels: the matching labels, shape ``(b, ...)``.
    track_weight_discrepancy: also report, per stage and tick, the relative distance
      ``|w_fwd - w_bwd| / |w_bwd|`` between the weights the forward of the sample being
      backwarded used and the weights its backward uses: staleness made visible. It keeps a copy
      of the forward's weights beside each stashed input (as PipeDream's stash does), so it costs
      memory and time; the training numbers are unchanged.
  """

  model: Model
  method: Method
  example_inputs: PyTree
  example_labels: PyTree
  track_weight_discrepancy: bool = False

  def __post_init__(self):
    if not isinstance(self.model, Model):
      raise PipelineError(f"model must be a pipejax.Model (pipejax.Model([stage, ...])); got "
                          f"{type(self.model).__name__}.")
    if not isinstance(self.method, Method):
      raise PipelineError(
          f"method must be a pipejax Method, e.g. methods.make_method('pb', learning_rate=0.01) or "
          f"methods.pb(optax.sgd(0.01, momentum=0.9)); got {type(self.method).__name__}.")
    inputs, labels = _canonical(_spec(self.example_inputs)), _canonical(_spec(self.example_labels))
    batch_sizes = {a.shape[0] if a.shape else None for a in jax.tree.leaves((inputs, labels))}
    if len(batch_sizes) != 1 or None in batch_sizes:
      raise PipelineError(
          f"Inputs {_describe(inputs)} and labels {_describe(labels)} must share one leading "
          "micro-batch axis of size b >= 1. Give one micro-batch, e.g. inputs of shape (b, 784) "
          "and labels of shape (b,).")
    (b,) = batch_sizes
    if b < 1:
      raise PipelineError("The micro-batch size b must be at least 1 (got b = 0). PB trains with "
                          "b = 1 and up; give example inputs with a non-empty leading axis.")
    object.__setattr__(self, "example_inputs", inputs)
    object.__setattr__(self, "example_labels", labels)
    params, stage_inputs = self.model.trace_shapes(jax.random.PRNGKey(0), inputs)
    for s, stage_params in enumerate(params):
      for path, leaf in jax.tree_util.tree_leaves_with_path(stage_params):
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
          raise PipelineError(
              f"{self.model.stage_label(s)} has a trainable parameter "
              f"{jax.tree_util.keystr(path)} of dtype {jnp.dtype(leaf.dtype).name}; gradients "
              "and updates need floating weights. Keep integer constants out of the params: in "
              "the stage's closure, or as a stateful stage's variables.")
    object.__setattr__(self, "_params_shapes", params)
    object.__setattr__(self, "_stage_inputs", stage_inputs)
    self._check_loss()
    object.__setattr__(self, "_jit_tick", jit(self._tick))
    object.__setattr__(self, "_jit_run", jit(self._run, donate_argnums=0))
    object.__setattr__(self, "_jit_run_full", jit(
        functools.partial(self._run, every_slot_full=True), donate_argnums=0))

  # ------------------------------------------------------------------ static facts

  @property
  def num_stages(self) -> int:
    return self.model.num_stages

  @property
  def micro_batch_size(self) -> int:
    return jax.tree.leaves(self.example_inputs)[0].shape[0]

  @property
  def delays(self) -> list[int]:
    return accounting.stage_delays(self.num_stages)

  @property
  def stage_input_shapes(self) -> list[PyTree]:
    """ShapeDtypeStructs of each stage's input micro-batch."""
    return list(self._stage_inputs)

  @property
  def _stashes_weights(self) -> bool:
    return self.method.stash_forward_weights or self.track_weight_discrepancy

  def stash_bytes(self) -> int:
    """Bytes of stashed activations by the formula sum_s (D_s + 1) |x_s|."""
    return accounting.stash_bytes(self._stage_inputs)

  @staticmethod
  def held_stash_bytes(state: PipelineState) -> int:
    """Bytes of stashed activations actually held in ``state``'s delay lines."""
    return sum(accounting.tree_bytes(st.delay_line.x) for st in state.stages)

  def _last_stage_output(self):
    """The last stage's output shape (abstractly, with its variables if it has any)."""
    last = self.model.stages[-1]
    key, x = jax.random.PRNGKey(0), self._stage_inputs[-1]
    out, _ = jax.eval_shape(last.forward, self._params_shapes[-1], x, key,
                            jax.eval_shape(last.variables, key, x))
    return out

  def _check_loss(self):
    last_out = self._last_stage_output()
    try:
      result = jax.eval_shape(self.model.loss, last_out, self.example_labels)
    except Exception as e:
      raise PipelineError(
          f"The loss cannot take the last stage's output {_describe(last_out)} with labels "
          f"{_describe(self.example_labels)}: {str(e).strip().splitlines()[0]}. Check the "
          "number of classes of the last stage and the labels' shape.") from None
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
      raise PipelineError(
          "The loss must return a pair (scalar loss, dict of scalar metrics), e.g. "
          "(jnp.mean(nll), {'accuracy': accuracy}) or (loss, {}); it returned "
          f"{_describe(result)}.")
    loss, _ = result
    if loss.shape != ():
      raise PipelineError(f"The loss must return a scalar (mean over the micro-batch); it "
                          f"returned shape {loss.shape}.")

  # ------------------------------------------------------------------ state

  def init(self, rng: jax.Array, fill_value: float = 0.0) -> PipelineState:
    """A fresh pipeline: initial weights, optimizer states, empty delay lines and registers.

    Empty slots hold ``fill_value`` (floating leaves; integer leaves hold 0) and are flagged
    invalid. Tests fill them with NaN to prove that nothing empty ever reaches weights or metrics.
    """
    param_key, run_key = jax.random.split(raw_key(rng))
    keys = jax.random.split(param_key, self.num_stages)

    def filled(spec, leading=()):
      return jax.tree.map(
          lambda a: jnp.full(leading + a.shape, fill_value if jnp.issubdtype(a.dtype, jnp.inexact)
                             else 0, a.dtype), spec)

    def empty_packet(x_spec):
      return Packet(filled(x_spec), filled(self.example_labels), jnp.array(False),
                    jnp.array(-1, jnp.int32))

    stages = []
    for s, stage in enumerate(self.model.stages):
      x_spec = self._stage_inputs[s]
      x_zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), x_spec)
      params = stage.init(keys[s], x_zeros)
      variables = stage.variables(keys[s], x_zeros)
      tx = self.method.optimizer(self.delays[s])
      slots = self.delays[s] + 1
      weights = (jax.tree.map(lambda p: jnp.full((slots,) + p.shape, fill_value, p.dtype), params)
                 if self._stashes_weights else None)
      delay_line = DelayLine(filled(x_spec, (slots,)), jnp.zeros((slots,), bool),
                             jnp.full((slots,), -1, jnp.int32), weights,
                             None if variables is None else filled(variables.forward, (slots,)))
      is_last = s == self.num_stages - 1
      forward_out = None if is_last else empty_packet(self._stage_inputs[s + 1])
      backward_out = None if s == 0 else filled(x_spec)
      stages.append(StageState(params, tx.init(params), delay_line, forward_out, backward_out,
                               variables))
    return PipelineState(tuple(stages), jnp.array(0, jnp.int32), run_key)

  # ------------------------------------------------------------------ one tick

  def _stage_key(self, rng, index, s):
    return jax.random.fold_in(jax.random.fold_in(rng, index), s)

  def advance_stage(self, s: int, st: StageState, inbound: Packet, cotangent: PyTree,
                    tick: jax.Array, rng: jax.Array, reduce_grads=None,
                    every_slot_full: bool = False, delay_line_entries: bool = False):
    """Stage s's work in one tick: forward, stash, backward, update.

    Returns the new stage state and this tick's stage metrics. ``inbound`` is what stage s-1
    forwarded last tick; ``cotangent`` what stage s+1 sent back last tick (ignored for the last
    stage, which meets the loss). This function is the whole algorithm; single- and multi-device
    ticks only route registers between calls of it. ``reduce_grads``, when given, combines the
    weight gradient across pipeline replicas (``lax.pmean`` over a ``data`` mesh axis).
    ``every_slot_full`` promises that the micro-batch backwarded is a real one (see
    :meth:`Pipeline.run`), which drops the guard that keeps empty slots from updating weights.
    ``delay_line_entries`` returns, in place of the new delay line, the entry this tick writes
    into it (:meth:`DelayLine.write` of it at ``tick`` gives the line).
    """
    stage, method = self.model.stages[s], self.method
    delay = self.delays[s]
    is_first, is_last = s == 0, s == self.num_stages - 1
    variables = st.variables  # None for a stateless stage
    metrics = {}

    # Forward the new micro-batch (the last stage's forward happens inside its backward below).
    forward_params = method.forward_weights(st.params, st.opt_state, delay)
    forward_out, forward_ok, forwarded_variables = None, jnp.array(True), None
    if not is_last:
      y, forwarded_variables = stage.forward(forward_params, inbound.x,
                                             self._stage_key(rng, inbound.index, s), variables)
      forward_out = Packet(y, inbound.labels, inbound.valid, inbound.index)
      forward_ok = jnp.logical_or(~inbound.valid, _all_finite(y))

    # Stash the input (and the forward variables it met); read back the one written D ticks ago.
    entry = st.delay_line.entry(inbound, forward_params,
                                None if variables is None else variables.forward)
    oldest = st.delay_line.read(tick, entry)
    line = entry if delay_line_entries else st.delay_line.write(tick, entry)
    x_old, valid, index = oldest.x, oldest.valid, oldest.index
    backward_params = (oldest.weights if method.stash_forward_weights
                       else method.backward_weights(st.params, st.opt_state, delay))
    key = self._stage_key(rng, index, s)
    if self.track_weight_discrepancy:
      metrics["weight_discrepancy"] = jnp.where(
          valid, _relative_distance(oldest.weights, backward_params), 0.0)

    # Backward: recompute the stage on the stashed input and take the VJP. A stateful stage also
    # differentiates with respect to its backward variables: that cotangent is their increment.
    def recompute(w, x):
      if variables is None:
        return stage.forward(w, x, key, None)
      params, backward_variables = w
      return stage.forward(params, x, key, Variables(oldest.variables, backward_variables))

    trainable = backward_params if variables is None else (backward_params, variables.backward)
    backward_out = None
    if is_last:
      def loss_of(w, x):
        y, forward_variables = recompute(w, x)
        loss, aux = self.model.loss(y, inbound.labels)
        return loss, (aux, forward_variables)
      loss, vjp, (aux, forwarded_variables) = jax.vjp(loss_of, trainable, x_old, has_aux=True)
      grads, backward_out = vjp(jnp.ones_like(loss))
      metrics["loss"] = jnp.where(valid, loss, 0.0)
      metrics.update({k: jnp.where(valid, v, 0.0) for k, v in aux.items()})
      metrics["valid"] = valid
      metrics["sample"] = index
      backward_ok = jnp.logical_or(~valid, jnp.isfinite(loss))
    elif is_first:  # nobody needs d loss / d data: skip that product.
      _, vjp, _ = jax.vjp(lambda w: recompute(w, x_old), trainable, has_aux=True)
      (grads,) = vjp(cotangent)
      backward_ok = jnp.array(True)
    else:
      _, vjp, _ = jax.vjp(recompute, trainable, x_old, has_aux=True)
      grads, backward_out = vjp(cotangent)
      backward_ok = jnp.logical_or(~valid, _all_finite(backward_out))
    if is_first:
      backward_out = None
    if variables is not None:
      grads, increment = grads
      forward_valid = valid if is_last else inbound.valid
      variables = _advance_variables(variables, forwarded_variables, forward_valid, increment,
                                     valid, every_slot_full)

    # Update with the stage's own transformation; an empty slot changes nothing. The guard is a
    # select: a lax.cond copies every weight and optimizer slot through its branches, which was
    # slower in scripts/benchmark.py. NaN gradients from empty slots are never selected, so they
    # need no scrubbing.
    if reduce_grads is not None:
      grads = reduce_grads(grads)
    tx = method.optimizer(delay)
    extra = {"gradient_params": backward_params} if method.pass_gradient_weights else {}
    updates, opt_state = tx.update(grads, st.opt_state, st.params, **extra)
    params = optax.apply_updates(st.params, updates)
    if not every_slot_full:
      params, opt_state = optax.tree_utils.tree_where(valid, (params, opt_state),
                                                      (st.params, st.opt_state))

    # A NaN weight shows in the stage's own output within a tick; checking activations instead of
    # every weight keeps the tick's cost independent of the parameter count.
    metrics["finite"] = jnp.logical_and(forward_ok, backward_ok)
    return StageState(params, opt_state, line, forward_out, backward_out, variables), metrics

  def advance_stages(self, first: int, stages: tuple[StageState, ...], inbound: Packet,
                     cotangent: PyTree, tick, rng, reduce_grads=None,
                     every_slot_full: bool = False, delay_line_entries: bool = False):
    """Advances the contiguous stages ``first .. first+len(stages)-1`` by one tick.

    ``inbound`` is the packet entering the group's first stage, ``cotangent`` the gradient entering
    its last (None when the group ends with the model's last stage).
    """
    new_stages, stage_metrics = [], []
    for i, st in enumerate(stages):
      s = first + i
      stage_in = inbound if i == 0 else stages[i - 1].forward_out
      stage_cot = cotangent if i == len(stages) - 1 else stages[i + 1].backward_out
      new_st, m = self.advance_stage(s, st, stage_in, stage_cot, tick, rng, reduce_grads,
                                     every_slot_full, delay_line_entries)
      new_stages.append(new_st)
      stage_metrics.append(m)
    return tuple(new_stages), stage_metrics

  def _tick(self, state: PipelineState, batch: Batch, every_slot_full: bool = False):
    inbound = Packet(batch.inputs, batch.labels, jnp.asarray(batch.valid, bool), state.tick)
    stages, stage_metrics = self.advance_stages(0, state.stages, inbound, None, state.tick,
                                                state.rng, every_slot_full=every_slot_full)
    metrics = dict(stage_metrics[-1])
    for per_stage in ("finite", "weight_discrepancy"):
      if per_stage in stage_metrics[0]:
        metrics[per_stage] = jnp.stack([m[per_stage] for m in stage_metrics])
    return PipelineState(stages, state.tick + 1, state.rng), metrics

  def metric_shapes(self) -> dict:
    """ShapeDtypeStructs of one tick's metrics (what ``tick`` returns), computed abstractly."""
    state = jax.eval_shape(self.init, jax.random.PRNGKey(0))
    batch = Batch(self.example_inputs, self.example_labels, jax.ShapeDtypeStruct((), bool))
    return jax.eval_shape(self._tick, state, batch)[1]

  def _run(self, state: PipelineState, batches: Batch, every_slot_full: bool = False):
    return jax.lax.scan(functools.partial(self._tick, every_slot_full=every_slot_full), state,
                        batches)

  @staticmethod
  def every_slot_full(state: PipelineState) -> bool:
    """True when every delay-line slot and forward register holds a real micro-batch.

    Then, if every micro-batch fed next is real too, every backward of the coming ticks is real:
    it reads either a slot that is full now or one written from the new micro-batches.
    """
    flags = [(st.delay_line.valid, st.forward_out.valid if st.forward_out is not None else True)
             for st in state.stages]
    return all(bool(np.all(v)) for v in jax.tree.leaves(jax.device_get(flags)))

  # ------------------------------------------------------------------ public, checked entry points

  def tick(self, state: PipelineState, inputs, labels, valid=True):
    """One tick: stage 0 takes micro-batch ``(inputs, labels)``; returns (state, metrics).

    Metrics: ``loss`` and the loss's own metrics (e.g. ``accuracy``) of the sample that met the
    loss this tick, ``valid`` (False while the pipeline fills), ``sample`` (its index) and
    ``finite`` (one flag per stage).
    """
    self.check_state(state)
    batch = self.checked_batch(inputs, labels, valid, ticks=None)
    return self._jit_tick(state, batch)

  def run(self, state: PipelineState, inputs, labels, valid=None):
    """Advances ``T`` ticks with ``lax.scan``; inputs/labels have a leading axis of size T.

    The state is donated: do not use the ``state`` passed in afterwards. Metrics come back
    stacked along T.

    Once the pipeline is full and stays full (every slot in flight and every micro-batch fed is
    real: PB after its fill), a second compiled version runs without the per-stage guard against
    empty slots (faster: the guard is one more pass over every weight per tick, and at
    micro-batch 1 such passes cost as much as the products). It computes the same numbers up to
    float rounding (the two programs fuse differently); which one runs depends only on the state
    and the stream, so a resumed run still repeats the original bit for bit.
    """
    self.check_state(state)
    batch = self.checked_batch(inputs, labels, valid, ticks=True)
    if bool(np.all(np.asarray(batch.valid))) and self.every_slot_full(state):
      return self._jit_run_full(state, batch)
    return self._jit_run(state, batch)

  @property
  def pipeline(self) -> Pipeline:
    return self

  def to_logical(self, state: PipelineState) -> PipelineState:
    """The state itself: on one device the layout is the logical one."""
    return state

  def from_logical(self, logical_state: PipelineState) -> PipelineState:
    return logical_state

  def schedule(self, inputs, labels):
    """Lays a stream of K micro-batches (leading axis K) onto ticks for this method.

    Asynchronous methods take one micro-batch per tick. The synchronous mode feeds groups of M
    followed by 2(S-1) empty ticks (fill and drain): returns (inputs, labels, valid) per tick.
    """
    counts = {np.shape(a)[0] if np.ndim(a) else None for a in jax.tree.leaves((inputs, labels))}
    if len(counts) != 1 or None in counts:
      raise PipelineError(f"schedule() takes inputs and labels with one leading axis of K "
                          f"micro-batches each; their leading axes are {sorted(counts, key=str)}.")
    (count,) = counts
    m = self.method.micro_batches_per_step
    if m is None:
      return inputs, labels, np.ones((count,), bool)
    if count % m:
      raise PipelineError(f"The synchronous mode steps every M = {m} micro-batches; got {count}, "
                          f"which is not a multiple of {m}. Feed whole groups.")
    gap = accounting.bubble_ticks(self.num_stages, m)
    groups = count // m

    def spread(a):
      a = np.asarray(a).reshape((groups, m) + a.shape[1:])
      pad = np.zeros((groups, gap) + a.shape[2:], a.dtype)
      return np.concatenate([a, pad], axis=1).reshape((groups * (m + gap),) + a.shape[2:])

    valid = spread(np.ones((count,), bool))
    return jax.tree.map(spread, inputs), jax.tree.map(spread, labels), valid

  def checked_batch(self, inputs, labels, valid, ticks):
    """Validates a micro-batch (``ticks=None``) or a stream of them; returns a :class:`Batch`."""
    lead = ()
    if ticks:
      leaves = jax.tree.leaves((inputs, labels))
      if not leaves or any(np.ndim(a) == 0 for a in leaves):
        raise PipelineError("run() takes inputs and labels with a leading time axis (ticks, b, "
                            "...); use tick() for a single micro-batch.")
      lead = (np.shape(leaves[0])[0],)
      counts = {what: {np.shape(a)[0] for a in jax.tree.leaves(tree)}
                for what, tree in (("inputs", inputs), ("labels", labels))}
      if counts["inputs"] | counts["labels"] != set(lead):
        raise PipelineError(
            f"The inputs have {sorted(counts['inputs'])} ticks and the labels "
            f"{sorted(counts['labels'])} (the leading axis): run() takes one micro-batch of "
            "each per tick. Give both the same number of ticks.")
      if valid is None and self.method.micro_batches_per_step is not None:
        raise PipelineError(
            f"The synchronous method steps every M = {self.method.micro_batches_per_step} "
            "micro-batches with the pipeline's fill and drain in between; a stream fed tick by "
            "tick without them trains asynchronously instead. Lay the stream out first: "
            "inputs, labels, valid = pipe.schedule(inputs, labels); pipe.run(state, inputs, "
            "labels, valid).")
    for what, got, want in (("inputs", inputs, self.example_inputs),
                            ("labels", labels, self.example_labels)):
      got_spec = _spec(got)
      if jax.tree.structure(got_spec) != jax.tree.structure(want):
        raise PipelineError(f"The {what} have structure {jax.tree.structure(got_spec)} but the "
                            f"pipeline was built for {jax.tree.structure(want)}.")
      for g, w in zip(jax.tree.leaves(got_spec), jax.tree.leaves(want)):
        if tuple(g.shape) != lead + tuple(w.shape) or g.dtype != w.dtype:
          expected = f"{lead + tuple(w.shape)} {jnp.dtype(w.dtype).name}"
          raise PipelineError(
              f"The {what} have shape {tuple(g.shape)} {jnp.dtype(g.dtype).name} but the pipeline "
              f"was built for {expected}"
              + (" (ticks, micro-batch, ...)" if ticks else " (micro-batch, ...)")
              + f". Reshape or cast the {what} (e.g. .astype(np.{jnp.dtype(w.dtype).name})), or "
              "build the pipeline for this shape. Example inputs and labels of 64-bit types are "
              "recorded as 32-bit ones, as JAX keeps them.")
    if valid is None:
      valid = np.ones(lead, bool)
    valid = jnp.asarray(valid, bool)
    if valid.shape != lead:
      raise PipelineError(f"valid must have shape {lead} (one flag per tick); got {valid.shape}.")
    self._check_class_labels(labels, valid)
    return Batch(inputs, labels, valid)

  # ------------------------------------------------------------------ boundary checks

  @functools.cached_property
  def _state_spec(self):
    return jax.eval_shape(self.init, jax.random.PRNGKey(0))

  def check_state(self, state: PipelineState) -> None:
    """Refuses a state of another pipeline, or one whose buffers an earlier run() consumed.

    Structure, shapes and dtypes only: no device work, so it costs nothing per call.
    """
    leaves = jax.tree.leaves(state)
    if any(isinstance(a, jax.Array) and a.is_deleted() for a in leaves):
      raise PipelineError(DONATED_STATE_MESSAGE)
    want = self._state_spec
    if jax.tree.structure(state) != jax.tree.structure(want) or any(
        np.shape(a) != w.shape or jnp.result_type(a) != w.dtype
        for a, w in zip(leaves, jax.tree.leaves(want))):
      raise PipelineError(
          "The state does not belong to this pipeline: its structure, shapes or dtypes differ "
          f"from what this pipeline's init() makes ({self.num_stages} stages of this model and "
          "method). Create the state with this pipeline's init(), or restore a checkpoint "
          "written by the same model and method.")

  @functools.cached_property
  def _num_classes(self) -> int | None:
    """The logits' width when the loss is the built-in classification loss, else None."""
    if self.model.loss is not softmax_cross_entropy:
      return None  # a custom loss defines what its labels are
    return int(self._last_stage_output().shape[-1])

  def _check_class_labels(self, labels, valid) -> None:
    """Class labels must be integers in [0, classes): JAX would clamp -1 or 50 silently.

    The range is checked on host arrays (what a data loader gives); labels already on a device
    are checked only in run(), once per call, so a tick never waits for a device transfer.
    """
    num_classes = self._num_classes
    if num_classes is None:
      return
    for leaf in jax.tree.leaves(labels):
      if not jnp.issubdtype(leaf.dtype, jnp.integer):
        raise PipelineError(
            f"The labels are {jnp.dtype(leaf.dtype).name}, but the softmax cross-entropy takes "
            "integer class indices (floats would be truncated). Build the pipeline with integer "
            "example labels and feed labels.astype(np.int32).")
      if isinstance(leaf, jax.Array) and np.ndim(valid) == 0:
        continue
      values = np.asarray(leaf)
      if np.ndim(valid):
        values = values[np.asarray(valid)]
      elif not bool(valid):
        continue
      if values.size and (values.min() < 0 or values.max() >= num_classes):
        raise PipelineError(
            f"Labels must be class indices in [0, {num_classes}) for this model's "
            f"{num_classes} outputs; got values from {values.min()} to {values.max()}. Map the "
            "labels to 0..classes-1, or build the model with more classes.")
