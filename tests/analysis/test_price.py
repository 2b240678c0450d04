"""The time to a target loss (pipejax.analysis.price) against the closed forms of the schedules."""

import json
import math

import pytest
from scipy import stats

from pipejax import schedules
from pipejax.analysis import price
from pipejax.study import budget
from pipejax.study import records as study_records


def uniform_costs(num_stages, update=0.0):
  return price.StageCosts(tuple(schedules.uniform(num_stages)), (update,) * num_stages)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m, update", [(4, 1, 0.0), (4, 8, 0.0), (8, 4, 5.0)])
def test_a_flushed_schedule_pays_its_bubble_and_one_update_per_iteration(schedule, p, m, update):
  # F = B = W = 1: an iteration of m micro-batches takes (m + p - 1) * 3, then the step.
  per_sample = price.time_per_sample(schedule, uniform_costs(p, update), p, m)
  assert per_sample == pytest.approx((3 * (m + p - 1) + update) / m)


@pytest.mark.parametrize("schedule", ["pb", "pipedream"])
@pytest.mark.parametrize("batch, update", [(1, 0.0), (1, 6.0), (8, 6.0)])
def test_an_asynchronous_schedule_pays_each_stage_and_its_update_over_the_batch(schedule, batch,
                                                                                 update):
  per_sample = price.time_per_sample(schedule, uniform_costs(4, update), 4, batch)
  assert per_sample == pytest.approx(3 + update / batch)


def test_interleaving_one_layer_a_device_is_1f1b_and_more_layers_are_refused():
  costs = uniform_costs(4, 1.0)
  assert price.time_per_sample("interleaved", costs, 4, 8) == \
      price.time_per_sample("1f1b", costs, 4, 8)
  with pytest.raises(price.PriceError, match="not in the cost model"):
    price.time_per_sample("interleaved", uniform_costs(8), 4, 8)
  with pytest.raises(price.PriceError, match="Unknown schedule"):
    price.time_per_sample("gpipe2", costs, 4, 8)
  with pytest.raises(price.PriceError, match="positive"):
    price.time_per_sample("gpipe", costs, 4, 0)


def test_damaged_stage_costs_are_refused_in_one_line(tmp_path):
  path = tmp_path / "costs.json"
  path.write_text("{not json")
  with pytest.raises(price.PriceError, match="scripts/price.py --measure"):
    price.read_costs(str(path))
  path.write_text(json.dumps({"stages": [{"forward": 1, "input_grad": 1, "weight_grad": -1,
                                          "update": 0}]}))
  with pytest.raises(price.PriceError, match="negative"):
    price.read_costs(str(path))


def record(method, samples, loss, seed=0):
  return study_records.parse_record(
      {"run": f"{method},{samples},{seed}", "status": "finished", "test_loss": loss,
       "samples": samples, "overrides": {"method": method, "seed": seed, "epochs": samples}})


def sync_and_async_section(tmp_path, costs, **kwargs):
  """A section of a synchronous series under 1F1B at 8 and an asynchronous one under PB at 1, on
  4 devices, with ``costs`` written where it reads them."""
  (tmp_path / "costs.json").write_text(json.dumps(costs.as_dict()))
  tokens = budget.TokensToTarget(
      series=(("Sync", (("method", "sync"),)), ("Async", (("method", "async"),))),
      baseline="Sync", targets=(2.5,))
  return price.TimeToTarget(tokens, (("Sync", "1f1b", 8), ("Async", "pb", 1)), "costs.json",
                            num_devices=4, **kwargs)


def test_the_section_multiplies_samples_to_target_by_time_per_sample(tmp_path):
  section = sync_and_async_section(tmp_path, uniform_costs(4, 3.0e9))
  records = [record("sync", 1000, 3.0), record("sync", 4000, 2.0),
             record("async", 1000, 2.9), record("async", 4000, 2.1)]
  text = section(records, str(tmp_path))
  sync_time = 2000 * (3 * (8 + 3) + 3e9) / 8
  async_samples = 1000 * 4 ** (0.4 / 0.8)
  async_time = async_samples * (3 + 3e9)
  assert f"| {sync_time / 1e9:,.1f} |" in text
  assert f"| {async_time / 1e9:,.1f} |" in text
  assert f"the synchronous one first, {async_time / sync_time:.2f}× sooner" in text
  assert (tmp_path / "time_to_target.png").exists()


