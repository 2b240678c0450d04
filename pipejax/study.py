"""Studies: a grid of training runs declared in a file, and the records its runs leave.

A study file (``configs/studies/*.py``) defines ``get_study(arg)`` returning a :class:`Study`: the
training config every run starts from, the grid of overrides (method x depth x seed x ...), what
the report shows. ``scripts/study.py`` runs the grid as separate trainer processes and appends one
record per finished run to ``results.jsonl``. This module holds the study's declaration and its
records; ``pipejax.study_report`` makes the tables, statistics and figures from the records alone,
so a report can be regenerated, merged or published without the runs' workdirs.
"""

from __future__ import annotations

import collections
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


# How reports name the grid keys most studies sweep.
KEY_NAMES = {"model_kwargs.depth": "stages", "reference.lr": "reference lr",
             "micro_batch_size": "micro-batch", "method": "method"}
TABLE_KINDS = ("mean", "gap", "stability", "cells", "tuned")
FIGURE_KINDS = ("mean", "gap", "staleness", "curves")


@dataclasses.dataclass(frozen=True)
class Table:
  """A markdown table of one metric: ``rows`` x ``columns`` (two grid keys).

  kind: 'mean' (n, mean and 95% CI of ``metric`` over seeds), 'gap' (the gap to the study's
  baseline paired by seed, with its 95% CI and p-value), 'stability' (per column value, the
  interval of ``rows`` values between the largest that trains and the smallest that fails),
  'cells' (one line per grid point, whatever keys set it: its mean and its gap to the baseline;
  ``rows`` and ``columns`` are unused) or 'tuned' (per column value, the ``rows`` value with the
  best mean, and the gap there to the baseline at the baseline's own best value).

  ``metric`` is a record field (``test_accuracy``, ``test_loss``) or ``samples_to:A``: the
  training samples a run took to first reach test accuracy A (runs that never did are counted
  as 'not reached').
  """

  title: str
  rows: str
  columns: str
  kind: str = "mean"
  metric: str = "test_accuracy"
  where: tuple = ()  # ((key, value), ...): only runs with these overrides (None: key not set)
  scale: float = 100.0  # cells show metric * scale (accuracy in percent)
  decimals: int = 2


