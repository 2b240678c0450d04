"""The price of asynchrony in time: how long each schedule takes to reach a target loss on S
devices, joining the samples a method needs (:mod:`pipejax.study.budget`) with the cost model's
time per sample (:mod:`pipejax.schedules`).

A synchronous schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2) runs a method without a
pipeline's delay at ``B`` micro-batches per update: it pays its bubble and one optimizer step per
``B`` samples, after the flush. An asynchronous one (PB, PipeDream, PipeDream-2BW) keeps every
device busy, and each stage pays its own optimizer step after every ``B`` backwards, which the
model spreads over them (a stage's weight-gradient time plus its update over ``B``). The time to
a target is the samples the method needs there times the schedule's time per sample.

Times are the cost model's: the per-stage forward, backward and update costs are FLOPs counted by
XLA's cost analysis (:mod:`pipejax.schedules.measure`), taken as time at one rate on every
device, with free communication. They rank schedules; they are not seconds on any machine.

Interleaved 1F1B needs two or more layers a device (its virtual stages); with one layer a device
it is 1F1B, and the table says so rather than repeating the row.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Sequence

from pipejax import schedules
from pipejax.schedules import LayerCost
from pipejax.study import budget

SYNCHRONOUS = ("gpipe", "1f1b", "interleaved", "zb_h1", "zb_h2")
INTERLEAVED = "interleaved"
UNIT = "10⁹ FLOP-times (XLA's FLOPs at one rate on every device)"


class PriceError(ValueError):
  """The cost file or the schedules asked for do not fit; the message says how to fix them."""


@dataclasses.dataclass(frozen=True)
class StageCosts:
  """The measured costs of one network's stages, one micro-batch each, and one update each."""

  layers: tuple[LayerCost, ...]
  updates: tuple[float, ...]  # FLOPs of one optimizer update of each stage
  description: str = ""

  @property
  def num_stages(self) -> int:
    return len(self.layers)

  def as_dict(self) -> dict:
    return {"description": self.description,
            "stages": [{"name": l.name, "forward": l.forward, "input_grad": l.input_grad,
                        "weight_grad": l.weight_grad, "update": u}
                       for l, u in zip(self.layers, self.updates)]}


def read_costs(path: str) -> StageCosts:
  """The stage costs ``scripts/price.py --measure`` wrote, checked."""
  try:
    with open(path) as f:
      data = json.load(f)
    stages = data["stages"]
    layers = tuple(LayerCost(float(s["forward"]), float(s["input_grad"]), float(s["weight_grad"]),
                             name=str(s.get("name", ""))) for s in stages)
    updates = tuple(float(s["update"]) for s in stages)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise PriceError(f"The stage costs {path} cannot be read ({type(e).__name__}: {e}). Write "
                     "them with scripts/price.py --measure.") from e
  if not layers or any(not math.isfinite(v) or v < 0 for l, u in zip(layers, updates)
                       for v in (l.forward, l.input_grad, l.weight_grad, u)):
    raise PriceError(f"The stage costs {path} hold no stage or a negative or non-finite cost.")
  return StageCosts(layers, updates, str(data.get("description", "")))


def time_per_sample(schedule: str, costs: StageCosts, num_devices: int, batch: int) -> float:
  """The cost model's time per training sample of ``schedule`` at ``batch`` micro-batches (one
  sample each) per update, over ``num_devices`` devices.

  Synchronous: the simulated iteration of ``batch`` micro-batches plus the slowest device's
  optimizer step after the flush, over ``batch``. Asynchronous: the steady-state time per sample
  with each stage's update over ``batch`` added to its weight gradient.
  """
  if batch < 1:
    raise PriceError(f"batch must be a positive number of micro-batches; got {batch}.")
  if schedule == INTERLEAVED:
    if costs.num_stages < 2 * num_devices:
      schedule = "1f1b"  # one layer a device: no virtual stages to interleave
    else:
      raise PriceError("Interleaved 1F1B over several layers a device is not in the cost model; "
                       f"{costs.num_stages} layers on {num_devices} devices would need it.")
  if schedule not in schedules.NAMES:
    raise PriceError(f"Unknown schedule {schedule!r}; known: {', '.join(schedules.NAMES)}, "
                     f"{INTERLEAVED}.")
  if schedules.SCHEDULES[schedule].synchronous:
    report = schedules.simulate(schedule, list(costs.layers), num_devices, micro_batches=batch)
    step = max(sum(costs.updates[l] for l in layers) for layers in report.device_layers)
    return (batch / report.throughput + step) / batch
  layers = [dataclasses.replace(l, weight_grad=l.weight_grad + u / batch)
            for l, u in zip(costs.layers, costs.updates)]
  report = schedules.simulate(schedule, layers, num_devices, micro_batches=batch)
  return 1.0 / report.throughput


@dataclasses.dataclass(frozen=True)
class Priced:
  """One series run under one schedule: (label, schedule, batch)."""

  series: str
  schedule: str
  batch: int


