"""Runs a schedule on layer costs and measures it: throughput, bubbles, memory, staleness.

Everything is measured on the simulated timeline, in its steady state: the last of several
iterations of a synchronous schedule, the middle third of a long stream of an asynchronous one.

* **bubble rate**: idle over busy time of a device in that window (Qi et al.'s definition: 1F1B
  (p-1)/m with F = B = W); ``bubble_fraction`` is idle over the whole window (GPipe's
  (p-1)/(m+p-1)); ``utilization`` is busy over the whole window.
* **peak activations**: the most samples whose input a device holds at once (from its forward
  until its last backward operation); times the device's ``activation_bytes`` in bytes.
* **weight versions**: the most versions of its weights a device keeps at once (1 unless the
  schedule stashes weights for the backward).
* **delay**: the number of updates a layer's weights receive between a sample's forward and the
  update that applies the sample's gradient (the gradient's staleness), the most in the window.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from typing import Any, Sequence

from pipejax.schedules import costs as costs_lib
from pipejax.schedules import plans, simulator
from pipejax.schedules.costs import LayerCost, ScheduleError, uniform

NAMES = tuple(plans.SCHEDULES)


@dataclasses.dataclass
class Report:
  """A simulated schedule's figures; ``timeline`` holds every operation for drawing."""

  schedule: str
  title: str
  num_devices: int
  micro_batches: int
  throughput: float
  bubble_rate: float
  bubble_rate_per_device: list[float]
  bubble_fraction: float
  utilization: float
  peak_activations: list[int]
  peak_activation_bytes: list[int]
  weight_versions: list[int]
  delays: list[int]
  layer_delays: list[int]
  device_layers: list[list[int]]
  device_costs: list[dict[str, float]]
  timeline: list[simulator.Op] = dataclasses.field(repr=False, default_factory=list)

  def as_dict(self, with_timeline: bool = False) -> dict[str, Any]:
    info = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "timeline"}
    if with_timeline:
      info["timeline"] = [{"kind": op.key.kind, "sample": op.key.sample, "device": op.key.device,
                           "start": op.start, "end": op.end} for op in self.timeline]
    return info


def assign(schedule: str, layers: Sequence[LayerCost], num_devices: int,
           layers_per_stage: int | None = None) -> list[costs_lib.DeviceWork]:
  """Which device does what: balanced contiguous stages, or LayerPipe's task split.

  ``layerpipe`` splits the weight gradient off (intra-layer); ``layerpipe_inter`` also divides
  the activation gradient between neighbours (intra + inter-layer). ``layers_per_stage`` fixes k
  layers per device instead of balancing (PB's granularity k).
  """
  if schedule in ("layerpipe", "layerpipe_inter"):
    return costs_lib.layerpipe_work(layers, num_devices, inter_layer=schedule == "layerpipe_inter")
  if layers_per_stage is not None:
    ranges = costs_lib.fixed_split(len(layers), layers_per_stage)
    if len(ranges) != num_devices:
      raise ScheduleError(
          f"{len(layers)} layers at {layers_per_stage} per stage make {len(ranges)} stages, but "
          f"num_devices={num_devices} (--num_stages in scripts/schedule.py). Pass "
          f"num_devices={len(ranges)} or another layers_per_stage.")
  else:
    ranges = costs_lib.balanced_split(layers, num_devices)
  return costs_lib.stage_work(layers, ranges)


