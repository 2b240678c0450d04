"""The token taxes a budget study measured, as the data a run's start-up warning reads.

Each reading of :meth:`pipejax.study.budget.TokensToTarget.taxes` belongs to a series of runs of
one preset at one depth and one number of micro-batches per update; :func:`measured_taxes` files
it under that preset with those two facts, taken from the series' own records, so that a run
of the same preset, depth and micro-batches per update is told what the study found
(:func:`pipejax.methods.safe_ranges.token_tax`). :func:`write_taxes` writes the file the warning
reads, ``pipejax/methods/token_tax.json``.
"""

from __future__ import annotations

import json
from typing import Sequence

from pipejax import files
from pipejax.analysis.phase.gaps import micro_batches_per_update
from pipejax.methods import safe_ranges
from pipejax.study import budget
from pipejax.study.cells import select
from pipejax.study.records import FINISHED, RunRecord


class TaxSeriesError(ValueError):
  """A series' runs disagree on what the warning files a tax under; the message names them."""


def _series_facts(records: Sequence[RunRecord], where: tuple, label: str) -> tuple:
  """(preset, stages, micro-batches per update) shared by every finished run of one series."""
  facts = {(r.overrides.get("method"), r.num_stages, micro_batches_per_update(r))
           for r in select(records, where) if r.status == FINISHED}
  if len(facts) != 1:
    raise TaxSeriesError(
        f"The series {label!r} mixes runs of {sorted(map(str, facts))} (preset, stages, "
        "micro-batches per update): a token tax belongs to one of each. Narrow its where.")
  return facts.pop()


def measured_taxes(tokens: budget.TokensToTarget, records: Sequence[RunRecord],
                   study: str) -> dict:
  """Per preset, every tax ``tokens`` reads from ``records``: its depth, micro-batches per
  update, target, tax, 95% interval over seeds (None below two seeds) and seeds."""
  readings = tokens.taxes(records)
  facts = {label: _series_facts(records, where, label) for label, where in tokens.series
           if any(r.series == label for r in readings)}
  found: dict[str, list] = {}
  for reading in readings:
    method, stages, per_update = facts[reading.series]
    iv = reading.interval
    found.setdefault(method, []).append({
        "study": study, "series": reading.series, "stages": stages,
        "micro_batches_per_update": per_update, "target": reading.target,
        "unit": tokens.unit, "tax": round(reading.tax, 4), "against": reading.against,
        "low": round(iv.low, 4) if iv.n >= 2 else None,
        "high": round(iv.high, 4) if iv.n >= 2 else None, "seeds": iv.n})
  return dict(sorted(found.items()))


def write_taxes(tokens: budget.TokensToTarget, records: Sequence[RunRecord], study: str,
                path: str = safe_ranges.TAX_PATH, command: str = "") -> str:
  """Writes :func:`measured_taxes` to ``path`` (the file the warning reads); returns ``path``."""
  text = json.dumps({"generated_by": command or "python scripts/price.py --token_tax="
                     "pipejax/methods/token_tax.json",
                     "methods": measured_taxes(tokens, records, study)},
                    indent=1, sort_keys=True)
  files.write(path, text + "\n")
  return path
