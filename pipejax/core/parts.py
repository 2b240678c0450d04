"""One tick over a pipeline's parts: the only place that routes registers between neighbours.

A *part* is a single stage or a *stack*: contiguous identical stages whose states are stacked on a
leading stage axis and advanced as one under ``vmap`` (``pipejax.parallel.stacking`` finds them).
Every layout ticks through :func:`advance_parts`:

* the per-stage :class:`~pipejax.core.engine.Pipeline`: every stage a part of its own;
* :class:`~pipejax.parallel.stacking.StackedPipeline`: its stacks and single stages;
* each device of :class:`~pipejax.parallel.sharding.ShardedPipeline`: the parts of its shard, the
  packet and cotangent that the mesh delivered from its neighbour devices entering at its ends.

Routing follows the engine's timing (``pipejax.core.engine``): part k's inbound packet is the
``forward_out`` register its upstream neighbour wrote last tick (the last row of a stack's), and
the cotangent entering it is its downstream neighbour's ``backward_out`` (the first row of a
stack's). Inside a stack the same holds row by row: the rows shift by one.

**A stack's delay lines** lie end to end (:class:`Rings`): one buffer per leaf holding every
stage's ring, stage i's ``D_i + 1`` slots at offset ``o_i``. A tick gathers each stage's oldest slot
and scatters its new entry: one gather and one scatter per leaf, whatever the stack's length. A
single stage keeps its own :class:`~pipejax.core.state.DelayLine`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

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
      (:meth:`DelayLine.write` of it at ``tick``, or :meth:`Rings.write` for a stack's rows, gives
      the line): a mesh writes that one slot in place after its ``lax.switch``.
  """

  reduce_grads: Callable[[PyTree], PyTree] | None = None
  every_slot_full: bool = False
  delay_line_entries: bool = False


class Rings(NamedTuple):
  """Where each stage of a stack keeps its ring in buffers that hold them end to end."""

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
    # Every index lies in its own stage's span. Indexing's default mode guards each with a
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
  """Stages ``start .. stop-1`` advanced together: one stage (``rings`` None), or a stack whose
  state has a leading stage axis and whose delay lines lie end to end as ``rings``."""

  start: int
  stop: int
  rings: Rings | None = None

  @classmethod
  def stack(cls, start: int, stop: int, delays: Sequence[int]) -> Part:
    """Stages ``start .. stop-1`` as a stack (``delays``: every stage's, by stage number)."""
    return cls(start, stop, Rings.of(delays[start:stop]))

  @property
  def stacked(self) -> bool:
    return self.rings is not None


def single_stages(first: int, stop: int) -> tuple[Part, ...]:
  """Stages ``first .. stop-1``, each a part of its own."""
  return tuple(Part(s, s + 1) for s in range(first, stop))


class Steps(Protocol):
  """The two halves of a stage's tick (:class:`~pipejax.core.engine.Pipeline`'s)."""

  def forward_step(self, s: int, st: StageState, inbound: Packet, rng, number=None,
                   delay=None) -> Forward:
    ...

  def backward_step(self, s: int, st: StageState, forward: Forward, oldest: DelayLine,
                    inbound: Packet, cotangent: PyTree, rng, number=None, delay=None,
                    options: TickOptions = TickOptions()):
    ...


def _last_row(part: Part, tree):
  return jax.tree.map(lambda a: a[-1], tree) if part.stacked else tree


def _first_row(part: Part, tree):
  return jax.tree.map(lambda a: a[0], tree) if part.stacked else tree


