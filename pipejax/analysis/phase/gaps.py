"""The gaps: each network's best baseline, each pipelined cell's gaps to it, and the notes on
studies that give none.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from pipejax.analysis.phase.runs import (method_of, is_baseline, is_pipelined, network_of,
                                         training_overrides, settings_of, usable, value_of, seed_of,
                                         settings_text)
from pipejax.analysis.phase.studies import PhaseError, StudyMismatchError, Unit, Source, read_study
from pipejax.core import accounting
from pipejax.study import statistics
from pipejax.study.cells import without_seed
from pipejax.study.records import RunRecord, diverged, is_number
from pipejax.study.spec import key_of


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
  """The micro-batches one update of the run applies, from its plan
  (:attr:`~pipejax.study.records.RunRecord.plan_facts`); 1 when it has no plan."""
  facts = record.plan_facts
  return 1 if facts is None else facts.micro_batches_per_update


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
