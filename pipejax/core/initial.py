"""A pipeline's initial state: weights, optimizer states, empty registers and delay lines.

:class:`StateInit` is the compiled init of a :class:`~pipejax.core.spec.PipelineSpec`. It is
built from small steps that the stacked layout reuses (``pipejax.core.stacked_layout``): a stage's
key, its initial weights, the state around them, its empty delay line, and the stage's whole
initialization as one program with the delay as an input, so that identical stages initialize
together under ``vmap``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.extend.core
import jax.numpy as jnp

from pipejax.core import accounting, checks
from pipejax.core.spec import PipelineSpec
from pipejax.core.state import DelayLine, Packet, PipelineState, StageState, raw_key

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
        self._compiled[signature] = compiled_for_init(self._jitted, rng, fill_value)
      return self._compiled[signature](rng, fill_value)
    if signature not in self._shared:
      self._shared[signature] = compiled_for_init(self._weights, rng)
    weights = self._shared[signature](rng)
    if signature not in self._compiled:
      self._compiled[signature] = compiled_for_init(self._around, weights, rng, fill_value)
    return self._compiled[signature](weights, rng, fill_value)


def compiled_for_init(jitted, *args):
  """``jitted`` compiled for ``args`` with :data:`INIT_COMPILER`: how every layout's init is."""
  return jitted.lower(*args).compile(compiler_options=INIT_COMPILER)


def _zeros(spec: PyTree) -> PyTree:
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), spec)


def filled(spec: PyTree, fill_value, leading: tuple[int, ...] = ()) -> PyTree:
  """Arrays shaped ``leading + leaf.shape`` for each leaf of ``spec``: ``fill_value`` in floating
  leaves, 0 in integer ones (an empty slot is flagged invalid, never read as a number)."""
  return jax.tree.map(
      lambda a: jnp.full(leading + a.shape, fill_value if jnp.issubdtype(a.dtype, jnp.inexact)
                         else 0, a.dtype), spec)


