"""A study's report from its records: tables with 95% CIs, paired gaps, verdicts, conclusions.

Conventions (the report states them too):

* a *cell* is every run with the same overrides except ``seed``: n, mean and 95% Student-t
  confidence interval over its seeds, in the table's units;
* a *gap* is paired by seed: ``metric(run) - metric(baseline's run of the same seed and cell
  coordinates)``. Runs of one seed start from the same weights (their records carry the same
  ``init_digest``) and see the same data, so the pairing removes the seed-to-seed spread. Each gap
  gets its 95% CI and the paired t-test's two-sided p-value;
* with a margin declared, each gap gets a non-inferiority verdict (one-sided t-test of
  H0: gap <= -margin, or gap >= +margin on a metric that is better smaller, such as a loss) and
  an equivalence verdict (two one-sided tests);
* a diverged run (a non-finite result, or a final test loss above its initial one) is counted
  and marked, never averaged in;
* the sentences under "Conclusions" are generated from these numbers, never written by hand;
  a study's own sections (``Study.sections``) follow the tables and figures.
"""

from __future__ import annotations

import collections
import csv
import json
import logging
import os
from typing import Sequence

from pipejax import files
from pipejax.study import statistics
from pipejax.train import workdir as workdir_lib
from pipejax.study.spec import Overrides, Section, Study, Table, run_id
from pipejax.study.cells import Cell, axis_values, gather_cells, lookup, ordered, select
from pipejax.study.figures import draw_figure
from pipejax.study.records import (DIVERGED, FAILED, FINISHED, SKIPPED, RunRecord, is_number,
                                   key_of, metric_of, read_results)


def _number(value: float, scale: float, decimals: int, signed: bool = False) -> str:
  text = f"{value * scale:{'+' if signed else ''}.{decimals}f}"
  return text.replace("-", "−")


def format_cell(cell: Cell | None, scale: float = 100.0, signed: bool = False,
                decimals: int = 2) -> str:
  """'85.12 [84.80, 85.44] n=3', a gap '+0.42 [−0.19, +1.03] n=3 p=0.12'; diverged runs and
  levels not reached are counted after it, and a cell of one seed says so."""
  if cell is None:
    return "—"
  if not cell.values:
    parts = ([f"div. {cell.diverged}/{cell.runs}"] if cell.diverged else []) + \
        ([f"not reached {cell.not_reached}/{cell.runs}"] if cell.not_reached else [])
    return ", ".join(parts) or "—"
  s = cell.stats
  text = _number(s.mean, scale, decimals, signed)
  if s.n > 1:
    text += (f" [{_number(s.low, scale, decimals, signed)}, "
             f"{_number(s.high, scale, decimals, signed)}] n={s.n}")
    if cell.paired:
      text += f" p={s.p_value:.2g}"
  else:
    text += " (1 seed)"
  if cell.diverged:
    text += f" ({cell.diverged}/{cell.runs} div.)"
  if cell.not_reached:
    text += f" ({cell.not_reached}/{cell.runs} not reached)"
  return text


def stable_limit(study: Study, records: Sequence[RunRecord], table: Table, column_value) -> tuple:
  """``(largest rows value that trains, smallest larger one that fails)`` for a column value.

  A cell trains when none of its seeds diverged and its mean metric is at least
  ``study.min_accuracy``. Either end is None where no such value was run.
  """
  records = select(records, table.where)
  cells = gather_cells(records, table.metric)
  trains, fails = [], []
  for value in ordered(study, table.rows, axis_values(records, table.rows)):
    cell = lookup(cells, {table.rows: value, table.columns: column_value})
    if cell is None or not cell.runs:
      continue
    ok = bool(cell.values) and not cell.diverged and cell.mean >= study.min_accuracy
    (trains if ok else fails).append(value)
  best = max(trains) if trains else None
  above = [v for v in fails if best is None or v > best]
  return best, (min(above) if above else None)


def gap_cells(study: Study, records: Sequence[RunRecord], table: Table) -> dict[tuple, Cell]:
  """The paired gaps of the cells ``table.where`` selects, each against its baseline run among
  *all* the records: a table of one method (``where``) still has its gaps to another's runs."""
  selected = {r.cell for r in select(records, table.where)}
  return {key: cell for key, cell in
          gather_cells(records, table.metric, study.baseline_of(table)).items() if key in selected}


