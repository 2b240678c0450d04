"""A study's figures from its records: cell means or gaps with 95% CIs, curves, staleness.

Diverged runs are drawn as 'k/n' marks in a band of their own, never on the metric axis, so a
mean is never pulled by a run that did not train. The metric is drawn times ``Figure.scale``, as
the tables show it, and a gap is the method's value minus the baseline's, as in the gap tables;
the y axis names the metric, its unit and, for a gap of a metric that is better smaller (a loss),
that lower is better.
"""

from __future__ import annotations

import collections
import math
from typing import Sequence

from pipejax import plotting
from pipejax.study import statistics
from pipejax.study.spec import Figure, Study
from pipejax.study.cells import axis_values, gather_cells, lookup, ordered, select
from pipejax.study.records import RunRecord, is_number


def metric_words(metric: str) -> str:
  """A metric in readable words: 'test_loss' is 'test loss', 'val_loss' 'validation loss',
  'samples_to:0.85' 'training samples to 85% test accuracy'."""
  if metric.startswith("samples_to:"):
    return f"training samples to {float(metric.split(':', 1)[1]):.0%} test accuracy"
  words = {"val": "validation", "acc": "accuracy"}
  return " ".join(words.get(word, word) for word in metric.split("_"))


def y_unit(figure: Figure) -> str:
  """The y axis's unit: ``figure.unit``, else percent (points for a gap) for an accuracy at scale
  100, else none."""
  if figure.unit:
    return figure.unit
  if figure.metric.endswith("accuracy") and figure.scale == 100:
    return "points" if figure.kind == "gap" else "%"
  return ""


def y_label(study: Study, figure: Figure) -> str:
  """E.g. 'test accuracy (%)', 'test accuracy gap to SGD (points)', 'test loss gap to SGD (bits per
  byte; lower is better)': a gap above zero reads as better unless the axis says otherwise."""
  what = metric_words(figure.metric)
  if figure.kind == "gap":
    what += f" gap to {study.baseline_label()}"
  notes = [y_unit(figure)]
  if figure.kind == "gap" and not figure.higher_is_better:
    notes.append("lower is better")
  notes = [note for note in notes if note]
  return f"{what} ({'; '.join(notes)})" if notes else what


def _with_unit(value: float, unit: str) -> str:
  """'50%', '1.2 bits per byte', '3'."""
  if unit == "%":
    return f"{value:g}%"
  return f"{value:g} {unit}" if unit else f"{value:g}"


def cell_points(study: Study, selected: Sequence[RunRecord], figure: Figure
                ) -> list[tuple[object, list[tuple], list[tuple]]]:
  """What a 'mean' or 'gap' figure draws, per series: ``(series value, points, diverged)``.

  ``points`` holds ``(x, mean, CI half-width)`` per cell with a finished run, times
  ``figure.scale`` (for a gap, method minus the study's baseline, paired by seed); ``diverged``
  holds ``(x, 'k/n')`` per cell where k of its n runs diverged. The baseline series of a gap
  figure is left out: its gap to itself is zero.
  """
  cells = gather_cells(selected, figure.metric, study.baseline if figure.kind == "gap" else None)
  xs = ordered(study, figure.x, axis_values(selected, figure.x))
  result = []
  for s in ordered(study, figure.series, axis_values(selected, figure.series)):
    if figure.kind == "gap" and study.baseline.get(figure.series) == s:
      continue  # the baseline's gap to itself is zero by construction
    points, failed = [], []
    for x in xs:
      cell = lookup(cells, {figure.x: x, figure.series: s})
      if cell is None:
        continue
      if cell.values:
        st = cell.stats
        points.append((x / figure.x_unit, st.mean * figure.scale,
                       0.0 if math.isnan(st.half_width) else st.half_width * figure.scale))
      if cell.diverged:
        failed.append((x / figure.x_unit, f"{cell.diverged}/{cell.runs}"))
    result.append((s, points, failed))
  return result


def _draw_cells(study: Study, figure: Figure, series, ax, band) -> None:
  """Means with 95% CIs, each series nudged sideways so that their bars stay apart; diverged
  runs as 'k/n' marks in ``band``, never on the metric axis."""
  count = len(series)
  for i, (s, points, failed) in enumerate(series):
    shift = (i - (count - 1) / 2) * 0.012
    nudge = (lambda x: x * 2 ** shift) if figure.log_x else (lambda x: x)
    colour = f"C{i % 10}"
    if points:
      px, py, pe = zip(*points)
      ax.errorbar([nudge(x) for x in px], py, yerr=pe, marker="o", ms=4, capsize=3, lw=1.2,
                  color=colour, label=study.label(s))
    if band is not None:
      for x, text in failed:
        band.plot([x], [i], marker="x", color=colour, ms=7)
        band.annotate(text, (x, i), textcoords="offset points", xytext=(5, -3), fontsize=7)
  if band is not None:
    band.set_yticks(range(count), [study.label(s) for s, _, _ in series], fontsize=7)
    band.set_ylim(-0.7, count - 0.3)
    band.set_title("diverged runs (of the cell's runs)", fontsize=8, loc="left")


