"""A study's records: one line of ``results.jsonl`` per run, written whole, read defensively.

A record is what a trainer process left: its status (finished, diverged, failed, skipped), its
results and the facts a reader needs to trust them (the starting weights' digest, the test curve,
the machine). Appends are one write of a whole line with fsync; a line cut short by a kill or a
full disk is set aside, and a line that is not a record is skipped and named.

A line is parsed once, here, into a :class:`RunRecord`; every reader of a study (its report, its
cells, the analyses and the study files' own sections) takes those, never the line's dict.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
from typing import Any, Iterable, Mapping

from pipejax import config as config_lib
from pipejax import files
from pipejax.study import run_logs
from pipejax.study.run_logs import (divergence_point, is_number, log_timing, logged_init_digest,
                                     read_summary, test_curve, train_curve)
from pipejax.study.spec import Overrides, Study, key_of, run_id

FINISHED, DIVERGED, FAILED = "finished", "diverged", "failed"
# Not run: the same point failed at a smaller value of Study.skip_beyond_failure.
SKIPPED = "skipped"
RESULTS_FILE = "results.jsonl"


# The repository's root, which a study's config file is named relative to.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


@dataclasses.dataclass(frozen=True)
class PlanFacts:
  """What a reader of a study takes from a run's plan (:class:`pipejax.train.plan.RunPlan`).

  Attributes:
    optimizer: the base update's optimizer (``'sgd'``, ``'adam'``).
    update_form: the base update as the quadratic reads it (:class:`pipejax.optim.Recipe`'s
      ``form``): ``'heavy_ball'`` (momentum SGD) or ``'ema'`` (Adam).
    micro_batches_per_update: the micro-batches whose mean gradient one update applies.
  """

  optimizer: str
  update_form: str
  micro_batches_per_update: int

  @classmethod
  def of(cls, plan: Mapping[str, Any]) -> PlanFacts:
    """The facts of a plan as ``summary.json`` records it (``RunPlan.to_json``)."""
    return cls(plan["optimizer"], plan["recipe"]["form"], int(plan["micro_batches_per_update"]))


class RecordError(ValueError):
  """A value that is not a run record; the message says why."""


@dataclasses.dataclass(frozen=True)
class RunRecord:
  """One run of a study as ``results.jsonl`` records it.

  ``overrides`` are the run's grid point (its cell and seed); ``fixed`` and ``config`` the recipe
  every run of the study shares. The fields from ``test_accuracy`` to ``momentum`` are what the
  trainer's summary said, None where the run stopped before it; the curves and diagnostics
  follow. A field of the line that none of these names is kept in ``extra`` and written back.
  """

  run: str
  overrides: Mapping[str, Any]
  status: str
  fixed: Mapping[str, Any] | None = None
  config: str | None = None
  wall_seconds: float = 0.0
  test_accuracy: float | None = None
  test_loss: float | None = None
  initial_test_loss: float | None = None
  init_digest: str | None = None
  train_seconds: float | None = None
  num_stages: int | None = None
  samples: int | None = None
  learning_rate: float | None = None
  momentum: float | None = None
  train_loss: float | None = None  # the last evaluation interval's (``train_curve``)
  test_curve: list | None = None  # [samples, accuracy, loss] rows
  train_curve: list | None = None  # [samples, loss] rows
  weight_discrepancy: list | None = None  # per stage
  timing: dict | None = None  # :func:`log_timing`
  machine: str | None = None
  divergence: dict | None = None  # :func:`divergence_point`
  plan: Mapping[str, Any] | None = None  # the trainer's resolved plan (``summary.json``)
  reason: str | None = None  # why a run was skipped
  error: str | None = None  # a failed run's log tail
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def settings(self) -> dict:
    """Every setting the study gave the run: its ``fixed`` values and its overrides."""
    return {**(self.fixed or {}), **self.overrides}

  @property
  def method(self) -> str | None:
    return self.settings.get("method")

  @property
  def seed(self) -> int:
    return self.overrides.get("seed", 0)

  @property
  def cell(self) -> tuple:
    """The identity of the run's cell: its overrides but the seed."""
    return key_of({k: v for k, v in self.overrides.items() if k != "seed"})

  @property
  def finished(self) -> bool:
    """Finished, and its numbers do not say it diverged."""
    return self.status == FINISHED and not diverged(self)

  @property
  def trained(self) -> bool:
    """Finished or diverged: a run that says something of its method (not failed or skipped)."""
    return self.status in (FINISHED, DIVERGED)

  @property
  def plan_facts(self) -> PlanFacts | None:
    """What the run's plan says of its update: from the plan it recorded, or for a record that
    holds none (made before records did, or of a run that stopped before its summary) from the
    plan its config file and settings resolve to (:func:`pipejax.train.plan.resolve_file`);
    None when neither can be had."""
    if self.plan is not None:
      return PlanFacts.of(self.plan)
    if not self.config:
      return None
    # Per cell: the seed changes no fact of the update.
    settings = {k: v for k, v in _trainer_settings(self.fixed, self.overrides).items()
                if k != "seed"}
    return _resolved_facts(self.config, key_of(settings))

  def get(self, name: str, default: Any = None) -> Any:
    """A field by name (a table's metric), else ``default``."""
    if name in _FIELDS and name != "extra":
      value = getattr(self, name)
      return default if value is None else value
    return self.extra.get(name, default)

  def to_json(self) -> dict:
    """The line's object: every field that is set, and ``extra``."""
    line = {f: getattr(self, f) for f in _FIELDS if f != "extra" and getattr(self, f) is not None}
    return {**line, **self.extra}


