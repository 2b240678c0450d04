"""A study's figures from its records: cell means or gaps with 95% CIs, curves, staleness.

Diverged runs are drawn as 'k/n' marks in a band of their own, never on the metric axis, so a
mean is never pulled by a run that did not train.
"""

from __future__ import annotations

import collections
import math
from typing import Sequence

from pipejax import plotting
from pipejax.study import statistics
from pipejax.study.spec import Figure, Study
from pipejax.study.cells import axis_values, gather_cells, is_diverged, lookup, ordered, select
from pipejax.study.records import is_number


def cell_points(study: Study, selected: Sequence[dict], figure: Figure
                ) -> list[tuple[object, list[tuple], list[tuple]]]:
  """What a 'mean' or 'gap' figure draws, per series: ``(series value, points, diverged)``.

  ``points`` holds ``(x, mean, CI half-width)`` per cell with a finished run, in percent (for a
  gap, to the study's baseline); ``diverged`` holds ``(x, 'k/n')`` per cell where k of its n runs
  diverged. The baseline series of a gap figure is left out: its gap to itself is zero.
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
        points.append((x / figure.x_unit, st.mean * 100,
                       0.0 if math.isnan(st.half_width) else st.half_width * 100))
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


def _draw_curves(study: Study, selected: Sequence[dict], figure: Figure, ax, zoom) -> bool:
  """Mean test accuracy over training samples per series, with its 95% CI as a band: the whole
  run on ``ax``, and on ``zoom`` the last three quarters of it on an axis fitted to them, where
  the methods' final differences (tenths of a point) are visible."""
  drawn, tail = False, []
  for i, s in enumerate(ordered(study, figure.series, axis_values(selected, figure.series))):
    runs = [r for r in selected if r["overrides"].get(figure.series) == s
            and r.get("test_curve") and not is_diverged(r)]
    by_samples = collections.defaultdict(list)
    for r in runs:
      for samples, accuracy, _ in r["test_curve"]:
        if is_number(accuracy):
          by_samples[samples].append(accuracy)
    if not by_samples:
      continue
    xs = sorted(by_samples)
    st = [statistics.interval(by_samples[x]) for x in xs]
    means = [v.mean * 100 for v in st]
    has_band = all(v.n > 1 for v in st)
    lows = [v.low * 100 for v in st] if has_band else means
    highs = [v.high * 100 for v in st] if has_band else means
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
    pad = max(0.1, (high - low) * 0.05)
    zoom.set_xlim(end / 4, end * 1.01)
    zoom.set_ylim(low - pad, high + pad)
    zoom.set_title("the last three quarters, zoomed", fontsize=9)
    zoom.grid(alpha=0.3)
    zoom.set_xlabel("training samples")
  ax.set_xlabel("training samples")
  return drawn


def draw_figure(study: Study, records: Sequence[dict], figure: Figure, path: str) -> bool:
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
    what = "test accuracy" if figure.metric == "test_accuracy" else figure.metric
    ax.set_ylabel(f"{what} gap to {study.baseline_label()} (points)" if figure.kind == "gap"
                  else f"{what} (%)")
    if figure.kind == "gap":
      ax.axhline(0, color="k", lw=0.8)
    if figure.log_x:
      ax.set_xscale("log", base=2)
  else:
    if figure.kind == "curves":
      fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4.2))
      drawn = _draw_curves(study, selected, figure, ax, zoom)
      ax.set_ylabel("test accuracy (%)")
    else:
      fig, ax = plt.subplots(figsize=(7, 4.2))
      drawn = _draw_staleness(study, selected, figure, ax)
  if figure.threshold is not None:
    ax.axhline(figure.threshold * 100, color="tab:red", ls="--", lw=1,
               label=f"threshold {figure.threshold * 100:g}%")
  if not drawn:
    plt.close(fig)
    return False
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, ncol=2, title="mean, 95% CI over seeds" if figure.kind != "staleness"
            else None, title_fontsize=8)
  ax.set_title(figure.title or study.name)
  fig.tight_layout()
  plotting.save(fig, path)
  return True


def _draw_staleness(study: Study, selected: Sequence[dict], figure: Figure, ax) -> bool:
  """Each series' per-stage weight discrepancy (its first seed's diagnostics)."""
  drawn = False
  for s in ordered(study, figure.series, axis_values(selected, figure.series)):
    runs = [r for r in selected if r["overrides"].get(figure.series) == s
            and r.get("weight_discrepancy")]
    if runs:
      run = min(runs, key=lambda r: r["overrides"].get("seed", 0))
      ax.plot(range(len(run["weight_discrepancy"])), run["weight_discrepancy"], marker="o",
              ms=3, label=study.label(s))
      drawn = True
  ax.set_xlabel("stage")
  ax.set_ylabel("‖w_fwd − w_bwd‖ / ‖w_bwd‖ (second half of training)")
  ax.set_yscale("symlog", linthresh=1e-5)
  return drawn
