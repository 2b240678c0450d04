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
The stage's index and delay enter both as values, so ``pipejax.parallel.stacking`` runs the same two
steps under ``vmap`` for a run of identical stages. The state the tick advances is
``pipejax.core.state``'s; the scan over ticks is ``pipejax.core.runner.ScanRunner``'s; the boundary
checks are ``pipejax.core.checks``'.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax

from pipejax.core import accounting, checks, parts
from pipejax.methods import Method
from pipejax.core.parts import TickOptions
from pipejax.core.runner import ScanRunner
from pipejax.core.stages import Model, Variables, softmax_cross_entropy
from pipejax.core.state import (Batch, DelayLine, Forward, Packet, PipelineState, StageState,
                                raw_key, slots_full)

PyTree = Any

# How every layout compiles its initial state. XLA:CPU's optimizing backend spends seconds on
# each weight shape's random generator (threefry); unoptimized, the same program compiles several
# times faster, and an init runs once. The numbers differ from an optimized compile's in the last
# bit of some weights, so every layout's init uses these options, and every layout starts from
# the same bits. XLA:CPU's older elemental emitters make the same bits as its MLIR fusion emitters
# here (tests/core/test_engine.py) and compile the generators 1.1 to 2 times faster. They compile
# reductions over many leaves several times slower, so no other program uses them.
INIT_COMPILER = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


class CompiledInit:
  """A layout's ``init(rng, fill_value)``: compiled with :data:`INIT_COMPILER` when called on
  values, once per key shape. Inside another trace (``jax.jit(pipe.init)``, ``eval_shape``) it is
  the plain jitted function, part of the caller's program and compiled with the caller's
  options, where the last bit of some weights may differ.

  A layout that gives ``weights`` and ``around`` (``init(rng, fill) = around(weights(rng), rng,
  fill)``) compiles them apart, and ``shared`` (a dict that lives as long as the model's trace)
  keeps the compiled ``weights`` for every pipeline over the same model. The weights are most of
  what an init compiles (a random generator per weight shape) and depend on the model alone: the
  pipelines of several methods over one model compile them once.
  """

  def __init__(self, init: Callable, weights: Callable | None = None,
               around: Callable | None = None, shared: dict | None = None):
    self._jitted = jax.jit(init)
    self._weights, self._shared = jax.jit(weights) if weights else None, shared
    self._around = jax.jit(around) if around else None
    self._compiled = {}

  def __call__(self, rng: jax.Array, fill_value: jax.Array):
    if isinstance(rng, jax.core.Tracer) or isinstance(fill_value, jax.core.Tracer):
      return self._jitted(rng, fill_value)
    signature = (rng.shape, str(rng.dtype))
    if self._weights is None:
      if signature not in self._compiled:
        self._compiled[signature] = _compiled_for_init(self._jitted, rng, fill_value)
      return self._compiled[signature](rng, fill_value)
    if signature not in self._shared:
      self._shared[signature] = _compiled_for_init(self._weights, rng)
    weights = self._shared[signature](rng)
    if signature not in self._compiled:
      self._compiled[signature] = _compiled_for_init(self._around, weights, rng, fill_value)
    return self._compiled[signature](weights, rng, fill_value)


def _compiled_for_init(jitted, *args):
  return jitted.lower(*args).compile(compiler_options=INIT_COMPILER)


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


def _zeros(spec: PyTree) -> PyTree:
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), spec)


def _filled(spec: PyTree, fill_value, leading: tuple[int, ...] = ()) -> PyTree:
  """Arrays shaped ``leading + leaf.shape`` for each leaf of ``spec``: ``fill_value`` in floating
  leaves, 0 in integer ones (an empty slot is flagged invalid, never read as a number)."""
  return jax.tree.map(
      lambda a: jnp.full(leading + a.shape, fill_value if jnp.issubdtype(a.dtype, jnp.inexact)
                         else 0, a.dtype), spec)


