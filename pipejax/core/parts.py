"""One tick over a pipeline's parts: the only place that routes registers between neighbours.

A *part* is consecutive stages a tick advances as one: a single stage, or a *stacked* part of
identical stages whose states are stacked on a leading stage axis and advanced as one under
``vmap`` (``pipejax.core.stackable`` finds them). Every layout ticks through
:func:`advance_parts`:

* :class:`~pipejax.core.engine.Pipeline`, the local runner: every stage a part of its own, or its
  stacked parts and single stages;
* each device of :class:`~pipejax.parallel.sharding.ShardedPipeline`: the parts of its shard, the
  packet and cotangent that the mesh delivered from its neighbour devices entering at its ends.

Routing follows the engine's timing (``pipejax.core.engine``): part k's inbound packet is the
``forward_out`` register its upstream neighbour wrote last tick (the last row of a stacked
part's), and the cotangent entering it is its downstream neighbour's ``backward_out`` (the first
row of a stacked part's). Inside a stacked part the same holds row by row: the rows shift by one.

**A stacked part's delay lines** lie end to end (:class:`Rings`): one buffer per leaf holding
every stage's ring, stage i's ``D_i + 1`` slots at offset ``o_i``. A tick gathers each stage's
oldest slot and scatters its new entry: one gather and one scatter per leaf, whatever the part's
length. A single stage keeps its own :class:`~pipejax.core.state.DelayLine`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.core.stage_maths import StageMaths, TickOptions, all_finite
from pipejax.core.state import DelayLine, Packet, StageState

PyTree = Any


class Rings(NamedTuple):
  """Where each stage of a stacked part keeps its ring in buffers that hold them end to end."""

  offsets: tuple[int, ...]  # o_i = L_0 + ... + L_{i-1}
  lengths: tuple[int, ...]  # L_i = D_i + 1

  @classmethod
  def of(cls, delays: Sequence[int]) -> Rings:
    lengths = np.asarray([d + 1 for d in delays])
    return cls(tuple(np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()),
               tuple(lengths.tolist()))

  @property
  def slots(self) -> int:
    return sum(self.lengths)

  def join(self, lines: Sequence[DelayLine]) -> DelayLine:
    """Each stage's own line, laid end to end in the first one's structure (the stages' names
    may differ: PipeDream's stashed weights); numpy leaves stay numpy, on the host."""
    def concatenate(column):
      on_host = all(isinstance(a, np.ndarray) for a in column)
      return np.concatenate(column) if on_host else jnp.concatenate(column)
    columns = zip(*(jax.tree.leaves(line) for line in lines))
    return jax.tree.structure(lines[0]).unflatten([concatenate(c) for c in columns])

  def cut(self, line: DelayLine, treedefs: Sequence[Any]) -> tuple[DelayLine, ...]:
    """Each stage's own line, cut from rings end to end (``treedefs``: each line's structure,
    whose names may differ between the stages)."""
    leaves = jax.tree.leaves(line)
    return tuple(treedef.unflatten([a[offset:offset + length] for a in leaves])
                 for treedef, offset, length in zip(treedefs, self.offsets, self.lengths))

  def read(self, line: DelayLine, tick) -> DelayLine:
    """Every stage's oldest entry (slot ``o_i + (t + 1) mod L_i``), stacked."""
    where = jnp.asarray(self.offsets) + (tick + 1) % jnp.asarray(self.lengths)
    # Every index lies in its own stage's ring. Indexing's default mode guards each with a
    # select, which writes the gathered slots out once more: a pass over the stashed weights.
    return jax.tree.map(lambda ring: ring.at[where].get(
        mode="promise_in_bounds", indices_are_sorted=True, unique_indices=True), line)

  def write(self, line: DelayLine, tick, entries: DelayLine) -> DelayLine:
    """Each stage's new entry into slot ``o_i + t mod L_i``."""
    where = jnp.asarray(self.offsets) + tick % jnp.asarray(self.lengths)
    return jax.tree.map(
        lambda ring, new: ring.at[where].set(new, indices_are_sorted=True, unique_indices=True),
        line, entries)


class Part(NamedTuple):
  """Stages ``start .. stop-1`` advanced together: one stage (``rings`` None), or a stacked part
  whose state has a leading stage axis and whose delay lines lie end to end as ``rings``."""

  start: int
  stop: int
  rings: Rings | None = None

  @classmethod
  def stack(cls, start: int, stop: int, delays: Sequence[int]) -> Part:
    """Stages ``start .. stop-1`` as a stacked part (``delays``: every stage's, by stage number)."""
    return cls(start, stop, Rings.of(delays[start:stop]))

  @property
  def stacked(self) -> bool:
    return self.rings is not None


def single_stages(first: int, stop: int) -> tuple[Part, ...]:
  """Stages ``first .. stop-1``, each a part of its own."""
  return tuple(Part(s, s + 1) for s in range(first, stop))


def cut_parts(part_spans: Sequence[tuple[int, int]] | None, delays: Sequence[int], first: int,
              stop: int) -> tuple[Part, ...]:
  """The parts of stages ``first .. stop-1`` (a mesh device's shard, or every stage).

  ``part_spans`` are the pipeline's parts as contiguous ``(start, stop)`` pairs, those of two or
  more stages stacked (None: every stage alone), cut here to the stages asked for. A stacked part
  cut short stays stacked, however short, so that its delay stays a traced value and the numbers
  are the whole part's bit for bit.
  """
  if part_spans is None:
    return single_stages(first, stop)
  cut = [(max(a, first), min(z, stop), z - a > 1) for a, z in part_spans]
  return tuple(Part.stack(a, z, delays) if stacked else Part(a, z) for a, z, stacked in cut
               if a < z)


@functools.partial(jax.jit, static_argnums=0)
def parts_finite(parts: tuple[Part, ...], states) -> jax.Array:
  """One flag per stage of ``parts``: are its weights and optimizer state finite (a stacked
  part's flags row by row)."""
  flags = []
  for part, st in zip(parts, states):
    trees = (st.params, st.opt_state)
    if not part.stacked:
      flags.append(all_finite(trees)[None])
      continue
    rows = [jnp.all(jnp.isfinite(a), axis=tuple(range(1, a.ndim)))
            for a in jax.tree.leaves(trees) if jnp.issubdtype(a.dtype, jnp.inexact)]
    flags.append(jnp.all(jnp.stack(rows), axis=0) if rows
                 else jnp.ones((part.stop - part.start,), bool))
  return jnp.concatenate(flags)


def _last_row(part: Part, tree):
  return jax.tree.map(lambda a: a[-1], tree) if part.stacked else tree


def _first_row(part: Part, tree):
  return jax.tree.map(lambda a: a[0], tree) if part.stacked else tree


def advance_parts(maths: StageMaths, delays: Sequence[int], parts: Sequence[Part],
                  states: Sequence[StageState], inbound: Packet, cotangent: PyTree, tick, rng,
                  options: TickOptions = TickOptions()):
  """Advances contiguous parts by one tick.

  Args:
    maths: the :class:`~pipejax.core.stage_maths.StageMaths` that advances a stage.
    delays: every stage's delay D_s (indexed by stage number).
    parts: the parts, contiguous, in stage order.
    states: each part's state (stacked for a stacked part).
    inbound: the packet entering the first part (the micro-batch, on the first stage).
    cotangent: the gradient entering the last part (None when it holds the model's last stage).
    tick, rng: the tick and the run's key.
    options: the tick's :class:`TickOptions`.

  Returns:
    The new states, and each part's metrics (stacked along the stage axis for a stacked part).
  """
  new_states, part_metrics = [], []
  for k, (part, st) in enumerate(zip(parts, states)):
    part_in = inbound if k == 0 else _last_row(parts[k - 1], states[k - 1].forward_out)
    part_cotangent = (cotangent if k == len(parts) - 1
                      else _first_row(parts[k + 1], states[k + 1].backward_out))
    advance = _advance_stacked if part.stacked else _advance_stage
    new, metrics = advance(maths, delays, part, st, part_in, part_cotangent, tick, rng, options)
    new_states.append(new)
    part_metrics.append(metrics)
  return tuple(new_states), part_metrics


def _advance_stage(maths: StageMaths, delays, part: Part, st: StageState, inbound: Packet,
                   cotangent: PyTree, tick, rng, options: TickOptions):
  """A single stage's tick: forward, delay line, backward and update."""
  s = part.start
  forward = maths.forward_step(s, st, inbound, rng)
  oldest = st.delay_line.read(tick, forward.entry)
  line = (forward.entry if options.delay_line_entries
          else st.delay_line.write(tick, forward.entry))
  new, metrics = maths.backward_step(s, st, forward, oldest, inbound, cotangent, rng,
                                     options=options)
  return new._replace(delay_line=line), metrics


_STACKED_BODY = StageState(0, 0, None, 0, 0, 0)  # vmap axes: every leaf but the delay line's


def _advance_stacked(maths: StageMaths, delays, part: Part, st: StageState, inbound: Packet,
                   cotangent: PyTree, tick, rng, options: TickOptions):
  """A stacked part's tick: the stage maths' two steps under ``vmap``, the delay lines between
  them.

  Stage number and delay enter as arrays over the stage axis (the rng fold-in, and the methods'
  delay-dependent coefficients), the code as the part's first stage's.
  """
  start, stop = part.start, part.stop
  shift_in = lambda first, own: jnp.concatenate([first[None], own[:-1]])
  shift_back = lambda own, last: jnp.concatenate([own[1:], last[None]])
  inbound = jax.tree.map(shift_in, inbound, st.forward_out)
  cotangent = jax.tree.map(shift_back, st.backward_out, cotangent)
  numbers = jnp.arange(start, stop, dtype=jnp.int32)
  stage_delays = jnp.asarray(delays[start:stop], jnp.int32)
  forward = jax.vmap(
      lambda st, inbound, number, delay: maths.forward_step(start, st, inbound, rng, number,
                                                            delay),
      in_axes=(_STACKED_BODY, 0, 0, 0))(st, inbound, numbers, stage_delays)
  oldest = part.rings.read(st.delay_line, tick)
  new, metrics = jax.vmap(
      lambda st, forward, oldest, inbound, cotangent, number, delay: maths.backward_step(
          start, st, forward, oldest, inbound, cotangent, rng, number, delay, options),
      in_axes=(_STACKED_BODY, 0, 0, 0, 0, 0, 0))(st, forward, oldest, inbound, cotangent,
                                                  numbers, stage_delays)
  line = (forward.entry if options.delay_line_entries
          else part.rings.write(st.delay_line, tick, forward.entry))
  return new._replace(delay_line=line), metrics


def tick_metrics(part_metrics: list[dict]) -> dict:
  """One tick's metrics from its parts': the last stage's, with the per-stage flags in stage
  order (a stacked part's along its stage axis)."""
  metrics = dict(part_metrics[-1])
  for per_stage in ("finite", "weight_discrepancy"):
    if per_stage in part_metrics[0]:
      metrics[per_stage] = jnp.concatenate([jnp.atleast_1d(m[per_stage]) for m in part_metrics])
  return metrics
