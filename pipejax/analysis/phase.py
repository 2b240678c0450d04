"""The phase diagram: every pipelined run's gap to its study's best baseline against D_max (1 − β).

Issue 51's hypothesis is that delay compensation holds while the pipeline's longest delay is
short against the momentum's memory, ``D_max (1 − β) ≪ 1``. This module reads the records of the
depth studies (``results.jsonl``, :func:`pipejax.study.records.load_results`) and gives, for each
cell of a pipelined method (every run with the same settings but the seed):

* ``S``, the stages the run recorded; ``D_max``, the largest of
  :func:`pipejax.core.accounting.stage_delays` (the stem's); ``β``, the momentum the run resolved
  and recorded (under Adam that is b1: :func:`pipejax.train.experiment.resolved_optimizer`); and
  ``x = D_max (1 − β)``, the delay counted in updates (``D_max / M`` where the method applies one
  update per ``M`` micro-batches, its ``micro_batches``);
* its gap to the **best baseline** of the same study and network: among the runs of a one-stage
  method (:class:`pipejax.methods.Traits`), over every rate and beta, the cell with the best mean
  among those of two or more seeds where there is one (a better one-seed cell is named beside it).
  A seed the baseline cell has is paired with it (same starting weights, where both records name
  them); another seed is set against the baseline cell's mean. The gap is in the study's own
  unit (its first gap table's, :func:`unit_of`) and **positive when the run is worse** than the
  baseline, whichever way its metric is better;
* the convex quadratic's prediction at the same ``D_max``, β and rate (:func:`prediction`).

The quadratic's prediction is not in the study's unit. Under gradient noise of variance ``σ²``,
:func:`pipejax.analysis.quadratic.noise.predicted_gap` is the method's stationary excess loss
minus the undelayed reference's, in units of ``σ²/λ``, at a step ``x = ηλ``. Neither ``σ²`` nor a
network's ``λ`` is known, so the prediction given here is that gap over the reference's own
excess loss (:func:`pipejax.analysis.quadratic.noise.heavy_ball_excess_loss`), in which ``σ²``
cancels: 0 where the delay costs nothing, 1 where it doubles the noise floor, ``inf`` where the
method is unstable. ``λ`` does not cancel: it is the study's own curvature reading of the stem
(``limits.jsonl``, :mod:`pipejax.analysis.depth_limits`) at the run's depth, and a cell without
one has no prediction. Nothing maps the quadratic's number onto points or bits per byte.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
from typing import Iterable, Sequence

from pipejax import config as config_lib
from pipejax import methods as methods_lib
from pipejax.analysis import depth_limits, quadratic, safe_range
from pipejax.analysis.quadratic import noise as quadratic_noise
from pipejax.core import accounting
from pipejax.study import statistics
from pipejax.study.cells import without_seed
from pipejax.study.records import RunRecord, diverged, is_number, load_results
from pipejax.study.spec import (Study, StudyError, higher_is_better, key_of, load_study,
                                run_id)

# Config fields that change what a run logs, not what it trains: a run that sets one is the same
# run as its twin without it (the depth study's 8-stage runs with ``diagnostics`` repeat seed 0
# of each method to the last digit), and is counted once.
MEASUREMENT_ONLY = ("diagnostics",)
CURVATURE_FILE = "limits.jsonl"  # scripts/depth_limits.py's records, beside results.jsonl
# The studies that measured the pipelined methods at depth: the phase diagram's, and those the
# start-up warning's ranges are generated from (pipejax/methods/safe_ranges.json).
DEFAULT_STUDIES = ("docs/studies/depth", "docs/studies/lm_depth", "docs/studies/lm_regime",
                   "docs/studies/mlp_regime")


class PhaseError(ValueError):
  """A study the phase diagram cannot read; the message says why and what to do."""


class StudyMismatchError(PhaseError):
  """A workdir's records are not runs of the study file paired with it: a user's error that no
  note may hide, since the diagram would read them in another study's unit."""