def test_times_within_rounding_of_each_other_name_no_winner(tmp_path):
  # Sync (1F1B at 8 on 4 devices, F = B = W = 1) costs 33 / 8 a sample and crosses 2.5 at 2,000;
  # Async (PB at 1) costs 3, so it ties where it crosses at 2,000 * 33 / 24 = 2,750 samples.
  section = sync_and_async_section(tmp_path, uniform_costs(4))
  fraction = math.log(2750 / 1000) / math.log(4)
  records = [record("sync", 1000, 3.0), record("sync", 4000, 2.0),
             record("async", 1000, 2.9), record("async", 4000, 2.9 - 0.4 / fraction)]
  text = section(records, str(tmp_path))
  assert "level within 0.5%" in text
  assert "one first" not in text
  records[-1] = record("async", 4000, 2.9 - 0.4 / fraction - 0.05)
  assert "the asynchronous one first" in section(records, str(tmp_path))


def test_a_run_that_gets_there_before_its_shortest_budget_bounds_its_side(tmp_path):
  # Sync (1F1B at 8 on 4 devices, 33 / 8 a sample) is already at 2.4 after 1,000 samples: it
  # reaches 2.5 within 4,125. Async (PB, 3 a sample) crosses 2.5 at 2,000 (6,000): the bound
  # beats it, so Sync is first by at least 6,000 / 4,125. Where Async crosses at
  # 1000 * 4 ** (1 / 6) (3,780), below the bound, which side is first is not known.
  section = sync_and_async_section(tmp_path, uniform_costs(4))
  sync = [record("sync", 1000, 2.4), record("sync", 4000, 2.0)]
  text = section(sync + [record("async", 1000, 2.9), record("async", 4000, 2.1)], str(tmp_path))
  assert (f"fastest synchronous Sync (1f1b), ≤ {4125 / 1e9:,.1f}; fastest asynchronous Async "
          f"(pb), {6000 / 1e9:,.1f}: the synchronous one first, at least {6000 / 4125:.2f}× "
          "sooner") in text
  text = section(sync + [record("async", 1000, 2.6), record("async", 4000, 2.0)], str(tmp_path))
  assert "not decided" in text and "one first" not in text


@pytest.mark.parametrize("update, async_seed_1, verdict", [
    (3.0e9, 2.95, "p = "), (0.0, 3.1, "not told apart, the interval includes 1×")])
def test_how_much_sooner_carries_an_interval_over_seeds_on_their_own_runs(
    tmp_path, update, async_seed_1, verdict):
  # Sync crosses 2.5 at 2,000 on both seeds; Async at 2,000 on seed 0 and at
  # 1000 * 4 ** ((async_seed_1 - 2.5) / 0.8) on seed 1. Per seed, the time ratio is Async's
  # samples times its time per sample over Sync's: the interval is Student's in log ratios.
  section = sync_and_async_section(tmp_path, uniform_costs(4, update))
  records = [record("sync", 1000, 3.0, seed) for seed in (0, 1)]
  records += [record("sync", 4000, 2.0, seed) for seed in (0, 1)]
  records += [record("async", 1000, 2.9), record("async", 4000, 2.1),
              record("async", 1000, async_seed_1, 1), record("async", 4000, 2.3, 1)]
  async_each, sync_each = 3 + update, (3 * (8 + 3) + update) / 8
  async_at = [2000.0, 1000 * 4 ** ((async_seed_1 - 2.5) / (async_seed_1 - 2.3))]
  logs = [math.log(a * async_each / (2000 * sync_each)) for a in async_at]
  if sum(logs) < 0:  # Async first: the ratio is Sync's time over Async's
    logs = [-v for v in logs]
  mean, sd = sum(logs) / 2, abs(logs[0] - logs[1]) / math.sqrt(2)
  half = stats.t.ppf(0.975, 1) * sd / math.sqrt(2)
  text = section([*records], str(tmp_path))
  assert (f"sooner ([{math.exp(mean - half):.2f}, {math.exp(mean + half):.2f}] on each seed's "
          "own runs, n = 2, p = ") in text
  assert verdict in text
  assert ("not told apart" in text) == (mean - half < 0)


def test_a_run_of_an_unknown_series_or_schedule_is_refused():
  tokens = budget.TokensToTarget(series=(("A", ()),), baseline="A", targets=(1.0,))
  with pytest.raises(price.PriceError, match="not a series"):
    price.TimeToTarget(tokens, (("B", "pb", 1),), "c.json", 4)
  with pytest.raises(price.PriceError, match="known schedule"):
    price.TimeToTarget(tokens, (("A", "pbx", 1),), "c.json", 4)


