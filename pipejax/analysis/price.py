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
import re
from typing import NamedTuple, Sequence

from pipejax import schedules
from pipejax.schedules import LayerCost
from pipejax.study import budget
from pipejax.study import statistics

SYNCHRONOUS = ("gpipe", "1f1b", "interleaved", "zb_h1", "zb_h2")
INTERLEAVED = "interleaved"
UNIT = "10⁹ FLOP-times (XLA's FLOPs at one rate on every device)"
# Two times to a target whose ratio is below this round to 1.00×: neither is named first.
LEVEL = 1.005


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


def schedule_name(schedule: str, costs: StageCosts, num_devices: int) -> str:
  """How tables name ``schedule``: interleaving with one layer a device says it is 1F1B."""
  if schedule == INTERLEAVED and costs.num_stages < 2 * num_devices:
    return "interleaved (= 1f1b: one layer a device)"
  return schedule


def _time_text(samples: float | None, per_sample: float, kind: str) -> str:
  if samples is None:  # 'not reached' or 'no runs'
    return kind
  return _bound_text(samples * per_sample, kind == "before")


def _time_or_bound(run: TimedRun, target: int) -> float:
  """A run's time to the ``target``-th target, or its bound where it gets there before its
  shortest budget; ``inf`` where it does not get there."""
  crossing = run.crossings[target]
  return crossing.samples * run.per_sample if crossing.kind in ("reached", "before") else math.inf


def _fastest_of(runs: Sequence[TimedRun], target: int) -> tuple[TimedRun | None, float, bool]:
  """The run of ``runs`` first to the ``target``-th target, its time (or bound), and whether any
  of them has only a bound there, which makes that time itself a bound."""
  best = min(runs, key=lambda run: _time_or_bound(run, target), default=None)
  if best is None or not math.isfinite(_time_or_bound(best, target)):
    return None, math.inf, False
  bounded = any(run.crossings[target].kind == "before" for run in runs)
  return best, _time_or_bound(best, target), bounded


def _bound_text(time: float, bounded: bool) -> str:
  """A side's best time to a target; '≤' where a run on that side has only a bound there."""
  return f"{'≤ ' if bounded else ''}{time / 1e9:,.1f}"


def _sooner_interval_text(first: TimedRun, second: TimedRun, target: int) -> str:
  """', [low, high] over n seeds, p = ...' for how many times sooner ``first`` reaches the
  ``target``-th target than ``second``, per seed on each seed's own runs; '' under two."""
  first_each, first_at = first.per_sample, first.crossings[target]
  second_each, second_at = second.per_sample, second.crossings[target]
  seeds = sorted(set(first_at.per_seed) & set(second_at.per_seed))
  logs = [math.log(second_at.per_seed[s] * second_each / (first_at.per_seed[s] * first_each))
          for s in seeds]
  result = statistics.paired(logs)
  if result.n < 2:
    return ""
  verdict = "" if result.excludes_zero() else ": not told apart, the interval includes 1×"
  return (f" ([{math.exp(result.low):.2f}, {math.exp(result.high):.2f}] on each seed's own "
          f"runs, n = {result.n}, p = {result.p_value:.2g}{verdict})")


class TimedRun(NamedTuple):
  """One series under one schedule: its time per sample and its time to each target, ``inf``
  where the series does not reach the target inside its budgets."""
  series: str
  schedule: str  # the name the tables show (:func:`schedule_name`)
  batch: int
  per_sample: float
  crossings: list[budget.Crossing]
  times: list[float]

  @property
  def key(self) -> str:
    return f"{self.series} ({self.schedule})"


