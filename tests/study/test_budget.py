"""Tokens to a target loss (pipejax.study.budget) against hand computations."""

import dataclasses
import math

import numpy as np
import pytest
from scipy import stats

from pipejax.study import budget
from pipejax.study import records as study_records


def record(method, samples, loss, seed=0, lr=1e-3, train_loss=None, status="finished"):
  r = {"run": f"{method},{samples},{seed},{lr}", "status": status, "test_loss": loss,
       "samples": samples,
       "overrides": {"method": method, "seed": seed, "reference.lr": lr, "epochs": samples}}
  if train_loss is not None:
    r["train_loss"] = train_loss
  return study_records.parse_record(r)


def test_the_best_rate_is_chosen_on_the_seeds_every_rate_has():
  # 1e-3 on seeds 0 and 1 (mean 2.35) against 2e-3 on seed 0 only (2.32): on seed 0, the seed
  # both have, 1e-3 is the better (2.30), whatever seed 1 did.
  records = [record("a", 1000, 2.30, seed=0, lr=1e-3), record("a", 1000, 2.40, seed=1, lr=1e-3),
             record("a", 1000, 2.32, seed=0, lr=2e-3)]
  (point,) = budget.budget_points(records, (("method", "a"),))
  assert point.rate == 1e-3 and point.losses == {0: 2.30, 1: 2.40}
  # Without a seed in common, each rate's own mean decides.
  records[2] = record("a", 1000, 2.32, seed=2, lr=2e-3)
  assert budget.budget_points(records, (("method", "a"),))[0].rate == 2e-3


def test_a_budget_says_whether_its_best_rate_is_bracketed():
  def point(*losses_by_rate):
    records = [record("a", 1000, loss, lr=lr) for lr, loss in losses_by_rate]
    (p,) = budget.budget_points(records, (("method", "a"),))
    return p
  inside = point((1e-3, 3.0), (4e-3, 2.9), (2e-3, 2.8))
  assert inside.rates_tried == (1e-3, 2e-3, 4e-3) and inside.bracket == "yes"
  assert point((1e-3, 3.0), (2e-3, 2.8)).bracket == "highest tried"
  assert point((1e-3, 2.7), (2e-3, 2.8)).bracket == "lowest tried"
  assert point((1e-3, 2.7)).bracket == "one rate"
  # A rate that diverged is worse than any that finished: it brackets the best from above. One
  # that failed (a crash, not the method) or was skipped says nothing of the rate.
  records = [record("a", 1000, 2.7, lr=1e-3), record("a", 1000, 2.9, lr=5e-4),
             record("a", 1000, float("nan"), lr=2e-3, status="diverged")]
  (p,) = budget.budget_points(records, (("method", "a"),))
  assert p.rates_tried == (5e-4, 1e-3, 2e-3) and p.bracket == "yes"
  # Stopped by its trainer, a diverged run has no sample count: its settings place it.
  stopped = study_records.parse_record(
      {"run": "stopped", "status": "diverged",
       "overrides": {"method": "a", "seed": 1, "reference.lr": 4e-3, "epochs": 1000}})
  (p,) = budget.budget_points(records[:2] + [stopped], (("method", "a"),))
  assert p.rates_tried == (5e-4, 1e-3, 4e-3) and p.bracket == "yes"
  for status in ("failed", "skipped"):
    records[2] = record("a", 1000, float("nan"), lr=2e-3, status=status)
    (p,) = budget.budget_points(records, (("method", "a"),))
    assert p.bracket == "highest tried"


def test_a_neighbouring_budget_brackets_only_under_the_falling_rate_prior():
  records = [record("a", 1000, 3.0, lr=1e-3), record("a", 1000, 3.1, lr=4e-3),  # 4e-3 lost
             record("a", 2000, 2.5, lr=1e-3), record("a", 2000, 2.6, lr=5e-4),
             record("a", 4000, 2.0, lr=1e-3), record("a", 4000, 2.1, lr=2e-3),
             record("a", 8000, 1.5, lr=1e-3)]
  points = budget.budget_points(records, (("method", "a"),))
  assert [p.bracket for p in points] == ["lowest tried", "highest tried", "lowest tried",
                                         "one rate"]
  # 1,000's lowest is backed by 5e-4 losing at 2,000; 2,000's highest by 4e-3 at 1,000. 4,000's
  # lowest has no longer budget that tried below 1e-3; a budget with one rate takes no prior.
  assert budget.brackets(points) == [
      "lowest tried; a lower rate lost at a longer budget",
      "highest tried; a higher rate lost at a shorter budget", "lowest tried", "one rate"]