def test_the_docs_block_is_rewritten_between_its_markers_only():
  page = "a\n<!-- begin when-the-pipeline-pays -->\nold\n<!-- end when-the-pipeline-pays -->\nb"
  assert price.render_docs(page, "new\n") == \
      "a\n<!-- begin when-the-pipeline-pays -->\nnew\n<!-- end when-the-pipeline-pays -->\nb"
  with pytest.raises(price.PriceError, match="holds 0"):
    price.render_docs("a\nb", "new")


def test_docs_lm_md_holds_the_block_the_budget_study_records_make():
  """docs/lm.md's section is generated: regenerate it (scripts/price.py --docs=docs/lm.md)
  whenever the budget study's records or stage costs change."""
  import os
  from pipejax.study import records, spec
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  study = spec.load_study(os.path.join(root, "configs/studies/lm_budget.py"))
  bodies = [section.body for section in study.sections]
  tokens = next(b for b in bodies if isinstance(b, budget.TokensToTarget))
  timing = next(b for b in bodies if isinstance(b, price.TimeToTarget))
  workdir = os.path.join(root, "docs/studies/lm_budget")
  block = price.docs_section(tokens, timing, records.read_results(workdir), workdir)
  with open(os.path.join(root, "docs/lm.md")) as f:
    page = f.read()
  assert price.render_docs(page, block) == page


def test_the_goal_needs_both_a_small_tax_and_the_baselines_loss_sooner(tmp_path):
  # The baseline's loss at 4,000 sequences is 2.0. Async's curve is Sync's at 1.05 times the
  # samples (tax 1.05 everywhere), and pb at 1 sequence per update costs 3 + 8 a sequence,
  # against 1f1b at 8 micro-batches' (3 (8 + 3) + 8) / 8 = 5.125: Async's time is
  # 1.05 × 11 / 5.125 = 2.25 times Sync's, so the tax is met and the time is not.
  section = sync_and_async_section(tmp_path, uniform_costs(4, 8.0), goal_samples=4000)
  records = [record("sync", 1000, 3.0), record("sync", 4000, 2.0), record("sync", 8000, 1.8),
             record("async", 1050, 3.0), record("async", 4200, 2.0), record("async", 8400, 1.8)]
  lines = section.goal(records, str(tmp_path))
  assert "Sync's loss at 4,000 sequences (2.000 )" in lines[0]
  assert f"Sync under 1f1b, {4000 * 5.125 / 1e9:,.1f} × 10⁹" in lines[0]
  assert lines[1] == (f"* Async (pb): tax 1.05× at 2.5 ; against Sync, the fastest synchronous "
                      f"run, 1.05× at 2.5 , above its break-even {5.125 / 11:.2f}× (one target: "
                      f"no trend); reaches it in {4200 * 11 / 1e9:,.1f}: not met.")
  assert lines[-1] == "No asynchronous run meets the goal in the records so far."
  # Cheaper asynchronous steps (no update cost) meet it: 3 against (33 + 0) / 8 = 4.125.
  (tmp_path / "costs.json").write_text(json.dumps(uniform_costs(4, 0.0).as_dict()))
  lines = section.goal(records, str(tmp_path))
  assert lines[1].endswith(": met.") and lines[-1] == "Met by Async."
  # A tax above the goal fails it whatever the time.
  slow = [record("async", 2000, 3.0), record("async", 8000, 2.0)]
  lines = section.goal(records[:3] + slow, str(tmp_path))
  assert "tax 2.00×" in lines[1] and lines[1].endswith("not met.")


def test_a_series_without_runs_reads_no_runs_rather_than_not_reached(tmp_path):
  # Async has no record: its row and its goal line say so, where a series whose runs end above
  # the target reads "not reached" and "does not reach it".
  section = sync_and_async_section(tmp_path, uniform_costs(4, 8.0), goal_samples=4000)
  sync = [record("sync", 1000, 3.0), record("sync", 4000, 2.0)]
  text = section(sync, str(tmp_path))
  assert "| Async | pb | 1 | 0.00·10⁶ | no runs |" in text
  assert section.goal(sync, str(tmp_path))[1] == \
      "* Async (pb): no tax measured yet; no runs yet: not met."
  tokens_text = section.tokens(sync, str(tmp_path))
  assert "| Async | no runs |" in tokens_text
  above = [record("async", 1000, 3.5), record("async", 4000, 2.6)]
  assert "| Async | not reached |" in section.tokens(sync + above, str(tmp_path))
  assert section.goal(sync + above, str(tmp_path))[1].endswith(
      "does not reach it inside its budgets: not met.")


