"""The statistics behind a study's claims: Student-t intervals, paired tests and margin verdicts.

A study's runs differ by seed, and a claim that one method is better than, worse than or as good
as another must hold against the seed-to-seed spread. Every function here takes plain floats (one
per seed) and returns numbers a report prints beside the claim:

* :func:`interval`: the mean with its 95% Student-t confidence interval;
* :func:`paired`: the mean of per-seed differences, its interval and the two-sided paired t-test's
  p-value (the differences must come from runs that share a seed, hence starting weights and data
  order);
* :func:`margin_tests`: at a margin ``m``, the one-sided non-inferiority test (H0: difference
  <= -m) and the two one-sided tests of equivalence (H0: |difference| >= m).

With fewer than two values an interval is undefined: the bounds and p-values are NaN and a
verdict is never given.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from scipy import stats

CONFIDENCE = 0.95
ALPHA = 1.0 - CONFIDENCE


@dataclasses.dataclass(frozen=True)
class Interval:
  """``mean`` of ``n`` values with its ``confidence`` Student-t interval ``[low, high]``."""

  n: int
  mean: float
  low: float
  high: float
  std: float  # sample standard deviation (n - 1)
  p_value: float = math.nan  # two-sided t-test of mean = 0, where that question was asked

  @property
  def half_width(self) -> float:
    return (self.high - self.low) / 2

  def excludes_zero(self) -> bool:
    return self.n >= 2 and (self.low > 0 or self.high < 0)


def interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
  """Mean and Student-t confidence interval of ``values`` (NaN bounds for fewer than two)."""
  values = [float(v) for v in values]
  n = len(values)
  if n == 0:
    return Interval(0, math.nan, math.nan, math.nan, math.nan)
  mean = sum(values) / n
  if n < 2:
    return Interval(1, mean, math.nan, math.nan, math.nan)
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
  half = stats.t.ppf(0.5 + confidence / 2, n - 1) * std / math.sqrt(n)
  return Interval(n, mean, float(mean - half), float(mean + half), std)


def paired(differences: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
  """The mean per-seed difference, its interval and the paired t-test's two-sided p-value."""
  result = interval(differences, confidence)
  if result.n < 2:
    return result
  if result.std == 0:
    p_value = 1.0 if result.mean == 0 else 0.0
  else:
    t = result.mean / (result.std / math.sqrt(result.n))
    p_value = float(2 * stats.t.sf(abs(t), result.n - 1))
  return dataclasses.replace(result, p_value=p_value)


@dataclasses.dataclass(frozen=True)
class MarginTests:
  """Verdicts at margin ``margin`` (in the differences' units) from ``n`` paired differences."""

  margin: float
  n: int
  non_inferiority_p: float  # H0: mean difference <= -margin
  equivalence_p: float  # TOST: the larger of the two one-sided p-values

  @property
  def non_inferior(self) -> bool:
    return self.n >= 2 and self.non_inferiority_p < ALPHA

  @property
  def equivalent(self) -> bool:
    return self.n >= 2 and self.equivalence_p < ALPHA


def margin_tests(differences: Sequence[float], margin: float) -> MarginTests:
  """Non-inferiority and equivalence (two one-sided t-tests) of the differences at ``margin``."""
  if not margin > 0:
    raise ValueError(f"A margin must be positive; got {margin!r}.")
  result = interval(differences)
  if result.n < 2:
    return MarginTests(margin, result.n, math.nan, math.nan)
  se = result.std / math.sqrt(result.n)
  dof = result.n - 1

  def p_above(bound):  # H0: mean <= bound, against mean > bound
    if se == 0:
      return 0.0 if result.mean > bound else 1.0
    return float(stats.t.sf((result.mean - bound) / se, dof))

  def p_below(bound):  # H0: mean >= bound, against mean < bound
    if se == 0:
      return 0.0 if result.mean < bound else 1.0
    return float(stats.t.cdf((result.mean - bound) / se, dof))

  lower = p_above(-margin)
  return MarginTests(margin, result.n, lower, max(lower, p_below(margin)))
