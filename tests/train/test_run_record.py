"""What a run says about its optimizer: the warning on a delay beyond its method's safe range at
start, and the resolved b1, b2 and rate in summary.json and the HParams."""

import logging
import os

import pytest

from pipejax.train import plan as plan_lib
from pipejax import methods
from pipejax.methods import safe_ranges
from pipejax.core import accounting
from pipejax.train import experiment, trainer
from pipejax.train import metrics as metrics_lib
from tests.helpers import digits_config, load_config
from tests.train.test_reliability import tensorboard_events


def _delays(plan):
  """The stage delays of ``plan``'s model, without building its pipeline."""
  return accounting.stage_delays(plan.model.num_stages)


def test_a_32_stage_adam_lm_is_warned_with_its_numbers():
  config = load_config("char_lm")
  config.model_kwargs.blocks = 30  # 32 stages: D_max = 62, b1 = 0.9, so 6.2
  config.method = "pb_sc_lwp"
  plan = plan_lib.resolve(config)
  delays = _delays(plan)
  assert len(delays) == 32
  warning = experiment.delay_memory_warning(plan, delays)
  assert warning is not None and "\n" not in warning
  assert "PB + SC + LWP at D_max (1 - b1) = 62 x (1 - 0.9) = 6.2" in warning
  assert "S = 32 stages" in warning
  assert "behind its best baseline at x = 6.2 (lm depth, 32 stages), by +" in warning
  assert "bits per byte (95% CI over seeds): expect a gap" in warning


def test_pb_muon_is_warned_at_32_stages_and_not_at_8():
  # lm_depth found PB + Muon non-inferior to Adam at 8 stages (D_max = 14: 14 x 0.1 = 1.4) and
  # behind at 32 (D_max = 62: 6.2).
  config = load_config("char_lm")
  config.method = "pb_muon"
  plan = plan_lib.resolve(config)
  assert experiment.delay_memory_warning(plan, accounting.stage_delays(8)) is None
  warning = experiment.delay_memory_warning(plan, accounting.stage_delays(32))
  assert "PB + Muon at D_max (1 - b1) = 62 x (1 - 0.9) = 6.2" in warning
  assert "behind its best baseline at x = 6.2" in warning


def test_an_8_stage_mlp_at_its_scaled_momentum_is_within_the_safe_range():
  # Momentum 0.9 at the reference batch 128 is 0.9^(1/128) = 0.99918 at micro-batch 1:
  # D_max (1 - m) = 14 x 0.00082 = 0.0115, within PB + SC + LWP's 0.104 (and PB's 0.012).
  config = load_config("deep_mlp")
  config.model_kwargs.depth = 8
  assert plan_lib.resolve(config).recipe.momentum == pytest.approx(0.9 ** (1 / 128))
  for method in ("pb_sc_lwp", "pb"):
    config.method = method
    plan = plan_lib.resolve(config)
    assert experiment.delay_memory(plan, _delays(plan)) == pytest.approx(0.01152, abs=1e-4)
    assert experiment.delay_memory_warning(plan, _delays(plan)) is None
  # The same pipeline at momentum 0.9 per micro-batch is at 1.4: far beyond.
  config.micro_batch.momentum = 0.9
  plan = plan_lib.resolve(config)
  assert "= 1.4 " in experiment.delay_memory_warning(plan, _delays(plan))


def test_an_accumulating_method_counts_its_delay_in_updates():
  """PipeDream + Muon at 8 sequences per update: D_max = 62 ticks is 7.75 updates."""
  config = load_config("char_lm")
  config.model_kwargs.blocks = 30
  config.method = "pipedream_muon"
  config.reference.batch_size = 8
  config.method_kwargs = {"pipedream_muon": {"micro_batches": 8}}
  plan = plan_lib.resolve(config)
  assert plan.recipe.momentum == 0.9 and plan.recipe.batch_size == 8
  delays = accounting.stage_delays(32)
  assert experiment.delay_memory(plan, delays) == pytest.approx(62 / 8 * 0.1)
  warning = experiment.delay_memory_warning(plan, delays)
  assert "D_max / 8 (1 - b1) = 62 / 8 x (1 - 0.9) = 0.775" in warning
  assert "8 micro-batches per update" in warning
  # lm_regime's cell at 0.775 made no claim, and the one behind is at 6.2: nothing measured here.
  assert "no study measured it behind at or below this x" in warning and "gap" not in warning


