"""The training binary's library: exact resume (in process and after SIGTERM), failure paths,
configs."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from pipejax.train import plan as plan_lib
from pipejax.train import (checkpoint, config_checks, divergence, experiment, interruption,
                           run_checks)
from pipejax import methods
from pipejax.train import trainer
from pipejax.data import DataError
from pipejax.core.engine import Pipeline
from pipejax.core.stages import ModelError
from pipejax.parallel.mesh import MeshError
from tests.helpers import (ROOT, as_from_a_terminal, config_module, digits_config, leaves_equal,
                           load_config, make_model, make_stream, sigterm_midway_and_resume)


def test_mid_flight_checkpoint_resumes_bit_exactly(tmp_path):
  model = make_model()
  x, y = make_stream(14, 2)
  pipe = Pipeline(model, methods.make_method("pb_sc_lwp", learning_rate=0.05), x[0], y[0])
  first, first_metrics = pipe.run(pipe.init(jax.random.PRNGKey(3)), x[:7], y[:7])
  # Mid-flight: stage 0's delay line holds 7 in-flight inputs, none of them backwarded yet.
  assert bool(np.asarray(first.stages[0].delay_line.valid).all())
  saver = checkpoint.Checkpointer(str(tmp_path / "ckpt"))
  saver.save(7, first, {"note": "mid-flight"})
  straight, straight_metrics = pipe.run(first, x[7:], y[7:])  # the run that never stopped

  restored, meta = saver.restore(7, pipe.init(jax.random.PRNGKey(99)))
  assert meta == {"note": "mid-flight"}
  resumed, resumed_metrics = pipe.run(restored, x[7:], y[7:])
  leaves_equal(straight, resumed)
  for key in straight_metrics:
    np.testing.assert_array_equal(resumed_metrics[key], straight_metrics[key])
  # And the whole is the 14-tick run in one call (which keeps the empty-slot guard throughout:
  # equal up to float rounding, see Pipeline.run).
  one_call, one_call_metrics = pipe.run(pipe.init(jax.random.PRNGKey(3)), x, y)
  for a, b in zip(jax.tree.leaves(one_call), jax.tree.leaves(resumed)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.concatenate([first_metrics["loss"], resumed_metrics["loss"]]),
                             one_call_metrics["loss"], rtol=1e-5)


def test_an_asynchronous_method_that_accumulates_schedules_its_rate_per_update(tmp_path):
  """PipeDream + Muon at M = 3: one update per three micro-batches, so the recipe is that of a
  batch of 3 b and the schedule counts updates; a chunk need not end on an update (40 ticks)."""
  config = digits_config(method="pipedream_muon", optimizer="adam", decay_mask=True,
                         method_kwargs={"pipedream_muon": {"micro_batches": 3}})
  plan = plan_lib.resolve(config)
  assert plan.recipe.batch_size == 3 * config.micro_batch_size
  assert plan.micro_batches_per_update == 3 and plan.micro_batches_per_flush is None
  steps, _ = experiment.optimizer_steps(plan, 1437)
  assert steps == experiment.run_ticks(plan, 1437) // 3
  summary = trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert summary["samples"] == experiment.run_ticks(plan, 1437) * config.micro_batch_size
  assert np.isfinite(summary["test_loss"]) and summary["test_loss"] < summary["initial_test_loss"]


@pytest.mark.slow
def test_training_resumes_exactly_after_sigterm(tmp_path):
  """A real kill: SIGTERM to the binary mid-run, rerun, and compare with a run never stopped.

  Two epochs, so the data stream resumes across an epoch's end, and Online Norm in every stage,
  so the state that must come back holds stage variables (live and stashed) as well as weights,
  optimizer states and delay lines."""
  sigterm_midway_and_resume(tmp_path, [
      "--config.dataset=digits", "--config.max_train_examples=0", "--config.max_test_examples=0",
      "--config.epochs=2.0", "--config.ticks_per_chunk=50", "--config.eval_every_samples=1000000",
      "--config.checkpoint_every_samples=1000000", "--config.schedule=constant",
      "--config.model_kwargs.hidden=(16,12)", "--config.model_kwargs.normalization=online"])

  straight_summary = json.load(open(tmp_path / "straight" / "summary.json"))
  resumed_summary = json.load(open(tmp_path / "killed" / "summary.json"))
  assert resumed_summary["test_accuracy"] == straight_summary["test_accuracy"]
  assert resumed_summary["test_loss"] == straight_summary["test_loss"]
  # The whole final pipeline state (weights, optimizer states, delay lines) is identical.
  config = digits_config(epochs=2.0, ticks_per_chunk=50, schedule="constant")
  config.model_kwargs["normalization"] = "online"
  a = checkpoint.Checkpointer(str(tmp_path / "straight" / "checkpoints"))
  b = checkpoint.Checkpointer(str(tmp_path / "killed" / "checkpoints"))
  step = a.latest_samples()
  assert b.latest_samples() == step
  meta_a, meta_b = a.restore_meta(step), b.restore_meta(step)
  assert meta_a["data_position"] == meta_b["data_position"]
  like = _pipeline_for(config).init(jax.random.PRNGKey(0))
  straight, resumed = a.restore(step, like)[0], b.restore(step, like)[0]
  leaves_equal(straight, resumed)
  # The checkpoint holds the Online Norm variables the run left, not fresh ones.
  for stage, fresh in zip(resumed.stages[:-1], like.stages[:-1]):
    for left, initial in zip(jax.tree.leaves(stage.variables), jax.tree.leaves(fresh.variables)):
      assert np.abs(np.asarray(left) - np.asarray(initial)).max() > 1e-4
  # Metrics were not duplicated by the resume.
  samples = [json.loads(l)["samples"] for l in open(tmp_path / "killed" / "metrics.jsonl")
             if json.loads(l)["split"] == "train"]
  assert samples == sorted(set(samples))


def _pipeline_for(config):
  return experiment.build(plan_lib.resolve(config)).pipeline


def test_nan_at_one_stage_is_reported_with_stage_and_tick():
  model = make_model()
  x, y = make_stream(12, 1)
  pipe = Pipeline(model, methods.make_method("pb", learning_rate=0.05), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0))
  poisoned = jax.tree.map(lambda p: p.at[...].set(np.nan), state.stages[2].params)
  state = state._replace(stages=state.stages[:2] + (state.stages[2]._replace(params=poisoned),)
                         + state.stages[3:])
  _, metrics = pipe.run(state, x, y)
  message = divergence.first_non_finite(np.asarray(metrics["finite"]), 100, model)
  # Stage 2 forwards its first real sample at tick 2: that is where the NaN first shows.
  assert message == "stage 2 ('dense3') at tick 102"


def test_divergence_stops_keeps_last_good_checkpoint_and_names_the_stage(tmp_path):
  workdir = str(tmp_path / "run")
  trainer.train_and_evaluate(digits_config(), workdir)
  saver = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
  good_step = saver.latest_samples()
  config = digits_config(epochs=480 / 1437, **{"micro_batch.lr": 1e30},  # resumes, then blows up
                         allow_changes_on_resume=True)
  with pytest.raises(divergence.TrainingDiverged, match=r"stage \d+ \('.*'\) at tick \d+.*"
                     rf"last good checkpoint \(at {good_step} samples,"):
    trainer.train_and_evaluate(config, workdir)
  assert saver.all_samples()[-1] == good_step
  like = _pipeline_for(config).init(jax.random.PRNGKey(0))
  state, _ = saver.restore(good_step, like)
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(state.stages[0].params))


def test_damaged_checkpoints_are_a_clear_error_not_a_fresh_start(tmp_path):
  workdir = str(tmp_path / "run")
  trainer.train_and_evaluate(digits_config(), workdir)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  steps = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
  for step in steps:
    for root, _, files in os.walk(os.path.join(ckpt_dir, str(step), "state")):
      for name in files:  # truncate every data file of every state
        with open(os.path.join(root, name), "r+b") as f:
          f.truncate(8)
  with pytest.raises(checkpoint.CheckpointError, match=f"Every checkpoint.*damaged.*{steps[-1]}"):
    trainer.train_and_evaluate(digits_config(epochs=480 / 1437, allow_changes_on_resume=True),
                               workdir)
  assert sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit()) == steps  # nothing moved


def test_checkpoint_directory_with_only_garbage_is_refused(tmp_path):
  workdir = tmp_path / "run"
  (workdir / "checkpoints" / "1234").mkdir(parents=True)
  (workdir / "checkpoints" / "1234" / "junk").write_text("not a checkpoint")
  with pytest.raises(checkpoint.CheckpointError,
                     match="checkpoint at 1234 samples .*cannot be restored"):
    trainer.train_and_evaluate(digits_config(), str(workdir))
  other = tmp_path / "other"
  (other / "checkpoints" / "copied-by-hand").mkdir(parents=True)
  with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
    trainer.train_and_evaluate(digits_config(), str(other))


def test_incompatible_checkpoint_names_the_differing_settings(tmp_path):
  workdir = str(tmp_path / "run")
  trainer.train_and_evaluate(digits_config(), workdir)
  other = digits_config()
  other.model_kwargs = {"hidden": (20, 12), "layers_per_stage": 1}
  with pytest.raises(checkpoint.CheckpointError, match="different model_kwargs") as raised:
    trainer.train_and_evaluate(other, workdir)
  # Python literals, not the YAML that ml_collections prints for a section.
  assert ("model_kwargs={'hidden': (16, 12), 'layers_per_stage': 1}; this run: "
          "model_kwargs={'hidden': (20, 12), 'layers_per_stage': 1})") in str(raised.value)


def test_missing_data_says_how_to_install_it(tmp_path):
  config = digits_config(dataset="fashion_mnist_idx", data_dir=str(tmp_path / "nowhere"))
  with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
    trainer.train_and_evaluate(config, str(tmp_path / "run"))


def test_unknown_method_lists_the_known_ones(tmp_path):
  with pytest.raises(config_checks.ConfigError, match="Known methods: dcasgd, muon, "
                     "nesterov_asyncpp, nesterov_asyncpp_released, pb"):
    trainer.train_and_evaluate(digits_config(method="pb_fast"), str(tmp_path / "run"))


def test_batchnorm_at_micro_batch_one_is_refused(tmp_path):
  config = digits_config(model="small_cnn")
  config.model_kwargs = {"widths": (4,), "dense": (8,), "normalization": "batch"}
  with pytest.raises(ModelError, match="(?i)batch.?norm.*(batch size 1|micro-batch)"):
    trainer.train_and_evaluate(config, str(tmp_path / "run"))


def test_training_writes_metrics_plots_and_summary(tmp_path):
  workdir = tmp_path / "run"
  summary = trainer.train_and_evaluate(digits_config(plot_curves=True), str(workdir))
  assert summary["samples"] == 240 and summary["stopped_by"] is None
  records = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
  assert {r["split"] for r in records} == {"train", "test"}
  assert records[-1]["split"] == "test" and records[-1]["accuracy"] == summary["test_accuracy"]
  assert (workdir / "curves.png").stat().st_size > 1000
  assert any(name.startswith("events") for name in os.listdir(workdir / "tensorboard"))
  assert json.load(open(workdir / "summary.json"))["test_accuracy"] == summary["test_accuracy"]


def test_a_run_without_curves_writes_everything_else(finished):
  workdir, summary = finished  # digits_config(): plot_curves=False
  assert not os.path.exists(os.path.join(workdir, "curves.png"))
  assert json.load(open(os.path.join(workdir, "summary.json")))["samples"] == summary["samples"]
  assert os.path.getsize(os.path.join(workdir, "metrics.jsonl")) > 0


@pytest.mark.parametrize("config_name", ["cifar10_resnet20", "cifar10_vgg", "imagenet_resnet50"])
def test_tiny_configs_train_on_mock_data(tmp_path, config_name):
  tfds = pytest.importorskip("tensorflow_datasets")
  config = load_config(config_name, "tiny")
  # 24 examples: enough for every stage of the deepest tiny split (8) to take two updates.
  with tfds.testing.mock_data(num_examples=24, policy=tfds.testing.MockPolicy.USE_CODE):
    summary = trainer.train_and_evaluate(config, str(tmp_path / config_name))
  assert summary["samples"] == 24 and summary["stopped_by"] is None
  assert 0.0 <= summary["test_accuracy"] <= 1.0
  assert np.isfinite(summary["test_loss"])


@pytest.mark.parametrize("config_name", ["default", "mnist1d", "cifar10_resnet20", "cifar10_vgg",
                                         "imagenet_resnet50"])
def test_every_config_has_a_smoke_variant_and_a_command(config_name):
  config = load_config(config_name, "smoke")
  plan_lib.resolve(config)
  assert config.max_train_examples and config.epochs <= 1
  assert f"--config=configs/{config_name}.py" in config_module(config_name).__doc__
  with pytest.raises(ValueError, match="Unknown config argument"):
    load_config(config_name, "warp")


@pytest.mark.slow
def test_mesh_run_of_the_binary_equals_the_single_device_run(tmp_path):
  """--config.mesh.stage=2 on two (forced CPU) devices trains to the same numbers as one device."""
  config = digits_config()
  single = trainer.train_and_evaluate(config, str(tmp_path / "single"))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
       "--config=" + os.path.join(ROOT, "configs", "default.py") + ":smoke",
       f"--workdir={tmp_path / 'mesh'}", "--config.dataset=digits",
       "--config.max_train_examples=0", "--config.max_test_examples=0",
       "--config.model_kwargs.hidden=(16,12)", f"--config.epochs={240 / 1437!r}",
       f"--config.warmup_epochs={40 / 1437!r}", "--config.ticks_per_chunk=40",
       "--config.eval_every_samples=80", "--config.checkpoint_every_samples=40",
       "--config.eval_batch_size=128", "--config.plot_curves=False", "--config.mesh.stage=2"],
      capture_output=True, text=True, env=env, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Mesh data=1 x stage=2" in result.stderr
  mesh = json.load(open(tmp_path / "mesh" / "summary.json"))
  assert mesh["samples"] == single["samples"]
  assert mesh["test_accuracy"] == pytest.approx(single["test_accuracy"], abs=1e-9)
  assert mesh["test_loss"] == pytest.approx(single["test_loss"], rel=1e-5)


# ------------------------------------------------------------------ chunks never change the recipe


def test_the_chunk_length_changes_neither_the_run_length_nor_the_schedule(tmp_path):
  # 240 samples: 6 chunks of 40 ticks, or 3 of 70 and a last one of 30, or one of all 240.
  results = {}
  for ticks in (40, 70, 10 ** 9):
    workdir = str(tmp_path / f"chunk{ticks}")
    summary = trainer.train_and_evaluate(digits_config(ticks_per_chunk=ticks), workdir)
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    train = [r for r in records if r["split"] == "train"]
    saver = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    results[ticks] = {"samples": summary["samples"], "last record": train[-1]["samples"],
                      "position": saver.restore_meta(saver.latest_samples())["data_position"],
                      "final rate": train[-1]["learning_rate"], "test loss": summary["test_loss"]}
  assert results[40]["samples"] == 240 and results[40]["final rate"] == 0.0
  for ticks in (70, 10 ** 9):
    # The same ticks at the same rates; XLA compiles scans of other lengths differently, so the
    # weights agree to rounding, not bit for bit (ticks_per_chunk is fixed for a run's resumes).
    assert results[ticks]["test loss"] == pytest.approx(results[40]["test loss"], rel=1e-5)
    assert {k: v for k, v in results[ticks].items() if k != "test loss"} == \
        {k: v for k, v in results[40].items() if k != "test loss"}


def test_a_chunk_too_large_for_memory_is_refused_with_its_estimate(tmp_path, monkeypatch):
  monkeypatch.setattr(run_checks, "CHUNK_MEMORY_SHARE", 1e-9)  # any chunk is too large
  with pytest.raises(config_checks.ConfigError, match=r"A chunk of 240 ticks .* needs about "
                     r"[\d.]+ MiB .* Lower --config.ticks_per_chunk to 1 or less"):
    trainer.train_and_evaluate(digits_config(ticks_per_chunk=10 ** 9), str(tmp_path / "run"))


def test_a_state_too_large_for_memory_is_refused_before_compiling(tmp_path, monkeypatch):
  monkeypatch.setattr(run_checks, "_memory_available",
                      lambda: (2 ** 20, "this machine's memory"))
  config = digits_config()
  config.model = "residual_mlp"
  config.model_kwargs = {"depth": 40, "width": 64}
  with pytest.raises(config_checks.ConfigError, match=r"pipeline state of this config needs about "
                     r"[\d.]+ MiB per device .* delay lines of 40 stages"):
    trainer.train_and_evaluate(config, str(tmp_path / "run"))


def test_a_warm_up_longer_than_the_run_is_refused():
  with pytest.raises(config_checks.ConfigError,
                     match=r"warmup_epochs \(5.0\) is longer than the run"):
    plan_lib.resolve(digits_config(warmup_epochs=5.0, epochs=1.0))
  with pytest.raises(config_checks.ConfigError,
                     match=r"warmup_epochs \(5.0\) is longer than the run"):
    plan_lib.resolve(digits_config(warmup_epochs=5.0, epochs=1.0, schedule="constant"))


def test_a_constant_schedule_warms_up_as_configured():
  recipe = plan_lib.resolve(digits_config(schedule="constant", warmup_epochs=0.0)).recipe
  rates = {}
  for warmup in (0.0, 0.5):
    config = digits_config(schedule="constant", warmup_epochs=warmup, epochs=1.0)
    schedule = experiment.learning_rate_schedule(plan_lib.resolve(config), 100)
    rates[warmup] = [float(schedule(step)) for step in (0, 25, 50, 99)]
  lr = recipe.learning_rate
  assert rates[0.0] == pytest.approx([lr] * 4)
  assert rates[0.5] == pytest.approx([0.0, lr / 2, lr, lr])


def test_a_field_the_run_would_not_read_is_refused():
  """One place decides what a run reads (config_checks.unread_fields): only Adam has b2. (A
  method's own hyperparameters are in its section of method_kwargs, read by it alone.)"""
  with pytest.raises(config_checks.ConfigError,
                     match=re.escape("reference.b2=0.9 would be ignored: only optimizer 'adam'")):
    plan_lib.resolve(digits_config(**{"reference.b2": 0.9}))
  plan_lib.resolve(digits_config(**{"reference.b2": 0.9}, optimizer="adam"))


@pytest.mark.parametrize("key, value", [("mesh.partition", ((0, 3),)),
                                        ("mesh.balance", "measured")])
def test_a_mesh_field_without_stage_devices_to_split_over_is_refused(key, value):
  """On one stage device the sharded runner is never built (mesh.stage = mesh.data = 1) or has
  nothing to split: a partition or a balance would be recorded and ignored."""
  with pytest.raises(config_checks.ConfigError,
                     match=re.escape(f"config.{key}={value!r} would be ignored: only a mesh of "
                                     "several stage devices")):
    plan_lib.resolve(digits_config(**{key: value}))
  plan_lib.resolve(digits_config(**{key: value, "mesh.stage": 2}))


def test_an_option_the_data_set_does_not_take_is_one_paragraph(tmp_path):
  config = digits_config()
  config.data_kwargs = {"contxt": 32}
  with pytest.raises(DataError, match=r"^Data set 'digits' takes no option 'contxt' \(.*"
                     r"config\.data_kwargs\)"):
    trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_method_kwargs_reach_the_method_and_a_key_it_lacks_is_refused():
  config = digits_config(method="pb_sc_lwp")
  config.method_kwargs = {"pb_sc_lwp": {"horizon": 3}, "pipemare": {"anneal_epochs": 0.5}}
  # A section for another method is checked, not read.
  assert plan_lib.resolve(config).hyperparameters.horizon == 3
  for sections, message in [
      # eps is read by Adam alone: under SGD it is not settable.
      ({"pb_sc_lwp": {"gamma": 0.5}}, "method 'pb_sc_lwp' has no hyperparameter 'gamma', so "
       "nothing would read it. Its settable hyperparameters are: horizon."),
      ({"pb_sc_lwp": {"momentum": 0.5}}, "use --config.reference.momentum (or "),
      ({"pb_sc_lwp": {"horizon": -2}}, "horizon must be an int >= 0"),
      ({"pipemare": {"gamma": 1.5}}, "config.method_kwargs.pipemare: make_method: gamma must be "
       "in [0, 1)"),
      ({"pb_fast": {"horizon": 1}}, "config.method_kwargs.pb_fast: there is no method 'pb_fast'")]:
    config.method_kwargs = sections
    with pytest.raises(config_checks.ConfigError, match=re.escape(message)):
      plan_lib.resolve(config)


def test_an_empty_workdir_restores_nothing_and_times_the_evaluation_as_its_own_phase(
    tmp_path, monkeypatch):
  """A fresh run reads no checkpoint, and the initial test evaluation (which compiles the whole
  network's forward) is logged as itself, not as "looking for a checkpoint"."""
  from pipejax.train import evaluation  # pylint: disable=import-outside-toplevel
  phases, phase_of_evaluations = [], []
  enter = interruption.SetupPhases.enter

  def recording_enter(self, phase):
    phases.append(phase)
    return enter(self, phase)

  make_evaluator = evaluation.make_evaluator

  def recording_evaluator(*args, **kwargs):
    evaluate = make_evaluator(*args, **kwargs)
    def evaluate_and_record(*a, **k):
      phase_of_evaluations.append(phases[-1])
      return evaluate(*a, **k)
    return evaluate_and_record

  def no_restore(*args, **kwargs):
    raise AssertionError("an empty workdir has no checkpoint to restore")

  monkeypatch.setattr(interruption.SetupPhases, "enter", recording_enter)
  monkeypatch.setattr(evaluation, "make_evaluator", recording_evaluator)
  monkeypatch.setattr(checkpoint.Checkpointer, "restore", no_restore)
  monkeypatch.setattr(checkpoint.Checkpointer, "restore_meta", no_restore)
  trainer.train_and_evaluate(digits_config(), str(tmp_path / "run"))
  looking = next(p for p in phases if "checkpoint" in p)
  assert phases[phases.index(looking) + 1] == "evaluating the initial weights on the test split"
  assert phase_of_evaluations[0] == "evaluating the initial weights on the test split"


# ------------------------------------------------------------------ the data and the model's values


def test_an_empty_test_split_is_refused_before_training(tmp_path, monkeypatch):
  from pipejax import data  # pylint: disable=import-outside-toplevel
  load = data.load

  def without_test_examples(*args, **kwargs):
    train, test = load(*args, **kwargs)
    empty = data.ArraySource(np.zeros((0, 8, 8, 1), np.uint8), np.zeros((0,), np.int64),
                             test.num_classes, "empty", normalization=test.normalization)
    return train, empty

  monkeypatch.setattr(data, "load", without_test_examples)
  with pytest.raises(config_checks.ConfigError,
                     match="The test split of data set 'digits' is empty"):
    trainer.train_and_evaluate(digits_config(), str(tmp_path / "run"))
  assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"depth": 8.5}, r"config.model_kwargs.depth must be an integer .* got 8.5"),
    ({"depth": "abc"}, r"config.model_kwargs.depth must be an integer .* got 'abc'"),
    ({"width": 1e9}, r"config.model_kwargs.width must be an integer .* got 1000000000.0"),
])
def test_model_keywords_of_the_wrong_type_are_named(kwargs, message):
  config = digits_config()
  config.model = "residual_mlp"
  config.model_kwargs = {"depth": 4, **kwargs}
  with pytest.raises(config_checks.ConfigError, match=message):
    plan_lib.resolve(config)