def advance_parts(steps: Steps, delays: Sequence[int], parts: Sequence[Part],
                  states: Sequence[StageState], inbound: Packet, cotangent: PyTree, tick, rng,
                  options: TickOptions = TickOptions()):
  """Advances contiguous parts by one tick.

  Args:
    steps: the engine whose :meth:`forward_step` and :meth:`backward_step` advance a stage.
    delays: every stage's delay D_s (indexed by stage number).
    parts: the parts, contiguous, in stage order.
    states: each part's state (stacked for a stack).
    inbound: the packet entering the first part (the micro-batch, on the first stage).
    cotangent: the gradient entering the last part (None when it holds the model's last stage).
    tick, rng: the tick and the run's key.
    options: the tick's :class:`TickOptions`.

  Returns:
    The new states, and each part's metrics (stacked along the stage axis for a stack).
  """
  new_states, part_metrics = [], []
  for k, (part, st) in enumerate(zip(parts, states)):
    part_in = inbound if k == 0 else _last_row(parts[k - 1], states[k - 1].forward_out)
    part_cotangent = (cotangent if k == len(parts) - 1
                      else _first_row(parts[k + 1], states[k + 1].backward_out))
    advance = _advance_stack if part.stacked else _advance_stage
    new, metrics = advance(steps, delays, part, st, part_in, part_cotangent, tick, rng, options)
    new_states.append(new)
    part_metrics.append(metrics)
  return tuple(new_states), part_metrics


def _advance_stage(steps: Steps, delays, part: Part, st: StageState, inbound: Packet,
                   cotangent: PyTree, tick, rng, options: TickOptions):
  """A single stage's tick: forward, delay line, backward and update."""
  s = part.start
  forward = steps.forward_step(s, st, inbound, rng)
  oldest = st.delay_line.read(tick, forward.entry)
  line = (forward.entry if options.delay_line_entries
          else st.delay_line.write(tick, forward.entry))
  new, metrics = steps.backward_step(s, st, forward, oldest, inbound, cotangent, rng,
                                     options=options)
  return new._replace(delay_line=line), metrics


_STACKED_BODY = StageState(0, 0, None, 0, 0, 0)  # vmap axes: every leaf but the delay line's


def _advance_stack(steps: Steps, delays, part: Part, st: StageState, inbound: Packet,
                   cotangent: PyTree, tick, rng, options: TickOptions):
  """A stack's tick: the engine's two steps under ``vmap``, the delay lines between them.

  Stage number and delay enter as arrays over the stage axis (the rng fold-in, and the methods'
  delay-dependent coefficients), the code as the stack's first stage's.
  """
  start, stop = part.start, part.stop
  shift_in = lambda first, own: jnp.concatenate([first[None], own[:-1]])
  shift_back = lambda own, last: jnp.concatenate([own[1:], last[None]])
  inbound = jax.tree.map(shift_in, inbound, st.forward_out)
  cotangent = jax.tree.map(shift_back, st.backward_out, cotangent)
  numbers = jnp.arange(start, stop, dtype=jnp.int32)
  stage_delays = jnp.asarray(delays[start:stop], jnp.int32)
  forward = jax.vmap(
      lambda st, inbound, number, delay: steps.forward_step(start, st, inbound, rng, number,
                                                            delay),
      in_axes=(_STACKED_BODY, 0, 0, 0))(st, inbound, numbers, stage_delays)
  oldest = part.rings.read(st.delay_line, tick)
  new, metrics = jax.vmap(
      lambda st, forward, oldest, inbound, cotangent, number, delay: steps.backward_step(
          start, st, forward, oldest, inbound, cotangent, rng, number, delay, options),
      in_axes=(_STACKED_BODY, 0, 0, 0, 0, 0, 0))(st, forward, oldest, inbound, cotangent,
                                                  numbers, stage_delays)
  line = (forward.entry if options.delay_line_entries
          else part.rings.write(st.delay_line, tick, forward.entry))
  return new._replace(delay_line=line), metrics


def tick_metrics(part_metrics: list[dict]) -> dict:
  """One tick's metrics from its parts': the last stage's, with the per-stage flags in stage
  order (a stack's stacked along its stage axis)."""
  metrics = dict(part_metrics[-1])
  for per_stage in ("finite", "weight_discrepancy"):
    if per_stage in part_metrics[0]:
      metrics[per_stage] = jnp.concatenate([jnp.atleast_1d(m[per_stage]) for m in part_metrics])
  return metrics
