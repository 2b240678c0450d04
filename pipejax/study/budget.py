"""Tokens to a target loss: what a method's final loss at several budgets says about the data it
needs, and the token tax of an asynchronous method against the best synchronous one.

A cosine schedule is shaped by its end, so a run's loss part-way through is not what a shorter
run would reach: each budget is its own run. For one series (a method at one batch), at each
budget the best learning rate of that budget is taken (budgets are tuned separately: the best
rate falls as runs lengthen), and the final loss at that rate, mean of its seeds, is a point of
the series' curve of loss against log training samples. The samples needed to reach a target
loss are read off that curve by linear interpolation in log samples between the two budgets
that bracket the target; a target below the longest budget's loss is 'not reached', one above
the shortest budget's loss 'reached by' that budget (no extrapolation either way).

Where a seed has runs at two or more budgets, the same reading of its own runs gives one value
per seed, and the table gives their geometric mean's 95% Student-t interval (in log samples).
The token tax at a target is a series' samples over those of the best synchronous series there;
its interval is paired by seed where both have that seed's crossing.

:class:`TokensToTarget` is a report section (``Section(title, TokensToTarget(...))``): it renders
the table, the tax and a figure of loss against budget from the study's records alone.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

from pipejax.study import statistics
from pipejax.study.cells import select
from pipejax.study.records import DIVERGED, FINISHED, RunRecord, is_number
from pipejax.study.spec import key_of

# One series: (label, where), where is the ``cells.select`` filter of its runs.
Series = tuple[str, tuple]


@dataclasses.dataclass(frozen=True)
class BudgetPoint:
  """One budget of a series: its best rate and the final losses of that rate's seeds."""

  samples: int
  rate: float | None
  losses: dict[int, float]  # seed -> final test loss (nats)
  # seed -> the last evaluation interval's training loss, where it spans at most half the run
  train_losses: dict[int, float]
  rates_tried: tuple = ()  # every rate that finished or diverged at this budget, lowest first

  @property
  def mean(self) -> float:
    return sum(self.losses.values()) / len(self.losses)

  @property
  def bracket(self) -> str:
    """Whether a tried rate lies on each side of the best: 'yes', or why not ('one rate',
    'highest tried', 'lowest tried'). Unbracketed, a rate beyond might reach a lower loss."""
    rates = [r for r in self.rates_tried if r is not None]
    if len(rates) < 2 or self.rate is None:
      return "one rate"
    if self.rate == rates[-1]:
      return "highest tried"
    if self.rate == rates[0]:
      return "lowest tried"
    return "yes"


def _rate(record: RunRecord) -> float | None:
  """The run's learning rate as the study set it, else as the trainer reported it."""
  return record.overrides.get("reference.lr", record.learning_rate)


def budget_points(records: Sequence[RunRecord], where: tuple) -> list[BudgetPoint]:
  """A series' points, shortest budget first: at each budget (a run's ``samples``) the rate with
  the lowest mean final loss (the rate tuned per budget), over the seeds every rate there has
  where there are any: a rate's extra seed would otherwise move its mean by that seed's luck."""
  selected = select(records, where)
  runs = [r for r in selected if r.status == FINISHED
          and is_number(r.test_loss) and is_number(r.samples)]
  # A rate that diverged (so recorded, or finished on a loss that is not a number) is worse than
  # any that finished: it brackets the best from its side. A trainer stopped by divergence
  # leaves no sample count, so its budget is that of the finished runs with the same settings
  # but for the rate and the seed.
  def settings(r):
    return key_of({k: v for k, v in r.overrides.items() if k not in ("reference.lr", "seed")})
  budget_of = {settings(r): int(r.samples) for r in runs}
  diverged_rates: dict[int, set] = {}
  for r in selected:
    if r.status == DIVERGED or (r.status == FINISHED and not is_number(r.test_loss)):
      if settings(r) in budget_of:
        diverged_rates.setdefault(budget_of[settings(r)], set()).add(
            _rate(r))
  by_budget: dict[int, dict] = {}
  for r in runs:
    rate = _rate(r)
    by_budget.setdefault(int(r.samples), {}).setdefault(rate, []).append((r.seed, r))
  points = []
  for samples in sorted(by_budget):
    rates = by_budget[samples]
    shared = set.intersection(*({seed for seed, _ in runs_at} for runs_at in rates.values()))

    def mean_loss(rate):
      losses = [r.test_loss for seed, r in rates[rate] if seed in shared or not shared]
      return sum(losses) / len(losses)
    best = min(rates, key=mean_loss)
    points.append(BudgetPoint(
        samples, best, {seed: r.test_loss for seed, r in rates[best]},
        {seed: r.train_loss for seed, r in rates[best] if _is_final_train_loss(r)},
        tuple(sorted(set(rates) | diverged_rates.get(samples, set()),
                     key=lambda rate: (rate is None, rate)))))
  return points


