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

**Delay lines** (docs/design.md §6.1). Stage ``s`` of a stack holds ``L_s = D_s + 1`` slots, and
``L_s`` differs from stage to stage. The stack keeps one buffer per leaf with all its stages'
rings laid end to end, stage ``i`` at offset ``o_i = L_0 + ... + L_{i-1}``, so it holds exactly
the per-stage formula's bytes. A tick gathers slot ``o_i + (t + 1) mod L_i`` of every stage
(the oldest input) and scatters the new entries to ``o_i + t mod L_i``: one gather and one
scatter of ``n`` rows per leaf, whatever ``n``. Within its span each stage's slots are where the
logical state has them, so :meth:`StackedPipeline.to_logical` is slicing and stacking back.

**On a mesh** (docs/design.md §6.1). ``ShardedPipeline(StackedPipeline(pipe), mesh)`` keeps
each stage's state in its per-stage buffers and advances each device's stages with
:func:`advance_stages`: the device's piece of every stack (:func:`pieces`) is stacked for the
tick, run through the same vmapped steps, and cut back into stages, each with its own delay line.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np

from pipejax.core import accounting, checks, engine
from pipejax.core.engine import Pipeline, TickOptions
from pipejax.parallel.mesh import MeshError
from pipejax.core.runner import ScanRunner
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
  return _as_text((pipeline.forward_program(s), update)), str(line)


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
  """Stage ``s``'s ``init_stage`` traced with its key, delay and fill value as inputs, and the
  constants it folds into its key (flax derives each weight's key from its module's name, so
  ``block3`` and ``block4`` fold in different ones) lifted out as a further input.

  Stages whose programs are then equal initialize under one ``vmap`` over their keys, delays and
  salts, with the per-stage init's numbers. None when the method's optimizer state cannot start
  from a traced delay.
  """
  closed, out_shape = pipeline.traced_init_stage(s)
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
  num, spec = pipeline.num_stages, pipeline.state_spec
  signatures = [None] + [_signature(pipeline, s, spec) for s in range(1, num - 1)] + [None]
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
  offsets: np.ndarray  # where each stage's ring starts in the stack's buffers
  lengths: np.ndarray  # each stage's ring length D_s + 1
  init: InitProgram | None  # the stages' one initialization program, if they have one
  salts: np.ndarray | None  # (n, k): each stage's salts for it


def _stack(trees, treedef):
  """Stacks trees whose leaves match one by one under ``treedef`` (names may differ)."""
  leaves = [jax.tree.leaves(t) for t in trees]
  return jax.tree.unflatten(treedef, [jnp.stack(column) for column in zip(*leaves)])


def _body(st: StageState) -> StageState:
  return st._replace(delay_line=None)


def _stacked_steps(pipe: Pipeline, start: int, stop: int, st: StageState, inbound: Packet,
                   cotangent: PyTree, rng, read_oldest, options: TickOptions):
  """The engine's two steps for identical stages ``start .. stop-1`` under ``vmap``.

  ``st`` is their stacked state; its delay line, not mapped, only gives the entries' structure
  and dtypes: ``read_oldest`` maps the stacked entries this tick writes to the stacked oldest
  entries, one per stage. ``inbound`` enters the first stage, ``cotangent`` the last. Returns
  the stacked entries, the stacked new state without its delay line, and the stacked metrics.
  """
  shift_in = lambda first, own: jnp.concatenate([first[None], own[:-1]])
  shift_back = lambda own, last: jnp.concatenate([own[1:], last[None]])
  inbound = jax.tree.map(shift_in, inbound, st.forward_out)
  cotangent = jax.tree.map(shift_back, st.backward_out, cotangent)
  numbers = jnp.arange(start, stop, dtype=jnp.int32)
  delays = jnp.asarray(pipe.delays[start:stop], jnp.int32)
  body_axes = StageState(0, 0, None, 0, 0, 0)
  forward = jax.vmap(
      lambda st, inbound, number, delay: pipe.forward_step(start, st, inbound, rng, number,
                                                           delay),
      in_axes=(body_axes, 0, 0, 0))(st, inbound, numbers, delays)
  oldest = read_oldest(forward.entry)
  new, metrics = jax.vmap(
      lambda st, forward, oldest, inbound, cotangent, number, delay: pipe.backward_step(
          start, st, forward, oldest, inbound, cotangent, rng, number, delay, options),
      in_axes=(body_axes, 0, 0, 0, 0, 0, 0))(st, forward, oldest, inbound, cotangent, numbers,
                                              delays)
  return forward.entry, new, metrics


