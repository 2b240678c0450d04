"""Checkpoints one can trust and runs that cannot be misconfigured (one test per failure mode).

Most tests start from one finished seconds-long run on scikit-learn's digits (trained once per
module) and copy its workdir, so each failure costs a restore and a few chunks, not a training.
"""

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from pipejax.train import plan as plan_lib
from pipejax.train import checkpoint, config_checks, divergence, experiment
from pipejax.parallel import distributed
from pipejax import methods
from pipejax.train import trainer
from pipejax import config as config_lib
from pipejax.train import metrics as metrics_lib
from pipejax.train import workdir as workdir_lib
from pipejax.core.checks import PipelineError
from pipejax.core.engine import Pipeline
from tests.helpers import (copy_of, ROOT, checkpoint_dir, config_module, digits_config,
                           flip_a_bit_in_each_data_file, make_model, make_stream, stored_digest)


@pytest.fixture
def warnings_logged(caplog):
  caplog.set_level(logging.INFO)
  return lambda: "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


# ------------------------------------------------------------------ 1. integrity digests

def test_flipped_bit_in_newest_checkpoint_falls_back_to_an_intact_one(finished, tmp_path,
                                                                      warnings_logged):
  workdir = copy_of(finished, tmp_path)
  final_digest = stored_digest(workdir, 240)
  flip_a_bit_in_each_data_file(os.path.join(checkpoint_dir(workdir), "240"))
  summary = trainer.train_and_evaluate(digits_config(), workdir)
  assert "checkpoint at 240 samples" in warnings_logged()
  assert "at 200 samples" in warnings_logged()
  assert os.path.isdir(os.path.join(checkpoint_dir(workdir) + ".damaged", "240"))
  # Retrained from step 200 to exactly the same bits as the run that was never damaged.
  assert stored_digest(workdir, 240) == final_digest
  assert summary["test_accuracy"] == finished[1]["test_accuracy"]
  assert summary["test_loss"] == finished[1]["test_loss"]


def test_digest_covers_the_data_position(finished, tmp_path):
  workdir = copy_of(finished, tmp_path)
  saver = checkpoint.Checkpointer(checkpoint_dir(workdir))
  like = experiment.build(plan_lib.resolve(digits_config())).pipeline.init(
      jax.random.PRNGKey(0))
  state, meta = saver.restore(240, like)
  meta["data_position"]["index_in_epoch"] += 1  # the same arrays, another data position
  digests = {"state_digest": stored_digest(workdir, 240)}
  assert checkpoint.state_digest(state, meta["data_position"]) != digests["state_digest"]


# ------------------------------------------------------------------ 2. unfinished writes

@pytest.mark.slow
def test_unfinished_first_checkpoint_is_removed_and_the_run_starts(finished, tmp_path,
                                                                   warnings_logged):
  workdir = tmp_path / "run"
  leftover = workdir / "checkpoints" / "40.orbax-checkpoint-tmp-1234" / "state"
  leftover.mkdir(parents=True)
  (leftover / "half-written").write_bytes(b"\0" * 100)
  summary = trainer.train_and_evaluate(digits_config(), str(workdir))
  assert "40.orbax-checkpoint-tmp-1234" in warnings_logged()
  assert not (workdir / "checkpoints" / "40.orbax-checkpoint-tmp-1234").exists()
  assert summary["test_accuracy"] == finished[1]["test_accuracy"]
  assert stored_digest(str(workdir), 240) == stored_digest(finished[0], 240)


# ------------------------------------------------------------------ 3. no non-finite checkpoint

def test_no_checkpoint_ever_holds_non_finite_weights(tmp_path):
  workdir = str(tmp_path / "run")
  # The largest finite rate: the first update makes weights inf before any activation shows it.
  config = digits_config(**{"micro_batch.lr": 3e38}, ticks_per_chunk=1, checkpoint_every_samples=1,
                         eval_every_samples=10**6)
  with pytest.raises(divergence.TrainingDiverged,
                     match=r"stage \d+ \('.*'\) \(its weights\).*after \d+ training samples.*"
                     r"last good checkpoint"):
    trainer.train_and_evaluate(config, workdir)
  saver = checkpoint.Checkpointer(checkpoint_dir(workdir))
  like = experiment.build(plan_lib.resolve(config)).pipeline.init(jax.random.PRNGKey(0))
  assert saver.all_samples()
  for step in saver.all_samples():
    state, _ = saver.restore(step, like)
    for st in state.stages:
      assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(st.params)), step