@dataclasses.dataclass(frozen=True)
class Unit:
  """How a study reports its metric: ``metric`` (a record field) times ``scale`` is in ``name``;
  ``margin`` (in ``name``) is its non-inferiority margin, None where it declares none."""

  metric: str
  scale: float
  name: str
  # Not part of a unit's identity: studies in one unit share its tables and its figure's panel,
  # and each row's verdict takes its own study's margin.
  margin: float | None = dataclasses.field(default=None, compare=False)

  @property
  def higher_is_better(self) -> bool:
    return higher_is_better(self.metric)

  def gap(self, value: float, reference: float) -> float:
    """``value``'s distance behind ``reference`` in this unit: positive when it is worse."""
    worse = reference - value if self.higher_is_better else value - reference
    return worse * self.scale


def unit_of(study: Study) -> Unit:
  """The unit of ``study``'s gaps: its first gap table's metric, scale and unit (points for an
  accuracy at scale 100), else its first table's, an accuracy in points without tables; and the
  study's margin in that unit."""
  tables = [t for t in study.tables if t.kind == "gap"] or list(study.tables)
  metric, scale, name = ((tables[0].metric, tables[0].scale, tables[0].unit_name) if tables
                         else ("test_accuracy", 100.0, "points"))
  # Rounded: a margin declared in nats comes out of the conversion to bits a float error away
  # from the one it states.
  margin = None if study.margin is None else round(study.margin * scale, 9)
  return Unit(metric, scale, name, margin)


@dataclasses.dataclass
class Source:
  """One study's records, its name and unit, and its curvature readings (may be empty)."""

  workdir: str
  name: str
  unit: Unit
  records: list[RunRecord]
  curvature: list[dict]
  problems: list[str] = dataclasses.field(default_factory=list)


def study_file_of(workdir: str) -> str:
  """Where a study workdir's study file is by the project's convention: ``docs/studies/NAME`` is
  ``configs/studies/NAME.py``'s."""
  return os.path.join("configs", "studies", os.path.basename(os.path.normpath(workdir)) + ".py")


def read_study(workdir: str, study_file: str | None = None, unit: Unit | None = None) -> Source:
  """The records of the study in ``workdir``; its name and unit from ``study_file`` (default
  :func:`study_file_of`) unless ``unit`` is given.

  Records that are not runs of the study file (not its grid points, or of another config) are
  left out with a note; when none is, the pairing is refused.

  Raises:
    PhaseError: no such workdir, no ``results.jsonl`` in it, or a study file that cannot be read.
    StudyMismatchError: none of the records is a run of the study file.
  """
  path = os.path.join(workdir, "results.jsonl")
  if not os.path.isdir(workdir):
    raise PhaseError(f"No study workdir {workdir!r}: the phase diagram reads its results.jsonl. "
                     "Give the directory a study was run in (scripts/study.py --workdir), or "
                     "leave it out of --studies.")
  if not os.path.isfile(path):
    raise PhaseError(f"{workdir!r} holds no results.jsonl: no run of a study has finished there "
                     "yet. Run the study first (scripts/study.py --workdir=" f"{workdir}), or "
                     "leave it out of --studies.")
  name = os.path.basename(os.path.normpath(workdir))
  records, problems = load_results(workdir)
  if unit is None:
    spec = study_file or study_file_of(workdir)
    try:
      study = load_study(spec)
    except StudyError as e:
      raise PhaseError(f"The unit of the study in {workdir!r} comes from its study file, and "
                       f"{e} Give the file as WORKDIR=STUDY_FILE in --studies.") from None
    name, unit = study.name, unit_of(study)
    records, foreign = runs_of_study(records, study, spec, workdir)
    problems += foreign
  curvature = depth_limits.read_records(os.path.join(workdir, CURVATURE_FILE))
  return Source(workdir, name, unit, records, curvature, problems)


def runs_of_study(records: Sequence[RunRecord], study: Study, spec: str,
                  workdir: str) -> tuple[list[RunRecord], list[str]]:
  """The records that are runs of ``study`` (its grid points, of its config), and a note on those
  left out.

  Raises:
    StudyMismatchError: there are records and none is a run of ``study``.
  """
  grid = {run_id(o) for o in study.runs()}
  kept = [r for r in records if r.run in grid and r.config == study.config]
  if records and not kept:
    configs = ", ".join(sorted({str(r.config) for r in records}))
    raise StudyMismatchError(
        f"None of the {len(records)} records in {workdir!r} is a run of the study file {spec!r} "
        f"(its config {study.config!r} and its grid; the records' config: {configs}): the phase "
        "diagram would read them in that study's unit. Pair each workdir with the study file it "
        "was run from (WORKDIR=STUDY_FILE in --studies).")
  left = len(records) - len(kept)
  notes = [f"{left} of its {len(records)} records are not runs of {spec} (not a grid point of it, "
           "or of another config): left out."] if left else []
  return kept, notes


