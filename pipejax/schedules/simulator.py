"""Event-by-event simulation of a pipeline schedule on a chain of devices (pure Python).

A schedule is, per device, a fixed order of operations ("F" forward, "B" backward: the activation
gradient, or all of the backward where the schedule does not split it) and, where it splits the
backward, "W" operations (weight gradients) that float: a device runs its next fixed operation as
soon as that operation's inputs have arrived, and otherwise fills the wait with the oldest weight
gradient it owes (the zero-bubble schedules' rule). Each operation starts when its device is free
and its dependencies have finished plus their transfer time.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import NamedTuple, Sequence


class OpKey(NamedTuple):
  kind: str  # "F", "B" or "W"
  sample: int
  device: int


@dataclasses.dataclass
class Op:
  key: OpKey
  cost: float
  deps: list[tuple[OpKey, float]]  # (operation, transfer time after it finishes)
  start: float | None = None
  end: float | None = None


@dataclasses.dataclass
class Plan:
  """What to simulate: per-device fixed orders, floating W operations, all operations by key."""

  ops: dict[OpKey, Op]
  order: list[list[OpKey]]
  floating: list[list[OpKey]]  # per device, W operations in the order they become due

  def add(self, key: OpKey, cost: float, deps: Sequence[tuple[OpKey, float]] = (),
          fixed: bool = True):
    self.ops[key] = Op(key, cost, list(deps))
    (self.order if fixed else self.floating)[key.device].append(key)


def empty_plan(num_devices: int) -> Plan:
  return Plan(ops={}, order=[[] for _ in range(num_devices)],
              floating=[[] for _ in range(num_devices)])


def run(plan: Plan) -> list[Op]:
  """Simulates ``plan`` in place (sets every op's start and end); returns ops by start time."""
  num_devices = len(plan.order)
  position = [0] * num_devices
  next_floating = [0] * num_devices
  free_at = [0.0] * num_devices
  waiting: set[int] = set()
  events = [(0.0, d) for d in range(num_devices)]
  heapq.heapify(events)

  def ready_time(op):
    times = [0.0]
    for dep, latency in op.deps:
      end = plan.ops[dep].end
      if end is None:
        return None
      times.append(end + (latency if dep.device != op.key.device else 0.0))
    return max(times)

  def start(op, now):
    op.start, op.end = now, now + op.cost
    free_at[op.key.device] = op.end
    heapq.heappush(events, (op.end, op.key.device))
    # A device that was waiting for an unknown finishing time may now know it.
    for d in list(waiting):
      heapq.heappush(events, (now, d))
    waiting.clear()

  while events:
    now, d = heapq.heappop(events)
    if now < free_at[d]:
      continue
    fixed = plan.ops[plan.order[d][position[d]]] if position[d] < len(plan.order[d]) else None
    ready = ready_time(fixed) if fixed is not None else None
    if fixed is not None and ready is not None and ready <= now + 1e-12:
      position[d] += 1
      start(fixed, now)
      continue
    floats = plan.floating[d]
    if next_floating[d] < len(floats):
      candidate = plan.ops[floats[next_floating[d]]]
      due = ready_time(candidate)
      if due is not None and due <= now + 1e-12:
        next_floating[d] += 1
        start(candidate, now)
        continue
      if due is not None and (ready is None or due < ready):
        heapq.heappush(events, (due, d))
        continue
    if fixed is None and next_floating[d] >= len(floats):
      continue  # this device is done
    if ready is not None:
      heapq.heappush(events, (ready, d))
    else:
      waiting.add(d)
  unfinished = [op.key for op in plan.ops.values() if op.end is None]
  if unfinished:
    raise RuntimeError(f"Schedule deadlocked; first unscheduled operations: {unfinished[:5]}")
  return sorted(plan.ops.values(), key=lambda op: (op.start, op.key.device))