def _is_final_train_loss(record) -> bool:
  """Whether the record's training loss (its last evaluation interval's mean) reads as a final
  one: not where that interval spans more than half the run, whose mean takes in the fast fall at
  the start of training (a short run evaluated only at its end)."""
  if not is_number(record.train_loss):
    return False
  curve = record.train_curve or ()
  if not curve or not record.samples:
    return True
  start = curve[-2][0] if len(curve) >= 2 else 0
  return curve[-1][0] - start <= record.samples / 2


def brackets(points: Sequence[BudgetPoint]) -> list[str]:
  """Each point's :attr:`BudgetPoint.bracket`, and, where its best is the highest (lowest) rate
  tried, whether a higher rate lost at a shorter budget (a lower one at a longer budget): if the
  best rate falls as budgets lengthen, that rate loses here too. A prior, not a measurement, so
  the text says which it is."""
  texts = []
  for i, p in enumerate(points):
    text = p.bracket
    if text == "highest tried" and any(
        r is not None and q.rate is not None and r > max(p.rate, q.rate)
        for q in points[:i] for r in q.rates_tried):
      text += "; a higher rate lost at a shorter budget"
    elif text == "lowest tried" and any(
        r is not None and q.rate is not None and r < min(p.rate, q.rate)
        for q in points[i + 1:] for r in q.rates_tried):
      text += "; a lower rate lost at a longer budget"
    texts.append(text)
  return texts


def crossing(curve: Sequence[tuple[int, float]], target: float) -> tuple[str, float | None]:
  """Where a curve of (samples, loss) points, shortest budget first, first reaches ``target``.

  Returns ('reached', samples) interpolated linearly in log samples between the bracketing
  budgets; ('before', shortest budget) when the shortest already is at or below the target;
  ('not reached', None) when no budget reaches it; ('no runs', None) for an empty curve, a series
  whose runs have not finished yet. A curve that rises again after reaching the target (an
  overlong budget that overfits) keeps its first crossing.
  """
  if not curve:
    return "no runs", None
  if curve[0][1] <= target:
    return "before", float(curve[0][0])
  for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
    if l1 <= target < l0:
      fraction = (l0 - target) / (l0 - l1)
      return "reached", math.exp(math.log(s0) + fraction * (math.log(s1) - math.log(s0)))
  return "not reached", None


def seed_crossings(points: Sequence[BudgetPoint], target: float) -> dict[int, float]:
  """Per seed with runs at two or more budgets, the samples its own runs take to ``target``
  (only where the target lies between its budgets)."""
  seeds = sorted({seed for p in points for seed in p.losses})
  found = {}
  for seed in seeds:
    curve = [(p.samples, p.losses[seed]) for p in points if seed in p.losses]
    if len(curve) >= 2:
      kind, samples = crossing(curve, target)
      if kind == "reached":
        found[seed] = samples
  return found


def log_interval(values: Sequence[float]) -> statistics.Interval:
  """The interval of ``values`` (all positive) in log space, mapped back: a geometric mean."""
  result = statistics.interval([math.log(v) for v in values])
  return dataclasses.replace(result, mean=math.exp(result.mean), low=math.exp(result.low),
                             high=math.exp(result.high))


