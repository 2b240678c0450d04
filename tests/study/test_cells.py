"""Records gathered into cells: values over seeds, paired gaps and control arms."""

import numpy as np
import pytest

from pipejax.study import spec as study_lib
from pipejax.study import cells as study_cells
from pipejax.study import records as study_records
from pipejax.study import report as study_report
from pipejax.study.spec import Study, Table

from tests.study.helpers import record, changed


def test_a_grid_point_listed_twice_in_another_order_is_one_run_everywhere():
  """One identity for a run (its run id, whatever the order of its keys): the grid runs it once,
  results.jsonl keeps one record of it, and a cell counts it once, never as two seeds."""
  study = Study(name="t", config="c.py", grids=[{"method": ("sgd",), "seed": (0,)},
                                                {"seed": (0,), "method": ("sgd", "pb")}])
  assert study.runs() == [{"method": "sgd", "seed": 0}, {"seed": 0, "method": "pb"}]
  assert study_lib.run_id({"seed": 0, "method": "pb"}) == "method=pb,seed=0"
  # Records of one run written under both orders (as a workdir of an older study holds them).
  first = record("sgd", 8, 0, 0.80)
  again = changed(first, run="seed=0,method=sgd,model_kwargs.depth=8", test_accuracy=0.81,
               overrides={"seed": 0, "method": "sgd", "model_kwargs.depth": 8})
  (cell,) = study_cells.gather_cells([first, again]).values()
  assert cell.values == [0.81] and cell.seeds == [0]
  assert study_report.format_cell(cell) == "81.00 (1 seed)"


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


RATES = "method_kwargs.sgd.stage_rates"


def test_control_arms_pair_with_their_seeds_baseline_and_list_as_cells():
  def run(seed, accuracy, **overrides):
    overrides = {**overrides, "seed": seed}
    return study_records.parse_record({
        "run": study_lib.run_id(overrides), "overrides": overrides, "config": "c.py",
            "status": study_records.FINISHED, "test_accuracy": accuracy, "fixed": {},
            "init_digest": f"w{seed}"})
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


def test_numeric_rows_ascend_across_grids_and_names_keep_the_files_order():
  """A stability study refines each method's range in a grid of its own: its table's rows must
  still read as one ascending ladder, while methods keep the order the study file gives them."""
  study = Study(name="ladder", config="configs/default.py:smoke",
                grids=[{"method": ("sgd", "pb"), "lr": (1.6, 3.2)},
                       {"method": ("pipedream",), "lr": (0.4, 0.8)}])
  assert study_cells.ordered(study, "lr", [1.6, 3.2, 0.4, 0.8]) == [0.4, 0.8, 1.6, 3.2]
  assert study_cells.ordered(study, "method", ["pipedream", "pb", "sgd"]) == [
      "sgd", "pb", "pipedream"]
