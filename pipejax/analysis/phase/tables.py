"""The phase report: its tables of baselines and gaps, and the markdown around them."""

from __future__ import annotations

import math
from typing import Sequence

from pipejax import methods as methods_lib
from pipejax.analysis import safe_range
from pipejax.analysis.phase.gaps import Baseline, Row, _network_text
from pipejax.analysis.phase.prediction import form_of
from pipejax.analysis.phase.runs import network_of, settings_text
from pipejax.analysis.phase.studies import Unit


def _signed(value: float, decimals: int = 2) -> str:
  return f"{value:+.{decimals}f}".replace("-", "−")


def gap_text(row: Row) -> str:
  """'+1.16 [+1.06, +1.27]', '+0.40 (1 seed)', 'div. 3/3'; diverged runs are counted after it."""

  parts = []
  if row.gaps:
    s = row.interval
    parts.append(f"{_signed(s.mean)} [{_signed(s.low)}, {_signed(s.high)}]" if s.n > 1
                 else f"{_signed(s.mean)} (1 seed)")
  if row.diverged:
    parts.append(f"div. {row.diverged}/{row.runs}")
  return "; ".join(parts) or "— (no baseline)"


def prediction_text(row: Row) -> str:
  """'+0.31 (ηλ 3.8e-04: …)', 'unstable (…)', '— (no quadratic form)'."""
  value = row.prediction
  if value is None:
    return f"— ({row.prediction_note})"
  text = ("unstable" if math.isinf(value) else "reference unstable" if math.isnan(value)
          else _signed(value, 3))
  return f"{text} ({row.prediction_note})"


def value_text(value: float, unit: Unit) -> str:
  """A baseline's mean as the study reports it: '84.39%' (an accuracy in points), '2.829 bits
  per byte'."""
  scaled = value * unit.scale
  return f"{scaled:.2f}%" if unit.name == "points" else f"{scaled:.3f} {unit.name}"


def _row_line(row: Row) -> str:
  paired = len(row.paired_gaps)
  seeds = f"{len(row.gaps)}" + (f" ({paired} paired)" if paired != len(row.gaps) else "")
  beta = f"{row.momentum:.6g}" + ("*" if row.borrowed else "")
  return (f"| {methods_lib.DISPLAY_NAMES.get(row.method, row.method)} | {row.study} | "
          f"{settings_text(row.settings)} | {row.num_stages} | {beta} | {row.max_delay} | "
          f"{row.delay_memory:.3g} | {seeds} | {gap_text(row)} | {prediction_text(row)} |")


def rows_table(rows: Sequence[Row], unit: Unit) -> str:
  """The markdown table of ``rows`` (all of one unit), in order of method and ``x``."""
  header = (f"| method | study | settings | S | β | D_max | x = D_max (1 − β) | n seeds | "
            f"gap to the best baseline, {unit.name} (95% CI; + = worse) | quadratic: excess "
            "loss over the undelayed reference's, ÷ its own (unit-free, not in "
            f"{unit.name}) |")
  lines = [header, "|" + "---|" * 10]
  for row in sorted(rows, key=lambda r: (r.method, r.delay_memory, settings_text(r.settings))):
    lines.append(_row_line(row))
  return "\n".join(lines)


def baseline_name(baseline: Baseline) -> str:
  """How the tables name a baseline: a preset defined for several base updates (the one-stage
  reference) by the update it ran, 'Adam' or 'momentum SGD'; another (Muon) by its own name."""
  record = methods_lib.preset_of(baseline.method)
  if len(record.optimizers) > 1:
    form = form_of(next(iter(baseline.runs.values())))
    update = {"ema": "Adam", "heavy_ball": "momentum SGD"}.get(form, record.display_name)
    return f"{update} without a pipeline"
  return f"{record.display_name} without a pipeline"


def baselines_table(rows: Sequence[Row]) -> str:
  """Per study and network, the baseline every gap of that network is taken to."""
  lines = ["| study | network | S of its pipelined runs | best baseline | its settings | seeds | "
           "mean | a better cell of one seed |", "|" + "---|" * 8]
  seen = set()
  for row in sorted(rows, key=lambda r: (r.study, r.num_stages)):
    key = (row.study, network_of(row.record))
    if row.baseline is None or key in seen:
      continue
    seen.add(key)
    b = row.baseline
    seeds = ", ".join(map(str, sorted(b.runs)))
    pilot = b.better_pilot
    better = "—" if pilot is None else (
        f"{baseline_name(pilot)}, {settings_text(pilot.settings)}: "
        f"{value_text(pilot.mean, row.unit)}")
    lines.append(f"| {row.study} | {_network_text(key[1])} | {row.num_stages} | "
                 f"{baseline_name(b)} | {settings_text(b.settings)} | {seeds} | "
                 f"{value_text(b.mean, row.unit)} | {better} |")
  return "\n".join(lines)


