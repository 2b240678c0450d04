"""Data, workdirs and process groups that differ from what the trainer assumes.

A data set changed under a stopped run, a corpus copied with its links turned into files, an
augmentation a data set does not have, a finished run whose checkpoints were deleted, a run too
short to fill its pipeline, the language model over two processes, an evaluation batch larger
than the test split, a checkpoint directory that is a file and a disk that fills while orbax
writes. Each ends as a one-line error or as the right result.
"""

import json
import logging as std_logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from pipejax.train import plan as plan_lib
from pipejax import data
from pipejax.train import checkpoint, config_checks, evaluation, experiment, run_checks, trainer
from pipejax.train import workdir as workdir_lib
from pipejax.data import fingerprint as fingerprint_lib
from pipejax.data import text
from tests.helpers import copy_of, ROOT, digits_config, free_port


def snapshot(workdir) -> dict:
  """Every file of ``workdir`` (but its lock) and its bytes."""
  return {os.path.relpath(os.path.join(root, name), workdir):
          open(os.path.join(root, name), "rb").read()
          for root, _, names in os.walk(workdir) for name in names if name != ".lock"}


def rewind_to(workdir, step):
  """The workdir as a run stopped at checkpoint ``step`` left it (newer steps and summary gone)."""
  directory = pathlib.Path(workdir) / "checkpoints"
  for entry in directory.iterdir():
    if entry.name.isdigit() and int(entry.name) > step:
      shutil.rmtree(entry)
  os.remove(os.path.join(workdir, "summary.json"))


@pytest.fixture
def digits_with_one_pixel_changed(monkeypatch):
  """``data.load`` as the trainer calls it, with one training pixel of digits changed."""
  load = data.load

  def changed(name, **kwargs):
    train, test = load(name, **kwargs)
    images = np.array(train.images)
    images[0].flat[0] += 1
    return data.ArraySource(images, train.labels, train.num_classes, train.name,
                            normalization=train.normalization), test

  monkeypatch.setattr(data, "load", changed)


# ------------------------------------------------------------------ 1. data changed on resume

def test_a_checkpoint_records_the_data_it_was_trained_on(finished):
  meta = checkpoint.Checkpointer(os.path.join(finished[0], "checkpoints")).restore_meta(240)
  assert meta["data"]["train"]["examples"] == 1437 and meta["data"]["test"]["examples"] == 360
  train, test = data.load("digits")
  assert meta["data"] == fingerprint_lib.fingerprint(train, test)


def test_a_data_set_changed_since_the_checkpoint_is_refused_naming_it(
    finished, tmp_path, digits_with_one_pixel_changed):
  workdir = copy_of(finished, tmp_path)
  rewind_to(workdir, 160)
  before = snapshot(workdir)
  with pytest.raises(data.DataError, match=r"The data changed since the checkpoint at 160 "
                     r"samples .*the "
                     r"training split \(digits:train\): the same size, other contents.*"
                     r"--config.allow_changes_on_resume=True"):
    trainer.train_and_evaluate(digits_config(), workdir)
  assert snapshot(workdir) == before


@pytest.mark.slow
def test_a_resume_allowed_on_changed_data_records_the_change(finished, tmp_path,
                                                             digits_with_one_pixel_changed):
  workdir = copy_of(finished, tmp_path)
  rewind_to(workdir, 160)
  summary = trainer.train_and_evaluate(digits_config(allow_changes_on_resume=True), workdir)
  assert summary["samples"] == 240
  records = [json.loads(line) for line in open(os.path.join(workdir, "config_changes.jsonl"))]
  (record,) = [r for r in records if "data" in r]  # beside the change of the flag itself
  assert record["samples"] == 160 and "the training split (digits:train)" in record["data"][0]