# ----------------------------------------------------------------------------------------------
# Runs: which are baselines, which are pipelined, and what each one is.


def method_of(record: RunRecord) -> str:
  return record.method or ""


def is_baseline(record: RunRecord) -> bool:
  """A run without a pipeline: its method trains the whole network as one stage."""
  name = method_of(record)
  return name in methods_lib.RECORDS and methods_lib.traits_of(name).one_stage


def is_pipelined(record: RunRecord) -> bool:
  """A run of a method that computes on stale weights (a delay to compensate)."""
  name = method_of(record)
  return name in methods_lib.RECORDS and not methods_lib.traits_of(name).delay_free


def network_of(record: RunRecord) -> tuple:
  """The network a run trained: its config and every ``model_kwargs.*`` it set. Runs of one
  network are one depth, whatever their method."""
  settings = record.settings
  return (record.config,) + key_of(
      {k: v for k, v in settings.items() if k.startswith("model_kwargs.")})


def training_overrides(record: RunRecord) -> dict:
  """The run's overrides less those that change only what it logs (:data:`MEASUREMENT_ONLY`)."""
  return {k: v for k, v in record.overrides.items() if k not in MEASUREMENT_ONLY}


def settings_of(record: RunRecord) -> dict:
  """What sets a run's cell apart beyond its method and network: its rate, betas, optimizer."""
  return {k: v for k, v in training_overrides(record).items()
          if k not in ("method", "seed") and not k.startswith("model_kwargs.")}


def usable(records: Iterable[RunRecord]) -> list[RunRecord]:
  """The finished and diverged runs, each once: failed and skipped runs say nothing of a method,
  and a run that differs from another only in :data:`MEASUREMENT_ONLY` is that run."""
  kept = {}
  for r in records:
    if not r.trained:
      continue
    identity = key_of(training_overrides(r))
    if identity not in kept or len(r.overrides) < len(kept[identity].overrides):
      kept[identity] = r
  return list(kept.values())


def value_of(record: RunRecord, unit: Unit) -> float | None:
  """The run's metric, None when it diverged or has none."""
  value = record.get(unit.metric)
  return None if diverged(record) or not is_number(value) else float(value)


def seed_of(record: RunRecord) -> int:
  return record.seed


# ----------------------------------------------------------------------------------------------
# The best baseline of each network.


@dataclasses.dataclass(frozen=True)
class Baseline:
  """The baseline cell: its runs by seed and their mean (metric units); and ``better_pilot``,
  a one-seed cell with a better value where there is one, which a reader should know of."""

  method: str
  settings: dict
  runs: dict  # seed -> record
  mean: float
  better_pilot: Baseline | None = None

  def value(self, seed: int, unit: Unit) -> float:
    return value_of(self.runs[seed], unit)


def best_baselines(records: Sequence[RunRecord], unit: Unit) -> dict[tuple, Baseline]:
  """Per network, the baseline cell with the best mean ``unit.metric`` over its seeds, among the
  cells of two or more seeds where there is one: a one-seed cell's noise would shift every
  unpaired gap alike, and pair with one seed only. A one-seed cell that is better still is kept
  as ``better_pilot``. A cell where a seed diverged is no baseline: its mean would hide the
  failure."""
  cells = collections.defaultdict(list)
  for r in usable(records):
    if is_baseline(r):
      cells[(network_of(r), without_seed(training_overrides(r)))].append(r)
  seeded, pilots = {}, {}
  for (network, _), runs in cells.items():
    values = [value_of(r, unit) for r in runs]
    if any(v is None for v in values):
      continue
    found = Baseline(method_of(runs[0]), settings_of(runs[0]), {seed_of(r): r for r in runs},
                     sum(values) / len(values))
    best = seeded if len(runs) > 1 else pilots
    held = best.get(network)
    if held is None or _better(found.mean, held.mean, unit):
      best[network] = found
  chosen = {}
  for network in {*seeded, *pilots}:
    baseline, pilot = seeded.get(network), pilots.get(network)
    if baseline is None:
      chosen[network] = pilot
    elif pilot is not None and _better(pilot.mean, baseline.mean, unit):
      chosen[network] = dataclasses.replace(baseline, better_pilot=pilot)
    else:
      chosen[network] = baseline
  return chosen