def markdown_table(study: Study, records: Sequence[RunRecord], table: Table) -> str:
  everything, records = records, select(records, table.where)
  if not records:
    return "(no runs recorded yet)"
  rows = ordered(study, table.rows, axis_values(records, table.rows))
  columns = ordered(study, table.columns, axis_values(records, table.columns))
  if table.kind == "stability":
    lines = [f"| {study.label(table.columns)} | trains at | fails at | limit lies in |",
             "|---|---|---|---|"]
    for c in columns:
      best, fail = stable_limit(study, records, table, c)
      interval = ("below every value run" if best is None else
                  f"[{best:g}, {fail:g})" if fail is not None else f"≥ {best:g} (none failed)")
      lines.append(f"| {study.label(c)} | {'none' if best is None else f'{best:g}'} | "
                   f"{'none run' if fail is None else f'{fail:g}'} | {interval} |")
    return "\n".join(lines)
  if table.kind == "cells":
    return _cells_table(study, records, table, gap_cells(study, everything, table))
  if table.kind == "tuned":
    return _tuned_table(study, records, table)
  if not rows or not columns:  # runs of the selection so far, but none that sets the table's axes
    return "(no runs recorded yet)"
  cells = (gap_cells(study, everything, table) if table.kind == "gap"
           else gather_cells(records, table.metric))
  # Points whose every run was skipped: a smaller value of the swept key already failed.
  status_by_point = collections.defaultdict(set)
  for rec in records:
    point = key_of({"r": rec.overrides.get(table.rows), "c": rec.overrides.get(table.columns)})
    status_by_point[point].add(rec.status)
  header = f"| {study.label(table.rows)} | " + " | ".join(study.label(c) for c in columns) + " |"
  lines = [header, "|" + "---|" * (len(columns) + 1)]
  for r in rows:
    entries = []
    for c in columns:
      if table.kind == "gap" and is_baseline_cell(study.baseline_of(table), records,
                                                  {table.rows: r, table.columns: c}):
        entries.append("baseline")
      elif status_by_point.get(key_of({"r": r, "c": c})) == {SKIPPED}:
        entries.append("not run (failed below)")
      else:
        entries.append(format_cell(lookup(cells, {table.rows: r, table.columns: c}),
                                   table.scale, table.kind == "gap", table.decimals))
    lines.append(f"| {r} | " + " | ".join(entries) + " |")
  return "\n".join(lines)


def is_baseline_cell(baseline: Overrides, records: Sequence[RunRecord], point: dict) -> bool:
  """Whether the table cell at ``point`` ({axis: value}) holds the runs of ``baseline`` (the
  overrides that select it): its axes' values are the baseline's, and so is every baseline key
  off the axes in each of its runs."""
  in_cell = [r.overrides for r in records
             if all(r.overrides.get(k) == v for k, v in point.items())]
  return bool(in_cell) and all(all({**o, **point}.get(k) == v for k, v in baseline.items())
                               for o in in_cell)


def describe_cell(study: Study, overrides: Overrides, common: dict) -> str:
  """A grid point named by what sets it apart: its overrides not shared by every point."""
  parts = [study.label(v) if k == "method" else f"{study.label(k)} = {v}"
           for k, v in overrides.items() if k != "seed" and common.get(k, object()) != v]
  return ", ".join(parts) or "(every run)"


def _cells_table(study: Study, records: Sequence[RunRecord], table: Table,
                 gaps: dict[tuple, Cell]) -> str:
  means = gather_cells(records, table.metric)
  points = {}
  for r in sorted(records, key=lambda r: r.seed):
    if r.trained:
      points.setdefault(r.cell, {k: v for k, v in r.overrides.items() if k != "seed"})
  common = dict(set.intersection(*(set(key_of(p)) for p in points.values()))) if points else {}
  common = {k: json_value for k, json_value in ((k, json.loads(v)) for k, v in common.items())}
  baseline = study.baseline_of(table)
  lines = [f"| run | {table.metric.replace('_', ' ')} | gap to {study.baseline_label_of(table)} |",
           "|---|---|---|"]
  for key, overrides in points.items():
    is_baseline = all(overrides.get(k) == v for k, v in baseline.items()) and \
        not set(overrides) - set(baseline) - set(common)
    lines.append(f"| {describe_cell(study, overrides, common)} | "
                 f"{format_cell(means.get(key), table.scale, decimals=table.decimals)} | "
                 + ("baseline" if is_baseline else
                    format_cell(gaps.get(key), table.scale, True, table.decimals)) + " |")
  return "\n".join(lines)


