"""Studies: a grid of training runs declared in a file, and the tables and figures made from them.

A study file (``configs/studies/*.py``) defines ``get_study(arg)`` returning a :class:`Study`: the
training config every run starts from, the grid of overrides (method x depth x seed x ...), what
the report shows. ``scripts/study.py`` runs the grid as separate trainer processes and appends one
record per finished run to ``results.jsonl``; everything in this module works from those records,
so a report can be regenerated, merged or published without the runs' workdirs.

Conventions of the report:

* a *cell* is every run with the same overrides except ``seed``; it shows mean ± std over its
  seeds (sample std, n - 1), in percentage points;
* a diverged run (non-finite value, or a final accuracy that is not a number) is counted and
  marked, never averaged in;
* a gap is paired by seed: ``acc(method, seed) - acc(baseline, seed)`` with the baseline's run of
  the same cell coordinates, then mean ± std over seeds.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import errno
import importlib.util
import itertools
import json
import math
import os
import re
from typing import Any, Iterable, Sequence

Overrides = dict[str, Any]

FINISHED, DIVERGED, FAILED = "finished", "diverged", "failed"
SKIPPED = "skipped"  # not run: the same point failed at a smaller value of Study.skip_beyond_failure
RESULTS_FILE = "results.jsonl"


class StudyError(ValueError):
  """A study file or a study workdir is unusable; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class Table:
  """A markdown table of one metric: ``rows`` x ``columns`` (two grid keys).

  kind: 'mean' (mean ± std of ``metric``), 'gap' (paired gap to the study's baseline) or
  'stability' (per column value, the largest ``rows`` value at which the method still trains).
  """

  title: str
  rows: str
  columns: str
  kind: str = "mean"
  metric: str = "test_accuracy"
  where: tuple = ()  # ((key, value), ...): only runs with these overrides (None: key not set)
  scale: float = 100.0  # cells show metric * scale (accuracy in percent)


@dataclasses.dataclass(frozen=True)
class Figure:
  """A PNG: ``metric`` (kind 'mean' or 'gap') against grid key ``x``, one line per ``series``.

  kind 'staleness' draws each series' per-stage weight discrepancy (the runs' diagnostics) at
  the grid point ``where``.
  """

  file: str
  x: str
  series: str
  kind: str = "mean"
  metric: str = "test_accuracy"
  log_x: bool = False
  where: tuple = ()  # ((key, value), ...): only runs with these overrides


@dataclasses.dataclass(frozen=True)
class Study:
  """A grid of training runs and what to report about them.

  Attributes:
    name: Short name, used in titles.
    config: The training config file every run starts from (relative to the repository root),
      optionally with its argument, e.g. 'configs/deep_mlp.py:smoke'.
    grids: Each a mapping from a config key (dotted, e.g. 'model_kwargs.depth') to the values it
      takes; the study runs the union of the grids' cartesian products.
    fixed: Overrides applied to every run.
    baseline: Overrides that select the baseline of gaps, e.g. {'method': 'sgd'}.
    tables, figures: What the report shows.
    min_accuracy: For 'stability' tables: a cell still trains when no seed diverged and its mean
      accuracy is at least this.
    skip_beyond_failure: A grid key along which failure is taken to persist (a learning rate):
      a run whose point, with a smaller value of this key and the same seed, already diverged or
      ended below ``min_accuracy`` is not run but recorded as skipped. Saves the costly runs of
      a stability sweep that cannot change its answer.
  """

  name: str
  config: str
  grids: Sequence[dict[str, Sequence[Any]]]
  fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
  baseline: dict[str, Any] = dataclasses.field(default_factory=dict)
  tables: Sequence[Table] = ()
  figures: Sequence[Figure] = ()
  min_accuracy: float = 0.0
  skip_beyond_failure: str | None = None

  def runs(self) -> list[Overrides]:
    """Every run's grid overrides, in a stable order (grids in order, products in order)."""
    seen, runs = set(), []
    for grid in self.grids:
      keys = list(grid)
      for values in itertools.product(*(grid[k] for k in keys)):
        run = dict(zip(keys, values))
        if run_id(run) not in seen:
          seen.add(run_id(run))
          runs.append(run)
    return runs

  def keys(self) -> list[str]:
    """The grid keys, in first-seen order."""
    return list(dict.fromkeys(k for grid in self.grids for k in grid))