def _better(value: float, than: float, unit: Unit) -> bool:
  return value > than if unit.higher_is_better else value < than


# ----------------------------------------------------------------------------------------------
# A pipelined cell: its delay over the momentum's memory, its gaps and the quadratic's word.


@dataclasses.dataclass
class Row:
  """One pipelined cell of one study: what it is, its gaps, and the quadratic's prediction."""

  study: str
  unit: Unit
  method: str
  settings: dict
  num_stages: int
  momentum: float
  learning_rate: float | None
  gaps: list[float]
  paired_gaps: list[float]  # those of ``gaps`` taken against the baseline's run of the same seed
  diverged: int
  runs: int
  baseline: Baseline | None
  record: RunRecord  # one run of the cell: what the cell's runs share (config, optimizer, network)
  borrowed: bool = False  # S, β and the rate from the cell's finished siblings (none finished)
  micro_batches_per_update: int = 1
  prediction: float | None = None
  prediction_note: str = ""

  @property
  def max_delay(self) -> int:
    return max(accounting.stage_delays(self.num_stages))

  @property
  def delay_memory(self) -> float:
    """``x = (D_max / M) (1 − β)``: the stem's delay in updates (M micro-batches each) over the
    momentum's memory ``1 / (1 − β)``."""
    return self.max_delay / self.micro_batches_per_update * (1.0 - self.momentum)

  @property
  def interval(self) -> statistics.Interval:
    """The mean gap with its 95% Student-t interval over the seeds."""
    return statistics.interval(self.gaps)


def gap_of(record: RunRecord, baseline: Baseline, unit: Unit) -> tuple[float, bool] | None:
  """The run's gap to ``baseline`` and whether it is paired: against the baseline's run of the
  same seed where there is one and both started from the same weights (where both records name
  them), else against the baseline's mean. None for a run without a value."""
  value = value_of(record, unit)
  if value is None:
    return None
  twin = baseline.runs.get(seed_of(record))
  digests = (record.init_digest, twin.init_digest if twin else None)
  if twin is not None and (None in digests or digests[0] == digests[1]):
    return unit.gap(value, baseline.value(seed_of(record), unit)), True
  return unit.gap(value, baseline.mean), False


def micro_batches_per_update(record: RunRecord) -> int:
  """The micro-batches one update of the run applies: its method's ``micro_batches`` where the
  method accumulates them (:class:`pipejax.methods.Traits`), as its study set it or by default."""
  method = method_of(record)
  if method not in methods_lib.RECORDS or \
      not methods_lib.traits_of(method).accumulates_micro_batches:
    return 1
  settings = record.settings
  fields = dataclasses.fields(methods_lib.record_of(method).hyperparameters)
  default = next(f.default for f in fields if f.name == "micro_batches")
  return int(settings.get(f"method_kwargs.{method}.micro_batches", default))


def _facts(runs: Sequence[RunRecord],
           records: Sequence[RunRecord]) -> tuple[int, float, float | None, bool] | None:
  """``(S, β, rate, borrowed)`` of a cell: from its finished runs, else (all diverged, having
  recorded neither) from a finished run of the same study, network and overrides but the method
  and seed, which resolved the same recipe (:func:`pipejax.train.experiment.resolve_recipe`
  reads the method only for a synchronous step's micro-batches); None when there is none."""
  own = [r for r in runs if is_number(r.momentum) and is_number(r.num_stages)]
  if own:
    return own[0].num_stages, own[0].momentum, own[0].learning_rate, False
  network, settings = network_of(runs[0]), key_of(settings_of(runs[0]))
  siblings = [r for r in records if network_of(r) == network and is_number(r.momentum)
              and key_of(settings_of(r)) == settings]
  stages = [r.num_stages for r in siblings if is_pipelined(r) and is_number(r.num_stages)]
  if not stages:
    return None
  return stages[0], siblings[0].momentum, siblings[0].learning_rate, True