def best_value(study: Study, records: Sequence[RunRecord], table: Table, column_value):
  """The ``rows`` value at which ``column_value``'s cell has the best mean (no diverged seed)."""
  cells = gather_cells(records, table.metric)
  best = None
  for value in ordered(study, table.rows, axis_values(records, table.rows)):
    cell = lookup(cells, {table.rows: value, table.columns: column_value})
    better = (lambda a, b: a > b) if table.higher_is_better else (lambda a, b: a < b)
    if cell is not None and cell.values and not cell.diverged and (
        best is None or better(cell.mean, best[1])):
      best = (value, cell.mean)
  return None if best is None else best[0]


def _tuned_table(study: Study, records: Sequence[RunRecord], table: Table) -> str:
  # A tuned table has no baseline of its own (spec._check_tables refuses one).
  baseline_column = study.baseline.get(table.columns)
  baseline_best = best_value(study, records, table, baseline_column)
  by_point = {}
  for r in records:
    if r.finished and is_number(metric_of(r, table.metric)):
      o = r.overrides
      by_point[(json.dumps(o.get(table.rows)), o.get(table.columns), r.seed)] = \
          metric_of(r, table.metric)
  lines = [f"| {study.label(table.columns)} | best {study.label(table.rows)} | "
           f"{table.metric.replace('_', ' ')} there | gap to {study.label(baseline_column)} "
           f"at its best ({baseline_best}) |", "|---|---|---|---|"]
  for c in ordered(study, table.columns, axis_values(records, table.columns)):
    best = best_value(study, records, table, c)
    if best is None:
      lines.append(f"| {study.label(c)} | none trained | — | — |")
      continue
    mine = {seed: v for (row, col, seed), v in by_point.items()
            if row == json.dumps(best) and col == c}
    theirs = {seed: v for (row, col, seed), v in by_point.items()
              if row == json.dumps(baseline_best) and col == baseline_column}
    mean = Cell(list(mine.values()), 0, list(mine))
    gap = Cell([mine[s] - theirs[s] for s in mine if s in theirs], 0, [], paired=True)
    lines.append(f"| {study.label(c)} | {best} | {format_cell(mean, table.scale)} | "
                 + ("baseline" if c == baseline_column else
                    format_cell(gap, table.scale, True)) + " |")
  lines += ["", "Each method's best value is picked on the same seeds that measure it, which "
            "favours it a little (the winner's curse); the gap at the common value is in the "
            "gap table."]
  return "\n".join(lines)


def conclusions(study: Study, records: Sequence[RunRecord], table: Table) -> list[str]:
  """One sentence per gap cell of ``table``, from its paired statistics (and margin verdicts)."""
  cells = gap_cells(study, records, table)
  records = select(records, table.where)
  baseline = study.baseline_label_of(table)
  unit = table.unit_name
  sentences = []
  for r in ordered(study, table.rows, axis_values(records, table.rows)):
    for c in ordered(study, table.columns, axis_values(records, table.columns)):
      point = {table.rows: r, table.columns: c}
      if is_baseline_cell(study.baseline_of(table), records, point):
        continue
      cell = lookup(cells, point)
      if cell is None or not cell.values:
        continue
      s = cell.stats
      where = f"{study.label(c)} at {study.label(table.rows)} = {r}"
      if s.n < 2:
        sentences.append(f"{where}: one paired seed ({_number(s.mean, table.scale, 2, True)} "
                         f"{unit}); no claim.")
        continue
      if s.excludes_zero():
        finding = f"{'above' if s.mean > 0 else 'below'} {baseline}"
      else:
        finding = f"no difference from {baseline} shown"
      text = (f"{where}: {finding} ({_number(s.mean, table.scale, 2, True)} {unit}, 95% CI "
              f"[{_number(s.low, table.scale, 2, True)}, {_number(s.high, table.scale, 2, True)}],"
              f" n = {s.n} seeds, paired t-test p = {s.p_value:.2g})")
      if study.margin is not None:
        # Non-inferiority asks whether the method is at most a margin worse: on a metric that is
        # better smaller, a positive gap is the worse one, so the test takes the gaps negated.
        tests = statistics.margin_tests(
            cell.values if table.higher_is_better else [-v for v in cell.values], study.margin)
        m = _number(study.margin, table.scale, 2)
        text += (f"; non-inferior at margin {m}: "
                 f"{'yes' if tests.non_inferior else 'not shown'} "
                 f"(p = {tests.non_inferiority_p:.2g})"
                 f"; equivalent within ±{m}: {'yes' if tests.equivalent else 'not shown'} "
                 f"(TOST p = {tests.equivalence_p:.2g})")
      if cell.diverged:
        text += f"; {cell.diverged} of {cell.runs} runs diverged and are not in the gap"
      sentences.append(text + ".")
  return sentences


