"""Where each pipelined method holds: the ``x = D_max (1 − β)`` at which the studies found it
non-inferior to the best baseline, and where they found it behind.

Each cell of the phase diagram (:class:`pipejax.analysis.phase.Row`) gets one verdict at its
study's margin (``Study.margin``, in the unit of its gaps), from its **paired** gaps only (those
taken against the baseline's run of the same seed), since an unpaired gap carries the noise of
the baseline's mean, which no interval over the cell's seeds sees:

* **non-inferior**: over at least two paired seeds, the one-sided t-test rejects a gap of the
  margin or more at 5% (:func:`pipejax.study.statistics.margin_tests`, the test the studies'
  own reports make of their gap tables, here against the phase diagram's baseline: the best
  cell without a pipeline of the same network, which need not be a study's own baseline, so a
  verdict here can differ from that study's);
* **behind**: the two-sided 95% interval of the paired gaps lies wholly above the margin (at
  2.5% one-sided, stricter than non-inferiority's 5%, so that a cell is not called behind on
  weaker evidence than it would be called level on);
* **not shown**: at least two paired seeds, and neither of the above;
* **diverged**: at least two runs, and one of them diverged;
* **no claim**: fewer than two paired seeds (a pilot, or a cell whose baseline has one seed), or
  a single run that diverged, or a study without a margin.

A method's cells at one ``x`` (several rates, betas or studies) count by their best verdict, so a
rate that was too high does not hide one that held. The method **holds up to** the largest ``x``
before the first ``x`` whose best verdict is decided (non-inferior, not shown, behind or
diverged) and is not non-inferior; cells of no claim neither extend nor end it.

:func:`measured_ranges` gives, per method, what the warning at a run's start reads
(:mod:`pipejax.methods.safe_ranges`): the momenta measured, and per unit the range where it holds
and each ``x`` where it was behind or diverged with that cell's gap; :func:`write_ranges` writes
it to ``pipejax/methods/safe_ranges.json``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Sequence

from pipejax import files
from pipejax import methods as methods_lib
from pipejax.methods import safe_ranges
from pipejax.study import statistics

NON_INFERIOR = "non-inferior"
NOT_SHOWN = "not shown"
BEHIND = "behind"
DIVERGED = "diverged"
NO_CLAIM = "no claim"
# Best first: the order in which a method's cells at one x stand for it there.
RANK = (NON_INFERIOR, NOT_SHOWN, BEHIND, DIVERGED, NO_CLAIM)
DECIDED = (NON_INFERIOR, NOT_SHOWN, BEHIND, DIVERGED)

# What the phase report says above the table.
INTRODUCTION = """\
Each cell below gets one verdict at its study's margin (`pipejax.analysis.safe_range`), from its
gaps paired by seed with the baseline's runs only: **non-inferior** where, over at least two
paired seeds, the one-sided t-test at 5% rejects a gap of the margin or more (the test of the
studies' own gap tables, here against this diagram's baseline, which need not be the study's
own: a verdict here can differ from the study's report); **behind** where the paired gaps'
two-sided 95% interval lies wholly above the margin; **not shown** otherwise; **diverged** where
a run of a cell of two or more diverged. Fewer than two paired seeds (a pilot, or a baseline of
one seed), a single run that diverged, or a study without a margin make no claim. A method's cells
at one x (several rates or betas) count by their best verdict. It **holds up to** the largest x
before the first x with a decided verdict other than non-inferior; cells of no claim neither
extend nor end that range. A run's start-up warning reads these verdicts
(`pipejax/methods/safe_ranges.json`, written by `scripts/phase_diagram.py --safe_ranges`): beyond
where its method holds, it names the nearest x at or below the run's where the method was behind,
with its gap, or says that the run's delay is unmeasured."""


def verdict(paired_gaps: Sequence[float], runs: int, diverged: int,
            margin: float | None) -> str:
  """The cell's verdict (module docstring) from its ``runs``, how many ``diverged`` and its
  gaps paired by seed (positive when worse), at ``margin`` (None: the study declares none)."""
  if margin is None:
    return NO_CLAIM
  if diverged:
    return DIVERGED if runs >= 2 else NO_CLAIM
  if len(paired_gaps) < 2:
    return NO_CLAIM
  # margin_tests asks whether a difference is above -margin: a gap's sign is the other way.
  if statistics.margin_tests([-g for g in paired_gaps], margin).non_inferior:
    return NON_INFERIOR
  if statistics.interval(paired_gaps).low > margin:
    return BEHIND
  return NOT_SHOWN


@dataclasses.dataclass(frozen=True)
class CellVerdict:
  """One phase-diagram cell's place and verdict."""

  x: float
  study: str
  num_stages: int
  verdict: str
  diverged: bool = False  # a run of the cell diverged (shown beside a verdict of no claim)


@dataclasses.dataclass(frozen=True)
class MethodRange:
  """One method's cells in one unit, and the range where it holds."""

  method: str
  cells: tuple[CellVerdict, ...]

  def best_by_x(self) -> dict[float, str]:
    """Each measured ``x``, ascending, with its cells' best verdict."""
    best = {}
    for cell in sorted(self.cells, key=lambda c: c.x):
      held = best.get(cell.x)
      if held is None or RANK.index(cell.verdict) < RANK.index(held):
        best[cell.x] = cell.verdict
    return best

  @property
  def holds_up_to(self) -> float | None:
    """The largest ``x`` before the first decided ``x`` that is not non-inferior; None when the
    smallest decided ``x`` is not, or no ``x`` is decided."""
    holds = None
    for x, best in self.best_by_x().items():
      if best not in DECIDED:
        continue
      if best != NON_INFERIOR:
        break
      holds = x
    return holds

  @property
  def behind_from(self) -> float | None:
    """The smallest ``x`` whose best verdict is behind or diverged."""
    return next((x for x, best in self.best_by_x().items() if best in (BEHIND, DIVERGED)), None)


def ranges(rows: Sequence) -> list[MethodRange]:
  """Per method, its cells among ``rows`` (phase rows of one unit) with their verdicts, each at
  its own study's margin."""
  cells = collections.defaultdict(list)
  for row in rows:
    cells[row.method].append(CellVerdict(
        float(f"{row.delay_memory:.3g}"), row.study, row.num_stages,
        verdict(row.paired_gaps, row.runs, row.diverged, row.unit.margin), bool(row.diverged)))
  return [MethodRange(method, tuple(found)) for method, found in sorted(cells.items())]


def _cells_with(cells: Sequence[CellVerdict], wanted: str) -> str:
  """'0.0049 (depth, S 4); 6.2 (lm depth, S 32) ×3': the cells of one verdict, by x; a cell whose
  run diverged is marked so, since the table shows diverged cells beside those behind."""
  counts = collections.Counter((c.x, c.study, c.num_stages,
                                 c.diverged and wanted in (NO_CLAIM, DIVERGED))
                               for c in cells if c.verdict == wanted)
  return "; ".join(f"{x:g} ({study}, S {stages}{', diverged' if diverged else ''})"
                   + (f" ×{n}" if n > 1 else "")
                   for (x, study, stages, diverged), n in sorted(counts.items())) or "—"


def table(rows: Sequence) -> str:
  """The markdown table of every method's verdicts by ``x`` and the range where it holds."""
  margins = sorted({row.unit.margin for row in rows if row.unit.margin is not None})
  unit = rows[0].unit.name if rows else ""
  margin = " or ".join(f"{m:g}" for m in margins) or "none"
  lines = [f"| method | non-inferior at x (margin {margin} {unit}) | not shown | behind, or "
           "diverged | no claim | holds up to x | behind from x |", "|" + "---|" * 7]
  for method_range in ranges(rows):
    cells = method_range.cells
    behind = "; ".join(text for text in (_cells_with(cells, BEHIND), _cells_with(cells, DIVERGED))
                       if text != "—")
    lines.append(
        f"| {methods_lib.DISPLAY_NAMES.get(method_range.method, method_range.method)} | "
        f"{_cells_with(cells, NON_INFERIOR)} | {_cells_with(cells, NOT_SHOWN)} | "
        f"{behind or '—'} | {_cells_with(cells, NO_CLAIM)} | "
        f"{_number(method_range.holds_up_to)} | {_number(method_range.behind_from)} |")
  return "\n".join(lines)


def _number(value: float | None) -> str:
  return "—" if value is None else f"{value:g}"


def _figures(value: float | None, digits: int = 4) -> float | None:
  return None if value is None else float(f"{value:.{digits}g}")


def _behind_cell(rows: Sequence, x: float, wanted: str) -> dict:
  """The cell of ``rows`` (one method, one unit) at ``x`` with verdict ``wanted`` that is least
  behind: the gap a run at that ``x`` should expect at the least."""
  found = [row for row in rows if float(f"{row.delay_memory:.3g}") == x and verdict(
      row.paired_gaps, row.runs, row.diverged, row.unit.margin) == wanted]
  row = min(found, key=lambda r: r.interval.mean if r.gaps else float("inf"))
  cell = {"x": x, "verdict": wanted, "study": row.study, "stages": row.num_stages,
          "momentum": _figures(row.momentum, 6), "unit": row.unit.name,
          "runs": row.runs, "diverged": row.diverged}
  if row.gaps:
    s = row.interval
    cell.update(gap=_figures(s.mean, 3), low=_figures(s.low, 3) if s.n > 1 else None,
                high=_figures(s.high, 3) if s.n > 1 else None)
  return cell


def measured_ranges(rows: Sequence) -> dict:
  """Per method of ``rows`` (phase rows of any units), what a run's start-up warning reads: the
  momenta its cells were measured at, and per unit the ``x`` up to which it holds and each ``x``
  whose best verdict is behind or diverged, with that cell's gap (:func:`_behind_cell`)."""
  found: dict[str, dict] = {}
  for unit in dict.fromkeys(row.unit for row in rows):
    unit_rows = [row for row in rows if row.unit == unit]
    for method_range in ranges(unit_rows):
      mine = [row for row in unit_rows if row.method == method_range.method]
      entry = found.setdefault(method_range.method, {"momenta": [], "units": {}})
      entry["momenta"] += [row.momentum for row in mine]
      entry["units"][unit.name] = {
          "holds_up_to": method_range.holds_up_to,
          "behind": [_behind_cell(mine, x, best) for x, best in method_range.best_by_x().items()
                     if best in (BEHIND, DIVERGED)]}
  for entry in found.values():
    entry["momenta"] = [min(entry["momenta"]), max(entry["momenta"])]
  return dict(sorted(found.items()))


def write_ranges(rows: Sequence, path: str = safe_ranges.PATH, command: str = "") -> str:
  """Writes :func:`measured_ranges` of ``rows`` to ``path`` (the file the warning reads);
  returns ``path``."""
  text = json.dumps({"generated_by": command or "python scripts/phase_diagram.py --safe_ranges="
                     "pipejax/methods/safe_ranges.json", "methods": measured_ranges(rows)},
                    indent=1, sort_keys=True)
  files.write(path, text + "\n")
  return path
