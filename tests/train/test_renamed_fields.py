"""The fields one method alone read, now its hyperparameters in ``config.method_kwargs``.

Each old name (``pipejax.config.RENAMED_FIELDS``) is refused in a new config with its new key,
and still read where it was saved: a checkpoint's config and fingerprint, a run's config.json.
"""

import os
import re
import types

import jax
import pytest

from pipejax.train import plan as plan_lib
from pipejax import config as config_lib
from pipejax.train import config_checks, experiment, resume
from tests.helpers import ROOT, digits_config

OLD_TO_NEW = {"micro_batches": "method_kwargs.sync.micro_batches",
              "pipemare_anneal_epochs": "method_kwargs.pipemare.anneal_epochs",
              "pipemare_anneal_fraction": "method_kwargs.pipemare.anneal_fraction",
              "sgd_stage_rates": "method_kwargs.sgd.stage_rates"}


def test_the_new_keys_reach_the_method():
  sync = plan_lib.resolve(digits_config(method="sync",
                                        method_kwargs={"sync": {"micro_batches": 4}}))
  assert sync.micro_batches_per_update == 4 and sync.micro_batches_per_flush == 4
  assert sync.hyperparameters.micro_batches == 4
  assert experiment.run_ticks(sync, 1437) % 4 == 0
  # One step sees 4 micro-batches: the recipe is converted to batch 4, not 1.
  assert sync.recipe.batch_size == 4
  pipemare = plan_lib.resolve(digits_config(
      method="pipemare", method_kwargs={"pipemare": {"anneal_fraction": 0.5}}))
  steps, _ = experiment.optimizer_steps(pipemare, 1437)
  assert experiment.annealing_steps(pipemare, 1437) == round(0.5 * steps)
  sgd = plan_lib.resolve(digits_config(method="sgd",
                                       method_kwargs={"sgd": {"stage_rates": "pipemare"}}))
  # The one-stage baseline with each layer at PipeMare's rate for its stage of the 3-stage split
  # (delays 4, 2, 0): one optimizer state per delay.
  (stage,) = experiment.build(sgd).pipeline.init(jax.random.PRNGKey(0)).stages
  inner = [s for s in jax.tree.leaves(stage.opt_state, is_leaf=lambda s: hasattr(s, "inner_states"))
           if hasattr(s, "inner_states")]
  assert len(inner) == 1 and sorted(inner[0].inner_states) == ["0", "2", "4"]


@pytest.mark.parametrize("old", sorted(OLD_TO_NEW))
def test_an_old_key_in_a_new_config_is_refused_naming_the_new_one(old, tmp_path):
  new = OLD_TO_NEW[old]
  value = {"micro_batches": 4, "sgd_stage_rates": "pipemare"}.get(old, 0.5)
  config = digits_config()
  config[old] = value
  with pytest.raises(config_checks.ConfigError,
                     match=rf"^config\.{old} is no longer a field of the training config: .* "
                     rf"set as config\.{re.escape(new)}, in the method's section"):
    plan_lib.resolve(config)
  # A config file, then the command line.
  path = tmp_path / "old.py"
  path.write_text("from pipejax.config import base_config\n\n\ndef get_config(arg=None):\n"
                  f"  config = base_config()\n  config.{old} = {value!r}\n  return config\n")
  with pytest.raises(config_lib.ConfigFileError,
                     match=rf"config\.{old} is no longer a field of .*old\.py: .* set as "
                     rf"config\.{re.escape(new)},"):
    config_lib.load_config(str(path))
  message = config_lib.describe_config_error(
      AttributeError(old), [f"--config={os.path.join(ROOT, 'configs', 'default.py')}",
                            f"--config.{old}={value}"])
  assert message.startswith(f"--config.{old} is no longer a field")
  assert f"set as --config.{new}," in message and "\n" not in message


class _Checkpointer:
  directory = "/tmp/run/checkpoints"


