"""results.jsonl: records written whole, read once into typed records, damaged lines set aside."""

import json
import os
import pathlib
import re

import pytest

from pipejax.study import spec as study_lib
from pipejax.study import cells as study_cells
from pipejax.study import records as study_records
from pipejax.study import report as study_report
from pipejax.study.spec import Study, Table

from tests.helpers import ROOT
from tests.study.helpers import STUDY, changed, record, run_main


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
  assert skipped.reason == "failed at model_kwargs.depth=4"
  assert study_records.is_done(skipped, sweep, skipped.overrides)
  records += [skipped, study_records.skipped_record(sweep, point("pb", 16, 1), 8)]
  lines = study_report.markdown_table(sweep, records, sweep.tables[0]).splitlines()
  assert lines[-1] == "| 16 | — | not run (failed below) |"


def test_a_failed_run_is_retried_and_a_finished_one_is_not():
  finished = record("pb", 8, 0, 0.8)
  failed = changed(finished, status=study_records.FAILED)
  overrides = finished.overrides
  assert study_records.is_done(finished, STUDY, overrides)
  assert not study_records.is_done(failed, STUDY, overrides)
  other = Study(name="t", config="c.py", grids=STUDY.grids, fixed={"epochs": 3.0})
  assert not study_records.is_done(finished, other, overrides)  # other settings: run again
  # Made before runs of a seed shared their starting weights: run again to be paired.
  assert not study_records.is_done(changed(finished, init_digest=None), STUDY, overrides)


def test_results_survive_a_line_cut_short(tmp_path):
  study_records.append_result(str(tmp_path), record("pb", 8, 0, 0.8))
  with open(tmp_path / study_records.RESULTS_FILE, "a") as f:
    f.write('{"run": "cut sho')
  assert [r.test_accuracy for r in study_records.read_results(str(tmp_path))] == [0.8]


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


def test_a_run_that_ends_above_its_initial_loss_counts_as_diverged():
  finished = changed(record("pb", 8, 0, 0.31), test_loss=2.4, initial_test_loss=2.3)
  assert study_records.diverged(finished)
  assert not study_records.diverged(changed(finished, test_loss=0.9))
  assert study_records.diverged(changed(finished, test_loss=float("nan"), test_accuracy=0.1))
  (cell,) = study_cells.gather_cells([finished, changed(record("pb", 8, 1, 0.8), test_loss=0.5,
                                              initial_test_loss=2.3)]).values()
  assert cell.values == [0.8] and cell.diverged == 1


def test_a_cut_line_is_set_aside_and_never_swallows_the_next_record(tmp_path, monkeypatch):
  study_records.append_result(str(tmp_path), record("pb", 8, 0, 0.8))
  results = tmp_path / study_records.RESULTS_FILE
  with open(results, "ab") as f:
    f.write(b'{"run": "cut sho')
  message = study_records.append_result(str(tmp_path), record("pb", 8, 1, 0.7))
  assert [r.test_accuracy for r in study_records.read_results(str(tmp_path))] == [0.8, 0.7]
  assert "moved it to" in message and "results.jsonl.partial-1" in message
  assert (tmp_path / "results.jsonl.partial-1").read_bytes() == b'{"run": "cut sho'
  # A full disk: the one write of a record is cut short. The record is lost, the next is not.
  real_write = os.write
  with monkeypatch.context() as patch:
    patch.setattr(os, "write", lambda fd, data: real_write(fd, data[:20]))
    with pytest.raises(OSError, match="No space left"):
      study_records.append_result(str(tmp_path), record("pb", 8, 2, 0.6))
  assert study_records.append_result(str(tmp_path), record("pb", 8, 3, 0.5)) is not None
  assert [r.test_accuracy for r in study_records.read_results(str(tmp_path))] == [0.8, 0.7, 0.5]
  assert (tmp_path / "results.jsonl.partial-2").stat().st_size == 20
  # A cut line that lacks only its newline is a whole record: it is kept.
  with open(results, "ab") as f:
    f.write(json.dumps(record("sgd", 8, 0, 0.9).to_json()).encode())
  assert study_records.append_result(str(tmp_path), record("sgd", 8, 1, 0.4)) is None
  assert len(study_records.read_results(str(tmp_path))) == 5