_FIELDS = tuple(f.name for f in dataclasses.fields(RunRecord))


def _trainer_settings(fixed: Mapping[str, Any] | None, overrides: Mapping[str, Any]) -> dict:
  """The settings a run's trainer was given: a fixed key of another method's section is left
  out, as :func:`pipejax.study.spec.trainer_flags` leaves it out of the trainer's flags."""
  method = {**(fixed or {}), **overrides}.get("method")
  unread = lambda key: (method is not None and key.startswith("method_kwargs.")
                        and key.split(".")[1] != method)
  return {**{k: v for k, v in (fixed or {}).items() if not unread(k)}, **overrides}


@functools.lru_cache(maxsize=None)
def _resolved_facts(config: str, settings: tuple) -> PlanFacts | None:
  """The facts of the plan that config file ``config`` (relative to the repository's root, as a
  study names it) with ``settings`` (a :func:`key_of`) resolves to; None where it resolves to
  none."""
  # The trainer's modules, JAX among them, only here: a process that reads records, or only
  # starts trainers, never loads them.
  from pipejax.train import plan as plan_lib  # pylint: disable=import-outside-toplevel
  try:
    plan = plan_lib.resolve_file(os.path.join(_ROOT, config),
                                 {k: json.loads(v) for k, v in settings})
  except (config_lib.ConfigFileError, ValueError):
    return None
  return PlanFacts.of(plan.to_json())


def parse_record(value: Any) -> RunRecord:
  """The record of a parsed line of results.jsonl (or of a dict of the same fields).

  Its overrides and ``fixed`` are in today's config keys, and its run id is that of its overrides:
  a record written before run ids were the same whatever the order of a grid's keys names its run
  in that order, or by a field since renamed, and is the same run.

  Raises:
    RecordError: ``value`` is not a record (:func:`record_problem` says why).
  """
  problem = record_problem(value)
  if problem is not None:
    raise RecordError(problem)
  overrides = config_lib.current_keys(value["overrides"])
  known = {k: v for k, v in value.items() if k in _FIELDS and k != "extra"}
  if "fixed" in value:
    known["fixed"] = config_lib.current_keys(value["fixed"])
  return RunRecord(**{**known, "overrides": overrides, "run": run_id(overrides),
                      "extra": {k: v for k, v in value.items() if k not in _FIELDS}})


def load_results(workdir: str) -> tuple[list[RunRecord], list[str]]:
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
      record = parse_record(json.loads(raw))
    except (json.JSONDecodeError, UnicodeDecodeError):
      problem = "it is not JSON"
    except RecordError as e:
      problem = str(e)
    else:
      previous = by_run.get(record.run)
      if not (record.status == FAILED and previous is not None and previous.status in _DONE):
        by_run[record.run] = record
      continue
    cut = "; cut short by a kill or a full disk" if last else ""
    problems.append(f"{path} line {number} is skipped: {problem}{cut} "
                    f"({raw[:80].decode(errors='replace')!r}).")
  return list(by_run.values()), problems


def read_results(workdir: str) -> list[RunRecord]:
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


def append_result(workdir: str, record: RunRecord) -> str | None:
  """Appends ``record`` as one line of results.jsonl; returns the message of
  :func:`set_aside_partial_line` when a cut line had to be set aside first."""
  message = set_aside_partial_line(workdir)
  files.append(os.path.join(workdir, RESULTS_FILE), json.dumps(record.to_json()) + "\n")
  return message


