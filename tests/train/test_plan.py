"""A run's plan: resolved once, read by everything downstream, and the settings a run reads."""

import dataclasses
import json
import os
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipejax import methods
from pipejax import models
from pipejax.parallel import stacking
from pipejax.study import preflight
from pipejax.study import spec as study_lib
from pipejax.train import checkpoint, config_checks, experiment, resume, trainer
from pipejax.train import plan as plan_lib
from pipejax.train.config_checks import ANNEALING_KEYS, TRAINER_SET, ConfigError
from tests.helpers import ROOT, digits_config


class _Checkpointer:
  directory = "/tmp/run/checkpoints"


def test_a_run_checks_its_config_once_and_builds_its_model_once_to_check_it(tmp_path,
                                                                            monkeypatch):
  counts = {"check_fields": 0, "build": 0}
  check_fields, build = config_checks.check_fields, models.build

  def counting(name, function):
    def counted(*args, **kwargs):
      counts[name] += 1
      return function(*args, **kwargs)
    return counted

  monkeypatch.setattr(config_checks, "check_fields", counting("check_fields", check_fields))
  monkeypatch.setattr(models, "build", counting("build", build))
  # Refused once the model is built (the run is too short to fill 3 stages): nothing trains.
  with pytest.raises(ConfigError, match="too short to train every stage"):
    trainer.train_and_evaluate(digits_config(max_train_examples=2), str(tmp_path / "run"))
  # Once to check the model's keywords, once with the data's classes.
  assert counts == {"check_fields": 1, "build": 2}


def test_the_plan_is_frozen_and_says_what_the_run_reads():
  plan = plan_lib.resolve(digits_config(method="sync", ticks_per_chunk=80,
                                        method_kwargs={"sync": {"micro_batches": 4}}))
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.seed = 1  # pytype: disable=not-writable
  assert (plan.micro_batches_per_update, plan.micro_batches_per_flush) == (4, 4)
  assert plan.model.num_stages == 3 and plan.recipe.batch_size == 4
  planned = plan.to_json()
  assert planned["hyperparameters"] == {"micro_batches": 4}  # eps: SGD reads none
  assert planned["model"]["kwargs"] == {"hidden": [16, 12], "layers_per_stage": 1}
  asynchronous = plan_lib.resolve(digits_config(method="pb"))
  assert (asynchronous.micro_batches_per_update, asynchronous.micro_batches_per_flush) == (1, None)


def test_a_config_file_with_a_studys_settings_resolves_as_its_trainer_did():
  # The settings as results.jsonl holds them: JSON values, a list for a tuple, a new keyword.
  plan = plan_lib.resolve_file(os.path.join(ROOT, "configs", "deep_mlp.py"), {
      "method": "sync", "method_kwargs.sync.micro_batches": 4, "optimizer": "adam",
      "model_kwargs.depth": 6, "mesh.partition": [], "seed": 3})
  assert (plan.method, plan.optimizer, plan.recipe.form) == ("sync", "adam", "ema")
  assert (plan.micro_batches_per_update, plan.model.kwargs["depth"], plan.seed) == (4, 6, 3)
  assert plan.mesh.partition == ()
  with pytest.raises(ValueError, match="'mesh.stages' is not a field of the config"):
    plan_lib.resolve_file(os.path.join(ROOT, "configs", "deep_mlp.py"), {"mesh.stages": 2})


def test_an_epsilon_the_method_does_not_read_is_refused():
  """SGD's form reads no eps: accepted, the run would train bit for bit as without it."""
  for method in ("sgd", "pb", "pb_sc_lwp"):
    config = digits_config(method=method, method_kwargs={method: {"eps": 1e-3}})
    with pytest.raises(ConfigError, match=rf"method_kwargs\.{method}\.eps=0\.001: method "
                       rf"'{method}' with optimizer 'sgd' reads no eps: only optimizer 'adam' "
                       "has an epsilon, so nothing would read it"):
      plan_lib.resolve(config)
  adam = plan_lib.resolve(digits_config(method="pb", optimizer="adam",
                                        method_kwargs={"pb": {"eps": 1e-3}}))
  assert adam.hyperparameters.eps == 1e-3 and adam.to_json()["hyperparameters"]["eps"] == 1e-3