def test_the_budgets_table_counts_the_unbracketed_budgets(tmp_path):
  records = [record("sync", 1000, 3.0, lr=1e-3), record("sync", 1000, 2.9, lr=2e-3),
             record("sync", 1000, 3.1, lr=4e-3), record("sync", 4000, 2.0)]
  section = budget.TokensToTarget(series=(("Sync", (("method", "sync"),)),),
                                  baseline="Sync", targets=(2.5,))
  text = section(records, "")
  assert "| Sync | 1,000 | 0.002 | 0.001, 0.002, 0.004 | yes | 2.900 | 1 | — |" in text
  assert "1 of 2 budgets have no tried rate on one side" in text
  assert "Of these, 0 are bracketed on that side only if" in text


def test_crossing_interpolates_linearly_in_log_samples():
  # Between (1000, 3.0) and (4000, 2.0), the loss 2.5 lies halfway: at sqrt(1000 * 4000).
  kind, samples = budget.crossing([(1000, 3.0), (4000, 2.0)], 2.5)
  assert kind == "reached"
  assert samples == pytest.approx(2000.0)
  # A quarter of the way down: 1000 * 4 ** 0.25.
  assert budget.crossing([(1000, 3.0), (4000, 2.0)], 2.75)[1] == pytest.approx(1000 * 4 ** 0.25)


def test_crossing_never_extrapolates():
  assert budget.crossing([(1000, 3.0), (4000, 2.0)], 1.5) == ("not reached", None)
  assert budget.crossing([(1000, 3.0), (4000, 2.0)], 3.5) == ("before", 1000.0)
  assert budget.crossing([], 3.0) == ("no runs", None)


def test_a_curve_that_rises_again_keeps_its_first_crossing():
  # Overfitting at the longest budget: the first budget pair that brackets the target counts.
  kind, samples = budget.crossing([(1000, 3.0), (2000, 2.0), (4000, 2.4)], 2.5)
  assert kind == "reached" and samples == pytest.approx(1000 * 2 ** 0.5)


def test_each_budget_takes_its_own_best_rate_over_the_seeds_mean():
  records = [record("a", 1000, 3.0, seed=0, lr=1e-3), record("a", 1000, 3.2, seed=1, lr=1e-3),
             record("a", 1000, 2.9, seed=0, lr=2e-3), record("a", 1000, 3.4, seed=1, lr=2e-3),
             record("a", 2000, 2.0, lr=1e-3), record("a", 2000, 1.8, lr=5e-4),
             record("a", 2000, 0.1, lr=1e-4, status="diverged"), record("b", 2000, 0.5)]
  points = budget.budget_points(records, (("method", "a"),))
  assert [p.samples for p in points] == [1000, 2000]
  assert points[0].rate == 1e-3  # mean 3.1 against 3.15
  assert points[0].losses == {0: 3.0, 1: 3.2}
  assert points[1].rate == 5e-4  # the diverged run is no candidate


def test_per_seed_crossings_give_a_geometric_interval():
  records = [record("a", 1000, 3.0, seed=0), record("a", 4000, 2.0, seed=0),
             record("a", 1000, 3.2, seed=1), record("a", 4000, 2.2, seed=1),
             record("a", 1000, 2.8, seed=2), record("a", 4000, 1.9, seed=2)]
  points = budget.budget_points(records, (("method", "a"),))
  c = budget.crossings(points, 2.5)
  expected = {0: 2000.0, 1: 1000 * 4 ** 0.7, 2: 1000 * 4 ** (0.3 / 0.9)}
  assert c.per_seed == pytest.approx(expected)
  logs = np.log(list(expected.values()))
  half = stats.t.ppf(0.975, 2) * logs.std(ddof=1) / math.sqrt(3)
  interval = budget.log_interval(list(c.per_seed.values()))
  assert interval.mean == pytest.approx(math.exp(logs.mean()))
  assert interval.low == pytest.approx(math.exp(logs.mean() - half))
  assert interval.high == pytest.approx(math.exp(logs.mean() + half))


