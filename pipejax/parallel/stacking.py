"""Runs of identical stages advanced as one stack under ``vmap`` (docs/design.md §6.1).

A deep pipeline is mostly runs of identical stages (the residual MLP's blocks, the blocks of one
ResNet width, transformer blocks). Traced stage by stage, the tick holds each operation once per
stage, so its kernels and its compile time grow with depth. :class:`StackedPipeline` advances each
such run as one stack: the stack's weights, optimizer states, registers and variables are stacked on
a leading stage axis, and the engine's own :meth:`~pipejax.core.engine.Pipeline.forward_step` and
:meth:`~pipejax.core.engine.Pipeline.backward_step` run under ``jax.vmap`` over it, with the stage
number (the rng fold-in) and the delay ``D_s`` as arrays over the axis. Every method's weight
views and update rules take the delay as a value (``pipejax.optim`` accepts traced
hyperparameters), so Spike Compensation's coefficients, the prediction horizons and PipeMare's
rates become per-stage arrays without any change to the methods.

**Which stages stack** (:func:`find_stacks`): two stages are identical when their forward (over
its parameters' flattened leaves), and the method's weight views and update with the delay as an
input, written over the flattened leaves of the stage's state, trace to the same jaxprs
(operations, shapes, dtypes, constants); the backward is the forward's VJP. Their parameter trees
may differ in names only (``block3`` against ``block4``): a stack keeps its first stage's tree
structure, and the logical state keeps every stage's own. The first and the last stage never stack
(they skip the input gradient, and meet the loss). A method whose update cannot take a traced
delay (an optimizer factory that branches on it in Python) makes no stack: the pipeline then runs
stage by stage. A stack also initializes as one program under ``vmap`` (:func:`init_program`):
flax derives each weight's key by folding a hash of its module's name into the stage's key, so
identical blocks trace to initializations that differ in those constants only, which are lifted
out into an input.

**The tick** is :func:`pipejax.core.parts.advance_parts`, over this layout's parts: each stack
keeps its stages' rings end to end (:class:`pipejax.core.parts.Rings`), so it holds exactly the
per-stage formula's bytes and a tick reads and writes them with one gather and one scatter per
leaf. Within its span each stage's slots are where the logical state has them, so
:meth:`StackedPipeline.to_logical` is slicing and stacking back.

**On a mesh** (docs/design.md §6.1). ``ShardedPipeline(StackedPipeline(pipe), mesh)`` cuts
each stack at the devices' boundaries (:func:`shard_parts`): a device's piece of a stack is a stack
of its own, whose rings lie end to end in the device's buffers as in this layout. The device keeps
its stages' other leaves stage by stage and stacks them for the tick (:func:`advance_shard`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np

from pipejax.core import accounting, checks, engine, initial, parts
from pipejax.core.engine import Pipeline
from pipejax.core.parts import TickOptions
from pipejax.parallel.mesh import MeshError
from pipejax.core.runner import Runner
from pipejax.core.state import Batch, Packet, PipelineState, StageState, raw_key, slots_full

PyTree = Any


# ----------------------------------------------------------------------------- which stages stack

def _signature(pipeline: Pipeline, s: int, spec: PipelineState):
  """What stage ``s`` computes, as text and constants: equal for identical stages.

  The stage's forward (traced when the pipeline was built), and the method's weight views and
  update (:func:`update_program`); the backward is the forward's VJP. None when the method cannot
  take a traced delay.
  """
  update = update_program(pipeline, s, spec)
  if update is None:
    return None
  line = [(a.shape[1:], a.dtype) for a in jax.tree.leaves(spec.stages[s].delay_line)]
  return _as_text((pipeline.spec.forward_program(s), update)), str(line)


def update_program(pipeline: Pipeline, s: int, spec: PipelineState):
  """The method's weight views and update of stage ``s`` with the delay as a traced value, as a
  closed jaxpr over the flattened leaves of the stage's state; None when the method cannot take
  a traced delay, or its update's state is not the state the stage's init makes."""
  method, st = pipeline.method, spec.stages[s]
  leaves, treedef = jax.tree.flatten(st._replace(delay_line=None))
  opt_structure = []

  def update(leaves, delay):
    st = jax.tree.unflatten(treedef, leaves)
    extra = {"gradient_params": st.params} if method.pass_gradient_weights else {}
    updates, opt_state = method.optimizer(delay).update(st.params, st.opt_state, st.params,
                                                        **extra)
    opt_structure.append(jax.tree.structure(opt_state))
    return (method.forward_weights(st.params, st.opt_state, delay),
            method.backward_weights(st.params, st.opt_state, delay), updates, opt_state)

  try:
    program = jax.make_jaxpr(update)(leaves, _TRACED_DELAY)
  except (TypeError, ValueError):  # a traced delay the method cannot take, among them
    return None
  if opt_structure[0] != jax.tree.structure(st.opt_state):
    return None
  return program


class InitProgram(NamedTuple):
  """One stage's initialization as a program of its key, delay, fill value and salts."""

  closed: jax_core.ClosedJaxpr  # the salts lifted out of it into inputs
  salts: np.ndarray  # (k,) uint32: the constants this stage folds into its key
  out_tree: Any  # the StageState structure it returns
  text: tuple  # equal for stages that run one program (names of weights may differ)

  def run(self, keys: jax.Array, delays, fill_value: jax.Array, salts: np.ndarray) -> StageState:
    """The stacked initial states of the stages whose keys, delays and salts are given."""
    program = jax_core.jaxpr_as_fun(self.closed)
    leaves = jax.vmap(lambda key, delay, salts: program(key, delay, fill_value, *salts))(
        keys, jnp.asarray(delays, jnp.int32), jnp.asarray(salts))
    return jax.tree.unflatten(self.out_tree, leaves)