def test_divergence_message_fits_the_run(tmp_path):
  config = digits_config(**{"micro_batch.lr": 1e30}, method="pb_sc_lwp",
                         checkpoint_every_samples=10**6)
  with pytest.raises(divergence.TrainingDiverged) as raised:
    trainer.train_and_evaluate(config, str(tmp_path / "run"))
  message = str(raised.value)
  assert "No checkpoint had been written yet, so a rerun starts from the beginning" in message
  assert "resumes from it" not in message and "try a method" not in message
  assert "after 0 training samples" not in message


# ------------------------------------------------------------------ 4. changes on resume

def test_changed_recipe_on_resume_is_refused_with_old_and_new_values(finished, tmp_path):
  workdir = copy_of(finished, tmp_path)
  before = open(os.path.join(workdir, "config.json")).read()
  with pytest.raises(config_checks.ConfigError, match=r"epochs 0\.167\d* -> 0\.5; micro_batch\.lr "
                     r"None -> 0\.001.*--config.allow_changes_on_resume=True"):
    trainer.train_and_evaluate(digits_config(**{"micro_batch.lr": 0.001}, epochs=0.5), workdir)
  assert open(os.path.join(workdir, "config.json")).read() == before


@pytest.mark.slow
def test_allowed_change_on_resume_is_recorded(finished, tmp_path):
  workdir = copy_of(finished, tmp_path)
  seconds_at_240 = checkpoint.Checkpointer(checkpoint_dir(workdir)).restore_meta(240)[
      "train_seconds"]
  config = digits_config(epochs=280 / 1437, allow_changes_on_resume=True)
  summary = trainer.train_and_evaluate(config, workdir)
  assert summary["samples"] == 280
  (record,) = [json.loads(line) for line in open(os.path.join(workdir, "config_changes.jsonl"))]
  assert record["samples"] == 240 and record["changes"]["epochs"] == [240 / 1437, 280 / 1437]
  assert json.load(open(os.path.join(workdir, "config.json")))["epochs"] == 280 / 1437
  # Time adds up across sessions: the seconds of the checkpoint resumed from are part of the
  # total. (Not the first session's whole total: that also counts its time after that checkpoint.)
  assert summary["train_seconds"] > seconds_at_240 > 0


def test_rerunning_a_finished_run_reports_it_and_changes_no_file(finished, tmp_path):
  workdir = copy_of(finished, tmp_path)

  def snapshot():
    return {os.path.relpath(os.path.join(root, name), workdir):
            open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(workdir) for name in names if name != ".lock"}

  before = snapshot()
  summary = trainer.train_and_evaluate(digits_config(), workdir)
  assert snapshot() == before
  assert summary == finished[1]
  assert summary["best_test_accuracy"] >= summary["test_accuracy"]
  assert set(summary["versions"]) == {"pipejax", "jax", "jaxlib"} and summary["device"]


def test_a_run_killed_before_its_summary_finishes_with_one_final_test_record(finished, tmp_path):
  workdir = copy_of(finished, tmp_path)
  os.remove(os.path.join(workdir, "summary.json"))  # killed after its final evaluation
  records = metrics_lib.read_records(workdir)
  summary = trainer.train_and_evaluate(digits_config(), workdir)
  assert metrics_lib.read_records(workdir) == records  # no second final test record
  assert (summary["test_accuracy"], summary["test_loss"]) == (finished[1]["test_accuracy"],
                                                             finished[1]["test_loss"])


def test_a_sigterm_while_the_run_writes_its_last_files_lets_it_finish(tmp_path, monkeypatch):
  original = metrics_lib.plot_runs

  def plot_and_get_signalled(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # with the default handler, this would kill the run
    return original(*args, **kwargs)

  monkeypatch.setattr(metrics_lib, "plot_runs", plot_and_get_signalled)
  workdir = str(tmp_path / "run")
  summary = trainer.train_and_evaluate(digits_config(), workdir)
  assert summary["stopped_by"] is None and summary["samples"] == summary["total_samples"]
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f)["test_accuracy"] == summary["test_accuracy"]


# ------------------------------------------------------------------ 5. environment failures

