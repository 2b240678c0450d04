"""The convex quadratic's prediction for each cell, at its D_max, β and rate, with the study's
curvature.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

from pipejax.analysis import depth_limits
from pipejax.analysis import quadratic
from pipejax.analysis.phase.gaps import Row, rows_of
from pipejax.analysis.phase.studies import Source
from pipejax.analysis.quadratic import noise as quadratic_noise
from pipejax.study.records import RunRecord, is_number


@functools.lru_cache(maxsize=None)
def relative_gap(method: str, delay: int, momentum: float, lr_lambda: float) -> float:
  """The quadratic's :func:`~pipejax.analysis.quadratic.noise.predicted_gap` over the undelayed
  reference's stationary excess loss at the same ``ηλ`` and momentum: the noise's variance
  cancels. ``inf`` where the method is unstable, NaN where the reference itself is."""
  reference = quadratic_noise.heavy_ball_excess_loss(lr_lambda, momentum, 1.0)
  if not math.isfinite(reference):
    return math.nan
  return quadratic_noise.predicted_gap(method, delay, momentum, lr_lambda, 1.0) / reference


def form_of(record: RunRecord) -> str | None:
  """The run's base update as the quadratic reads it, from its plan
  (:attr:`~pipejax.study.records.RunRecord.plan_facts`): ``'ema'`` for Adam, ``'heavy_ball'``
  for SGD (:class:`pipejax.optim.Recipe`'s ``form``); None when it has no plan."""
  facts = record.plan_facts
  return None if facts is None else facts.update_form


def rate_fraction(reading: dict) -> float | None:
  """The rate the run's schedule had reached at the reading's weights, over the peak rate it was
  read for (``learning_rate_now / learning_rate``); None where the reading recorded neither."""
  now, peak = reading.get("learning_rate_now"), reading.get("learning_rate")
  if not (is_number(now) and is_number(peak)) or peak <= 0:
    return None
  return float(now) / float(peak)


def stem_reading(curvature: Sequence[dict], num_stages: int) -> dict | None:
  """The study's curvature reading of the stem (stage 0, the delay ``D_max``) at ``num_stages``
  that the run's step meets hardest: the largest ``λ`` times the rate the schedule had reached at
  those weights (:func:`rate_fraction`). The step is that rate times that ``λ``, never the peak
  rate times the initial weights' ``λ``: under a warm-up from 0 the initial weights meet no step,
  and by the warm-up's end the stem's ``λ`` has fallen (docs/studies/depth/limits.jsonl: 45.5 at
  the initial weights of 128 stages, 2.5 after 1,250 samples, 0.57 after 3,000). A reading that
  did not record its rate, or met a rate of 0, is left out; None where none is left."""
  readings = [r for r in curvature if r.get("num_stages") == num_stages and r.get("stage") == 0
              and is_number(r.get("sharpness")) and (rate_fraction(r) or 0.0) > 0.0]
  return max(readings, key=lambda r: rate_fraction(r) * r["sharpness"]) if readings else None


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
    at_depth = any(r.get("num_stages") == row.num_stages and r.get("stage") == 0
                   for r in curvature)
    return None, (f"no λ reading at {row.num_stages} stages with a rate above 0: the initial "
                  "weights meet none under a warm-up" if at_depth
                  else f"no λ reading at {row.num_stages} stages")
  if form is None:
    return None, f"its config {row.record.config!r} cannot be read"
  if (reading.get("form") or "heavy_ball") != form:
    return None, "λ read under another optimizer"
  if not is_number(row.learning_rate):
    return None, "no rate recorded"
  fraction = rate_fraction(reading)
  lr_lambda = depth_limits.step_curvature(row.learning_rate * fraction, reading["sharpness"],
                                          row.momentum, form)
  samples = reading.get("samples", 0)
  where = "at the initial weights" if not samples else f"after {samples:,} samples"
  return (relative_gap(row.method, row.max_delay, row.momentum, lr_lambda),
          f"ηλ {lr_lambda:.2g}: the stem's λ {where}, at {fraction:.0%} of the peak rate")


def phase_rows(sources: Sequence[Source]) -> list[Row]:
  """Every study's pipelined cells (:func:`rows_of`) with the quadratic's prediction."""
  rows = []
  for source in sources:
    for row in rows_of(source):
      row.prediction, row.prediction_note = prediction(row, form_of(row.record),
                                                       source.curvature)
      rows.append(row)
  return rows