def test_token_tax_is_the_ratio_and_its_interval_is_paired_by_seed():
  base = budget.Crossing("reached", 1000.0, {0: 1000.0, 1: 1100.0, 2: 900.0})
  method = budget.Crossing("reached", 1500.0, {0: 1600.0, 1: 1650.0, 2: 1400.0, 3: 9e9})
  tax, interval = budget.token_tax(method, base)
  assert tax == pytest.approx(1.5)
  ratios = np.log([1.6, 1.5, 1400 / 900])  # seed 3 has no baseline: unpaired, left out
  assert interval.n == 3
  assert interval.mean == pytest.approx(math.exp(ratios.mean()))
  assert budget.token_tax(budget.Crossing("not reached", None, {}), base)[0] is None
  # A reading's interval is the same pairing, from its per-seed taxes.
  reading = budget.TaxReading("m", 2.5, tax, "b", 1000.0,
                              {s: (base.per_seed[s], method.per_seed[s] / base.per_seed[s])
                               for s in (0, 1, 2)})
  assert (reading.interval.mean, reading.interval.low, reading.interval.high) == pytest.approx(
      (interval.mean, interval.low, interval.high))
  assert budget.TaxReading("m", 2.5, tax, "b", 1000.0).interval.n == 0


def test_tax_trend_extrapolates_a_falling_tax_to_the_goal():
  # tax = 2 (s / 1000) ** -0.5: reaches 1.1 at s = 1000 (2 / 1.1) ** 2.
  taxes = [(1000.0, 2.0), (4000.0, 1.0 * 2 / 2)]
  text = budget.tax_trend(taxes, 1.1)
  assert "samples^-0.50" in text and "already" in text
  taxes = [(1000.0, 2.0), (4000.0, 1.5)]
  slope = math.log(0.75) / math.log(4)
  cross = 1000 * math.exp(math.log(1.1 / 2) / slope)
  # cross is about 17,800 samples, 4.46 times 4,000: both to two significant figures.
  assert 17_000 < cross < 18_500
  text = budget.tax_trend(taxes, 1.1)
  assert "about 18,000 samples of the baseline, 4.5 times" in text
  assert "span 4.0-fold (1,000 to 4,000)" in text
  assert "does not fall" in budget.tax_trend([(1000.0, 1.5), (4000.0, 1.6)], 1.1)


def test_the_section_renders_tables_a_figure_and_the_tax(tmp_path):
  records = [record("sync", 1000, 3.0), record("sync", 4000, 2.0, train_loss=1.7),
             record("async", 1000, 3.5), record("async", 4000, 2.4)]
  section = budget.TokensToTarget(
      series=(("Sync", (("method", "sync"),)), ("Async", (("method", "async"),))),
      baseline="Sync", targets=(2.5,), unit="nats")
  text = section(records, str(tmp_path))
  assert "| Sync | 4,000 | 0.001 | 0.001 | one rate | 2.000 | 1 | 1.700 |" in text
  assert "4 of 4 budgets have no tried rate on one side of their best" in text
  async_samples = 1000 * 4 ** (1.0 / 1.1)
  assert f"| Async | {async_samples:,.0f} |" in text
  assert f"| Async | {async_samples / 2000:.2f}× |" in text
  assert (tmp_path / "tokens_to_target.png").exists()


def test_a_training_loss_averaged_over_more_than_half_the_run_is_not_shown_as_final():
  # Evaluated only at its end, the run's one interval is all of it: its training loss is the
  # mean from the start, not a final loss. Evaluated at 3,000 too, the last interval is a quarter.
  def with_curve(samples, curve, seed):
    r = record("sync", samples, 2.0, seed=seed, train_loss=curve[-1][1])
    return dataclasses.replace(r, train_curve=curve)
  whole = with_curve(4000, [[4000, 3.5]], seed=0)
  late = with_curve(4000, [[3000, 2.6], [4000, 1.9]], seed=1)
  (point,) = budget.budget_points([whole, late], (("method", "sync"),))
  assert point.train_losses == {1: 1.9}
  (point,) = budget.budget_points([whole], (("method", "sync"),))
  assert point.train_losses == {}


