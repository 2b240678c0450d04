"""The stacked layout of a local pipeline's state: each stacked part's stages stacked into one.

A stacked part (``pipejax.core.stackable``) keeps its stages' weights, optimizer states, registers
and variables on a leading stage axis, and its stages' rings end to end
(:class:`pipejax.core.parts.Rings`), so it holds exactly the per-stage formula's bytes and a tick
reads and writes them with one gather and one scatter per leaf. Within its part each stage's slots
are where the logical state has them, so :meth:`StackedLayout.unstack` is slicing and
:meth:`StackedLayout.stack` stacking back: the logical state, which checkpoints hold, is the same
in every layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.core import accounting, checks, initial, parts, stackable
from pipejax.core.state import PipelineState, StageState, raw_key

PyTree = Any


class StackedState(NamedTuple):
  """A :class:`~pipejax.core.state.PipelineState` with each stacked part's stages stacked into one.

  ``parts[k]`` is the :class:`~pipejax.core.state.StageState` of a single stage, or of a stacked
  part with a leading stage axis on every leaf but the delay line's, whose rings lie end to end.
  """

  parts: tuple[StageState, ...]
  tick: jax.Array
  rng: jax.Array


class _Stacked(NamedTuple):
  """Static facts of one stacked part."""

  start: int
  stop: int
  treedefs: tuple  # each stage's StageState structure, delay line left out
  line_treedefs: tuple  # each stage's DelayLine structure
  rings: parts.Rings  # where each stage's ring lies in the part's buffers
  init: stackable.InitProgram | None  # the stages' one initialization program, if they have one
  salts: np.ndarray | None  # (n, k): each stage's salts for it


def stack_trees(trees, treedef):
  """Stacks trees whose leaves match one by one under ``treedef`` (names may differ)."""
  leaves = [jax.tree.leaves(t) for t in trees]
  return jax.tree.unflatten(treedef, [jnp.stack(column) for column in zip(*leaves)])


def without_line(st: StageState) -> StageState:
  """A stage's state without its delay line: what a stacked part stacks row by row."""
  return st._replace(delay_line=None)


def _check_alike(logical: PipelineState, start: int, stop: int) -> None:
  """Refuses a stacked part whose stages' states differ in their leaves' shapes or dtypes."""
  leaves = lambda s: [(a.shape, a.dtype) for a in jax.tree.leaves(without_line(logical.stages[s]))]
  for s in range(start + 1, stop):
    if leaves(s) != leaves(start):
      raise checks.PipelineError(
          f"Stages {start} .. {stop - 1} are given as one stacked part, but stage {s}'s state "
          f"differs from stage {start}'s in its shapes or dtypes: only identical stages stack. "
          f"Pass stack=True to find the identical runs, or give stage {s} a part of its own.")


