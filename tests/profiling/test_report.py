"""The benchmark report is generated from the committed JSON files, and the same every time."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from pipejax.profiling import report
from tests.helpers import ROOT

BENCHMARKS = os.path.join(ROOT, "docs", "benchmarks")


def test_committed_report_is_what_the_committed_json_renders_to():
  proc = subprocess.run([sys.executable, os.path.join("scripts", "benchmark_report.py"), "--check"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  with open(report.report_path(BENCHMARKS), encoding="utf-8") as f:
    text = f.read()
  for name in report.read_benchmarks(BENCHMARKS):
    assert f"\n## {name}\n" in text


def test_regenerating_twice_gives_the_same_bytes_and_a_stale_report_is_detected(tmp_path):
  for path in os.listdir(BENCHMARKS):
    if path.endswith(".json"):
      shutil.copy(os.path.join(BENCHMARKS, path), tmp_path / path)
  command = [sys.executable, os.path.join("scripts", "benchmark_report.py"), f"--folder={tmp_path}"]
  runs = []
  for _ in range(2):
    assert subprocess.run(command, cwd=ROOT, capture_output=True, timeout=120).returncode == 0
    runs.append((tmp_path / report.REPORT_NAME).read_bytes())
  assert runs[0] == runs[1]
  with open(report.report_path(BENCHMARKS), "rb") as f:
    assert f.read() == runs[0]
  # A changed measurement makes the report stale until it is rendered again.
  (name,) = [p for p in sorted(os.listdir(tmp_path)) if p.endswith(".json")][:1]
  data = json.loads((tmp_path / name).read_text())
  data["load_average_at_start"] = [9.0, 9.0, 9.0]
  (tmp_path / name).write_text(json.dumps(data))
  proc = subprocess.run(command + ["--check"], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 1 and "out of date" in proc.stderr
  assert "to 9.0." in report.build(str(tmp_path))


def test_report_gives_machine_load_range_and_one_table_per_record_shape():
  text = report.render({"b": {
      "device": "cpu", "cpu_count": 2, "jax": "0.1", "xla_flags": "",
      "load_average_at_start": [1.25, 1.5, 2.0], "load_average_at_end": [0.5, 1.0, 1.0],
      "workloads": {"depth": "an MLP"},
      "depth": [{"num_stages": 8, "samples_per_s": 1234.5678},
                {"num_stages": 8, "method": "pb", "relative_to_pb": 1.0, "meets": True},
                {"num_stages": 16, "samples_per_s": None}]}})
  assert "Machine: device cpu, cpu_count 2, jax 0.1, xla_flags (none)." in text
  assert "at start and end): 0.5 to 2.0." in text
  assert "`depth`: an MLP." in text
  assert "| 8 | 1235 |" in text and "| 16 | — |" in text and "| 8 | pb | 1 | yes |" in text
  rules = [line for line in text.splitlines() if line.startswith("|---")]
  assert rules == ["|---|---|", "|---|---|---|---|"]
  assert text.endswith("|\n")


def test_a_folder_without_benchmarks_or_with_a_broken_json_is_refused(tmp_path):
  with pytest.raises(ValueError, match="holds no benchmark JSON"):
    report.build(str(tmp_path))
  (tmp_path / "x.json").write_text("{")
  with pytest.raises(ValueError, match=r"x\.json is not valid JSON .*scripts/benchmark\.py"):
    report.build(str(tmp_path))