@pytest.mark.slow
def test_a_checkpoint_that_records_no_data_resumes_as_before(finished, tmp_path,
                                                             digits_with_one_pixel_changed):
  workdir = copy_of(finished, tmp_path)
  rewind_to(workdir, 160)
  path = pathlib.Path(workdir) / "checkpoints" / "160" / "meta" / "metadata"
  meta = json.loads(path.read_text())
  del meta["data"]  # as written before checkpoints recorded their data
  meta["meta_digest"] = checkpoint._meta_digest(meta)  # pylint: disable=protected-access
  path.write_text(json.dumps(meta))
  summary = trainer.train_and_evaluate(digits_config(), workdir)
  assert summary["samples"] == 240
  assert not os.path.exists(os.path.join(workdir, "config_changes.jsonl"))


def write_corpus(directory, files=("alpha", "beta"), fortunes_per_file=2000, links=True):
  """A fortunes directory of over 1 MB: numbered fortunes, an index file and a NAME.u8 link."""
  directory.mkdir()
  for name in files:
    body = "".join(f"{name} fortune {k}: {'words ' * 50}\n%\n" for k in range(fortunes_per_file))
    (directory / name).write_text(body)
    (directory / f"{name}.dat").write_bytes(b"\0" * 64)
    if links:
      os.symlink(directory / name, directory / f"{name}.u8")
  return directory


def test_the_fingerprint_of_a_changed_corpus_names_its_files(tmp_path):
  corpus = write_corpus(tmp_path / "fortunes")
  before = fingerprint_lib.fingerprint(*text.load_fortunes(corpus, context=32))
  assert fingerprint_lib.differences(before, fingerprint_lib.fingerprint(
      *text.load_fortunes(corpus, context=32))) == []
  (corpus / "gamma").write_text("gamma fortune\n%\n")
  with open(corpus / "alpha", "a") as f:
    f.write("one more\n%\n")
  changes = fingerprint_lib.differences(before, fingerprint_lib.fingerprint(
      *text.load_fortunes(corpus, context=32)))
  # Both new fortunes train (by their hashes), so the validation split is the same.
  assert not text.held_out(b"gamma fortune", 10) and not text.held_out(b"one more", 10)
  assert len(changes) == 1 and changes[0].startswith("the training split")
  assert "files added: gamma" in changes[0] and "files changed in size: alpha" in changes[0]


# ------------------------------------------------------------------ 2. the fortunes split

def test_a_corpus_copy_whose_links_became_files_splits_as_the_original(tmp_path, caplog):
  original = write_corpus(tmp_path / "original")
  copy = tmp_path / "copy"
  shutil.copytree(original, copy, symlinks=False)  # cp -L, rsync -L, scp -r, a zip
  assert (copy / "alpha.u8").is_file() and not (copy / "alpha.u8").is_symlink()
  caplog.set_level(std_logging.WARNING)
  assert text.split_fortunes(str(copy)) == text.split_fortunes(str(original))
  assert "alpha.u8 holds the same bytes as" in caplog.text


def test_the_validation_split_shares_no_fortune_with_training(tmp_path):
  corpus = write_corpus(tmp_path / "fortunes")
  # Another file that repeats alpha's fortunes among its own: the same text in two places.
  own = [f"delta fortune {k}: {'other ' * 40}\n%\n" for k in range(500)]
  repeated = "".join(own[:3]) + (corpus / "alpha").read_text() + "".join(own[3:])
  (corpus / "delta").write_text(repeated)
  train, validation = text.split_fortunes(str(corpus))
  held_out = [f for f in validation.split(text.SEPARATOR) if f]
  trained = set(f for f in train.split(text.SEPARATOR) if f)
  assert held_out and not trained & set(held_out)
  assert len(held_out) == len(set(held_out))  # a fortune of two files is held out once
  assert {f.split(b" ")[0] for f in held_out} == {b"alpha", b"beta", b"delta"}


def test_an_os_error_outside_the_workdir_is_not_called_a_workdir_error(tmp_path, monkeypatch):
  unreadable = str(tmp_path / "corpus" / "beta")

  def load(name, **kwargs):
    del name, kwargs
    raise PermissionError(13, "Permission denied", unreadable)

  monkeypatch.setattr(data, "load", load)
  with pytest.raises(workdir_lib.StorageError) as info:
    trainer.train_and_evaluate(digits_config(), str(tmp_path / "run"))
  assert re.fullmatch(rf"{re.escape(unreadable)} cannot be used \(.*Permission denied.*\); it "
                      r"lies outside the workdir .*run, whose files are intact\. .*",
                      str(info.value))