def test_an_annealing_length_the_baseline_does_not_read_is_refused():
  with pytest.raises(ConfigError, match=r"method_kwargs\.sgd\.anneal_epochs=0\.5: method 'sgd' "
                     "reads no annealing length without stage_rates"):
    plan_lib.resolve(digits_config(method="sgd", method_kwargs={"sgd": {"anneal_epochs": 0.5}}))
  plan_lib.resolve(digits_config(method="sgd", method_kwargs={
      "sgd": {"anneal_epochs": 0.5, "stage_rates": "pipemare"}}))


def test_a_command_line_section_for_another_method_is_refused():
  config = digits_config(method="pb", method_kwargs={"sgd": {"stage_rates": "pipemare"}})
  plan_lib.resolve(config)  # from a config file: the recipe of a method a study switches to
  with pytest.raises(ConfigError, match=r"--config\.method_kwargs\.sgd\.stage_rates sets a "
                     r"hyperparameter of method 'sgd', but this run trains method 'pb'"):
    plan_lib.resolve(config, overridden=["seed", "method_kwargs.sgd.stage_rates"])
  plan_lib.resolve(digits_config(method="sgd", method_kwargs={"sgd": {"stage_rates": "pipemare"}}),
                   overridden=["method_kwargs.sgd.stage_rates"])


def test_a_study_grid_that_crosses_a_methods_key_with_other_methods_is_refused():
  crossed = study_lib.Study(name="crossed", config="configs/default.py:smoke", grids=[
      {"method": ("pb", "sgd"), "method_kwargs.sgd.stage_rates": ("", "pipemare")}])
  with pytest.raises(study_lib.StudyError, match=r"trains method 'pb' and sets "
                     r"method_kwargs\.sgd\.stage_rates=.*would be trained once per value"):
    preflight.check_method_sections(crossed, "pb_sc_lwp")
  preflight.check_method_sections(study_lib.Study(
      name="apart", config="configs/default.py:smoke",
      grids=[{"method": ("pb",)}, {"method": ("sgd",),
                                   "method_kwargs.sgd.stage_rates": ("", "pipemare")}]), "pb")
  # A fixed key of another method's section reaches that method's trainers alone.
  fixed = study_lib.Study(name="fixed", config="configs/default.py:smoke",
                          grids=[{"method": ("pb", "pipemare")}],
                          fixed={"method_kwargs.pipemare.anneal_fraction": 0.1})
  assert study_lib.trainer_flags(fixed, {"method": "pb"}) == ["--config.method=pb"]
  assert "--config.method_kwargs.pipemare.anneal_fraction=0.1" in study_lib.trainer_flags(
      fixed, {"method": "pipemare"})


@pytest.mark.parametrize("change", ["another_method", "explicit_default"])
def test_a_resume_with_changes_nothing_reads_continues(change):
  before = digits_config(method="pb_sc_lwp")
  after = digits_config(method="pb_sc_lwp", method_kwargs={
      "another_method": {"pipemare": {"anneal_epochs": 0.5}},
      "explicit_default": {"pb_sc_lwp": {"horizon": None}}}[change])
  saved = resume.meta(plan_lib.resolve(before))
  resume.check_resumable(plan_lib.resolve(after), _Checkpointer(), 80, saved)
  read = digits_config(method="pb_sc_lwp", method_kwargs={"pb_sc_lwp": {"horizon": 2}})
  with pytest.raises(ConfigError, match=r"method_kwargs\.pb_sc_lwp\.horizon \(not set\) -> 2.*"
                     "would mix two experiments"):
    resume.check_resumable(plan_lib.resolve(read), _Checkpointer(), 80, saved)


# Values a fuzzed key is tried with: one a method's field of that name takes where it has one.
_VALUES = {"micro_batches": 2, "horizon": 2, "gamma": 0.5, "dc_strength": 0.1, "eps": 1e-4,
           "stage_rates": "pipemare", "smoothing": 0.5, "anneal_epochs": 0.5,
           "anneal_fraction": 0.1, "bogus": 1.0}


def _expected(method: str, optimizer: str, key: str, section: dict) -> str | None:
  """What resolving ``method_kwargs.METHOD = section`` must say of ``key``, from the presets'
  records alone: a fragment of the refusal, or None where the run reads it."""
  fields = methods.preset_of(method).fields()
  if key in ANNEALING_KEYS:
    if "anneal_steps" not in fields:
      return "has no hyperparameter"
    unread_anneal = method == "sgd" and not section.get("stage_rates")
    return "reads no annealing length" if unread_anneal else None
  if key in TRAINER_SET:
    return "is set by the trainer"
  if key not in fields:
    return "has no hyperparameter"
  if key == "eps" and optimizer != "adam":
    return "reads no eps"
  if key == "stage_rates" and optimizer != "sgd":
    return "needs optimizer='sgd'"
  return None


