"""Faults at the edges a user reaches: signals of a closed terminal, study files and flags that
cannot be used, and a trainer's damaged files under a study."""

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from pipejax.study import launcher
from pipejax.study import preflight
from pipejax.study import records as study_records
from pipejax.study import spec as study_lib

from tests.helpers import ROOT, as_from_a_terminal
from tests.study.helpers import FAKE_TRAINER, STUDY_PROCESS, TWO_RUNS, alive, record, start_study


ENV = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)


def _train_command(workdir, *overrides):
  return [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
          "--config=" + os.path.join(ROOT, "configs", "default.py") + ":smoke",
          f"--workdir={workdir}", "--config.dataset=digits", "--config.max_train_examples=0",
          "--config.max_test_examples=0", "--config.model_kwargs.hidden=(16,12)",
          "--config.schedule=constant", "--config.plot_curves=False", *overrides]


def _signal_when(command, sig, marker):
  """Starts ``command``, sends ``sig`` once a line holding ``marker`` appears; returns
  (exit code, whole output)."""
  process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=ENV, preexec_fn=as_from_a_terminal)
  lines = []
  for line in process.stdout:
    lines.append(line)
    if marker in line:
      process.send_signal(sig)
      break
  rest, _ = process.communicate(timeout=300)
  return process.returncode, "".join(lines) + rest


# ----------------------------------------------------------------------------- SIGHUP


@pytest.mark.slow
def test_sighup_while_training_saves_a_checkpoint_exits_75_and_resumes(tmp_path):
  workdir = tmp_path / "run"
  command = _train_command(workdir, "--config.epochs=2.0", "--config.ticks_per_chunk=50",
                           "--config.eval_every_samples=1000000",
                           "--config.checkpoint_every_samples=1000000")
  code, output = _signal_when(command, signal.SIGHUP, "samples/s")
  assert code == 75, output[-2000:]
  assert "STOPPED by SIGHUP after" in output
  summary = json.load(open(workdir / "summary.json"))
  assert summary["stopped_by"] == "SIGHUP" and summary["samples"] > 0
  assert os.listdir(workdir / "checkpoints")
  resumed = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert "Resumed from" in resumed.stderr


@pytest.mark.slow
def test_sighup_during_set_up_is_a_stop_of_one_line(tmp_path):
  code, output = _signal_when(_train_command(tmp_path / "run"), signal.SIGHUP,
                              "pipejax training:")
  assert code == 75, output[-2000:]
  assert "STOPPED by SIGHUP during" in output and "Traceback" not in output


def _in_a_terminal_closed_when(command, ready):
  """Runs ``command`` in a terminal of its own (a pty, as an SSH session gives), closes the
  terminal once ``ready(output so far)``; returns the exit code. The kernel then sends SIGHUP, and
  every later write to the terminal fails."""
  pid, terminal = pty.fork()
  if pid == 0:  # the child: nothing but the signals a terminal's command starts with, and exec
    as_from_a_terminal()
    os.execve(command[0], command, ENV)
  output, deadline = b"", time.time() + 300
  while not ready(output) and time.time() < deadline:
    if select.select([terminal], [], [], 1)[0]:
      try:
        output += os.read(terminal, 4096)
      except OSError:
        break
  os.close(terminal)
  return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.slow
def test_a_closed_terminal_stops_the_trainer_with_75_and_a_checkpoint(tmp_path):
  workdir = tmp_path / "run"
  command = _train_command(workdir, "--config.epochs=3.0", "--config.ticks_per_chunk=20",
                           "--config.eval_every_samples=1000000",
                           "--config.checkpoint_every_samples=1000000")
  code = _in_a_terminal_closed_when(command, lambda output: b"samples/s" in output)
  assert code == 75  # not 1: the final "STOPPED" line must not fail on the closed terminal
  assert json.load(open(workdir / "summary.json"))["stopped_by"] == "SIGHUP"
  assert os.listdir(workdir / "checkpoints")


def _ignoring_sighup():  # what nohup does before it starts the command
  signal.signal(signal.SIGHUP, signal.SIG_IGN)