def rows_of(source: Source) -> list[Row]:
  """Every pipelined cell of the study with its gaps to its network's best baseline; a cell
  whose network has no baseline gets no gaps (:func:`notes` names it)."""
  records = usable(source.records)
  baselines = best_baselines(records, source.unit)
  cells = collections.defaultdict(list)
  for r in records:
    if is_pipelined(r):
      cells[without_seed(training_overrides(r))].append(r)
  rows = []
  for runs in cells.values():
    facts = _facts(runs, records)
    if facts is None:
      continue
    stages, momentum, rate, borrowed = facts
    baseline = baselines.get(network_of(runs[0]))
    found = [gap_of(r, baseline, source.unit) for r in runs] if baseline else []
    found = [g for g in found if g is not None]
    rows.append(Row(source.name, source.unit, method_of(runs[0]), settings_of(runs[0]),
                    int(stages), float(momentum), rate, [g for g, _ in found],
                    [g for g, paired in found if paired],
                    sum(value_of(r, source.unit) is None for r in runs),
                    len(runs), baseline, runs[0], borrowed,
                    micro_batches_per_update(runs[0])))
  return sorted(rows, key=lambda row: (row.method, row.num_stages, settings_text(row.settings)))


# ----------------------------------------------------------------------------------------------
# The quadratic's prediction.


@functools.lru_cache(maxsize=None)
def relative_gap(method: str, delay: int, momentum: float, lr_lambda: float) -> float:
  """The quadratic's :func:`~pipejax.analysis.quadratic.noise.predicted_gap` over the undelayed
  reference's stationary excess loss at the same ``ηλ`` and momentum: the noise's variance
  cancels. ``inf`` where the method is unstable, NaN where the reference itself is."""
  reference = quadratic_noise.heavy_ball_excess_loss(lr_lambda, momentum, 1.0)
  if not math.isfinite(reference):
    return math.nan
  return quadratic_noise.predicted_gap(method, delay, momentum, lr_lambda, 1.0) / reference


@functools.lru_cache(maxsize=None)
def _config_optimizer(config: str) -> str | None:
  try:
    return config_lib.load_config(config).optimizer
  except config_lib.ConfigFileError:
    return None


def form_of(record: RunRecord) -> str | None:
  """The run's base update as the quadratic reads it: ``'ema'`` for Adam, ``'heavy_ball'`` for
  SGD (:class:`pipejax.optim.Recipe`'s ``form``); None when its config cannot be read."""
  optimizer = record.overrides.get("optimizer") or (record.fixed or {}).get("optimizer")
  if optimizer is None and record.config:
    optimizer = _config_optimizer(record.config)
  return None if optimizer is None else ("ema" if optimizer == "adam" else "heavy_ball")


def stem_reading(curvature: Sequence[dict], num_stages: int) -> dict | None:
  """The study's curvature reading of the stem (stage 0, the delay ``D_max``) at ``num_stages``:
  at the initial weights where there is one, else the earliest."""
  readings = [r for r in curvature if r.get("num_stages") == num_stages and r.get("stage") == 0
              and is_number(r.get("sharpness"))]
  return min(readings, key=lambda r: r.get("samples", 0)) if readings else None


def prediction(row: Row, form: str | None, curvature: Sequence[dict]) -> tuple[float | None, str]:
  """The quadratic's relative gap (:func:`relative_gap`) for ``row`` at its ``D_max``, β and
  rate, with ``λ`` the study's stem reading at its depth; None with the reason where there is
  none. A reading taken of one base update (heavy ball, or Adam's preconditioned curvature)
  predicts nothing for a run of the other."""
  if row.micro_batches_per_update > 1:
    return None, f"{row.micro_batches_per_update} micro-batches per update: no quadratic form"
  if row.method not in quadratic.PIPELINE_METHODS:
    return None, "no quadratic form"
  reading = stem_reading(curvature, row.num_stages)
  if reading is None:
    return None, f"no λ reading at {row.num_stages} stages"
  if form is None:
    return None, f"its config {row.record.config!r} cannot be read"
  if (reading.get("form") or "heavy_ball") != form:
    return None, "λ read under another optimizer"
  if not is_number(row.learning_rate):
    return None, "no rate recorded"
  lr_lambda = depth_limits.step_curvature(row.learning_rate, reading["sharpness"], row.momentum,
                                          form)
  samples = reading.get("samples", 0)
  where = "at the initial weights" if not samples else f"after {samples:,} samples"
  return (relative_gap(row.method, row.max_delay, row.momentum, lr_lambda),
          f"ηλ {lr_lambda:.2g}: the stem's λ {where}")