@pytest.mark.parametrize("change, error, message", [
    ({"dataset": "fashion_mnist_idz"}, config_checks.ConfigError, "not a known data set"),
    ({"model": "residual_mlp", "model_kwargs": {"depth": 1}}, ModelError, "depth >= 3"),
    ({"model": "residual_mlp", "model_kwargs": {"depth": 2}}, ModelError, "depth >= 3"),
    ({"model_kwargs": {"hiden": (16,)}}, ModelError, "Did you mean 'hidden' for 'hiden'"),
    # Refused only once the data's size, the devices or the model's shapes are known.
    ({"epochs": 1 / 1437, "warmup_epochs": 0.0}, config_checks.ConfigError,
     "too short to train every stage"),
    ({"mesh.stage": 16}, MeshError, "needs 16 devices"),
    ({"model_kwargs": {"hidden": (16.0, 12)}}, config_checks.ConfigError,
     re.escape("config.model_kwargs.hidden must be a tuple of integers")),
])
def test_config_errors_never_create_the_workdir(tmp_path, change, error, message):
  config = digits_config(**change)
  with pytest.raises(error, match=message):
    trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------- the binary: messages and signals


def _train_command(workdir, *overrides, config="default.py:smoke"):
  return [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
          f"--config={os.path.join(ROOT, 'configs', config)}", f"--workdir={workdir}", *overrides]