@pytest.mark.slow
def test_under_nohup_a_sighup_leaves_the_trainer_running_to_the_end(tmp_path):
  command = _train_command(tmp_path / "run", "--config.epochs=1.0", "--config.ticks_per_chunk=50")
  process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=ENV, preexec_fn=_ignoring_sighup)
  for line in process.stdout:
    if "samples/s" in line:
      process.send_signal(signal.SIGHUP)
      break
  output = process.communicate(timeout=300)[0]
  assert process.returncode == 0, output[-2000:]
  assert json.load(open(tmp_path / "run" / "summary.json"))["stopped_by"] is None


@pytest.fixture
def fake_trainer(tmp_path):
  path = tmp_path / "fake_train.py"
  path.write_text(FAKE_TRAINER)
  return lambda mode: (sys.executable, str(path), mode)


def test_sighup_to_a_study_stops_its_trainers_through_their_checkpoints(tmp_path, fake_trainer):
  workdir = tmp_path / "study"
  process, trainers = start_study(workdir, fake_trainer("sleep"))
  process.send_signal(signal.SIGHUP)
  out = process.communicate(timeout=60)[0]
  assert process.returncode == launcher.EXIT_STOPPED, out
  assert not any(alive(pid) for pid in trainers)
  assert all((workdir / "runs" / f"method=sgd,seed={s}" / "saved").exists() for s in (0, 1))
  assert "SIGHUP: stopping" in out


def test_under_nohup_a_sighup_leaves_the_study_running(tmp_path, fake_trainer):
  workdir = tmp_path / "study"
  pids = [workdir / "runs" / f"method=sgd,seed={s}" / "pid" for s in (0, 1)]
  process = subprocess.Popen(
      [sys.executable, "-c", STUDY_PROCESS, str(workdir), *fake_trainer("sleep")], cwd=ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
      preexec_fn=_ignoring_sighup)
  deadline = time.time() + 60
  while not all(p.exists() and p.read_text() for p in pids):
    assert time.time() < deadline and process.poll() is None
    time.sleep(0.05)
  process.send_signal(signal.SIGHUP)
  time.sleep(2)
  assert process.poll() is None and all(alive(int(p.read_text())) for p in pids)
  process.send_signal(signal.SIGTERM)  # then a stop it does take
  out = process.communicate(timeout=60)[0]
  assert process.returncode == launcher.EXIT_STOPPED and "SIGHUP" not in out, out


def test_a_closed_terminal_stops_a_study_and_its_trainers_with_75(tmp_path, fake_trainer):
  workdir = tmp_path / "study"
  pids = [workdir / "runs" / f"method=sgd,seed={s}" / "pid" for s in (0, 1)]
  code = _in_a_terminal_closed_when(
      [sys.executable, "-c", STUDY_PROCESS, str(workdir), *fake_trainer("sleep")],
      lambda output: all(p.exists() and p.read_text() for p in pids))
  assert code == launcher.EXIT_STOPPED
  assert all((workdir / "runs" / f"method=sgd,seed={s}" / "saved").exists() for s in (0, 1))
  assert not any(alive(int(p.read_text())) for p in pids)


# ---------------------------------------------------------------------------- study files and flags


def _study_cli(*args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "study.py"), *args],
                        capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)


GOOD_STUDY = """
from pipejax.study import Study
def get_study(arg):
  return Study(name="g", config="configs/default.py:smoke", fixed={FIXED},
               grids=[{"method": ("sgd", "pb"), "seed": (0, 1)}])
"""


def _study_file(tmp_path, text, name="s.py"):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize("args", [
    ("--where=method=pbx",), ("--where=method=pb|sgdx,seed=3",), ("--report_only",),
    ("--where=method=pb,method=sgd",), ("--list", "--report_only")],
    ids=["no value matches", "one key matches nothing", "report of a missing workdir",
         "a key named twice", "list and report at once"])
def test_a_selection_or_report_with_nothing_to_do_fails_in_one_line_creating_nothing(
    tmp_path, args):
  workdir = tmp_path / "mistyped"
  result = _study_cli(f"--study={_study_file(tmp_path, GOOD_STUDY.replace('{FIXED}', '{}'))}",
                      f"--workdir={workdir}", *args)
  assert result.returncode == 2, result.stdout + result.stderr
  assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error: ")
  assert not workdir.exists()


