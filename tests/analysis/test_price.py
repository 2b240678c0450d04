"""The time to a target loss (pipejax.analysis.price) against the closed forms of the schedules."""

import json

import pytest

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


def record(method, samples, loss):
  return study_records.parse_record(
      {"run": f"{method},{samples}", "status": "finished", "test_loss": loss, "samples": samples,
       "overrides": {"method": method, "seed": 0, "epochs": samples}})


def test_the_section_multiplies_samples_to_target_by_time_per_sample(tmp_path):
  costs = uniform_costs(4, 3.0e9)
  (tmp_path / "costs.json").write_text(json.dumps(costs.as_dict()))
  tokens = budget.TokensToTarget(
      series=(("Sync", (("method", "sync"),)), ("Async", (("method", "async"),))),
      baseline="Sync", targets=(2.5,))
  section = price.TimeToTarget(tokens, (("Sync", "1f1b", 8), ("Async", "pb", 1)),
                               "costs.json", num_devices=4)
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
