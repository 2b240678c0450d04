"""The study runner: grids, records, aggregation over seeds, diverged runs, and a real smoke study."""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from pipejax import statistics
from pipejax import study as study_lib
from pipejax import study_report
from pipejax.study import Study, Table

from tests.helpers import ROOT


def record(method, depth, seed, accuracy, status=study_lib.FINISHED):
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


def test_cells_average_over_seeds_and_never_average_diverged_runs():
  records = [record("pb", 8, 0, 0.80), record("pb", 8, 1, 0.84),
             record("pb", 8, 2, None, status=study_lib.DIVERGED)]
  (cell,) = study_report.cells(records).values()
  assert cell.values == [0.80, 0.84] and cell.diverged == 1
  assert cell.mean == pytest.approx(0.82)
  assert cell.std == pytest.approx(np.std([0.80, 0.84], ddof=1))
  # 95% Student-t interval at n = 2: mean ± t(0.975, 1) s / sqrt(2), t(0.975, 1) = 12.7062.
  half = 12.7062 * np.std([0.80, 0.84], ddof=1) / np.sqrt(2) * 100
  assert study_report.format_cell(cell) == \
      f"82.00 [{82 - half:.2f}, {82 + half:.2f}] n=2 (1/3 div.)"
  all_diverged = study_report.cells([record("pb", 8, s, None, study_lib.DIVERGED)
                                  for s in range(3)])
  assert study_report.format_cell(next(iter(all_diverged.values()))) == "div. 3/3"


def test_gaps_are_paired_by_seed_with_the_baseline_at_the_same_depth():
  records = [record("sgd", 8, 0, 0.85), record("sgd", 8, 1, 0.80),
             record("pb", 8, 0, 0.84), record("pb", 8, 1, 0.78),
             record("sgd", 4, 0, 0.50), record("pb", 4, 0, 0.90)]
  gaps = study_report.paired_gaps(records, {"method": "sgd"})
  cell = study_report.lookup(gaps, {"model_kwargs.depth": 8, "method": "pb"})
  assert cell.values == pytest.approx([-0.01, -0.02])  # not 0.84 - mean(sgd) etc.
  assert study_report.lookup(gaps, {"model_kwargs.depth": 4, "method": "pb"}).values == \
      pytest.approx([0.40])


def test_markdown_tables_and_stability_limit():
  records = [record(m, d, s, acc) for m, d, s, acc in [
      ("sgd", 4, 0, 0.9), ("sgd", 8, 0, 0.9), ("pb", 4, 0, 0.8), ("pb", 4, 1, 0.82)]]
  records.append(record("pb", 8, 0, None, study_lib.DIVERGED))
  text = study_report.markdown_table(STUDY, records, STUDY.tables[0])
  lines = text.splitlines()
  assert lines[0] == "| stages | SGD | PB |"
  assert lines[2] == "| 4 | 90.00 (1 seed) | 81.00 [68.29, 93.71] n=2 |"
  assert lines[3] == "| 8 | 90.00 (1 seed) | div. 1/1 |"
  stability = Table("s", rows="model_kwargs.depth", columns="method", kind="stability")
  assert study_report.stable_limit(STUDY, records, stability, "pb") == (4, 8)
  assert study_report.stable_limit(STUDY, records, stability, "sgd") == (8, None)


def test_a_point_that_failed_at_a_smaller_swept_value_is_skipped_beyond_it():
  sweep = Study(name="t", config="c.py", grids=[{"model_kwargs.depth": (4, 8, 16),
                                                 "method": ("sgd", "pb"), "seed": (0, 1)}],
                min_accuracy=0.5, skip_beyond_failure="model_kwargs.depth",
                tables=[Table("acc", rows="model_kwargs.depth", columns="method")])
  records = [record("sgd", 4, 0, 0.9), record("pb", 4, 0, 0.3),  # pb seed 0: trains badly at 4
             record("pb", 4, 1, 0.8), record("pb", 8, 1, None, study_lib.DIVERGED)]
  point = lambda m, d, s: {"model_kwargs.depth": d, "method": m, "seed": s}
  assert study_lib.failed_below(sweep, records, point("pb", 8, 0)) == 4
  assert study_lib.failed_below(sweep, records, point("pb", 16, 1)) == 8
  assert study_lib.failed_below(sweep, records, point("pb", 8, 1)) is None  # its own run
  assert study_lib.failed_below(sweep, records, point("sgd", 8, 0)) is None  # sgd trained
  assert study_lib.failed_below(STUDY, records, point("pb", 8, 0)) is None  # the study opts in
  skipped = study_lib.skipped_record(sweep, point("pb", 16, 0), 4)
  assert skipped["reason"] == "failed at model_kwargs.depth=4"
  assert study_lib.is_done(skipped, sweep, skipped["overrides"])
  records += [skipped, study_lib.skipped_record(sweep, point("pb", 16, 1), 8)]
  lines = study_report.markdown_table(sweep, records, sweep.tables[0]).splitlines()
  assert lines[-1] == "| 16 | — | not run (failed below) |"