def test_an_empty_workdir_flag_is_refused_not_taken_for_the_current_directory(tmp_path):
  study_file = _study_file(tmp_path, GOOD_STUDY.replace("{FIXED}", "{}"))
  before = sorted(os.listdir(ROOT))
  result = _study_cli(f"--study={study_file}", "--workdir=")
  assert result.returncode == 2 and "--workdir is empty" in result.stderr, result.stderr
  assert sorted(os.listdir(ROOT)) == before


def test_where_names_the_values_its_key_takes_and_report_only_names_an_empty_workdir(tmp_path):
  with pytest.raises(study_lib.StudyError, match=r"method takes sgd\. Nothing"):
    preflight.check_selection(TWO_RUNS, {"method": "pbx"})
  with pytest.raises(study_lib.StudyError, match="no grid point has them together"):
    preflight.check_selection(
        study_lib.Study(name="u", config="c.py", grids=[{"method": ("sgd",), "seed": (0,)},
                                                        {"method": ("pb",), "seed": (1,)}]),
        {"method": "sgd", "seed": "1"})
  preflight.check_selection(TWO_RUNS, {"method": "pb|sgd"})  # one alternative is enough
  assert launcher.main(TWO_RUNS, str(tmp_path), parallel=1, command="",
                           report_only=True) == launcher.EXIT_USAGE
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("text, message", [
    ("from pipejax.study import Study\ndef get_study(arg):\n  return Study(name=nme)\n",
     r"NameError: name 'nme' is not defined \(line 3\)"),
    ("def get_study(arg)\n  return None\n", r"SyntaxError: .*line 1"),
    ("import no_such_module_here\n", "ModuleNotFoundError"),
    ("def get_study(arg):\n  return {}['x']\n", r"KeyError: 'x' \(line 2\)"),
    (GOOD_STUDY.replace("(\"sgd\", \"pb\")", "\"sgd\"").replace("{FIXED}", "{}"),
     "the values of grid key 'method' must be a list or tuple"),
    (GOOD_STUDY.replace("grids=[", "grids=").replace(")}]", ")}").replace("{FIXED}", "{}"),
     "grids must be a list of mappings"),
    (GOOD_STUDY.replace("{FIXED}", "{'epcohs': 1.0}"), "'epcohs' is not a field of "
     "configs/default.py:smoke. Did you mean 'epochs'"),
    (GOOD_STUDY.replace("{FIXED}", "{}").replace("configs/default.py", "configs/nope.py"),
     "its config file 'configs/nope.py' does not exist"),
    (GOOD_STUDY.replace("{FIXED}", "{}").replace(":smoke", ":smok"),
     "Unknown config argument 'smok'"),
], ids=["NameError", "SyntaxError", "ImportError", "error in get_study", "grid value",
        "grid not a list", "unknown config key", "missing config file", "unknown config variant"])
def test_a_study_file_that_cannot_be_used_is_exit_2_in_one_line(tmp_path, text, message):
  workdir = tmp_path / "work"
  result = _study_cli(f"--study={_study_file(tmp_path, text)}", f"--workdir={workdir}")
  assert result.returncode == 2, result.stdout + result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  assert re.search(message, lines[0]), lines[0]
  assert not workdir.exists()


def test_a_study_that_sets_a_renamed_field_is_refused_naming_its_new_key():
  study = study_lib.Study(name="old", config="configs/default.py:smoke",
                          grids=[{"method": ("sync",), "micro_batches": (4,)}])
  with pytest.raises(study_lib.StudyError,
                     match=r"^Study 'old': config\.micro_batches is no longer a field of "
                     r"configs/default\.py:smoke: .* set as "
                     r"config\.method_kwargs\.sync\.micro_batches, in the method's section"):
    preflight.check_config_keys(study)
  # The new key passes the check (the trainer checks it against the method's record).
  preflight.check_config_keys(study_lib.Study(
      name="new", config="configs/default.py:smoke",
      grids=[{"method": ("sync",), "method_kwargs.sync.micro_batches": (4,)}]))