def simulate(schedule: str, layers: Sequence[LayerCost], num_devices: int,
             micro_batches: int = 8, layers_per_stage: int | None = None,
             num_samples: int | None = None) -> Report:
  """Simulates ``schedule`` on ``layers`` over ``num_devices`` and measures it.

  Args:
    schedule: one of :data:`NAMES`, or ``layerpipe_inter`` (LayerPipe with its inter-layer split).
    layers: one :class:`LayerCost` per layer, in network order.
    num_devices: devices (= pipeline stages) D.
    micro_batches: m, micro-batches per iteration of the synchronous schedules and per update of
      PipeDream-2BW; the asynchronous ones ignore it otherwise.
    layers_per_stage: k layers per device instead of a balanced split (``pb`` at granularity k).
    num_samples: length of the simulated stream of an asynchronous schedule (default: long enough
      for a steady state of at least 8 samples per device).

  Example:
    >>> from pipejax import schedules
    >>> report = schedules.simulate('1f1b', schedules.uniform(4), num_devices=4, micro_batches=8)
    >>> report.bubble_rate  # (p - 1) / m
    0.375
  """
  if micro_batches < 1:
    raise ScheduleError(f"micro_batches must be >= 1; got {micro_batches}.")
  key = "layerpipe" if schedule == "layerpipe_inter" else schedule
  if key not in plans.SCHEDULES:
    raise ScheduleError(f"Unknown schedule {schedule!r}; known: {', '.join(NAMES)}, "
                        "layerpipe_inter.")
  spec = plans.SCHEDULES[key]
  work = assign(schedule, layers, num_devices, layers_per_stage)
  num_devices = len(work)
  if spec.synchronous:
    iterations = 5
    plan = plans.build(spec, work, micro_batches, iterations=iterations)
  else:
    per_update = micro_batches if not spec.updates_per_micro_batch else 1
    num_samples = num_samples or max(24 * num_devices, 8 * per_update, 48)
    num_samples = -(-num_samples // per_update) * per_update
    plan = plans.build(spec, work, micro_batches, num_samples=num_samples)
  timeline = simulator.run(plan)

  sample_end: dict[int, float] = {}
  for op in timeline:
    sample_end[op.key.sample] = max(sample_end.get(op.key.sample, 0.0), op.end)
  if spec.synchronous:
    # One iteration, from device 0's first forward of iteration K-2 to that of K-1: after the
    # flush, or in the steady overlap of iterations where there is none.
    starts = {op.key.sample: op.start for op in timeline if op.key == ("F", op.key.sample, 0)}
    window = (starts[(iterations - 2) * micro_batches], starts[(iterations - 1) * micro_batches])
    window_samples = range((iterations - 2) * micro_batches, (iterations - 1) * micro_batches)
  else:
    # Completion order equals sample order in these schedules; time the middle third.
    first, last = num_samples // 3, 2 * num_samples // 3
    first -= first % per_update
    last -= last % per_update
    window = (sample_end[first - 1], sample_end[last - 1])
    window_samples = range(first, last)
  span = window[1] - window[0]
  if span <= 0:
    raise ScheduleError("Every layer costs nothing: give at least one positive cost.")
  throughput = len(window_samples) / span

  busy = [0.0] * num_devices
  for op in timeline:
    busy[op.key.device] += max(0.0, min(op.end, window[1]) - max(op.start, window[0]))
  idle = [span - b for b in busy]
  bubble_per_device = [i / b if b > 0 else float("inf") for i, b in zip(idle, busy)]
  total_busy = sum(busy)

  layer_delays = _delays(spec, timeline, work, micro_batches, window_samples, len(layers))
  return Report(
      schedule=schedule, title=spec.title + (" intra + inter-layer" if schedule ==
                                              "layerpipe_inter" else ""),
      num_devices=num_devices, micro_batches=micro_batches, throughput=throughput,
      bubble_rate=sum(idle) / total_busy, bubble_rate_per_device=bubble_per_device,
      bubble_fraction=sum(idle) / (span * num_devices),
      utilization=total_busy / (span * num_devices),
      peak_activations=(peaks := _peak_activations(timeline, num_devices)),
      peak_activation_bytes=[n * w.activation_bytes for n, w in zip(peaks, work)],
      weight_versions=_weight_versions(spec, timeline, work, micro_batches, window_samples),
      delays=[max((layer_delays[l] for l in w.forward_layers), default=0) for w in work],
      layer_delays=layer_delays,
      device_layers=[list(w.forward_layers) for w in work],
      device_costs=[{"forward": w.forward, "input_grad": w.input_grad,
                     "weight_grad": w.weight_grad, "transfer": w.transfer} for w in work],
      timeline=timeline)


def _updates(spec, timeline, micro_batches, num_devices):
  """Per device: the times of its weight updates, and per sample the index of the update that
  applies that sample's gradient (1-based: update u makes version u)."""
  last_grad = "W" if spec.split_backward else "B"
  per_update = micro_batches if (spec.synchronous or not spec.updates_per_micro_batch) else 1
  update_times = [[] for _ in range(num_devices)]
  applied_in: list[dict[int, int]] = [{} for _ in range(num_devices)]
  done = [0] * num_devices
  for op in sorted((op for op in timeline if op.key.kind == last_grad), key=lambda op: op.end):
    d = op.key.device
    done[d] += 1
    applied_in[d][op.key.sample] = -(-done[d] // per_update)
    if done[d] % per_update == 0:
      update_times[d].append(op.end)
  return update_times, applied_in


def _version(update_times, time):
  """Updates done by ``time`` (``update_times`` is sorted): the version a forward then uses."""
  return bisect.bisect_right(update_times, time + 1e-12)


def _delays(spec, timeline, work, micro_batches, window_samples, num_layers):
  update_times, applied_in = _updates(spec, timeline, micro_batches, len(work))
  forward_start = {(op.key.sample, op.key.device): op.start for op in timeline
                   if op.key.kind == "F"}
  forward_device = {l: d for d, w in enumerate(work) for l in w.forward_layers}
  weight_device = {l: d for d, w in enumerate(work) for l in w.weight_layers}
  delays = []
  for layer in range(num_layers):
    f, u = forward_device[layer], weight_device[layer]
    delays.append(max(applied_in[u][j] - 1 - _version(update_times[u], forward_start[j, f])
                      for j in window_samples))
  return delays


def _weight_versions(spec, timeline, work, micro_batches, window_samples):
  """Per device, the most versions of one of its layers' weights held at once: those its samples
  in flight were forwarded with (kept until their backward B, which multiplies by them), and the
  current one. The versions are counted where the layer's weights are updated."""
  if not spec.stashes_weights:
    return [1] * len(work)
  update_times, _ = _updates(spec, timeline, micro_batches, len(work))
  spans = [{} for _ in work]  # per device: sample -> [forward start, backward B end]
  for op in timeline:
    if op.key.kind in ("F", "B"):
      span = spans[op.key.device].setdefault(op.key.sample, [op.start, op.end])
      span[0 if op.key.kind == "F" else 1] = op.start if op.key.kind == "F" else op.end
  weight_device = {l: d for d, w in enumerate(work) for l in w.weight_layers}
  versions = []
  for d, w in enumerate(work):
    most = 1
    window = set(window_samples)
    for updates in {tuple(update_times[weight_device[l]]) for l in w.forward_layers}:
      in_flight = []  # heap of (backward end, forward version) of the samples in flight
      for j, (start, end) in sorted(spans[d].items(), key=lambda item: item[1][0]):
        while in_flight and in_flight[0][0] <= start:
          heapq.heappop(in_flight)
        version = _version(updates, start)
        heapq.heappush(in_flight, (end, version))
        if j in window:
          most = max(most, len({v for _, v in in_flight}))
    versions.append(most)
  return versions


def _peak_activations(timeline, num_devices):
  events = [[] for _ in range(num_devices)]
  last_use: dict[tuple[int, int], float] = {}
  for op in timeline:
    k = (op.key.sample, op.key.device)
    if op.key.kind == "F":
      events[op.key.device].append((op.start, 1))
    else:
      last_use[k] = max(last_use.get(k, 0.0), op.end)
  for (sample, d), end in last_use.items():
    events[d].append((end, -1))
  peaks = []
  for device_events in events:
    # At equal times a release comes before an acquire: the slot is reused within the tick.
    level = peak = 0
    for _, change in sorted(device_events):
      level += change
      peak = max(peak, level)
    peaks.append(peak)
  return peaks


def delay_profile(schedule: str, num_stages: int, micro_batches: int = 8,
                  layers: Sequence[LayerCost] | None = None) -> list[int]:
  """Each stage's gradient delay D_s under ``schedule`` (balanced stages of equal layers unless
  ``layers`` are given, one per stage or more): PB 2(S-1-s), PipeDream S-1-s, 2BW 1, sync 0.

  Example:
    >>> delay_profile('pb', num_stages=4)
    [6, 4, 2, 0]
  """
  layers = uniform(num_stages) if layers is None else layers
  return simulate(schedule, layers, num_stages, micro_batches).delays
