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


def schedule_grid(num_stages: int, num_ticks: int, micro_batches: int | None = None
                  ) -> list[list[tuple[int | None, int | None]]]:
  """grid[t][s] = (sample forwarded, sample backwarded) by stage s at tick t (None while filling).

  With ``micro_batches`` M, the synchronous mode's grid: the bubbles of each group of M (the ticks
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


# ----------------------------------------------------------------------------- over a mesh
# ``sharded`` is a pipejax.sharding.ShardedPipeline; its ``packing`` (pipejax.packing.Packing) says
# where every leaf lives and what the padded buffers cost.


def boundary_bytes_per_tick(sharded) -> dict[str, int]:
  """Bytes that cross device boundaries in one tick, over the whole mesh.

  Returns a dict:

  * ``forward``: packets (activations, labels, valid flag, sample index) from each group's last
    stage to the next group, summed over the boundaries and the data replicas;
  * ``backward``: cotangents from each group's first stage to the previous group;
  * ``gradient_all_reduce``: the data axis's gradient averaging, ``2 (data - 1) |g_s|`` summed over
    the stages (what a ring all-reduce sends in total; 0 without a data axis);
  * ``total``: the sum of the three;
  * ``forward_padded`` / ``backward_padded``: what ``ppermute`` actually sends, each message padded
    to the largest group's register.
  """
  layout = sharded.packing
  state, data = layout.abstract_state, layout.num_replicas
  forward = backward = 0
  for a, _ in sharded.partition[1:]:
    sender, receiver = state.stages[a - 1], state.stages[a]
    forward += data * layout.replica_bytes(sender.forward_out, layout.roles(sender).forward_out)
    backward += tree_bytes(receiver.backward_out)
  all_reduce = sum(2 * (data - 1) * tree_bytes(st.params) for st in state.stages)
  messages = (len(layout.partition) - 1) * data
  return {
      "forward": forward,
      "backward": backward,
      "gradient_all_reduce": all_reduce,
      "total": forward + backward + all_reduce,
      "forward_padded": messages * layout.region_bytes(layout.packet_region),
      "backward_padded": messages * layout.region_bytes(layout.cotangent_region),
  }


def device_memory(sharded) -> list[dict[str, Any]]:
  """Bytes each stage-axis device holds (the same on every data replica of it).

  Per device: ``stages`` (its ``(start, stop)``), ``weights``, ``optimizer``, ``delay_lines``
  (stashed inputs with their flags), ``weight_stash`` (PipeDream's weight copies), ``variables``
  (stateful stages' variables, live and stashed with the inputs), ``registers``
  (forward packets and cotangents), their sum ``logical``, ``allocated`` (the padded buffers every
  device actually holds) and ``messages`` (the two transient boundary buffers of a tick).
  Activations count the device's own ``b / data`` samples.
  """
  layout = sharded.packing
  state = layout.abstract_state
  report = []
  for a, z in layout.partition:
    row = {"stages": (a, z), "weights": 0, "optimizer": 0, "delay_lines": 0, "weight_stash": 0,
           "variables": 0, "registers": 0}
    for st in state.stages[a:z]:
      roles = layout.roles(st)
      line, line_roles = st.delay_line, roles.delay_line
      row["weights"] += tree_bytes(st.params)
      row["optimizer"] += tree_bytes(st.opt_state)
      row["delay_lines"] += layout.replica_bytes((line.x, line.valid, line.index),
                                                 (line_roles.x, line_roles.valid, line_roles.index))
      row["weight_stash"] += tree_bytes(line.weights)
      row["variables"] += tree_bytes((st.variables, line.variables))
      row["registers"] += layout.replica_bytes((st.forward_out, st.backward_out),
                                               (roles.forward_out, roles.backward_out))
    row["logical"] = sum(row[k] for k in ("weights", "optimizer", "delay_lines", "weight_stash",
                                          "variables", "registers"))
    row["allocated"] = layout.allocated_bytes()
    row["messages"] = layout.message_bytes()
    report.append(row)
  return report
