"""The mechanism grid's report: summaries, losses and orderings against hand-made records."""

import contextlib
import glob
import json
import math
import os
import random
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


def _grid(directory):
  """Three runs of two methods, the report's inputs."""
  _write_run(directory, "pb_b1_0.9", _records("pb", 0.9, [0.4, 0.2, 0.0], [0.5, 0.7, 0.9]))
  _write_run(directory, "pb_sc_b1_0.9", _records("pb_sc", 0.9, [0.6, 0.3, 0.0], [0.4, 0.6, 0.9]))
  _write_run(directory, "pb_b1_0.99", _records("pb", 0.99, [0.1, 0.1, 0.0], [0.8, 0.8, 0.9]))


def _script(*args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "mechanism_report.py"),
                         *args], capture_output=True, text=True, cwd=ROOT, timeout=120,
                        env={**os.environ, "PYTHONPATH": ROOT}, check=False)


def test_a_damaged_record_line_is_refused_naming_the_run_to_measure_again(tmp_path):
  directory = str(tmp_path / "mechanism")
  _grid(directory)
  path = os.path.join(directory, "pb_sc_b1_0.9", "mechanism.jsonl")
  with open(path, "a", encoding="utf-8") as f:
    f.write('{"tick": 30, "stage": 1, "mism\n')
  with pytest.raises(mechanism_report.MechanismReportError,
                     match=r"pb_sc_b1_0.9/mechanism.jsonl line 7 is not a mechanism record: it "
                           r"is not JSON .* --output_dir=.*pb_sc_b1_0.9\)"):
    mechanism_report.report(directory, [])
  with open(path, "w", encoding="utf-8") as f:
    f.write(json.dumps({"stage": "one", "method": "pb"}) + "\n")
  with pytest.raises(mechanism_report.MechanismReportError, match=r"its 'stage' is 'one'"):
    mechanism_report.report(directory, [])
  done = _script(f"--dir={directory}", "--results=")
  assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
  assert done.stderr.startswith("error: ") and "measure the run again" in done.stderr


def test_a_results_file_that_is_not_text_is_refused_and_a_bad_line_skipped_and_named(tmp_path):
  directory = str(tmp_path / "mechanism")
  _grid(directory)
  binary = tmp_path / "results.jsonl"
  binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
  with pytest.raises(mechanism_report.MechanismReportError, match=r"results.jsonl is not text"):
    mechanism_report.report(directory, [str(binary)])
  done = _script(f"--dir={directory}", f"--results={binary}")
  assert done.returncode == 2 and "is not text" in done.stderr and "Traceback" not in done.stderr
  results = tmp_path / "study" / "results.jsonl"
  results.parent.mkdir()
  results.write_text(json.dumps(_study_record("pb")) + "\n"
                     + json.dumps({**_study_record("pb_sc"), "test_loss": None}) + "\n"
                     + '[1, 2]\n{"overrides": {"method": "pb"}, "status": "fini')
  text = mechanism_report.report(directory, [str(results)])
  assert "## Left out" in text
  assert f"{results} line 2 is skipped: its 'test_loss' is None" in text
  assert f"{results} line 3 is skipped: it is list, not an object" in text
  assert f"{results} line 4 is skipped: it is not JSON" in text
  assert f"{2.0 / math.log(2):.2f} bits, n = 1" in text  # the good record still counts


def test_a_run_without_records_is_named_in_the_report_not_dropped_silently(tmp_path):
  directory = str(tmp_path / "mechanism")
  _grid(directory)
  _write_run(directory, "pipeoptim_b1_0.9", [])
  text = mechanism_report.report(directory, [])
  assert "3 runs, 3 stages" in text
  left_out = text[text.index("## Left out"):]
  assert "pipeoptim_b1_0.9 is left out of the table and the rank correlations: its " \
         "mechanism.jsonl holds no record" in left_out
  for name in ("pb_b1_0.9", "pb_sc_b1_0.9", "pb_b1_0.99"):
    os.remove(os.path.join(directory, name, "mechanism.jsonl"))
  with pytest.raises(mechanism_report.MechanismReportError, match="is empty"):
    mechanism_report.report(directory, [])


