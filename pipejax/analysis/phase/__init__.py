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

The package's modules, one job each: :mod:`~pipejax.analysis.phase.studies` reads the studies,
:mod:`~pipejax.analysis.phase.runs` says what each run is, :mod:`~pipejax.analysis.phase.gaps`
takes the gaps, :mod:`~pipejax.analysis.phase.prediction` gives the quadratic's word,
:mod:`~pipejax.analysis.phase.tables` writes the report and :mod:`~pipejax.analysis.phase.figure`
draws the figure; their names are this package's, ``phase.rows_of``.
"""

from pipejax.analysis.phase.studies import (
    MEASUREMENT_ONLY,
    CURVATURE_FILE,
    DEFAULT_STUDIES,
    PhaseError,
    StudyMismatchError,
    Unit,
    unit_of,
    Source,
    study_file_of,
    read_study,
    runs_of_study,
)
from pipejax.analysis.phase.runs import (
    method_of,
    is_baseline,
    is_pipelined,
    network_of,
    training_overrides,
    settings_of,
    usable,
    value_of,
    seed_of,
    settings_text,
)
from pipejax.analysis.phase.gaps import (
    Baseline,
    best_baselines,
    Row,
    gap_of,
    micro_batches_per_update,
    rows_of,
    read_studies,
)
from pipejax.analysis.phase.prediction import (
    relative_gap,
    form_of,
    stem_reading,
    prediction,
    phase_rows,
)
from pipejax.analysis.phase.tables import (
    gap_text,
    prediction_text,
    value_text,
    rows_table,
    baseline_name,
    baselines_table,
    INTRODUCTION,
    report,
)
from pipejax.analysis.phase.figure import (
    draw,
)

__all__ = ["Baseline", "CURVATURE_FILE", "DEFAULT_STUDIES", "INTRODUCTION", "MEASUREMENT_ONLY",
           "PhaseError", "Row", "Source", "StudyMismatchError", "Unit", "baseline_name",
           "baselines_table", "best_baselines", "draw", "form_of", "gap_of", "gap_text",
           "is_baseline", "is_pipelined", "method_of", "micro_batches_per_update", "network_of",
           "phase_rows", "prediction", "prediction_text", "read_studies", "read_study",
           "relative_gap", "report", "rows_of", "rows_table", "runs_of_study", "seed_of",
           "settings_of", "settings_text", "stem_reading", "study_file_of", "training_overrides",
           "unit_of", "usable", "value_of", "value_text"]
