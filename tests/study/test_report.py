"""The report: tables, stability limits, conclusions, sections, and the committed reports."""

import dataclasses
import os
import subprocess
import sys

import pytest

from pipejax.study import spec as study_lib
from pipejax.study import cells as study_cells
from pipejax.study import records as study_records
from pipejax.study import report as study_report
from pipejax.study.spec import Study, Table

from tests.helpers import ROOT
from tests.study.helpers import STUDY, loss_record, record, sectioned_study, write_records, changed


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
  records.append(changed(record("pb", 4, 1, 0.7), overrides={
      "model_kwargs.depth": 4, "method": "pb", "seed": 1, "reference.lr": 0.1}))
  assert study_report.markdown_table(STUDY, records, sweep).splitlines()[2] == (
      "| 0.1 | — | 70.00 (1 seed) |")


def test_tables_take_list_valued_axes_as_results_jsonl_gives_them_back():
  # A tuple override (a model's hidden widths) comes back from results.jsonl as a list.
  widths = Study(name="t", config="c.py", grids=[{"model_kwargs.hidden": ((8,), (8, 8)),
                                                  "method": ("sgd", "pb"), "seed": (0,)}],
                 tables=[Table("acc", rows="model_kwargs.hidden", columns="method")])
  records = [study_records.parse_record({
      "run": f"{m}{h}", "overrides": {"model_kwargs.hidden": list(h), "method": m, "seed": 0},
      "status": study_records.FINISHED, "test_accuracy": acc, "fixed": {}, "config": "c.py"})
             for m, h, acc in [("sgd", (8,), 0.9), ("pb", (8,), 0.8), ("sgd", (8, 8), 0.7)]]
  lines = study_report.markdown_table(widths, records, widths.tables[0]).splitlines()
  assert lines[2] == "| [8] | 90.00 (1 seed) | 80.00 (1 seed) |"
  assert lines[3] == "| [8, 8] | 70.00 (1 seed) | — |"


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


def test_stability_limits_are_intervals_between_a_trained_and_a_failed_value():
  sweep = Study(name="t", config="c.py", grids=[{"reference.lr": (0.1, 0.141, 0.2),
                                                 "method": ("pb",), "seed": (0, 1)}],
                min_accuracy=0.5, tables=[Table("s", rows="reference.lr", columns="method",
                                                kind="stability")])
  def run(lr, seed, accuracy):
    overrides = {"reference.lr": lr, "method": "pb", "seed": seed}
    return study_records.parse_record({
        "run": study_lib.run_id(overrides), "overrides": overrides, "config": "c.py",
            "status": study_records.FINISHED, "test_accuracy": accuracy, "fixed": {}})
  records = [run(0.1, 0, 0.8), run(0.1, 1, 0.8), run(0.141, 0, 0.8), run(0.141, 1, 0.1),
             run(0.2, 0, 0.1)]
  assert study_report.stable_limit(sweep, records, sweep.tables[0], "pb") == (0.1, 0.141)
  assert "| PB | 0.1 | 0.141 | [0.1, 0.141) |" in study_report.markdown_table(
      sweep, records, sweep.tables[0])