def _falling_tax_goal_line(tmp_path, targets, sync_at) -> str:
  """The goal line of Async, whose crossings of ``targets`` are 4 and 3 times Sync's
  (``sync_at``), with Sync under 1F1B at batch 8 and Async under PB on 4 uniform stages."""
  (tmp_path / "costs.json").write_text(json.dumps(uniform_costs(4, 8.0).as_dict()))
  tokens = budget.TokensToTarget(
      series=(("Sync", (("method", "sync"),)), ("Async", (("method", "async"),))),
      baseline="Sync", targets=targets)
  section = price.TimeToTarget(tokens, (("Sync", "1f1b", 8), ("Async", "pb", 1)), "costs.json",
                               num_devices=4, goal_samples=4000)
  records = [record("sync", 1000, 3.0), record("sync", 4000, 2.0), record("sync", 8000, 1.8),
             record("async", 4000, 3.0), record("async", 4 * sync_at[0], targets[0]),
             record("async", 3 * sync_at[1], targets[1]), record("async", 16000, 1.5)]
  return section.goal(records, str(tmp_path))[1]


def test_a_falling_tax_is_extrapolated_to_its_break_even(tmp_path):
  # Sync crosses 2.5 at 2,000 and 2.2 at 1000 * 4 ** 0.8 (loss linear in log samples); Async at
  # 4 and 3 times those. On these costs Async ties at 5.125 / 11 times Sync's samples, which the
  # fit tax = 4 (s / 2000) ** slope reaches at 2000 (tie / 4) ** (1 / slope).
  sync_at = (2000.0, 1000 * 4 ** 0.8)
  line = _falling_tax_goal_line(tmp_path, (2.5, 2.2), sync_at)
  slope = math.log(3 / 4) / math.log(sync_at[1] / sync_at[0])
  tie = 5.125 / 11
  cross = 2000 * (tie / 4) ** (1 / slope)
  assert (f"tax 3.00× at 2.2 ; against Sync, the fastest synchronous run, 3.00× at 2.2 , "
          f"falling as samples^{slope:+.2f}") in line
  assert f"to its break-even {tie:.2f}× at about {float(f'{cross:.2g}'):,.0f} sequences" in line


@pytest.mark.parametrize("cheaper", [None, "no runs", "short"])
def test_the_break_even_is_extrapolated_from_the_taxes_against_the_fastest_synchronous_run(
    tmp_path, cheaper):
  # Lean (batch 1 under GPipe, 3 * 4 + 8 = 20 a sequence) reaches each target in fewer samples
  # than Wide (1F1B at 8, 5.125 a sequence), which is the faster. The table's tax is against
  # Lean; the break-even (5.125 / 11 of Wide's samples, on these costs) is a tax against Wide,
  # so the trend extrapolated to it is that of the taxes against Wide: Async at 4 and 3 times
  # Wide's samples at 2.5 and 2.2, where Wide crosses at 2,000 and 1000 * 4 ** 0.8 and Lean, the
  # same curve at half the samples, at half of those (taxes 8 and 6). A synchronous series cheaper
  # per sequence (1F1B at 64) that has no runs, or whose one run ends above the goal's loss, does
  # not reach the goal first, so Wide stays the one.
  extra = ((("Widest", (("method", "widest"),)),), (("Widest", "1f1b", 64),)) if cheaper \
      else ((), ())
  (tmp_path / "costs.json").write_text(json.dumps(uniform_costs(4, 8.0).as_dict()))
  tokens = budget.TokensToTarget(
      series=(("Lean", (("method", "lean"),)), ("Wide", (("method", "wide"),)), *extra[0],
              ("Async", (("method", "async"),))),
      baseline="Lean", synchronous=("Lean", "Wide", *(label for label, _ in extra[0])),
      targets=(2.5, 2.2))
  section = price.TimeToTarget(
      tokens, (("Lean", "gpipe", 1), ("Wide", "1f1b", 8), *extra[1], ("Async", "pb", 1)),
      "costs.json", num_devices=4, goal_samples=2000)
  wide_at = (2000.0, 1000 * 4 ** 0.8)
  records = [record("wide", 1000, 3.0), record("wide", 4000, 2.0), record("wide", 8000, 1.8),
             record("lean", 500, 3.0), record("lean", 2000, 2.0), record("lean", 4000, 1.8),
             record("async", 4000, 3.0), record("async", 4 * wide_at[0], 2.5),
             record("async", 3 * wide_at[1], 2.2), record("async", 32000, 1.5)]
  records += [record("widest", 16000, 2.6)] if cheaper == "short" else []
  by_target = {r.target: r for r in tokens.taxes(records)}
  assert by_target[2.2].against == "Lean" and by_target[2.2].tax == pytest.approx(6.0, rel=1e-3)
  with pytest.raises(ValueError, match="synchronous series"):
    tokens.taxes(records, against=("Async",))
  line = section.goal(records, str(tmp_path))[1]
  slope = math.log(3 / 4) / math.log(wide_at[1] / wide_at[0])
  tie = 5.125 / 11
  cross = 2000 * (tie / 4) ** (1 / slope)
  assert line.startswith(f"* Async (pb): tax 6.00× at 2.2 ; against Wide, the fastest "
                         f"synchronous run, 3.00× at 2.2 , falling as samples^{slope:+.2f}")
  assert f"to its break-even {tie:.2f}× at about {float(f'{cross:.2g}'):,.0f} sequences" in line