@dataclasses.dataclass(frozen=True, eq=False)
class Pipeline(ScanRunner):
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
    checks.check_model_and_method(self.model, self.method)
    inputs, labels = checks.micro_batch_specs(self.example_inputs, self.example_labels)
    object.__setattr__(self, "example_inputs", inputs)
    object.__setattr__(self, "example_labels", labels)
    traced = self.model.trace(jax.random.PRNGKey(0), inputs)
    checks.check_floating_params(self.model, traced.params)
    object.__setattr__(self, "_params_shapes", traced.params)
    object.__setattr__(self, "_stage_inputs", traced.inputs)
    object.__setattr__(self, "_forward_programs", tuple(traced.forwards))
    object.__setattr__(self, "_initial_programs", tuple(traced.initials))
    checks.check_loss(self.model.loss, self._last_stage_output(), labels)
    for name, program in zip(("_jit_tick", "_jit_run", "_jit_run_full"), self._compile()):
      object.__setattr__(self, name, program)
    # Compiled programs: run op by op, each initializer of each new weight shape compiles a
    # program of its own, which takes longer than compiling the whole init once.
    object.__setattr__(self, "_jit_init", CompiledInit(self._init, self._initial_weights,
                                                       self._init_around, traced.compiled))
    object.__setattr__(self, "_init_traces", {})

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
  def stage_param_shapes(self) -> list[PyTree]:
    """ShapeDtypeStructs of each stage's parameters."""
    return list(self._params_shapes)

  def forward_program(self, s: int) -> jax.extend.core.ClosedJaxpr:
    """Stage ``s``'s forward as a closed jaxpr of its parameters, input, key and variables,
    traced when the pipeline was built (:meth:`pipejax.Model.trace`)."""
    return self._forward_programs[s]

  @property
  def stashes_weights(self) -> bool:
    """Whether delay lines keep the forward's weights beside each input."""
    return self.method.stash_forward_weights or self.track_weight_discrepancy

  def stash_bytes(self) -> int:
    """Bytes of stashed activations by the formula sum_s (D_s + 1) |x_s|."""
    return accounting.stash_bytes(self._stage_inputs)

  def held_stash_bytes(self, state: PipelineState) -> int:
    """Bytes of stashed activations actually held in ``state``'s delay lines."""
    return accounting.held_stash_bytes(state.stages)

  def _last_stage_output(self):
    """The last stage's output shape (abstractly, with its variables if it has any)."""
    last = self.model.stages[-1]
    key, x = jax.random.PRNGKey(0), self._stage_inputs[-1]
    out, _ = jax.eval_shape(last.forward, self._params_shapes[-1], x, key,
                            jax.eval_shape(last.variables, key, x))
    return out

  # ------------------------------------------------------------------ state

  def init(self, rng: jax.Array, fill_value: float = 0.0) -> PipelineState:
    """A fresh pipeline: initial weights, optimizer states, empty delay lines and registers.

    Empty slots hold ``fill_value`` (floating leaves; integer leaves hold 0) and are flagged
    invalid. Tests fill them with NaN to prove that nothing empty ever reaches weights or metrics.
    Every runner starts from this one compiled program, so every layout starts from the same bits.
    A state larger than the device's memory is refused before anything is allocated.
    """
    if not checks.traced((rng, fill_value)):
      checks.check_state_fits(accounting.tree_bytes(self.state_spec), self.num_stages)
    return self._jit_init(raw_key(rng), jnp.float32(fill_value))

  def _init(self, rng: jax.Array, fill_value: jax.Array) -> PipelineState:
    return self._init_around(self._initial_weights(rng), rng, fill_value)

  def _initial_weights(self, rng: jax.Array) -> tuple:
    """Each stage's initial ``(params, variables)``: what the model and ``rng`` alone decide."""
    stage_keys, _ = self.init_keys(rng)
    return tuple(self.stage_weights(s, stage_keys[s]) for s in range(self.num_stages))

  def stage_weights(self, s: int, key: jax.Array) -> tuple:
    """Stage ``s``'s initial ``(params, variables)`` from its key (:meth:`init_keys`)."""
    # The program traced with the model, not the stage's Python again: the same computation,
    # and at hundreds of stages a second trace of every initialization is seconds of building.
    return self._initial_programs[s](key, _zeros(self._stage_inputs[s]))

  def _init_around(self, weights: tuple, rng: jax.Array, fill_value: jax.Array) -> PipelineState:
    """The initial state around each stage's initial weights: optimizer states, registers and
    empty delay lines."""
    _, run_key = self.init_keys(rng)
    stages = tuple(self.initial_stage(s, weights[s], fill_value) for s in range(self.num_stages))
    return PipelineState(stages, jnp.array(0, jnp.int32), run_key)

  def initial_stage(self, s: int, weights: tuple, fill_value: jax.Array) -> StageState:
    """Stage ``s``'s whole initial state around its :meth:`stage_weights`: :meth:`init_stage`
    with its empty delay line."""
    st = self.init_stage(s, weights, fill_value, self.delays[s])
    return st._replace(delay_line=self.empty_delay_line(s, st, self.delays[s] + 1, fill_value))

  def init_keys(self, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The key of each stage's initial weights, and the key of the run's own stream."""
    param_key, run_key = jax.random.split(rng)
    return jax.random.split(param_key, self.num_stages), run_key

  def init_stage(self, s: int, weights: tuple, fill_value: jax.Array, delay) -> StageState:
    """Stage ``s``'s initial state around its :meth:`stage_weights` (optimizer state and empty
    registers), without its delay line (:meth:`empty_delay_line`). ``delay`` may be traced, so
    that identical stages initialize together under ``vmap``."""
    x_spec = self._stage_inputs[s]
    params, variables = weights
    forward_out = None
    if s < self.num_stages - 1:
      forward_out = Packet(_filled(self._stage_inputs[s + 1], fill_value),
                           _filled(self.example_labels, fill_value), jnp.array(False),
                           jnp.array(-1, jnp.int32))
    backward_out = None if s == 0 else _filled(x_spec, fill_value)
    return StageState(params, self.method.optimizer(delay).init(params), None, forward_out,
                      backward_out, variables)

  def traced_init_stage(self, s: int) -> tuple[jax.extend.core.ClosedJaxpr | None, StageState]:
    """Stage ``s``'s :meth:`stage_weights` and :meth:`init_stage` as one program of its key, delay
    and fill value, and the shapes of the state it makes. The program is None where the method's
    optimizer cannot start from a traced delay; the shapes are then those at the stage's own
    delay.

    Traced once per stage and kept: :attr:`state_spec` and the stacked layout's initialization
    (``pipejax.parallel.stacking``) both read it, and at hundreds of stages the trace is most of
    what building a pipeline costs.
    """
    if s not in self._init_traces:
      self._init_traces[s] = self.trace_init_stage(s)
    return self._init_traces[s]

  def trace_init_stage(self, s: int) -> tuple[jax.extend.core.ClosedJaxpr | None, StageState]:
    """:meth:`traced_init_stage`, traced anew (not kept)."""
    key = jax.eval_shape(jax.random.PRNGKey, 0)
    fill = jax.ShapeDtypeStruct((), jnp.float32)
    try:
      return jax.make_jaxpr(
          lambda key, delay, fill: self.init_stage(s, self.stage_weights(s, key), fill, delay),
          return_shape=True)(key, jax.ShapeDtypeStruct((), jnp.int32), fill)
    except (TypeError, ValueError):  # a traced delay the method cannot take, among them
      return None, jax.eval_shape(
          lambda key, fill: self.init_stage(s, self.stage_weights(s, key), fill, self.delays[s]),
          key, fill)

  def empty_delay_line(self, s: int, st: StageState, slots: int, fill_value) -> DelayLine:
    """``slots`` empty entries of stage ``s``'s delay line, shaped after one stage's state
    ``st``."""
    weights = _filled(st.params, fill_value, (slots,)) if self.stashes_weights else None
    variables = None if st.variables is None else _filled(st.variables.forward, fill_value,
                                                           (slots,))
    return DelayLine(_filled(self._stage_inputs[s], fill_value, (slots,)),
                     jnp.zeros((slots,), bool), jnp.full((slots,), -1, jnp.int32), weights,
                     variables)

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
      y, forwarded = self.model.stages[s].forward(
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
    stage, variables = self.model.stages[s], st.variables
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
        loss, aux = self.model.loss(y, labels)
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
    if self.track_weight_discrepancy:
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

  def weights_finite(self, state: PipelineState) -> np.ndarray:
    """See :meth:`pipejax.core.runner.Runner.weights_finite`."""
    self.check_state(state)
    return np.asarray(_stages_finite(state.stages))

  # ------------------------------------------------------------------ layout

  @property
  def pipeline(self) -> Pipeline:
    return self

  def to_logical(self, state: PipelineState) -> PipelineState:
    """The state itself: on one device the layout is the logical one."""
    checks.check_not_donated(state)
    return state

  def from_logical(self, logical_state: PipelineState) -> PipelineState:
    checks.check_not_donated(logical_state)
    return logical_state

  # ------------------------------------------------------------- boundary (pipejax.core.checks)

  def checked_batch(self, inputs, labels, valid, ticks):
    """Validates a micro-batch (``ticks=None``) or a stream of them; returns a :class:`Batch`."""
    valid = checks.checked_stream(
        inputs, labels, valid, example_inputs=self.example_inputs,
        example_labels=self.example_labels, micro_batches=self.method.micro_batches_per_step,
        ticks=bool(ticks))
    self.check_labels(labels, valid)
    return Batch(inputs, labels, valid)

  @functools.cached_property
  def state_spec(self) -> PipelineState:
    """The abstract state ``init`` makes (ShapeDtypeStructs), from each stage's
    :meth:`traced_init_stage`."""
    stages = []
    for s in range(self.num_stages):
      _, st = self.traced_init_stage(s)
      line = jax.eval_shape(
          lambda st, s=s: self.empty_delay_line(s, st, self.delays[s] + 1, jnp.float32(0)), st)
      stages.append(st._replace(delay_line=line))
    return PipelineState(tuple(stages), jax.ShapeDtypeStruct((), jnp.int32),
                         jax.eval_shape(jax.random.PRNGKey, 0))

  def check_state(self, state: PipelineState) -> None:
    """Refuses a state of another pipeline, or one whose buffers an earlier run() consumed."""
    checks.check_state(state, self.state_spec, self.num_stages)

  @functools.cached_property
  def num_classes(self) -> int | None:
    """The logits' width when the loss is the built-in classification loss, else None."""
    if self.model.loss is not softmax_cross_entropy:
      return None  # a custom loss defines what its labels are
    return int(self._last_stage_output().shape[-1])

  def check_labels(self, labels, valid) -> None:
    """Refuses class labels outside ``[0, classes)``
    (:func:`pipejax.core.checks.check_class_labels`)."""
    checks.check_class_labels(labels, valid, self.num_classes)