@dataclasses.dataclass(frozen=True)
class Crossing:
  kind: str  # 'reached', 'before', 'not reached' or 'no runs'
  samples: float | None  # from the seeds' mean curve
  per_seed: dict[int, float]


def crossings(points: Sequence[BudgetPoint], target: float) -> Crossing:
  kind, samples = crossing([(p.samples, p.mean) for p in points], target)
  return Crossing(kind, samples, seed_crossings(points, target))


def token_tax(method: Crossing, baseline: Crossing) -> tuple[float | None, statistics.Interval]:
  """A series' samples over the baseline's at one target, and the paired-by-seed interval of
  that ratio (geometric); None where either did not reach the target inside its budgets."""
  if method.kind != "reached" or baseline.kind != "reached":
    return None, statistics.interval([])
  seeds = sorted(set(method.per_seed) & set(baseline.per_seed))
  ratios = [method.per_seed[s] / baseline.per_seed[s] for s in seeds]
  interval = log_interval(ratios) if ratios else statistics.interval([])
  return method.samples / baseline.samples, interval


def _rate_text(rate) -> str:
  return "—" if rate is None else f"{rate:g}"


def _samples_text(c: Crossing) -> str:
  if c.samples is None:  # 'not reached' or 'no runs'
    return c.kind
  if c.kind == "before":
    return f"≤ {c.samples:,.0f}"
  text = f"{c.samples:,.0f}"
  if len(c.per_seed) >= 2:
    iv = log_interval(list(c.per_seed.values()))
    text += f" [{iv.low:,.0f}, {iv.high:,.0f}], n = {iv.n}"
  return text


def _tax_text(tax: float | None, interval: statistics.Interval) -> str:
  if tax is None:
    return "—"
  text = f"{tax:.2f}×"
  if interval.n >= 2:
    text += f" [{interval.low:.2f}, {interval.high:.2f}], n = {interval.n}"
  return text


# The least span of baseline samples over which a tax trend is extrapolated. An error in the
# slope moves the extrapolated crossing by the log of its distance over the log of the span: a
# fit over two neighbouring targets (1.2-fold) can put 1.1x five powers of ten out, on a slope
# that one more target could halve.
MIN_SPAN = 1.5
# The largest natural log of samples that a float holds (e^709 is about 8e307).
MAX_LOG = 709.0


@dataclasses.dataclass(frozen=True)
class TaxTrend:
  """log tax linear in the baseline's log samples to the target, fitted over ``points``
  (baseline samples, tax), the most samples last."""

  slope: float
  mean_log_samples: float
  mean_log_tax: float
  points: tuple[tuple[float, float], ...]

  @property
  def span(self) -> float:
    """How many times the most baseline samples of the fit exceed the fewest."""
    return self.points[-1][0] / self.points[0][0]

  @property
  def extrapolable(self) -> bool:
    """Whether the fit spans enough samples to be read beyond them (:data:`MIN_SPAN`)."""
    return self.span >= MIN_SPAN

  def samples_at(self, tax: float) -> float | None:
    """The baseline samples at which the fitted tax equals ``tax``; None where it never
    falls, ``inf`` where a nearly flat fall takes it past any float."""
    if self.slope >= 0:
      return None
    log_samples = self.mean_log_samples + (math.log(tax) - self.mean_log_tax) / self.slope
    return math.exp(log_samples) if log_samples < MAX_LOG else math.inf


def fit_tax_trend(taxes: Sequence[tuple[float, float]]) -> TaxTrend | None:
  """The least-squares :class:`TaxTrend` of ``(baseline samples, tax)`` pairs; None with fewer
  than two distinct samples."""
  points = tuple(sorted((s, t) for s, t in taxes if t and t > 0))
  if len(points) < 2:
    return None
  xs = [math.log(s) for s, _ in points]
  ys = [math.log(t) for _, t in points]
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  sxx = sum((x - mx) ** 2 for x in xs)
  if sxx == 0:
    return None
  slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
  return TaxTrend(slope, mx, my, points)


