"""A study's records gathered into cells: the numbers every table, sentence and figure is made of.

A *cell* is every run with the same overrides except ``seed``. :func:`gather_cells` collects each
cell's per-seed values (or, with a baseline, its per-seed gaps to the baseline run of the same seed
and cell coordinates), and counts the runs that diverged or never reached a ``samples_to`` level;
:func:`lookup`, :func:`ordered` and :func:`select` find the cells a table or figure shows.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from pipejax.study import statistics
from pipejax.study.spec import Overrides, Study, run_id
from pipejax.study.records import RunRecord, diverged, is_number, key_of, metric_of


@dataclasses.dataclass
class Cell:
  """The runs of one grid point (all seeds): each one's value, or why it has none."""

  values: list[float]
  diverged: int
  seeds: list[int]
  not_reached: int = 0  # finished runs without a value (a 'samples_to' level never reached)
  paired: bool = False  # values are per-seed differences to the baseline

  @property
  def stats(self) -> statistics.Interval:
    return statistics.paired(self.values) if self.paired else statistics.interval(self.values)

  @property
  def mean(self) -> float:
    return self.stats.mean

  @property
  def std(self) -> float:
    return self.stats.std

  @property
  def runs(self) -> int:
    return len(self.values) + self.diverged + self.not_reached


def without_seed(overrides: Overrides) -> tuple:
  """The identity of a run's cell: its overrides but the seed."""
  return key_of({k: v for k, v in overrides.items() if k != "seed"})


def gather_cells(records: Iterable[RunRecord], metric: str = "test_accuracy",
          baseline: Overrides | None = None) -> dict[tuple, Cell]:
  """Groups finished and diverged records by their overrides without the seed.

  With ``baseline``, each value is the run's metric minus that of its baseline run: the run with
  the same overrides except the baseline's keys (and their values). A seed whose baseline run is
  missing or diverged has no gap.
  """
  # One value per run, however often it is among the records (the last one counts): a run
  # counted twice would be two seeds of one.
  records = list({run_id(r.overrides): r for r in records if r.trained}.values())
  references = []
  if baseline is not None:
    references = [r for r in records if not diverged(r) and is_number(metric_of(r, metric))
                  and all(r.overrides.get(k) == v for k, v in baseline.items())]
  cells: dict[tuple, Cell] = {}
  for r in records:
    cell = cells.setdefault(r.cell, Cell([], 0, [], paired=baseline is not None))
    cell.seeds.append(r.seed)
    value = metric_of(r, metric)
    if diverged(r):
      cell.diverged += 1
    elif not is_number(value):
      cell.not_reached += 1
    elif baseline is None:
      cell.values.append(value)
    else:
      reference = baseline_run([ref for ref in references if ref is not r], r.overrides,
                               baseline) or (r if any(r is ref for ref in references) else None)
      if reference is not None:
        cell.values.append(value - metric_of(reference, metric))
  return cells


def baseline_run(references: Sequence[RunRecord], overrides: Overrides,
                 baseline: Overrides) -> RunRecord | None:
  """The baseline run a run is paired with, among ``references`` (which exclude the run itself):
  the run with the same overrides but the baseline's (same seed, same cell), else the most
  specific baseline run whose every override the run shares. So a control arm that adds an
  override to the baseline's, such as ``method_kwargs.sgd.stage_rates``, pairs with the plain
  baseline run of its seed."""
  wanted = key_of({**overrides, **baseline})
  best = None
  for ref in references:
    if key_of(ref.overrides) == wanted:
      return ref
    shared = all(overrides.get(k) == v for k, v in ref.overrides.items() if k not in baseline)
    if shared and ref.seed == overrides.get("seed", 0) and (
        best is None or len(ref.overrides) > len(best.overrides)):
      best = ref
  return best


def lookup(cells: dict[tuple, Cell], point: Overrides) -> Cell | None:
  """The cell whose overrides include every item of ``point``, if exactly one does."""
  wanted = set(key_of(point))
  found = [c for key, c in cells.items() if wanted <= set(key)]
  return found[0] if len(found) == 1 else None


def axis_values(records: Sequence[RunRecord], key: str) -> list:
  """The values ``key`` takes in the records' overrides, sorted where they can be."""
  values = []
  for r in records:
    if key in r.overrides and r.overrides[key] not in values:
      values.append(r.overrides[key])
  try:
    return sorted(values)
  except TypeError:
    return values


def ordered(study: Study, key: str, present: list) -> list:
  """The values of a key that have records: ascending where they are numbers (several grids may
  each give a range), else in the study file's order."""
  if present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
    return sorted(present)
  order = [v for grid in study.grids for v in grid.get(key, ())]
  known = list(dict.fromkeys(v for v in order if v in present))
  return known + [v for v in present if v not in known]


def select(records: Sequence[RunRecord], where: Iterable[tuple]) -> list[RunRecord]:
  """The records whose overrides have every ``(key, value)`` of ``where`` (None: unset or None;
  a tuple: any of its values; a record's own values are JSON, never tuples). A tuple of keys
  takes a tuple of their values' combinations, any of which matches: ``(('method',
  'reference.lr'), (('muon', 4e-3), ('pb', 1e-3)))`` is Muon at 4e-3 and PB at 1e-3."""
  def value_of(overrides, key):
    return tuple(overrides.get(k) for k in key) if isinstance(key, tuple) else overrides.get(key)

  def matches(value, wanted):
    return value in wanted if isinstance(wanted, tuple) else value == wanted
  return [r for r in records if all(matches(value_of(r.overrides, k), v) for k, v in where)]