def is_done(record: RunRecord | None, study: Study, overrides: Overrides) -> bool:
  """A run is done when it finished, diverged or was skipped with the same settings; failures
  are retried, and so is a run recorded without ``init_digest``: it was made before every method
  of a seed started from the same weights, so it cannot be paired with the runs made since."""
  return record is not None and record.status in _DONE and \
      record.fixed == _jsonable(study.fixed) and record.config == study.config \
      and (record.status == SKIPPED or bool(record.init_digest))


def recipe_change(study: Study, records: Iterable[RunRecord], workdir: str) -> str | None:
  """The refusal when done records were made with other ``fixed`` values or config; else None.

  Every trainer would refuse to resume its run with another recipe, and a rerun from scratch
  would mix two recipes in one report: the study stops before, saying what differs.
  """
  fixed, seen = _jsonable(study.fixed), collections.Counter()
  for r in records:
    if r.status not in _DONE:
      continue
    old_fixed = r.fixed or {}
    diff = [f"config: {r.config} -> {study.config}"] if r.config != study.config else []
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


def failed_below(study: Study, records: Iterable[RunRecord], overrides: Overrides) -> Any:
  """The smaller ``study.skip_beyond_failure`` value at which this point failed, else None."""
  key = study.skip_beyond_failure
  if key is None or key not in overrides:
    return None
  others = key_of({k: v for k, v in overrides.items() if k != key})
  for r in records:
    value = r.overrides.get(key)
    if (r.status in (DIVERGED, SKIPPED, FINISHED) and value is not None
        and value < overrides[key]
        and key_of({k: v for k, v in r.overrides.items() if k != key}) == others
        and (r.status != FINISHED or not is_number(r.test_accuracy)
             or r.test_accuracy < study.min_accuracy)):
      return value
  return None


def skipped_record(study: Study, overrides: Overrides, failed_at: Any) -> RunRecord:
  return RunRecord(run_id(overrides), _jsonable(overrides), SKIPPED, _jsonable(study.fixed),
                   study.config, reason=f"failed at {study.skip_beyond_failure}={failed_at}")


# What a record takes from the trainer's summary.json.
SUMMARY_FIELDS = ("test_accuracy", "test_loss", "initial_test_loss", "init_digest",
                  "train_seconds", "num_stages", "samples", "learning_rate", "momentum", "plan")


def record_from_run(study: Study, overrides: Overrides, run_dir: str, returncode: int,
                    wall_seconds: float, log_tail: str) -> RunRecord:
  """The results record of a trainer process that ended with ``returncode``."""
  record = {"run": run_id(overrides), "overrides": _jsonable(overrides),
            "fixed": _jsonable(study.fixed), "config": study.config,
            "wall_seconds": round(wall_seconds, 1)}
  summary, summary_problem = read_summary(run_dir)
  if returncode == 0 and summary and not summary.get("stopped_by"):
    for key in SUMMARY_FIELDS:
      record[key] = summary.get(key)
    numbers = RunRecord(**record, status=FINISHED)
    record["status"] = DIVERGED if diverged(numbers) else FINISHED
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
  staleness = run_logs.mean_staleness(run_dir)
  if staleness is not None:
    record["weight_discrepancy"] = staleness
  timing = log_timing(os.path.join(run_dir, "log.txt"))
  if timing:
    record["timing"] = timing
  return RunRecord(**record)


def samples_to_reach(record: RunRecord, accuracy: float) -> int | None:
  """The training samples after which the run's test accuracy first reached ``accuracy``."""
  for samples, value, _ in record.test_curve or ():
    if is_number(value) and value >= accuracy:
      return samples
  return None


def metric_of(record: RunRecord, metric: str) -> Any:
  """A record's value of a table's metric (a field, or ``samples_to:A``)."""
  if metric.startswith("samples_to:"):
    return samples_to_reach(record, float(metric.split(":", 1)[1]))
  return record.get(metric)


def diverged(record: RunRecord) -> bool:
  """A run diverged when it is so recorded (its trainer stopped on a non-finite value), when its
  final accuracy or loss is not a number, or when its final test loss is above the loss at its
  initial weights: it ended worse than where it started, however finite its numbers. Failed and
  skipped runs did not diverge: they say nothing of their method."""
  if record.status == DIVERGED:
    return True
  if record.status != FINISHED:
    return False
  final, initial = record.test_loss, record.initial_test_loss
  return (not is_number(record.test_accuracy)
          or (final is not None and not is_number(final))
          or (is_number(final) and is_number(initial) and final > initial))


def _jsonable(value):
  return json.loads(json.dumps(value, default=str))