def test_method_kwargs_fuzzed_against_the_chosen_method_are_read_or_refused():
  """Seeded: a random method, base optimizer and section of method_kwargs; each key is either
  refused, naming it, or reaches the plan."""
  rng = random.Random(66)
  keys = sorted({f for r in methods.PRESETS.values() for f in r.fields()} | set(_VALUES))
  for _ in range(60):
    method = rng.choice(methods.METHODS)
    optimizer = rng.choice(methods.preset_of(method).optimizers)
    key = rng.choice(keys)
    section = {key: _VALUES.get(key, 0.5)}
    if key in ANNEALING_KEYS and method == "sgd" and optimizer == "sgd" and rng.random() < 0.5:
      section["stage_rates"] = "pipemare"
    config = digits_config(method=method, optimizer=optimizer,
                           decay_mask=optimizer == "adam", method_kwargs={method: section})
    if method in ("sync",) and key == "micro_batches":
      config.ticks_per_chunk = 80
    expected = _expected(method, optimizer, key, section)
    if expected is None:
      planned = plan_lib.resolve(config).to_json()
      where = planned["annealing"] if key in ANNEALING_KEYS else planned["hyperparameters"]
      assert where[key] == section[key], (method, optimizer, key)
    else:
      refusal = rf"method_kwargs\.{method}\b.*{re.escape(expected)}"
      with pytest.raises(ConfigError, match=refusal):
        plan_lib.resolve(config)


def test_an_sgd_update_is_bit_identical_whatever_its_epsilon():
  """The refusal's ground: momentum SGD's update does not read eps."""
  params = {"w": jnp.arange(4.0)}
  grads = {"w": jnp.array([0.5, -1.0, 2.0, 1e-9])}
  updates = []
  for eps in (1e-8, 1e-3):
    optimizer = methods.make_method("pb", learning_rate=0.1, eps=eps).optimizer(2)
    update, _ = optimizer.update(grads, optimizer.init(params), params)
    updates.append(np.asarray(jax.device_get(update["w"])))
  np.testing.assert_array_equal(updates[0], updates[1])


def test_summary_and_checkpoints_record_the_plan_the_run_read(finished):
  workdir, summary = finished
  plan = plan_lib.resolve(digits_config())
  assert summary["plan"] == plan.to_json()
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f)["plan"] == plan.to_json()
  saver = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
  assert saver.all_samples() == [160, 200, 240] and saver.latest_samples() == 240
  assert saver.restore_meta(240)["plan"] == plan.to_json()
  with pytest.warns(DeprecationWarning, match="renamed latest_samples"):
    assert saver.latest_step() == 240


def test_the_flush_and_the_micro_batches_per_update_are_two_names():
  synchronous = methods.make_method("sync", learning_rate=0.1, micro_batches=4)
  asynchronous = methods.make_method("pipedream_muon", learning_rate=1e-3, optimizer="adam",
                                     micro_batches=4)
  assert (synchronous.micro_batches_per_flush, synchronous.micro_batches_per_update) == (4, 4)
  assert (asynchronous.micro_batches_per_flush, asynchronous.micro_batches_per_update) == (None, 4)
  with pytest.warns(DeprecationWarning, match="renamed micro_batches_per_flush"):
    assert synchronous.micro_batches_per_step == 4


@pytest.mark.parametrize("stack_stages", [True, False])
def test_the_one_stage_baseline_starts_from_the_pipelined_runs_weights(stack_stages):
  """Its weights come from the split's initial state, initialised in stacks or stage by
  stage: the same digest as the pipelined run of the same seed."""
  digests = {}
  for method in ("pb", "sgd"):
    config = digits_config(method=method, model="residual_mlp", stack_stages=stack_stages,
                           model_kwargs={"depth": 5, "width": 8, "layers_per_stage": 1})
    setup = experiment.build(plan_lib.resolve(config))
    runner = setup.runner
    digests[method] = checkpoint.weights_digest(
        runner.host_params(setup.init(jax.random.PRNGKey(config.seed))))
    if method == "sgd":
      assert setup.initial_weights_from.stacked == stack_stages
  assert digests["sgd"] == digests["pb"]
