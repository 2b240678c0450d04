"""What each run is: a baseline or pipelined, its network, its settings and its value."""

from __future__ import annotations

from typing import Iterable

from pipejax import methods as methods_lib
from pipejax.analysis.phase.studies import MEASUREMENT_ONLY, Unit
from pipejax.study.records import RunRecord, diverged, is_number
from pipejax.study.spec import key_of


def method_of(record: RunRecord) -> str:
  return record.method or ""


def is_baseline(record: RunRecord) -> bool:
  """A run without a pipeline: its method trains the whole network as one stage."""

  name = method_of(record)
  return name in methods_lib.PRESETS and methods_lib.traits_of(name).one_stage


def is_pipelined(record: RunRecord) -> bool:
  """A run of a method that computes on stale weights (a delay to compensate)."""
  name = method_of(record)
  return name in methods_lib.PRESETS and not methods_lib.traits_of(name).delay_free


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


def settings_text(settings: dict) -> str:
  """The overrides that set a cell apart, or 'the recipe' when none do."""
  return ", ".join(f"{k} = {v}" for k, v in sorted(settings.items())) or "the recipe"
