"""The runner: trainer processes, retries, stops, locks and the exit codes."""

import dataclasses
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pipejax.study import statistics
from pipejax.study import spec as study_lib
from pipejax.study import records as study_records
from pipejax.study import report as study_report
from pipejax.study import launcher
from pipejax.study.spec import Study, Table
from pipejax.train import workdir as workdir_lib

from tests.helpers import ROOT
from tests.study.helpers import STUDY, TWO_RUNS, alive, record, run_main, start_study, changed


def test_a_study_with_a_point_listed_twice_runs_it_once_and_reports_one_seed(tmp_path,
                                                                              fake_trainer,
                                                                              capsys):
  study = Study(name="t", config="c.py", grids=[{"method": ("sgd",), "seed": (0,)},
                                                {"seed": (0,), "method": ("sgd",)}],
                baseline={"method": "sgd"}, tables=[Table("acc", "", "", kind="cells")])
  assert run_main(tmp_path, fake_trainer("finish"), study=study) == 0
  assert "1 runs, 0 already done, 1 to run" in capsys.readouterr().out
  assert os.listdir(tmp_path / "runs") == ["method=sgd,seed=0"]
  # An older workdir's second record of the run, under the other order of its keys.
  (done,) = study_records.read_results(str(tmp_path))
  study_records.append_result(str(tmp_path), changed(done, run="seed=0,method=sgd",
                                                  overrides={"seed": 0, "method": "sgd"}))
  assert len(study_records.read_results(str(tmp_path))) == 1
  assert run_main(tmp_path, fake_trainer("fail"), study=study, report_only=True) == 0
  report = (tmp_path / "report.md").read_text()
  assert "1 of 1 runs recorded: 1 finished" in report and "| 50.00 (1 seed) |" in report


def test_a_run_stopped_under_its_grid_order_resumes_in_its_own_directory(tmp_path):
  old = tmp_path / "runs" / "seed=0,method=pb"
  old.mkdir(parents=True)
  (old / "config.json").write_text("{}")
  path = launcher.run_directory(str(tmp_path), {"seed": 0, "method": "pb"})
  assert path == str(tmp_path / "runs" / "method=pb,seed=0")
  assert os.listdir(tmp_path / "runs") == ["method=pb,seed=0"]
  assert os.path.exists(os.path.join(path, "config.json"))


@pytest.mark.slow
def test_smoke_study_runs_skips_finished_runs_and_marks_divergence(tmp_path):
  """The CI run of configs/studies/depth.py:smoke: real trainer processes, then a rerun."""
  workdir = tmp_path / "depth"
  command = [sys.executable, os.path.join(ROOT, "scripts", "study.py"),
             "--study=configs/studies/depth.py:smoke", f"--workdir={workdir}", "--parallel=2"]
  first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  records = study_records.read_results(str(workdir))
  assert len(records) == 9
  statuses = {r.run: r.status for r in records}
  assert statuses["method=pb,model_kwargs.depth=5,reference.lr=10000.0,seed=0"] == "diverged"
  point = next(r for r in records if r.status == "diverged").divergence
  assert point["samples"] >= 0 and point["stages"] and set(point["stages"]) <= set(range(5))
  assert sum(s == "finished" for s in statuses.values()) == 8
  report = (workdir / "report.md").read_text()
  table = report.split("## Test accuracy (%)")[1].split("##")[0]
  rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
          for line in table.strip().splitlines()[2:]}
  assert set(rows) == {"4", "5", "6"}
  for depth in ("4", "6"):
    assert all(cell.endswith("n=2") for cell in rows[depth]), rows  # two seeds aggregated
  assert rows["5"][1] == "div. 1/1"
  # Every method starts from the same weights at a seed and depth: SGD's one stage too.
  digests = {}
  assert all(len(r.init_digest) == 64 for r in records)  # the diverged run's too
  for r in records:
    point = (r.overrides["model_kwargs.depth"], r.overrides["seed"])
    digests.setdefault(point, {})[r.overrides["method"]] = r.init_digest
  for point, by_method in digests.items():
    assert len(set(by_method.values())) == 1 and len(by_method["pb"]) == 64, (point, by_method)
  assert digests[(4, 0)]["sgd"] != digests[(4, 1)]["sgd"] != digests[(6, 1)]["sgd"]
  assert "every group started from one set of weights" in report
  assert "Conclusions (generated from the table's statistics):" in report
  # The machine of each run (the trainers see as many devices as XLA_FLAGS gives them).
  assert re.search(rf"Machines \(runs\): \d+ x cpu \(cpu\), {os.cpu_count()} CPU cores \(8\)",
                   report), report
  assert (workdir / "gap_vs_depth.png").stat().st_size > 1000
  assert (workdir / "results.csv").read_text().count("\n") == 10
  # The rerun finds every run done and starts none.
  again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0 and "9 already done, 0 to run" in again.stdout
  assert len(study_records.read_results(str(workdir))) == 9