def _break_even_text(beside: Sequence[budget.TaxReading], tie: float, fastest: str,
                     unit: str) -> str:
  """'; against <fastest>, ...': an asynchronous series' tax against the fastest synchronous
  series at the longest budget, where it is above the break-even ``tie``, and how its trend
  (pooled, and per seed where two or more have one) meets the break-even or does not."""
  longest = min(beside, key=lambda r: r.target) if beside else None
  if not longest or longest.tax <= tie:
    return ""
  text = (f"; against {fastest}, the fastest synchronous run, {longest.tax:.2f}× at "
          f"{longest.target:g} {unit}")
  trend = budget.fit_tax_trend([(r.baseline_samples, r.tax) for r in beside])
  if not trend or not trend.extrapolable:
    why = "one target: no trend" if not trend else "too short a span for a trend"
    return text + f", above its break-even {tie:.2f}× ({why})"
  seeds = budget.slope_interval(beside)
  per_seed = (f" (per seed {seeds.mean:+.2f} [{seeds.low:+.2f}, {seeds.high:+.2f}], "
              f"n = {seeds.n}, p = {seeds.p_value:.2g}: {budget.slope_verdict(seeds)})"
              if seeds.n >= 2 else "")
  text += (f", {'falling' if trend.slope < 0 else 'not falling'} as "
           f"samples^{trend.slope:+.2f}{per_seed}")
  at_tie = trend.samples_at(tie)
  if at_tie is None:
    return text + f": the fit never reaches its break-even {tie:.2f}×"
  if math.isinf(at_tie):
    return text + (f": it falls too slowly for the fit to reach its break-even {tie:.2f}× at "
                   "any budget")
  return text + (f": extrapolated, to its break-even {tie:.2f}× at about {budget.about(at_tie)} "
                 "sequences of that run")


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
  # The goal: an asynchronous run whose tax at the longest budget is at most ``goal_tax`` and
  # that reaches the baseline's loss at ``goal_samples`` sooner than every synchronous run.
  goal_samples: int | None = None
  goal_tax: float = 1.1

  def __post_init__(self):
    labels = {label for label, _ in self.tokens.series}
    for series, schedule, batch in self.runs:
      if series not in labels:
        raise PriceError(f"TimeToTarget: {series!r} is not a series of its tokens section.")
      if schedule not in (*schedules.NAMES, INTERLEAVED) or int(batch) < 1:
        raise PriceError(f"TimeToTarget: ({series!r}, {schedule!r}, {batch!r}) needs a known "
                         "schedule and a positive batch.")

  def read_costs(self, workdir: str) -> StageCosts:
    """The stage costs file, relative to ``workdir`` unless absolute."""
    return read_costs(os.path.join(workdir, self.costs))  # an absolute path stays itself

  def timed(self, records: Sequence[dict], costs: StageCosts,
            targets: Sequence[float] | None = None) -> list[TimedRun]:
    """Each run's times to ``targets`` (in the report's unit; the section's by default)."""
    curves = self.tokens.points(records)
    found = []
    for series, schedule, batch in self.runs:
      per_sample = time_per_sample(schedule, costs, self.num_devices, batch)
      reached = [budget.crossings(curves[series], t / self.tokens.scale)
                 for t in (self.tokens.targets if targets is None else targets)]
      times = [c.samples * per_sample if c.kind == "reached" else math.inf for c in reached]
      found.append(TimedRun(series, schedule_name(schedule, costs, self.num_devices), batch,
                            per_sample, reached, times))
    return found

  def fastest(self, records: Sequence[dict], workdir: str) -> list[str]:
    """Per target, which side reaches it first (:meth:`_fastest`)."""
    return self._fastest(self.timed(records, self.read_costs(workdir)))

  def __call__(self, records: Sequence[dict], workdir: str) -> str:
    costs = self.read_costs(workdir)
    header = " | ".join(f"{t:g}" for t in self.tokens.targets)
    lines = [f"Time to each target loss ({self.tokens.unit}) on {self.num_devices} devices, in "
             f"{UNIT}: the sequences each series needs there (the table above) times the "
             "schedule's time per sequence at the series' batch. Stage costs: "
             f"{costs.description or self.costs}.", "",
             f"| series | schedule | batch | time per sequence | {header} |",
             "|---|---|---|---|" + "---|" * len(self.tokens.targets)]
    timed = self.timed(records, costs)
    for run in timed:
      lines.append(f"| {run.series} | {run.schedule} | {run.batch} | "
                   f"{run.per_sample / 1e6:,.2f}·10⁶ | " +
                   " | ".join(_time_text(c.samples, run.per_sample, c.kind)
                              for c in run.crossings) + " |")
    lines += ["", *self._fastest(timed)]
    if self.goal_samples:
      lines += ["", *self.goal(records, workdir)]
    figure = self._figure(os.path.join(workdir, self.figure), timed) if workdir else None
    if figure:
      lines += ["", f"![Time to target]({figure})"]
    return "\n".join(lines)

  def _fastest(self, timed: list[TimedRun]) -> list[str]:
    """Per target, the fastest synchronous and asynchronous runs, where both get there, and how
    many times sooner the first does: on the seeds' mean curves, with the interval over seeds of
    the same ratio on each seed's own runs (paired by seed) where two or more have it.

    A run that reaches a target before its shortest budget has only an upper bound there (its
    time at that budget). Where one side has such a bound, the first is named only when that
    bound beats the other side's exact time; else the target is left undecided."""
    synchronous = set(self.tokens.synchronous or (self.tokens.baseline,))
    lines = []
    for i, target in enumerate(self.tokens.targets):
      sides = [_fastest_of([run for run in timed if (run.series in synchronous) == is_sync], i)
               for is_sync in (True, False)]
      if not all(run for run, _, _ in sides):
        continue
      sync_first = sides[0][1] <= sides[1][1]  # a tie: synchronous first
      (first, first_time, first_bounded), (second, second_time, second_bounded) = (
          sides if sync_first else sides[::-1])
      faster = "synchronous" if sync_first else "asynchronous"
      ratio = second_time / first_time
      if not first_bounded and not second_bounded:
        # A ratio that rounds to 1.00× names no winner.
        order = (f"level within {LEVEL - 1:.1%}" if ratio < LEVEL else
                 f"the {faster} one first, {ratio:.2f}× sooner")
        order += _sooner_interval_text(first, second, i)
      elif not second_bounded:
        order = (f"the {faster} one first, at least {ratio:.2f}× sooner (a run on its side "
                 "reaches the target before its shortest budget, so its time is a bound)")
      else:
        order = ("not decided: a run on the slower-looking side reaches the target before its "
                 "shortest budget, so its time is only a bound; a shorter budget would tell")
      (sync, sync_time, sync_bounded), (asynchronous, async_time, async_bounded) = sides
      lines.append(f"* {target:g} {self.tokens.unit}: fastest synchronous {sync.key}, "
                   f"{_bound_text(sync_time, sync_bounded)}; fastest asynchronous "
                   f"{asynchronous.key}, {_bound_text(async_time, async_bounded)}: {order}.")
    return lines or ["No target is reached inside the budgets by both a synchronous and an "
                     "asynchronous series yet."]

  def goal(self, records: Sequence[dict], workdir: str) -> list[str]:
    """Whether an asynchronous run meets the goal: its token tax at the longest budget (the
    lowest target it and a synchronous series reach) at most ``goal_tax``, and the baseline's
    loss at ``goal_samples`` reached sooner than by every synchronous run."""
    tokens, costs = self.tokens, self.read_costs(workdir)
    at_goal = [p for p in tokens.points(records)[tokens.baseline] if p.samples == self.goal_samples]
    if not at_goal:
      return [f"The goal: no run of {tokens.baseline} at {self.goal_samples:,} sequences yet."]
    target = at_goal[0].mean
    synchronous = set(tokens.synchronous or (tokens.baseline,))
    timed = self.timed(records, costs, (target * tokens.scale,))
    times = {(run.series, run.schedule): run.times[0] for run in timed}
    no_runs = {(run.series, run.schedule) for run in timed if run.crossings[0].kind == "no runs"}
    per_sample = {(run.series, run.schedule): run.per_sample for run in timed}
    sync_best = min(((t, key) for key, t in times.items() if key[0] in synchronous),
                    default=(math.inf, None))
    readings = tokens.taxes(records)
    lines = [f"The goal: a token tax of at most {self.goal_tax:g}× at the longest budget, and "
             f"{tokens.baseline}'s loss at {self.goal_samples:,} sequences "
             f"({target * tokens.scale:.3f} {tokens.unit}) reached on {self.num_devices} devices "
             "sooner than by the fastest synchronous run"
             + (f" ({sync_best[1][0]} under {sync_best[1][1]}, {sync_best[0] / 1e9:,.1f} × 10⁹ "
                "FLOP-times)."
                if sync_best[1] else " (none reaches it inside its budgets yet).")]
    # The break-even is a tax against the synchronous run that reaches the goal's loss first, on
    # its own samples, so the trend extrapolated to it is that of the taxes against that series,
    # which need not be the one with the fewest samples to a target (a larger batch costs
    # samples and saves time), nor the one cheapest per sample (it may never get there).
    fastest_series = sync_best[1][0] if sync_best[1] else None
    fastest_sync = per_sample[sync_best[1]] if sync_best[1] else math.inf
    against_fastest = tokens.taxes(records, against=(fastest_series,)) if fastest_series else []
    met = []
    for (series, name), time in times.items():
      if series in synchronous:
        continue
      mine = [r for r in readings if r.series == series]
      longest = min(mine, key=lambda r: r.target) if mine else None
      tax = (f"tax {longest.tax:.2f}× at {longest.target:g} {tokens.unit}" if longest
             else "no tax measured yet")
      tie = fastest_sync / per_sample[series, name]
      beside = [r for r in against_fastest if r.series == series]
      tax += _break_even_text(beside, tie, fastest_series, tokens.unit)
      when = (f"reaches it in {time / 1e9:,.1f}" if math.isfinite(time)
              else "no runs yet" if (series, name) in no_runs
              else "does not reach it inside its budgets")
      ok = bool(longest) and longest.tax <= self.goal_tax and time < sync_best[0]
      met += [series] if ok else []
      lines.append(f"* {series} ({name}): {tax}; {when}: {'met' if ok else 'not met'}.")
    lines.append(f"Met by {', '.join(met)}." if met else
                 "No asynchronous run meets the goal in the records so far.")
    return lines

  def _figure(self, path: str, timed: list[TimedRun]) -> str | None:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
    styles = line_styles([(run.series, run.schedule) for run in timed])
    palette = plt.get_cmap("tab10" if len({run.series for run in timed}) <= 10 else "tab20")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    drawn = False
    for run in timed:
      points = [(t, time / 1e9) for t, time in zip(self.tokens.targets, run.times)
                if math.isfinite(time)]
      if points:
        colour, marker, dash = styles[run.series, run.schedule]
        ax.plot(*zip(*points), label=run.key, lw=1, ms=5, mfc="none",
                color=palette(colour % palette.N), marker=marker, ls=dash)
        drawn = True
    if not drawn:
      plt.close(fig)
      return None
    ax.set_yscale("log")
    ax.invert_xaxis()
    ax.set_xlabel(f"target validation loss ({self.tokens.unit})")
    ax.set_ylabel(f"time to target ({UNIT.split(' (')[0]})")
    ax.set_title(f"Time to a target loss on {self.num_devices} devices (cost model)")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return os.path.basename(path)