def test_lines_that_are_json_but_not_records_are_skipped_and_named(tmp_path, capsys):
  good = [record("pb", 8, 0, 0.8), record("pb", 8, 1, 0.7)]
  lines = [json.dumps(good[0].to_json()), "null", "[1, 2]", "{}", '{"run": "x"}',
           '{"run": "y", "ov', json.dumps(good[1].to_json())]
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
  assert [r.run for r in records] == [study_lib.run_id(run) for run in study.runs()]
  assert records[2].run == "method=pipemare,method_kwargs.pipemare.anneal_epochs=0.0,seed=0"
  assert all(study_records.is_done(r, study, r.overrides) for r in records)
  assert study_records.recipe_change(study, records, str(tmp_path)) is None
  assert run_main(tmp_path, (), study=study, report_only=True) == 0
  report = (tmp_path / "report.md").read_text()
  assert "4 of 4 runs recorded" in report
  assert "| annealing epochs = 0.0 | 70.00 " in report


def test_a_line_is_parsed_once_into_a_typed_record_that_writes_back_the_same_line():
  line = {"run": "seed=1,method=pb", "overrides": {"seed": 1, "method": "pb"}, "status": "finished",
          "fixed": {"epochs": 1.0}, "config": "c.py", "wall_seconds": 3.5, "test_accuracy": 0.8,
          "test_curve": [[10, 0.5, 1.2]], "a_field_of_tomorrow": {"x": 1}}
  parsed = study_records.parse_record(line)
  assert (parsed.method, parsed.seed, parsed.status, parsed.test_accuracy) == ("pb", 1, "finished",
                                                                               0.8)
  assert parsed.run == "method=pb,seed=1"  # its identity, whatever the order of its keys
  assert parsed.cell == study_lib.key_of({"method": "pb"})
  assert parsed.get("a_field_of_tomorrow") == {"x": 1} and parsed.get("test_loss", "-") == "-"
  assert parsed.to_json() == {**line, "run": "method=pb,seed=1"}
  with pytest.raises(study_records.RecordError, match="no 'overrides'"):
    study_records.parse_record({"run": "x", "status": "finished"})


def test_one_predicate_says_a_run_diverged():
  finished = changed(record("pb", 8, 0, 0.8), test_loss=1.0, initial_test_loss=2.0)
  assert not study_records.diverged(finished) and finished.finished
  assert study_records.diverged(changed(finished, status=study_records.DIVERGED))
  assert study_records.diverged(changed(finished, test_loss=2.5))  # worse than where it started
  failed = changed(finished, status=study_records.FAILED, test_accuracy=None)
  assert not study_records.diverged(failed) and not failed.trained  # says nothing of its method


def test_only_the_records_module_reads_a_lines_fields_by_key():
  # Every other reader takes the typed record: a field renamed or added changes one module.
  sources = [*pathlib.Path(ROOT, "pipejax").rglob("*.py"),
             *pathlib.Path(ROOT, "configs", "studies").glob("*.py")]
  found = [f"{path.relative_to(ROOT)}:{number}" for path in sources
           if path.name != "records.py" or path.parent.name != "study"
           for number, line in enumerate(path.read_text().splitlines(), 1)
           if re.search(r"""\[["'](overrides|status)["']\]""", line)]
  assert len(sources) > 100 and not found, found


def test_a_record_holds_the_plan_its_trainer_resolved_and_reads_its_update_from_it(tmp_path):
  plan = {"method": "sync", "optimizer": "adam", "micro_batches_per_update": 4,
          "recipe": {"form": "ema", "learning_rate": 0.001}, "seed": 0}
  (tmp_path / "summary.json").write_text(json.dumps(
      {"test_accuracy": 0.5, "test_loss": 1.0, "initial_test_loss": 2.0, "plan": plan}))
  # The study's config file says otherwise (momentum SGD, one micro-batch): the plan wins.
  study = Study(name="t", config="configs/deep_mlp.py", grids=[{"method": ("sync",)}])
  made = study_records.record_from_run(study, {"method": "sync", "seed": 0}, str(tmp_path), 0,
                                       1.0, "")
  assert made.status == study_records.FINISHED and made.plan == plan
  read = study_records.parse_record(json.loads(json.dumps(made.to_json())))
  assert read.plan == plan
  assert read.plan_facts == study_records.PlanFacts("adam", "ema", 4)


def test_a_record_without_a_plan_resolves_the_settings_its_trainer_was_given():
  # The study fixes sync's section for every run; its trainers got it only where sync ran.
  fixed = {"method_kwargs.sync.micro_batches": 4, "optimizer": "adam"}
  of = lambda method: study_records.parse_record(
      {"run": "r", "overrides": {"method": method, "seed": 0}, "fixed": fixed,
       "config": "configs/deep_mlp.py", "status": "finished"}).plan_facts
  assert of("sync") == study_records.PlanFacts("adam", "ema", 4)
  assert of("pb") == study_records.PlanFacts("adam", "ema", 1)
