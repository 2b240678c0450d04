"""The phase diagram (pipejax.analysis.phase, scripts/phase_diagram.py) on hand-written records.

Every expected number is worked out here from the fixture's own values: the delay from the
schedule's rule 2(S − 1), the gaps by hand, the interval by scipy.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from pipejax.analysis import phase
from pipejax.analysis.quadratic import noise as quadratic_noise
from pipejax.study import records as records_lib
from pipejax.study.spec import load_study, run_id
from tests.helpers import ROOT

MLP = os.path.join(ROOT, "configs", "deep_mlp.py")  # momentum SGD
LM = os.path.join(ROOT, "configs", "char_lm.py")  # AdamW
POINTS = phase.Unit("test_accuracy", 100.0, "points")
BITS = phase.Unit("test_loss", 1 / math.log(2), "bits per byte")


def run(method, seed, value=None, *, stages=1, momentum=0.9, lr=0.01, status="finished",
        metric="test_accuracy", config=MLP, **overrides):
  """One record as scripts/study.py writes it; a failed or diverged run records no results."""
  overrides = {"method": method, "seed": seed, **overrides}
  record = {"run": run_id(overrides), "overrides": overrides, "fixed": {}, "config": config,
            "wall_seconds": 1.0, "status": status}
  if status == "finished":
    record.update({metric: value, "num_stages": stages, "momentum": momentum,
                   "learning_rate": lr})
    other = "test_loss" if metric == "test_accuracy" else "test_accuracy"
    record[other] = 0.5
  return record


def study(tmp_path, records, unit=POINTS, limits=(), name="study"):
  workdir = tmp_path / name
  workdir.mkdir()
  (workdir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  if limits:
    (workdir / "limits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in limits))
  return phase.read_study(str(workdir), unit=unit)


def rows_by(source):
  return {(row.method, row.num_stages, tuple(sorted(row.settings.items()))): row
          for row in phase.rows_of(source)}


def test_x_is_the_stems_delay_over_the_momentums_memory(tmp_path):
  source = study(tmp_path, [
      run("pb", 0, 0.8, stages=4, momentum=0.9),
      run("pb_sc", 0, 0.8, stages=8, momentum=0.99)])
  rows = rows_by(source)
  pb, pb_sc = rows["pb", 4, ()], rows["pb_sc", 8, ()]
  assert (pb.max_delay, pb_sc.max_delay) == (2 * 3, 2 * 7)
  assert pb.delay_memory == pytest.approx(6 * 0.1)
  assert pb_sc.delay_memory == pytest.approx(14 * 0.01)


def test_an_accumulating_method_counts_its_delay_in_updates_and_has_no_quadratic_form(tmp_path):
  # PipeDream + Muon at 32 stages: D_max = 62 ticks, 62 / 8 updates at 8 micro-batches each.
  # The records hold no plan: each is resolved from its config file and settings.
  source = study(tmp_path, [
      run("pipedream_muon", 0, 0.8, stages=32, momentum=0.9, config=LM,
          **{"method_kwargs.pipedream_muon.micro_batches": 8}),
      run("pipedream_muon", 0, 0.8, stages=32, momentum=0.9, config=LM,
          **{"reference.lr": 0.002})])
  rows = rows_by(source)
  accumulating = rows["pipedream_muon", 32, (("method_kwargs.pipedream_muon.micro_batches", 8),)]
  plain = rows["pipedream_muon", 32, (("reference.lr", 0.002),)]
  assert accumulating.max_delay == plain.max_delay == 62
  assert accumulating.delay_memory == pytest.approx(62 / 8 * 0.1)
  assert plain.delay_memory == pytest.approx(62 * 0.1)
  assert phase.prediction(accumulating, "ema", []) == (
      None, "8 micro-batches per update: no quadratic form")


def _plan(optimizer, form, micro_batches_per_update):
  """The part of a plan as summary.json records it that the analysis reads."""
  return {"optimizer": optimizer, "recipe": {"form": form},
          "micro_batches_per_update": micro_batches_per_update}


def test_the_plan_a_record_holds_is_read_before_its_config(tmp_path):
  # The config file says momentum SGD and one micro-batch per update; the recorded plan, which
  # the trainer resolved, says otherwise, and it is what the run did.
  recorded = {**run("pb", 0, 0.8, stages=4, config=MLP), "plan": _plan("adam", "ema", 4)}
  (row,) = phase.rows_of(study(tmp_path, [run("sgd", 0, 0.9, config=MLP), recorded]))
  assert row.micro_batches_per_update == 4
  assert row.delay_memory == pytest.approx(6 / 4 * 0.1)
  assert phase.form_of(row.record) == "ema"


def test_a_record_without_a_plan_resolves_its_config_once(tmp_path):
  # A rate of their own: no other test has resolved these cells.
  cell = {"config": MLP, "reference.lr": 0.031}
  records = [run("pb", seed, 0.8, stages=4, **cell) for seed in range(3)]
  source = study(tmp_path, [*records, run("sgd", 0, 0.9, **cell)])
  resolutions = records_lib._resolved_facts.cache_info  # pylint: disable=protected-access
  resolved = resolutions().misses
  assert {phase.form_of(r) for r in source.records} == {"heavy_ball"}
  assert {phase.micro_batches_per_update(r) for r in source.records} == {1}
  # Once per cell (the three seeds of pb are one), however often it is asked.
  assert resolutions().misses - resolved == 2
  missing = study(tmp_path, [run("pb", 0, 0.8, stages=4, config="configs/missing.py")],
                  name="missing")
  (record,) = missing.records
  assert phase.form_of(record) is None and phase.micro_batches_per_update(record) == 1


def test_gaps_pair_by_seed_else_take_the_baselines_mean_and_the_interval_is_students(tmp_path):
  source = study(tmp_path, [
      run("sgd", 0, 0.80), run("sgd", 1, 0.82),
      run("sgd", 0, 0.70, **{"reference.lr": 1.0}),  # a worse rate: not the best baseline
      run("pb", 0, 0.78, stages=4), run("pb", 1, 0.81, stages=4), run("pb", 2, 0.75, stages=4)])
  (row,) = phase.rows_of(source)
  # Positive is worse: seeds 0 and 1 against their own baseline run, seed 2 against the mean.
  expected = [(0.80 - 0.78) * 100, (0.82 - 0.81) * 100, (0.81 - 0.75) * 100]
  np.testing.assert_allclose(row.gaps, expected)
  assert row.paired_gaps == pytest.approx(expected[:2])
  low, high = stats.t.interval(0.95, len(expected) - 1, loc=np.mean(expected),
                               scale=stats.sem(expected))
  assert row.interval.mean == pytest.approx(np.mean(expected))
  assert (row.interval.low, row.interval.high) == (pytest.approx(low), pytest.approx(high))
  assert row.baseline.settings == {}


def test_a_seed_from_other_starting_weights_is_not_paired(tmp_path):
  baseline = {**run("sgd", 0, 0.80), "init_digest": "a"}
  other = {**run("sgd", 1, 0.90), "init_digest": "b"}
  pipelined = {**run("pb", 0, 0.70, stages=4), "init_digest": "c"}
  (row,) = phase.rows_of(study(tmp_path, [baseline, other, pipelined]))
  assert row.paired_gaps == []
  assert row.gaps == [pytest.approx((0.85 - 0.70) * 100)]


def test_the_baseline_is_the_best_cell_of_sgd_and_muon_and_never_one_that_diverged(tmp_path):
  lm = dict(metric="test_loss", config=LM)
  source = study(tmp_path, [
      run("sgd", 0, 2.0, **lm), run("sgd", 1, 2.1, **lm),
      run("sgd", 0, 1.9, **lm, **{"reference.lr": 4e-3}),
      run("sgd", 1, 2.0, **lm, **{"reference.lr": 4e-3}),
      run("muon", 0, 1.8, **lm), run("muon", 1, 1.9, **lm),
      # Lowest of all, but one of its seeds diverged: no baseline.
      run("sgd", 0, 1.0, **lm, **{"reference.momentum": 0.99}),
      run("sgd", 1, None, status="diverged", **lm, **{"reference.momentum": 0.99}),
      run("pb", 0, 2.5, stages=8, **lm), run("pb", 5, 2.6, stages=8, **lm)], unit=BITS)
  (row,) = phase.rows_of(source)
  assert row.baseline.method == "muon"
  assert row.baseline.mean == pytest.approx(1.85)
  np.testing.assert_allclose(row.gaps, [(2.5 - 1.8) / math.log(2), (2.6 - 1.85) / math.log(2)])
  assert phase.baseline_name(row.baseline) == "Muon without a pipeline"


def test_a_better_cell_of_one_seed_is_named_beside_the_baseline_not_made_it(tmp_path):
  source = study(tmp_path, [
      run("sgd", 0, 0.80), run("sgd", 1, 0.82),
      run("sgd", 0, 0.90, **{"reference.lr": 1.0}),  # better, but one seed
      run("pb", 0, 0.78, stages=4), run("pb", 1, 0.80, stages=4)])
  (row,) = phase.rows_of(source)
  assert row.baseline.settings == {} and row.baseline.mean == pytest.approx(0.81)
  assert row.baseline.better_pilot.settings == {"reference.lr": 1.0}
  np.testing.assert_allclose(row.paired_gaps, [2.0, 2.0])
  assert "| momentum SGD without a pipeline, reference.lr = 1.0: 90.00% |" in \
      phase.baselines_table([row])


def test_on_accuracy_the_best_baseline_is_the_highest(tmp_path):
  source = study(tmp_path, [run("sgd", 0, 0.80), run("sgd", 0, 0.85, optimizer="adam"),
                            run("pb", 0, 0.84, stages=4)])
  (row,) = phase.rows_of(source)
  assert row.baseline.settings == {"optimizer": "adam"}
  assert row.gaps == [pytest.approx(1.0)]
  assert phase.baseline_name(row.baseline) == "Adam without a pipeline"


def test_unfinished_runs_are_left_out_diverged_ones_counted_and_a_logging_twin_counted_once(
    tmp_path):
  source = study(tmp_path, [
      run("sgd", 0, 0.80), run("sgd", 1, 0.80),
      run("pb", 0, 0.78, stages=4), run("pb", 1, 0.79, stages=4),
      run("pb", 0, 0.78, stages=4, diagnostics=True),  # the same run, logging more
      run("pb", 2, status="failed"), run("pb", 3, status="skipped"),
      run("pb", 4, status="diverged"),
      run("pb_sc", 0, status="failed")])  # a cell of failures only: no row
  (row,) = phase.rows_of(source)
  assert (row.method, row.runs, row.diverged) == ("pb", 3, 1)
  np.testing.assert_allclose(row.gaps, [2.0, 1.0])
  assert phase.gap_text(row) == "+1.50 [−4.85, +7.85]; div. 1/3"


def test_a_cell_that_only_diverged_takes_its_stages_and_momentum_from_its_siblings(tmp_path):
  source = study(tmp_path, [
      run("sgd", 0, 0.80, momentum=0.99),
      run("pb_sc", 0, 0.70, stages=8, momentum=0.99),
      run("pb", 0, status="diverged"), run("pb", 1, status="diverged")])
  row = rows_by(source)["pb", 8, ()]
  assert (row.momentum, row.borrowed, row.diverged, row.gaps) == (0.99, True, 2, [])
  assert phase.gap_text(row) == "div. 2/2"


def test_the_prediction_is_the_quadratics_gap_over_the_references_at_the_stems_curvature(
    tmp_path):
  peak = {"learning_rate": 1e-3, "learning_rate_now": 1e-3}
  limits = [{"num_stages": 4, "stage": 0, "samples": 100, "sharpness": 1.0, **peak},
            {"num_stages": 4, "stage": 0, "samples": 0, "sharpness": 10.0, **peak},
            {"num_stages": 4, "stage": 1, "samples": 0, "sharpness": 99.0, **peak}]
  source = study(tmp_path, [run("sgd", 0, 0.8), run("pb", 0, 0.7, stages=4, lr=1e-3),
                            run("pipedream", 0, 0.7, stages=4),
                            run("pb", 0, 0.7, stages=8, **{"model_kwargs.depth": 8})],
                 limits=limits)
  rows = {(r.method, r.num_stages): r for r in phase.phase_rows([source])}
  pb = rows["pb", 4]
  x = 1e-3 * 10.0  # the rate times the stem's curvature at the initial weights (no warm-up)
  expected = (quadratic_noise.predicted_gap("pb", 6, 0.9, x, 1.0)
              / quadratic_noise.heavy_ball_excess_loss(x, 0.9, 1.0))
  assert pb.prediction == pytest.approx(expected)
  assert pb.prediction_note == ("ηλ 0.01: the stem's λ at the initial weights, at 100% of the "
                                "peak rate")
  assert rows["pipedream", 4].prediction is None
  assert rows["pipedream", 4].prediction_note == "no quadratic form"
  assert rows["pb", 8].prediction_note == "no λ reading at 8 stages"


def test_the_step_is_the_rate_the_schedule_had_reached_times_the_curvature_then(tmp_path):
  # The deep MLP's stem at 32 stages (PB + SC + LWP, seed 0, scripts/depth_limits.py): λ 58.2 at
  # the initial weights, where the warm-up's rate is 0, and 5.01 after 2,000 samples, at 2/3 of
  # the peak rate 6.43e-6. The step ηλ is the rate then times λ then, 2.1e-5, stable at D = 62;
  # the peak rate times the initial λ, 3.7e-4, a step the run never takes, is not.
  eta, m = 6.43e-6, 0.99918
  limits = [{"num_stages": 32, "stage": 0, "samples": 0, "sharpness": 58.2,
             "learning_rate": eta, "learning_rate_now": 0.0},
            {"num_stages": 32, "stage": 0, "samples": 2000, "sharpness": 5.01,
             "learning_rate": eta, "learning_rate_now": eta * 2 / 3},
            {"num_stages": 32, "stage": 0, "samples": 4000, "sharpness": 2.0,
             "learning_rate": eta, "learning_rate_now": eta},
            # A reading that did not record its rate says nothing of the step.
            {"num_stages": 32, "stage": 0, "samples": 0, "sharpness": 59.6, "learning_rate": eta},
            {"num_stages": 16, "stage": 0, "samples": 0, "sharpness": 44.8, "learning_rate": eta}]
  source = study(tmp_path, [run("sgd", 0, 0.8, momentum=m),
                            run("pb_sc_lwp", 0, 0.8, stages=32, momentum=m, lr=eta),
                            run("pb_sc_lwp", 0, 0.8, stages=16, momentum=m, lr=eta,
                                **{"model_kwargs.depth": 16})], limits=limits)
  rows = {row.num_stages: row for row in phase.phase_rows([source])}
  x = eta * 2 / 3 * 5.01
  assert rows[32].prediction_note == (f"ηλ {x:.2g}: the stem's λ after 2,000 samples, at 67% "
                                      "of the peak rate")
  assert rows[32].prediction == pytest.approx(phase.relative_gap("pb_sc_lwp", 62, m, x))
  assert math.isfinite(rows[32].prediction)
  assert math.isinf(phase.relative_gap("pb_sc_lwp", 62, m, eta * 58.2))
  assert rows[16].prediction is None
  assert rows[16].prediction_note.startswith("no λ reading at 16 stages with a rate above 0")


def test_adams_prediction_takes_its_step_over_the_first_moments_memory(tmp_path):
  lm = dict(metric="test_loss", config=LM)
  limits = [{"num_stages": 4, "stage": 0, "samples": 0, "sharpness": 50.0, "form": "ema",
             "learning_rate": 1e-3, "learning_rate_now": 1e-3}]
  source = study(tmp_path, [run("sgd", 0, 2.0, **lm), run("pb", 0, 2.5, stages=4, lr=1e-3, **lm),
                            run("pb", 0, 2.5, stages=4, lr=1e-3, optimizer="sgd")],
                 unit=BITS, limits=limits)
  rows = {row.settings.get("optimizer"): row for row in phase.phase_rows([source])}
  assert rows[None].prediction_note.startswith(f"ηλ {1e-3 * (1 - 0.9) * 50.0:.2g}:")
  assert rows["sgd"].prediction_note == "λ read under another optimizer"


def test_the_quadratic_predicts_no_cost_without_delay_and_instability_far_beyond():
  assert phase.relative_gap("pb", 0, 0.9, 1e-2) == pytest.approx(0.0, abs=1e-9)  # heavy ball
  assert phase.relative_gap("pb_sc", 0, 0.9, 1e-2) == pytest.approx(0.0, abs=1e-9)
  assert math.isinf(phase.relative_gap("pb", 60, 0.9, 1e-2))


def test_the_unit_is_the_study_files(tmp_path):
  lm = phase.unit_of(load_study(os.path.join(ROOT, "configs", "studies", "lm_depth.py")))
  assert (lm.metric, lm.scale, lm.name) == ("test_loss", pytest.approx(1 / math.log(2)),
                                            "bits per byte")
  mlp = phase.unit_of(load_study(os.path.join(ROOT, "configs", "studies", "depth.py")))
  assert (mlp.metric, mlp.scale, mlp.name) == ("test_accuracy", 100.0, "points")
  # Each study's margin in its own unit: 0.02 bits per byte (declared in nats), half a point.
  assert (lm.margin, mlp.margin) == (pytest.approx(0.02), pytest.approx(0.5))
  regime = phase.unit_of(load_study(os.path.join(ROOT, "configs", "studies", "lm_regime.py")))
  assert regime == lm  # one unit, so one table of gaps and one of ranges for both studies
  assert BITS.gap(2.0, 1.0) > 0 and POINTS.gap(0.8, 0.9) > 0  # worse is positive either way


def test_a_missing_study_is_one_paragraph_and_a_note_among_others(tmp_path):
  missing = str(tmp_path / "no_such_study")
  with pytest.raises(phase.PhaseError, match=r"No study workdir .*no_such_study.* --studies"):
    phase.read_study(missing, unit=POINTS)
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(phase.PhaseError, match="holds no results.jsonl"):
    phase.read_study(str(empty), unit=POINTS)
  sources, notes = phase.read_studies([missing])
  assert sources == [] and len(notes) == 1 and notes[0].startswith("Skipped: No study workdir")
  assert "\n" not in notes[0]


# The study file of the hand-written records: their config and grid, accuracy in points.
STUDY_FILE = f"""
from pipejax.study import Study
def get_study(arg):
  return Study(name="depth", config={MLP!r}, margin=0.005,
               grids=[{{"method": ("sgd", "pb", "pb_sc"), "seed": (0, 1)}}])
