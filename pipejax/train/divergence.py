"""Divergence: finding the first non-finite value of a chunk, and the paragraph that reports it.

The training loop calls :func:`raise_if_diverged` after every chunk, before anything of the chunk
is written: a run that produced a NaN or an inf stops with :class:`TrainingDiverged`, naming the
stage and the tick, and its checkpoints keep only finite weights.
"""

from __future__ import annotations

import numpy as np

from pipejax import methods
from pipejax.train.checkpoint import Checkpointer
from pipejax.train.plan import RunPlan
from pipejax.core.stages import Model


class TrainingDiverged(RuntimeError):
  """A stage produced a non-finite value; the message names the stage and the tick."""


def first_non_finite(finite: np.ndarray, first_tick: int, model: Model) -> str | None:
  """Where a chunk's first non-finite value appeared, e.g. ``"stage 2 ('dense3') at tick 102"``.

  Args:
    finite: the chunk's ``(ticks, stages)`` flags, True where a stage's tick was finite.
    first_tick: the tick of the chunk's first row.
    model: the model, for the stages' names.

  Returns:
    The stages that were first non-finite and the tick, or None when every flag is True.
  """
  bad = np.argwhere(~finite)
  if not len(bad):
    return None
  tick_offset = bad[:, 0].min()
  stages = sorted(int(s) for t, s in bad if t == tick_offset)
  names = ", ".join(model.stage_label(s) for s in stages)
  return f"{names} at tick {first_tick + int(tick_offset)}"


def raise_if_diverged(plan: RunPlan, model: Model,
                      weights_finite: np.ndarray, finite: np.ndarray, valid: np.ndarray,
                      first_tick: int, samples: int, checkpointer: Checkpointer | None) -> None:
  """Raises :class:`TrainingDiverged` if a chunk saw a non-finite activation or left bad weights.

  Activations flag a NaN within a tick of its birth; the weights are checked too, once per chunk,
  because an inf weight can be written in the chunk's last tick and must never be checkpointed.

  Args:
    plan: the run's plan (its micro-batch size, and its method for the advice).
    model: the model, for the stages' names.
    weights_finite: one flag per stage after the chunk, from the runner
      (:meth:`pipejax.core.runner.Runner.weights_finite`, computed where the state lives).
    finite: the chunk's ``(ticks, stages)`` finite flags.
    valid: the chunk's per-tick flags, True where a tick fed a real sample.
    first_tick: the tick of the chunk's first row.
    samples: the training samples seen before the chunk.
    checkpointer: the run's checkpoints, named in the message as the place a rerun resumes from
      (None: a run that keeps none, such as a benchmark's).

  Raises:
    TrainingDiverged: one paragraph: where, after how many samples, what a rerun does, and what
      to change.
  """
  finite = np.asarray(finite)
  bad_weights = [s for s, ok in enumerate(np.asarray(weights_finite)) if not ok]
  if finite.all() and not bad_weights:
    return
  if not finite.all():
    where = first_non_finite(finite, first_tick, model)
    offset = int(np.argwhere(~finite)[:, 0].min())
  else:
    where = (", ".join(model.stage_label(s) for s in bad_weights)
             + f" (its weights) in ticks {first_tick}..{first_tick + len(finite) - 1}")
    offset = len(finite)
  seen = samples + plan.micro_batch_size * int(np.sum(np.asarray(valid)[:offset]))
  saved = checkpointer.all_samples() if checkpointer is not None else []
  advice = ("Lower the learning rate (--config.reference.lr or --config.micro_batch.lr) or add "
            "warm-up (--config.warmup_epochs)")
  traits = plan.traits
  if not (traits.delay_free or traits.recommended):
    advice += (", or try a method with delay compensation "
               f"(--config.method={methods.RECOMMENDED})")
  raise TrainingDiverged(
      f"Training diverged: {where} produced a non-finite value (NaN or inf), after {seen} "
      "training samples. "
      + (f"The last good checkpoint (at {max(saved)} samples, with finite weights) is kept in "
         f"{checkpointer.directory}; a rerun resumes from it (to resume with other settings, add "
         "--config.allow_changes_on_resume=True). "
         if saved else "No checkpoint had been written yet, so a rerun starts from the "
         "beginning. ")
      + advice + ".")