def _draw_curves(study: Study, selected: Sequence[RunRecord], figure: Figure, ax, zoom) -> bool:
  """Mean ``figure.metric`` over training samples per series, with its 95% CI as a band: the whole
  run on ``ax``, and on ``zoom`` the last three quarters of it on an axis fitted to them, where
  the methods' final differences (tenths of a point of accuracy, hundredths of a bit of loss) are
  visible once the first quarter's large values are off the axis."""
  column = 2 if figure.metric == "test_loss" else 1  # test_curve rows: samples, accuracy, loss
  scale = figure.scale
  drawn, tail = False, []
  for i, s in enumerate(ordered(study, figure.series, axis_values(selected, figure.series))):
    runs = [r for r in selected if r.overrides.get(figure.series) == s
            and r.test_curve and r.finished]
    by_samples = collections.defaultdict(list)
    for r in runs:
      for row in r.test_curve:
        if len(row) > column and is_number(row[column]):
          by_samples[row[0]].append(row[column])
    if not by_samples:
      continue
    xs = sorted(by_samples)
    st = [statistics.interval(by_samples[x]) for x in xs]
    means = [v.mean * scale for v in st]
    has_band = all(v.n > 1 for v in st)
    lows = [v.low * scale for v in st] if has_band else means
    highs = [v.high * scale for v in st] if has_band else means
    for axis in (ax, zoom):
      axis.plot(xs, means, color=f"C{i % 10}", label=f"{study.label(s)} (n={len(runs)})")
      if has_band:
        axis.fill_between(xs, lows, highs, color=f"C{i % 10}", alpha=0.2)
    tail += zip(xs, lows, highs)
    drawn = True
  if drawn:
    end = max(x for x, _, _ in tail)
    low = min(lo for x, lo, _ in tail if x >= end / 4)
    high = max(hi for x, _, hi in tail if x >= end / 4)
    pad = max(0.001 * abs(scale), (high - low) * 0.05)  # at least a tenth of a point of accuracy
    zoom.set_xlim(end / 4, end * 1.01)
    zoom.set_ylim(low - pad, high + pad)
    zoom.set_title("the last three quarters, zoomed", fontsize=9)
    zoom.grid(alpha=0.3)
    zoom.set_xlabel("training samples")
  ax.set_xlabel("training samples")
  return drawn


def draw_figure(study: Study, records: Sequence[RunRecord], figure: Figure, path: str) -> bool:
  """Draws ``figure`` to ``path``; False when no record has what it needs."""
  plt = plotting.pyplot()
  selected = select(records, figure.where)
  band = None
  if figure.kind in ("mean", "gap"):
    series = cell_points(study, selected, figure)
    drawn = any(points or failed for _, points, failed in series)
    if any(failed for _, _, failed in series):
      fig, (ax, band) = plt.subplots(2, 1, figsize=(7, 5.2), sharex=True,
                                     gridspec_kw={"height_ratios": [4, 1.4]})
    else:
      fig, ax = plt.subplots(figsize=(7, 4.2))
    _draw_cells(study, figure, series, ax, band)
    (band or ax).set_xlabel(figure.x_label or study.label(figure.x))
    ax.set_ylabel(y_label(study, figure))
    if figure.kind == "gap":
      ax.axhline(0, color="k", lw=0.8)
    if figure.log_x:
      ax.set_xscale("log", base=2)
  else:
    if figure.kind == "curves":
      fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4.2))
      drawn = _draw_curves(study, selected, figure, ax, zoom)
      ax.set_ylabel(y_label(study, figure))
    else:
      fig, ax = plt.subplots(figsize=(7, 4.2))
      drawn = _draw_staleness(study, selected, figure, ax)
  if figure.threshold is not None:
    ax.axhline(figure.threshold * figure.scale, color="tab:red", ls="--", lw=1,
               label=f"threshold {_with_unit(figure.threshold * figure.scale, y_unit(figure))}")
  if not drawn:
    plt.close(fig)
    return False
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, ncol=2, title="mean, 95% CI over seeds" if figure.kind != "staleness"
            else None, title_fontsize=8)
  ax.set_title(figure.title or study.name)
  plotting.save(fig, path)
  return True


def _draw_staleness(study: Study, selected: Sequence[RunRecord], figure: Figure, ax) -> bool:
  """Each series' per-stage weight discrepancy (its first seed's diagnostics)."""
  drawn = False
  for s in ordered(study, figure.series, axis_values(selected, figure.series)):
    runs = [r for r in selected if r.overrides.get(figure.series) == s and r.weight_discrepancy]
    if runs:
      run = min(runs, key=lambda r: r.seed)
      ax.plot(range(len(run.weight_discrepancy)), run.weight_discrepancy, marker="o",
              ms=3, label=study.label(s))
      drawn = True
  ax.set_xlabel("stage")
  ax.set_ylabel("‖w_fwd − w_bwd‖ / ‖w_bwd‖ (second half of training)")
  ax.set_yscale("symlog", linthresh=1e-5)
  return drawn
