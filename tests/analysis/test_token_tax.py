"""The token taxes filed for the start-up warning (pipejax.analysis.token_tax and
pipejax.methods.safe_ranges.token_tax), and the committed file against the budget study."""

import json
import os

import pytest

from pipejax.analysis import token_tax
from pipejax.methods import safe_ranges
from pipejax.study import budget, spec
from pipejax.study import records as study_records
from pipejax.train import experiment
from pipejax.train import plan as plan_lib
from pipejax.core import accounting
from tests.helpers import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def record(method, samples, loss, seed=0, stages=32, **overrides):
  return study_records.parse_record({
      "run": f"{method},{samples},{seed},{overrides}", "status": "finished", "test_loss": loss,
      "samples": samples, "num_stages": stages,
      "overrides": {"method": method, "seed": seed, "reference.lr": 1e-3, "epochs": samples,
                    **overrides}})


SECTION = budget.TokensToTarget(
    series=(("Sync", (("method", "muon"),)), ("Async", (("method", "pipedream_muon"),))),
    baseline="Sync", targets=(2.5, 2.8), unit="nats")


def test_a_tax_is_filed_under_its_preset_depth_and_micro_batches_per_update():
  records = [record("muon", 1000, 3.0, stages=1), record("muon", 4000, 2.0, stages=1),
             record("pipedream_muon", 1000, 3.5), record("pipedream_muon", 4000, 2.4)]
  found = token_tax.measured_taxes(SECTION, records, "lm budget")
  (entry, other) = found["pipedream_muon"]
  assert (entry["stages"], entry["micro_batches_per_update"], entry["target"]) == (32, 1, 2.5)
  assert entry["tax"] == pytest.approx(1000 * 4 ** (1 / 1.1) / 2000, abs=1e-3)
  assert (entry["low"], entry["seeds"], entry["against"]) == (None, 1, "Sync")
  assert other["target"] == 2.8 and list(found) == ["pipedream_muon"]


def test_a_series_that_mixes_depths_is_refused_with_its_facts():
  records = [record("muon", 1000, 3.0), record("muon", 4000, 2.0),
             record("pipedream_muon", 1000, 3.5), record("pipedream_muon", 4000, 2.4, stages=8)]
  with pytest.raises(token_tax.TaxSeriesError, match="'Async' mixes runs"):
    token_tax.measured_taxes(SECTION, records, "lm budget")


def test_the_sentence_states_the_lowest_target_and_the_spread_of_the_others():
  taxes = {"pipedream_muon": [
      {"study": "lm budget", "stages": 32, "micro_batches_per_update": 1, "target": 2.9,
       "unit": "bits per byte", "tax": 3.5, "against": "Muon", "low": None, "high": None,
       "seeds": 1},
      {"study": "lm budget", "stages": 32, "micro_batches_per_update": 1, "target": 2.8,
       "unit": "bits per byte", "tax": 2.4, "against": "Muon", "low": 2.1, "high": 2.7,
       "seeds": 2}]}
  text = safe_ranges.token_tax("pipedream_muon", 32, 1, taxes)
  assert ("needed 2.40 times the sequences of Muon to reach 2.8 bits per byte (95% CI [2.10, "
          "2.70] over 2 seeds; 3.50x to 3.50x at its 1 higher target)") in text
  assert safe_ranges.token_tax("pipedream_muon", 16, 1, taxes) is None
  assert safe_ranges.token_tax("pipedream_muon", 32, 8, taxes) is None
  assert safe_ranges.token_tax("pb_muon", 32, 1, taxes) is None


def test_the_start_up_warning_states_a_measured_tax(monkeypatch):
  config = load_config("char_lm")
  config.method = "pb_muon"
  plan = plan_lib.resolve(config)
  taxes = {"pb_muon": [{"study": "lm budget", "stages": 8, "micro_batches_per_update": 1,
                        "target": 2.6, "unit": "bits per byte", "tax": 1.7, "against": "Muon",
                        "low": None, "high": None, "seeds": 1}]}
  monkeypatch.setattr(safe_ranges, "load_taxes", lambda path=None: taxes)
  # At 8 stages PB + Muon holds level (lm_depth): the tax alone is the warning.
  warning = experiment.delay_memory_warning(plan, accounting.stage_delays(8))
  assert warning is not None and (
      "needed 1.70 times the sequences of Muon to reach 2.6 bits per byte (1 seed)") in warning
  assert "behind" not in warning
  # At 32 stages it is behind, and no tax is measured there: the gap alone.
  warning = experiment.delay_memory_warning(plan, accounting.stage_delays(32))
  assert "behind its best baseline" in warning and "token tax" not in warning


def test_the_committed_token_taxes_are_what_the_budget_study_records_give(tmp_path):
  # The start-up warning reads pipejax/methods/token_tax.json: a budget run that moves a tax
  # fails here until the file is generated again (scripts/price.py --token_tax=...).
  study = spec.load_study(os.path.join(ROOT, "configs/studies/lm_budget.py"))
  tokens = next(s.body for s in study.sections if isinstance(s.body, budget.TokensToTarget))
  records = study_records.read_results(os.path.join(ROOT, "docs/studies/lm_budget"))
  path = token_tax.write_taxes(tokens, records, study.name, str(tmp_path / "token_tax.json"))
  with open(path, encoding="utf-8") as f, open(safe_ranges.TAX_PATH, encoding="utf-8") as g:
    assert json.load(f)["methods"] == json.load(g)["methods"], \
        "regenerate: python scripts/price.py --token_tax=pipejax/methods/token_tax.json"