def init_program(pipeline: Pipeline, s: int) -> InitProgram | None:
  """Stage ``s``'s init traced with its key, delay and fill value as inputs
  (:meth:`~pipejax.core.initial.StateInit.stage_program`), and the constants it folds into its key
  (flax derives each weight's key from its module's name, so ``block3`` and ``block4`` fold in
  different ones) lifted out as a further input.

  Stages whose programs are then equal initialize under one ``vmap`` over their keys, delays and
  salts, with the per-stage init's numbers. None when the method's optimizer state cannot start
  from a traced delay.
  """
  closed, out_shape = pipeline.initial.stage_program(s)
  if closed is None:
    return None
  eqns, salt_vars, salts = [], [], []
  for eqn in closed.jaxpr.eqns:
    if eqn.primitive.name == "random_fold_in" and isinstance(eqn.invars[1], jax_core.Literal):
      salt_vars.append(jax_core.Var(eqn.invars[1].aval))
      salts.append(eqn.invars[1].val)
      eqn = eqn.replace(invars=[eqn.invars[0], salt_vars[-1]])
    eqns.append(eqn)
  debug, names = closed.jaxpr.debug_info, tuple(f"salt{i}" for i in range(len(salts)))
  lifted = jax_core.ClosedJaxpr(
      closed.jaxpr.replace(invars=closed.jaxpr.invars + salt_vars, eqns=eqns,
                           debug_info=debug._replace(arg_names=debug.arg_names + names)),
      closed.consts)
  return InitProgram(lifted, np.asarray(salts, np.uint32), jax.tree.structure(out_shape),
                      _as_text((lifted,)))


_TRACED_DELAY = jax.ShapeDtypeStruct((), jnp.int32)


def _as_text(traced) -> tuple:
  """Closed jaxprs as comparable text: the programs, and their constants' shapes and bytes."""
  consts = tuple((np.shape(c), str(np.result_type(c)), np.asarray(c).tobytes())
                 for closed in traced for c in closed.consts)
  return tuple(str(closed.jaxpr) for closed in traced), consts


def find_stacks(pipeline: Pipeline) -> list[tuple[int, int]]:
  """The pipeline's parts as contiguous ``(start, stop)`` spans; a span of two or more stages is
  a stack of identical stages (module docstring), every other run a single stage."""
  num, spec, model = pipeline.num_stages, pipeline.state_spec, pipeline.model
  signatures = [None] * num
  for s in range(1, num - 1):
    # A declared stack's stages run one program (pipejax.Model): the first one's is traced.
    same = model.repeats(s) and s > 1
    signatures[s] = signatures[s - 1] if same else _signature(pipeline, s, spec)
  spans, start = [], 0
  for s in range(1, num + 1):
    same = (s < num and signatures[s] is not None and signatures[s] == signatures[start])
    if not same:
      spans.append((start, s))
      start = s
  return spans


# ----------------------------------------------------------------------------- the stacked tick


