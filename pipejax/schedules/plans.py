"""The operation order of every schedule, per device (pure Python).

Samples are numbered globally: iteration k of a synchronous schedule holds samples
``k*m .. k*m + m - 1``. ``D = num_devices``, ``d`` a device (= stage), ``m`` micro-batches.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from pipejax.schedules.costs import DeviceWork
from pipejax.schedules.simulator import OpKey, Plan, empty_plan


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A schedule's rules: how it orders operations and when it updates the weights.

  Attributes:
    name: the ``--schedule`` name.
    title: a human name with its reference.
    split_backward: B and W are separate operations (W floats); otherwise one "B" op does both.
    synchronous: iterations of m micro-batches with one update each; otherwise a stream of samples
      with an update every ``update_every(m)`` backwards.
    flush: a synchronous schedule waits for every device to finish an iteration before the next.
    stashes_weights: the backward uses the weights its forward used (PipeDream's weight stashing);
      otherwise the current weights (fine-grained PB, which recomputes the forward with them).
    warmup: forwards device d runs before its first backward, given (D, d, m).
    in_flight: with a split backward, the most samples whose W device d may owe before its next
      forward, given (D, d, m); default warm-up + 1.
    order: "one_f_one_b", "all_f_then_b" or "ticks".
  """

  name: str
  title: str
  split_backward: bool
  synchronous: bool
  flush: bool
  stashes_weights: bool
  order: str
  warmup: Callable[[int, int, int], int] = lambda num_devices, d, m: num_devices - 1 - d
  updates_per_micro_batch: bool = True
  in_flight: Callable[[int, int, int], int] | None = None


SCHEDULES = {
    "gpipe": Schedule("gpipe", "GPipe (Huang et al. 2019)", split_backward=False,
                      synchronous=True, flush=True, stashes_weights=False, order="all_f_then_b"),
    "1f1b": Schedule("1f1b", "1F1B with flush (Narayanan et al. 2021)", split_backward=False,
                     synchronous=True, flush=True, stashes_weights=False, order="one_f_one_b"),
    "zb_h1": Schedule("zb_h1", "zero-bubble ZB-H1 (Qi et al. 2024)", split_backward=True,
                      synchronous=True, flush=True, stashes_weights=False, order="one_f_one_b",
                      in_flight=lambda num_devices, d, m: num_devices),
    # ZB-H2 doubles the warm-up forwards and drops the flush (its optimizer step is validated
    # after the fact), so the next iteration's forwards fill the tail of this one.
    "zb_h2": Schedule("zb_h2", "zero-bubble ZB-H2 (Qi et al. 2024)", split_backward=True,
                      synchronous=True, flush=False, stashes_weights=False, order="one_f_one_b",
                      warmup=lambda num_devices, d, m: 2 * (num_devices - 1 - d),
                      in_flight=lambda num_devices, d, m: 2 * num_devices - 1),
    "pipedream": Schedule("pipedream", "PipeDream async 1F1B + weight stashing (Narayanan 2019)",
                          split_backward=False, synchronous=False, flush=False,
                          stashes_weights=True, order="one_f_one_b"),
    "2bw": Schedule("2bw", "PipeDream-2BW (Narayanan et al. 2021)", split_backward=False,
                    synchronous=False, flush=False, stashes_weights=True, order="one_f_one_b",
                    updates_per_micro_batch=False),
    "layerpipe": Schedule("layerpipe", "LayerPipe (Unnikrishnan & Parhi 2021)",
                          split_backward=True, synchronous=False, flush=False,
                          stashes_weights=True, order="one_f_one_b"),
    "pb": Schedule("pb", "fine-grained Pipelined Backpropagation (Kosson et al. 2021)",
                   split_backward=False, synchronous=False, flush=False, stashes_weights=False,
                   order="ticks"),
}


def _one_f_one_b(warmup: int, samples: Sequence[int]) -> list[tuple[str, int]]:
  """``warmup`` forwards, then alternately one forward and one backward, then the backwards."""
  warmup = min(warmup, len(samples))
  steps = [("F", j) for j in samples[:warmup]]
  for i, j in enumerate(samples[warmup:]):
    steps += [("F", j), ("B", samples[i])]
  steps += [("B", j) for j in samples[len(samples) - warmup:]]
  return steps


def _ticks(num_devices: int, d: int, num_samples: int) -> list[tuple[str, int]]:
  """Fine-grained PB: in tick t device d forwards sample t - d and backwards t - 2(D-1) + d."""
  steps = []
  for t in range(num_samples + 2 * (num_devices - 1)):
    if 0 <= t - d < num_samples:
      steps.append(("F", t - d))
    if 0 <= t - 2 * (num_devices - 1) + d < num_samples:
      steps.append(("B", t - 2 * (num_devices - 1) + d))
  return steps


def device_steps(schedule: Schedule, num_devices: int, d: int,
                 samples: Sequence[int], m: int) -> list[tuple[str, int]]:
  if schedule.order == "all_f_then_b":
    return [("F", j) for j in samples] + [("B", j) for j in samples]
  if schedule.order == "ticks":
    return _ticks(num_devices, d, len(samples))
  return _one_f_one_b(schedule.warmup(num_devices, d, m), samples)


def build(schedule: Schedule, work: Sequence[DeviceWork], micro_batches: int,
          iterations: int = 1, num_samples: int | None = None) -> Plan:
  """The operations of ``iterations`` synchronous iterations, or a stream of ``num_samples``."""
  num_devices = len(work)
  plan = empty_plan(num_devices)
  if schedule.synchronous:
    steps = [list(range(k * micro_batches, (k + 1) * micro_batches)) for k in range(iterations)]
  else:
    steps = [list(range(num_samples))]
  for samples in steps:
    # A device runs its fixed ops in order and its floating W in order, so the last of each
    # finishing means all of that device's ops have.
    everything_before = [keys[-1] for device_keys in (plan.order, plan.floating)
                         for keys in device_keys if keys]
    for d, w in enumerate(work):
      steps = device_steps(schedule, num_devices, d, samples, micro_batches)
      # A split backward frees a sample's input only after its W: the device must catch up on
      # W before a forward would hold more inputs than the schedule allows.
      in_flight_cap = (schedule.in_flight(num_devices, d, micro_batches) if schedule.in_flight
                       else min(schedule.warmup(num_devices, d, micro_batches), len(samples)) + 1)
      forwards = 0
      for n, (kind, j) in enumerate(steps):
        deps = []
        if n == 0:
          # The first op of an iteration needs the update of the last one: of every device after
          # a flush, of this device's own weight gradients otherwise.
          own_before = [keys[-1] for keys in (plan.order[d], plan.floating[d]) if keys]
          deps += [(key, 0.0) for key in (everything_before if schedule.flush else own_before)]
        if kind == "F":
          key = OpKey("F", j, d)
          if d > 0:
            deps.append((OpKey("F", j, d - 1), work[d - 1].transfer))
          if schedule.split_backward and forwards >= in_flight_cap:
            deps.append((OpKey("W", samples[forwards - in_flight_cap], d), 0.0))
          forwards += 1
          cost = w.forward
        else:
          key = OpKey("B", j, d)
          deps.append((OpKey("F", j, d), 0.0))
          if d < num_devices - 1:
            deps.append((OpKey("B", j, d + 1), w.transfer))
          cost = w.input_grad if schedule.split_backward else w.input_grad + w.weight_grad
        plan.add(key, cost, deps)
        if kind == "B" and schedule.split_backward:
          plan.add(OpKey("W", j, d), w.weight_grad, [(key, 0.0)], fixed=False)
  return plan
