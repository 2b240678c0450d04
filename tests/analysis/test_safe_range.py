"""Where each method holds (pipejax.analysis.safe_range): verdicts on hand-written gaps, checked
against scipy's t distribution, and the ranges the start-up warning reads against the studies."""

import json
import os

import numpy as np
import pytest
from scipy import stats

from pipejax.analysis import phase, safe_range
from pipejax.methods import safe_ranges
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
  end = lines.index("## Gaps in points")
  table = {line.split(" | ")[0].lstrip("| "): line for line in lines[start:end]
           if line.startswith("| ")}
  # PB: gaps 0.1 and 0.2 points, paired: non-inferior at x = 6 x 0.1 = 0.6, the range's end.
  assert table["PB"] == "| PB | 0.6 (s, S 4) | — | — | — | 0.6 | — |"
  # PB + SC: two paired gaps of 2 points (the third seed has none to pair with): behind.
  assert table["PB + SC"] == "| PB + SC | — | — | 0.14 (s, S 8) | — | — | 0.14 |"
  assert table["SpecTrain"].startswith("| SpecTrain | — | — | — | 0.6 (s, S 4) | — | — |")


def test_the_committed_safe_ranges_are_what_the_studies_records_give(tmp_path):
  # The start-up warning reads pipejax/methods/safe_ranges.json: a study that adds records fails
  # here until the file is generated again (scripts/phase_diagram.py --safe_ranges=...).
  sources, _ = phase.read_studies([os.path.join(ROOT, study) for study in phase.DEFAULT_STUDIES])
  rows = [row for source in sources for row in phase.rows_of(source)]
  generated = safe_range.write_ranges(rows, str(tmp_path / "safe_ranges.json"))
  with open(generated, encoding="utf-8") as f, open(safe_ranges.PATH, encoding="utf-8") as g:
    assert f.read() == g.read(), "regenerate: python scripts/phase_diagram.py --safe_ranges=" \
        "pipejax/methods/safe_ranges.json"
  measured = safe_ranges.load()
  assert measured["pb_muon"]["units"]["bits per byte"]["holds_up_to"] == 1.4
  assert [c["x"] for c in measured["pb_muon"]["units"]["bits per byte"]["behind"]] == [6.2]


def test_a_finding_holds_within_the_range_names_the_nearest_gap_below_and_claims_no_other():
  cell = {"x": 0.5, "verdict": "behind", "study": "s", "stages": 8, "unit": "points",
          "gap": 1.5, "low": 1.0, "high": 2.0, "runs": 3, "diverged": 0}
  far = dict(cell, x=2.0, verdict="diverged", diverged=2)
  ranges = {"pb": {"momenta": [0.9, 0.99],
                   "units": {"points": {"holds_up_to": 0.1, "behind": [cell, far]}}}}
  finding = lambda x, momentum=0.95: safe_ranges.finding("pb", x, momentum, ranges)
  assert finding(0.1).kind == safe_ranges.HOLDS and finding(0.10004).kind == safe_ranges.HOLDS
  assert finding(0.3).kind == safe_ranges.UNMEASURED and "beyond x = 0.1" in finding(0.3).text
  assert "at x = 0.5 (s, 8 stages), by +1.5 [+1, +2] points" in finding(1.0).text
  assert "diverge at x = 2 (s, 8 stages): 2 of 3 runs" in finding(3.0).text
  assert finding(0.05, momentum=0.0).kind == safe_ranges.UNMEASURED  # no study ran momentum 0