@pytest.mark.parametrize("key, message", [
    ("method_kwargs.pipemare.anneal_steps",
     r"pipemare\.anneal_steps is set by the trainer: use --config\.method_kwargs\.pipemare\."
     r"anneal_epochs \(or anneal_fraction\) instead\. Every trainer would refuse it"),
    ("method_kwargs.pb_sc_lwp.gamma", r"method 'pb_sc_lwp' has no hyperparameter 'gamma'"),
    ("method_kwargs.pb_scc.horizon", r"there is no method 'pb_scc'")])
def test_a_method_key_no_trainer_would_accept_is_refused_before_any_run(key, message):
  study = study_lib.Study(name="keys", config="configs/default.py:smoke",
                          grids=[{"method": ("pipemare",), key: (1,)}])
  with pytest.raises(study_lib.StudyError, match=r"^Study 'keys': config\..*" + message):
    preflight.check_config_keys(study)
  preflight.check_config_keys(study_lib.Study(
      name="keys", config="configs/default.py:smoke",
      grids=[{"method": ("pipemare",), "method_kwargs.pipemare.anneal_fraction": (0.5,),
              "method_kwargs.pipemare.gamma": (0.5,)}]))


def test_every_study_file_passes_the_config_key_check():
  # The check refuses what a trainer would; it must not refuse a study the trainers accept.
  paths = sorted(p for p in os.listdir(os.path.join(ROOT, "configs", "studies"))
                 if p.endswith(".py"))
  assert paths
  for path in paths:
    for variant in ("", ":smoke"):
      preflight.check_config_keys(
          study_lib.load_study(os.path.join(ROOT, "configs", "studies", path) + variant))


# ----------------------------------------------------------------------------- a trainer's files


@pytest.mark.parametrize("content", [b"", b'{"test_accuracy": 0.5', b"\xff\xfe", b"[1, 2]"],
                         ids=["empty", "cut short", "not text", "not an object"])
def test_an_unreadable_summary_is_a_missing_one(tmp_path, content):
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "summary.json").write_bytes(content)
  (run_dir / "metrics.jsonl").write_bytes(b'{"split": "test", "samples": 10, "accuracy": 0.5}\n'
                                          b"\xff\x00garbage\n[3]\n")
  record = study_records.record_from_run(TWO_RUNS, {"method": "sgd", "seed": 0}, str(run_dir), 0,
                                         1.0, "error: No space left on device")
  assert record.status == study_records.FAILED
  assert "summary.json cannot be read" in record.error or "not a summary" in record.error
  assert record.test_curve == [[10, 0.5, None]]
  # Exit 75 with the same summary: stopped, not failed; the runner never records it.
  stopped = study_records.record_from_run(TWO_RUNS, {"method": "sgd", "seed": 0}, str(run_dir),
                                          1, 1.0, "")
  assert stopped.status == study_records.FAILED


def test_a_diverged_run_records_where_and_when_the_trainer_saw_it_break(tmp_path):
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  tail = ("...\nerror: Training diverged: stage 1 ('block1'), stage 2 ('block2') at tick 1392 "
          "produced a non-finite value (NaN or inf), after 1392 training samples. No checkpoint "
          "had been written yet, so a rerun starts from the beginning.\n")
  record = study_records.record_from_run(TWO_RUNS, {"method": "sgd", "seed": 0}, str(run_dir), 1,
                                         1.0, tail)
  assert record.status == study_records.DIVERGED
  assert record.divergence == {"samples": 1392, "stages": [1, 2]}
  # A diverged run whose log says no more than that is recorded without a point.
  bare = study_records.record_from_run(TWO_RUNS, {"method": "sgd", "seed": 0}, str(run_dir), 1,
                                       1.0, "the loss diverged")
  assert bare.status == study_records.DIVERGED and bare.divergence is None


EMPTY_SUMMARY_TRAINER = FAKE_TRAINER + """
open(os.path.join(workdir, "summary.json"), "w").close()  # the disk filled while writing it
"""