class StackedState(NamedTuple):
  """A :class:`~pipejax.core.state.PipelineState` with each stack's stages stacked into one.

  ``parts[k]`` is the :class:`~pipejax.core.state.StageState` of a single stage, or of a stack with
  a leading stage axis on every leaf but the delay line's, whose rings lie end to end.
  """

  parts: tuple[StageState, ...]
  tick: jax.Array
  rng: jax.Array


class _Stack(NamedTuple):
  """Static facts of one stack."""

  start: int
  stop: int
  treedefs: tuple  # each stage's StageState structure, delay line left out
  line_treedefs: tuple  # each stage's DelayLine structure
  rings: parts.Rings  # where each stage's ring lies in the stack's buffers
  init: InitProgram | None  # the stages' one initialization program, if they have one
  salts: np.ndarray | None  # (n, k): each stage's salts for it


def _stack(trees, treedef):
  """Stacks trees whose leaves match one by one under ``treedef`` (names may differ)."""
  leaves = [jax.tree.leaves(t) for t in trees]
  return jax.tree.unflatten(treedef, [jnp.stack(column) for column in zip(*leaves)])


def _body(st: StageState) -> StageState:
  return st._replace(delay_line=None)


@functools.partial(jax.jit, static_argnums=0)
def _parts_finite(part_list, states) -> jax.Array:
  flags = []
  for part, st in zip(part_list, states):
    trees = (st.params, st.opt_state)
    if not part.stacked:
      flags.append(engine.all_finite(trees)[None])
      continue
    rows = [jnp.all(jnp.isfinite(a), axis=tuple(range(1, a.ndim)))
            for a in jax.tree.leaves(trees) if jnp.issubdtype(a.dtype, jnp.inexact)]
    flags.append(jnp.all(jnp.stack(rows), axis=0) if rows
                 else jnp.ones((part.stop - part.start,), bool))
  return jnp.concatenate(flags)


def shard_parts(spans, delays, first: int, stop: int) -> tuple[parts.Part, ...]:
  """The parts of stages ``first .. stop-1`` (one device's share on a mesh): each part span
  (:func:`find_stacks`; None: every stage alone) cut to the share. The piece of a stack is a stack,
  however short, so that its delay is a traced value as in :class:`StackedPipeline` and the numbers
  are that runner's bit for bit."""
  if spans is None:
    return parts.single_stages(first, stop)
  cut = [(max(a, first), min(z, stop), z - a > 1) for a, z in spans]
  return tuple(parts.Part.stack(a, z, delays) if stacked else parts.Part(a, z)
               for a, z, stacked in cut if a < z)


def advance_shard(pipe: Pipeline, shard: tuple[parts.Part, ...], stages: tuple[StageState, ...],
                  stack_lines: tuple, inbound: Packet, cotangent: PyTree, tick, rng,
                  options: TickOptions = TickOptions()):
  """A mesh device's tick of its parts ``shard`` (:func:`shard_parts`).

  ``stages`` holds every stage's state, a stack's stages without their delay lines, and
  ``stack_lines`` each stack's rings end to end (in ``shard``'s order). Each stack's stages are
  stacked for the tick and cut back after it (:func:`pipejax.core.parts.advance_parts`).
  Returns the new stages, the new ``stack_lines`` (or, with ``options.delay_line_entries``, each
  stack's new entries) and each part's metrics.
  """
  first = shard[0].start
  states, lines = [], iter(stack_lines)
  for part in shard:
    own = stages[part.start - first:part.stop - first]
    if not part.stacked:
      states.append(own[0])
      continue
    states.append(_stack([_body(st) for st in own], jax.tree.structure(_body(own[0])))
                  ._replace(delay_line=next(lines)))
  new_states, part_metrics = parts.advance_parts(pipe, pipe.delays, shard, states, inbound,
                                                 cotangent, tick, rng, options)
  new_stages, new_lines = [], []
  for part, st in zip(shard, new_states):
    if not part.stacked:
      new_stages.append(st)
      continue
    new_lines.append(st.delay_line)
    leaves = jax.tree.leaves(_body(st))
    new_stages.extend(jax.tree.structure(_body(own)).unflatten([leaf[i] for leaf in leaves])
                      for i, own in enumerate(stages[part.start - first:part.stop - first]))
  return tuple(new_stages), tuple(new_lines), part_metrics


