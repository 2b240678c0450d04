"""Intervals, paired t-tests and margin verdicts against scipy and the t table."""

import numpy as np
import pytest

from pipejax.study import statistics


def test_intervals_and_paired_tests_match_scipy_and_the_t_table():
  from scipy import stats  # pylint: disable=import-outside-toplevel
  gaps = [0.0120, 0.0030, -0.0010, 0.0080, 0.0050]
  result = statistics.paired(gaps)
  reference = stats.ttest_1samp(gaps, 0.0)
  assert result.p_value == pytest.approx(reference.pvalue)
  # t(0.975, 4) = 2.7764 from the printed table.
  half = 2.7764 * np.std(gaps, ddof=1) / np.sqrt(len(gaps))
  assert (result.low, result.high) == pytest.approx((np.mean(gaps) - half, np.mean(gaps) + half),
                                                    abs=1e-6)
  assert statistics.interval([0.5]).n == 1 and np.isnan(statistics.interval([0.5]).low)


def test_margin_verdicts_are_one_and_two_one_sided_t_tests():
  from scipy import stats  # pylint: disable=import-outside-toplevel
  gaps = [0.0042, 0.0010, 0.0075]
  tests = statistics.margin_tests(gaps, 0.005)
  # Non-inferiority: H0 mean <= -m, i.e. a one-sided test of gaps + m > 0.
  shifted = stats.ttest_1samp(np.array(gaps) + 0.005, 0.0, alternative="greater")
  assert tests.non_inferiority_p == pytest.approx(shifted.pvalue)
  upper = stats.ttest_1samp(np.array(gaps) - 0.005, 0.0, alternative="less")
  assert tests.equivalence_p == pytest.approx(max(shifted.pvalue, upper.pvalue))
  assert tests.non_inferior and not tests.equivalent  # the mean sits near the upper margin
  assert statistics.margin_tests([0.001, -0.001, 0.0005, 0.0], 0.005).equivalent
  with pytest.raises(ValueError, match="margin"):
    statistics.margin_tests(gaps, 0.0)
