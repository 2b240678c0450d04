"""Studies: grids, records, statistics over seeds, diverged runs, the runner, a real smoke study and
the committed studies' reports."""

import dataclasses
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from pipejax.study import statistics
from pipejax.study import spec as study_lib
from pipejax.study import cells as study_cells
from pipejax.study import figures as study_figures
from pipejax.study import records as study_records
from pipejax.study import report as study_report
from pipejax.study import launcher
from pipejax.study.spec import Study, Table

from tests.helpers import ROOT, as_from_a_terminal


def record(method, depth, seed, accuracy, status=study_records.FINISHED):
  overrides = {"model_kwargs.depth": depth, "method": method, "seed": seed}
  return {"run": study_lib.run_id(overrides), "overrides": overrides, "status": status,
          "test_accuracy": accuracy, "fixed": {}, "config": "c.py", "init_digest": f"w{seed}"}


STUDY = Study(name="t", config="c.py",
              grids=[{"model_kwargs.depth": (4, 8), "method": ("sgd", "pb"), "seed": (0, 1, 2)}],
              baseline={"method": "sgd"}, min_accuracy=0.5,
              tables=[Table("acc", rows="model_kwargs.depth", columns="method")])


def test_grids_are_the_union_of_products_without_duplicates():
  study = Study(name="t", config="c.py", grids=[{"a": (1, 2), "b": ("x",)},
                                                {"a": (2, 3), "b": ("x",)}])
  assert [r["a"] for r in study.runs()] == [1, 2, 3]
  assert study_lib.run_id({"a": 1, "b": (1, 2)}) == "a=1,b=(1,2)"
  assert study_lib.trainer_flags(Study(name="t", config="c", grids=[], fixed={"epochs": 2.0}),
                                 {"model_kwargs.hidden": (64,)}) == [
                                     "--config.epochs=2.0", "--config.model_kwargs.hidden=(64,)"]