@jax.jit
def _row(leaf, i):
  return jax.lax.dynamic_index_in_dim(leaf, i, keepdims=False)


def _spans(leaf, spans: tuple):
  """Each ``(offset, length)`` span of a ring buffer's leading axis, as an array of its own.

  Cut on the host: the lengths differ from stage to stage, so on the device it takes a program
  per length, or one program with a slice per stage whose compile grows faster than the stack.
  Each span is copied, so nothing aliases the buffer, which ``run`` donates.
  """
  host, device = np.asarray(jax.device_get(leaf)), min(leaf.devices(), key=lambda d: d.id)
  return tuple(jax.device_put(np.array(host[o:o + n]), device) for o, n in spans)


def pieces(spans, first: int, stop: int) -> list[tuple[int, int, bool]]:
  """The part spans cut to stages ``first .. stop-1`` (one device's share of them on a mesh), each as
  ``(start, stop, stacked)``: ``stacked`` when the run is a stack, however short its piece."""
  cut = [(max(a, first), min(z, stop), z - a > 1) for a, z in spans]
  return [(a, z, stacked) for a, z, stacked in cut if a < z]


def advance_stages(pipe: Pipeline, part_spans, first: int, stages: tuple[StageState, ...],
                   inbound: Packet, cotangent: PyTree, tick, rng,
                   options: TickOptions = TickOptions()):
  """:meth:`Pipeline.advance_stages <pipejax.core.engine.Pipeline.advance_stages>` (the same
  arguments, state and results) with each piece of a run of identical stages advanced stacked.

  This is a mesh device's tick (``pipejax.parallel.sharding``): its stages stay in their per-stage
  layout, and its piece of each stack in ``part_spans`` (:func:`find_stacks`) is stacked for the tick,
  run under ``vmap`` and cut back into stages. A piece of one stage runs stacked too, so that
  its delay is a traced value as in :class:`StackedPipeline`: the numbers are that runner's bit
  for bit. Each stage keeps its own delay line: the stacked step reads every stage's oldest
  entry from it and returns the entries for the caller to write, as the per-stage engine does.
  """
  new_stages, stage_metrics = [], []
  for a, z, stacked in pieces(part_spans, first, first + len(stages)):
    own = stages[a - first:z - first]
    piece_in = inbound if a == first else stages[a - first - 1].forward_out
    piece_cotangent = cotangent if z == first + len(stages) else stages[z - first].backward_out
    if not stacked:
      new, metrics = pipe.advance_stage(a, own[0], piece_in, piece_cotangent, tick, rng, options)
      new_stages.append(new)
      stage_metrics.append(metrics)
      continue
    treedefs = [jax.tree.structure(_body(st)) for st in own]

    def read_oldest(entries, own=own):
      per_stage = [st.delay_line.read(tick, jax.tree.map(lambda a, i=i: a[i], entries))
                   for i, st in enumerate(own)]
      return jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_stage)

    # The first stage's line stands for all: a step only takes its structure and dtypes.
    body = _stack([_body(st) for st in own], treedefs[0])._replace(delay_line=own[0].delay_line)
    entries, new, metrics = _stacked_steps(pipe, a, z, body, piece_in, piece_cotangent, rng,
                                           read_oldest, options)
    leaves = jax.tree.leaves(new)
    for i, st in enumerate(own):
      entry = jax.tree.map(lambda a, i=i: a[i], entries)
      line = entry if options.delay_line_entries else st.delay_line.write(tick, entry)
      new_stages.append(jax.tree.unflatten(treedefs[i], [leaf[i] for leaf in leaves])
                        ._replace(delay_line=line))
      stage_metrics.append(jax.tree.map(lambda a, i=i: a[i], metrics))
  return tuple(new_stages), stage_metrics