def test_a_study_that_fails_stops_its_trainers_first(tmp_path):
  """The trainers run in sessions of their own: a crashing study must not leave them running."""
  polite = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], 'w').write('saved'),"
            " sys.exit(75)))\n"
            "open(sys.argv[1] + '.up', 'w').close()\n"
            "time.sleep(60)\n")
  deaf = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "open(sys.argv[1] + '.up', 'w').close(); time.sleep(60)")
  polite_process = subprocess.Popen([sys.executable, "-c", polite, str(tmp_path / "a")],
                                    start_new_session=True)
  deaf_process = subprocess.Popen([sys.executable, "-c", deaf, str(tmp_path / "b")],
                                  start_new_session=True)
  while not ((tmp_path / "a.up").exists() and (tmp_path / "b.up").exists()):
    time.sleep(0.05)
  launcher.stop_trainers([polite_process, deaf_process], timeout=3)
  assert polite_process.returncode == 75 and (tmp_path / "a").read_text() == "saved"
  assert deaf_process.returncode == -9  # killed once the timeout passed


@pytest.mark.slow
def test_cli_adds_model_keywords_and_names_misspelt_keys(tmp_path):
  train = os.path.join(ROOT, "scripts", "train.py")
  typo = subprocess.run([sys.executable, train, "--config=configs/default.py:smoke",
                         "--config.methd=pb", f"--workdir={tmp_path}/a"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert typo.returncode == 2
  assert "--config.methd is not a field" in typo.stderr and "--config.method?" in typo.stderr
  assert "Traceback" not in typo.stderr
  keyword = subprocess.run([sys.executable, train, "--config=configs/default.py:smoke",
                            "--config.model_kwargs.normalizaton=layer",
                            f"--workdir={tmp_path}/b"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
  assert keyword.returncode != 0 and "Traceback" not in keyword.stderr
  assert "Did you mean 'normalization'" in keyword.stderr


def test_where_selects_runs_whose_value_is_one_of_the_alternatives(tmp_path):
  planned = launcher.outcome(STUDY, str(tmp_path),
                             {"model_kwargs.depth": "8", "method": "sgd|pb", "seed": "0|2"})
  assert sorted(planned.planned) == sorted(
      study_lib.run_id({"model_kwargs.depth": 8, "method": m, "seed": s})
      for m in ("sgd", "pb") for s in (0, 2))
  assert launcher.outcome(STUDY, str(tmp_path), {"method": "adam|sg"}).planned == []


def test_the_runner_and_the_report_count_the_same_records(tmp_path, fake_trainer, capsys):
  workdir = tmp_path / "study"
  workdir.mkdir()
  first = changed(study_records.skipped_record(TWO_RUNS, {"method": "sgd", "seed": 0}, 0),
               status=study_records.FINISHED, test_accuracy=0.5, init_digest="w0")
  (workdir / study_records.RESULTS_FILE).write_text(
      json.dumps(first.to_json()) + '\n{"run": "method=sgd,s')
  assert run_main(workdir, fake_trainer("finish")) == 0
  out = capsys.readouterr().out
  assert "ended in a line cut short" in out and "1 already done, 1 to run" in out
  assert "[2/2 done, 0 failed]" in out
  assert "2 of 2 runs recorded: 2 finished" in (workdir / "report.md").read_text()


def test_a_changed_fixed_value_is_refused_with_the_diff_and_hides_no_result(tmp_path,
                                                                             fake_trainer, capsys):
  assert run_main(tmp_path, fake_trainer("finish")) == 0
  other = dataclasses.replace(TWO_RUNS, fixed={"epochs": 2.0, "warmup_epochs": 0.5})
  for report_only in (False, True):
    assert run_main(tmp_path, fake_trainer("fail"), study=other, report_only=report_only) == 2
    err = capsys.readouterr().err
    assert "2 run(s) with epochs: 1.0 -> 2.0; warmup_epochs: (not set) -> 0.5" in err
    assert "restore the old values" in err and "another --workdir" in err
  statuses = {r.status for r in study_records.read_results(str(tmp_path))}
  assert statuses == {study_records.FINISHED}
  # A workdir where a changed recipe already recorded failures still shows its finished runs.
  finished = study_records.read_results(str(tmp_path))
  study_records.append_result(str(tmp_path), changed(finished[0], status=study_records.FAILED,
                                                     fixed={"epochs": 2.0}))
  assert study_records.read_results(str(tmp_path)) == finished


def test_a_trainer_stopped_by_someone_else_leaves_a_non_zero_exit_naming_the_run(
    tmp_path, fake_trainer, capsys):
  assert run_main(tmp_path, fake_trainer("stop-seed-1")) == launcher.EXIT_STOPPED
  out = capsys.readouterr().out
  assert "stopped method=sgd,seed=1 by a signal the study did not send" in out
  assert "[1/2 done, 0 failed]" in out
  assert "Not done (1, stopped before the end): method=sgd,seed=1. Rerun" in out
  assert run_main(tmp_path, fake_trainer("finish")) == 0  # the rerun completes the grid
  assert "1 already done, 1 to run" in capsys.readouterr().out


def test_a_full_or_read_only_disk_is_one_paragraph(tmp_path, fake_trainer, monkeypatch, capsys):
  def full(path, data):
    raise OSError(errno.ENOSPC, "No space left on device", path)
  monkeypatch.setattr(study_records.files, "append", full)
  assert run_main(tmp_path, fake_trainer("finish")) == 1
  err = capsys.readouterr().err
  assert err.startswith("error: Running the study failed: the disk holding")
  assert "is full" in err and "rerun the same command: finished runs are kept" in err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1

  def read_only(*args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "results.csv.tmp"))
  monkeypatch.setattr(study_report, "write_csv", read_only)
  assert run_main(tmp_path, (), report_only=True) == 1
  err = capsys.readouterr().err
  assert "Writing the report failed" in err and "results.csv.tmp cannot be written" in err
  assert len(err.strip().splitlines()) == 1


def test_trainers_that_share_an_accelerator_do_not_each_take_most_of_its_memory(tmp_path,
                                                                               monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  assert launcher._trainer_env(4, str(tmp_path))["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in launcher._trainer_env(1, str(tmp_path))
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")  # the user's own choice stands
  assert launcher._trainer_env(4, str(tmp_path))["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"


def test_trainers_started_together_each_check_their_share_of_the_memory(tmp_path, monkeypatch):
  """N trainers started at once each pass a check against the whole memory while their sum does
  not fit; under a study each checks its Nth."""
  from pipejax.train import run_checks  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv("PIPEJAX_TRAINERS_AT_ONCE", raising=False)
  whole, where = run_checks._memory_available()  # pylint: disable=protected-access
  assert where == "this machine's memory"
  env = launcher._trainer_env(4, str(tmp_path), at_once=3)  # pylint: disable=protected-access
  assert env["PIPEJAX_TRAINERS_AT_ONCE"] == "3"
  monkeypatch.setenv("PIPEJAX_TRAINERS_AT_ONCE", "3")
  share, where = run_checks._memory_available()  # pylint: disable=protected-access
  assert share == whole // 3
  assert where.startswith("its share of this machine's memory (1/3: the study runs 3 trainers")
  # A study of one run at a time leaves its trainer the whole memory, whatever the environment.
  alone = launcher._trainer_env(4, str(tmp_path), at_once=1)  # pylint: disable=protected-access
  assert "PIPEJAX_TRAINERS_AT_ONCE" not in alone


def test_more_trainings_at_once_than_cores_is_a_warning(tmp_path, fake_trainer, capsys,
                                                        monkeypatch):
  monkeypatch.setattr(launcher, "cpu_cores", lambda: 1)
  assert launcher.parallel_warning(1) is None
  assert run_main(tmp_path, fake_trainer("finish")) == 0  # two runs, two at a time, on one core
  out = capsys.readouterr().out
  assert "warning: 2 trainings at once (--parallel) on 1 CPU cores: each gets a share of a core" \
      in out and "Give --parallel=1 or less" in out


def test_the_eta_counts_the_last_runs_at_their_own_length():
  # One run left, running for 10 s of the 100 s a run takes: 90 s, not a quarter of 100 s.
  assert launcher.eta([100.0], [10.0], 0, 4) == pytest.approx(90.0)
  # Eight queued runs, four at a time: two rounds.
  assert launcher.eta([100.0, 100.0], [], 8, 4) == pytest.approx(200.0)
  # Two slots, one free in 10 s, one free now; three queued: they end at 100, 110 and 200 s.
  assert launcher.eta([100.0], [90.0], 3, 2) == pytest.approx(200.0)
  assert launcher.eta([], [5.0], 3, 2) is None  # no run finished: nothing to go by
  assert launcher.eta([100.0], [], 0, 2) == 0.0


def test_a_second_study_on_a_workdir_is_refused_naming_the_first(tmp_path, fake_trainer, capsys):
  with launcher.hold(str(tmp_path)):
    assert run_main(tmp_path, fake_trainer("fail")) == 1
  err = capsys.readouterr().err
  assert f"Another study (study process {os.getpid()} on " in err and "another --workdir" in err
  assert not (tmp_path / study_records.RESULTS_FILE).exists()
  with launcher.hold(str(tmp_path)):  # released with the first
    pass


def test_killing_the_study_stops_its_trainers_and_a_rerun_waits_for_them(tmp_path, fake_trainer,
                                                                         capsys):
  workdir = tmp_path / "study"
  process, trainers = start_study(workdir, fake_trainer("sleep"))
  process.kill()
  process.wait()
  assert all(alive(pid) for pid in trainers)  # still saving their checkpoints (one second)
  with launcher.hold(str(workdir), wait_s=30):
    assert not any(alive(pid) for pid in trainers)
    assert all((workdir / "runs" / f"method=sgd,seed={s}" / "saved").exists() for s in (0, 1))
  assert "has ended; waiting up to 30 s for the trainers" in capsys.readouterr().out


def test_a_stopped_study_stops_its_trainers_and_exits_75_naming_the_runs(tmp_path, fake_trainer):
  workdir = tmp_path / "study"
  process, trainers = start_study(workdir, fake_trainer("sleep"))
  process.send_signal(signal.SIGTERM)
  out = process.communicate(timeout=60)[0]
  assert process.returncode == launcher.EXIT_STOPPED, out
  assert not any(alive(pid) for pid in trainers)
  assert "SIGTERM: stopping" in out and "Not done (2, stopped before the end)" in out


def test_list_says_where_each_selected_run_stands_and_writes_nothing(tmp_path, capsys):
  """One run of each kind: finished, failed, running (its trainer's lock names a live process of
  this host), stopped (a checkpoint, no trainer) and never started."""
  study = Study(name="t", config="c.py", grids=[{"model_kwargs.depth": (4,), "method": ("sgd",),
                                                  "seed": (0, 1, 2, 3, 4)}])
  ids = [study_lib.run_id({"model_kwargs.depth": 4, "method": "sgd", "seed": s})
         for s in range(5)]
  records = [record("sgd", 4, 0, 0.8), record("sgd", 4, 1, 0.0, status=study_records.FAILED)]
  (tmp_path / study_records.RESULTS_FILE).write_text(
      "".join(json.dumps(r.to_json()) + "\n" for r in records))
  run_dirs = [tmp_path / "runs" / study_lib.directory_name(rid) for rid in ids]
  (run_dirs[2] / "checkpoints" / "250").mkdir(parents=True)
  (run_dirs[2] / ".lock").write_text(workdir_lib.this_process())
  (run_dirs[3] / "checkpoints" / "500").mkdir(parents=True)
  (run_dirs[3] / "checkpoints" / "1000").mkdir()
  (run_dirs[3] / "checkpoints" / "1500.orbax-checkpoint-tmp-1").mkdir()
  # A trainer that has ended leaves its lock's text behind: no longer running.
  (run_dirs[3] / ".lock").write_text(f"process {2 ** 22 + 1} on {os.uname().nodename}")
  before = sorted(str(p) for p in tmp_path.rglob("*"))
  assert run_main(tmp_path, (), study=study, list_only=True) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == (f"Study 't', {tmp_path}: 5 runs selected (1 finished, 1 failed, "
                      "1 running, 1 stopped, 1 to run).")
  assert lines[1:] == [
      f"finished: {ids[0]}", f"failed (retried on rerun): {ids[1]}",
      f"running (process {os.getpid()}, last checkpoint at 250 samples): {ids[2]}",
      f"stopped (last checkpoint at 1,000 samples: resumes from it on rerun): {ids[3]}",
      f"to run: {ids[4]}"]
  assert sorted(str(p) for p in tmp_path.rglob("*")) == before
  # A workdir not made yet: every run is to run, and it stays unmade.
  assert run_main(tmp_path / "new", (), study=study, list_only=True,
                  where={"seed": "0|1"}) == 0
  assert capsys.readouterr().out.splitlines()[1:] == [f"to run: {ids[0]}", f"to run: {ids[1]}"]
  assert not (tmp_path / "new").exists()