def _margin_sentence(study: Study) -> str:
  """The report's statement of the verdicts' margin, in the units its gap tables show."""
  if not study.margin:
    return ""
  # The gap tables' units, or where a study has none yet, its other tables'.
  gap_tables = [t for t in study.tables if t.kind == "gap"] or list(study.tables)
  if not gap_tables or all(t.scale == 100 for t in gap_tables):
    return f" Verdicts use a margin of {study.margin * 100:g} points."
  table = next(t for t in gap_tables if t.scale != 100)
  better = "" if table.higher_is_better else " (the metric is better smaller: a method is " \
      "non-inferior when its gap is credibly below the margin)"
  units = (f"{table.unit}" if table.unit else
           f"the units of the table '{table.title}'")
  return f" Verdicts use a margin of {study.margin * table.scale:.3g} {units}{better}."


def write_csv(records: Sequence[RunRecord], path: str) -> None:
  keys = sorted({k for r in records for k in r.overrides})
  fields = ["run", *keys, "status", "test_accuracy", "test_loss", "initial_test_loss",
            "num_stages", "samples", "train_seconds", "wall_seconds", "init_digest"]
  with files.replacing(path) as tmp:
    with open(tmp, "w", newline="") as f:
      writer = csv.writer(f)
      writer.writerow(fields)
      for r in records:
        writer.writerow([r.run, *(r.overrides.get(k, "") for k in keys), r.status,
                         *(r.get(k, "") for k in fields[len(keys) + 2:])])


REPORT_LOCK = ".report.lock"


def write_report(study: Study, workdir: str, command: str = "") -> str:
  """Writes results.csv, report.md and the figures into ``workdir``; returns the markdown.

  Each file is replaced atomically, and one writer at a time writes the set (it waits for
  ``WORKDIR/.report.lock``): a study and ``--report_only`` beside it never collide, and the
  files of one report always come from the same records.
  """
  lock = workdir_lib.FileLock(os.path.join(workdir, REPORT_LOCK))
  try:
    lock.wait()
    return _write_report(study, workdir, command)
  finally:
    lock.close()