def test_a_series_name_the_section_does_not_have_is_refused():
  with pytest.raises(ValueError, match="not one of its series"):
    budget.TokensToTarget(series=(("A", ()),), baseline="B", targets=(1.0,))


def test_a_records_training_curve_is_the_length_weighted_mean_of_its_chunks(tmp_path):
  from pipejax.study import records as study_records
  lines = [{"split": "train", "samples": 300, "loss": 3.0},
           {"split": "train", "samples": 500, "loss": 2.0},   # 200 samples
           {"split": "train", "samples": 1000, "loss": 1.0},  # 500 samples
           {"split": "train", "samples": 1200, "loss": float("nan")},
           {"split": "test", "samples": 500, "loss": 9.0}]
  (tmp_path / "metrics.jsonl").write_text("\n".join(__import__("json").dumps(l) for l in lines))
  curve = study_records.train_curve(str(tmp_path), [0, 500, 1000])
  assert curve == [[500, pytest.approx((3.0 * 300 + 2.0 * 200) / 500)], [1000, 1.0]]


@pytest.mark.slow
def test_the_budget_studys_smoke_records_train_losses_and_reads_tokens_to_target(tmp_path):
  """configs/studies/lm_budget.py:smoke end to end: two budgets of real trainer runs."""
  import os
  import subprocess
  import sys
  from pipejax.study import records as study_records
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  command = [sys.executable, os.path.join(root, "scripts", "study.py"),
             "--study=configs/studies/lm_budget.py:smoke", f"--workdir={tmp_path}",
             "--parallel=2"]
  done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  records = study_records.read_results(str(tmp_path))
  assert sorted(r.samples for r in records) == [750, 1500, 1500]
  assert all(r.train_curve[-1][0] == r.samples and r.train_loss > 0 for r in records)
  report = (tmp_path / "report.md").read_text()
  section = report.split("## Tokens to a target loss")[1]
  assert "| Muon, no pipeline | 1,500 |" in section and "| token tax |" in section
  assert (tmp_path / "tokens_to_target.png").exists()


def test_the_tax_readings_are_the_series_samples_over_the_best_synchronous_series():
  # Two synchronous series: the batch one reaches 2.5 sooner (at 2,000), so the tax is taken
  # against it; the asynchronous series reaches 2.5 at 1000 * 4 ** (1 / 1.1).
  records = [record("sync", 1000, 3.0), record("sync", 4000, 2.0),
             record("slow", 1000, 3.2), record("slow", 4000, 2.2),
             record("async", 1000, 3.5), record("async", 4000, 2.4)]
  section = budget.TokensToTarget(
      series=(("Sync", (("method", "sync"),)), ("Slow", (("method", "slow"),)),
              ("Async", (("method", "async"),))),
      baseline="Slow", synchronous=("Slow", "Sync"), targets=(2.5, 3.0), unit="nats")
  readings = section.taxes(records)
  # At 3.0 the batch series is at its shortest budget already (1,000), below the slow series'
  # crossing: the best synchronous samples there are not bracketed, so no tax is read.
  assert [(r.series, r.target, r.against) for r in readings] == [("Async", 2.5, "Sync")]
  (reading,) = readings
  assert reading.baseline_samples == pytest.approx(2000.0)
  assert reading.tax == pytest.approx(1000 * 4 ** (1 / 1.1) / 2000)
  assert reading.interval.n == 1  # one seed: no interval
  assert reading.per_seed == {0: (pytest.approx(2000.0), pytest.approx(reading.tax))}


def _readings_with_slopes(slopes, samples=(1000.0, 2000.0, 4000.0)):
  """Per seed, a tax of 2 (s / 1000) ** slope at each baseline sample s."""
  return [budget.TaxReading("Async", float(i), 2.0, "Sync", s,
                            {seed: (s, 2.0 * (s / 1000) ** slope)
                             for seed, slope in enumerate(slopes)})
          for i, s in enumerate(samples)]