@contextlib.contextmanager
def _read_only(directory):
  """``directory`` made read-only, its files kept: bound onto itself read-only for root (who
  writes past permissions), its permissions for anyone else; skipped where neither works."""
  if os.geteuid() != 0:
    os.chmod(directory, 0o500)
    try:
      yield
    finally:
      os.chmod(directory, 0o700)
    return
  bound = not subprocess.run(["mount", "--bind", directory, directory],
                             capture_output=True).returncode
  try:
    if not bound or subprocess.run(["mount", "-o", "remount,ro,bind", directory],
                                   capture_output=True).returncode:
      pytest.skip("a read-only directory needs a bind mount, which failed here")
    yield
  finally:
    if bound:
      subprocess.run(["umount", directory], capture_output=True, check=False)


def test_a_directory_that_cannot_be_written_is_exit_2_before_anything_is_read(tmp_path):
  directory = str(tmp_path / "mechanism")
  _grid(directory)
  with _read_only(directory):
    done = _script(f"--dir={directory}", "--results=")
  assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
  assert done.stderr.startswith(f"error: --dir={directory} cannot be written: ")


def test_a_report_the_disk_refuses_is_one_paragraph(tmp_path, monkeypatch):
  """Where the check at start-up passed and the disk then refuses (filled, remounted)."""
  directory = str(tmp_path / "mechanism")
  _grid(directory)

  def refused(*args, **kwargs):
    raise PermissionError(13, "Permission denied")
  monkeypatch.setattr(mechanism_report.files, "write", refused)
  with pytest.raises(mechanism_report.MechanismReportError,
                     match=r"cannot be written to .*\(Permission denied\)"):
    mechanism_report.report(directory, [])


def _damaged(rng, data: bytes) -> bytes:
  """``data`` with one seeded random damage: cut short, a byte changed, NUL bytes, a line that is
  JSON but no record, a field of another type, or emptied."""
  kind = rng.randrange(6)
  if kind == 0 and data:
    return data[:rng.randrange(len(data))]
  if kind == 1 and data:
    at = rng.randrange(len(data))
    return data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
  if kind == 2:
    return data + b"\x00" * rng.randint(1, 4)
  if kind == 3:
    return data + rng.choice([b"[]\n", b"null\n", b"3\n", b'"text"\n', b"{}\n"])
  if kind == 4:
    lines = data.split(b"\n")
    record = json.loads(lines[0])
    record[rng.choice(sorted(record))] = rng.choice([None, "x", [1], {"a": 1}, True])
    return b"\n".join([json.dumps(record).encode(), *lines[1:]])
  return b""


@pytest.mark.parametrize("seed", range(2))
def test_fuzz_damaged_inputs_are_a_report_or_one_paragraph_never_a_traceback(tmp_path, seed,
                                                                            monkeypatch):
  """Seeded random damage to a run's records or to the study records: the report either names
  every run it read (and each it left out), or refuses in one paragraph."""
  monkeypatch.setattr(mechanism_report, "plot", lambda records, path: None)  # speed
  rng = random.Random(seed)
  for trial in range(60):
    directory = str(tmp_path / f"trial{trial}")
    _grid(directory)
    results = tmp_path / f"results{trial}.jsonl"
    results.write_text("".join(json.dumps(_study_record(m, test_loss=2.0)) + "\n"
                               for m in ("pb", "pb_sc")))
    target = rng.choice([str(results)] + glob.glob(os.path.join(directory, "*", "*.jsonl")))
    with open(target, "rb") as f:
      data = f.read()
    with open(target, "wb") as f:
      f.write(_damaged(rng, data))
    try:
      text = mechanism_report.report(directory, [str(results)])
    except mechanism_report.MechanismReportError as e:
      assert "\n" not in str(e) and str(e).strip(), (trial, target)
      continue
    for run in ("pb_b1_0.9", "pb_sc_b1_0.9", "pb_b1_0.99"):
      method, momentum = run.rsplit("_b1_", 1)
      assert (f"| {method} | {float(momentum):g} |" in text or
              f"{os.path.join(directory, run)} is left out" in text), (trial, target, run)