# ------------------------------------------------------------------ 3. augmentation

@pytest.mark.parametrize("dataset", ["mnist1d", "fashion_mnist", "fashion_mnist_idx", "fortunes",
                                     "digits"])
def test_augment_on_a_data_set_without_a_standard_one_is_refused(tmp_path, dataset):
  with pytest.raises(config_checks.ConfigError,
                     match=f"data set '{dataset}' has no standard augmentation"):
    trainer.train_and_evaluate(digits_config(dataset=dataset, augment=True),
                                str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_the_data_sets_named_augmented_are_those_whose_sources_augment(tmp_path):
  plan_lib.resolve(digits_config(dataset="cifar10", augment=True))
  sources = [data.load("digits")[0], data.load("mnist1d", num_samples=200)[0],
             data.load("fortunes", data_dir=str(write_corpus(tmp_path / "f")), context=32)[0]]
  for source in sources:
    assert source.default_augment is None
    assert source.name.split(":")[0] not in data.AUGMENTED_NAMES


# ------------------------------------------------------------------ 4. results without checkpoints

def test_a_finished_run_whose_checkpoints_were_deleted_is_reported_again(finished, tmp_path):
  workdir = copy_of(finished, tmp_path)
  shutil.rmtree(os.path.join(workdir, "checkpoints"))
  before = snapshot(workdir)
  summary = trainer.train_and_evaluate(digits_config(), workdir)
  assert summary == finished[1]
  assert snapshot(workdir) == before  # nothing retrained, nothing written, no checkpoints/


@pytest.mark.parametrize("change, named", [({"seed": 1}, "seed 0 -> 1"),
                                           ({"method": "pb"}, "method 'pb_sc_lwp' -> 'pb'")])
def test_other_settings_over_a_finished_run_without_checkpoints_are_refused(finished, tmp_path,
                                                                            change, named):
  workdir = copy_of(finished, tmp_path)
  shutil.rmtree(os.path.join(workdir, "checkpoints"))
  before = snapshot(workdir)
  with pytest.raises(config_checks.ConfigError,
                     match=f"results of a finished run .*{named}.*overwrite its summary"):
    trainer.train_and_evaluate(digits_config(**change), workdir)
  assert snapshot(workdir) == before


def _empty_summary(workdir):
  open(os.path.join(workdir, "summary.json"), "w").close()  # what a kill mid-write left


def _no_summary(workdir):
  os.remove(os.path.join(workdir, "summary.json"))


def _stopped_summary(workdir):  # a run stopped by SIGTERM (exit 75) at 160 samples
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  summary.update(stopped_by="SIGTERM", samples=160, test_accuracy=None, test_loss=None)
  json.dump(summary, open(os.path.join(workdir, "summary.json"), "w"))


@pytest.mark.parametrize("damage, named", [
    (_empty_summary, r"an earlier run \(its metrics reach 240 samples; no readable summary"),
    (_no_summary, r"an earlier run \(its metrics reach 240 samples; no readable summary"),
    (_stopped_summary, r"a run stopped by SIGTERM \(method 'pb_sc_lwp', 160 samples\)")],
    ids=["summary left empty", "summary missing", "stopped run"])
def test_other_settings_over_any_earlier_run_without_checkpoints_are_refused(finished, tmp_path,
                                                                             damage, named):
  """Not only a whole summary of a finished run: metrics.jsonl, the record of truth, is never
  truncated by a run of other settings."""
  workdir = copy_of(finished, tmp_path)
  shutil.rmtree(os.path.join(workdir, "checkpoints"))
  damage(workdir)
  before = snapshot(workdir)
  with pytest.raises(config_checks.ConfigError,
                     match=f"holds the results of {named}.* but no checkpoints.*seed 0 -> 1.*"
                     "overwrite its summary, metrics and curves"):
    trainer.train_and_evaluate(digits_config(seed=1), workdir)
  assert snapshot(workdir) == before


@pytest.mark.slow  # trains the run again (about 30 s on 2 cores)
def test_its_own_settings_over_an_earlier_run_without_checkpoints_train_it_again(finished,
                                                                                tmp_path):
  workdir = copy_of(finished, tmp_path)
  shutil.rmtree(os.path.join(workdir, "checkpoints"))
  _empty_summary(workdir)
  metrics = open(os.path.join(workdir, "metrics.jsonl")).read()
  summary = trainer.train_and_evaluate(digits_config(), workdir)
  assert summary["test_accuracy"] == finished[1]["test_accuracy"]
  assert summary["init_digest"] == finished[1]["init_digest"]
  assert open(os.path.join(workdir, "metrics.jsonl")).read().count("\n") == metrics.count("\n")


# ------------------------------------------------------------------ 5. a pipeline never filled

def test_a_run_too_short_to_fill_its_pipeline_is_refused_before_training(tmp_path):
  workdir = tmp_path / "run"
  # 1437 digits at b = 256: 5 micro-batches; 3 stages under a cosine schedule need 6.
  with pytest.raises(config_checks.ConfigError, match=r"too short to train every stage: it "
                     r"trains 5 micro-batches of 256 .*at micro-batch 5, and a warm-up starts at "
                     r"a rate of 0. It needs at least 1536 training samples"):
    trainer.train_and_evaluate(digits_config(micro_batch_size=256, epochs=1.0), str(workdir))
  assert not (workdir / "checkpoints").exists() and not (workdir / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides, shortest, too_short", [
    ({}, 6, 5),  # 3 stages: stage 0's first update at tick 4, its second (rate > 0) at tick 5
    ({"schedule": "constant", "warmup_epochs": 0.0}, 5, 4),
    ({"method": "sync", "method_kwargs": {"sync": {"micro_batches": 4}}}, 8, 4),  # 2 sync steps
    # Stage 0's first backward at tick 4, its updates after every third: ticks 6 and 9.
    ({"method": "pipedream_muon", "optimizer": "adam", "decay_mask": True,
      "method_kwargs": {"pipedream_muon": {"micro_batches": 3}}}, 10, 9),
    ({"method": "sgd"}, 2, 1)])  # one stage
