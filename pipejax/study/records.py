"""A study's records: one line of ``results.jsonl`` per run, written whole, read defensively.

A record is what a trainer process left: its status (finished, diverged, failed, skipped), its
results and the facts a reader needs to trust them (the starting weights' digest, the test curve,
the machine). Appends are one write of a whole line with fsync; a line cut short by a kill or a
full disk is set aside, and a line that is not a record is skipped and named.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
from typing import Any, Iterable

from pipejax import config as config_lib
from pipejax import files
from pipejax.study.spec import Overrides, Study, key_of, run_id

FINISHED, DIVERGED, FAILED = "finished", "diverged", "failed"
# Not run: the same point failed at a smaller value of Study.skip_beyond_failure.
SKIPPED = "skipped"
RESULTS_FILE = "results.jsonl"


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

  A run is known by its overrides, whatever the order of their keys (``run_id``), so it has one
  record however often it was recorded. The last record of a run wins, except that a failure
  never hides a finished, diverged or skipped record of the same run. A line that is not a
  record (cut short by a kill or a full disk, or edited by hand) is skipped and named; its run,
  if it had one, is simply run again.
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
    # A run is known by its overrides, in today's config keys: a record written before run ids
    # were the same whatever the order of a grid's keys names its run in that order, or by a
    # field since renamed, and is the same run.
    record = {**record, "overrides": config_lib.current_keys(record["overrides"]),
              **({"fixed": config_lib.current_keys(record["fixed"])} if "fixed" in record else {})}
    record["run"] = run_id(record["overrides"])
    rid = record["run"]
    previous = by_run.get(rid)
    if record["status"] == FAILED and previous is not None and previous["status"] in _DONE:
      continue
    by_run[rid] = record
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
    files.append(path, b"\n")
    return None
  number = 1
  while os.path.exists(f"{path}.partial-{number}"):
    number += 1
  aside = f"{path}.partial-{number}"
  files.write(aside, tail)
  os.truncate(path, end)
  return (f"{path} ended in a line cut short ({len(tail)} bytes without an end of line, left by a "
          f"kill or a full disk); moved it to {aside}. The run it belonged to runs again.")


def append_result(workdir: str, record: dict) -> str | None:
  """Appends ``record`` as one line of results.jsonl; returns the message of
  :func:`set_aside_partial_line` when a cut line had to be set aside first."""
  message = set_aside_partial_line(workdir)
  files.append(os.path.join(workdir, RESULTS_FILE), json.dumps(record) + "\n")
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
  summary, summary_problem = read_summary(run_dir)
  if returncode == 0 and summary and not summary.get("stopped_by"):
    for key in ("test_accuracy", "test_loss", "initial_test_loss", "init_digest",
                "train_seconds", "num_stages", "samples", "learning_rate", "momentum"):
      record[key] = summary.get(key)
    record["status"] = DIVERGED if diverged(record) else FINISHED
  elif "diverged" in log_tail.lower():
    record["status"] = DIVERGED
    point = divergence_point(log_tail)
    if point:
      record["divergence"] = point
  else:
    record["status"] = FAILED
    record["error"] = log_tail[-2000:]
    if returncode == 0 and summary_problem:
      record["error"] = f"exit 0, but {summary_problem}\n" + record["error"][-1800:]
  # Where the run's times come from: the devices the trainer saw, and this host's cores.
  device = (summary or {}).get("device")
  record["machine"] = (f"{device}, " if device else "") + f"{os.cpu_count()} CPU cores"
  if not record.get("init_digest"):  # a run that stopped before its summary logged it
    record["init_digest"] = logged_init_digest(os.path.join(run_dir, "log.txt"))
  curve = test_curve(run_dir)
  if curve:
    record["test_curve"] = curve
    train = train_curve(run_dir, [row[0] for row in curve])
    if train:
      record["train_curve"] = train
      record["train_loss"] = train[-1][1]
  staleness = _mean_staleness(run_dir)
  if staleness is not None:
    record["weight_discrepancy"] = staleness
  timing = log_timing(os.path.join(run_dir, "log.txt"))
  if timing:
    record["timing"] = timing
  return record


def read_summary(run_dir: str) -> tuple[dict | None, str | None]:
  """A trainer's ``summary.json`` and, when it is there but cannot be used (empty or cut short by a
  full disk, not JSON, not an object), why. An unusable summary counts as a missing one: the run
  is then judged by its exit code and log, and runs again."""
  path = os.path.join(run_dir, "summary.json")
  if not os.path.exists(path):
    return None, None
  try:
    with open(path, "rb") as f:
      summary = json.loads(f.read())
  except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    return None, f"its {path} cannot be read ({type(e).__name__}: {e})"
  if not isinstance(summary, dict):
    return None, f"its {path} holds {type(summary).__name__}, not a summary"
  return summary, None


_DIVERGED = re.compile(r"Training diverged: (.*?) produced a non-finite value.*?after (\d+) "
                       r"training samples", re.DOTALL)


def divergence_point(log: str) -> dict | None:
  """Where and when the trainer's last divergence message says a run broke: ``{"samples": n,
  "stages": [...]}`` (the stages where the first non-finite value appeared), None without one."""
  found = list(_DIVERGED.finditer(log))
  if not found:
    return None
  where, samples = found[-1].groups()
  return {"samples": int(samples), "stages": [int(s) for s in re.findall(r"stage (\d+)", where)]}


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
  return {"setup_s": round(elapsed(model), 1),
          "first_chunk_s": round(elapsed(t0) - elapsed(model), 1),
          "steady_samples_per_s": round((n1 - n0) / max((t1 - t0) % 86400, 1e-9), 1)}


def test_curve(run_dir: str) -> list[list[float]]:
  """The run's test evaluations as ``[samples, accuracy, loss]`` rows, in order of samples."""
  from pipejax.train import metrics as metrics_lib  # no JAX: plain JSONL reading
  rows = {r["samples"]: [r["samples"], r.get("accuracy"), r.get("loss")]
          for r in metrics_lib.read_records(run_dir) if r.get("split") == "test"}
  return [rows[k] for k in sorted(rows)]


def train_curve(run_dir: str, evaluations: list[int]) -> list[list[float]]:
  """The run's training loss as ``[samples, loss]`` rows, one per interval between consecutive
  ``evaluations`` (sample counts): the mean of the chunks' losses that ended in it, weighted by
  the chunks' lengths, at the interval's end. Beside the test curve it shows repeated data: past
  one epoch the training loss falls below the validation loss."""
  from pipejax.train import metrics as metrics_lib  # no JAX: plain JSONL reading
  chunks = sorted((r["samples"], r["loss"]) for r in metrics_lib.read_records(run_dir)
                  if r.get("split") == "train" and is_number(r.get("samples"))
                  and is_number(r.get("loss")) and math.isfinite(r["loss"]))
  rows, previous = [], 0
  for end in sorted(evaluations):
    total = weight = 0.0
    start = previous
    for samples, loss in chunks:
      if start < samples <= end:
        length = samples - previous
        total, weight, previous = total + loss * length, weight + length, samples
    if weight:
      rows.append([end, total / weight])
  return rows


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
  from pipejax.train import metrics as metrics_lib  # no JAX: plain JSONL reading
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