def test_full_disk_while_saving_is_one_paragraph(tmp_path, monkeypatch):
  def full_disk(*args, **kwargs):
    raise ValueError('RESOURCE_EXHAUSTED: Error writing "stages.0.params" in OCDBT database: '
                     "No space left on device [os_error_code='28']")
  monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", full_disk)
  with pytest.raises(workdir_lib.StorageError, match="checkpoint at 40 samples failed: the disk "
                     ".* is full.*rerun the same command"):
    trainer.train_and_evaluate(digits_config(), str(tmp_path / "run"))


def test_workdir_that_cannot_be_written_is_refused_before_training(tmp_path, monkeypatch):
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  monkeypatch.setattr(experiment, "build", lambda config: pytest.fail("built before the check"))
  with pytest.raises(workdir_lib.StorageError, match="cannot be used"):
    trainer.train_and_evaluate(digits_config(), str(blocker / "run"))
  if os.geteuid() != 0:  # root writes anywhere
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    with pytest.raises(workdir_lib.StorageError, match="cannot be written"):
      trainer.train_and_evaluate(digits_config(), str(read_only))


def test_storage_error_recognises_permissions_and_full_disks():
  assert "full" in str(workdir_lib.storage_error("Saving", "/x", OSError(28, "No space left")))
  assert "cannot be written" in str(workdir_lib.storage_error("Saving", "/x", PermissionError(13,
                                                                                             "no")))
  assert workdir_lib.storage_error("Saving", "/x", ValueError("shape mismatch")) is None


# ------------------------------------------------------------------ 6. config validation

@pytest.mark.parametrize("key, value", [
    ("epochs", float("nan")), ("micro_batch.weight_decay", -1.0), ("reference.batch_size", 0),
    ("eval_batch_size", 0), ("warmup_epochs", -0.5), ("mesh.data", 0), ("mesh.stage", -2),
    ("mesh.balance", "nope"), ("micro_batch.lr", -0.1), ("micro_batch.lr", float("nan")),
    ("micro_batch.lr", float("inf")), ("micro_batch.lr", 0.0), ("reference.lr", 0.0),
    ("model_kwargs.hidden", (0,)), ("seed", -1), ("reference.momentum", 1.0),
])
def test_every_bad_field_is_refused_before_the_workdir_exists(tmp_path, key, value):
  config = digits_config()
  parent, _, leaf = key.rpartition(".")
  (config[parent] if parent else config)[leaf] = value
  with pytest.raises(config_checks.ConfigError, match=re.escape(f"config.{key} must be")):
    trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("micro_batches", [0, -2])
def test_sync_micro_batches_must_be_positive(micro_batches):
  with pytest.raises(config_checks.ConfigError, match=r"config\.method_kwargs\.sync: "
                     r"micro_batches must be an int >= 1 .*GPipe's M"):
    plan_lib.resolve(digits_config(method="sync",
                                   method_kwargs={"sync": {"micro_batches": micro_batches}}))


def test_only_a_synchronous_chunk_must_hold_whole_steps():
  # A synchronous chunk of 40 ticks cannot hold whole steps of 3 micro-batches with their flushes;
  # an asynchronous stage carries its partial sum of gradients over to the next chunk.
  with pytest.raises(config_checks.ConfigError, match=r"config\.ticks_per_chunk \(40\) must be a "
                     r"multiple of config\.method_kwargs\.sync\.micro_batches \(3\)"):
    plan_lib.resolve(digits_config(method="sync", ticks_per_chunk=40,
                                   method_kwargs={"sync": {"micro_batches": 3}}))
  plan_lib.resolve(digits_config(method="pipedream_muon", optimizer="adam", decay_mask=True,
                                 ticks_per_chunk=40,
                                 method_kwargs={"pipedream_muon": {"micro_batches": 3}}))


def test_one_training_example_gives_a_valid_learning_rate_schedule():
  config = digits_config(max_train_examples=1, epochs=1.0)
  # optax refuses 0 steps
  learning_rate = experiment.learning_rate_schedule(plan_lib.resolve(config), train_size=1)
  assert np.isfinite(float(learning_rate(0))) and np.isfinite(float(learning_rate(5)))


def test_the_resolved_recipe_keeps_every_decay_per_sample_and_takes_the_overrides():
  config = digits_config(optimizer="adam", micro_batch_size=2, **{
      "reference.batch_size": 128, "reference.momentum": 0.9, "reference.b2": 0.99,
      "micro_batch.weight_decay": 0.5})
  recipe = plan_lib.resolve(config).recipe
  assert recipe.batch_size == 2 and recipe.form == "ema" and recipe.weight_decay == 0.5
  np.testing.assert_allclose([recipe.momentum, recipe.b2], [0.9**(2 / 128), 0.99**(2 / 128)],
                             rtol=1e-12)


