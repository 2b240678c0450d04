"""Where each method holds (pipejax.analysis.safe_range): verdicts on hand-written gaps, checked
against scipy's t distribution, and the product's warning thresholds against the studies."""

import json
import os

import numpy as np
import pytest
from scipy import stats

from pipejax import methods as methods_lib
from pipejax.analysis import phase, safe_range
from tests.analysis import test_phase
from tests.helpers import ROOT

MARGIN = 0.5


def non_inferiority_p(gaps, margin):
  """H0: the mean gap is at least the margin (positive gaps are worse), by scipy."""
  gaps = np.asarray(gaps, float)
  t = (margin - gaps.mean()) / stats.sem(gaps)
  return stats.t.sf(t, len(gaps) - 1)


@pytest.mark.parametrize("gaps, expected", [
    ([0.10, 0.12, 0.11], safe_range.NON_INFERIOR),
    ([2.0, 2.1, 1.9], safe_range.BEHIND),
    ([0.3, 0.9, -0.2], safe_range.NOT_SHOWN),
    ([0.2], safe_range.NO_CLAIM),
    ([], safe_range.NO_CLAIM),
])
def test_a_cells_verdict_follows_the_one_sided_test_and_the_interval(gaps, expected):
  assert safe_range.verdict(gaps, len(gaps), 0, MARGIN) == expected
  if len(gaps) >= 2:
    low = stats.t.interval(0.95, len(gaps) - 1, loc=np.mean(gaps), scale=stats.sem(gaps))[0]
    assert (non_inferiority_p(gaps, MARGIN) < 0.05) == (expected == safe_range.NON_INFERIOR)
    assert (low > MARGIN) == (expected == safe_range.BEHIND)


def test_a_divergence_decides_a_cell_of_two_runs_or_more_and_a_single_run_makes_no_claim():
  assert safe_range.verdict([0.1], 2, 1, MARGIN) == safe_range.DIVERGED
  assert safe_range.verdict([], 1, 1, MARGIN) == safe_range.NO_CLAIM
  assert safe_range.verdict([0.1, 0.1], 2, 0, None) == safe_range.NO_CLAIM  # no margin


def test_the_range_ends_at_the_first_decided_x_that_does_not_hold():
  cell = safe_range.CellVerdict
  found = safe_range.MethodRange("pb", (
      cell(0.01, "a", 4, safe_range.NON_INFERIOR),
      cell(0.01, "a", 4, safe_range.BEHIND),  # a rate too high at the same x: the best counts
      cell(0.02, "b", 8, safe_range.NO_CLAIM),  # a pilot neither extends nor ends the range
      cell(0.02, "b", 8, safe_range.NO_CLAIM, diverged=True),  # nor does one that diverged
      cell(0.04, "a", 16, safe_range.NON_INFERIOR),
      cell(0.08, "a", 32, safe_range.NOT_SHOWN),
      cell(0.16, "a", 64, safe_range.NON_INFERIOR),  # after the range has ended
      cell(0.32, "a", 128, safe_range.DIVERGED)))
  assert found.holds_up_to == 0.04
  assert found.behind_from == 0.32
  assert safe_range.MethodRange("pb", (cell(0.01, "a", 4, safe_range.NOT_SHOWN),)).holds_up_to \
      is None


def test_a_range_with_nothing_decided_or_first_diverged_holds_nowhere():
  cell = safe_range.CellVerdict
  undecided = safe_range.MethodRange("pb", (cell(0.01, "a", 4, safe_range.NO_CLAIM),))
  assert (undecided.holds_up_to, undecided.behind_from) == (None, None)
  diverged_first = safe_range.MethodRange("pb", (
      cell(0.01, "a", 4, safe_range.DIVERGED, diverged=True),
      cell(0.02, "a", 8, safe_range.NON_INFERIOR)))
  assert (diverged_first.holds_up_to, diverged_first.behind_from) == (None, 0.01)
  assert safe_range.ranges([]) == []


def test_the_table_marks_the_diverged_cells_beside_those_behind():
  unit = phase.Unit("test_accuracy", 100.0, "points", margin=0.5)
  row = lambda x, gaps, diverged: type("Row", (), dict(  # the fields ranges() reads
      method="pb", delay_memory=x, study="s", num_stages=4, paired_gaps=gaps, runs=2,
      diverged=diverged, unit=unit))
  line = safe_range.table([row(0.1, [3.0, 3.2], 0), row(0.2, [3.0], 1)]).splitlines()[-1]
  assert "| 0.1 (s, S 4); 0.2 (s, S 4, diverged) |" in line


def test_the_report_gives_each_units_table_from_paired_gaps_only(tmp_path):
  # PB's two seeds hold against the baseline's; PB + SC's third seed has no baseline twin, so
  # its verdict rests on two paired seeds; SpecTrain's one paired seed makes no claim.
  unit = phase.Unit("test_accuracy", 100.0, "points", margin=0.5)
  workdir = tmp_path / "s"
  workdir.mkdir()
  records = [test_phase.run("sgd", s, 0.80 + s / 100) for s in range(2)]
  records += [test_phase.run("pb", s, 0.80 + s / 100 - 0.001 * (s + 1), stages=4)
              for s in range(2)]
  records += [test_phase.run("pb_sc", s, 0.78 + s / 100, stages=8, momentum=0.99)
              for s in range(3)]
  records += [test_phase.run("spectrain", 1, 0.8, stages=4)]
  (workdir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  rows = phase.rows_of(phase.read_study(str(workdir), unit=unit))
  lines = phase.report(rows, [], "phase.png", "cmd").splitlines()
  start = lines.index("## Where each method holds, in points")
  table = {line.split(" | ")[0].lstrip("| "): line for line in lines[start:start + 20]
           if line.startswith("| ")}
  # PB: gaps 0.1 and 0.2 points, paired: non-inferior at x = 6 x 0.1 = 0.6, the range's end.
  assert table["PB"].startswith("| PB | 0.6 (s, S 4) | — | — | — | 0.6 | — | 0.012 |")
  # PB + SC: two paired gaps of 2 points (the third seed has none to pair with): behind.
  assert table["PB + SC"].startswith("| PB + SC | — | — | 0.14 (s, S 8) | — | — | 0.14 | 0.052 |")
  assert table["SpecTrain"].startswith("| SpecTrain | — | — | — | 0.6 (s, S 4) | — | — |")


def test_each_warning_threshold_lies_between_where_the_studies_found_the_method_hold_and_fail():
  # The product warns a run beyond its method's safe_delay_memory: the studies' own records must
  # put that threshold at or above the last x where the method held, and below the first x
  # where it fell behind, in every unit. Records added by a study that contradict a threshold
  # fail here until the record's threshold is revised.
  sources, _ = phase.read_studies([os.path.join(ROOT, "docs", "studies", name) for name in
                                   ("depth", "lm_depth", "lm_regime", "mlp_regime")])
  rows = [row for source in sources for row in phase.rows_of(source)]
  checked = 0
  for unit in {row.unit for row in rows}:
    for method_range in safe_range.ranges([r for r in rows if r.unit == unit]):
      method, held = method_range.method, method_range.holds_up_to
      safe = methods_lib.record_of(method).safe_delay_memory
      if safe is None:
        assert held is None, (f"{method} held up to x = {held} in {unit.name}; its record names "
                              "no safe_delay_memory")
        continue
      if held is not None:
        assert held <= safe, (method, unit.name)  # x at three figures; the threshold rounds up
      if method_range.behind_from is not None:
        assert safe < method_range.behind_from, (method, unit.name)
      checked += 1
  assert checked >= 8
