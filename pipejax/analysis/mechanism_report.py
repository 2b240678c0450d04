"""The mechanism grid in one report: does the weight mismatch order the methods as their loss does?

``scripts/mechanism.py`` writes one ``mechanism.jsonl`` per run (a method at one β1): per measured
tick and stage, the mismatch ``|w_fwd - w_bwd| / |w_bwd|`` and the cosine between the delayed and
the current gradient (``pipejax.analysis.mechanism``). This module reads every run under a
directory and gives:

* per run, the mismatch and cosine averaged over the measured ticks of each stage, then over the
  stages (:func:`run_summaries`);
* per β1, the methods ordered by that mismatch beside their final loss from study records of the
  same network, depth and rate (:func:`losses`), with Kendall's tau between the two orders and its
  two-sided p-value (:func:`orderings`): does the mismatch ordering predict the loss ordering;
* a figure, each stage's mean mismatch and cosine against its delay, one line per method and one
  column of panels per β1 (:func:`plot`).

With four methods a β1, tau is a statement about n = 4 (p can be no smaller than 0.083 for a
perfect agreement); the report says n with every tau.

Inputs are read defensively: a run's ``mechanism.jsonl`` is written whole, so a line of it that
is not a record, or a file that is not text, is refused naming the run to measure again; a run
whose file holds no record is left out and named in the report; a study record that cannot be
read is skipped and named (a study's log may end in a line cut short), and a file of study
records that is not text is refused. Nothing here ends in a traceback.
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Iterable, NamedTuple, Sequence

import numpy as np
from scipy import stats

from pipejax import files, plotting

BITS_PER_NAT = 1 / math.log(2)


class MechanismReportError(ValueError):
  """A directory without mechanism records, or records that cannot be summarised."""


# The fields of a mechanism record this report reads, and the types each must have.
_NUMBER = (int, float)
_RECORD_FIELDS = {"stage": int, "delay": _NUMBER, "mismatch": _NUMBER, "cosine": _NUMBER,
                  "method": str, "momentum": _NUMBER, "num_stages": int, "lr": _NUMBER}


def _field_problem(value, fields: dict) -> str | None:
  """Why a parsed line is not a record with ``fields`` (name: type), or None."""
  if not isinstance(value, dict):
    return f"it is {type(value).__name__}, not an object"
  for name, kind in fields.items():
    if isinstance(value.get(name), bool) or not isinstance(value.get(name), kind):
      return f"its {name!r} is {value.get(name)!r}"
  return None


def _text_lines(path: str) -> list[str]:
  """The lines of ``path``; a file that cannot be read or is not UTF-8 text is refused."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise MechanismReportError(f"{path} cannot be read ({e.strerror or e}).") from None
  nul = data.find(b"\0")
  try:
    if nul >= 0:
      raise UnicodeError(f"a NUL byte at byte {nul}")
    return data.decode("utf-8").split("\n")
  except UnicodeError as e:
    raise MechanismReportError(f"{path} is not text ({e}): it holds no JSON lines.") from None


class Runs(NamedTuple):
  """The records of every run under a directory, and a sentence for each run left out."""

  records: list[dict]
  notes: list[str]


def load_runs(directory: str) -> Runs:
  """Every record of every ``*/mechanism.jsonl`` under ``directory``, and a note for each run
  whose file holds none. A line that is not a record, or a file that is not text, is refused
  naming the run to measure again (scripts/mechanism.py writes each file whole, so either is a
  damaged file, never a run still being written)."""
  paths = sorted(glob.glob(os.path.join(directory, "*", "mechanism.jsonl")))
  if not paths:
    raise MechanismReportError(
        f"No */mechanism.jsonl under {directory}: run scripts/mechanism.py with "
        f"--output_dir={directory}/NAME for each method and β1 first.")
  records, notes = [], []
  for path in paths:
    run_dir = os.path.dirname(path)
    again = (f"measure the run again (scripts/mechanism.py --output_dir={run_dir}) or move "
             f"{run_dir} out of {directory}")
    try:
      lines = _text_lines(path)
    except MechanismReportError as e:
      raise MechanismReportError(f"{e} It is damaged: {again}.") from None
    found = []
    for number, line in enumerate(lines, 1):
      if not line.strip():
        continue
      try:
        problem = _field_problem(record := json.loads(line), _RECORD_FIELDS)
      except json.JSONDecodeError:
        problem = "it is not JSON"
      if problem is not None:
        raise MechanismReportError(f"{path} line {number} is not a mechanism record: {problem} "
                                   f"({line[:80]!r}). The file is damaged: {again}.")
      found.append(record)
    if not found:
      notes.append(f"{run_dir} is left out of the table and the rank correlations: its "
                   f"mechanism.jsonl holds no record; {again}.")
    records.extend(found)
  if not records:
    raise MechanismReportError(f"Every */mechanism.jsonl under {directory} is empty: "
                               "run scripts/mechanism.py again for the runs.")
  return Runs(records, notes)


def load(directory: str) -> list[dict]:
  """Every record of every ``*/mechanism.jsonl`` under ``directory`` (see :func:`load_runs`)."""
  return load_runs(directory).records