def line_styles(lines: Sequence[tuple[str, str]]) -> dict[tuple[str, str], tuple[int, str, str]]:
  """(colour index, marker, dash) for each (series, schedule) line of the time figure: the series
  sets the colour, the schedule the marker and dash, so that no two series share a colour and
  schedules of equal time (1F1B and its interleaving at one layer a device) stay legible where
  their lines overlap."""
  series_order = list(dict.fromkeys(series for series, _ in lines))
  schedule_order = list(dict.fromkeys(name for _, name in lines))
  markers, dashes = "os^vDP<>X*", ("-", "--", ":", "-.")
  return {(series, name): (series_order.index(series),
                           markers[schedule_order.index(name) % len(markers)],
                           dashes[schedule_order.index(name) % len(dashes)])
          for series, name in lines}


def break_even(section: TimeToTarget, costs: StageCosts) -> str:
  """The largest token tax at which each asynchronous run still reaches a target first: the
  fastest synchronous run's time per sample over its own (the cost model's, no training)."""
  synchronous = set(section.tokens.synchronous or (section.tokens.baseline,))
  timed = [(series, schedule, batch,
            time_per_sample(schedule, costs, section.num_devices, batch))
           for series, schedule, batch in section.runs]
  sync = [t for t in timed if t[0] in synchronous]
  if not sync:
    return ""
  fastest = min(sync, key=lambda t: t[3])
  lines = [f"Time per sequence on {section.num_devices} devices (FLOPs at one rate on every "
           "device, by XLA's cost analysis), and for each "
           "asynchronous run the token tax at which it would tie with the synchronous run "
           f"cheapest per sequence ({fastest[0]} under {fastest[1]}): below it, the "
           "asynchronous run reaches a target first. A run cheaper per sequence can still reach "
           "a target later, by needing more sequences: the goal below sets each asynchronous "
           "run against the synchronous run that reaches the goal's loss first.", "",
           "| series | schedule | batch | time per sequence | break-even token tax |",
           "|---|---|---|---|---|"]
  for series, schedule, batch, per_sample in timed:
    tie = "—" if series in synchronous else f"{fastest[3] / per_sample:.2f}×"
    lines.append(f"| {series} | {schedule_name(schedule, costs, section.num_devices)} | {batch} "
                 f"| {per_sample / 1e6:,.2f}·10⁶ | {tie} |")
  return "\n".join(lines)