# ------------------------------------------------------------------ 7. labels and states

@pytest.fixture(scope="module")
def pipe():
  x, y = make_stream(1, 2)
  return Pipeline(make_model(), methods.make_method("pb", learning_rate=0.05), x[0], y[0])


@pytest.mark.parametrize("bad", [-1, 4, 50])
def test_labels_outside_the_classes_are_refused(pipe, bad):
  x, y = make_stream(6, 2)
  y = y.copy()
  y[3, 1] = bad
  with pytest.raises(PipelineError, match=r"\[0, 4\).*from .*{}".format(bad)):
    pipe.run(pipe.init(jax.random.PRNGKey(0)), x, y)
  with pytest.raises(PipelineError, match=r"\[0, 4\)"):
    pipe.tick(pipe.init(jax.random.PRNGKey(0)), x[3], y[3])
  pipe.run(pipe.init(jax.random.PRNGKey(0)), x, y, valid=np.arange(6) != 3)  # empty slot: ignored


def test_float_labels_are_refused():
  x, y = make_stream(3, 2)
  float_pipe = Pipeline(make_model(), methods.make_method("pb", learning_rate=0.05), x[0],
                        y[0].astype(np.float32))
  with pytest.raises(PipelineError, match="float32.*integer class indices"):
    float_pipe.run(float_pipe.init(jax.random.PRNGKey(0)), x, y.astype(np.float32))


def test_state_of_another_pipeline_and_donated_state_are_refused(pipe):
  x, y = make_stream(6, 2)  # the shapes of the label test: its compiled run is reused
  other = Pipeline(make_model((3, 3)), methods.make_method("pb", learning_rate=0.05), x[0], y[0])
  with pytest.raises(PipelineError, match="does not belong to this pipeline"):
    pipe.run(other.init(jax.random.PRNGKey(0)), x, y)
  state = pipe.init(jax.random.PRNGKey(0))
  pipe.run(state, x, y)
  with pytest.raises(PipelineError, match="donated to an earlier run"):
    pipe.run(state, x, y)


# ------------------------------------------------------------------ 8. TensorBoard

def tensorboard_events(directory):
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  for name in sorted(os.listdir(directory)):
    if not name.startswith("events."):
      continue
    data = open(os.path.join(directory, name), "rb").read()
    offset = 0
    while offset + 12 <= len(data):  # TFRecord: length u64, crc u32, payload, crc u32
      length = int.from_bytes(data[offset:offset + 8], "little")
      yield event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 16 + length


def tensorboard_steps(workdir, tag):
  return [event.step for event in tensorboard_events(os.path.join(workdir, "tensorboard"))
          for v in event.summary.value if v.tag == tag]


def test_tensorboard_has_rate_and_the_runs_settings_beside_its_result(finished):
  workdir, summary = finished
  assert tensorboard_steps(workdir, "train/samples_per_second") == [40, 80, 120, 160, 200, 240]
  assert tensorboard_steps(workdir, "train/learning_rate") == [40, 80, 120, 160, 200, 240]
  events = list(tensorboard_events(os.path.join(workdir, "tensorboard", metrics_lib.HPARAMS_RUN)))
  results = {v.tag: v.simple_value for e in events for v in e.summary.value if v.HasField(
      "simple_value")}
  assert results["hparam/test_accuracy"] == pytest.approx(summary["test_accuracy"], rel=1e-6)
  # The plugin's session-start record carries the settings, the method among them.
  plugin = b"".join(v.metadata.plugin_data.content for e in events for v in e.summary.value
                    if v.metadata.plugin_data.plugin_name == "hparams")
  assert b"method" in plugin and b"pb_sc_lwp" in plugin and b"resolved.lr" in plugin


def test_tensorboard_is_rebuilt_from_metrics_on_resume(finished, tmp_path):
  workdir = copy_of(finished, tmp_path)
  shutil.rmtree(os.path.join(workdir, "tensorboard"))  # what a SIGKILL before any flush leaves
  os.makedirs(os.path.join(workdir, "tensorboard"))
  writer = metrics_lib.MetricsWriter(workdir, resume_samples=200)
  writer.close()
  assert tensorboard_steps(workdir, "train/loss") == [40, 80, 120, 160, 200]
  # The test set at the initial weights (samples 0), then every 80 samples.
  assert tensorboard_steps(workdir, "test/accuracy") == [0, 80, 160]


