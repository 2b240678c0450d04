"""A mesh device's tick over its shard's parts, stacked parts stacked for the tick.

``ShardedPipeline(Pipeline(..., stack=True), mesh)`` cuts each stacked part at the devices'
boundaries (:func:`pipejax.core.parts.cut_parts`): a device's share of a stacked part is a stacked
part of its own, whose rings lie end to end in the device's buffers as in the local stacked layout
(``pipejax.core.stacked_layout``). The device keeps its stages' other leaves stage by stage and
stacks them for the tick (:func:`advance_shard`), so the numbers are the local runner's bit for
bit (docs/design.md §6.1).

``StackedPipeline``, ``find_stacks`` and ``shard_parts`` are aliases that say what replaced them.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

from pipejax.core import parts, stackable
from pipejax.core.engine import Pipeline, StackedPipeline  # pylint: disable=unused-import
from pipejax.core.stacked_layout import StackedState  # pylint: disable=unused-import
from pipejax.core.stacked_layout import stack_trees, without_line
from pipejax.core.stage_maths import StageMaths, TickOptions
from pipejax.core.state import Batch, Packet, StageState  # pylint: disable=unused-import

PyTree = Any

def advance_shard(maths: StageMaths, shard: tuple[parts.Part, ...],
                  stages: tuple[StageState, ...], stack_lines: tuple, inbound: Packet,
                  cotangent: PyTree, tick, rng, options: TickOptions = TickOptions()):
  """A mesh device's tick of its shard's parts ``shard`` (:func:`pipejax.core.parts.cut_parts`).

  ``stages`` holds every stage's state, a stacked part's stages without their delay lines, and
  ``stack_lines`` each stacked part's rings end to end (in ``shard``'s order). Each stacked part's
  stages are stacked for the tick and cut back after it
  (:func:`pipejax.core.parts.advance_parts`). Returns the new stages, the new ``stack_lines``
  (or, with ``options.delay_line_entries``, each stacked part's new entries) and each part's
  metrics.
  """
  first = shard[0].start
  states, lines = [], iter(stack_lines)
  for part in shard:
    own = stages[part.start - first:part.stop - first]
    if not part.stacked:
      states.append(own[0])
      continue
    states.append(stack_trees([without_line(st) for st in own],
                              jax.tree.structure(without_line(own[0])))
                  ._replace(delay_line=next(lines)))
  new_states, part_metrics = parts.advance_parts(maths, maths.spec.delays, shard, states, inbound,
                                                 cotangent, tick, rng, options)
  new_stages, new_lines = [], []
  for part, st in zip(shard, new_states):
    if not part.stacked:
      new_stages.append(st)
      continue
    new_lines.append(st.delay_line)
    leaves = jax.tree.leaves(without_line(st))
    own = stages[part.start - first:part.stop - first]
    new_stages.extend(jax.tree.structure(without_line(old)).unflatten([leaf[i] for leaf in leaves])
                      for i, old in enumerate(own))
  return tuple(new_stages), tuple(new_lines), part_metrics


def find_stacks(pipeline: Pipeline) -> list[tuple[int, int]]:
  """Replaced by :func:`pipejax.core.stackable.find_parts` of ``pipeline.initial``."""
  warnings.warn("stacking.find_stacks(pipe) is replaced by "
                "pipejax.core.stackable.find_parts(pipe.initial).", DeprecationWarning,
                stacklevel=2)
  return stackable.find_parts(pipeline.initial)


def shard_parts(part_spans, delays, first: int, stop: int) -> tuple[parts.Part, ...]:
  """Replaced by :func:`pipejax.core.parts.cut_parts`."""
  warnings.warn("stacking.shard_parts is replaced by pipejax.core.parts.cut_parts.",
                DeprecationWarning, stacklevel=2)
  return parts.cut_parts(part_spans, delays, first, stop)