def test_tables_take_list_valued_axes_as_results_jsonl_gives_them_back():
  # A tuple override (a model's hidden widths) comes back from results.jsonl as a list.
  widths = Study(name="t", config="c.py", grids=[{"model_kwargs.hidden": ((8,), (8, 8)),
                                                  "method": ("sgd", "pb"), "seed": (0,)}],
                 tables=[Table("acc", rows="model_kwargs.hidden", columns="method")])
  records = [{"run": f"{m}{h}", "overrides": {"model_kwargs.hidden": list(h), "method": m,
                                              "seed": 0},
              "status": study_lib.FINISHED, "test_accuracy": acc, "fixed": {}, "config": "c.py"}
             for m, h, acc in [("sgd", (8,), 0.9), ("pb", (8,), 0.8), ("sgd", (8, 8), 0.7)]]
  lines = study_report.markdown_table(widths, records, widths.tables[0]).splitlines()
  assert lines[2] == "| [8] | 90.00 (1 seed) | 80.00 (1 seed) |"
  assert lines[3] == "| [8, 8] | 70.00 (1 seed) | — |"


def test_a_failed_run_is_retried_and_a_finished_one_is_not():
  finished = record("pb", 8, 0, 0.8)
  failed = dict(finished, status=study_lib.FAILED)
  overrides = finished["overrides"]
  assert study_lib.is_done(finished, STUDY, overrides)
  assert not study_lib.is_done(failed, STUDY, overrides)
  changed = Study(name="t", config="c.py", grids=STUDY.grids, fixed={"epochs": 3.0})
  assert not study_lib.is_done(finished, changed, overrides)  # other settings: run again
  # Made before runs of a seed shared their starting weights: run again to be paired.
  assert not study_lib.is_done({k: v for k, v in finished.items() if k != "init_digest"}, STUDY,
                               overrides)


def test_results_survive_a_line_cut_short(tmp_path):
  study_lib.append_result(str(tmp_path), record("pb", 8, 0, 0.8))
  with open(tmp_path / study_lib.RESULTS_FILE, "a") as f:
    f.write('{"run": "cut sho')
  assert [r["test_accuracy"] for r in study_lib.read_results(str(tmp_path))] == [0.8]


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


def test_smoke_study_runs_skips_finished_runs_and_marks_divergence(tmp_path):
  """The CI run of configs/studies/depth.py:smoke: real trainer processes, then a rerun."""
  workdir = tmp_path / "depth"
  command = [sys.executable, os.path.join(ROOT, "scripts", "study.py"),
             "--study=configs/studies/depth.py:smoke", f"--workdir={workdir}", "--parallel=2"]
  first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  records = study_lib.read_results(str(workdir))
  assert len(records) == 9
  statuses = {r["run"]: r["status"] for r in records}
  assert statuses["model_kwargs.depth=5,method=pb,seed=0,reference.lr=10000.0"] == "diverged"
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
  assert len(study_lib.read_results(str(workdir))) == 9