def test_the_shortest_run_that_moves_every_stage_passes(overrides, shortest, too_short):
  config = digits_config(**overrides)
  pipe = experiment.build(plan_lib.resolve(config)).pipeline
  run_checks.check_pipeline_fills(plan_lib.resolve(config), pipe, shortest)
  with pytest.raises(config_checks.ConfigError, match="too short to train every stage"):
    run_checks.check_pipeline_fills(plan_lib.resolve(config), pipe, too_short)


# ------------------------------------------------------------------ 6. the LM over processes

def _lm_command(workdir, *extra):
  return [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
          "--config=configs/char_lm.py:smoke", "--config.mesh.stage=2",
          "--config.max_train_examples=100", "--config.max_test_examples=20",
          "--config.ticks_per_chunk=200", "--config.eval_every_samples=100",
          "--config.checkpoint_every_samples=50", "--config.plot_curves=False",
          f"--workdir={workdir}", *extra]


def _lm_env(devices):
  return dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
              XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def _newest_meta(workdir) -> dict:
  directory = pathlib.Path(workdir) / "checkpoints"
  step = max(int(s.name) for s in directory.iterdir() if s.name.isdigit())
  return json.loads((directory / str(step) / "meta" / "metadata").read_text())


@pytest.mark.slow
def test_the_char_lm_over_two_processes_equals_one_process(tmp_path):
  address = f"localhost:{free_port()}"
  two = [subprocess.Popen(
      _lm_command(tmp_path / "two", f"--coordinator_address={address}", "--num_processes=2",
                  f"--process_id={i}"), cwd=ROOT, env=_lm_env(1), stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(2)]
  one = subprocess.run(_lm_command(tmp_path / "one"), cwd=ROOT, env=_lm_env(2),
                       capture_output=True, text=True, timeout=600)
  logs = [p.communicate(timeout=600)[0] for p in two]
  assert one.returncode == 0, one.stderr[-3000:]
  for p, log in zip(two, logs):
    assert p.returncode == 0, log[-3000:]
    assert "processes=2 mesh=data1xstage2" in log
  assert "Process 1 of 2 loads rows [] of every micro-batch of 1" in logs[1]
  expected = _newest_meta(tmp_path / "one")
  assert _newest_meta(tmp_path / "two")["state_digest"] == expected["state_digest"]
  assert expected["samples"] == 100


@pytest.mark.slow
def test_processes_that_read_different_copies_of_the_data_refuse_to_train(tmp_path):
  write_corpus(tmp_path / "host0")
  # A file that sorts first: the run's first windows (all it reads of each split) differ.
  (write_corpus(tmp_path / "host1") / "aardvark").write_text("aardvark fortune\n%\n")
  address = f"localhost:{free_port()}"
  processes = [subprocess.Popen(
      _lm_command(tmp_path / "run", f"--config.data_dir={tmp_path / f'host{i}'}",
                  f"--coordinator_address={address}", "--num_processes=2", f"--process_id={i}"),
      cwd=ROOT, env=_lm_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  for p in processes:
    log = p.communicate(timeout=600)[0]
    assert p.returncode == 1, log[-3000:]
    (error,) = [line for line in log.splitlines() if line.startswith("error: ")]
    assert "The 2 processes of this run read different data" in error
    assert "process 1, against process 0: the training split (fortunes:train[:100]): files " \
        "added: aardvark" in error
    assert "Traceback" not in log
  assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------ 11. one line, not a traceback

def test_an_eval_batch_larger_than_the_test_split_is_capped(finished, tmp_path, monkeypatch):
  workdir = copy_of(finished, tmp_path)
  os.remove(os.path.join(workdir, "summary.json"))  # so the rerun evaluates its final state
  batches = []
  make = evaluation.make_evaluator
  monkeypatch.setattr(evaluation, "make_evaluator",
                      lambda model, batch: batches.append(batch) or make(model, batch))
  summary = trainer.train_and_evaluate(digits_config(eval_batch_size=10**7), workdir)
  assert batches == [360] and summary["test_accuracy"] == pytest.approx(
      finished[1]["test_accuracy"])


def test_an_evaluation_batch_too_large_for_memory_is_refused(monkeypatch):
  config = digits_config(eval_batch_size=10**7)  # the whole test split, 360 examples
  setup = experiment.build(plan_lib.resolve(config))
  state, chunk = run_checks.state_bytes(setup), run_checks.chunk_bytes(setup, 40)
  available = max(int(chunk / run_checks.CHUNK_MEMORY_SHARE), state + chunk) + 1
  assert state + run_checks.eval_bytes(setup, 360) > available  # the chunk fits, eval does not
  monkeypatch.setattr(run_checks, "_memory_available", lambda: (available, "test memory"))
  with pytest.raises(config_checks.ConfigError, match=r"Evaluation in batches of 360 .* Lower "
                     r"--config.eval_batch_size to \d+ or less"):
    run_checks.check_memory(plan_lib.resolve(config), setup, 40)


def test_a_checkpoint_directory_that_is_a_file_is_one_line(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "checkpoints").write_text("not a directory")
  with pytest.raises(workdir_lib.StorageError, match=r"checkpoints is a file, where the run keeps "
                     r"its checkpoints. Move it away"):
    trainer.train_and_evaluate(digits_config(), str(workdir))
  assert (workdir / "checkpoints").read_text() == "not a directory"


@pytest.mark.parametrize("name", ["summary.json", "metrics.jsonl", "config.json", "curves.png",
                                  ".lock"])
def test_a_directory_where_the_run_writes_a_file_is_refused_before_training(tmp_path, name,
                                                                          monkeypatch):
  (tmp_path / "run" / name).mkdir(parents=True)
  monkeypatch.setattr(experiment, "build", lambda config: pytest.fail("built before the check"))
  with pytest.raises(workdir_lib.StorageError, match=f"{re.escape(name)} is a directory, where "
                     "the run keeps its"):
    trainer.train_and_evaluate(digits_config(), str(tmp_path / "run"))


@pytest.mark.parametrize("damage", ["[]", "null", "5"])
def test_a_damaged_summary_or_metrics_line_is_written_again_not_a_traceback(finished, tmp_path,
                                                                           damage):
  workdir = copy_of(finished, tmp_path)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    f.write(damage)
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write(damage + "\n")
  summary = trainer.train_and_evaluate(digits_config(), workdir)
  assert summary["test_accuracy"] == finished[1]["test_accuracy"]
  assert json.load(open(os.path.join(workdir, "summary.json")))["samples"] == 240


def test_a_full_disk_while_saving_reports_once(tmp_path, monkeypatch, caplog, capsys):
  def full_disk(*args, **kwargs):
    # What orbax's writer threads do before the save raises: log the failure with its traceback,
    # and tensorstore prints the exceptions of its callbacks through sys.excepthook.
    try:
      raise ValueError("RESOURCE_EXHAUSTED: Error writing local file: No space left on device")
    except ValueError:
      record = std_logging.LogRecord(
          "absl", std_logging.ERROR, os.path.join("site-packages", "orbax", "checkpoint",
                                                  "future.py"), 387,
          "_SignalingThread.run() raised an exception", None, sys.exc_info())
    std_logging.getLogger("absl").handle(record)
    sys.excepthook(RuntimeError, RuntimeError("Event loop is closed"), None)
    sys.unraisablehook(types.SimpleNamespace(
        exc_type=RuntimeError, exc_value=RuntimeError("Event loop is closed"),
        exc_traceback=None, err_msg=None, object=None))
    raise ValueError("RESOURCE_EXHAUSTED: Error writing local file: No space left on device")

  monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", full_disk)
  for hook in ("excepthook", "unraisablehook"):  # the quieting lasts the process; not the tests'
    monkeypatch.setattr(sys, hook, getattr(sys, hook))
  absl_logger = std_logging.getLogger("absl")
  monkeypatch.setattr(absl_logger, "filters", list(absl_logger.filters))
  caplog.set_level(std_logging.INFO)
  with pytest.raises(workdir_lib.StorageError, match="checkpoint at 40 samples failed: the disk"):
    trainer.train_and_evaluate(digits_config(), str(tmp_path / "run"))
  # tensorstore's callbacks that outlive the failed save, as on a loaded machine.
  sys.excepthook(RuntimeError, RuntimeError("Event loop is closed"), None)
  sys.unraisablehook(types.SimpleNamespace(
      exc_type=RuntimeError, exc_value=RuntimeError("Event loop is closed"),
      exc_traceback=None, err_msg=None, object=None))
  assert "_SignalingThread" not in caplog.text
  assert "Event loop is closed" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_real_full_disk_prints_one_error_line_and_no_traceback(tmp_path):
  disk = tmp_path / "small"
  disk.mkdir()
  if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs",
                                          str(disk)], capture_output=True).returncode:
    pytest.skip("mounting a small tmpfs needs root")
  try:
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
         "--config=configs/default.py:smoke", f"--workdir={disk / 'run'}",
         "--config.dataset=digits", "--config.max_train_examples=0",
         "--config.max_test_examples=0", "--config.model_kwargs.hidden=(16,12)",
         "--config.epochs=0.167", "--config.warmup_epochs=0.0278", "--config.ticks_per_chunk=40",
         "--config.eval_every_samples=80", "--config.checkpoint_every_samples=40",
         "--config.eval_batch_size=128"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
        capture_output=True, text=True, timeout=600)
  finally:
    subprocess.run(["umount", str(disk)], check=False)
  assert result.returncode == 1, result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines()
            if line.startswith("error:") or re.match(r"E\d{4} ", line)]  # absl's ERROR lines
  assert len(errors) == 1 and "is full" in errors[0], result.stderr[-3000:]