class StackedPipeline(Runner):
  """A :class:`~pipejax.core.engine.Pipeline` whose spans of identical stages tick as stacks.

  The same numbers as ``pipeline`` (tests/parallel/test_stacking.py), in fewer operations per
  tick and a compile time that does not grow with the length of a run. The logical state
  (:meth:`to_logical`, what checkpoints hold) is the pipeline's own, so either layout resumes
  the other's checkpoints.

  Args:
    pipeline: the single-device pipeline.
    part_spans: contiguous ``(start, stop)`` spans covering every stage, one per part (a stage or
      a stack); default
      :func:`find_stacks`. A run of two or more stages is a stack: its stages must be identical.
  """

  def __init__(self, pipeline: Pipeline, part_spans=None):
    self.pipeline = pipeline
    self.part_spans = tuple(find_stacks(pipeline) if part_spans is None else part_spans)
    spec = pipeline.state_spec
    self._stacks = {}
    for start, stop in self.part_spans:
      if stop - start < 2:
        continue
      inits = []
      for s in range(start, stop):
        inits.append(inits[-1] if inits and pipeline.model.repeats(s)
                     else init_program(pipeline, s))
      together = None not in inits and len({p.text for p in inits}) == 1
      self._stacks[start] = _Stack(
          start, stop, tuple(jax.tree.structure(_body(st)) for st in spec.stages[start:stop]),
          tuple(jax.tree.structure(st.delay_line) for st in spec.stages[start:stop]),
          parts.Rings.of(pipeline.delays[start:stop]),
          inits[0] if together else None,
          np.stack([p.salts for p in inits]) if together else None)
    self.parts = shard_parts(self.part_spans, pipeline.delays, 0, pipeline.num_stages)
    self._jit_tick, self._jit_run, self._jit_run_full = self._compile()
    self._jit_to_logical = self._unstack  # not jitted whole: see _unstack
    self._jit_from_logical = jax.jit(self._stack)
    self._jit_init = initial.CompiledInit(self._init)
    self._state_spec = jax.eval_shape(self._stack, spec)

  @property
  def num_stages(self) -> int:
    return self.pipeline.num_stages

  @property
  def stacked(self) -> bool:
    """Whether any run of stages is stacked."""
    return bool(self._stacks)

  # ------------------------------------------------------------------ layout

  def init(self, rng: jax.Array, fill_value: float = 0.0) -> StackedState:
    """The pipeline's initial state (the same numbers), in the stacked layout.

    A stack whose stages initialize alike initializes under one ``vmap`` over its stages' keys,
    so this program, like the tick, does not grow with the length of a stack. A state larger
    than the device's memory is refused before anything is allocated.
    """
    if not checks.traced((rng, fill_value)):
      checks.check_state_fits(accounting.tree_bytes(self._state_spec), self.num_stages)
    return self._jit_init(raw_key(rng), jnp.float32(fill_value))

  def _init(self, rng: jax.Array, fill_value: jax.Array) -> StackedState:
    pipe = self.pipeline
    keys, run_key = pipe.initial.keys(rng)
    states = []
    for start, stop in self.part_spans:
      stack = self._stacks.get(start)
      if stack is None:
        states.append(pipe.initial.stage_state(start, pipe.initial.weights(start, keys[start]),
                                              fill_value))
      elif stack.init is not None:
        body = stack.init.run(keys[start:stop], pipe.delays[start:stop], fill_value,
                              stack.salts)
        one = jax.tree.map(lambda a: a[0], body)
        states.append(body._replace(delay_line=pipe.initial.empty_delay_line(
            start, one, stack.rings.slots, fill_value)))
      else:
        states.append(self._stack_stages(stack, [
            pipe.initial.stage_state(s, pipe.initial.weights(s, keys[s]), fill_value)
            for s in range(start, stop)]))
    return StackedState(tuple(states), jnp.array(0, jnp.int32), run_key)

  def from_logical(self, logical_state: PipelineState) -> StackedState:
    self.pipeline.check_state(logical_state)
    return self._jit_from_logical(logical_state)

  def to_logical(self, state: StackedState) -> PipelineState:
    self.check_state(state)
    return self._jit_to_logical(state)

  def _stack(self, logical: PipelineState) -> StackedState:
    stacked = []
    for start, stop in self.part_spans:
      stages = logical.stages[start:stop]
      stack = self._stacks.get(start)
      if stack is None:
        stacked.append(stages[0])
        continue
      stacked.append(self._stack_stages(stack, stages))
    return StackedState(tuple(stacked), logical.tick, logical.rng)

  @staticmethod
  def _stack_stages(stack: _Stack, stages) -> StageState:
    """A stack's stages as one stacked state, their rings laid end to end."""
    body = _stack([_body(st) for st in stages], stack.treedefs[0])
    return body._replace(delay_line=stack.rings.join([st.delay_line for st in stages]))

  def _unstack(self, state: StackedState) -> PipelineState:
    # Cut on the host: on the device a stage's row is a program (or a dispatch) per leaf and
    # stage, and one program for the whole state holds S x leaves slices, whose compile time
    # grows faster than that count (minutes at 128 stages). A stack comes to the host in one
    # transfer and its stages go back in one. The copies never alias the stacked state, which
    # run donates.
    stages = []
    for (start, _), part in zip(self.part_spans, state.parts):
      stack = self._stacks.get(start)
      if stack is None:
        stages.append(jax.tree.map(jnp.copy, part))
        continue
      device = min(jax.tree.leaves(part)[0].devices(), key=lambda d: d.id)
      host = jax.device_get(part)
      body = jax.tree.leaves(_body(host))
      lines = stack.rings.cut(jax.tree.map(np.array, host.delay_line), stack.line_treedefs)
      cut = [jax.tree.unflatten(treedef, [np.array(leaf[i]) for leaf in body])
             ._replace(delay_line=line)
             for i, (treedef, line) in enumerate(zip(stack.treedefs, lines))]
      stages.extend(jax.device_put(cut, device))
    return PipelineState(tuple(stages), jnp.copy(state.tick), jnp.copy(state.rng))

  def check_state(self, state: StackedState) -> None:
    if isinstance(state, PipelineState):
      raise checks.PipelineError(
          "This is a logical PipelineState; a StackedPipeline ticks the stacked state of its "
          "init(), or stacked.from_logical(state) of a logical one.")
    checks.check_state(state, self._state_spec, self.num_stages)

  def every_slot_full(self, state: StackedState) -> bool:
    checks.check_on_host("every_slot_full", state)
    checks.check_not_donated(state)
    return slots_full(state.parts)

  def host_params(self, state: StackedState) -> list:
    """See :meth:`pipejax.core.runner.Runner.host_params`: a stack's rows cut on the host."""
    self.check_state(state)
    spec, params = self.pipeline.state_spec, jax.device_get([p.params for p in state.parts])
    out = []
    for part, host in zip(self.parts, params):
      if not part.stacked:
        out.append(host)
        continue
      leaves = jax.tree.leaves(host)
      out.extend(jax.tree.unflatten(jax.tree.structure(spec.stages[s].params),
                                    [leaf[i] for leaf in leaves])
                 for i, s in enumerate(range(part.start, part.stop)))
    return out

  def weights_finite(self, state: StackedState) -> np.ndarray:
    """See :meth:`pipejax.core.runner.Runner.weights_finite`: a stack's flags row by row."""
    self.check_state(state)
    return np.asarray(_parts_finite(self.parts, state.parts))

  def held_stash_bytes(self, state: StackedState) -> int:
    """Bytes of stashed activations the state's delay lines hold."""
    return accounting.held_stash_bytes(state.parts)

  # ------------------------------------------------------------------ one tick

  def _tick(self, state: StackedState, batch: Batch, every_slot_full: bool = False):
    inbound = Packet(batch.inputs, batch.labels, jnp.asarray(batch.valid, bool), state.tick)
    new_parts, part_metrics = parts.advance_parts(
        self.pipeline, self.pipeline.delays, self.parts, state.parts, inbound, None, state.tick,
        state.rng, TickOptions(every_slot_full=every_slot_full))
    return (StackedState(new_parts, state.tick + 1, state.rng), parts.tick_metrics(part_metrics))

def pipeline_and_spans(runner) -> tuple[Pipeline, tuple[tuple[int, int], ...] | None]:
  """What a mesh ticks for ``runner``: its single-device pipeline, and the part spans whose
  pieces each device stacks (:func:`shard_parts`), None when it runs stage by stage."""
  if isinstance(runner, StackedPipeline):
    return runner.pipeline, (runner.part_spans if runner.stacked else None)
  if isinstance(runner, Pipeline):
    return runner, None
  raise MeshError(f"ShardedPipeline takes a Pipeline, or a StackedPipeline to stack each "
                  f"device's share of its stacks; got {type(runner).__name__}.")