def test_a_method_with_no_delay_is_never_warned_and_one_measured_without_a_claim_is_unmeasured():
  config = load_config("char_lm")
  config.model_kwargs.blocks = 30
  # lm_regime's pilots of these made no claim at 32 stages (one seed): no gap is known.
  for name in ("pb_error_feedback", "pb_muon_delay_warmup"):
    config.method = name
    warning = experiment.delay_memory_warning(plan_lib.resolve(config), accounting.stage_delays(32))
    assert "its cost here is unmeasured" in warning and "gap" not in warning, name
  for name in (n for n, record in methods.PRESETS.items() if record.traits.delay_free):
    config.method = name
    assert experiment.delay_memory_warning(plan_lib.resolve(config),
                                           accounting.stage_delays(32)) is None
  never = safe_ranges.finding("pb", 6.2, 0.9, ranges={})
  assert never.kind == safe_ranges.UNMEASURED and "no study has measured this method" in never.text


@pytest.mark.parametrize("method", ["pipedream_muon", "pb_muon_sc_lwp", "nesterov_asyncpp",
                                    "pipeoptim", "pb_muon"])
def test_at_32_stages_on_the_lm_each_method_measured_behind_there_is_warned_with_its_gap(method):
  config = load_config("char_lm")
  config.model_kwargs.blocks = 30
  config.method = method
  warning = experiment.delay_memory_warning(plan_lib.resolve(config), accounting.stage_delays(32))
  assert "behind its best baseline at x = 6.2 (lm" in warning
  assert "bits per byte (95% CI over seeds): expect a gap" in warning


def test_a_momentum_no_study_measured_is_said_to_be_unmeasured_not_given_a_gap():
  config = load_config("char_lm")
  config.model_kwargs.blocks = 30
  config.method = "pb"
  config.reference.momentum = 0.0
  warning = experiment.delay_memory_warning(plan_lib.resolve(config), accounting.stage_delays(32))
  assert "no study has measured it at momentum 0 (its cells span 0.9 to " in warning
  assert "unmeasured" in warning and "gap" not in warning


def test_the_warning_is_logged_at_the_start_of_training(tmp_path, caplog):
  caplog.set_level(logging.INFO)
  config = digits_config(**{"micro_batch.momentum": 0.9})  # 3 stages: D_max (1 - m) = 0.4
  plan = plan_lib.resolve(config)
  setup = experiment.build(plan)
  log_start = trainer._log_start  # pylint: disable=protected-access
  log_start(plan, str(tmp_path), False, setup, 240, "digest")
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and "D_max (1 - momentum) = 4 x (1 - 0.9) = 0.4" in warnings[0]


@pytest.mark.slow
def test_an_adam_runs_summary_and_hparams_record_the_resolved_b1_b2_and_rate(tmp_path):
  config = digits_config(optimizer="adam", **{"reference.b2": 0.95, "reference.lr": 2e-3})
  recipe = plan_lib.resolve(config).recipe
  summary = trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert (summary["learning_rate"], summary["b1"], summary["b2"]) == (
      recipe.learning_rate, recipe.momentum, recipe.b2)
  assert summary["b2"] != 0.999  # the config's, not the default
  events = list(tensorboard_events(os.path.join(tmp_path, "run", "tensorboard",
                                                metrics_lib.HPARAMS_RUN)))
  plugin = b"".join(v.metadata.plugin_data.content for e in events for v in e.summary.value
                    if v.metadata.plugin_data.plugin_name == "hparams")
  for name in (b"resolved.lr", b"resolved.b1", b"resolved.b2"):
    assert name in plugin


def test_an_sgd_runs_summary_has_no_adam_betas():
  config = digits_config()
  resolved = experiment.resolved_optimizer(plan_lib.resolve(config))
  assert resolved["b1"] is None and resolved["b2"] is None and resolved["momentum"] > 0