def test_a_grid_point_listed_twice_in_another_order_is_one_run_everywhere():
  """One identity for a run (its run id, whatever the order of its keys): the grid runs it once,
  results.jsonl keeps one record of it, and a cell counts it once, never as two seeds."""
  study = Study(name="t", config="c.py", grids=[{"method": ("sgd",), "seed": (0,)},
                                                {"seed": (0,), "method": ("sgd", "pb")}])
  assert study.runs() == [{"method": "sgd", "seed": 0}, {"seed": 0, "method": "pb"}]
  assert study_lib.run_id({"seed": 0, "method": "pb"}) == "method=pb,seed=0"
  # Records of one run written under both orders (as a workdir of an older study holds them).
  first = record("sgd", 8, 0, 0.80)
  again = dict(first, run="seed=0,method=sgd,model_kwargs.depth=8", test_accuracy=0.81,
               overrides={"seed": 0, "method": "sgd", "model_kwargs.depth": 8})
  (cell,) = study_cells.gather_cells([first, again]).values()
  assert cell.values == [0.81] and cell.seeds == [0]
  assert study_report.format_cell(cell) == "81.00 (1 seed)"


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
  study_records.append_result(str(tmp_path), dict(done, run="seed=0,method=sgd",
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


def test_cells_average_over_seeds_and_never_average_diverged_runs():
  records = [record("pb", 8, 0, 0.80), record("pb", 8, 1, 0.84),
             record("pb", 8, 2, None, status=study_records.DIVERGED)]
  (cell,) = study_cells.gather_cells(records).values()
  assert cell.values == [0.80, 0.84] and cell.diverged == 1
  assert cell.mean == pytest.approx(0.82)
  assert cell.std == pytest.approx(np.std([0.80, 0.84], ddof=1))
  # 95% Student-t interval at n = 2: mean ± t(0.975, 1) s / sqrt(2), t(0.975, 1) = 12.7062.
  half = 12.7062 * np.std([0.80, 0.84], ddof=1) / np.sqrt(2) * 100
  assert study_report.format_cell(cell) == \
      f"82.00 [{82 - half:.2f}, {82 + half:.2f}] n=2 (1/3 div.)"
  all_diverged = study_cells.gather_cells([record("pb", 8, s, None, study_records.DIVERGED)
                                   for s in range(3)])
  assert study_report.format_cell(next(iter(all_diverged.values()))) == "div. 3/3"


def test_gaps_are_paired_by_seed_with_the_baseline_at_the_same_depth():
  records = [record("sgd", 8, 0, 0.85), record("sgd", 8, 1, 0.80),
             record("pb", 8, 0, 0.84), record("pb", 8, 1, 0.78),
             record("sgd", 4, 0, 0.50), record("pb", 4, 0, 0.90)]
  gaps = study_cells.gather_cells(records, "test_accuracy", {"method": "sgd"})
  cell = study_cells.lookup(gaps, {"model_kwargs.depth": 8, "method": "pb"})
  assert cell.values == pytest.approx([-0.01, -0.02])  # not 0.84 - mean(sgd) etc.
  assert study_cells.lookup(gaps, {"model_kwargs.depth": 4, "method": "pb"}).values == \
      pytest.approx([0.40])


def test_markdown_tables_and_stability_limit():
  records = [record(m, d, s, acc) for m, d, s, acc in [
      ("sgd", 4, 0, 0.9), ("sgd", 8, 0, 0.9), ("pb", 4, 0, 0.8), ("pb", 4, 1, 0.82)]]
  records.append(record("pb", 8, 0, None, study_records.DIVERGED))
  text = study_report.markdown_table(STUDY, records, STUDY.tables[0])
  lines = text.splitlines()
  assert lines[0] == "| stages | SGD | PB |"
  assert lines[2] == "| 4 | 90.00 (1 seed) | 81.00 [68.29, 93.71] n=2 |"
  assert lines[3] == "| 8 | 90.00 (1 seed) | div. 1/1 |"
  stability = Table("s", rows="model_kwargs.depth", columns="method", kind="stability")
  assert study_report.stable_limit(STUDY, records, stability, "pb") == (4, 8)
  assert study_report.stable_limit(STUDY, records, stability, "sgd") == (8, None)


def test_a_table_whose_rows_no_recorded_run_sets_says_so_instead_of_an_empty_header():
  # A sweep's table over the swept key, while only the runs at the recipe's value are recorded.
  sweep = Table("lr", rows="reference.lr", columns="method")
  records = [record("sgd", 4, 0, 0.9), record("pb", 4, 0, 0.8)]
  assert study_report.markdown_table(STUDY, records, sweep) == "(no runs recorded yet)"
  records.append({**record("pb", 4, 1, 0.7), "overrides": {"model_kwargs.depth": 4, "method": "pb",
                                                          "seed": 1, "reference.lr": 0.1}})
  assert study_report.markdown_table(STUDY, records, sweep).splitlines()[2] == (
      "| 0.1 | — | 70.00 (1 seed) |")


def test_a_point_that_failed_at_a_smaller_swept_value_is_skipped_beyond_it():
  sweep = Study(name="t", config="c.py", grids=[{"model_kwargs.depth": (4, 8, 16),
                                                 "method": ("sgd", "pb"), "seed": (0, 1)}],
                min_accuracy=0.5, skip_beyond_failure="model_kwargs.depth",
                tables=[Table("acc", rows="model_kwargs.depth", columns="method")])
  records = [record("sgd", 4, 0, 0.9), record("pb", 4, 0, 0.3),  # pb seed 0: trains badly at 4
             record("pb", 4, 1, 0.8), record("pb", 8, 1, None, study_records.DIVERGED)]
  point = lambda m, d, s: {"model_kwargs.depth": d, "method": m, "seed": s}
  assert study_records.failed_below(sweep, records, point("pb", 8, 0)) == 4
  assert study_records.failed_below(sweep, records, point("pb", 16, 1)) == 8
  assert study_records.failed_below(sweep, records, point("pb", 8, 1)) is None  # its own run
  assert study_records.failed_below(sweep, records, point("sgd", 8, 0)) is None  # sgd trained
  assert study_records.failed_below(STUDY, records, point("pb", 8, 0)) is None  # the study opts in
  skipped = study_records.skipped_record(sweep, point("pb", 16, 0), 4)
  assert skipped["reason"] == "failed at model_kwargs.depth=4"
  assert study_records.is_done(skipped, sweep, skipped["overrides"])
  records += [skipped, study_records.skipped_record(sweep, point("pb", 16, 1), 8)]
  lines = study_report.markdown_table(sweep, records, sweep.tables[0]).splitlines()
  assert lines[-1] == "| 16 | — | not run (failed below) |"


def test_tables_take_list_valued_axes_as_results_jsonl_gives_them_back():
  # A tuple override (a model's hidden widths) comes back from results.jsonl as a list.
  widths = Study(name="t", config="c.py", grids=[{"model_kwargs.hidden": ((8,), (8, 8)),
                                                  "method": ("sgd", "pb"), "seed": (0,)}],
                 tables=[Table("acc", rows="model_kwargs.hidden", columns="method")])
  records = [{"run": f"{m}{h}", "overrides": {"model_kwargs.hidden": list(h), "method": m,
                                              "seed": 0},
              "status": study_records.FINISHED, "test_accuracy": acc, "fixed": {}, "config": "c.py"}
             for m, h, acc in [("sgd", (8,), 0.9), ("pb", (8,), 0.8), ("sgd", (8, 8), 0.7)]]
  lines = study_report.markdown_table(widths, records, widths.tables[0]).splitlines()
  assert lines[2] == "| [8] | 90.00 (1 seed) | 80.00 (1 seed) |"
  assert lines[3] == "| [8, 8] | 70.00 (1 seed) | — |"


def test_a_failed_run_is_retried_and_a_finished_one_is_not():
  finished = record("pb", 8, 0, 0.8)
  failed = dict(finished, status=study_records.FAILED)
  overrides = finished["overrides"]
  assert study_records.is_done(finished, STUDY, overrides)
  assert not study_records.is_done(failed, STUDY, overrides)
  changed = Study(name="t", config="c.py", grids=STUDY.grids, fixed={"epochs": 3.0})
  assert not study_records.is_done(finished, changed, overrides)  # other settings: run again
  # Made before runs of a seed shared their starting weights: run again to be paired.
  assert not study_records.is_done({k: v for k, v in finished.items() if k != "init_digest"}, STUDY,
                               overrides)


def test_results_survive_a_line_cut_short(tmp_path):
  study_records.append_result(str(tmp_path), record("pb", 8, 0, 0.8))
  with open(tmp_path / study_records.RESULTS_FILE, "a") as f:
    f.write('{"run": "cut sho')
  assert [r["test_accuracy"] for r in study_records.read_results(str(tmp_path))] == [0.8]


def test_a_missing_study_file_is_a_clear_error():
  with pytest.raises(study_lib.StudyError, match="No study file"):
    study_lib.load_study("configs/studies/nope.py")
  with pytest.raises(study_lib.StudyError, match=r"depth.py: Unknown study argument 'smok'"):
    study_lib.load_study(os.path.join(ROOT, "configs", "studies", "depth.py:smok"))


def test_every_study_file_loads_with_its_smoke_variant():
  folder = os.path.join(ROOT, "configs", "studies")
  files = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
  assert len(files) >= 2
  for name in files:
    for arg in ("", ":smoke"):
      study = study_lib.load_study(os.path.join(folder, name) + arg)
      assert study.runs() and os.path.isfile(os.path.join(ROOT, study.config.partition(":")[0]))


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
  statuses = {r["run"]: r["status"] for r in records}
  assert statuses["method=pb,model_kwargs.depth=5,reference.lr=10000.0,seed=0"] == "diverged"
  point = next(r for r in records if r["status"] == "diverged")["divergence"]
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
  assert all(len(r["init_digest"]) == 64 for r in records)  # the diverged run's too
  for r in records:
    point = (r["overrides"]["model_kwargs.depth"], r["overrides"]["seed"])
    digests.setdefault(point, {})[r["overrides"]["method"]] = r["init_digest"]
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


def test_log_timing_splits_setup_compile_and_steady_rate(tmp_path):
  log = tmp_path / "log.txt"
  log.write_text("$ old invocation\nI1122 09:00:00.0 1 x] Model: ...\n"
                 "$ python scripts/train.py ...\n"
                 "I1122 23:59:50.000000 1 training.py:1] Unable to initialize backend 'tpu'\n"
                 "I1122 23:59:58.500000 1 training.py:2] Model: 32 stages; method pb\n"
                 "I1123 00:00:18.500000 1 training.py:3] [2000/60000 samples, epoch 0.03] ...\n"
                 "I1123 00:00:28.500000 1 training.py:3] [4000/60000 samples, epoch 0.07] ...\n"
                 "I1123 00:00:38.500000 1 training.py:3] [6000/60000 samples, epoch 0.10] ...\n")
  assert study_records.log_timing(str(log)) == {"setup_s": 8.5, "first_chunk_s": 20.0,
                                            "steady_samples_per_s": 200.0}


def test_intervals_and_paired_tests_match_scipy_and_the_t_table():
  from scipy import stats  # pylint: disable=import-outside-toplevel
  gaps = [0.0120, 0.0030, -0.0010, 0.0080, 0.0050]
  result = statistics.paired(gaps)
  reference = stats.ttest_1samp(gaps, 0.0)
  assert result.p_value == pytest.approx(reference.pvalue)
  # t(0.975, 4) = 2.7764 from the printed table.
  half = 2.7764 * np.std(gaps, ddof=1) / np.sqrt(len(gaps))
  assert (result.low, result.high) == pytest.approx((np.mean(gaps) - half, np.mean(gaps) + half),
                                                    abs=1e-6)
  assert statistics.interval([0.5]).n == 1 and np.isnan(statistics.interval([0.5]).low)


def test_margin_verdicts_are_one_and_two_one_sided_t_tests():
  from scipy import stats  # pylint: disable=import-outside-toplevel
  gaps = [0.0042, 0.0010, 0.0075]
  tests = statistics.margin_tests(gaps, 0.005)
  # Non-inferiority: H0 mean <= -m, i.e. a one-sided test of gaps + m > 0.
  shifted = stats.ttest_1samp(np.array(gaps) + 0.005, 0.0, alternative="greater")
  assert tests.non_inferiority_p == pytest.approx(shifted.pvalue)
  upper = stats.ttest_1samp(np.array(gaps) - 0.005, 0.0, alternative="less")
  assert tests.equivalence_p == pytest.approx(max(shifted.pvalue, upper.pvalue))
  assert tests.non_inferior and not tests.equivalent  # the mean sits near the upper margin
  assert statistics.margin_tests([0.001, -0.001, 0.0005, 0.0], 0.005).equivalent
  with pytest.raises(ValueError, match="margin"):
    statistics.margin_tests(gaps, 0.0)


def test_conclusions_follow_the_numbers_with_margin_verdicts():
  study = Study(name="t", config="c.py", grids=STUDY.grids, baseline={"method": "sgd"},
                margin=0.005, labels={"pb": "PB"},
                tables=[Table("gap", rows="model_kwargs.depth", columns="method", kind="gap")])
  records = [record("sgd", 8, s, a) for s, a in enumerate((0.85, 0.80, 0.83))]
  records += [record("pb", 8, s, a) for s, a in enumerate((0.84, 0.79, 0.82))]  # -1 point each
  (sentence,) = study_report.conclusions(study, records, study.tables[0])
  assert sentence.startswith("PB at stages = 8: below SGD (−1.00 points")
  assert "non-inferior at margin 0.50: not shown" in sentence
  records[3:] = [record("pb", 8, s, a) for s, a in enumerate((0.851, 0.80, 0.829))]
  (sentence,) = study_report.conclusions(study, records, study.tables[0])
  assert "no difference from SGD shown" in sentence and "equivalent within ±0.50: yes" in sentence
  # A table whose baseline the study's own name would mislead about names it itself.
  adam = dataclasses.replace(study.tables[0], baseline_label="Adam without a pipeline")
  (sentence,) = study_report.conclusions(study, records, adam)
  assert "no difference from Adam without a pipeline shown" in sentence


def test_a_run_that_ends_above_its_initial_loss_counts_as_diverged():
  finished = dict(record("pb", 8, 0, 0.31), test_loss=2.4, initial_test_loss=2.3)
  assert study_records.diverged(finished)
  assert not study_records.diverged(dict(finished, test_loss=0.9))
  assert study_records.diverged(dict(finished, test_loss=float("nan"), test_accuracy=0.1))
  (cell,) = study_cells.gather_cells([finished, dict(record("pb", 8, 1, 0.8), test_loss=0.5,
                                              initial_test_loss=2.3)]).values()
  assert cell.values == [0.8] and cell.diverged == 1


def test_stability_limits_are_intervals_between_a_trained_and_a_failed_value():
  sweep = Study(name="t", config="c.py", grids=[{"reference.lr": (0.1, 0.141, 0.2),
                                                 "method": ("pb",), "seed": (0, 1)}],
                min_accuracy=0.5, tables=[Table("s", rows="reference.lr", columns="method",
                                                kind="stability")])
  def run(lr, seed, accuracy):
    overrides = {"reference.lr": lr, "method": "pb", "seed": seed}
    return {"run": study_lib.run_id(overrides), "overrides": overrides, "config": "c.py",
            "status": study_records.FINISHED, "test_accuracy": accuracy, "fixed": {}}
  records = [run(0.1, 0, 0.8), run(0.1, 1, 0.8), run(0.141, 0, 0.8), run(0.141, 1, 0.1),
             run(0.2, 0, 0.1)]
  assert study_report.stable_limit(sweep, records, sweep.tables[0], "pb") == (0.1, 0.141)
  assert "| PB | 0.1 | 0.141 | [0.1, 0.141) |" in study_report.markdown_table(
      sweep, records, sweep.tables[0])


RATES = "method_kwargs.sgd.stage_rates"


def test_control_arms_pair_with_their_seeds_baseline_and_list_as_cells():
  def run(seed, accuracy, **overrides):
    overrides = {**overrides, "seed": seed}
    return {"run": study_lib.run_id(overrides), "overrides": overrides, "config": "c.py",
            "status": study_records.FINISHED, "test_accuracy": accuracy, "fixed": {},
            "init_digest": f"w{seed}"}
  records = [run(s, 0.80 + s / 100, method="sgd") for s in range(3)]
  records += [run(s, 0.81 + s / 100, method="pipemare") for s in range(3)]
  records += [run(s, 0.805 + s / 100, method="sgd", **{RATES: "pipemare"}) for s in range(3)]
  study = Study(name="c", config="c.py", grids=[{"method": ("sgd", "pipemare"), "seed": (0,)}],
                baseline={"method": "sgd"}, labels={RATES: "per-layer rates"},
                tables=[Table("t", rows="", columns="", kind="cells")])
  gaps = study_cells.gather_cells(records, "test_accuracy", study.baseline)
  rescheduled = study_cells.lookup(gaps, {RATES: "pipemare"})
  assert rescheduled.values == pytest.approx([0.005] * 3)  # paired with plain SGD, seed by seed
  lines = study_report.markdown_table(study, records, study.tables[0]).splitlines()
  assert lines[2].startswith("| SGD | 81.00 [") and lines[2].endswith("| baseline |")
  assert lines[3].startswith("| PipeMare | 82.00 [") and "| +1.00 [+1.00, +1.00] n=3" in lines[3]
  assert lines[4].startswith("| SGD, per-layer rates = pipemare | 81.50 [")


def test_a_table_with_its_own_baseline_pairs_with_that_baseline_and_names_it():
  # The study's baseline is Muon; a second table sets PipeDream + Muon against Adam's best.
  def run(method, seed, loss):
    overrides = {"method": method, "reference.lr": 0.002, "seed": seed}
    return {"run": study_lib.run_id(overrides), "overrides": overrides, "config": "c.py",
            "status": study_records.FINISHED, "test_loss": loss, "initial_test_loss": 5.0,
            "test_accuracy": 0.5, "fixed": {}, "init_digest": f"w{seed}"}
  adam = {0: 2.0, 1: 2.2, 2: 2.1}
  muon = {0: 1.7, 1: 1.8, 2: 1.75}
  pipelined = {0: 2.05, 1: 2.2, 2: 2.2}
  records = [run(m, s, v) for m, values in (("sgd", adam), ("muon", muon), ("pb", pipelined))
             for s, v in values.items()]
  against_adam = Table("against Adam", rows="reference.lr", columns="method", kind="gap",
                       metric="test_loss", scale=1.0, where=(("method", ("sgd", "pb")),),
                       baseline=(("method", "sgd"),))
  study = Study(name="b", config="c.py", grids=[{"method": ("muon",), "seed": (0,)}],
                baseline={"method": "muon"}, labels={"sgd": "Adam"}, margin=0.1,
                tables=[Table("against Muon", rows="reference.lr", columns="method", kind="gap",
                              metric="test_loss", scale=1.0), against_adam])
  by_adam = study_report.gap_cells(study, records, against_adam)
  by_muon = study_report.gap_cells(study, records, study.tables[0])
  assert study_cells.lookup(by_adam, {"method": "pb"}).values == pytest.approx(
      [pipelined[s] - adam[s] for s in range(3)])
  assert study_cells.lookup(by_muon, {"method": "pb"}).values == pytest.approx(
      [pipelined[s] - muon[s] for s in range(3)])
  lines = study_report.markdown_table(study, records, against_adam).splitlines()
  assert lines[0] == "| reference lr | PB | Adam |"
  assert lines[2].startswith("| 0.002 | +0.05 [") and lines[2].endswith("| baseline |")
  (sentence,) = study_report.conclusions(study, records, against_adam)
  assert sentence.startswith("PB at reference lr = 0.002: no difference from Adam shown (+0.05")
  # A 'cells' table with the same baseline: Adam's line is the baseline, PB's gap is to Adam.
  cells = dataclasses.replace(against_adam, kind="cells", baseline_label="")
  lines = study_report.markdown_table(study, records, cells).splitlines()
  assert lines[0] == "| run | test loss | gap to Adam |"
  assert len(lines) == 4 and lines[2].startswith("| Adam |") and lines[2].endswith("| baseline |")
  assert lines[3].startswith("| PB |") and "| +0.05 [" in lines[3]
  with pytest.raises(study_lib.StudyError, match="baseline must be a tuple of .config key, "
                                                 "value. pairs"):
    Study(name="b", config="c.py", grids=[], tables=[dataclasses.replace(
        against_adam, baseline={"method": "sgd"})])
  with pytest.raises(study_lib.StudyError, match="of kind 'tuned' takes the study's baseline"):
    Study(name="b", config="c.py", grids=[], tables=[dataclasses.replace(
        against_adam, kind="tuned")])


def test_a_baseline_fixed_at_its_best_rate_pairs_every_run_of_its_seed_and_is_named():
  def run(method, lr, seed, loss, **extra):
    overrides = {"reference.lr": lr, "method": method, "seed": seed, **extra}
    return {"run": study_lib.run_id(overrides), "overrides": overrides, "config": "c.py",
            "status": study_records.FINISHED, "test_loss": loss, "initial_test_loss": 5.0,
            "test_accuracy": 0.5, "fixed": {}, "init_digest": f"w{seed}"}
  records = [run("muon", 0.004, s, 1.0 + s) for s in range(2)]
  records += [run("muon", 0.002, s, 1.5 + s) for s in range(2)]
  records += [run("pb", 0.001, s, 1.25 + s, **{"method_kwargs.pb.smoothing": 0.9})
              for s in range(2)]
  study = Study(name="b", config="c.py", grids=[{"method": ("muon",), "seed": (0, 1)}],
                baseline={"method": "muon", "reference.lr": 0.004},
                baseline_name="Muon at 4e-3, the best baseline",
                tables=[Table("t", rows="", columns="", kind="cells", metric="test_loss")])
  gaps = study_cells.gather_cells(records, "test_loss", study.baseline)
  # Other rates and methods, with or without their own keys, pair with 4e-3 seed by seed.
  assert study_cells.lookup(gaps, {"reference.lr": 0.002}).values == pytest.approx([0.5, 0.5])
  assert study_cells.lookup(gaps, {"method": "pb"}).values == pytest.approx([0.25, 0.25])
  assert "| gap to Muon at 4e-3, the best baseline |" in study_report.markdown_table(
      study, records, study.tables[0])
  # A table of one method alone still pairs with the baseline's runs, which it does not show.
  alone = Table("pb alone", rows="", columns="", kind="cells", metric="test_loss",
                where=(("method", "pb"),))
  rows = study_report.markdown_table(study, records, alone).splitlines()[2:]
  assert len(rows) == 1 and "| +25.00 [+25.00, +25.00] n=2" in rows[0]
  # A tuple in ``where`` takes any of its values: here the baseline's rate and pb's.
  either = Table("either", rows="", columns="", kind="cells", metric="test_loss",
                 where=(("reference.lr", (0.004, 0.001)),))
  rows = study_report.markdown_table(study, records, either).splitlines()[2:]
  assert len(rows) == 2 and "| baseline |" in rows[0] and "n=2" in rows[1]
  # A tuple of keys takes combinations: Muon at 2e-3 and pb at 1e-3, not Muon at 4e-3.
  joint = study_cells.select(records, ((("method", "reference.lr"),
                                        (("muon", 0.002), ("pb", 0.001))),))
  assert sorted((r["overrides"]["method"], r["overrides"]["reference.lr"]) for r in joint) == [
      ("muon", 0.002), ("muon", 0.002), ("pb", 0.001), ("pb", 0.001)]
  # A combination of keys given one value would match nothing: refused.
  with pytest.raises(study_lib.StudyError, match=r"Study 'b', table 'either': where's keys "
                                                 r"\('method', 'reference.lr'\) take a tuple of "
                                                 r"combinations of 2 values"):
    Study(name="b", config="c.py", grids=[], tables=[dataclasses.replace(
        either, where=((("method", "reference.lr"), ("muon", 0.002)),))])
  # A gap table whose axes leave out a baseline key (b2) still names the baseline's cell.
  with_b2 = [run("muon", lr, s, 1.0 + lr + s, **{"reference.b2": 0.99}) for lr in (0.004, 0.002)
             for s in range(2)]
  gap = Table("gap", rows="reference.lr", columns="method", kind="gap", metric="test_loss")
  study = dataclasses.replace(study, baseline={**study.baseline, "reference.b2": 0.99},
                              tables=[gap])
  rows = study_report.markdown_table(study, with_b2, gap).splitlines()[2:]
  assert [row.split(" | ")[0] for row in rows if "baseline" in row] == ["| 0.004"]
  assert len(study_report.conclusions(study, with_b2, gap)) == 1  # none of the baseline itself


def test_tuned_tables_compare_each_method_at_its_best_value():
  def run(method, lr, seed, accuracy):
    overrides = {"reference.lr": lr, "method": method, "seed": seed}
    return {"run": study_lib.run_id(overrides), "overrides": overrides, "config": "c.py",
            "status": study_records.FINISHED, "test_accuracy": accuracy, "fixed": {},
            "init_digest": f"w{seed}"}
  records = [run("sgd", 0.1, s, 0.80) for s in range(2)] + \
      [run("sgd", 0.05, s, 0.82 + s / 100) for s in range(2)] + \
      [run("pb", 0.1, s, 0.83) for s in range(2)] + [run("pb", 0.05, s, 0.81) for s in range(2)]
  study = Study(name="t", config="c.py", grids=[{"reference.lr": (0.05, 0.1),
                                                 "method": ("sgd", "pb"), "seed": (0, 1)}],
                baseline={"method": "sgd"},
                tables=[Table("t", rows="reference.lr", columns="method", kind="tuned")])
  table = study_report.markdown_table(study, records, study.tables[0])
  assert "| SGD | 0.05 | 82.50 [" in table
  # PB at its best (0.1: 0.83) against SGD at its best (0.05: 0.82, 0.83), seed by seed.
  assert "| PB | 0.1 | 83.00 [83.00, 83.00] n=2 | +0.50 [−5.85, +6.85] n=2 p=0.5 |" in table


def test_figures_put_diverged_runs_in_a_band_of_their_own(tmp_path):
  from pipejax.study.spec import Figure  # pylint: disable=import-outside-toplevel
  records = [record("sgd", 4, 0, 0.9), record("sgd", 8, 0, 0.9), record("pb", 4, 0, 0.8),
             record("pb", 8, 0, None, study_records.DIVERGED), record("pb", 8, 1, 0.7)]
  figure = Figure("f.png", x="model_kwargs.depth", series="method", title="Accuracy by depth")
  series = dict((s, (points, failed)) for s, points, failed in
                study_figures.cell_points(STUDY, records, figure))
  assert series["pb"] == ([(4, 80.0, 0.0), (8, 70.0, 0.0)], [(8, "1/2")])
  assert study_figures.draw_figure(STUDY, records, figure, str(tmp_path / "f.png"))
  assert (tmp_path / "f.png").stat().st_size > 1000
# ------------------------------------------------------------- the runner, with stand-in trainers

# Takes a trainer's flags; its first argument says how it behaves. On SIGTERM it takes a moment
# (a checkpoint), then exits 75 as scripts/train.py does.
FAKE_TRAINER = """
import json, os, signal, sys, time
mode = sys.argv[1]
flag = lambda name: [a.split("=", 1)[1] for a in sys.argv if a.startswith(name + "=")][0]
workdir, seed = flag("--workdir"), flag("--config.seed")

def stop(*_):
  time.sleep(1)
  open(os.path.join(workdir, "saved"), "w").close()
  sys.exit(75)

signal.signal(signal.SIGTERM, stop)
open(os.path.join(workdir, "pid"), "w").write(str(os.getpid()))
if mode == "sleep":
  time.sleep(120)
if mode == "stop-seed-1" and seed == "1":
  print("STOPPED by SIGTERM after 0 samples; rerun to resume.")
  sys.exit(75)
if mode == "fail":
  sys.exit("error: no trainer should have started")
with open(os.path.join(workdir, "summary.json"), "w") as f:
  json.dump({"test_accuracy": 0.5 + int(seed) / 10, "test_loss": 1.0, "stopped_by": None,
             "init_digest": "w" + seed}, f)
"""

TWO_RUNS = Study(name="two", config="configs/default.py:smoke",
                 grids=[{"method": ("sgd",), "seed": (0, 1)}], fixed={"epochs": 1.0})


@pytest.fixture
def fake_trainer(tmp_path):
  path = tmp_path / "fake_train.py"
  path.write_text(FAKE_TRAINER)
  return lambda mode: (sys.executable, str(path), mode)


def run_main(workdir, trainer, study=TWO_RUNS, **kwargs):
  return launcher.main(study, str(workdir), parallel=2, command="", trainer=trainer, **kwargs)


def test_a_cut_line_is_set_aside_and_never_swallows_the_next_record(tmp_path, monkeypatch):
  study_records.append_result(str(tmp_path), record("pb", 8, 0, 0.8))
  results = tmp_path / study_records.RESULTS_FILE
  with open(results, "ab") as f:
    f.write(b'{"run": "cut sho')
  message = study_records.append_result(str(tmp_path), record("pb", 8, 1, 0.7))
  assert [r["test_accuracy"] for r in study_records.read_results(str(tmp_path))] == [0.8, 0.7]
  assert "moved it to" in message and "results.jsonl.partial-1" in message
  assert (tmp_path / "results.jsonl.partial-1").read_bytes() == b'{"run": "cut sho'
  # A full disk: the one write of a record is cut short. The record is lost, the next is not.
  real_write = os.write
  with monkeypatch.context() as patch:
    patch.setattr(os, "write", lambda fd, data: real_write(fd, data[:20]))
    with pytest.raises(OSError, match="No space left"):
      study_records.append_result(str(tmp_path), record("pb", 8, 2, 0.6))
  assert study_records.append_result(str(tmp_path), record("pb", 8, 3, 0.5)) is not None
  assert [r["test_accuracy"] for r in study_records.read_results(str(tmp_path))] == [0.8, 0.7, 0.5]
  assert (tmp_path / "results.jsonl.partial-2").stat().st_size == 20
  # A cut line that lacks only its newline is a whole record: it is kept.
  with open(results, "ab") as f:
    f.write(json.dumps(record("sgd", 8, 0, 0.9)).encode())
  assert study_records.append_result(str(tmp_path), record("sgd", 8, 1, 0.4)) is None
  assert len(study_records.read_results(str(tmp_path))) == 5


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
  first = dict(study_records.skipped_record(TWO_RUNS, {"method": "sgd", "seed": 0}, 0),
               status=study_records.FINISHED, test_accuracy=0.5, init_digest="w0")
  (workdir / study_records.RESULTS_FILE).write_text(json.dumps(first) + '\n{"run": "method=sgd,s')
  assert run_main(workdir, fake_trainer("finish")) == 0
  out = capsys.readouterr().out
  assert "ended in a line cut short" in out and "1 already done, 1 to run" in out
  assert "[2/2 done, 0 failed]" in out
  assert "2 of 2 runs recorded: 2 finished" in (workdir / "report.md").read_text()


def test_lines_that_are_json_but_not_records_are_skipped_and_named(tmp_path, capsys):
  good = [record("pb", 8, 0, 0.8), record("pb", 8, 1, 0.7)]
  lines = [json.dumps(good[0]), "null", "[1, 2]", "{}", '{"run": "x"}', '{"run": "y", "ov',
           json.dumps(good[1])]
  (tmp_path / study_records.RESULTS_FILE).write_text("\n".join(lines) + "\n")
  records, problems = study_records.load_results(str(tmp_path))
  assert records == good
  assert [p.split(" is skipped")[0].rsplit(" ", 1)[1] for p in problems] == ["2", "3", "4", "5",
                                                                           "6"]
  assert "it is null, not a record" in problems[0] and "it is an array" in problems[1]
  assert "no 'run' id" in problems[2] and "no 'overrides'" in problems[3]
  assert "not JSON" in problems[4]
  study = Study(name="t", config="c.py", grids=STUDY.grids, tables=STUDY.tables)
  assert run_main(tmp_path, (), study=study, report_only=True) == 0
  out = capsys.readouterr().out
  assert out.count("warning:") == 5 and "line 5 is skipped" in out
  assert "2 of 12 runs recorded" in (tmp_path / "report.md").read_text()


def test_a_changed_fixed_value_is_refused_with_the_diff_and_hides_no_result(tmp_path,
                                                                             fake_trainer, capsys):
  assert run_main(tmp_path, fake_trainer("finish")) == 0
  changed = dataclasses.replace(TWO_RUNS, fixed={"epochs": 2.0, "warmup_epochs": 0.5})
  for report_only in (False, True):
    assert run_main(tmp_path, fake_trainer("fail"), study=changed, report_only=report_only) == 2
    err = capsys.readouterr().err
    assert "2 run(s) with epochs: 1.0 -> 2.0; warmup_epochs: (not set) -> 0.5" in err
    assert "restore the old values" in err and "another --workdir" in err
  statuses = {r["status"] for r in study_records.read_results(str(tmp_path))}
  assert statuses == {study_records.FINISHED}
  # A workdir where a changed recipe already recorded failures still shows its finished runs.
  finished = study_records.read_results(str(tmp_path))
  study_records.append_result(str(tmp_path), dict(finished[0], status=study_records.FAILED,
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


STUDY_PROCESS = """
import sys
from pipejax.study import launcher
from pipejax.study.spec import Study
study = Study(name="two", config="c.py", grids=[{"method": ("sgd",), "seed": (0, 1)}])
sys.exit(launcher.main(study, sys.argv[1], parallel=2, command="", trainer=sys.argv[2:]))
"""


def start_study(workdir, trainer):
  process = subprocess.Popen([sys.executable, "-c", STUDY_PROCESS, str(workdir), *trainer],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                             preexec_fn=as_from_a_terminal)
  pids = [workdir / "runs" / f"method=sgd,seed={s}" / "pid" for s in (0, 1)]
  deadline = time.time() + 60
  while not all(p.exists() and p.read_text() for p in pids):
    assert time.time() < deadline and process.poll() is None, process.communicate()[0]
    time.sleep(0.05)
  return process, [int(p.read_text()) for p in pids]


def alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/stat") as f:  # a trainer reaped by no one yet is a zombie: ended
    return f.read().rpartition(")")[2].split()[0] != "Z"


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


def test_reports_leave_out_runs_made_before_starting_weights_were_matched():
  old = {k: v for k, v in record("pb", 8, 0, 0.7).items() if k != "init_digest"}
  new = record("pb", 4, 0, 0.8)
  kept, left_out = study_report.paired_records([old, new])
  assert kept == [new] and left_out == 1
  assert study_report.paired_records([old]) == ([old], 0)  # nothing matched yet: shown, flagged


def test_numeric_rows_ascend_across_grids_and_names_keep_the_files_order():
  """A stability study refines each method's range in a grid of its own: its table's rows must
  still read as one ascending ladder, while methods keep the order the study file gives them."""
  study = Study(name="ladder", config="configs/default.py:smoke",
                grids=[{"method": ("sgd", "pb"), "lr": (1.6, 3.2)},
                       {"method": ("pipedream",), "lr": (0.4, 0.8)}])
  assert study_cells.ordered(study, "lr", [1.6, 3.2, 0.4, 0.8]) == [0.4, 0.8, 1.6, 3.2]
  assert study_cells.ordered(study, "method", ["pipedream", "pb", "sgd"]) == [
      "sgd", "pb", "pipedream"]


def _loss_record(method, depth, seed, loss):
  r = record(method, depth, seed, 0.5)
  return {**r, "test_loss": loss, "initial_test_loss": 5.0}


def test_a_loss_is_better_smaller_in_margin_verdicts_and_the_best_rate():
  study = Study(name="t", config="c.py", grids=STUDY.grids, baseline={"method": "sgd"},
                margin=0.02, labels={"pb": "PB"},
                tables=[Table("gap", rows="model_kwargs.depth", columns="method", kind="gap",
                              metric="test_loss", scale=1.0)])
  table = study.tables[0]
  assert not table.higher_is_better and Table("a", rows="r", columns="c").higher_is_better
  assert not Table("s", rows="r", columns="c", metric="samples_to:0.85").higher_is_better
  base = [_loss_record("sgd", 8, s, v) for s, v in enumerate((2.00, 2.10, 2.05))]
  # Half a margin worse (higher loss) on every seed: non-inferior, as it would be for accuracy
  # half a margin lower; read as accuracy (higher better) the same gaps would be "above".
  worse = [_loss_record("pb", 8, s, v + 0.01) for s, v in enumerate((2.00, 2.10, 2.05))]
  (sentence,) = study_report.conclusions(study, base + worse, table)
  assert "non-inferior at margin 0.02: yes" in sentence
  # Five margins worse: not non-inferior (on the old, accuracy-only reading it was).
  much_worse = [_loss_record("pb", 8, s, v + 0.1 + 0.001 * s)
                for s, v in enumerate((2.00, 2.10, 2.05))]
  (sentence,) = study_report.conclusions(study, base + much_worse, table)
  assert "non-inferior at margin 0.02: not shown" in sentence
  margin_sentence = study_report._margin_sentence  # pylint: disable=protected-access
  assert "better smaller" in margin_sentence(study)
  # A study with no gap table yet (a baselines phase) states its margin in its tables' unit, not
  # in accuracy points.
  cells_only = Study(name="t", config="c.py", grids=[{"method": ("sgd",), "seed": (0,)}],
                     margin=0.02 / 1.4427, tables=[Table(
                         "cells", rows="method", columns="method", kind="cells",
                         metric="test_loss", scale=1.4427, unit="bits per byte")])
  sentence = study_report._margin_sentence(cells_only)  # pylint: disable=protected-access
  assert "0.02 bits per byte" in sentence and "points" not in sentence
  # The best rate of a loss is its lowest mean.
  sweep = Study(name="t", config="c.py",
                grids=[{"reference.lr": (0.1, 0.2), "method": ("sgd",), "seed": (0,)}],
                tables=[Table("tuned", rows="reference.lr", columns="method", kind="tuned",
                              metric="test_loss")])
  records = []
  for lr, loss in ((0.1, 3.0), (0.2, 2.0)):
    overrides = {"reference.lr": lr, "method": "sgd", "seed": 0}
    records.append({"run": study_lib.run_id(overrides), "overrides": overrides,
                    "status": study_records.FINISHED, "test_accuracy": 0.5, "test_loss": loss,
                    "initial_test_loss": 5.0, "fixed": {}, "config": "c.py", "init_digest": "w"})
  assert study_report.best_value(sweep, records, sweep.tables[0], "sgd") == 0.2


# ------------------------------------------------------------- figures of a loss, report sections

BITS = 1 / np.log(2)  # a loss in nats drawn in bits


def drawn_figure(study, records, figure, path, monkeypatch):
  """Draws ``figure`` and returns the matplotlib figure it saved, to read its axes."""
  saved, real_save = [], study_figures.plotting.save
  monkeypatch.setattr(study_figures.plotting, "save",
                      lambda fig, p: (saved.append(fig), real_save(fig, p)))
  assert study_figures.draw_figure(study, records, figure, str(path))
  (fig,) = saved
  return fig


def test_a_loss_gap_figure_draws_method_minus_baseline_paired_by_seed(tmp_path, monkeypatch):
  from pipejax.study.spec import Figure  # pylint: disable=import-outside-toplevel
  losses = {("sgd", 4): (1.90, 1.95, 1.92), ("pb", 4): (1.88, 1.96, 1.90),
            ("sgd", 8): (2.00, 2.10, 2.05), ("pb", 8): (2.03, 2.11, 2.09)}
  records = [_loss_record(m, d, s, v) for (m, d), values in losses.items()
             for s, v in enumerate(values)]
  figure = Figure("gap.png", x="model_kwargs.depth", series="method", kind="gap",
                  metric="test_loss", scale=BITS, unit="bits per byte")
  ((series, points, failed),) = study_figures.cell_points(STUDY, records, figure)
  assert series == "pb" and failed == []
  for (x, mean, half), depth in zip(points, (4, 8)):
    gaps = np.subtract(losses[("pb", depth)], losses[("sgd", depth)])  # method - baseline
    # 95% paired interval at n = 3: t(0.975, 2) = 4.3027 from the printed table.
    assert x == depth
    assert mean == pytest.approx(gaps.mean() * BITS)
    assert half == pytest.approx(4.3027 * gaps.std(ddof=1) / np.sqrt(3) * BITS, rel=1e-4)
  assert points[1][1] > 0  # pb's loss is higher at 8 stages: a positive gap, the worse one
  # The table of the same gap shows the same number, with the same sign.
  table = Table("gap", rows="model_kwargs.depth", columns="method", kind="gap",
                metric="test_loss", scale=BITS)
  row = study_report.markdown_table(STUDY, records, table).splitlines()[3]
  assert row.startswith(f"| 8 | baseline | +{points[1][1]:.2f} [")
  fig = drawn_figure(STUDY, records, figure, tmp_path / "gap.png", monkeypatch)
  assert fig.axes[0].get_ylabel() == "test loss gap to SGD (bits per byte; lower is better)"
  (errorbar,) = fig.axes[0].containers  # the pb series: its line of means
  assert list(errorbar.lines[0].get_ydata()) == pytest.approx([mean for _, mean, _ in points])


def _curve_record(method, seed, curve):
  return {**record(method, 8, seed, curve[-1][1]), "test_curve": curve, "test_loss": curve[-1][2],
          "initial_test_loss": 5.0}


CURVE_SAMPLES = (400, 1200, 2000, 2800, 3600, 4000)


def _curves_records():
  """Two seeds of two methods whose accuracy and loss curves differ: a loss read from the
  accuracy's column, or an accuracy from the loss's, gives other numbers."""
  accuracy = (0.30, 0.60, 0.70, 0.72, 0.74, 0.75)
  loss = (4.0, 2.5, 2.0, 1.8, 1.7, 1.65)
  records = []
  for m, shift in (("sgd", 0.0), ("pb", 0.05)):
    for seed in (0, 1):
      records.append(_curve_record(m, seed, [
          [n, a - shift / 10 + seed / 100, l + shift + seed / 100]
          for n, a, l in zip(CURVE_SAMPLES, accuracy, loss)]))
  return records


def test_loss_curves_read_the_loss_column_times_the_scale_and_zoom_on_it(tmp_path, monkeypatch):
  from pipejax.study.spec import Figure  # pylint: disable=import-outside-toplevel
  records = _curves_records()
  figure = Figure("c.png", x="samples", series="method", kind="curves", metric="test_loss",
                  scale=BITS, unit="bits per byte", where=(("model_kwargs.depth", 8),))
  fig = drawn_figure(STUDY, records, figure, tmp_path / "c.png", monkeypatch)
  ax, zoom = fig.axes
  assert ax.get_ylabel() == "test loss (bits per byte)"
  sgd = [(a[2] + b[2]) / 2 * BITS for a, b in zip(records[0]["test_curve"],
                                                  records[1]["test_curve"])]
  assert list(ax.lines[0].get_xdata()) == list(CURVE_SAMPLES)
  assert list(ax.lines[0].get_ydata()) == pytest.approx(sgd)
  # The zoom holds the last three quarters (from 1000 samples) and leaves out the first loss.
  tail = [v for line in zoom.lines for x, v in zip(line.get_xdata(), line.get_ydata())
          if x >= 1000]
  low, high = zoom.get_ylim()
  assert low < min(tail) and max(tail) < high < 4.0 * BITS
  assert zoom.get_xlim()[0] == pytest.approx(1000)
  accuracy = Figure("a.png", x="samples", series="method", kind="curves",
                    where=(("model_kwargs.depth", 8),))
  fig = drawn_figure(STUDY, records, accuracy, tmp_path / "a.png", monkeypatch)
  assert list(fig.axes[0].lines[0].get_ydata()) == pytest.approx(
      [(a[1] + b[1]) / 2 * 100 for a, b in zip(records[0]["test_curve"], records[1]["test_curve"])])
  with pytest.raises(study_lib.StudyError, match="curves are recorded of test_accuracy and"):
    Study(name="t", config="c.py", grids=[], figures=[
        dataclasses.replace(accuracy, metric="samples_to:0.7")])


def test_the_axes_of_accuracy_figures_read_as_before(tmp_path, monkeypatch):
  from pipejax.study.spec import Figure  # pylint: disable=import-outside-toplevel
  records = [record(m, d, s, 0.8 + s / 100 + (m == "pb") / 50)
             for m in ("sgd", "pb") for d in (4, 8) for s in range(3)]
  mean = Figure("m.png", x="model_kwargs.depth", series="method", threshold=0.7)
  fig = drawn_figure(STUDY, records, mean, tmp_path / "m.png", monkeypatch)
  assert fig.axes[0].get_ylabel() == "test accuracy (%)"
  assert "threshold 70%" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
  gap = Figure("g.png", x="model_kwargs.depth", series="method", kind="gap")
  fig = drawn_figure(STUDY, records, gap, tmp_path / "g.png", monkeypatch)
  assert fig.axes[0].get_ylabel() == "test accuracy gap to SGD (points)"
  assert study_figures.cell_points(STUDY, records, gap)[0][1][0][1] == pytest.approx(2.0)
  curves = Figure("c.png", x="samples", series="method", kind="curves",
                  where=(("model_kwargs.depth", 8),))
  fig = drawn_figure(STUDY, _curves_records(), curves, tmp_path / "c.png", monkeypatch)
  assert fig.axes[0].get_ylabel() == "test accuracy (%)"


def _sectioned_study(*sections):
  from pipejax.study.spec import Figure  # pylint: disable=import-outside-toplevel
  return dataclasses.replace(
      STUDY, figures=[Figure("f.png", x="model_kwargs.depth", series="method", title="By depth")],
      sections=sections)


def _write_records(workdir):
  for m, d, s, acc in [("sgd", 4, 0, 0.9), ("pb", 4, 0, 0.8), ("sgd", 8, 0, 0.85)]:
    study_records.append_result(str(workdir), record(m, d, s, acc))


def test_sections_follow_the_figures_in_order(tmp_path):
  from pipejax.study import Section  # pylint: disable=import-outside-toplevel
  _write_records(tmp_path)
  seen = []
  def computed(records, workdir):
    seen.append((len(records), workdir))
    return f"{len(records)} runs, by a function."
  study = _sectioned_study(Section("Notes", "Written by hand.\n\nTwo paragraphs."),
                           Section("Computed", computed))
  text = study_report.write_report(study, str(tmp_path))
  assert (tmp_path / "report.md").read_text() == text
  assert seen == [(3, str(tmp_path))]
  figure = text.index("![By depth](f.png)")
  assert text.index("## acc") < figure
  assert text[figure:] == ("![By depth](f.png)\n\n## Notes\n\nWritten by hand.\n\nTwo paragraphs."
                           "\n\n## Computed\n\n3 runs, by a function.\n")


def test_a_section_whose_function_raises_is_a_note_and_the_rest_stays(tmp_path, caplog):
  from pipejax.study import Section  # pylint: disable=import-outside-toplevel
  _write_records(tmp_path)
  def broken(records, workdir):
    raise FileNotFoundError("no samples.txt in the workdir\n(run the sampler first)")
  study = _sectioned_study(Section("Samples", broken), Section("After", "Still here."))
  whole = study_report.write_report(_sectioned_study(Section("After", "Still here.")),
                                    str(tmp_path))
  with caplog.at_level("WARNING"):
    text = study_report.write_report(study, str(tmp_path))
  note = ("## Samples\n\nThis section could not be generated: FileNotFoundError: no samples.txt "
          "in the workdir (run the sampler first).\n\n")
  assert text == whole.replace("## After", note + "## After")
  assert (tmp_path / "report.md").read_text() == text and (tmp_path / "f.png").exists()
  assert any("Samples" in r.getMessage() and "no samples.txt" in r.getMessage()
             and r.levelname == "WARNING" for r in caplog.records)


def test_a_section_that_is_not_one_is_refused_in_one_line():
  from pipejax.study import Section  # pylint: disable=import-outside-toplevel
  for sections, message in [((("Notes", "text"),), "each section must be a pipejax.study.Section"),
                            ((Section("  ", "text"),), "a section needs a title"),
                            ((Section(None, "text"),), "a section needs a title"),
                            ((Section("Notes", 3),), "must be markdown text or a function"),
                            (Section("Notes", "text"), "sections must be a list")]:
    with pytest.raises(study_lib.StudyError, match=message) as error:
      dataclasses.replace(STUDY, sections=sections)
    assert "\n" not in str(error.value)


# ------------------------------------------------------------- reports written side by side; labels


def test_a_report_written_while_another_is_being_written_never_collides(tmp_path, monkeypatch):
  """A second writer (``--report_only`` beside the study) starts while the first is between
  drawing its figure and renaming it: both finish, each with its own temporary files."""
  import threading  # pylint: disable=import-outside-toplevel
  from matplotlib import figure as figure_lib  # pylint: disable=import-outside-toplevel
  _write_records(tmp_path)
  study = _sectioned_study()
  real_savefig, second, errors = figure_lib.Figure.savefig, [], []

  def write_beside():
    try:
      study_report.write_report(study, str(tmp_path))
    except Exception as e:  # noqa: BLE001 - the test reports it below
      errors.append(e)

  def savefig_with_a_second_writer(self, *args, **kwargs):
    real_savefig(self, *args, **kwargs)
    if not second:  # the first writer's figure is drawn but not renamed yet
      second.append(threading.Thread(target=write_beside))
      second[0].start()
      second[0].join(timeout=2)  # a second writer that waits for the first stays waiting

  monkeypatch.setattr(figure_lib.Figure, "savefig", savefig_with_a_second_writer)
  text = study_report.write_report(study, str(tmp_path))
  second[0].join(timeout=60)
  assert not errors and not second[0].is_alive()
  assert (tmp_path / "report.md").read_text() == text
  assert sorted(os.listdir(tmp_path)) == [".report.lock", "f.png", "report.md", "results.csv",
                                          "results.jsonl"]


def test_labels_of_any_script_draw_without_glyph_warnings(tmp_path, caplog):
  """'β₁ − 0.9' is drawn as it is (DejaVu Sans has it); characters no installed font has are
  drawn as '?' and named once in the log, never as empty boxes with a warning each."""
  import warnings  # pylint: disable=import-outside-toplevel
  from pipejax import plotting  # pylint: disable=import-outside-toplevel
  _write_records(tmp_path)
  study = dataclasses.replace(_sectioned_study(), labels={"pb": "β₁ − 0.9", "sgd": "学習率"})
  drawn = []
  real_save = plotting.save

  def save_and_keep(fig, path, **kwargs):
    real_save(fig, path, **kwargs)
    drawn.extend(t.get_text() for t in fig.axes[0].get_legend().get_texts())

  with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING"):
    warnings.simplefilter("always")
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(study_figures.plotting, "save", save_and_keep)
      for _ in range(2):
        study_report.write_report(study, str(tmp_path))
  assert [str(w.message) for w in caught] == []
  cjk = all(plotting._font_with(c) for c in "学習率")  # pylint: disable=protected-access
  assert drawn[:2] == ["学習率" if cjk else "???", "β₁ − 0.9"]
  named = [r for r in caplog.records if "no installed font has" in r.getMessage()]
  assert len(named) == (0 if cjk else 1)


def test_records_written_with_a_renamed_field_read_under_its_new_key(tmp_path):
  """A study's records keep the config keys they were run with; a field since moved into
  config.method_kwargs (pipejax.config.RENAMED_FIELDS) is read under its new key, so the study
  file that uses the new key finds its runs done and reports them as before."""
  def old_record(seed, accuracy, **overrides):
    overrides = {"method": "pipemare", **overrides, "seed": seed}
    return {"run": ",".join(f"{k}={v}" for k, v in sorted(overrides.items())),
            "overrides": overrides, "fixed": {"epochs": 1.0, "pipemare_anneal_fraction": 0.1},
            "config": "c.py", "status": study_records.FINISHED, "test_accuracy": accuracy,
            "init_digest": f"w{seed}", "wall_seconds": 1.0}
  lines = [old_record(s, 0.8) for s in (0, 1)]
  lines += [old_record(s, 0.7, pipemare_anneal_epochs=0.0) for s in (0, 1)]
  (tmp_path / study_records.RESULTS_FILE).write_text(
      "".join(json.dumps(line) + "\n" for line in lines))
  key = "method_kwargs.pipemare.anneal_epochs"
  study = Study(name="t", config="c.py", grids=[{"method": ("pipemare",), "seed": (0, 1)},
                                                {"method": ("pipemare",), key: (0.0,),
                                                 "seed": (0, 1)}],
                fixed={"epochs": 1.0, "method_kwargs.pipemare.anneal_fraction": 0.1},
                labels={key: "annealing epochs"}, baseline={"method": "pipemare"},
                tables=[Table("t", rows="", columns="", kind="cells")])
  records, problems = study_records.load_results(str(tmp_path))
  assert not problems
  assert [r["run"] for r in records] == [study_lib.run_id(run) for run in study.runs()]
  assert records[2]["run"] == "method=pipemare,method_kwargs.pipemare.anneal_epochs=0.0,seed=0"
  assert all(study_records.is_done(r, study, r["overrides"]) for r in records)
  assert study_records.recipe_change(study, records, str(tmp_path)) is None
  assert run_main(tmp_path, (), study=study, report_only=True) == 0
  report = (tmp_path / "report.md").read_text()
  assert "4 of 4 runs recorded" in report
  assert "| annealing epochs = 0.0 | 70.00 " in report


# ------------------------------------------------------------------------ committed study reports


@pytest.mark.slow
def test_a_committed_study_regenerates_byte_for_byte_from_its_records(tmp_path):
  """`--report_only` on a copy of docs/studies/batch (24 records and a figure), with the command
  its report gives (the workdir with a trailing '/', as a shell completes it), writes its
  report.md, results.csv and figure byte for byte as committed."""
  committed = os.path.join(ROOT, "docs", "studies", "batch")
  workdir = tmp_path / "docs" / "studies" / "batch"
  workdir.mkdir(parents=True)
  (workdir / "results.jsonl").write_bytes(open(os.path.join(committed, "results.jsonl"),
                                               "rb").read())
  os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "study.py"),
       "--study=configs/studies/batch.py", "--workdir=docs/studies/batch/", "--report_only"],
      cwd=tmp_path, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, PYTHONPATH=ROOT))
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  names = sorted(n for n in os.listdir(committed) if not n.startswith("."))  # not .report.lock
  assert sorted(os.listdir(workdir)) == [".report.lock", *names]
  differ = [name for name in names if (workdir / name).read_bytes() != open(
      os.path.join(committed, name), "rb").read()]
  assert not differ, (f"{differ} of docs/studies/batch differ from what its records regenerate "
                      "to: run the command of its report.md with --report_only and commit them")
