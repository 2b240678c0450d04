"""Delays, delay-line sizes, stashed bytes and utilization of each mode (docs/design.md §2), and
the memory a state competes for."""

from __future__ import annotations

import math
import os
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


def memory_available() -> tuple[int, str]:
  """The memory a pipeline's state competes for, and where it is: the first local device's, or
  the host's on CPU (the trainer's memory check and ``init``'s alike)."""
  device = jax.local_devices()[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{device.device_kind}'s memory"
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"


def gib(n: int) -> str:
  """Bytes for a message: GiB from 1 GiB up, MiB below."""
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def stash_bytes(stage_input_shapes: Sequence[PyTree]) -> int:
  """The formula: sum_s (D_s + 1) * |x_s|, with |x_s| the bytes of one micro-batch into stage s."""
  slots = stash_slots(len(stage_input_shapes))
  return sum(n * tree_bytes(x) for n, x in zip(slots, stage_input_shapes))


def held_stash_bytes(stage_states) -> int:
  """Bytes of stashed activations the delay lines of ``stage_states`` (one stage's or a
  stacked part's each) hold: what :func:`stash_bytes` predicts, read off a state."""
  return sum(tree_bytes(st.delay_line.x) for st in stage_states)


def weight_stash_bytes(stage_param_shapes: Sequence[PyTree]) -> int:
  """The formula for a weight stash (PipeDream's, DC-ASGD's): sum_s (D_s + 1) * |w_s|, one copy
  of stage s's weights beside each of its stashed inputs."""
  return stash_bytes(stage_param_shapes)


def held_weight_stash_bytes(stage_states) -> int:
  """Bytes of stashed weight copies the delay lines of ``stage_states`` hold (0 where a method
  stashes none): what :func:`weight_stash_bytes` predicts, read off a state."""
  return sum(tree_bytes(st.delay_line.weights) for st in stage_states)


def fill_ticks(num_stages: int) -> int:
  """Ticks until every stage has seen its first backward (stage 0's comes at 2(S-1))."""
  _check_num_stages(num_stages)
  return 2 * (num_stages - 1)


def bubble_ticks(num_stages: int, micro_batches: int | None = None) -> int:
  """Idle ticks per optimizer step.

  Pipelined Backpropagation (``micro_batches=None``) never drains: zero after the one-off fill.
  The synchronous mode fills and drains for every step's M micro-batches: 2(S-1) ticks.
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


def schedule_grid(num_stages: int, num_ticks: int, micro_batches: int | None = None
                  ) -> list[list[tuple[int | None, int | None]]]:
  """grid[t][s] = (sample forwarded, sample backwarded) by stage s at tick t (None while filling).

  With ``micro_batches`` M, the synchronous mode's grid: the bubbles of each step's M (the ticks
  it feeds no real micro-batch) are left empty too.
  """
  _check_num_stages(num_stages)
  if micro_batches is None:
    sample = lambda entered_at: entered_at if entered_at >= 0 else None
  else:
    cycle = micro_batches + bubble_ticks(num_stages, micro_batches)

    def sample(entered_at):
      if entered_at < 0 or entered_at % cycle >= micro_batches:
        return None
      return (entered_at // cycle) * micro_batches + entered_at % cycle

  return [[(sample(t - s), sample(t - 2 * (num_stages - 1) + s)) for s in range(num_stages)]
          for t in range(num_ticks)]


def mode_summary(num_stages: int, micro_batches: int | None = None, micro_batch_size: int = 1,
                 activation_size: int = 256, dtype_bytes: int = 4) -> dict[str, Any]:
  """What each stage of the engine holds in a mode: its delay line, and what the mode keeps in it.

  PB (``micro_batches`` None) keeps D_s + 1 inputs in flight and applies gradients D_s updates
  late. The synchronous mode allocates the same delay lines but holds at most min(M, D_s + 1)
  inputs at once, and its gradients are never stale (one update after the M micro-batches have
  all gone back). Bytes are for inputs of ``activation_size`` numbers of ``dtype_bytes`` each per
  sample.
  """
  slots = stash_slots(num_stages)
  if micro_batches is None:
    delays, in_flight = stage_delays(num_stages), slots
  else:
    delays, in_flight = [0] * num_stages, [min(micro_batches, n) for n in slots]
  per_stage_bytes = [n * micro_batch_size * activation_size * dtype_bytes for n in in_flight]
  return {
      "num_stages": num_stages,
      "mode": "pb" if micro_batches is None else f"sync(M={micro_batches})",
      "delays": delays,
      "stash_slots": in_flight,
      "buffer_slots": slots,
      "stash_bytes_per_stage": per_stage_bytes,
      "stash_bytes": sum(per_stage_bytes),
      "fill_ticks": fill_ticks(num_stages),
      "bubble_ticks_per_step": bubble_ticks(num_stages, micro_batches),
      "utilization": utilization(num_stages, micro_batches),
  }