"""


def _study_file(tmp_path, text=STUDY_FILE):
  path = tmp_path / "study_file.py"
  path.write_text(text)
  return str(path)


def test_records_of_another_study_are_refused_and_foreign_ones_left_out_with_a_note(tmp_path):
  records = [run("sgd", 0, 0.80), run("pb", 0, 0.78, stages=4)]
  workdir = tmp_path / "mlp"
  workdir.mkdir()
  (workdir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  lm_study = os.path.join(ROOT, "configs", "studies", "lm_depth.py")
  with pytest.raises(phase.StudyMismatchError, match="None of the 2 records .* is a run of the "
                     "study file .*lm_depth.py"):
    phase.read_studies([f"{workdir}={lm_study}"])
  result = _script(f"--studies={workdir}={lm_study}", f"--out={tmp_path / 'phase'}")
  assert result.returncode == 2 and "bits per byte" not in result.stderr
  assert "is a run of the study file" in result.stderr and "Traceback" not in result.stderr
  assert not (tmp_path / "phase").exists()
  # A record that is not a grid point of its own study (a grid that shrank) is left out, named.
  foreign = run("pb", 0, 0.1, stages=4, **{"reference.lr": 9.0})
  (workdir / "results.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                 for r in [*records, foreign]))
  source = phase.read_study(str(workdir), _study_file(tmp_path))
  assert len(source.records) == 2 and source.problems == [
      f"1 of its 3 records are not runs of {_study_file(tmp_path)} (not a grid point of it, or of "
      "another config): left out."]


def _script(*args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "phase_diagram.py"),
                         *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_script_writes_the_report_and_figure_and_notes_a_missing_study(tmp_path):
  workdir = tmp_path / "depth"
  workdir.mkdir()
  records = [run("sgd", 0, 0.80), run("pb", 0, 0.78, stages=4), run("pb_sc", 0, status="diverged"),
             run("pb_sc", 1, 0.79, stages=4)]
  (workdir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  out = tmp_path / "phase"
  result = _script(f"--studies={workdir}={_study_file(tmp_path)},{tmp_path / 'gone'}",
                   f"--out={out}")
  assert result.returncode == 0, result.stderr
  assert "Skipped: No study workdir" in result.stderr and "Traceback" not in result.stderr
  report = (out / "report.md").read_text()
  assert "| PB | depth | the recipe | 4 | 0.9 | 6 | 0.6 | 1 | +2.00 (1 seed) |" in report
  assert "div. 1/2" in report
  assert (out / "phase.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_script_with_no_study_to_read_says_so_in_one_paragraph(tmp_path):
  result = _script(f"--studies={tmp_path / 'gone'}", f"--out={tmp_path / 'phase'}")
  assert result.returncode == 2
  assert "nothing to draw" in result.stderr and "Traceback" not in result.stderr
  assert not (tmp_path / "phase").exists()