def _saved(config, **old_fields) -> dict:
  """What a checkpoint written before the renaming holds: the config with the old flat fields
  (every one, at its default unless given) and a fingerprint naming micro_batches."""
  plan = plan_lib.resolve(config)
  flat = dict(plan.given)
  flat.update({old: default for old, (_, default) in config_lib.RENAMED_FIELDS.items()})
  flat.update(old_fields)
  fingerprint = dict(plan.given_fingerprint)
  fingerprint["micro_batches"] = flat["micro_batches"]
  return {"config": flat, "fingerprint": fingerprint}


def test_an_old_workdir_resumes_with_its_fields_under_their_new_keys():
  sync = digits_config(method="sync", ticks_per_chunk=80,
                       method_kwargs={"sync": {"micro_batches": 4}})
  resume.check_resumable(plan_lib.resolve(sync), _Checkpointer(), 80,
                         _saved(sync, micro_batches=4))
  pipemare = digits_config(method="pipemare",
                           method_kwargs={"pipemare": {"anneal_fraction": 0.1}})
  meta = _saved(pipemare, pipemare_anneal_fraction=0.1)
  resume.check_resumable(plan_lib.resolve(pipemare), _Checkpointer(), 80, meta)
  assert resume.recipe_changes(plan_lib.resolve(pipemare), meta["config"]) == ""
  # The old fields at their defaults, under any method: nothing was set.
  plain = digits_config(method="pb")
  resume.check_resumable(plan_lib.resolve(plain), _Checkpointer(), 80, _saved(plain))


def test_an_old_workdir_resumed_with_another_value_of_a_renamed_field_is_refused():
  sync = digits_config(method="sync", ticks_per_chunk=80,
                       method_kwargs={"sync": {"micro_batches": 4}})
  with pytest.raises(Exception, match=r"different micro_batches \(micro_batches=2; this run: "
                     r"micro_batches=4\)"):
    resume.check_resumable(plan_lib.resolve(sync), _Checkpointer(), 80,
                           _saved(sync, micro_batches=2))
  pipemare = digits_config(method="pipemare")
  with pytest.raises(config_checks.ConfigError,
                     match=r"method_kwargs\.pipemare\.anneal_fraction 0\.1 -> \(not set\)"):
    resume.check_resumable(plan_lib.resolve(pipemare), _Checkpointer(), 80,
                                  _saved(pipemare, pipemare_anneal_fraction=0.1))


def test_a_method_hyperparameter_added_on_resume_is_a_change_of_recipe():
  before = digits_config(method="pb_sc_lwp")
  after = digits_config(method="pb_sc_lwp", method_kwargs={"pb_sc_lwp": {"horizon": 2}})
  with pytest.raises(config_checks.ConfigError,
                     match=r"method_kwargs\.pb_sc_lwp\.horizon \(not set\) -> 2"):
    resume.check_resumable(plan_lib.resolve(after), _Checkpointer(), 80,
                                  {"config": dict(plan_lib.resolve(before).given),
                                   "fingerprint": dict(plan_lib.resolve(before).given_fingerprint)})


def test_a_translated_record_keeps_an_explicit_new_key():
  flat = {"method": "pipemare", "pipemare_anneal_epochs": 0.0, "seed": 1}
  assert list(config_lib.current_keys(flat)) == ["method", "method_kwargs.pipemare.anneal_epochs",
                                                 "seed"]
  both = {"pipemare_anneal_epochs": 0.0, "method_kwargs.pipemare.anneal_epochs": 2.0}
  assert config_lib.current_keys(both) == {"method_kwargs.pipemare.anneal_epochs": 2.0}
  # A whole saved config: under its own method's section, and nothing at the old defaults.
  saved = {"method": "nesterov_asyncpp", "pipemare_anneal_epochs": 0.5, "micro_batches": 1}
  assert config_lib.current_keys(saved, method="nesterov_asyncpp") == {
      "method": "nesterov_asyncpp", "method_kwargs.nesterov_asyncpp.anneal_epochs": 0.5}