@dataclasses.dataclass(frozen=True)
class Figure:
  """A PNG of ``metric`` against grid key ``x``, one line per ``series`` value.

  kind 'mean' and 'gap' draw the cells' means with 95% CIs, diverged runs in a band of their own
  below the axis; 'curves' draws the mean test accuracy over training samples (with its 95% CI)
  at the grid point ``where``; 'staleness' draws each series' per-stage weight discrepancy (the
  runs' diagnostics) at the grid point ``where``.
  """

  file: str
  x: str
  series: str
  kind: str = "mean"
  metric: str = "test_accuracy"
  log_x: bool = False
  where: tuple = ()  # ((key, value), ...): only runs with these overrides
  title: str = ""  # for a reader: never a config key
  x_label: str = ""
  x_unit: float = 1.0  # x is drawn as value / x_unit (a learning rate as a multiplier)
  threshold: float | None = None  # a horizontal line at this metric value, e.g. a stability bar


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
    margin: When set (a fraction of the metric: 0.005 is half a point of accuracy), each gap
      gets a non-inferiority and an equivalence verdict at this margin (one and two one-sided
      paired t-tests).
    labels: Readable names of grid values for the report's text and figures, e.g.
      {'pb_sc_lwp': 'PB + SC + LWP'}.
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
  margin: float | None = None
  labels: dict[str, str] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    for table in self.tables:
      if table.kind not in TABLE_KINDS:
        raise StudyError(f"Table {table.title!r}: kind {table.kind!r} is not one of "
                         f"{', '.join(TABLE_KINDS)}.")
    for figure in self.figures:
      if figure.kind not in FIGURE_KINDS:
        raise StudyError(f"Figure {figure.file!r}: kind {figure.kind!r} is not one of "
                         f"{', '.join(FIGURE_KINDS)}.")
    if self.margin is not None and not (isinstance(self.margin, (int, float)) and
                                        0 < self.margin < 1):
      raise StudyError(f"Study {self.name!r}: margin must be a fraction in (0, 1) of the metric "
                       f"(0.005 is half a point of accuracy); got {self.margin!r}.")

  def label(self, value: Any) -> str:
    """How the report names a grid key or value: ``labels``, then a method's display name, else
    the value itself."""
    from pipejax.methods import DISPLAY_NAMES  # pylint: disable=import-outside-toplevel
    text = str(value)
    return self.labels.get(text, DISPLAY_NAMES.get(text, KEY_NAMES.get(text, text)))

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
  are retried, and so is a run recorded without ``init_digest``: it was made before every method
  of a seed started from the same weights, so it cannot be paired with the runs made since."""
  return bool(record) and record["status"] in _DONE and \
      record.get("fixed") == _jsonable(study.fixed) and record.get("config") == study.config \
      and (record["status"] == SKIPPED or bool(record.get("init_digest")))


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
  others = key_of({k: v for k, v in overrides.items() if k != key})
  for r in records:
    value = r["overrides"].get(key)
    if (r["status"] in (DIVERGED, SKIPPED, FINISHED) and value is not None
        and value < overrides[key]
        and key_of({k: v for k, v in r["overrides"].items() if k != key}) == others
        and (r["status"] != FINISHED or not is_number(r.get("test_accuracy"))
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
    for key in ("test_accuracy", "test_loss", "initial_test_loss", "init_digest",
                "train_seconds", "num_stages", "samples", "learning_rate", "momentum"):
      record[key] = summary.get(key)
    record["status"] = DIVERGED if diverged(record) else FINISHED
  elif "diverged" in log_tail.lower():
    record["status"] = DIVERGED
  else:
    record["status"] = FAILED
    record["error"] = log_tail[-2000:]
  # Where the run's times come from: the devices the trainer saw, and this host's cores.
  device = (summary or {}).get("device")
  record["machine"] = (f"{device}, " if device else "") + f"{os.cpu_count()} CPU cores"
  if not record.get("init_digest"):  # a run that stopped before its summary logged it
    record["init_digest"] = logged_init_digest(os.path.join(run_dir, "log.txt"))
  curve = test_curve(run_dir)
  if curve:
    record["test_curve"] = curve
  staleness = _mean_staleness(run_dir)
  if staleness is not None:
    record["weight_discrepancy"] = staleness
  timing = log_timing(os.path.join(run_dir, "log.txt"))
  if timing:
    record["timing"] = timing
  return record


_INIT_DIGEST = re.compile(r"Initial weights: sha256 ([0-9a-f]{64})")


def logged_init_digest(path: str) -> str | None:
  """The initial weights' digest a trainer logged (the last invocation's), if any."""
  if not os.path.exists(path):
    return None
  with open(path, errors="replace") as f:
    found = _INIT_DIGEST.findall(f.read())
  return found[-1] if found else None


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


def test_curve(run_dir: str) -> list[list[float]]:
  """The run's test evaluations as ``[samples, accuracy, loss]`` rows, in order of samples."""
  from pipejax import metrics as metrics_lib  # no JAX: plain JSONL reading
  rows = {r["samples"]: [r["samples"], r.get("accuracy"), r.get("loss")]
          for r in metrics_lib.read_records(run_dir) if r.get("split") == "test"}
  return [rows[k] for k in sorted(rows)]


def samples_to_reach(record: dict, accuracy: float) -> int | None:
  """The training samples after which the run's test accuracy first reached ``accuracy``."""
  for samples, value, _ in record.get("test_curve") or ():
    if is_number(value) and value >= accuracy:
      return samples
  return None


def metric_of(record: dict, metric: str) -> Any:
  """A record's value of a table's metric (a field, or ``samples_to:A``)."""
  if metric.startswith("samples_to:"):
    return samples_to_reach(record, float(metric.split(":", 1)[1]))
  return record.get(metric)


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


def diverged(record: dict) -> bool:
  """A run diverged when its final accuracy or loss is not a number, or when its final test loss
  is above the loss at its initial weights: it ended worse than where it started, however finite
  its numbers."""
  final, initial = record.get("test_loss"), record.get("initial_test_loss")
  return (not is_number(record.get("test_accuracy"))
          or (final is not None and not is_number(final))
          or (is_number(final) and is_number(initial) and final > initial))


def is_number(value) -> bool:
  return isinstance(value, (int, float)) and math.isfinite(value)


def _jsonable(value):
  return json.loads(json.dumps(value, default=str))


def key_of(overrides: Overrides) -> tuple:
  """A hashable identity of a set of overrides (values as JSON text: lists are allowed)."""
  return tuple(sorted((k, json.dumps(v)) for k, v in overrides.items()))