def phase_rows(sources: Sequence[Source]) -> list[Row]:
  """Every study's pipelined cells (:func:`rows_of`) with the quadratic's prediction."""
  rows = []
  for source in sources:
    for row in rows_of(source):
      row.prediction, row.prediction_note = prediction(row, form_of(row.record),
                                                       source.curvature)
      rows.append(row)
  return rows


# ----------------------------------------------------------------------------------------------
# Reading several studies, and what to say about those that give no row.


def read_studies(entries: Sequence[str]) -> tuple[list[Source], list[str]]:
  """The studies of ``entries`` (``WORKDIR`` or ``WORKDIR=STUDY_FILE``) that can be read, and one
  line for each that cannot or that gives no row (a missing workdir is skipped, not an error).

  Raises:
    StudyMismatchError: a workdir's records are not runs of the study file paired with it.
  """
  sources, notes = [], []
  for entry in entries:
    workdir, _, study_file = entry.partition("=")
    try:
      source = read_study(workdir, study_file or None)
    except StudyMismatchError:
      raise
    except PhaseError as e:
      notes.append(f"Skipped: {e}")
      continue
    notes += [f"{source.name}: {problem}" for problem in source.problems]
    runs = usable(source.records)
    if not any(is_pipelined(r) for r in runs):
      notes.append(f"{source.name} ({workdir}): {len(runs)} finished or diverged run(s), none of "
                   "a pipelined method yet: no row.")
    baselines = best_baselines(runs, source.unit)
    lacking = sorted({_network_text(network_of(r)) for r in runs
                      if is_pipelined(r) and network_of(r) not in baselines})
    if lacking:
      notes.append(f"{source.name}: no finished baseline for the network(s) {'; '.join(lacking)}: "
                   "their runs have no gap.")
    sources.append(source)
  return sources, notes


def _network_text(network: tuple) -> str:
  """'depth 32', 'blocks 30, width 64': a network's ``model_kwargs`` in words."""
  parts = [f"{key.split('.', 1)[1]} {value}" for key, value in network[1:]]
  return ", ".join(parts) or str(network[0])


# ----------------------------------------------------------------------------------------------
# The tables.


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


def settings_text(settings: dict) -> str:
  """The overrides that set a cell apart, or 'the recipe' when none do."""
  return ", ".join(f"{k} = {v}" for k, v in sorted(settings.items())) or "the recipe"


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
  record = methods_lib.record_of(baseline.method)
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


# ----------------------------------------------------------------------------------------------
# The figure.

_SPREAD = 0.015  # series at one x are drawn this fraction apart on the log axis, method by method
_BAND = 0.95  # where diverged runs (left axis) and unstable predictions (right) are drawn