@pytest.mark.slow
def test_tensorboard_is_flushed_at_every_checkpoint(tmp_path, monkeypatch):
  workdir = str(tmp_path / "run")
  seen = []
  original = checkpoint.Checkpointer.save

  def save_then_look(self, step, state, meta):
    original(self, step, state, meta)
    seen.append((step, "save"))

  def flush_then_look(self):
    original_flush(self)
    seen.append((seen[-1][0], tensorboard_steps(workdir, "train/loss")))

  original_flush = metrics_lib.MetricsWriter.flush
  monkeypatch.setattr(checkpoint.Checkpointer, "save", save_then_look)
  monkeypatch.setattr(metrics_lib.MetricsWriter, "flush", flush_then_look)
  trainer.train_and_evaluate(digits_config(epochs=80 / 1437), workdir)
  assert (40, [40]) in seen and (80, [40, 80]) in seen


# --------------------------------------------------------------- 9. one run per workdir; exit codes

def test_second_run_on_a_held_workdir_is_refused(tmp_path):
  workdir = str(tmp_path / "run")
  with workdir_lib.claim(workdir):
    with pytest.raises(workdir_lib.WorkdirBusy, match=rf"Another run \(process {os.getpid()}"):
      trainer.train_and_evaluate(digits_config(), workdir)
  with workdir_lib.claim(workdir):  # released with the first claim
    pass


@pytest.mark.slow
def test_sigterm_stops_with_a_checkpoint_and_its_own_exit_code(tmp_path, monkeypatch):
  workdir = str(tmp_path / "run")
  original = metrics_lib.MetricsWriter.write

  def write_and_get_signalled(self, split, samples, **scalars):
    original(self, split, samples, **scalars)
    if samples == 80:
      os.kill(os.getpid(), signal.SIGTERM)

  monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write_and_get_signalled)
  summary = trainer.train_and_evaluate(digits_config(), workdir)
  assert summary["stopped_by"] == "SIGTERM" and summary["samples"] == 80
  assert checkpoint.Checkpointer(checkpoint_dir(workdir)).latest_samples() == 80
  # The binary's exit code 75 for such a stop: tests/train/test_training.py's
  # test_training_resumes_exactly_after_sigterm signals scripts/train.py itself.


@pytest.mark.slow
def test_config_key_typo_is_one_line_naming_the_closest_field(tmp_path):
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
       f"--config={os.path.join(ROOT, 'configs', 'default.py')}:smoke",
       f"--workdir={tmp_path / 'run'}", "--config.methd=pb"],
      capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
  assert result.returncode == 2
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith("error: --config.methd is not a field") and "--config.method?" in line
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_unknown_config_variant_is_one_line_naming_the_known_ones(tmp_path):
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
       f"--config={os.path.join(ROOT, 'configs', 'default.py')}:smok",
       f"--workdir={tmp_path / 'run'}"],
      capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
  assert result.returncode == 2
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith("error: The config ") and "'smok'; known: smoke." in line


def test_a_bare_optimizer_key_names_both_the_recipe_and_the_micro_batch_field():
  # `--config.lr` was the per-micro-batch rate once; a user typing it means one of the two.
  message = config_lib.describe_config_error(
      AttributeError("lr"), [f"--config={os.path.join(ROOT, 'configs', 'default.py')}",
                             "--config.lr=0.1"])
  assert "--config.lr is not a field" in message
  assert "Did you mean" in message
  assert "--config.reference.lr" in message and "--config.micro_batch.lr" in message


def test_a_config_loads_by_path_as_the_trainer_loads_it_with_its_messages():
  default = os.path.join(ROOT, "configs", "default.py")
  assert config_lib.load_config(f"{default}:smoke").to_dict() == \
      config_module("default").get_config("smoke").to_dict()
  with pytest.raises(config_lib.ConfigFileError,
                     match=r"^The config '.*default\.py:smok' could not be loaded: Unknown config "
                     r"argument 'smok'; known: smoke\.$"):
    config_lib.load_config(f"{default}:smok")
  missing = os.path.join(ROOT, "configs", "nope.py")
  with pytest.raises(config_lib.ConfigFileError,
                     match=rf"^The config file '{re.escape(missing)}' does not exist\. Give a path "
                     r"such as --config=configs/default\.py"):
    config_lib.load_config(missing)