INTRODUCTION = """\
Every cell of a pipelined method in the studies below (every run with the same settings but the
seed), set against **x = D_max (1 − β)**: the pipeline's longest delay, the stem's
D_max = 2(S − 1) (`pipejax.core.accounting.stage_delays`) counted in updates (D_max / M where
a method applies one update per M micro-batches), over the momentum's memory 1 / (1 − β), with
β the momentum the run resolved and recorded (the deep MLP's momentum from the
batch-128 recipe's scaling rule, 0.9^(1/128) at micro-batch 1; Adam's b1 on the language model).
Issue 51's hypothesis is that delay compensation holds while x ≪ 1.

The **gap** is taken to the best baseline of the same study and network: among the runs
without a pipeline (SGD or Adam as one stage, Muon as one stage where the study has it), over
every rate and beta, the cell with the best mean among those of two or more seeds where there
is one; a one-seed cell that is better still is named beside it, since one seed's noise would
shift every unpaired gap alike. A seed the baseline cell has is paired with
its run (same starting weights); another seed is set against the baseline cell's mean, so its
spread does not enter the interval. Gaps are in each study's own unit, **positive when the
pipelined run is worse**: accuracy points on the deep MLP, bits per byte (nats / ln 2) of
validation loss on the language model. The interval is the 95% Student-t interval over seeds
(`pipejax.study.statistics.interval`); diverged runs are counted, never averaged.

The **prediction** is the convex quadratic's (`pipejax.analysis.quadratic.noise`): under gradient
noise, the method's stationary excess loss minus the undelayed reference's at the same D_max, β
and step ηλ, divided by the reference's own excess loss, so that the noise's variance cancels.
It has no unit and is not a prediction of points or bits per byte: 0 is no cost of the delay, 1
doubles the reference's noise floor, below 0 is a lower floor (a smaller effective step, bought
with slower progress, which a stationary floor does not count), and "unstable" is a spectral
radius of at least 1. It needs the curvature λ: the stem's own, read by
`scripts/depth_limits.py` into the study's `limits.jsonl` (Adam's is that of the Hessian over
√ν̂, `pipejax.analysis.depth_limits.step_curvature`), at the run's depth, each reading paired with
the rate the schedule had reached at its weights, and the reading where that step ηλ is largest
taken (`pipejax.analysis.phase.stem_reading`). A reading at the initial weights meets a rate of 0
under a warm-up and is left out: pairing it with the peak rate would give a step the run never
takes (on the deep MLP at 128 stages the stem's λ falls from 45.5 at the initial weights to
2.46 after 1,250 samples, while the rate is still ramping up: `docs/studies/depth/limits.jsonl`).
The readings at one depth come from one run (each names its method and seed: at 32 stages on
the deep MLP, PB + SC + LWP's seed 0), not from each method's own trajectory. A cell whose
study has no reading at its depth with a rate above 0 has no prediction. The figure draws it on
its own right-hand axis."""


def report(rows: Sequence[Row], notes: Sequence[str], figure: str, command: str) -> str:
  """The phase diagram's markdown: how to regenerate it, what it shows, the notes on studies
  that gave no rows, the baselines, where each method holds and the gaps (one table of each per
  unit), and ``figure`` with its caption."""
  parts = ["# The phase diagram: the gap to the best baseline against D_max (1 − β)", "",
           "Regenerate from the studies' records (trains nothing):", "", "```bash", command,
           "```", "", INTRODUCTION, ""]
  if notes:
    parts += ["Studies and runs left out:", ""] + [f"- {note}" for note in notes] + [""]
  parts += ["## The baselines", "", baselines_table(rows), ""]
  for unit in dict.fromkeys(row.unit for row in rows):
    parts += [f"## Where each method holds, in {unit.name}", "", safe_range.INTRODUCTION, "",
              safe_range.table([r for r in rows if r.unit == unit]), ""]
  for unit in dict.fromkeys(row.unit for row in rows):
    parts += [f"## Gaps in {unit.name}", "", rows_table([r for r in rows if r.unit == unit],
                                                       unit), ""]
  if any(row.borrowed for row in rows):
    parts += ["\\* Every run of the cell diverged, recording neither its stages nor its "
              "momentum: S, β and the rate are those a finished run of the same study, network "
              "and settings recorded (the same recipe).", ""]
  parts += ["## The figure", "", f"![The phase diagram]({figure})", "",
            "Left axis, filled dots: each cell's mean gap to the best baseline with its 95% CI "
            "(positive is worse), one colour per method, against x = D_max (1 − β) on a log "
            "axis; cells at one x are drawn slightly apart, method by method. Crosses at the "
            "top: cells with diverged runs. Right axis, hollow squares (symmetric log scale): "
            "the convex quadratic's excess loss over the undelayed reference's, divided by the "
            "reference's own; it has no unit and is not in points or bits per byte, so the two "
            "axes are not to be read against each other, only each against x. Hollow triangles "
            "under the crosses: the quadratic is unstable there. A panel without a curvature "
            "reading has no right axis.", ""]
  return "\n".join(parts)
