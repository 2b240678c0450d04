"""Where each method holds (pipejax.analysis.safe_range): verdicts on hand-written gaps, checked
against scipy's t distribution, and the product's warning thresholds against the studies."""

import os

import numpy as np
import pytest
from scipy import stats

from pipejax import methods as methods_lib
from pipejax.analysis import phase, safe_range
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
    ([0.2], safe_range.ONE_SEED),
    ([], safe_range.NO_GAP),
])
def test_a_cells_verdict_follows_the_one_sided_test_and_the_interval(gaps, expected):
  assert safe_range.verdict(gaps, 0, MARGIN) == expected
  if len(gaps) >= 2:
    low = stats.t.interval(0.95, len(gaps) - 1, loc=np.mean(gaps), scale=stats.sem(gaps))[0]
    assert (non_inferiority_p(gaps, MARGIN) < 0.05) == (expected == safe_range.NON_INFERIOR)
    assert (low > MARGIN) == (expected == safe_range.BEHIND)


def test_a_divergence_is_its_cells_verdict_whatever_the_other_seeds_did():
  assert safe_range.verdict([0.1, 0.1], 1, MARGIN) == safe_range.DIVERGED


def test_the_range_ends_at_the_first_decided_x_that_does_not_hold():
  cell = safe_range.Cell
  found = safe_range.MethodRange("pb", (
      cell(0.01, "a", 4, safe_range.NON_INFERIOR),
      cell(0.01, "a", 4, safe_range.BEHIND),  # a rate too high at the same x: the best counts
      cell(0.02, "b", 8, safe_range.ONE_SEED),  # a pilot neither extends nor ends the range
      cell(0.04, "a", 16, safe_range.NON_INFERIOR),
      cell(0.08, "a", 32, safe_range.NOT_SHOWN),
      cell(0.16, "a", 64, safe_range.NON_INFERIOR),  # after the range has ended
      cell(0.32, "a", 128, safe_range.DIVERGED)))
  assert found.holds_up_to == 0.04
  assert found.behind_from == 0.32
  assert safe_range.MethodRange("pb", (cell(0.01, "a", 4, safe_range.NOT_SHOWN),)).holds_up_to \
      is None


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
    for found in safe_range.ranges([r for r in rows if r.unit == unit], unit.margin):
      safe = methods_lib.record_of(found.method).safe_delay_memory
      if safe is None:
        assert found.holds_up_to is None, (
            f"{found.method} held up to x = {found.holds_up_to} in {unit.name}; its record "
            "names no safe_delay_memory")
        continue
      if found.holds_up_to is not None:
        # The records round x to two significant figures.
        assert found.holds_up_to <= safe * 1.01, (found.method, unit.name)
      if found.behind_from is not None:
        assert safe < found.behind_from, (found.method, unit.name)
      checked += 1
  assert checked >= 8