def _stage_means(rows: Iterable[dict], key: str) -> dict[int, float]:
  by_stage: dict[int, list[float]] = {}
  for r in rows:
    by_stage.setdefault(r["stage"], []).append(r[key])
  return {s: float(np.nanmean(v)) for s, v in sorted(by_stage.items())}


def run_summaries(records: Sequence[dict]) -> list[dict]:
  """One row per (method, β1): its stages' mean mismatch and cosine, averaged over the stages.

  ``mismatch`` averages the stages that have one (the last stage's is 0 by construction and
  counts); ``cosine_min`` is the lowest stage mean, and ``worst_stage`` that stage.
  ``first_mismatch`` is the first stage's own (the longest delay; the LM's embedding) and
  ``rest_mismatch`` the mean of the others, since the first stage alone can set the mean.
  """
  runs: dict[tuple[str, float], list[dict]] = {}
  for r in records:
    runs.setdefault((r["method"], float(r["momentum"])), []).append(r)
  rows = []
  for (method, momentum), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    mismatch, cosine = _stage_means(rs, "mismatch"), _stage_means(rs, "cosine")
    worst = min(cosine, key=cosine.get)
    first, *rest = mismatch.values()  # _stage_means orders the stages
    rows.append({"method": method, "momentum": momentum, "stages": len(mismatch),
                 "lr": rs[0].get("lr"), "num_stages": rs[0].get("num_stages"),
                 "mismatch": float(np.mean(list(mismatch.values()))),
                 "first_mismatch": first,
                 "rest_mismatch": float(np.mean(rest)) if rest else math.nan,
                 "cosine": float(np.mean(list(cosine.values()))),
                 "cosine_min": cosine[worst], "worst_stage": worst})
  return rows


class Losses(NamedTuple):
  """A method's final validation losses at one β1, in bits per byte, and the records they are
  from."""

  bits: list[float]
  source: str


# What this report reads of a finished study record of the depth and rate it looks for.
_LOSS_FIELDS = {"momentum": _NUMBER, "test_loss": _NUMBER}


def _study_record(line: str) -> tuple[dict | None, str | None]:
  """A line of study records parsed, or None and why it is not a record."""
  try:
    r = json.loads(line)
  except json.JSONDecodeError:
    return None, "it is not JSON"
  if not isinstance(r, dict):
    return None, f"it is {type(r).__name__}, not an object"
  if not all(isinstance(r.get(key, {}), dict) for key in ("fixed", "overrides")):
    return None, "its 'fixed' or 'overrides' is not an object"
  return r, None


def losses(result_paths: Sequence[str], num_stages: int, lr: float,
           notes: list[str] | None = None) -> dict[tuple, Losses]:
  """Final validation loss in bits per byte of each (method, β1), one entry per finished run of
  ``num_stages`` stages at rate ``lr``, all from one of the study records ``result_paths``: the
  first that has the (method, β1). Studies trained on different data or from different weights
  are not averaged together. A line that is not such a record is skipped, with a sentence in
  ``notes`` when given; a file that is not text is refused."""
  found: dict[tuple, Losses] = {}
  for path in result_paths:
    here: dict[tuple, Losses] = {}
    try:
      lines = _text_lines(path)
    except MechanismReportError as e:
      raise MechanismReportError(f"{e} Give study records (a study's results.jsonl) with "
                                 "--results.") from None
    for number, line in enumerate(lines, 1):
      if not line.strip():
        continue
      r, problem = _study_record(line)
      if r is not None:
        # A study record names its method among its grid's overrides or its fixed settings.
        method = {**r.get("fixed", {}), **r.get("overrides", {})}.get("method")
        rate = r.get("learning_rate")
        if (method is None or r.get("status") != "finished" or r.get("num_stages") != num_stages
            or not isinstance(rate, _NUMBER) or not math.isclose(rate, lr)):
          continue
        problem = _field_problem(r, _LOSS_FIELDS)
      if problem is not None:
        if notes is not None:
          notes.append(f"{path} line {number} is skipped: {problem} ({line[:80]!r}).")
        continue
      here.setdefault((method, float(r["momentum"])), Losses([], path)).bits.append(
          r["test_loss"] * BITS_PER_NAT)
    for key, value in here.items():
      found.setdefault(key, value)
  return found


def orderings(summaries: Sequence[dict], run_losses: dict[tuple, Losses]) -> list[dict]:
  """Per β1, the methods with both a mismatch and a loss, ordered by mismatch, and Kendall's tau
  between mismatch and mean loss (None with fewer than 3 methods)."""
  out = []
  for momentum in sorted({row["momentum"] for row in summaries}):
    methods = [dict(row, loss=float(np.mean(found.bits)), seeds=len(found.bits),
                    source=found.source)
               for row in summaries if row["momentum"] == momentum
               and (found := run_losses.get((row["method"], momentum))) is not None]
    methods.sort(key=lambda row: row["mismatch"])
    tau = p = None
    if len(methods) >= 3:
      result = stats.kendalltau([m["mismatch"] for m in methods], [m["loss"] for m in methods])
      tau, p = float(result.statistic), float(result.pvalue)
    out.append({"momentum": momentum, "methods": methods, "tau": tau, "p": p})
  return out