def test_a_study_that_fails_stops_its_trainers_first(tmp_path):
  """The trainers run in sessions of their own: a crashing study must not leave them running."""
  from tests.test_docs import load_script  # pylint: disable=import-outside-toplevel
  study_script = load_script("scripts/study.py")
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
  study_script._stop_trainers([polite_process, deaf_process], timeout=3)
  assert polite_process.returncode == 75 and (tmp_path / "a").read_text() == "saved"
  assert deaf_process.returncode == -9  # killed once the timeout passed


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
  assert study_lib.log_timing(str(log)) == {"setup_s": 8.5, "first_chunk_s": 20.0,
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


def test_a_run_that_ends_above_its_initial_loss_counts_as_diverged():
  finished = dict(record("pb", 8, 0, 0.31), test_loss=2.4, initial_test_loss=2.3)
  assert study_lib.diverged(finished)
  assert not study_lib.diverged(dict(finished, test_loss=0.9))
  assert study_lib.diverged(dict(finished, test_loss=float("nan"), test_accuracy=0.1))
  (cell,) = study_report.cells([finished, dict(record("pb", 8, 1, 0.8), test_loss=0.5,
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
            "status": study_lib.FINISHED, "test_accuracy": accuracy, "fixed": {}}
  records = [run(0.1, 0, 0.8), run(0.1, 1, 0.8), run(0.141, 0, 0.8), run(0.141, 1, 0.1),
             run(0.2, 0, 0.1)]
  assert study_report.stable_limit(sweep, records, sweep.tables[0], "pb") == (0.1, 0.141)
  assert "| PB | 0.1 | 0.141 | [0.1, 0.141) |" in study_report.markdown_table(
      sweep, records, sweep.tables[0])


def test_control_arms_pair_with_their_seeds_baseline_and_list_as_cells():
  def run(seed, accuracy, **overrides):
    overrides = {**overrides, "seed": seed}
    return {"run": study_lib.run_id(overrides), "overrides": overrides, "config": "c.py",
            "status": study_lib.FINISHED, "test_accuracy": accuracy, "fixed": {},
            "init_digest": f"w{seed}"}
  records = [run(s, 0.80 + s / 100, method="sgd") for s in range(3)]
  records += [run(s, 0.81 + s / 100, method="pipemare") for s in range(3)]
  records += [run(s, 0.805 + s / 100, method="sgd", sgd_stage_rates="pipemare") for s in range(3)]
  study = Study(name="c", config="c.py", grids=[{"method": ("sgd", "pipemare"), "seed": (0,)}],
                baseline={"method": "sgd"}, labels={"sgd_stage_rates": "per-layer rates"},
                tables=[Table("t", rows="", columns="", kind="cells")])
  gaps = study_report.paired_gaps(records, study.baseline)
  rescheduled = study_report.lookup(gaps, {"sgd_stage_rates": "pipemare"})
  assert rescheduled.values == pytest.approx([0.005] * 3)  # paired with plain SGD, seed by seed
  lines = study_report.markdown_table(study, records, study.tables[0]).splitlines()
  assert lines[2].startswith("| SGD | 81.00 [") and lines[2].endswith("| baseline |")
  assert lines[3].startswith("| PipeMare | 82.00 [") and "| +1.00 [+1.00, +1.00] n=3" in lines[3]
  assert lines[4].startswith("| SGD, per-layer rates = pipemare | 81.50 [")


def test_tuned_tables_compare_each_method_at_its_best_value():
  def run(method, lr, seed, accuracy):
    overrides = {"reference.lr": lr, "method": method, "seed": seed}
    return {"run": study_lib.run_id(overrides), "overrides": overrides, "config": "c.py",
            "status": study_lib.FINISHED, "test_accuracy": accuracy, "fixed": {},
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
  from pipejax.study import Figure  # pylint: disable=import-outside-toplevel
  records = [record("sgd", 4, 0, 0.9), record("sgd", 8, 0, 0.9), record("pb", 4, 0, 0.8),
             record("pb", 8, 0, None, study_lib.DIVERGED), record("pb", 8, 1, 0.7)]
  figure = Figure("f.png", x="model_kwargs.depth", series="method", title="Accuracy by depth")
  series = dict((s, (points, failed)) for s, points, failed in
                study_report._cell_points(STUDY, records, figure))  # pylint: disable=protected-access
  assert series["pb"] == ([(4, 80.0, 0.0), (8, 70.0, 0.0)], [(8, "1/2")])
  assert study_report.draw_figure(STUDY, records, figure, str(tmp_path / "f.png"))
  assert (tmp_path / "f.png").stat().st_size > 1000
