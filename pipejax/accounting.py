"""Delays, delay-line sizes, stashed bytes and utilization of each mode (docs/design.md §2)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np

PyTree = Any


def _check_num_stages(num_stages: int):
  if isinstance(num_stages, bool) or not isinstance(num_stages, (int, np.integer)):
    raise ValueError(f"num_stages must be an int (the number of stages S); got {num_stages!r}.")
  if num_stages < 1:
    raise ValueError(f"A pipeline needs at least one stage; got num_stages={num_stages!r}.")


def stage_delays(num_stages: int) -> list[int]:
  """D_s = 2(S-1-s): updates stage s applies between a sample's forward and its backward."""
  _check_num_stages(num_stages)
  return [2 * (num_stages - 1 - s) for s in range(num_stages)]


def stash_slots(num_stages: int) -> list[int]:
  """Inputs each stage holds in flight: D_s + 1 (written and read in the same tick)."""
  return [d + 1 for d in stage_delays(num_stages)]


def tree_bytes(tree: PyTree) -> int:
  """Bytes of every array (or ShapeDtypeStruct) leaf of ``tree``."""
  return int(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


def stash_bytes(stage_input_shapes: Sequence[PyTree]) -> int:
  """The formula: sum_s (D_s + 1) * |x_s|, with |x_s| the bytes of one micro-batch into stage s."""
  slots = stash_slots(len(stage_input_shapes))
  return sum(n * tree_bytes(x) for n, x in zip(slots, stage_input_shapes))


def fill_ticks(num_stages: int) -> int:
  """Ticks until every stage has seen its first backward (stage 0's comes at 2(S-1))."""
  _check_num_stages(num_stages)
  return 2 * (num_stages - 1)


def bubble_ticks(num_stages: int, micro_batches: int | None = None) -> int:
  """Idle ticks per optimizer step.

  Pipelined Backpropagation (``micro_batches=None``) never drains: zero after the one-off fill.
  The synchronous mode fills and drains for every group of M micro-batches: 2(S-1) ticks.
  """
  _check_num_stages(num_stages)
  return 0 if micro_batches is None else 2 * (num_stages - 1)


def utilization(num_stages: int, micro_batches: int | None = None) -> float:
  """Fraction of (stage, tick) slots doing useful work in steady state.

  A tick is one forward and one backward slot per stage, so a synchronous step of M micro-batches
  takes M + 2(S-1) ticks (the GPipe / 1F1B-flush bubble); asynchronous PB keeps every slot busy.
  """
  if micro_batches is None:
    _check_num_stages(num_stages)
    return 1.0
  if micro_batches < 1:
    raise ValueError(f"micro_batches must be >= 1; got {micro_batches}.")
  return micro_batches / (micro_batches + bubble_ticks(num_stages, micro_batches))


def schedule_grid(num_stages: int, num_ticks: int) -> list[list[tuple[int | None, int | None]]]:
  """grid[t][s] = (sample forwarded, sample backwarded) by stage s at tick t (None while filling)."""
  _check_num_stages(num_stages)
  grid = []
  for t in range(num_ticks):
    row = []
    for s in range(num_stages):
      fwd = t - s
      bwd = t - 2 * (num_stages - 1) + s
      row.append((fwd if fwd >= 0 else None, bwd if bwd >= 0 else None))
    grid.append(row)
  return grid