def test_a_study_records_a_run_with_an_empty_summary_as_failed_and_retries_it(tmp_path, capsys):
  trainer_path = tmp_path / "trainer.py"
  trainer_path.write_text(EMPTY_SUMMARY_TRAINER)
  trainer = (sys.executable, str(trainer_path), "finish")
  for _ in range(2):  # every rerun the same: recorded, never a crash
    code = launcher.main(TWO_RUNS, str(tmp_path / "study"), parallel=2, command="",
                             trainer=trainer)
    assert code == launcher.EXIT_FAILED
    assert "FAILED" in capsys.readouterr().out
  records = study_records.read_results(str(tmp_path / "study"))
  assert [r.status for r in records] == [study_records.FAILED] * 2


# ----------------------------------------------------------------------------- concurrent use

REPORTED_STUDY = """
from pipejax.study import Figure, Study, Table
def get_study(arg):
  return Study(name="beside", config="c.py", baseline={"method": "sgd"},
               grids=[{"method": ("sgd", "pb"), "model_kwargs.depth": (4,), "seed": (0, 1)}],
               tables=[Table("runs", "", "", kind="cells")],
               figures=[Figure("f.png", x="model_kwargs.depth", series="method"),
                        Figure("g.png", x="model_kwargs.depth", series="method", kind="gap")])
"""

# `--report_only` in a tight loop, as scripts/study.py runs it, until the stop file exists.
REPORT_LOOP = """
import os, sys
from pipejax.study import launcher, spec
study, (workdir, stop) = spec.load_study(sys.argv[1]), sys.argv[2:]
sys.stdout = open(os.devnull, "w")  # each report's markdown
reports = 0
while not (reports and os.path.exists(stop)):
  code = launcher.main(study, workdir, parallel=1, command="", report_only=True)
  if code:
    sys.exit(f"--report_only exited {code}")
  reports += 1
sys.stderr.write(f"{reports} reports")
"""


def test_report_only_beside_a_running_study_leaves_it_running_and_its_report_whole(
    tmp_path, fake_trainer, capsys):
  """A study and `--report_only` in a loop beside it, on one workdir: the study ends with every
  run done, every report of the loop is written, and the report is the study's last, whole."""
  study_file = _study_file(tmp_path, REPORTED_STUDY)
  workdir, stop = tmp_path / "study", tmp_path / "stop"
  (workdir / "runs").mkdir(parents=True)
  loop = subprocess.Popen([sys.executable, "-c", REPORT_LOOP, study_file, str(workdir), str(stop)],
                          stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
  deadline = time.time() + 60
  while not (workdir / "report.md").exists():  # the loop writes reports before the study starts
    assert time.time() < deadline and loop.poll() is None, loop.communicate()[1][-2000:]
    time.sleep(0.05)
  code = launcher.main(study_lib.load_study(study_file), str(workdir), parallel=2, command="",
                       trainer=fake_trainer("finish"))
  stop.touch()
  err = loop.communicate(timeout=120)[1]
  assert code == launcher.EXIT_COMPLETE, capsys.readouterr()
  assert loop.returncode == 0 and err.endswith("reports"), err[-2000:]
  assert "4 of 4 runs recorded: 4 finished" in (workdir / "report.md").read_text()
  assert {"f.png", "g.png", "report.md", "results.csv"} <= set(os.listdir(workdir))
  assert not [name for name in os.listdir(workdir) if ".tmp" in name]  # no writer's left over


# ----------------------------------------------------------------------------- docs/reliability.md


def test_every_test_docs_reliability_cites_exists():
  text = open(os.path.join(ROOT, "docs", "reliability.md")).read()
  cited = set(re.findall(r"`((?:\w+/)?test_\w+\.py)::(test_\w+)", text))
  assert len(cited) > 50
  missing = [f"{name}::{test}" for name, test in sorted(cited)
             if not re.search(rf"^\s*def {test}\(", open(os.path.join(ROOT, "tests", name)).read(),
                              re.M)]
  assert not missing, f"docs/reliability.md cites tests that do not exist: {missing}"
