"""The mechanism grid's report: summaries, losses and orderings against hand-made records."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from pipejax.analysis import mechanism_report
from tests.helpers import ROOT


def _records(method, momentum, mismatch_by_stage, cosine_by_stage, ticks=(10, 20)):
  """Two ticks per stage: values v - 0.1 and v + 0.1, whose mean is v."""
  out = []
  for s, (m, c) in enumerate(zip(mismatch_by_stage, cosine_by_stage)):
    for t, shift in zip(ticks, (-0.1, 0.1)):
      out.append({"tick": t, "stage": s, "sample": t - s, "delay": 2 * (2 - s),
                  "mismatch": m + shift * m, "cosine": c + shift * (1 - c) if c < 1 else c,
                  "delayed_norm": 1.0, "current_norm": 1.0, "method": method,
                  "momentum": momentum, "seed": 0, "num_stages": 3, "lr": 1e-3, "b2": 0.99})
  return out


def _write_run(directory, name, records):
  os.makedirs(os.path.join(directory, name))
  with open(os.path.join(directory, name, "mechanism.jsonl"), "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)


def test_a_runs_summary_averages_each_stage_then_the_stages():
  records = _records("pb", 0.9, [0.4, 0.2, 0.0], [0.5, 0.7, 0.9])
  [row] = mechanism_report.run_summaries(records)
  assert row["method"] == "pb" and row["momentum"] == 0.9 and row["stages"] == 3
  np.testing.assert_allclose(row["mismatch"], (0.4 + 0.2 + 0.0) / 3)
  np.testing.assert_allclose(row["first_mismatch"], 0.4)
  np.testing.assert_allclose(row["rest_mismatch"], (0.2 + 0.0) / 2)
  np.testing.assert_allclose(row["cosine"], (0.5 + 0.7 + 0.9) / 3)
  assert row["worst_stage"] == 0
  np.testing.assert_allclose(row["cosine_min"], 0.5)


def _study_record(method, num_stages=3, lr=1e-3, status="finished", test_loss=2.0, fixed=False):
  """A record as scripts/study.py writes it: the method among the overrides or fixed settings."""
  where = {"method": method, "seed": 0}
  return {"overrides": {} if fixed else where, "fixed": where if fixed else {},
          "num_stages": num_stages, "learning_rate": lr, "momentum": 0.9, "status": status,
          "test_loss": test_loss}


def test_losses_keep_finished_runs_of_the_same_depth_and_rate_in_bits(tmp_path):
  path = tmp_path / "results.jsonl"
  rows = [_study_record("pb", test_loss=2.0), _study_record("pb", test_loss=3.0, fixed=True),
          _study_record("pb", status="diverged", test_loss=9.0),
          _study_record("pb", num_stages=8, test_loss=9.0),
          _study_record("pb", lr=2e-3, test_loss=9.0),
          {**_study_record("pb"), "overrides": {}, "fixed": {}}]  # no method: not a method's
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  found = mechanism_report.losses([str(path)], 3, 1e-3)
  np.testing.assert_allclose(found["pb", 0.9].bits, [2.0 / math.log(2), 3.0 / math.log(2)])
  assert list(found) == [("pb", 0.9)] and found["pb", 0.9].source == str(path)


def test_a_methods_losses_come_from_the_first_study_that_has_it(tmp_path):
  """Two studies trained on other data are never averaged: the first path with the (method, b1)
  gives all its losses, a later one only the keys the earlier ones lack."""
  first, second = tmp_path / "lm_regime.jsonl", tmp_path / "lm_depth.jsonl"
  first.write_text(json.dumps(_study_record("pb", test_loss=2.0)) + "\n")
  second.write_text("".join(json.dumps(r) + "\n" for r in (
      _study_record("pb", test_loss=5.0), _study_record("pb", test_loss=6.0),
      _study_record("pb_sc", test_loss=4.0))))
  found = mechanism_report.losses([str(first), str(second)], 3, 1e-3)
  np.testing.assert_allclose(found["pb", 0.9].bits, [2.0 / math.log(2)])
  assert found["pb", 0.9].source == str(first)
  np.testing.assert_allclose(found["pb_sc", 0.9].bits, [4.0 / math.log(2)])
  assert found["pb_sc", 0.9].source == str(second)


def test_kendalls_tau_reads_agreement_and_reversal_of_the_two_orders():
  summaries = [{"method": m, "momentum": 0.9, "mismatch": v}
               for m, v in (("a", 0.1), ("b", 0.2), ("c", 0.3), ("d", 0.4))]
  agree = {("a", 0.9): [1.0], ("b", 0.9): [2.0], ("c", 0.9): [3.0], ("d", 0.9): [4.0, 4.2]}
  agree = {key: mechanism_report.Losses(bits, "s.jsonl") for key, bits in agree.items()}
  [block] = mechanism_report.orderings(summaries, agree)
  assert [m["method"] for m in block["methods"]] == ["a", "b", "c", "d"]
  assert block["tau"] == pytest.approx(1.0)
  assert block["p"] == pytest.approx(2 / 24)  # exact: 1 of the 24 orders, both tails
  assert block["methods"][-1]["seeds"] == 2 and block["methods"][-1]["loss"] == pytest.approx(4.1)
  reverse = {key: mechanism_report.Losses([-v.bits[0]], "s.jsonl") for key, v in agree.items()}
  assert mechanism_report.orderings(summaries, reverse)[0]["tau"] == pytest.approx(-1.0)
  two = {key: agree[key] for key in (("a", 0.9), ("b", 0.9))}
  [few] = mechanism_report.orderings(summaries, two)
  assert few["tau"] is None and len(few["methods"]) == 2


def test_the_report_and_its_figure_are_written_beside_the_runs(tmp_path):
  directory = str(tmp_path / "mechanism")
  _write_run(directory, "pb_b1_0.9", _records("pb", 0.9, [0.4, 0.2, 0.0], [0.5, 0.7, 0.9]))
  _write_run(directory, "pb_sc_b1_0.9", _records("pb_sc", 0.9, [0.6, 0.3, 0.0], [0.4, 0.6, 0.9]))
  _write_run(directory, "pb_b1_0.99", _records("pb", 0.99, [0.1, 0.1, 0.0], [0.8, 0.8, 0.9]))
  results = tmp_path / "results.jsonl"
  results.write_text(json.dumps(_study_record("pb")) + "\n")
  text = mechanism_report.report(directory, [str(results)])
  assert os.path.getsize(os.path.join(directory, "mechanism.png")) > 0
  with open(os.path.join(directory, "report.md"), encoding="utf-8") as f:
    assert f.read() == text
  assert "| pb_sc | 0.9 | 0.3 | " in text
  assert "fewer than 3 methods with a loss: no test" in text
  assert f"{2.0 / math.log(2):.2f} bits, n = 1" in text


def test_a_directory_without_runs_is_refused_with_the_command_that_makes_them(tmp_path):
  with pytest.raises(mechanism_report.MechanismReportError, match="run scripts/mechanism.py"):
    mechanism_report.load(str(tmp_path))
  done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "mechanism_report.py"),
                         f"--dir={tmp_path}"], capture_output=True, text=True, cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": ROOT}, check=False)
  assert done.returncode != 0
  assert "run scripts/mechanism.py" in done.stderr and "Traceback" not in done.stderr