def test_a_falling_tax_over_too_short_a_span_is_not_extrapolated(tmp_path):
  # As above, with targets 2.5 and 2.4, which Sync crosses at 2,000 and 1000 * 4 ** 0.6 samples
  # (1.15-fold): the tax falls from 4x to 3x, and the line states it without a break-even.
  line = _falling_tax_goal_line(tmp_path, (2.5, 2.4), (2000.0, 1000 * 4 ** 0.6))
  assert "tax 3.00× at 2.4 ;" in line and "extrapolated" not in line
  assert f"above its break-even {5.125 / 11:.2f}× (too short a span for a trend)" in line


@pytest.mark.parametrize("factors", [((4.0, 3.0), (5.0, 3.5)), ((3.0, 4.0), (3.0, 5.0))])
def test_the_break_even_trend_carries_its_slope_on_each_seed(tmp_path, factors):
  # Async crosses 2.5 and 2.2 at these multiples of Sync's samples on seeds 0 and 1: its tax
  # falls on both seeds, or rises on both. The per-seed slopes are log(tax ratio) / log(span),
  # and the interval is Student's over the two.
  (tmp_path / "costs.json").write_text(json.dumps(uniform_costs(4, 8.0).as_dict()))
  tokens = budget.TokensToTarget(
      series=(("Sync", (("method", "sync"),)), ("Async", (("method", "async"),))),
      baseline="Sync", targets=(2.5, 2.2))
  section = price.TimeToTarget(tokens, (("Sync", "1f1b", 8), ("Async", "pb", 1)), "costs.json",
                               num_devices=4, goal_samples=4000)
  sync_at = (2000.0, 1000 * 4 ** 0.8)
  records = []
  for seed, (first, second) in enumerate(factors):
    records += [record("sync", 1000, 3.0, seed), record("sync", 4000, 2.0, seed),
                record("sync", 8000, 1.8, seed), record("async", 1000, 3.5, seed),
                record("async", first * sync_at[0], 2.5, seed),
                record("async", second * sync_at[1], 2.2, seed),
                record("async", 64000, 1.5, seed)]
  line = section.goal(records, str(tmp_path))[1]
  span = math.log(sync_at[1] / sync_at[0])
  slopes = [math.log(second / first) / span for first, second in factors]
  result = stats.ttest_1samp(slopes, 0.0)
  low, high = result.confidence_interval(0.95)
  mean = sum(slopes) / 2
  verdict = ("neither a fall nor a rise is shown" if low < 0 < high
             else "it falls" if mean < 0 else "it rises")
  assert (f" (per seed {mean:+.2f} [{low:+.2f}, {high:+.2f}], n = 2, "
          f"p = {result.pvalue:.2g}: {verdict})") in line
  if mean < 0:
    assert "falling as" in line and "extrapolated, to its break-even" in line
  else:
    assert "not falling as" in line and "the fit never reaches its break-even" in line


def test_the_time_figure_gives_each_series_a_colour_and_each_schedule_a_line_style():
  lines = [(series, schedule) for series in ("sync at 1", "sync at 8")
           for schedule in price.SYNCHRONOUS] + [("pipedream", "2bw"), ("pb", "pb")]
  styles = price.line_styles(lines)
  colour_of = {}
  for (series, _), (colour, _, _) in styles.items():
    assert colour_of.setdefault(series, colour) == colour
  assert len(set(colour_of.values())) == 4
  style_of = {}
  for (_, schedule), (_, marker, dash) in styles.items():
    assert style_of.setdefault(schedule, (marker, dash)) == (marker, dash)
  assert len(set(style_of.values())) == len(style_of) == len(price.SYNCHRONOUS) + 2