class StateInit:
  """The initial state of a :class:`~pipejax.core.spec.PipelineSpec`'s pipeline, compiled once.

  Calling it on ``(rng, fill_value)`` makes the whole :class:`~pipejax.core.state.PipelineState`;
  empty slots hold ``fill_value`` (floating leaves; integer leaves hold 0) and are flagged invalid.
  """

  def __init__(self, spec: PipelineSpec):
    self.spec = spec
    self._programs = {}
    # Compiled programs: run op by op, each initializer of each new weight shape compiles a
    # program of its own, which takes longer than compiling the whole init once.
    self._compiled = CompiledInit(self._state, self._all_weights, self._state_around,
                                  spec.trace.compiled)

  def __call__(self, rng: jax.Array, fill_value: float = 0.0) -> PipelineState:
    """The initial state; one larger than the device's memory is refused before anything is
    allocated."""
    if not checks.traced((rng, fill_value)):
      checks.check_state_fits(accounting.tree_bytes(self.state_spec), self.spec.num_stages)
    return self._compiled(raw_key(rng), jnp.float32(fill_value))

  def keys(self, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The key of each stage's initial weights, and the key of the run's own stream."""
    param_key, run_key = jax.random.split(rng)
    return jax.random.split(param_key, self.spec.num_stages), run_key

  def weights(self, s: int, key: jax.Array) -> tuple:
    """Stage ``s``'s initial ``(params, variables)`` from its key (:meth:`keys`)."""
    # The program traced with the model, not the stage's Python again: the same computation,
    # and at hundreds of stages a second trace of every initialization is seconds of building.
    return self.spec.trace.initials[s](key, _zeros(self.spec.trace.inputs[s]))

  def state_without_line(self, s: int, weights: tuple, fill_value: jax.Array,
                         delay) -> StageState:
    """Stage ``s``'s optimizer state and empty registers around its :meth:`weights`, its delay line
    left out (:meth:`empty_delay_line`). ``delay`` may be traced, so that identical stages
    initialize together under ``vmap``."""
    spec, (params, variables) = self.spec, weights
    forward_out = None
    if s < spec.num_stages - 1:
      forward_out = Packet(filled(spec.trace.inputs[s + 1], fill_value),
                           filled(spec.example_labels, fill_value), jnp.array(False),
                           jnp.array(-1, jnp.int32))
    backward_out = None if s == 0 else filled(spec.trace.inputs[s], fill_value)
    return StageState(params, spec.method.optimizer(delay).init(params), None, forward_out,
                      backward_out, variables)

  def empty_delay_line(self, s: int, st: StageState, slots: int, fill_value) -> DelayLine:
    """``slots`` empty entries of stage ``s``'s delay line, shaped after one stage's state
    ``st``."""
    weights = filled(st.params, fill_value, (slots,)) if self.spec.stashes_weights else None
    variables = None if st.variables is None else filled(st.variables.forward, fill_value,
                                                          (slots,))
    return DelayLine(filled(self.spec.trace.inputs[s], fill_value, (slots,)),
                     jnp.zeros((slots,), bool), jnp.full((slots,), -1, jnp.int32), weights,
                     variables)

  def stage_state(self, s: int, weights: tuple, fill_value: jax.Array) -> StageState:
    """Stage ``s``'s whole initial state around its :meth:`weights`, its empty delay line in."""
    delay = self.spec.delays[s]
    st = self.state_without_line(s, weights, fill_value, delay)
    return st._replace(delay_line=self.empty_delay_line(s, st, delay + 1, fill_value))

  def stage_program(self, s: int) -> tuple[jax.extend.core.ClosedJaxpr | None, StageState]:
    """Stage ``s``'s :meth:`weights` and :meth:`state_without_line` as one program of its key,
    delay and fill value, and the shapes of the state it makes. The program is None where the
    method's optimizer cannot start from a traced delay; the shapes are then those at the stage's
    own delay.

    Traced once per stage and kept: :attr:`state_spec` and the stacked layout's initialization
    both read it, and at hundreds of stages the trace is most of what building a pipeline costs.
    """
    last = self.spec.num_stages - 1
    if s not in self._programs and 1 < s < last and self.spec.model.repeats(s):
      # A repeated stage (pipejax.Model): a middle stage's init is its predecessor's program.
      program, shapes = self.stage_program(s - 1)
      if program is not None:
        self._programs[s] = program, shapes
    if s not in self._programs:
      key = jax.eval_shape(jax.random.PRNGKey, 0)
      fill = jax.ShapeDtypeStruct((), jnp.float32)
      try:
        self._programs[s] = jax.make_jaxpr(
            lambda key, delay, fill: self.state_without_line(s, self.weights(s, key), fill,
                                                             delay),
            return_shape=True)(key, jax.ShapeDtypeStruct((), jnp.int32), fill)
      except (TypeError, ValueError):  # a traced delay the method cannot take, among them
        self._programs[s] = None, jax.eval_shape(
            lambda key, fill: self.state_without_line(s, self.weights(s, key), fill,
                                                      self.spec.delays[s]), key, fill)
    return self._programs[s]

  @functools.cached_property
  def state_spec(self) -> PipelineState:
    """The abstract state this init makes (ShapeDtypeStructs), from each :meth:`stage_program`."""
    stages = []
    for s in range(self.spec.num_stages):
      _, st = self.stage_program(s)
      # Written from the shapes: a trace of empty_delay_line per stage is most of the time a
      # deep pipeline's build takes (tests/core/test_engine.py checks the two agree).
      slots = (self.spec.delays[s] + 1,)
      with_slots = lambda tree: jax.tree.map(
          lambda a: jax.ShapeDtypeStruct(slots + tuple(a.shape), a.dtype), tree)
      line = DelayLine(with_slots(self.spec.trace.inputs[s]),
                       jax.ShapeDtypeStruct(slots, jnp.bool_),
                       jax.ShapeDtypeStruct(slots, jnp.int32),
                       with_slots(st.params) if self.spec.stashes_weights else None,
                       None if st.variables is None else with_slots(st.variables.forward))
      stages.append(st._replace(delay_line=line))
    return PipelineState(tuple(stages), jax.ShapeDtypeStruct((), jnp.int32),
                         jax.eval_shape(jax.random.PRNGKey, 0))

  def _state(self, rng: jax.Array, fill_value: jax.Array) -> PipelineState:
    return self._state_around(self._all_weights(rng), rng, fill_value)

  def _all_weights(self, rng: jax.Array) -> tuple:
    """Each stage's initial ``(params, variables)``: what the model and ``rng`` alone decide."""
    stage_keys, _ = self.keys(rng)
    return tuple(self.weights(s, stage_keys[s]) for s in range(self.spec.num_stages))

  def _state_around(self, weights: tuple, rng: jax.Array, fill_value: jax.Array) -> PipelineState:
    """The initial state around each stage's initial weights."""
    _, run_key = self.keys(rng)
    stages = tuple(self.stage_state(s, weights[s], fill_value)
                   for s in range(self.spec.num_stages))
    return PipelineState(stages, jnp.array(0, jnp.int32), run_key)
