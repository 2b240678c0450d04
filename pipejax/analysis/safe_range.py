"""Where each pipelined method holds: the ``x = D_max (1 − β)`` at which the studies found it
non-inferior to the best baseline, and where they found it behind.

Each cell of the phase diagram (:class:`pipejax.analysis.phase.Row`) gets one verdict at its
study's margin (``Study.margin``, in the unit of its gaps):

* **non-inferior**: over at least two seeds, the one-sided t-test rejects a gap of the margin or
  more at 5% (:func:`pipejax.study.statistics.margin_tests`, the verdict the studies' own reports
  give);
* **behind**: the 95% interval of the gap lies wholly above the margin;
* **not shown**: at least two seeds, and neither of the above;
* **one seed**: a pilot, from which no claim is made;
* **diverged**: a run of the cell diverged.

A method's cells at one ``x`` (several rates, betas or studies) count by their best verdict, so a
rate that was too high does not hide one that held. The method **holds up to** the largest ``x``
before the first ``x`` whose best verdict from two or more seeds (or a divergence) is not
non-inferior; one-seed cells neither extend nor end it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from pipejax import methods as methods_lib
from pipejax.study import statistics

NON_INFERIOR = "non-inferior"
NOT_SHOWN = "not shown"
BEHIND = "behind"
DIVERGED = "diverged"
ONE_SEED = "one seed"
NO_GAP = "no gap"
# Best first: the order in which a method's cells at one x stand for it there.
RANK = (NON_INFERIOR, NOT_SHOWN, BEHIND, DIVERGED, ONE_SEED, NO_GAP)
DECIDED = (NON_INFERIOR, NOT_SHOWN, BEHIND, DIVERGED)

# What the phase report says above the table.
INTRODUCTION = """\
Each cell below gets one verdict at its studies' margin (`pipejax.analysis.safe_range`):
**non-inferior** where, over at least two seeds, the one-sided t-test at 5% rejects a gap of the
margin or more (the verdict of the studies' own reports); **behind** where the gap's 95% interval
lies wholly above the margin; **not shown** otherwise; a one-seed pilot makes no claim. A
method's cells at one x (several rates or betas) count by their best verdict. It **holds up to**
the largest x before the first x, from two or more seeds, where it is not non-inferior; one-seed
cells neither extend nor end that range. The last column is the product's threshold (the
method's `safe_delay_memory`): a run beyond it is warned at its start."""


def verdict(gaps: Sequence[float], diverged: int, margin: float) -> str:
  """The cell's verdict (module docstring) from its gaps (positive when worse) at ``margin``."""
  if diverged:
    return DIVERGED
  if not gaps:
    return NO_GAP
  if len(gaps) < 2:
    return ONE_SEED
  # margin_tests asks whether a difference is above -margin: a gap's sign is the other way.
  if statistics.margin_tests([-g for g in gaps], margin).non_inferior:
    return NON_INFERIOR
  if statistics.interval(gaps).low > margin:
    return BEHIND
  return NOT_SHOWN


@dataclasses.dataclass(frozen=True)
class Cell:
  """One phase-diagram cell as this module needs it."""

  x: float
  study: str
  num_stages: int
  verdict: str


@dataclasses.dataclass(frozen=True)
class MethodRange:
  """One method's cells in one unit, and the range where it holds."""

  method: str
  cells: tuple[Cell, ...]

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
    """The smallest ``x`` whose best decided verdict is behind or diverged."""
    return next((x for x, best in self.best_by_x().items() if best in (BEHIND, DIVERGED)), None)


def ranges(rows: Sequence, margin: float) -> list[MethodRange]:
  """Per method, its cells among ``rows`` (phase rows of one unit) with their verdicts."""
  cells = collections.defaultdict(list)
  for row in rows:
    cells[row.method].append(Cell(float(f"{row.delay_memory:.3g}"), row.study, row.num_stages,
                                  verdict(row.gaps, row.diverged, margin)))
  return [MethodRange(method, tuple(found)) for method, found in sorted(cells.items())]


def _places(cells: Sequence[Cell], wanted: str) -> str:
  """'0.0049 (depth, S 4); 6.2 (lm depth, S 32) ×3': the cells with one verdict, by x."""
  counts = collections.Counter((c.x, c.study, c.num_stages) for c in cells
                               if c.verdict == wanted)
  return "; ".join(f"{x:g} ({study}, S {stages})" + (f" ×{n}" if n > 1 else "")
                   for (x, study, stages), n in sorted(counts.items())) or "—"


def table(rows: Sequence, margin: float, unit_name: str) -> str:
  """The markdown table of every method's verdicts by ``x`` and the range where it holds, beside
  the threshold beyond which the product warns (its record's ``safe_delay_memory``)."""
  lines = [f"| method | non-inferior at x (margin {margin:g} {unit_name}) | not shown (≥ 2 seeds) "
           "| behind, or diverged | one seed: no claim | holds up to x | behind from x | the "
           "product warns beyond x |", "|" + "---|" * 8]
  for found in ranges(rows, margin):
    record = methods_lib.RECORDS.get(found.method)
    warns = record.safe_delay_memory if record is not None else None
    behind = "; ".join(text for text in (_places(found.cells, BEHIND),
                                         _places(found.cells, DIVERGED)) if text != "—")
    lines.append(
        f"| {methods_lib.DISPLAY_NAMES.get(found.method, found.method)} | "
        f"{_places(found.cells, NON_INFERIOR)} | {_places(found.cells, NOT_SHOWN)} | "
        f"{behind or '—'} | "
        f"{_places(found.cells, ONE_SEED)} | {_number(found.holds_up_to)} | "
        f"{_number(found.behind_from)} | {_number(warns)} |")
  return "\n".join(lines)


def _number(value: float | None) -> str:
  return "—" if value is None else f"{value:g}"