@pytest.mark.slow
@pytest.mark.parametrize("value", ["8.5", "abc", "1e9"])
def test_bad_model_keyword_values_are_one_line_and_logged_in_the_command_line(tmp_path, value):
  key = "width" if value == "1e9" else "depth"
  result = subprocess.run(
      _train_command(tmp_path / "run", f"--config.model_kwargs.{key}={value}",
                     config="deep_mlp.py:smoke"),
      capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
  assert result.returncode in (1, 2), result.stderr[-2000:]
  assert "Traceback" not in result.stderr
  (error,) = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert f"config.model_kwargs.{key} must be an integer" in error
  # The run's first line reproduces it, the model's keywords included.
  first = result.stderr.splitlines()[0]
  assert "pipejax training: " in first and f"--config.model_kwargs.{key}={value}" in first
  assert not (tmp_path / "run").exists()


# A line the binary logs in each phase, and the signal sent when it appears.
_PHASES = [("pipejax training:", signal.SIGINT), ("Set-up (", signal.SIGTERM),
           ("initialising the pipeline state", signal.SIGINT),
           ("compiling the chunk", signal.SIGTERM), ("compiling the chunk", signal.SIGINT)]


@pytest.mark.slow
@pytest.mark.parametrize("line, sig", _PHASES)
def test_a_signal_in_any_phase_of_set_up_exits_75_with_a_message(tmp_path, line, sig):
  process = subprocess.Popen(_train_command(tmp_path / "run"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             env=dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1"),
                             preexec_fn=as_from_a_terminal)
  seen = []
  for text in process.stdout:
    seen.append(text)
    if line in text:
      process.send_signal(sig)
      break
  rest, _ = process.communicate(timeout=300)
  output = "".join(seen) + rest
  assert process.returncode == 75, output[-3000:]
  assert f"STOPPED by {signal.Signals(sig).name}" in output, output[-3000:]
  assert "Traceback" not in output and "Fatal Python error" not in output, output[-3000:]


def test_a_chunk_inside_the_fill_says_so_instead_of_a_loss_of_nan(tmp_path, caplog):
  caplog.set_level(logging.INFO)
  # 2 ticks a chunk: the first chunk ends before any sample reaches the loss (4 stages).
  trainer.train_and_evaluate(digits_config(ticks_per_chunk=2, epochs=8 / 1437,
                                           warmup_epochs=2 / 1437, eval_every_samples=8,
                                           checkpoint_every_samples=8), str(tmp_path / "run"))
  progress = [r.getMessage() for r in caplog.records if "samples, epoch" in r.getMessage()]
  assert "filling the pipeline: no sample has reached the loss yet" in progress[0], progress
  assert re.search(r"\] loss \d+\.\d{4}, accuracy", progress[-1]), progress
  assert not any("nan" in line for line in progress), progress


def test_a_long_set_up_says_what_it_is_still_doing(tmp_path, monkeypatch, caplog):
  caplog.set_level(logging.INFO)
  monkeypatch.setattr(interruption, "SETUP_REPORT_EVERY", 0.2)
  build = experiment.build

  def slow_build(plan):  # a deep model builds for minutes
    time.sleep(1.0)
    return build(plan)

  monkeypatch.setattr(experiment, "build", slow_build)
  trainer.train_and_evaluate(digits_config(), str(tmp_path / "run"))
  lines = [r.getMessage() for r in caplog.records]
  assert any(re.match(r"Set-up \(\d+ s\): still loading the data and building the model\.", line)
             for line in lines)
  assert any("Pipeline state: " in line and "per device" in line for line in lines)
