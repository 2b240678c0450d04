"""What a trainer's workdir says of its run, read without JAX: its summary, the divergence and
initial-weights lines of its log, where its wall time went, and its test and training curves.
:mod:`pipejax.study.records` makes a run's record from these.
"""

from __future__ import annotations

import json
import math
import os
import re

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


def mean_staleness(run_dir: str) -> list[float] | None:
  """Per stage, the mean of the logged ``weight_discrepancy`` over the second half of training."""
  from pipejax.train import metrics as metrics_lib  # no JAX: plain JSONL reading
  rows = [r for r in metrics_lib.read_records(run_dir)
          if r.get("split") == "diagnostics" and "weight_discrepancy" in r]
  if not rows:
    return None
  rows = rows[len(rows) // 2:]
  per_stage = list(zip(*(r["weight_discrepancy"] for r in rows)))
  return [sum(v) / len(v) for v in per_stage]


def is_number(value) -> bool:
  return isinstance(value, (int, float)) and math.isfinite(value)
