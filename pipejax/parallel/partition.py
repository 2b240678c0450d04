"""How a sharded pipeline's logical stages are split into contiguous shards, one per device."""

from __future__ import annotations

import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp

from pipejax.core.engine import Pipeline
from pipejax.parallel.mesh import MeshError
from pipejax.schedules.costs import contiguous_split
from pipejax.core.state import PipelineState


def partition_stages(costs: Sequence[float], num_shards: int) -> list[tuple[int, int]]:
  """Contiguous shards ``(start, stop)`` of stages minimising the largest shard's cost.

  Exact (:func:`pipejax.schedules.costs.contiguous_split`); among partitions with the same
  largest cost it prefers the one whose costliest shards are shortest, so stages that cost nothing
  are spread rather than piled onto one device.

  Args:
    costs: non-negative cost per logical stage (parameter counts, measured seconds, ...).
    num_shards: number of shards, 1 <= num_shards <= len(costs).

  Returns:
    ``num_shards`` pairs covering ``range(len(costs))`` in order, none empty.
  """
  costs = [float(c) for c in costs]
  num_stages = len(costs)
  if any(not math.isfinite(c) or c < 0 for c in costs):
    raise MeshError(f"Stage costs must be finite and >= 0; got {costs}.")
  if not 1 <= num_shards <= num_stages:
    raise MeshError(f"Cannot split {num_stages} stages into {num_shards} non-empty shards: the "
                    f"stage axis must have between 1 and {num_stages} devices.")
  return contiguous_split(costs, num_shards)


def imbalance(costs: Sequence[float], partition: Sequence[tuple[int, int]]) -> float:
  """Largest shard cost over the mean shard cost: 1.0 is perfect balance.

  A pipeline ticks at the pace of its slowest device, so this is the slowdown against an ideal
  split of the same total work.
  """
  shard_costs = [float(sum(costs[a:b])) for a, b in partition]
  mean = sum(shard_costs) / len(shard_costs)
  return max(shard_costs) / mean if mean > 0 else 1.0


def check_partition(partition, num_stages: int, num_shards: int) -> list[tuple[int, int]]:
  """Validates an explicit partition: ``num_shards`` contiguous, non-empty, covering shards."""
  try:
    bounds = [(int(a), int(b)) for a, b in partition]
  except (TypeError, ValueError):
    raise MeshError(f"A partition is a list of (start, stop) pairs, one per stage-axis device; got "
                    f"{partition!r}.") from None
  example = partition_stages([1.0] * num_stages, num_shards) if num_shards <= num_stages else None
  hint = f" For example {example} for an even split." if example else ""
  if len(bounds) != num_shards:
    raise MeshError(f"The partition {bounds} has {len(bounds)} shards but the mesh's stage axis "
                    f"has {num_shards} devices; give exactly one (start, stop) per device.{hint}")
  expected_start = 0
  for a, b in bounds:
    if a != expected_start or b <= a:
      raise MeshError(
          f"The partition {bounds} is not contiguous: shards must be non-empty (start < stop), "
          f"start at 0, and each must start where the previous one stopped (expected a shard "
          f"starting at {expected_start}, got ({a}, {b})).{hint}")
    expected_start = b
  if expected_start != num_stages:
    raise MeshError(f"The partition {bounds} covers stages 0..{expected_start - 1} but the "
                    f"pipeline has {num_stages} stages (0..{num_stages - 1}).{hint}")
  return bounds


def param_counts(pipeline: Pipeline) -> list[int]:
  """Number of weights of each logical stage (a proxy for its compute at fixed micro-batch)."""
  state = pipeline.state_spec
  return [sum(math.prod(a.shape) for a in jax.tree.leaves(st.params)) for st in state.stages]


def measure_stage_costs(pipeline: Pipeline, state: PipelineState | None = None,
                        repeats: int = 5) -> list[float]:
  """Seconds per tick of each stage's work, measured one stage at a time.

  Times a jitted forward, recompute and VJP (the stage's share of a tick) on the stage's own
  weights and an input of its micro-batch shape; best of ``repeats``. Measured costs beat parameter
  counts when stages differ in kind (convolutions against dense layers).
  """
  if state is None:  # the logical state, whatever the pipeline's layout
    state = pipeline.initial(jax.random.PRNGKey(0))
  seconds = []
  for s, stage in enumerate(pipeline.model.stages):
    key = jax.random.PRNGKey(s)

    def work(params, variables, x, forward=stage.forward, key=key):
      y, _ = forward(params, x, key, variables)
      y2, vjp = jax.vjp(lambda w, h: forward(w, h, key, variables)[0], params, x)
      return y, vjp(jax.tree.map(jnp.ones_like, y2))

    params, variables = state.stages[s].params, state.stages[s].variables
    x = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), pipeline.spec.stage_input_shapes[s])
    fn = jax.jit(work)
    jax.block_until_ready(fn(params, variables, x))
    best = math.inf
    for _ in range(max(repeats, 1)):
      start = time.perf_counter()
      jax.block_until_ready(fn(params, variables, x))
      best = min(best, time.perf_counter() - start)
    seconds.append(best)
  return seconds