def test_the_tax_trend_is_tested_on_each_seeds_own_slope():
  # Three seeds whose taxes fall exactly as s^-0.2, s^-0.25 and s^-0.3: the mean slope -0.25,
  # its standard deviation 0.05 and Student-t interval -0.25 +/- t(0.975, 2) 0.05 / sqrt(3).
  iv = budget.slope_interval(_readings_with_slopes((-0.2, -0.25, -0.3)))
  half = stats.t.ppf(0.975, 2) * 0.05 / math.sqrt(3)
  assert iv.n == 3 and iv.mean == pytest.approx(-0.25)
  assert (iv.low, iv.high) == (pytest.approx(-0.25 - half), pytest.approx(-0.25 + half))
  assert iv.p_value == pytest.approx(2 * stats.t.sf(0.25 / (0.05 / math.sqrt(3)), 2))
  assert "it falls" in budget.slope_interval_text(iv)
  # Two seeds with slopes of opposite sign show neither a fall nor a rise.
  text = budget.slope_interval_text(budget.slope_interval(_readings_with_slopes((-0.1, 0.1))))
  assert "n = 2 seeds" in text and "neither a fall nor a rise" in text
  # One seed gives no interval and no sentence.
  assert budget.slope_interval_text(budget.slope_interval(_readings_with_slopes((-0.2,)))) == ""


def test_a_seed_whose_targets_span_too_little_is_left_out_of_the_slope_test():
  readings = _readings_with_slopes((-0.2, -0.3, 0.5))
  # Seed 2 crossed only the first two targets' neighbourhood: 1,000 to 1,200, under 1.5-fold.
  readings = [dataclasses.replace(r, per_seed={**r.per_seed, 2: (1000.0 + 100 * i, 1.0)})
              for i, r in enumerate(readings)]
  iv = budget.slope_interval(readings)
  assert iv.n == 2 and iv.mean == pytest.approx(-0.25)


def test_a_nearly_flat_tax_extrapolates_in_powers_of_ten_not_to_the_sample():
  # tax = 2.7 (s / 5000) ** -0.04: reaches 1.1 at 5000 (2.7 / 1.1) ** 25, about 2.8e13 samples.
  taxes = [(5000.0, 2.7), (9000.0, 2.7 * 1.8 ** -0.04)]
  cross = 5000 * (2.7 / 1.1) ** 25
  assert 2.75e13 < cross < 2.85e13
  text = budget.tax_trend(taxes, 1.1)
  assert "samples^-0.04" in text
  assert "about 2.8·10¹³ samples of the baseline, 3.1·10⁹ times" in text


def test_a_tax_trend_over_too_short_a_span_is_not_extrapolated():
  # Falling as samples^-0.11 over 1.2-fold: fitted and stated, never read out to the goal.
  short = [(5000.0, 3.85), (6000.0, 3.85 * 1.2 ** -0.11)]
  trend = budget.fit_tax_trend(short)
  assert trend.span == pytest.approx(1.2) and not trend.extrapolable
  assert trend.slope == pytest.approx(-0.11)
  text = budget.tax_trend(short, 1.1)
  assert "samples^-0.11" in text and "too short a span to extrapolate" in text
  assert "about" not in text
  wide = [(5000.0, 3.85), (5000.0 * budget.MIN_SPAN, 3.85 * budget.MIN_SPAN ** -0.11)]
  assert budget.fit_tax_trend(wide).extrapolable
  assert "extrapolated, it would reach 1.1×" in budget.tax_trend(wide, 1.1)


def test_the_tax_trend_reads_the_longest_target_whatever_the_order_given():
  # Falling from 2.0 at 1,000 samples to 1.0 at 4,000: at the goal at the longest target.
  taxes = [(1000.0, 2.0), (4000.0, 1.0)]
  assert budget.tax_trend(taxes, 1.1) == budget.tax_trend(taxes[::-1], 1.1)
  assert "already" in budget.tax_trend(taxes[::-1], 1.1)