def tax_trend(taxes: Sequence[tuple[float, float]], goal: float) -> str:
  """A sentence on how the tax moves with the baseline's samples to the target, and, fitting
  log tax linearly in log samples, at what samples it would cross ``goal``."""
  trend = fit_tax_trend(taxes)
  if trend is None:
    return ""
  points, slope = trend.points, trend.slope
  text = (f"Fitted over {len(points)} targets, whose baseline samples span "
          f"{trend.span:.1f}-fold ({points[0][0]:,.0f} to {points[-1][0]:,.0f}), "
          f"the tax scales as samples^{slope:+.2f} (log tax linear in the baseline's log samples "
          "to the target)")
  if points[-1][1] <= goal:
    return text + f"; it is already at or below {goal:g}× at the longest target reached."
  if not trend.extrapolable:
    return text + (f"; too short a span to extrapolate (at least {MIN_SPAN:g}-fold): longer "
                   "budgets would tell.")
  cross = trend.samples_at(goal)
  if cross is None:
    return text + f"; it does not fall, so the fit never reaches {goal:g}×."
  if math.isinf(cross):
    return text + f"; it falls too slowly for the fit to reach {goal:g}× at any budget."
  return text + (f"; extrapolated, it would reach {goal:g}× at about {about(cross)} samples of "
                 f"the baseline, {about(cross / points[-1][0])} times the most of these targets "
                 "needs (an extrapolation of the fit, not a measurement).")


def slope_interval(readings: Sequence[TaxReading]) -> statistics.Interval:
  """The tax trend's slope fitted on each seed's own runs (its taxes paired with the baseline's
  same seed), and the Student-t interval of those slopes over the seeds whose fit spans at least
  :data:`MIN_SPAN`: the test of whether the tax falls or rises with the budget."""
  seeds = sorted({seed for r in readings for seed in r.per_seed})
  slopes = []
  for seed in seeds:
    trend = fit_tax_trend([r.per_seed[seed] for r in readings if seed in r.per_seed])
    if trend is not None and trend.extrapolable:
      slopes.append(trend.slope)
  return statistics.paired(slopes)


def slope_interval_text(interval: statistics.Interval) -> str:
  """One sentence on :func:`slope_interval`; empty under two seeds."""
  if interval.n < 2:
    return ""
  return (f" Fitted on each seed's own runs, the slope is {interval.mean:+.2f} "
          f"[{interval.low:+.2f}, {interval.high:+.2f}], n = {interval.n} seeds, "
          f"p = {interval.p_value:.2g} (t-test of no trend): {slope_verdict(interval)}.")


def slope_verdict(interval: statistics.Interval) -> str:
  """What the per-seed slopes show: a fall, a rise, or neither."""
  return ("neither a fall nor a rise is shown" if not interval.excludes_zero()
          else "it falls" if interval.mean < 0 else "it rises")


_SUPERSCRIPT = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")


def about(x: float) -> str:
  """``x`` to two significant figures: ``18,000``, or ``1.6·10¹⁴`` from a million up (the
  precision of an extrapolation, not of a measurement)."""
  rounded = float(f"{x:.2g}")
  if rounded < 1e6:
    return f"{rounded:,.0f}" if rounded >= 10 else f"{rounded:g}"
  exponent = math.floor(math.log10(rounded))
  return f"{rounded / 10 ** exponent:.1f}·10{str(exponent).translate(_SUPERSCRIPT)}"


def _figure(path: str, curves: dict[str, list[BudgetPoint]], targets: Sequence[float],
            scale: float, unit: str) -> str | None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(7, 4.5))
  drawn = False
  for label, points in curves.items():
    if points:
      ax.plot([p.samples for p in points], [p.mean * scale for p in points], "o-", label=label)
      drawn = True
  if not drawn:
    plt.close(fig)
    return None
  for target in targets:
    ax.axhline(target, color="grey", lw=0.5, ls=":")
  ax.set_xscale("log")
  ax.set_xlabel("training sequences (one run per budget, each at its best rate)")
  ax.set_ylabel(f"final validation loss ({unit})" if unit else "final validation loss")
  ax.legend(fontsize=8)
  ax.set_title("Loss against budget: the token tax is the horizontal distance")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return os.path.basename(path)