def test_a_table_with_its_own_baseline_pairs_with_that_baseline_and_names_it():
  # The study's baseline is Muon; a second table sets PipeDream + Muon against Adam's best.
  def run(method, seed, loss):
    overrides = {"method": method, "reference.lr": 0.002, "seed": seed}
    return study_records.parse_record({
        "run": study_lib.run_id(overrides), "overrides": overrides, "config": "c.py",
            "status": study_records.FINISHED, "test_loss": loss, "initial_test_loss": 5.0,
            "test_accuracy": 0.5, "fixed": {}, "init_digest": f"w{seed}"})
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
    return study_records.parse_record({
        "run": study_lib.run_id(overrides), "overrides": overrides, "config": "c.py",
            "status": study_records.FINISHED, "test_loss": loss, "initial_test_loss": 5.0,
            "test_accuracy": 0.5, "fixed": {}, "init_digest": f"w{seed}"})
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
  assert sorted((r.overrides["method"], r.overrides["reference.lr"]) for r in joint) == [
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
    return study_records.parse_record({
        "run": study_lib.run_id(overrides), "overrides": overrides, "config": "c.py",
            "status": study_records.FINISHED, "test_accuracy": accuracy, "fixed": {},
            "init_digest": f"w{seed}"})
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


def test_reports_leave_out_runs_made_before_starting_weights_were_matched():
  old = changed(record("pb", 8, 0, 0.7), init_digest=None)
  new = record("pb", 4, 0, 0.8)
  kept, left_out = study_report.paired_records([old, new])
  assert kept == [new] and left_out == 1
  assert study_report.paired_records([old]) == ([old], 0)  # nothing matched yet: shown, flagged


def test_a_loss_is_better_smaller_in_margin_verdicts_and_the_best_rate():
  study = Study(name="t", config="c.py", grids=STUDY.grids, baseline={"method": "sgd"},
                margin=0.02, labels={"pb": "PB"},
                tables=[Table("gap", rows="model_kwargs.depth", columns="method", kind="gap",
                              metric="test_loss", scale=1.0)])
  table = study.tables[0]
  assert not table.higher_is_better and Table("a", rows="r", columns="c").higher_is_better
  assert not Table("s", rows="r", columns="c", metric="samples_to:0.85").higher_is_better
  base = [loss_record("sgd", 8, s, v) for s, v in enumerate((2.00, 2.10, 2.05))]
  # Half a margin worse (higher loss) on every seed: non-inferior, as it would be for accuracy
  # half a margin lower; read as accuracy (higher better) the same gaps would be "above".
  worse = [loss_record("pb", 8, s, v + 0.01) for s, v in enumerate((2.00, 2.10, 2.05))]
  (sentence,) = study_report.conclusions(study, base + worse, table)
  assert "non-inferior at margin 0.02: yes" in sentence
  # Five margins worse: not non-inferior (on the old, accuracy-only reading it was).
  much_worse = [loss_record("pb", 8, s, v + 0.1 + 0.001 * s)
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
    records.append(study_records.parse_record({
        "run": study_lib.run_id(overrides), "overrides": overrides,
                    "status": study_records.FINISHED, "test_accuracy": 0.5, "test_loss": loss,
                    "initial_test_loss": 5.0, "fixed": {}, "config": "c.py", "init_digest": "w"}))
  assert study_report.best_value(sweep, records, sweep.tables[0], "sgd") == 0.2


def test_sections_follow_the_figures_in_order(tmp_path):
  from pipejax.study import Section  # pylint: disable=import-outside-toplevel
  write_records(tmp_path)
  seen = []
  def computed(records, workdir):
    seen.append((len(records), workdir))
    return f"{len(records)} runs, by a function."
  study = sectioned_study(Section("Notes", "Written by hand.\n\nTwo paragraphs."),
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
  write_records(tmp_path)
  def broken(records, workdir):
    raise FileNotFoundError("no samples.txt in the workdir\n(run the sampler first)")
  study = sectioned_study(Section("Samples", broken), Section("After", "Still here."))
  whole = study_report.write_report(sectioned_study(Section("After", "Still here.")),
                                    str(tmp_path))
  with caplog.at_level("WARNING"):
    text = study_report.write_report(study, str(tmp_path))
  note = ("## Samples\n\nThis section could not be generated: FileNotFoundError: no samples.txt "
          "in the workdir (run the sampler first).\n\n")
  assert text == whole.replace("## After", note + "## After")
  assert (tmp_path / "report.md").read_text() == text and (tmp_path / "f.png").exists()
  assert any("Samples" in r.getMessage() and "no samples.txt" in r.getMessage()
             and r.levelname == "WARNING" for r in caplog.records)


def test_a_report_written_while_another_is_being_written_never_collides(tmp_path, monkeypatch):
  """A second writer (``--report_only`` beside the study) starts while the first is between
  drawing its figure and renaming it: both finish, each with its own temporary files."""
  import threading  # pylint: disable=import-outside-toplevel
  from matplotlib import figure as figure_lib  # pylint: disable=import-outside-toplevel
  write_records(tmp_path)
  study = sectioned_study()
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


def test_a_report_counts_and_tabulates_only_the_studys_grid_points(tmp_path):
  # The grid shrank to depth 4 after runs at depth 8 were recorded, and a record of another
  # study's method sits among them: neither is counted, given a row or a gap.
  shrunk = Study(name="t", config="c.py", baseline={"method": "sgd"},
                 grids=[{"model_kwargs.depth": (4,), "method": ("sgd", "pb"), "seed": (0,)}],
                 tables=[Table("acc", rows="model_kwargs.depth", columns="method", kind="gap")])
  for m, d, acc in [("sgd", 4, 0.9), ("pb", 4, 0.8), ("sgd", 8, 0.85), ("pb", 8, 0.7),
                    ("pipemare", 4, 0.1)]:
    study_records.append_result(str(tmp_path), record(m, d, 0, acc))
  text = study_report.write_report(shrunk, str(tmp_path))
  assert "\n2 of 2 runs recorded: 2 finished" in text
  assert "3 records of results.jsonl are not grid points of the study file" in text
  assert "| 8 |" not in text and "PipeMare" not in text


@pytest.mark.parametrize("rows, columns, message", [
    ("method", "method", "'method' as both its rows and its columns"),
    ("seed", "method", "puts 'seed' on an axis")])
def test_a_table_whose_axes_cannot_hold_its_cells_is_refused_in_one_paragraph(rows, columns,
                                                                                message):
  with pytest.raises(study_lib.StudyError, match=message) as error:
    Study(name="t", config="c.py", grids=STUDY.grids, tables=[Table("acc", rows, columns)])
  assert "\n" not in str(error.value)