class StackedPipeline(ScanRunner):
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
      lengths = np.asarray([d + 1 for d in pipeline.delays[start:stop]])
      inits = [init_program(pipeline, s) for s in range(start, stop)]
      together = None not in inits and len({p.text for p in inits}) == 1
      self._stacks[start] = _Stack(
          start, stop, tuple(jax.tree.structure(_body(st)) for st in spec.stages[start:stop]),
          tuple(jax.tree.structure(st.delay_line) for st in spec.stages[start:stop]),
          np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths,
          inits[0] if together else None,
          np.stack([p.salts for p in inits]) if together else None)
    self._stack_index = {k for k, (start, _) in enumerate(self.part_spans) if start in self._stacks}
    self._jit_tick, self._jit_run, self._jit_run_full = self._compile()
    self._jit_to_logical = self._unstack  # not jitted whole: see _unstack
    self._jit_from_logical = jax.jit(self._stack)
    self._jit_init = engine.CompiledInit(self._init)
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
    keys, run_key = pipe.init_keys(rng)
    parts = []
    for start, stop in self.part_spans:
      stack = self._stacks.get(start)
      if stack is None:
        parts.append(pipe.initial_stage(start, pipe.stage_weights(start, keys[start]), fill_value))
      elif stack.init is not None:
        body = stack.init.run(keys[start:stop], pipe.delays[start:stop], fill_value,
                              stack.salts)
        one = jax.tree.map(lambda a: a[0], body)
        parts.append(body._replace(delay_line=pipe.empty_delay_line(
            start, one, int(stack.lengths.sum()), fill_value)))
      else:
        parts.append(self._stack_stages(stack, [
            pipe.initial_stage(s, pipe.stage_weights(s, keys[s]), fill_value)
            for s in range(start, stop)]))
    return StackedState(tuple(parts), jnp.array(0, jnp.int32), run_key)

  def from_logical(self, logical_state: PipelineState) -> StackedState:
    self.pipeline.check_state(logical_state)
    return self._jit_from_logical(logical_state)

  def to_logical(self, state: StackedState) -> PipelineState:
    self.check_state(state)
    return self._jit_to_logical(state)

  def _stack(self, logical: PipelineState) -> StackedState:
    parts = []
    for start, stop in self.part_spans:
      stages = logical.stages[start:stop]
      stack = self._stacks.get(start)
      if stack is None:
        parts.append(stages[0])
        continue
      parts.append(self._stack_stages(stack, stages))
    return StackedState(tuple(parts), logical.tick, logical.rng)

  @staticmethod
  def _stack_stages(stack: _Stack, stages) -> StageState:
    """A stack's stages as one stacked state, their rings laid end to end."""
    body = _stack([_body(st) for st in stages], stack.treedefs[0])
    line_leaves = [jax.tree.leaves(st.delay_line) for st in stages]
    line = jax.tree.unflatten(stack.line_treedefs[0],
                              [jnp.concatenate(column) for column in zip(*line_leaves)])
    return body._replace(delay_line=line)

  def _unstack(self, state: StackedState) -> PipelineState:
    # Leaf by leaf: one program for the whole state holds S x leaves slices, and XLA's compile
    # time grows faster than that count (minutes at 128 stages). A stage's row of a stacked leaf
    # is one program per leaf shape, its index an argument (_row), so its compile does not grow
    # with the stack; the rings differ in length from stage to stage, so they are cut on the host
    # (_spans). The single stages, tick and rng are copied so that the logical state never
    # aliases the stacked one, which run donates.
    stages = []
    for (start, _), part in zip(self.part_spans, state.parts):
      stack = self._stacks.get(start)
      if stack is None:
        stages.append(jax.tree.map(jnp.copy, part))
        continue
      n, where = len(stack.lengths), tuple(zip(stack.offsets.tolist(), stack.lengths.tolist()))
      body = [[_row(leaf, i) for i in range(n)] for leaf in jax.tree.leaves(_body(part))]
      line = [_spans(leaf, where) for leaf in jax.tree.leaves(part.delay_line)]
      for i in range(n):
        st = jax.tree.unflatten(stack.treedefs[i], [leaf[i] for leaf in body])
        stage_line = jax.tree.unflatten(stack.line_treedefs[i], [leaf[i] for leaf in line])
        stages.append(st._replace(delay_line=stage_line))
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

  def held_stash_bytes(self, state: StackedState) -> int:
    """Bytes of stashed activations the state's delay lines hold."""
    return accounting.held_stash_bytes(state.parts)

  # ------------------------------------------------------------------ one tick

  def _advance_stack(self, stack: _Stack, st: StageState, inbound: Packet, cotangent: PyTree,
                     tick, rng, options: TickOptions):
    """One tick of a stack: the engine's steps under vmap, the packed rings between."""
    read = jnp.asarray(stack.offsets) + (tick + 1) % jnp.asarray(stack.lengths)
    write = jnp.asarray(stack.offsets) + tick % jnp.asarray(stack.lengths)
    # Every index lies in its own stage's span. Indexing's default mode guards each with a
    # select, which writes the gathered slots out once more: a pass over the stashed weights.
    read_oldest = lambda entry: jax.tree.map(
        lambda ring: ring.at[read].get(mode="promise_in_bounds", indices_are_sorted=True,
                                       unique_indices=True), st.delay_line)
    entry, new, metrics = _stacked_steps(self.pipeline, stack.start, stack.stop, st, inbound,
                                         cotangent, rng, read_oldest, options)
    line = jax.tree.map(
        lambda ring, new: ring.at[write].set(new, indices_are_sorted=True, unique_indices=True),
        st.delay_line, entry)
    return new._replace(delay_line=line), metrics

  def _tick(self, state: StackedState, batch: Batch, every_slot_full: bool = False):
    parts = state.parts
    last_of = lambda k: (parts[k].forward_out if k not in self._stack_index
                         else jax.tree.map(lambda a: a[-1], parts[k].forward_out))
    first_of = lambda k: (parts[k].backward_out if k not in self._stack_index
                          else jax.tree.map(lambda a: a[0], parts[k].backward_out))
    options = TickOptions(every_slot_full=every_slot_full)
    new_parts, stage_metrics = [], []
    for k, ((start, _), st) in enumerate(zip(self.part_spans, parts)):
      inbound = (Packet(batch.inputs, batch.labels, jnp.asarray(batch.valid, bool), state.tick)
                 if k == 0 else last_of(k - 1))
      cotangent = first_of(k + 1) if k + 1 < len(parts) else None
      if k in self._stack_index:
        new, metrics = self._advance_stack(self._stacks[start], st, inbound, cotangent,
                                           state.tick, state.rng, options)
      else:
        new, metrics = self.pipeline.advance_stage(start, st, inbound, cotangent, state.tick,
                                                   state.rng, options)
      new_parts.append(new)
      stage_metrics.append(metrics)
    return (StackedState(tuple(new_parts), state.tick + 1, state.rng),
            engine.tick_metrics(stage_metrics))


def pipeline_and_spans(runner) -> tuple[Pipeline, tuple[tuple[int, int], ...] | None]:
  """What a mesh ticks for ``runner``: its single-device pipeline, and the part spans whose pieces each
  device stacks (:func:`advance_stages`), None when it runs stage by stage."""
  if isinstance(runner, StackedPipeline):
    return runner.pipeline, (runner.part_spans if runner.stacked else None)
  if isinstance(runner, Pipeline):
    return runner, None
  raise MeshError(f"ShardedPipeline takes a Pipeline, or a StackedPipeline to stack each "
                  f"device's share of its stacks; got {type(runner).__name__}.")
