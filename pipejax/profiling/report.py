"""The benchmark report: ``docs/benchmarks/*.json`` as one markdown page.

``scripts/benchmark.py --output=docs/benchmarks/NAME.json`` records a measurement;
``scripts/benchmark_report.py`` renders every recorded JSON into ``docs/benchmarks/README.md``. The
page is a pure function of the JSON files (sorted by name, no clock, no environment), so rendering
twice gives the same bytes and a test can check that the committed page is current.

Each JSON gets a section: the machine and the load it was measured under (the load averages at
start and end, as a range), what each benchmark measured (its ``workloads`` line), and one table per
shape of record (a benchmark whose records carry different fields gets a table per field set).
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Any, Mapping, Sequence

REPORT_NAME = "README.md"
# Fields describing the machine and the process, not measured records.
_MACHINE_FIELDS = ("device", "backend", "device_count", "cpu_count", "cores_available", "jax",
                   "python", "xla_flags")
_LOAD_FIELDS = ("load_average_at_start", "load_average_at_end")


def format_value(value: Any) -> str:
  """One table cell: floats to 4 significant digits, containers as compact JSON."""
  if value is None:
    return "—"
  if isinstance(value, bool):
    return "yes" if value else "no"
  if isinstance(value, float):
    if math.isnan(value) or math.isinf(value):
      return str(value)
    return f"{value:.4g}"
  if isinstance(value, (dict, list, tuple)):
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
  else:
    text = str(value)
  return text.replace("|", "\\|").replace("\n", " ")


def _record_tables(records: Sequence[Mapping[str, Any]]) -> list[list[str]]:
  """Records grouped by their field set, in order of first appearance: the columns of each."""
  shapes: list[list[str]] = []
  for record in records:
    fields = list(record)
    if fields not in shapes:
      shapes.append(fields)
  return shapes


def _table(fields: Sequence[str], records: Sequence[Mapping[str, Any]]) -> list[str]:
  lines = ["| " + " | ".join(f"`{f}`" for f in fields) + " |",
           "|" + "|".join("---" for _ in fields) + "|"]
  for record in records:
    if list(record) == list(fields):
      lines.append("| " + " | ".join(format_value(record[f]) for f in fields) + " |")
  return lines


def _load_range(data: Mapping[str, Any]) -> str | None:
  values = [v for field in _LOAD_FIELDS for v in (data.get(field) or [])]
  if not values:
    return None
  return f"{min(values):.1f} to {max(values):.1f}"


def render_section(name: str, data: Mapping[str, Any]) -> list[str]:
  """The markdown lines of one benchmark JSON named ``name`` (its file name without .json)."""
  lines = [f"## {name}", ""]
  machine = ", ".join(f"{field} {format_value(data[field]) or '(none)'}"
                      for field in _MACHINE_FIELDS if field in data)
  lines.append(f"Machine: {machine}.")
  load = _load_range(data)
  if load is not None:
    lines.append(f"Load average (1, 5 and 15 minutes, at start and end): {load}.")
  lines.append("")
  for benchmark, description in sorted((data.get("workloads") or {}).items()):
    lines += [f"`{benchmark}`: {format_value(description)}.", ""]
  for key, value in data.items():
    if key in _MACHINE_FIELDS or key in _LOAD_FIELDS or key == "workloads":
      continue
    if isinstance(value, list) and value and all(isinstance(r, Mapping) for r in value):
      lines += [f"### {name}: `{key}`", ""]
      for fields in _record_tables(value):
        lines += _table(fields, value) + [""]
    else:
      lines += [f"`{key}`: {format_value(value)}", ""]
  return lines


def render(benchmarks: Mapping[str, Mapping[str, Any]]) -> str:
  """The report page over ``{name: json object}``, sections in name order."""
  lines = [
      "# Benchmark results",
      "",
      "Generated from the JSON files beside this page by `python scripts/benchmark_report.py`;",
      "do not edit by hand. Each JSON was written by `python scripts/benchmark.py "
      "--output=docs/benchmarks/NAME.json`",
      "with the benchmarks its `workloads` names. `docs/performance.md` says what each field "
      "measures and how.",
      "Timings depend on the machine and on what else ran on it: read them as ratios within one",
      "section, never across sections.",
      "",
  ]
  for name in sorted(benchmarks):
    lines += render_section(name, benchmarks[name])
  while lines[-1] == "":
    lines.pop()
  return "\n".join(lines) + "\n"


def read_benchmarks(folder: str) -> dict[str, dict[str, Any]]:
  """``{name: json object}`` of every ``*.json`` in ``folder``."""
  out = {}
  for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
    with open(path, encoding="utf-8") as f:
      try:
        out[os.path.basename(path)[:-len(".json")]] = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}): rewrite it with `python "
                         f"scripts/benchmark.py --output={path}`, or remove it.") from e
  return out


def report_path(folder: str) -> str:
  return os.path.join(folder, REPORT_NAME)


def build(folder: str) -> str:
  """The report of the JSON files in ``folder``; a folder without any is refused."""
  benchmarks = read_benchmarks(folder)
  if not benchmarks:
    raise ValueError(f"{folder} holds no benchmark JSON (*.json): write one with `python "
                     f"scripts/benchmark.py --output={os.path.join(folder, 'NAME.json')}` first.")
  return render(benchmarks)


def write(folder: str) -> str:
  """Writes the report into ``folder``; returns its path."""
  path = report_path(folder)
  text = build(folder)
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  return path


def is_current(folder: str) -> bool:
  """Whether the report in ``folder`` is what its JSON files render to now."""
  path = report_path(folder)
  if not os.path.exists(path):
    return False
  with open(path, encoding="utf-8") as f:
    return f.read() == build(folder)