def _panel(ax, rows: Sequence[Row]) -> None:
  """One unit's gaps (left axis, filled, 95% CIs) and predictions (right axis, hollow)."""
  from matplotlib import ticker, transforms  # pylint: disable=import-outside-toplevel
  order = sorted({row.method for row in rows})
  top_left = transforms.blended_transform_factory(ax.transData, ax.transAxes)
  predicted = [row for row in rows if row.prediction is not None
               and not math.isnan(row.prediction)]
  drawn = {id(row) for row in predicted}
  twin = ax.twinx() if predicted else None
  for row in rows:
    color = methods_lib.record_of(row.method).color
    x = row.delay_memory * (1 + _SPREAD * (order.index(row.method) - (len(order) - 1) / 2))
    if row.gaps:
      s = row.interval
      error = [[s.mean - s.low], [s.high - s.mean]] if s.n > 1 else None
      ax.errorbar([x], [s.mean], yerr=error, fmt="o", color=color, ms=5, capsize=2, lw=1)
    if row.diverged:
      ax.plot([x], [_BAND], "x", color=color, ms=7, mew=2, transform=top_left, clip_on=False)
    if id(row) in drawn and math.isinf(row.prediction):
      ax.plot([x], [_BAND - 0.06], "^", mfc="none", color=color, ms=7, transform=top_left,
              clip_on=False)
    elif id(row) in drawn:
      twin.plot([x], [row.prediction], "s", mfc="none", color=color, ms=7)
  unit = rows[0].unit.name
  ax.axhline(0.0, color="black", lw=0.8, ls="--")
  ax.set_xscale("log")
  plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
  ax.xaxis.set_major_formatter(plain)
  left, right = ax.get_xlim()
  # Within one decade the minor ticks are the only ones to read; over several they would crowd.
  ax.xaxis.set_minor_formatter(plain if right < 10 * left else ticker.NullFormatter())
  low, high = ax.get_ylim()
  ax.set_ylim(low, high + 0.25 * (high - low))  # room for the band of diverged runs
  ax.set_xlabel("x = D_max (1 − β): the longest delay over the momentum's memory")
  ax.set_ylabel(f"gap to the best baseline ({unit}; above 0 is worse)")
  if twin is not None:
    # The quadratic's excess loss is never below 0, so its ratio to the reference's is ≥ −1.
    finite = [row.prediction for row in predicted if math.isfinite(row.prediction)]
    twin.set_yscale("symlog", linthresh=0.01)
    twin.set_ylim(-1.05, max([1.0] + [1.5 * v for v in finite]))
    twin.set_ylabel("quadratic: excess loss over the reference's, ÷ its own (hollow; no unit)")
  else:
    ax.text(0.02, 0.02, "no curvature reading in these studies: no prediction",
            transform=ax.transAxes, fontsize=8, color="gray")
  studies = ", ".join(dict.fromkeys(row.study for row in rows))
  ax.set_title(f"{unit} ({studies})", fontsize=10)
  ax.grid(True, which="major", alpha=0.3)


def draw(rows: Sequence[Row], path: str) -> str:
  """Writes the phase diagram to ``path``: a panel per unit, a colour per method (its record's),
  the measured gap with its 95% CI against ``x`` on a log axis, the diverged runs as crosses at
  the top, the quadratic's prediction as hollow squares on its own right axis (unstable: a
  hollow triangle under the crosses). Returns ``path``."""
  from matplotlib import lines as lines_lib  # pylint: disable=import-outside-toplevel
  from pipejax import plotting  # pylint: disable=import-outside-toplevel
  plt = plotting.pyplot()
  units = list(dict.fromkeys(row.unit.name for row in rows))
  order = sorted({row.method for row in rows})
  fig, axes = plt.subplots(1, len(units), figsize=(7.5 * len(units), 5.2), squeeze=False)
  for ax, unit in zip(axes.flat, units):
    _panel(ax, [row for row in rows if row.unit.name == unit])
  handles = [lines_lib.Line2D([], [], color=methods_lib.record_of(m).color, marker="o", ls="none",
                              label=methods_lib.DISPLAY_NAMES.get(m, m)) for m in order]
  handles += [lines_lib.Line2D([], [], color="gray", marker="x", ls="none", mew=2,
                               label="runs diverged (count in the table)"),
              lines_lib.Line2D([], [], color="gray", marker="s", mfc="none", ls="none",
                               label="quadratic's prediction (right axis)"),
              lines_lib.Line2D([], [], color="gray", marker="^", mfc="none", ls="none",
                               label="quadratic: unstable")]
  fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8,
             frameon=False)
  rows_of_legend = math.ceil(len(handles) / 6)
  plotting.save(fig, path, dpi=110, rect=(0.0, 0.05 * rows_of_legend, 1.0, 1.0))
  return path


# ----------------------------------------------------------------------------------------------
# The report.

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
√ν̂, `pipejax.analysis.depth_limits.step_curvature`), at the run's depth, and a cell whose study
has no such reading there has none. The figure draws it on its own right-hand axis."""


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