class StackedLayout:
  """Where a local pipeline's stacked parts keep their stages, and the moves between this layout
  and the logical one.

  Args:
    init: the pipeline's :class:`~pipejax.core.initial.StateInit`.
    part_spans: each part's ``(start, stop)`` stages, contiguous and covering every stage; a part
      of two or more stages is stacked, and its stages must be identical.
  """

  def __init__(self, init: initial.StateInit, part_spans: Sequence[tuple[int, int]]):
    spec, logical = init.spec, init.state_spec
    self.initial, self.part_spans = init, tuple(part_spans)
    self._stacked = {}
    for start, stop in self.part_spans:
      if stop - start < 2:
        continue
      _check_alike(logical, start, stop)
      programs = []
      for s in range(start, stop):
        programs.append(programs[-1] if programs and spec.model.repeats(s)
                        else stackable.init_program(init, s))
      together = None not in programs and len({p.text for p in programs}) == 1
      self._stacked[start] = _Stacked(
          start, stop,
          tuple(jax.tree.structure(without_line(st)) for st in logical.stages[start:stop]),
          tuple(jax.tree.structure(st.delay_line) for st in logical.stages[start:stop]),
          parts.Rings.of(spec.delays[start:stop]),
          programs[0] if together else None,
          np.stack([p.salts for p in programs]) if together else None)
    self._compiled_init = initial.CompiledInit(self._init)
    self.jit_stack = jax.jit(self.stack)
    self.state_spec = jax.eval_shape(self.stack, logical)

  def init(self, rng: jax.Array, fill_value: float = 0.0) -> StackedState:
    """The logical init's numbers in this layout. A stacked part whose stages initialize alike
    initializes under one ``vmap`` over their keys, so this program, like the tick, does not
    grow with the length of a part. A state larger than the device's memory is refused before
    anything is allocated."""
    if not checks.traced((rng, fill_value)):
      checks.check_state_fits(accounting.tree_bytes(self.state_spec),
                              self.initial.spec.num_stages)
    return self._compiled_init(raw_key(rng), jnp.float32(fill_value))

  def _init(self, rng: jax.Array, fill_value: jax.Array) -> StackedState:
    init, delays = self.initial, self.initial.spec.delays
    keys, run_key = init.keys(rng)
    states = []
    for start, stop in self.part_spans:
      stacked = self._stacked.get(start)
      if stacked is None:
        states.append(init.stage_state(start, init.weights(start, keys[start]), fill_value))
      elif stacked.init is not None:
        body = stacked.init.run(keys[start:stop], delays[start:stop], fill_value, stacked.salts)
        one = jax.tree.map(lambda a: a[0], body)
        states.append(body._replace(delay_line=init.empty_delay_line(
            start, one, stacked.rings.slots, fill_value)))
      else:
        states.append(self._stack_stages(stacked, [
            init.stage_state(s, init.weights(s, keys[s]), fill_value)
            for s in range(start, stop)]))
    return StackedState(tuple(states), jnp.array(0, jnp.int32), run_key)

  def stack(self, logical: PipelineState) -> StackedState:
    """A logical state in this layout (traceable)."""
    stacked = []
    for start, stop in self.part_spans:
      stages = logical.stages[start:stop]
      facts = self._stacked.get(start)
      stacked.append(stages[0] if facts is None else self._stack_stages(facts, stages))
    return StackedState(tuple(stacked), logical.tick, logical.rng)

  @staticmethod
  def _stack_stages(facts: _Stacked, stages) -> StageState:
    """A stacked part's stages as one stacked state, their rings laid end to end."""
    body = stack_trees([without_line(st) for st in stages], facts.treedefs[0])
    return body._replace(delay_line=facts.rings.join([st.delay_line for st in stages]))

  def unstack(self, state: StackedState) -> PipelineState:
    """The logical state, in arrays of its own (the stacked state's buffers may be donated)."""
    # Cut on the host: on the device a stage's row is a program (or a dispatch) per leaf and
    # stage, and one program for the whole state holds S x leaves slices, whose compile time
    # grows faster than that count (minutes at 128 stages). A stacked part comes to the host in
    # one transfer and its stages go back in one.
    stages = []
    for (start, _), part in zip(self.part_spans, state.parts):
      facts = self._stacked.get(start)
      if facts is None:
        stages.append(jax.tree.map(jnp.copy, part))
        continue
      device = min(jax.tree.leaves(part)[0].devices(), key=lambda d: d.id)
      host = jax.device_get(part)
      body = jax.tree.leaves(without_line(host))
      lines = facts.rings.cut(jax.tree.map(np.array, host.delay_line), facts.line_treedefs)
      cut = [jax.tree.unflatten(treedef, [np.array(leaf[i]) for leaf in body])
             ._replace(delay_line=line)
             for i, (treedef, line) in enumerate(zip(facts.treedefs, lines))]
      stages.extend(jax.device_put(cut, device))
    return PipelineState(tuple(stages), jnp.copy(state.tick), jnp.copy(state.rng))