def _write_report(study: Study, workdir: str, command: str) -> str:
  records, off_grid = grid_records(study, read_results(workdir))
  records, superseded = paired_records(records)
  write_csv(records, os.path.join(workdir, "results.csv"))
  planned = len(study.runs())
  counts = {s: sum(r.status == s for r in records) for s in (FINISHED, DIVERGED, FAILED)}
  wall = sum(r.wall_seconds for r in records)
  parts = [f"# Study '{study.name}'", ""]
  if command:
    parts += ["Regenerate (skips finished runs, resumes stopped ones):", "", "```bash", command,
              "```", ""]
  parts.append(
      f"{len(records)} of {planned} runs recorded: {counts[FINISHED]} finished, "
      f"{counts[DIVERGED]} diverged, {counts[FAILED]} failed; {wall / 3600:.2f} h of run time "
      "(sum over runs). A cell is the mean over seeds with its 95% Student-t confidence interval "
      "[low, high] and n; a gap is paired by seed (same starting weights and data order) with "
      "its 95% CI and the paired t-test's p-value. A run diverged when its result is not finite "
      "or its final test loss is above its initial one; diverged runs are counted, never "
      "averaged." + _margin_sentence(study))
  parts += _pairing_check(records)
  if off_grid:
    parts += ["", f"{off_grid} records of results.jsonl are not grid points of the study file (a "
              "grid that shrank, or another study's runs) and are set aside: counted and shown "
              "nowhere in this report (they stay in results.jsonl)."]
  if superseded:
    parts += ["", f"{superseded} runs recorded before every method of a seed started from the "
              "same weights are left out of the tables (they stay in results.jsonl); the study "
              "runs them again."]
  machines = collections.Counter(r.machine or "not recorded" for r in records
                                 if r.status != SKIPPED)
  if machines:
    parts += ["", "Machines (runs): " + "; ".join(f"{m} ({n})" for m, n in machines.items()) + "."]
  for table in study.tables:
    parts += ["", f"## {table.title}", "", markdown_table(study, records, table)]
    if table.kind == "gap":
      sentences = conclusions(study, records, table)
      if sentences:
        parts += ["", "Conclusions (generated from the table's statistics):", ""]
        parts += [f"- {s}" for s in sentences]
  figures = [f for f in study.figures
             if draw_figure(study, records, f, os.path.join(workdir, f.file))]
  for figure in figures:
    parts += ["", f"![{figure.title or figure.file}]({figure.file})"]
  for section in study.sections:
    parts += ["", f"## {section.title}", "", section_body(section, records, workdir)]
  text = "\n".join(parts) + "\n"
  files.write(os.path.join(workdir, "report.md"), text)
  return text


def section_body(section: Section, records: Sequence[RunRecord], workdir: str) -> str:
  """A section's markdown: its text, or what its function returns given the report's records and
  the workdir. A function that raises, or returns no text, gives a one-paragraph note that says
  why, and a warning: one broken section must not cost the report its tables and figures."""
  if isinstance(section.body, str):
    return section.body
  try:
    text = section.body(records, workdir)
    if not isinstance(text, str):
      raise TypeError(f"it returned {type(text).__name__}, not markdown text")
  except Exception as e:  # noqa: BLE001 - whatever the study's function raises, said in the report
    reason = " ".join(f"{type(e).__name__}: {e}".split()).rstrip(".")
    logging.warning("Section %r of the report could not be generated: %s", section.title, reason)
    return f"This section could not be generated: {reason}."
  return text


def grid_records(study: Study, records: Sequence[RunRecord]) -> tuple[list[RunRecord], int]:
  """The records that are grid points of ``study``, and how many are not: the report counts and
  tabulates the study's own runs only, never a foreign run's row and gap."""
  grid = {run_id(o) for o in study.runs()}
  kept = [r for r in records if r.run in grid]
  return kept, len(records) - len(kept)


def paired_records(records: Sequence[RunRecord]) -> tuple[list[RunRecord], int]:
  """The records a report shows, and how many it leaves out: once a study has runs that record
  their starting weights (``init_digest``), its runs made before that are left out, since they
  cannot be paired with them."""
  if not any(r.init_digest for r in records):
    return list(records), 0
  kept = [r for r in records if r.init_digest or r.status in (SKIPPED, FAILED)]
  return kept, len(records) - len(kept)


def _pairing_check(records: Sequence[RunRecord]) -> list[str]:
  """A line on whether the runs of each seed and network started alike, whatever the method."""
  digests = collections.defaultdict(set)
  for r in records:
    if r.init_digest:
      point = {k: v for k, v in r.overrides.items()
               if k == "seed" or k.startswith(("model", "dataset", "image_size"))}
      digests[key_of(point)].add(r.init_digest)
  if not digests:
    return ["", "Starting weights: not recorded (runs made before records carried "
            "`init_digest`), so the pairing by seed pairs the data order only."]
  mixed = sum(len(d) > 1 for d in digests.values())
  return ["", f"Starting weights: {len(digests)} groups of runs of one seed and network; "
          + ("every group started from one set of weights (same `init_digest`)." if not mixed
             else f"{mixed} of them hold more than one `init_digest`: their pairs do not share "
             "starting weights.")]