_BASE = "from pipejax.config import base_config\n"


@pytest.mark.parametrize("body, message", [
    # A typo in the file: trained at the default rate, while the same typo as a flag is refused.
    ("def get_config(arg):\n  c = base_config()\n  c.learning_rate = 0.5\n  return c\n",
     r"config\.learning_rate is not a field of .*nothing would read it.* Did you mean "
     r"config\.micro_batch\.lr or config\.reference\.lr\?"),
    ("def get_config(arg):\n  c = base_config()\n  c.reference.momentom = 0.5\n  return c\n",
     r"config\.reference\.momentom is not a field .* Did you mean config\.reference\.momentum\?"),
    ("def get_config(arg):\n  c = base_config()\n  c.mesh.stages = 2\n  return c\n",
     r"config\.mesh\.stages is not a field .* Did you mean config\.mesh\.stage\?"),
    ("def get_config(arg):\n  return {'method': 'pb'}\n",
     r"its get_config returned dict, not an ml_collections\.ConfigDict\. Build it on "
     r"pipejax\.config\.base_config\(\)"),
    ("import sys\nsys.exit(0)\n", r"could not be loaded: it called sys\.exit\(0\) while loading"),
    ("def get_config(arg):\n  raise SystemExit('bye')\n", r"it called sys\.exit\('bye'\)"),
])
def test_a_config_file_that_cannot_be_trained_as_written_is_one_paragraph(tmp_path, body, message):
  path = tmp_path / "config.py"
  path.write_text(_BASE + body)
  with pytest.raises(config_lib.ConfigFileError, match=message) as raised:
    config_lib.load_config(str(path))
  assert "\n" not in str(raised.value)


def test_the_free_form_sections_keys_are_left_to_their_readers(tmp_path):
  path = tmp_path / "config.py"
  path.write_text(_BASE + "def get_config(arg):\n  c = base_config()\n  c.model_kwargs.anything "
                  "= 1\n  c.data_kwargs = {'context': 8}\n  c.method_kwargs = {'pb': {'x': 1}}\n"
                  "  return c\n")
  assert config_lib.load_config(str(path)).data_kwargs.context == 8


def test_a_config_built_in_code_with_an_unknown_field_is_refused(tmp_path):
  config = digits_config()
  config.learning_rate = 0.5
  with pytest.raises(config_checks.ConfigError, match=r"config\.learning_rate is not a field"):
    trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_config_file_that_exits_is_exit_2_not_a_finished_run(tmp_path):
  path = tmp_path / "config.py"
  path.write_text("import sys\nsys.exit(0)\n")
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "train.py"), f"--config={path}",
       f"--workdir={tmp_path / 'run'}"],
      capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
  assert result.returncode == 2, result.stderr[-2000:]
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith("error: The config ") and "it called sys.exit(0)" in line
  assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ 10. the stop across processes

def test_stop_agreement_on_one_process_is_the_local_flag():
  assert distributed.any_process(True) is True
  assert distributed.any_process(False) is False


_AGREE = """
import sys, time
from pipejax.parallel import distributed
distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]), num_cpu_devices=1)
# Process 1 was "signalled" at its second chunk; process 0 never was.
answers = [distributed.any_process(int(sys.argv[2]) == 1 and chunk == 1) for chunk in range(3)]
print("ANSWERS", answers, flush=True)
"""


def test_a_stop_requested_on_one_process_stops_both():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  workers = [subprocess.Popen([sys.executable, "-c", _AGREE, f"localhost:{port}", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(2)]
  outputs = [w.communicate(timeout=180)[0] for w in workers]
  for output in outputs:
    assert "ANSWERS [False, True, False]" in output, output[-3000:]


@pytest.mark.parametrize("key, value", [("ticks_per_chunk", 10 ** 9), ("ticks_per_chunk", 7)])
def test_the_run_length_follows_from_the_config_alone(key, value):
  config = digits_config(**{key: value})
  assert experiment.run_ticks(plan_lib.resolve(config), 1437) * config.micro_batch_size == 240
  # The synchronous mode trains whole steps of micro-batches.
  sync = digits_config(method="sync", method_kwargs={"sync": {"micro_batches": 7}},
                       ticks_per_chunk=14)
  assert experiment.run_ticks(plan_lib.resolve(sync), 1437) == 238