def docs_section(tokens: budget.TokensToTarget, section: TimeToTarget, records: Sequence[dict],
                 workdir: str) -> str:
  """The part of docs/lm.md on when the pipeline pays, from the budget study's records and its
  stage costs: the break-even tax by schedule, the tokens to each target with the tax, and which
  side reaches each target first."""
  tables = tokens(records, "")  # no figure: the report has it
  fastest = "\n".join(section.fastest(records, workdir))
  goal = "\n".join(section.goal(records, workdir)) if section.goal_samples else ""
  return "\n\n".join(part for part in (break_even(section, section.read_costs(workdir)), tables,
                                        fastest, goal) if part)


DOCS_BLOCK = "when-the-pipeline-pays"
_BLOCK = re.compile(rf"(<!-- begin {DOCS_BLOCK} -->\n)(?:.*?\n)?(<!-- end {DOCS_BLOCK} -->)", re.S)


def render_docs(page: str, block: str) -> str:
  """``page`` with its generated block (between ``<!-- begin when-the-pipeline-pays -->`` and
  ``<!-- end when-the-pipeline-pays -->``) replaced by ``block``.

  Raises:
    PriceError: the page has no such block, or more than one.
  """
  found = len(_BLOCK.findall(page))
  if found != 1:
    raise PriceError(f"The page must hold one generated block between <!-- begin {DOCS_BLOCK} "
                     f"--> and <!-- end {DOCS_BLOCK} --> lines; it holds {found}.")
  return _BLOCK.sub(lambda m: m[1] + block.rstrip("\n") + "\n" + m[2], page)