def _time_text(samples: float | None, per_sample: float, kind: str) -> str:
  if kind == "not reached" or samples is None:
    return "not reached"
  value = f"{samples * per_sample / 1e9:,.1f}"
  return f"≤ {value}" if kind == "before" else value


@dataclasses.dataclass(frozen=True)
class TimeToTarget:
  """A report section: the cost model's time to each target loss on ``num_devices`` devices.

  tokens: the study's :class:`~pipejax.study.budget.TokensToTarget` (its series, targets, unit).
  runs: which schedules run each series, at which batch: (series label, schedule, batch) triples.
  costs: the stage costs file (``scripts/price.py --measure``), relative to the report's folder.
  """

  tokens: budget.TokensToTarget
  runs: tuple[tuple[str, str, int], ...]
  costs: str
  num_devices: int
  figure: str = "time_to_target.png"

  def __post_init__(self):
    labels = {label for label, _ in self.tokens.series}
    for series, schedule, batch in self.runs:
      if series not in labels:
        raise PriceError(f"TimeToTarget: {series!r} is not a series of its tokens section.")
      if schedule not in (*schedules.NAMES, INTERLEAVED) or int(batch) < 1:
        raise PriceError(f"TimeToTarget: ({series!r}, {schedule!r}, {batch!r}) needs a known "
                         "schedule and a positive batch.")

  def __call__(self, records: Sequence[dict], workdir: str) -> str:
    costs = read_costs(os.path.join(workdir, self.costs))
    curves = self.tokens.points(records)
    targets = [t / self.tokens.scale for t in self.tokens.targets]
    header = " | ".join(f"{t:g}" for t in self.tokens.targets)
    lines = [f"Time to each target loss ({self.tokens.unit}) on {self.num_devices} devices, in "
             f"{UNIT}: the sequences each series needs there (the table above) times the "
             "schedule's time per sequence at the series' batch. Stage costs: "
             f"{costs.description or self.costs}.", "",
             f"| series | schedule | batch | time per sequence | {header} |",
             "|---|---|---|---|" + "---|" * len(targets)]
    best: dict[str, tuple[float, list, str]] = {}
    for series, schedule, batch in self.runs:
      per_sample = time_per_sample(schedule, costs, self.num_devices, batch)
      found = [budget.crossings(curves[series], t) for t in targets]
      name = schedule if schedule != INTERLEAVED or costs.num_stages >= 2 * self.num_devices \
          else "interleaved (= 1f1b: one layer a device)"
      lines.append(f"| {series} | {name} | {batch} | {per_sample / 1e6:,.2f}·10⁶ | " +
                   " | ".join(_time_text(c.samples, per_sample, c.kind) for c in found) + " |")
      times = [c.samples * per_sample if c.kind == "reached" else math.inf for c in found]
      best[f"{series} ({name})"] = (per_sample, times, series)
    lines += ["", *self._fastest(best)]
    figure = self._figure(os.path.join(workdir, self.figure), best)
    if figure:
      lines += ["", f"![Time to target]({figure})"]
    return "\n".join(lines)

  def _fastest(self, best: dict[str, tuple[float, list, str]]) -> list[str]:
    """Per target, the fastest synchronous and asynchronous runs, where both reached it."""
    synchronous = set(self.tokens.synchronous or (self.tokens.baseline,))
    lines = []
    for i, target in enumerate(self.tokens.targets):
      sides = []
      for is_sync in (True, False):
        reached = [(times[i], key) for key, (_, times, series) in best.items()
                   if (series in synchronous) == is_sync and math.isfinite(times[i])]
        sides.append(min(reached) if reached else None)
      if all(sides):
        (sync_time, sync_key), (async_time, async_key) = sides
        faster = "asynchronous" if async_time < sync_time else "synchronous"
        lines.append(f"* {target:g} {self.tokens.unit}: fastest synchronous {sync_key}, "
                     f"{sync_time / 1e9:,.1f}; fastest asynchronous {async_key}, "
                     f"{async_time / 1e9:,.1f}: the {faster} one first, "
                     f"{max(sides)[0] / min(sides)[0]:.2f}× sooner.")
    return lines or ["No target is reached inside the budgets by both a synchronous and an "
                     "asynchronous series yet (a target below a series' shortest budget counts "
                     "only once a shorter budget brackets it)."]

  def _figure(self, path: str, best: dict[str, tuple[float, list, str]]) -> str | None:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    drawn = False
    for label, (_, times, _) in best.items():
      points = [(t, time / 1e9) for t, time in zip(self.tokens.targets, times)
                if math.isfinite(time)]
      if points:
        ax.plot(*zip(*points), "o-", label=label, lw=1)
        drawn = True
    if not drawn:
      plt.close(fig)
      return None
    ax.set_yscale("log")
    ax.invert_xaxis()
    ax.set_xlabel(f"target validation loss ({self.tokens.unit})")
    ax.set_ylabel(f"time to target ({UNIT.split(' (')[0]})")
    ax.set_title(f"Time to a target loss on {self.num_devices} devices (cost model)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.basename(path)