@dataclasses.dataclass(frozen=True)
class TaxReading:
  """One asynchronous series' token tax at one target: its samples over those of the best
  synchronous series there (``against``), whose samples to the target are ``baseline_samples``."""

  series: str
  target: float  # in the section's unit
  tax: float
  against: str
  baseline_samples: float
  # seed -> (the baseline's samples to the target on that seed, the tax on that seed)
  per_seed: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)

  @property
  def interval(self) -> statistics.Interval:
    """The tax's interval paired by seed (geometric); n < 2 where under two seeds crossed in
    both series."""
    taxes = [tax for _, tax in self.per_seed.values()]
    return log_interval(taxes) if taxes else statistics.interval([])


@dataclasses.dataclass(frozen=True)
class TokensToTarget:
  """A report section: per series, the samples to each target loss and the token tax.

  series: (label, where) of each method at its batch. baseline: the label whose loss at the
  middle budget is quoted. synchronous: the labels of the synchronous series; the tax at a
  target is taken against the one of them that needs the fewest samples there (default: the
  baseline alone). targets: in the report's unit (the metric times ``scale``).
  """

  series: tuple[Series, ...]
  baseline: str
  targets: tuple[float, ...]
  synchronous: tuple[str, ...] = ()
  scale: float = 1.0
  unit: str = ""
  goal: float = 1.1  # the tax the study asks for
  figure: str = "tokens_to_target.png"

  def __post_init__(self):
    labels = [label for label, _ in self.series]
    for name in (self.baseline, *self.synchronous):
      if name not in labels:
        raise ValueError(f"TokensToTarget: {name!r} is not one of its series {labels}.")

  def points(self, records: Sequence[RunRecord]) -> dict[str, list[BudgetPoint]]:
    return {label: budget_points(records, where) for label, where in self.series}

  def __call__(self, records: Sequence[RunRecord], workdir: str) -> str:
    curves = self.points(records)
    if not any(curves.values()):
      return "No finished run of these series is recorded yet."
    lines = [self._budgets_table(curves), "", self._targets_table(curves)]
    figure = _figure(os.path.join(workdir, self.figure), curves, self.targets, self.scale,
                     self.unit) if workdir and os.path.isdir(workdir) else None
    if figure:
      lines += ["", f"![Loss against budget]({figure})"]
    return "\n".join(lines)

  def _budgets_table(self, curves) -> str:
    lines = ["Each budget's best rate and its final losses (validation, and training over the "
             "last evaluation interval where the record has it and that interval spans at most "
             "half the run: below the validation loss past an epoch, repeated data shows).", "",
             f"| series | sequences | best rate | rates tried | bracketed "
             f"| validation ({self.unit}) | n | training |",
             "|---|---|---|---|---|---|---|---|"]
    unbracketed = by_prior = 0
    for label, points in curves.items():
      for p, bracket in zip(points, brackets(points)):
        iv = statistics.interval([v * self.scale for v in p.losses.values()])
        value = f"{iv.mean:.3f}" + (f" [{iv.low:.3f}, {iv.high:.3f}]" if iv.n >= 2 else "")
        train = (f"{sum(p.train_losses.values()) / len(p.train_losses) * self.scale:.3f}"
                 if p.train_losses else "—")
        tried = ", ".join(_rate_text(rate) for rate in p.rates_tried)
        unbracketed += p.bracket != "yes"
        by_prior += bracket != p.bracket
        lines.append(f"| {label} | {p.samples:,} | {_rate_text(p.rate)} | {tried} "
                     f"| {bracket} | {value} | {iv.n} | {train} |")
    total = sum(len(points) for points in curves.values())
    if unbracketed:
      lines += ["", f"{unbracketed} of {total} budgets have no tried rate on one side of their "
                "best: a rate beyond might reach a lower loss there and shorten that series' "
                "samples to a target. An asynchronous series' tax there may be overstated; the "
                f"taxes against a synchronous series there, understated. Of these, {by_prior} "
                "are bracketed on that side only if the best rate falls as budgets lengthen "
                "(a neighbouring budget's loss at a rate beyond, not this one's)."]
    return "\n".join(lines)

  def crossings(self, curves: dict[str, list[BudgetPoint]]) -> dict[str, list[Crossing]]:
    """Per series, its crossing of each target."""
    return {label: [crossings(points, t / self.scale) for t in self.targets]
            for label, points in curves.items()}

  def taxes(self, records: Sequence[RunRecord],
            against: Sequence[str] | None = None) -> list[TaxReading]:
    """Every token tax the records measure: each asynchronous series at each target that it and
    at least one synchronous series reach inside their budgets, against the synchronous series
    that reaches it in the fewest samples (of ``against``, default: all of the section's). A
    target that another synchronous series already reached at a shorter budget than the best
    crossing has no reading: the best synchronous series there is not bracketed, and the tax
    would be understated."""
    return self._taxes(self.crossings(self.points(records)), against)

  def _taxes(self, found: dict[str, list[Crossing]],
             against: Sequence[str] | None = None) -> list[TaxReading]:
    all_synchronous = self.synchronous or (self.baseline,)
    synchronous = all_synchronous if against is None else tuple(against)
    if not set(synchronous) <= set(all_synchronous):
      raise ValueError(f"Token taxes against {list(synchronous)}: each must be one of the "
                       f"section's synchronous series, {list(all_synchronous)}.")
    readings = []
    for label in found:
      if label in all_synchronous:
        continue
      for i, target in enumerate(self.targets):
        reached = [(s, found[s][i]) for s in synchronous if found[s][i].kind == "reached"]
        if not reached:
          continue
        best_series, best = min(reached, key=lambda pair: pair[1].samples)
        if any(found[s][i].kind == "before" and found[s][i].samples < best.samples
               for s in synchronous):
          continue  # a synchronous series got there sooner than its shortest budget says
        tax, _ = token_tax(found[label][i], best)
        if tax is not None:
          mine = found[label][i].per_seed
          per_seed = {seed: (best.per_seed[seed], mine[seed] / best.per_seed[seed])
                      for seed in sorted(set(mine) & set(best.per_seed))}
          readings.append(
              TaxReading(label, target, tax, best_series, best.samples, per_seed))
    return readings

  def _targets_table(self, curves) -> str:
    synchronous = self.synchronous or (self.baseline,)
    header = " | ".join(f"{t:g}" for t in self.targets)
    lines = [f"Sequences to reach each target loss ({self.unit}), interpolated in log sequences "
             "between budgets (geometric mean [95% CI] over seeds with their own crossing); "
             "then the token tax, each series' sequences over the best synchronous series' at "
             "that target (paired by seed).", "",
             f"| series | {header} |", "|---|" + "---|" * len(self.targets)]
    found = self.crossings(curves)
    for label in found:
      lines.append(f"| {label} | " + " | ".join(_samples_text(c) for c in found[label]) + " |")
    lines += ["", f"| token tax | {header} |", "|---|" + "---|" * len(self.targets)]
    readings = self._taxes(found)
    trends = []
    for label in found:
      if label in synchronous:
        continue
      mine = {r.target: r for r in readings if r.series == label}
      lines.append(f"| {label} | " + " | ".join(
          _tax_text(mine[t].tax, mine[t].interval) if t in mine else "—" for t in self.targets)
          + " |")
      trend = tax_trend([(r.baseline_samples, r.tax) for r in mine.values()], self.goal)
      if trend:
        trend += slope_interval_text(slope_interval(list(mine.values())))
        trends.append(f"* {label}: {trend}")
    if trends:
      lines += ["", *trends]
    return "\n".join(lines)