def plot(records: Sequence[dict], path: str) -> None:
  """Each stage's mean mismatch (top) and cosine (bottom) against its delay, a line per method and
  a column per β1."""
  momenta = sorted({float(r["momentum"]) for r in records})
  plt = plotting.pyplot()
  fig, axes = plt.subplots(2, len(momenta), figsize=(4.5 * len(momenta), 6.5), squeeze=False)
  for column, momentum in enumerate(momenta):
    top, bottom = axes[0][column], axes[1][column]
    for method in sorted({r["method"] for r in records if r["momentum"] == momentum}):
      rows = [r for r in records if r["method"] == method and r["momentum"] == momentum]
      delay = {r["stage"]: r["delay"] for r in rows}
      mismatch, cosine = _stage_means(rows, "mismatch"), _stage_means(rows, "cosine")
      top.plot([delay[s] for s in mismatch], list(mismatch.values()), marker="o", ms=2,
               label=method)
      bottom.plot([delay[s] for s in cosine], list(cosine.values()), marker="o", ms=2,
                  label=method)
    top.set_title(f"β1 = {momentum:g}")
    top.set_yscale("log")
    bottom.axhline(1.0, color="0.6", lw=0.8, ls=":")
    bottom.set_xlabel("stage delay D_s")
    top.legend(fontsize=7)
  axes[0][0].set_ylabel("mean ‖w_fwd − w_bwd‖ / ‖w_bwd‖")
  axes[1][0].set_ylabel("mean cos(delayed, current gradient)")
  plotting.save(fig, path)


def _study_name(path: str) -> str:
  """A study's name from its records' path: the workdir's name."""
  return os.path.basename(os.path.dirname(os.path.abspath(path)))


def _number(value, digits: int = 3) -> str:
  return "—" if value is None else f"{value:.{digits}g}"


def report(directory: str, result_paths: Sequence[str]) -> str:
  """The markdown report of the runs under ``directory`` (and ``mechanism.png`` written there)."""
  records, notes = load_runs(directory)
  summaries = run_summaries(records)
  run_losses = losses(result_paths, summaries[0]["num_stages"], summaries[0]["lr"], notes)
  lines = [
      "# The delay's mechanism per stage", "",
      f"Generated by `python scripts/mechanism_report.py --dir={directory} "
      f"--results={','.join(result_paths)}` from each run's `mechanism.jsonl` "
      "(`scripts/mechanism.py`); do not edit by hand.", "",
      f"{len(summaries)} runs, {summaries[0]['num_stages']} stages, rate {summaries[0]['lr']:g}. "
      "Mismatch: ‖w_fwd − w_bwd‖ / ‖w_bwd‖; cosine: between the delayed gradient a stage "
      "applies and the gradient at the current weights on the same sample. Each is averaged "
      "over a stage's measured ticks, then over the stages.", "",
      "The first stage, whose delay is the longest (the language model's embedding), is also "
      "shown alone, beside the mean of the others.", "",
      "| method | β1 | mismatch | first stage's | other stages' | cosine | lowest stage cosine "
      "(stage) |", "|---|---|---|---|---|---|---|"]
  for row in summaries:
    lines.append(f"| {row['method']} | {row['momentum']:g} | {_number(row['mismatch'])} | "
                 f"{_number(row['first_mismatch'])} | {_number(row['rest_mismatch'])} | "
                 f"{_number(row['cosine'])} | {_number(row['cosine_min'])} "
                 f"({row['worst_stage']}) |")
  lines += ["", "## Does the mismatch ordering predict the loss ordering?", "",
            "Final validation loss (bits per byte, mean over the finished runs of the same "
            "depth and rate), each method's from the first of "
            + ", ".join(f"`{p}`" for p in result_paths) + " that has it at that β1 (a study's "
            "runs are not averaged with another's, trained on other data or from other weights); "
            "the methods ordered by mismatch; Kendall's tau between the two orders, two-sided p.",
            ""]
  for block in orderings(summaries, run_losses):
    names = ", ".join(f"{m['method']} ({_number(m['mismatch'])}; {m['loss']:.2f} bits, "
                      f"n = {m['seeds']}, {_study_name(m['source'])})"
                      for m in block["methods"]) or "no method with a loss"
    verdict = ("fewer than 3 methods with a loss: no test" if block["tau"] is None else
               f"tau = {block['tau']:.2f}, p = {block['p']:.2g}, n = {len(block['methods'])}")
    lines.append(f"- β1 = {block['momentum']:g}: {names}. {verdict}.")
  lines += ["", "![mismatch and cosine by stage](mechanism.png)", ""]
  if notes:
    lines += ["## Left out", "", *(f"- {note}" for note in notes), ""]
  text = "\n".join(lines)
  try:
    plot(records, os.path.join(directory, "mechanism.png"))
    files.write(os.path.join(directory, "report.md"), text)
  except OSError as e:
    raise MechanismReportError(f"The report cannot be written to {directory} "
                               f"({e.strerror or e}); give a --dir that can be written.") from None
  return text