def load_study(spec: str) -> Study:
  """Loads ``path[:arg]``: the file's ``get_study(arg)``."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise StudyError(f"No study file {path!r}. Give the path of a file under configs/studies/, "
                     "e.g. --study=configs/studies/depth.py (append :smoke for the quick variant).")
  module_spec = importlib.util.spec_from_file_location("pipejax_study_file", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_study"):
    raise StudyError(f"{path} defines no get_study(arg); a study file returns a "
                     "pipejax.study.Study from get_study (see configs/studies/depth.py).")
  try:
    study = module.get_study(arg or None)
  except ValueError as e:  # the study files' way of refusing an unknown variant
    raise StudyError(f"{path}: {e}") from None
  if not isinstance(study, Study):
    raise StudyError(f"{path}: get_study returned {type(study).__name__}, not a Study.")
  for run in study.runs():
    if "seed" in run and not isinstance(run["seed"], int):
      raise StudyError(f"{path}: seeds must be integers; got {run['seed']!r}.")
  return study


# ----------------------------------------------------------------------------- runs and records


def run_id(overrides: Overrides) -> str:
  """A file-name-safe id of a run, e.g. 'method=pb,model_kwargs.depth=32,seed=0'."""
  parts = [f"{k}={format_value(v)}" for k, v in overrides.items()]
  return ",".join(parts).replace("/", "_").replace(" ", "")


def format_value(value: Any) -> str:
  """A value as the trainer's ``--config.KEY=VALUE`` flag takes it."""
  if isinstance(value, (tuple, list)):
    return "(" + ",".join(format_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  return str(value)


def trainer_flags(study: Study, overrides: Overrides) -> list[str]:
  """The trainer's ``--config.KEY=VALUE`` flags of one run: the study's fixed ones, then the grid's."""
  merged = {**study.fixed, **overrides}
  return [f"--config.{k}={format_value(v)}" for k, v in merged.items()]


RECORD_STATUSES = (FINISHED, DIVERGED, FAILED, SKIPPED)
_DONE = (FINISHED, DIVERGED, SKIPPED)  # never run again; a failed run is retried


def record_problem(value: Any) -> str | None:
  """Why a parsed line of results.jsonl is not a run record, or None when it is one."""
  if not isinstance(value, dict):
    kind = {type(None): "null", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "a number")
    return f"it is {kind}, not a record"
  if not isinstance(value.get("run"), str):
    return "it has no 'run' id"
  if not isinstance(value.get("overrides"), dict):
    return "it has no 'overrides'"
  if not isinstance(value.get("fixed", {}), dict):
    return "its 'fixed' is not an object"
  if not isinstance(value.get("wall_seconds", 0), (int, float)):
    return "its 'wall_seconds' is not a number"
  if value.get("status") not in RECORD_STATUSES:
    return f"its status {value.get('status')!r} is not one of {', '.join(RECORD_STATUSES)}"
  return None


def load_results(workdir: str) -> tuple[list[dict], list[str]]:
  """The records of ``workdir/results.jsonl``, and a sentence for each line that is not one.

  The last record of a run wins, except that a failure never hides a finished, diverged or
  skipped record of the same run. A line that is not a record (cut short by a kill or a full disk,
  or edited by hand) is skipped and named; its run, if it had one, is simply run again.
  """
  path = os.path.join(workdir, RESULTS_FILE)
  if not os.path.exists(path):
    return [], []
  with open(path, "rb") as f:
    data = f.read()
  lines = data.split(b"\n")
  by_run, problems = {}, []
  for number, raw in enumerate(lines, 1):
    if not raw.strip():
      continue
    last = number == len(lines)  # text after the file's last newline
    try:
      record = json.loads(raw)
      problem = record_problem(record)
    except (json.JSONDecodeError, UnicodeDecodeError):
      record, problem = None, "it is not JSON"
    if problem is not None:
      cut = "; cut short by a kill or a full disk" if last else ""
      problems.append(f"{path} line {number} is skipped: {problem}{cut} "
                      f"({raw[:80].decode(errors='replace')!r}).")
      continue
    previous = by_run.get(record["run"])
    if record["status"] == FAILED and previous is not None and previous["status"] in _DONE:
      continue
    by_run[record["run"]] = record
  return list(by_run.values()), problems


def read_results(workdir: str) -> list[dict]:
  """The records of ``workdir/results.jsonl`` (see :func:`load_results`)."""
  return load_results(workdir)[0]


def set_aside_partial_line(workdir: str) -> str | None:
  """Ends results.jsonl at its last newline; returns a message when that moved anything.

  A write cut short (a full disk, a kill) leaves a line without its end; the next record appended
  onto it would be lost with it. A cut line that still parses as a record only lacks its newline,
  which is then added; anything else moves to ``results.jsonl.partial-N``.
  """
  path = os.path.join(workdir, RESULTS_FILE)
  if not os.path.exists(path) or not os.path.getsize(path):
    return None
  with open(path, "rb") as f:
    f.seek(-1, os.SEEK_END)
    if f.read(1) == b"\n":
      return None
    f.seek(0)
    data = f.read()
  end = data.rfind(b"\n") + 1
  tail = data[end:]
  try:
    complete = record_problem(json.loads(tail)) is None
  except (json.JSONDecodeError, UnicodeDecodeError):
    complete = False
  if complete:
    _append_bytes(path, b"\n")
    return None
  number = 1
  while os.path.exists(f"{path}.partial-{number}"):
    number += 1
  aside = f"{path}.partial-{number}"
  with open(aside, "wb") as f:
    f.write(tail)
    f.flush()
    os.fsync(f.fileno())
  os.truncate(path, end)
  return (f"{path} ended in a line cut short ({len(tail)} bytes without an end of line, left by a "
          f"kill or a full disk); moved it to {aside}. The run it belonged to runs again.")


def _append_bytes(path: str, data: bytes) -> None:
  """One ``write`` of ``data`` at the end of ``path``, then fsync: a record is all there or cut
  at its end, never interleaved."""
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    written = os.write(fd, data)
    if written != len(data):
      raise OSError(errno.ENOSPC, f"No space left on device: wrote {written} of {len(data)} "
                    "bytes", path)
    os.fsync(fd)
  finally:
    os.close(fd)


def append_result(workdir: str, record: dict) -> str | None:
  """Appends ``record`` as one line of results.jsonl; returns the message of
  :func:`set_aside_partial_line` when a cut line had to be set aside first."""
  message = set_aside_partial_line(workdir)
  _append_bytes(os.path.join(workdir, RESULTS_FILE), (json.dumps(record) + "\n").encode())
  return message


def is_done(record: dict | None, study: Study, overrides: Overrides) -> bool:
  """A run is done when it finished, diverged or was skipped with the same settings; failures
  are retried."""
  return bool(record) and record["status"] in _DONE and \
      record.get("fixed") == _jsonable(study.fixed) and record.get("config") == study.config


def recipe_change(study: Study, records: Iterable[dict], workdir: str) -> str | None:
  """The refusal when done records were made with other ``fixed`` values or config; else None.

  Every trainer would refuse to resume its run with another recipe, and a rerun from scratch
  would mix two recipes in one report: the study stops before, saying what differs.
  """
  fixed, seen = _jsonable(study.fixed), collections.Counter()
  for r in records:
    if r["status"] not in _DONE:
      continue
    old_fixed = r.get("fixed") or {}
    diff = [f"config: {r.get('config')} -> {study.config}"] if r.get("config") != study.config \
        else []
    for key in dict.fromkeys([*old_fixed, *fixed]):
      before, after = old_fixed.get(key, "(not set)"), fixed.get(key, "(not set)")
      if before != after:
        diff.append(f"{key}: {before} -> {after}")
    if diff:
      seen["; ".join(diff)] += 1
  if not seen:
    return None
  lines = [f"{count} run(s) with {diff}" for diff, count in seen.items()]
  return (f"The study file's settings differ from those of the runs recorded in "
          f"{os.path.join(workdir, RESULTS_FILE)} (recorded -> now): " + " | ".join(lines) +
          ". A study's runs share one recipe, and a trainer refuses to resume its run with "
          "another. To keep those results, restore the old values in the study file; to run the "
          "new recipe, give the study another --workdir (or move this one away).")


def failed_below(study: Study, records: Iterable[dict], overrides: Overrides) -> Any:
  """The smaller ``study.skip_beyond_failure`` value at which this point failed, else None."""
  key = study.skip_beyond_failure
  if key is None or key not in overrides:
    return None
  others = _key({k: v for k, v in overrides.items() if k != key})
  for r in records:
    value = r["overrides"].get(key)
    if (r["status"] in (DIVERGED, SKIPPED, FINISHED) and value is not None
        and value < overrides[key]
        and _key({k: v for k, v in r["overrides"].items() if k != key}) == others
        and (r["status"] != FINISHED or not _is_number(r.get("test_accuracy"))
             or r["test_accuracy"] < study.min_accuracy)):
      return value
  return None


def skipped_record(study: Study, overrides: Overrides, failed_at: Any) -> dict:
  return {"run": run_id(overrides), "overrides": _jsonable(overrides),
          "fixed": _jsonable(study.fixed), "config": study.config, "status": SKIPPED,
          "reason": f"failed at {study.skip_beyond_failure}={failed_at}", "wall_seconds": 0.0}


def record_from_run(study: Study, overrides: Overrides, run_dir: str, returncode: int,
                    wall_seconds: float, log_tail: str) -> dict:
  """The results record of a trainer process that ended with ``returncode``."""
  record = {"run": run_id(overrides), "overrides": _jsonable(overrides),
            "fixed": _jsonable(study.fixed), "config": study.config,
            "wall_seconds": round(wall_seconds, 1)}
  summary_path = os.path.join(run_dir, "summary.json")
  summary = None
  if os.path.exists(summary_path):
    with open(summary_path) as f:
      summary = json.load(f)
  if returncode == 0 and summary and not summary.get("stopped_by"):
    accuracy = summary.get("test_accuracy")
    record["status"] = FINISHED if _is_number(accuracy) else DIVERGED
    for key in ("test_accuracy", "test_loss", "train_seconds", "num_stages", "samples",
                "learning_rate", "momentum"):
      record[key] = summary.get(key)
  elif "diverged" in log_tail.lower():
    record["status"] = DIVERGED
  else:
    record["status"] = FAILED
    record["error"] = log_tail[-2000:]
  # Where the run's times come from: the devices the trainer saw, and this host's cores.
  device = (summary or {}).get("device")
  record["machine"] = (f"{device}, " if device else "") + f"{os.cpu_count()} CPU cores"
  staleness = _mean_staleness(run_dir)
  if staleness is not None:
    record["weight_discrepancy"] = staleness
  timing = log_timing(os.path.join(run_dir, "log.txt"))
  if timing:
    record["timing"] = timing
  return record


_LOG_TIME = re.compile(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d\d\.\d+)")
_PROGRESS = re.compile(r"\[(\d+)/\d+ samples")


def log_timing(path: str) -> dict | None:
  """Where a trainer's wall time went, from its absl log's timestamps (this session's lines).

  ``setup_s``: process start to the model line (imports, data, abstract tracing);
  ``first_chunk_s``: to the first progress line (compiling the tick, then one chunk);
  ``steady_samples_per_s``: the rate between the first and the last progress line.
  """
  if not os.path.exists(path):
    return None
  with open(path, errors="replace") as f:
    lines = f.read().split("\n$ ")[-1].splitlines()  # the last invocation only
  stamps = []
  for line in lines:
    match = _LOG_TIME.match(line)
    if match:
      h, m, sec = match.groups()
      stamps.append((int(h) * 3600 + int(m) * 60 + float(sec), line))
  if not stamps:
    return None
  start = stamps[0][0]
  model = next((t for t, l in stamps if "] Model:" in l), None)
  progress = [(t, int(p.group(1))) for t, l in stamps if (p := _PROGRESS.search(l))]
  if model is None or len(progress) < 2:
    return None
  elapsed = lambda t: (t - start) % 86400  # a run may cross midnight
  (t0, n0), (t1, n1) = progress[0], progress[-1]
  return {"setup_s": round(elapsed(model), 1), "first_chunk_s": round(elapsed(t0) - elapsed(model), 1),
          "steady_samples_per_s": round((n1 - n0) / max((t1 - t0) % 86400, 1e-9), 1)}


def _mean_staleness(run_dir: str) -> list[float] | None:
  """Per stage, the mean of the logged ``weight_discrepancy`` over the second half of training."""
  from pipejax import metrics as metrics_lib  # no JAX: plain JSONL reading
  rows = [r for r in metrics_lib.read_records(run_dir)
          if r.get("split") == "diagnostics" and "weight_discrepancy" in r]
  if not rows:
    return None
  rows = rows[len(rows) // 2:]
  per_stage = list(zip(*(r["weight_discrepancy"] for r in rows)))
  return [sum(v) / len(v) for v in per_stage]


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and math.isfinite(value)


def _jsonable(value):
  return json.loads(json.dumps(value, default=str))


# ----------------------------------------------------------------------------- aggregation


@dataclasses.dataclass
class Cell:
  """The runs of one grid point (all seeds)."""

  values: list[float]  # the metric of each finished run
  diverged: int
  seeds: list[int]
  planned: int = 0

  @property
  def mean(self) -> float:
    return sum(self.values) / len(self.values) if self.values else math.nan

  @property
  def std(self) -> float:
    n = len(self.values)
    if n < 2:
      return math.nan
    mean = self.mean
    return math.sqrt(sum((v - mean) ** 2 for v in self.values) / (n - 1))


def _without_seed(overrides: Overrides) -> tuple:
  return tuple(sorted((k, json.dumps(v)) for k, v in overrides.items() if k != "seed"))


def cells(records: Iterable[dict], metric: str = "test_accuracy") -> dict[tuple, Cell]:
  """Groups records by their overrides without the seed."""
  grouped: dict[tuple, Cell] = {}
  for r in records:
    if r["status"] not in (FINISHED, DIVERGED):
      continue
    cell = grouped.setdefault(_without_seed(r["overrides"]), Cell([], 0, []))
    cell.seeds.append(r["overrides"].get("seed", 0))
    if r["status"] == DIVERGED or not _is_number(r.get(metric)):
      cell.diverged += 1
    else:
      cell.values.append(r[metric])
  return grouped


def paired_gaps(records: Sequence[dict], baseline: Overrides,
                metric: str = "test_accuracy") -> dict[tuple, Cell]:
  """Per cell, ``metric - baseline's metric`` paired by seed (diverged runs counted, not paired).

  The baseline of a run is the run with the same overrides except the baseline's keys (and their
  values). Where the baseline's run of a seed is missing or diverged, that seed has no gap.
  """
  by_key = {}
  for r in records:
    if r["status"] == FINISHED and _is_number(r.get(metric)):
      by_key[_key(r["overrides"])] = r[metric]
  gaps: dict[tuple, Cell] = {}
  for r in records:
    if r["status"] not in (FINISHED, DIVERGED):
      continue
    cell = gaps.setdefault(_without_seed(r["overrides"]), Cell([], 0, []))
    cell.seeds.append(r["overrides"].get("seed", 0))
    if r["status"] == DIVERGED or not _is_number(r.get(metric)):
      cell.diverged += 1
      continue
    reference = by_key.get(_key({**r["overrides"], **baseline}))
    if reference is not None:
      cell.values.append(r[metric] - reference)
  return gaps


def _key(overrides: Overrides) -> tuple:
  return tuple(sorted((k, json.dumps(v)) for k, v in overrides.items()))


def _lookup(grouped: dict[tuple, Cell], point: Overrides) -> Cell | None:
  """The cell whose overrides include every item of ``point``, if exactly one does."""
  wanted = {(k, json.dumps(v)) for k, v in point.items()}
  found = [c for key, c in grouped.items() if wanted <= set(key)]
  return found[0] if len(found) == 1 else None


def _axis_values(records: Sequence[dict], key: str) -> list:
  values = []
  for r in records:
    if key in r["overrides"] and r["overrides"][key] not in values:
      values.append(r["overrides"][key])
  try:
    return sorted(values)
  except TypeError:
    return values


def _order(study: Study, key: str, present: list) -> list:
  """Grid order for a key (the study file's order), keeping only values that have records."""
  order = [v for grid in study.grids for v in grid.get(key, ())]
  ordered = list(dict.fromkeys(v for v in order if v in present))
  return ordered + [v for v in present if v not in ordered]


# ----------------------------------------------------------------------------- report


def format_cell(cell: Cell | None, scale: float = 100.0, signed: bool = False) -> str:
  """'85.12 ± 0.31' (n = 3), with '(1/3 div.)' for diverged seeds, 'div. 3/3' when all did."""
  if cell is None:
    return "—"
  total = len(cell.values) + cell.diverged
  if not cell.values:
    return f"div. {cell.diverged}/{total}" if cell.diverged else "—"
  sign = "+" if signed else ""
  text = f"{cell.mean * scale:{sign}.2f}"
  if len(cell.values) > 1:
    text += f" ± {cell.std * scale:.2f} (n={len(cell.values)})"
  if cell.diverged:
    text += f" ({cell.diverged}/{total} div.)"
  elif len(cell.values) == 1:
    text += " (1 seed)"
  return text


def select(records: Sequence[dict], where: Iterable[tuple]) -> list[dict]:
  """The records whose overrides have every ``(key, value)`` of ``where`` (None: unset or None)."""
  return [r for r in records if all(r["overrides"].get(k) == v for k, v in where)]


def stable_limit(study: Study, records: Sequence[dict], table: Table, column_value) -> Any:
  """The largest ``table.rows`` value at which the column's method still trains (None: never)."""
  records = select(records, table.where)
  grouped = cells(records, table.metric)
  best = None
  for value in _order(study, table.rows, _axis_values(records, table.rows)):
    cell = _lookup(grouped, {table.rows: value, table.columns: column_value})
    trains = cell is not None and cell.values and not cell.diverged and \
        cell.mean >= study.min_accuracy
    if trains and (best is None or value > best):
      best = value
  return best


def markdown_table(study: Study, records: Sequence[dict], table: Table) -> str:
  records = select(records, table.where)
  if not records:
    return "(no runs recorded yet)"
  rows = _order(study, table.rows, _axis_values(records, table.rows))
  columns = _order(study, table.columns, _axis_values(records, table.columns))
  if table.kind == "stability":
    lines = [f"| {table.columns} | largest {table.rows} that trains |", "|---|---|"]
    for c in columns:
      limit = stable_limit(study, records, table, c)
      lines.append(f"| {c} | {'none' if limit is None else limit} |")
    return "\n".join(lines)
  if table.kind == "gap":
    grouped = paired_gaps(records, study.baseline, table.metric)
  elif table.kind == "mean":
    grouped = cells(records, table.metric)
  else:
    raise StudyError(f"Table kind {table.kind!r} is not one of 'mean', 'gap', 'stability'.")
  # Points whose every run was skipped: a smaller value of the swept key already failed.
  # Keyed by JSON text, as _key is: an axis's values may be lists (a model's hidden widths).
  point_of = lambda row, column: (json.dumps(row), json.dumps(column))
  status_by_point = {}
  for rec in records:
    point = point_of(rec["overrides"].get(table.rows), rec["overrides"].get(table.columns))
    status_by_point.setdefault(point, set()).add(rec["status"])
  skipped = {p for p, statuses in status_by_point.items() if statuses == {SKIPPED}}
  header = f"| {table.rows} | " + " | ".join(str(c) for c in columns) + " |"
  lines = [header, "|" + "---|" * (len(columns) + 1)]
  for r in rows:
    entries = [format_cell(_lookup(grouped, {table.rows: r, table.columns: c}), table.scale,
                           signed=table.kind == "gap")
               if point_of(r, c) not in skipped else "not run (failed below)" for c in columns]
    lines.append(f"| {r} | " + " | ".join(entries) + " |")
  return "\n".join(lines)


def write_csv(records: Sequence[dict], path: str) -> None:
  keys = sorted({k for r in records for k in r["overrides"]})
  fields = ["run", *keys, "status", "test_accuracy", "test_loss", "num_stages", "samples",
            "train_seconds", "wall_seconds"]
  tmp = path + ".tmp"
  with open(tmp, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(fields)
    for r in records:
      writer.writerow([r["run"], *(r["overrides"].get(k, "") for k in keys), r["status"],
                       *(r.get(k, "") for k in fields[len(keys) + 2:])])
  os.replace(tmp, path)


def draw_figure(study: Study, records: Sequence[dict], figure: Figure, path: str) -> bool:
  """Draws ``figure`` to ``path``; False when no record has what it needs."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  selected = select(records, figure.where)
  fig, ax = plt.subplots(figsize=(7, 4.2))
  drawn = False
  series_values = _order(study, figure.series, _axis_values(selected, figure.series))
  if figure.kind == "staleness":
    for s in series_values:
      runs = [r for r in selected if r["overrides"].get(figure.series) == s
              and r.get("weight_discrepancy")]
      if runs:
        run = min(runs, key=lambda r: r["overrides"].get("seed", 0))
        ax.plot(range(len(run["weight_discrepancy"])), run["weight_discrepancy"], marker="o",
                ms=3, label=str(s))
        drawn = True
    ax.set_xlabel("stage")
    ax.set_ylabel("‖w_fwd − w_bwd‖ / ‖w_bwd‖ (second half of training)")
    ax.set_yscale("symlog", linthresh=1e-5)
  else:
    grouped = (paired_gaps(selected, study.baseline, figure.metric) if figure.kind == "gap"
               else cells(selected, figure.metric))
    xs = _order(study, figure.x, _axis_values(selected, figure.x))
    for s in series_values:
      points = []
      for x in xs:
        cell = _lookup(grouped, {figure.x: x, figure.series: s})
        if cell is not None and cell.values:
          points.append((x, cell.mean * 100, 0 if math.isnan(cell.std) else cell.std * 100,
                         cell.diverged))
      if points:
        px, py, pe, _ = zip(*points)
        ax.errorbar(px, py, yerr=pe, marker="o", ms=4, capsize=3, label=str(s))
        drawn = True
      for x in xs:  # diverged cells: a cross on the x axis
        cell = _lookup(grouped, {figure.x: x, figure.series: s})
        if cell is not None and cell.diverged and not cell.values:
          ax.plot([x], [ax.get_ylim()[0] if drawn else 0], marker="x", color="k")
    ax.set_xlabel(figure.x)
    ax.set_ylabel(("gap to " + ", ".join(f"{k}={v}" for k, v in study.baseline.items())
                   if figure.kind == "gap" else figure.metric) + " (points)")
    if figure.kind == "gap":
      ax.axhline(0, color="k", lw=0.8)
    if figure.log_x:
      ax.set_xscale("log", base=2)
  if not drawn:
    plt.close(fig)
    return False
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, ncol=2)
  ax.set_title(f"study '{study.name}'" + "".join(f", {k}={v}" for k, v in figure.where))
  fig.tight_layout()
  tmp = path + ".tmp.png"
  fig.savefig(tmp, dpi=110)
  plt.close(fig)
  os.replace(tmp, path)
  return True


def write_report(study: Study, workdir: str, command: str = "") -> str:
  """Writes results.csv, report.md and the figures into ``workdir``; returns the markdown."""
  records = read_results(workdir)
  write_csv(records, os.path.join(workdir, "results.csv"))
  planned = len(study.runs())
  counts = {s: sum(r["status"] == s for r in records) for s in (FINISHED, DIVERGED, FAILED)}
  wall = sum(r.get("wall_seconds", 0) for r in records)
  parts = [f"# Study '{study.name}'", ""]
  if command:
    parts += ["Regenerate (skips finished runs, resumes stopped ones):", "", "```bash", command,
              "```", ""]
  parts.append(f"{len(records)} of {planned} runs recorded: {counts[FINISHED]} finished, "
               f"{counts[DIVERGED]} diverged, {counts[FAILED]} failed; "
               f"{wall / 3600:.2f} h of run time (sum over runs). Cells: mean ± std over seeds "
               "in points; diverged runs are counted, never averaged.")
  machines = collections.Counter(r.get("machine", "not recorded") for r in records
                                 if r["status"] != SKIPPED)
  if machines:
    parts += ["", "Machines (runs): " + "; ".join(f"{m} ({n})" for m, n in machines.items()) + "."]
  for table in study.tables:
    parts += ["", f"## {table.title}", "", markdown_table(study, records, table)]
  figures = [f for f in study.figures
             if draw_figure(study, records, f, os.path.join(workdir, f.file))]
  for figure in figures:
    parts += ["", f"![{figure.file}]({figure.file})"]
  text = "\n".join(parts) + "\n"
  tmp = os.path.join(workdir, "report.md.tmp")
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, os.path.join(workdir, "report.md"))
  return text
