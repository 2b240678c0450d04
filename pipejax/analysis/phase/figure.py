"""The phase diagram's figure: a panel per unit, the gaps and the quadratic's prediction against x.

"""

from __future__ import annotations

import math
from typing import Sequence

from pipejax import methods as methods_lib
from pipejax.analysis.phase.gaps import Row


_SPREAD = 0.015  # series at one x are drawn this fraction apart on the log axis, method by method


_BAND = 0.95  # where diverged runs (left axis) and unstable predictions (right) are drawn


def _panel(ax, rows: Sequence[Row]) -> None:
  """One unit's gaps (left axis, filled, 95% CIs) and predictions (right axis, hollow)."""
  from matplotlib import ticker, transforms  # pylint: disable=import-outside-toplevel
  order = sorted({row.method for row in rows})
  top_left = transforms.blended_transform_factory(ax.transData, ax.transAxes)
  predicted = [row for row in rows if row.prediction is not None
               and not math.isnan(row.prediction)]
  drawn = {id(row) for row in predicted}
  twin = ax.twinx() if predicted else None
  for row in rows:
    color = methods_lib.preset_of(row.method).color
    x = row.delay_memory * (1 + _SPREAD * (order.index(row.method) - (len(order) - 1) / 2))
    if row.gaps:
      s = row.interval
      error = [[s.mean - s.low], [s.high - s.mean]] if s.n > 1 else None
      ax.errorbar([x], [s.mean], yerr=error, fmt="o", color=color, ms=5, capsize=2, lw=1)
    if row.diverged:
      ax.plot([x], [_BAND], "x", color=color, ms=7, mew=2, transform=top_left, clip_on=False)
    if id(row) in drawn and math.isinf(row.prediction):
      ax.plot([x], [_BAND - 0.06], "^", mfc="none", color=color, ms=7, transform=top_left,
              clip_on=False)
    elif id(row) in drawn:
      twin.plot([x], [row.prediction], "s", mfc="none", color=color, ms=7)
  unit = rows[0].unit.name
  ax.axhline(0.0, color="black", lw=0.8, ls="--")
  ax.set_xscale("log")
  plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
  ax.xaxis.set_major_formatter(plain)
  left, right = ax.get_xlim()
  # Within one decade the minor ticks are the only ones to read; over several they would crowd.
  ax.xaxis.set_minor_formatter(plain if right < 10 * left else ticker.NullFormatter())
  low, high = ax.get_ylim()
  ax.set_ylim(low, high + 0.25 * (high - low))  # room for the band of diverged runs
  ax.set_xlabel("x = D_max (1 − β): the longest delay over the momentum's memory")
  ax.set_ylabel(f"gap to the best baseline ({unit}; above 0 is worse)")
  if twin is not None:
    # The quadratic's excess loss is never below 0, so its ratio to the reference's is ≥ −1.
    finite = [row.prediction for row in predicted if math.isfinite(row.prediction)]
    twin.set_yscale("symlog", linthresh=0.01)
    twin.set_ylim(-1.05, max([1.0] + [1.5 * v for v in finite]))
    twin.set_ylabel("quadratic: excess loss over the reference's, ÷ its own (hollow; no unit)")
  else:
    ax.text(0.02, 0.02, "no curvature reading in these studies: no prediction",
            transform=ax.transAxes, fontsize=8, color="gray")
  studies = ", ".join(dict.fromkeys(row.study for row in rows))
  ax.set_title(f"{unit} ({studies})", fontsize=10)
  ax.grid(True, which="major", alpha=0.3)


def draw(rows: Sequence[Row], path: str) -> str:
  """Writes the phase diagram to ``path``: a panel per unit, a colour per method (its preset's),
  the measured gap with its 95% CI against ``x`` on a log axis, the diverged runs as crosses at
  the top, the quadratic's prediction as hollow squares on its own right axis (unstable: a
  hollow triangle under the crosses). Returns ``path``."""
  from matplotlib import lines as lines_lib  # pylint: disable=import-outside-toplevel
  from pipejax import plotting  # pylint: disable=import-outside-toplevel
  plt = plotting.pyplot()
  units = list(dict.fromkeys(row.unit.name for row in rows))
  order = sorted({row.method for row in rows})
  fig, axes = plt.subplots(1, len(units), figsize=(7.5 * len(units), 5.2), squeeze=False)
  for ax, unit in zip(axes.flat, units):
    _panel(ax, [row for row in rows if row.unit.name == unit])
  handles = [lines_lib.Line2D([], [], color=methods_lib.preset_of(m).color, marker="o", ls="none",
                              label=methods_lib.DISPLAY_NAMES.get(m, m)) for m in order]
  handles += [lines_lib.Line2D([], [], color="gray", marker="x", ls="none", mew=2,
                               label="runs diverged (count in the table)"),
              lines_lib.Line2D([], [], color="gray", marker="s", mfc="none", ls="none",
                               label="quadratic's prediction (right axis)"),
              lines_lib.Line2D([], [], color="gray", marker="^", mfc="none", ls="none",
                               label="quadratic: unstable")]
  fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8,
             frameon=False)
  rows_of_legend = math.ceil(len(handles) / 6)
  plotting.save(fig, path, dpi=110, rect=(0.0, 0.05 * rows_of_legend, 1.0, 1.0))
  return path
