"""Where the convex quadratic says each method breaks, on a trained network's own curvature.

The quadratic's stability edge is in units of ``ηλ``; a network has no one ``λ``. Each stage's
update sees the curvature of its own block of the Hessian (:mod:`pipejax.analysis.sharpness`)
through its own delay ``D_s``, so the quadratic makes one prediction a stage: stage ``s`` is
stable under a method when ``ρ(method, η λ_s, m, D_s) < 1``, and its limit is the largest delay
still stable at ``η λ_s`` (:func:`pipejax.analysis.quadratic.largest_stable_delay`; PipeMare's,
whose step shrinks with the delay, :func:`pipemare_limit`). A pipeline whose stages all pass is
predicted to train; the first stage (the longest delay) usually decides.

:func:`measure` reads the curvature where a study's run was (its initial weights and its
checkpoints) and writes one record a (weights, stage), with the predictions at the run's peak
learning rate and momentum. ``scripts/depth_limits.py`` is its command line.
:func:`report_section` sets the records beside a study's runs, with :func:`verdicts`.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Iterable, Iterator, Sequence

import jax
import numpy as np

from pipejax.analysis import quadratic
from pipejax.analysis import sharpness
from pipejax import methods as methods_lib
from pipejax.methods import DISPLAY_NAMES
from pipejax.study import statistics
from pipejax.study.records import RunRecord, diverged as is_diverged
from pipejax.train import experiment
from pipejax.train import plan as plan_lib
from pipejax.train.checkpoint import Checkpointer

# The pipelined methods the quadratic models. PipeMare's limit is :func:`pipemare_limit`'s: its
# step is η/D at the start of its annealing, so its stable delays need not be an interval.
LIMIT_METHODS = quadratic.PIPELINE_METHODS
AT_DELAY_METHODS = LIMIT_METHODS
# PipeMare: the modelled method whose step falls with the delay.
RESCHEDULED = next(m for m in LIMIT_METHODS if methods_lib.preset_of(m).quadratic.rate_over_delay)


def sampled_stages(num_stages: int) -> list[int]:
  """The stem, the first block, evenly spread blocks and the head: where a deep pipeline's delays
  go from their longest, ``2(S - 1)``, to zero."""
  s = num_stages
  return sorted({0, 1, s // 8, s // 4, s // 2, (3 * s) // 4, s - 2, s - 1} & set(range(s)))


def step_curvature(learning_rate: float, curvature: float, momentum: float,
                   form: str = "heavy_ball") -> float:
  """The quadratic's ``x = η λ`` for a stage whose update meets ``curvature``.

  Heavy ball (``v ← m v + g``, ``w ← w − η v``) is the quadratic's own convention: ``η λ``. The
  EMA form of Adam's first moment (``v ← b1 v + (1 − b1) g``) is heavy ball with the rate
  ``η (1 − b1)`` and momentum ``b1``, and Adam divides the step by ``√ν̂ + ε`` coordinate by
  coordinate, so its ``λ`` is the curvature of ``P⁻¹ H`` with ``P = √ν̂ + ε``
  (:func:`pipejax.analysis.sharpness.adam_preconditioner`): ``x = η (1 − b1) λ(P⁻¹ H)``. With
  ``ν̂`` held (it moves over ``1 / (1 − b2)`` steps), Adam on a quadratic is that linear
  recurrence, so the quadratic's limits hold for it at this ``x`` and momentum ``b1``.

  Args:
    learning_rate: ``η``.
    curvature: ``λ``: the Hessian's (heavy ball) or the preconditioned one's (Adam).
    momentum: ``m``, or Adam's ``b1``.
    form: ``'heavy_ball'`` or ``'ema'`` (:class:`pipejax.optim.Recipe`'s ``form``).
  """
  if form not in ("heavy_ball", "ema"):
    raise ValueError(f"form must be 'heavy_ball' or 'ema' (a Recipe's form), got {form!r}.")
  return learning_rate * curvature * ((1.0 - momentum) if form == "ema" else 1.0)


def stable_at(lr_sharpness: float, momentum: float, delay: int) -> dict:
  """Per method, whether ``η λ`` is stable at ``delay`` (one eigensolve each)."""
  if not (math.isfinite(lr_sharpness) and lr_sharpness > 0):
    return {m: True for m in AT_DELAY_METHODS}
  return {m: quadratic.spectral_radius(m, lr_sharpness, momentum, delay) < 1.0
          for m in AT_DELAY_METHODS}


def pipemare_limit(lr_sharpness: float, momentum: float, max_delay: int) -> int | None:
  """PipeMare's largest stable delay at base ``η λ``: the longest ``D ≤ max_delay`` with every
  delay up to it stable; None when all are, -1 when not even no delay is.

  PipeMare at delay ``D`` is PB at ``η λ / D`` (docs/quadratic.md), so its largest stable base
  ``η λ`` at ``D`` is ``D`` times PB's. At ``D = 1`` that is exactly ``1 − m`` (the roots of
  ``z² − (1 + m) z + m + η λ``), at ``D = 0`` heavy ball's ``2 (1 + m)``, and it grows with ``D``
  (checked on a grid in the tests; ``D`` times PB's edge tends to ``π/2 (1 − m)``). A base ``η λ``
  below ``1 − m`` is therefore stable at every delay, with no eigensolve; from ``1 − m`` on, the
  delays are asked in turn from 0, and ``D = 1`` is already unstable.
  """
  if lr_sharpness < 1.0 - momentum:
    return None
  for delay in range(max_delay + 1):
    radius = quadratic.spectral_radius(RESCHEDULED, lr_sharpness, momentum, delay)
    if radius >= 1.0:
      return delay - 1
  return None


def limits_at(lr_sharpness: float, momentum: float, max_delay: int) -> dict:
  """Per method, the largest stable delay at ``η λ``: None when ``max_delay`` is stable too, -1
  when not even no delay is. Costs ``O(D³)`` eigensolves up to the limit, so :func:`measure`
  asks it only of the stages that decide (the stem and the sharpest block)."""
  if not (math.isfinite(lr_sharpness) and lr_sharpness > 0):
    return {m: None for m in LIMIT_METHODS}
  rules = {RESCHEDULED: pipemare_limit}  # its stable delays need not be an interval
  return {m: rules.get(m, functools.partial(quadratic.largest_stable_delay, m))(
      lr_sharpness, momentum, max_delay) for m in LIMIT_METHODS}


def limit_bound(num_stages: int) -> int:
  """How far :func:`measure` looks for a limit: twice the pipeline's longest delay (the stem's,
  2(S − 1))."""
  return max(4 * (num_stages - 1), 16)


def _batch(setup, size: int, seed: int):
  source = setup.train_source
  indices = np.random.default_rng(seed).choice(len(source), min(size, len(source)),
                                               replace=False)
  images, labels = source.take(np.sort(indices))
  return source.normalization(images), labels


def _weights_at(setup, initial_state, checkpoints: Checkpointer | None, samples: int):
  """Every stage's params after ``samples`` samples: the initial state's at 0, else the run's
  checkpoint saved at that many samples."""
  state = setup.runner.to_logical(initial_state)  # checkpoints hold the logical state
  if samples:
    state, _ = checkpoints.restore(samples, state)
  return [st.params for st in state.stages]


def _norm(tree) -> float:
  """The Euclidean norm of every weight of a stage together (what a curvature is read beside)."""
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(a, np.float64)))
                           for a in jax.tree.leaves(tree))))


def measure(plan: plan_lib.RunPlan, run_dir: str | None = None,
            at_samples: Iterable[int] = (0,), stages: Sequence[int] | None = None,
            batch: int = 512, iterations: int = 30) -> Iterator[dict]:
  """One record a (point of ``at_samples``, stage of ``stages``), yielded as each point is done.

  Args:
    plan: The run's plan (:func:`pipejax.train.plan.resolve`: its model, data, recipe and
      seed).
    run_dir: The run's workdir, whose checkpoints give the weights after training; None: only
      the initial weights (``at_samples`` = (0,)).
    at_samples: Where to read the curvature: 0 is the initial weights, else a checkpoint's
      samples.
    stages: Which stages; default :func:`sampled_stages`.
    batch: Training examples in the loss whose Hessian is read.
    iterations: Power-iteration products a stage.

  An Adam run (its recipe's EMA form) is read as :func:`step_curvature` says: ``sharpness`` is
  that of ``P⁻¹ H`` with Adam's divisor ``P = √ν̂ + ε`` estimated at the same weights from the
  squared gradients of ``batch / micro_batch_size`` steps' batches, ``momentum`` is ``b1`` and
  ``lr_sharpness`` is ``η (1 − b1) λ``.

  Yields:
    Records with the keys ``num_stages, samples, stage, delay, sharpness, weight_norm`` (the
    stage's weights' Euclidean norm), ``learning_rate`` (the schedule's peak), ``momentum,
    lr_sharpness`` (at the peak, :func:`step_curvature`), ``form`` (the recipe's),
    ``stable_at_delay`` (per method, at the peak), ``largest_stable_delay`` (per method, at the
    peak, up to twice the pipeline's longest delay; empty but for the stem and the sharpest
    block), and the schedule's rate after ``samples`` with the stability there:
    ``learning_rate_now, stable_at_delay_now``.
  """
  at_samples = [int(v) for v in at_samples]
  checkpoints = (Checkpointer(f"{run_dir}/checkpoints", primary=False) if run_dir else None)
  saved = checkpoints.all_samples() if checkpoints is not None else []
  missing = [v for v in at_samples if v and v not in saved]
  if missing:  # before the build, which takes minutes at depth
    raise ValueError(f"No checkpoint at {missing[0]} samples"
                     f"{'' if checkpoints is None else ' in ' + checkpoints.directory}; "
                     f"saved: {saved}.")
  setup = experiment.build(plan)
  model, pipe = setup.model, setup.pipeline
  stages = sampled_stages(model.num_stages) if stages is None else list(stages)
  initial = setup.init(jax.random.PRNGKey(plan.seed))
  x, y = _batch(setup, batch, plan.seed)
  eta, momentum = float(setup.recipe.learning_rate), float(setup.recipe.momentum)
  form = setup.recipe.form
  schedule = experiment.learning_rate_schedule(plan, len(setup.train_source))
  x_of = lambda rate, value: step_curvature(rate, float(value), momentum, form)

  def loss(params):
    return model.loss(model.apply(params, x), y)[0]

  def batch_loss(params, xb, yb):
    return model.loss(model.apply(params, xb), yb)[0]

  b = plan.micro_batch_size
  steps = [(x[i:i + b], y[i:i + b]) for i in range(0, len(x) - b + 1, b)]
  for samples in at_samples:
    params = _weights_at(setup, initial, checkpoints, samples)
    preconditioner = (sharpness.adam_preconditioner(batch_loss, params, steps)
                      if form == "ema" else None)
    values = sharpness.stage_sharpness(loss, params, stages, jax.random.PRNGKey(samples),
                                       iterations, preconditioner=preconditioner)
    eta_now = float(schedule(int(samples) // setup.recipe.batch_size))
    blocks = [i for i, s in enumerate(stages) if 0 < s < model.num_stages - 1]
    deciding = {0, max(blocks, key=lambda i: values[i])} if blocks else {0}
    for i, (s, value) in enumerate(zip(stages, values)):
      delay = int(pipe.delays[s])
      yield {"num_stages": model.num_stages, "samples": int(samples), "stage": s,
             "delay": delay, "sharpness": float(value), "weight_norm": _norm(params[s]),
             "learning_rate": eta, "form": form,
             "momentum": momentum, "lr_sharpness": x_of(eta, value),
             "stable_at_delay": stable_at(x_of(eta, value), momentum, delay),
             "largest_stable_delay": (limits_at(x_of(eta, value), momentum,
                                                limit_bound(model.num_stages))
                                      if i in deciding else {}),
             "learning_rate_now": eta_now,
             "stable_at_delay_now": stable_at(x_of(eta_now, value), momentum, delay)}
  if checkpoints is not None:
    checkpoints.close()


def read_records(path: str) -> list[dict]:
  """The records of a ``scripts/depth_limits.py --output`` file; [] when there is none."""
  try:
    with open(path) as f:
      return [json.loads(line) for line in f if line.strip()]
  except FileNotFoundError:
    return []


def _limit_text(record: dict, method: str, num_stages: int) -> str:
  limits = record.get("largest_stable_delay", {})
  if method not in limits:
    return "not computed"
  limit = limits[method]
  if limit is None:
    return f"none ≤ {limit_bound(num_stages)}"
  return "unstable at 0" if limit < 0 else str(limit)


def _runs_of(study_records: Sequence[RunRecord], method: str, depth: int) -> dict:
  """The momentum-SGD runs of ``method`` at ``depth`` that finished or diverged, by seed."""
  return {r.overrides.get("seed"): r for r in study_records
          if r.overrides.get("method") == method
          and r.overrides.get("model_kwargs.depth") == depth
          and r.overrides.get("optimizer") is None
          and r.overrides.get("diagnostics") is None and r.trained}


def _paired_gaps(study_records: Sequence[RunRecord], method: str, depth: int) -> list[float]:
  """The gap to SGD in points of every seed where both finished."""
  runs = _runs_of(study_records, method, depth)
  baseline = _runs_of(study_records, methods_lib.ONE_STAGE_REFERENCE, depth)
  return [100 * (r.test_accuracy - baseline[seed].test_accuracy)
          for seed, r in runs.items()
          if r.finished and seed in baseline and baseline[seed].finished]


def _outcomes(study_records: Sequence[RunRecord], method: str, depth: int) -> str:
  """What the study measured for ``method`` at ``depth`` (momentum SGD runs): the mean gap to
  SGD in points over the seeds both finished, with their count, and the diverged runs; '—' when
  none ran."""
  runs = _runs_of(study_records, method, depth)
  if not runs:
    return "—"
  gaps = _paired_gaps(study_records, method, depth)
  diverged = sum(is_diverged(r) for r in runs.values())
  parts = [f"{sum(gaps) / len(gaps):+.1f} pts (n={len(gaps)})".replace("-", "−")] if gaps else []
  if diverged:
    parts.append(f"div. {diverged}/{len(runs)}")
  return ", ".join(parts) or f"trained ({len(runs)}), no SGD pair yet"


def _weights_label(depth: int, samples: int, method: str) -> str:
  return "initial" if samples == 0 else f"{method} after {samples:,}"


def _points(limit_records: Sequence[dict]) -> list[tuple]:
  """Per (depth, samples, whose weights), in order: the stem's record, the blocks' (the head
  apart) and every sampled stage's; points with no block are left out."""
  out = []
  for depth, samples, method in sorted({(r["num_stages"], r["samples"], r["method"])
                                        for r in limit_records}):
    rows = [r for r in limit_records
            if (r["num_stages"], r["samples"], r["method"]) == (depth, samples, method)]
    blocks = [r for r in rows if 0 < r["stage"] < depth - 1]
    if blocks:
      out.append((depth, samples, method, next((r for r in rows if r["stage"] == 0), None),
                  blocks, rows))
  return out


def report_section(study_records: Sequence[RunRecord], limit_records: Sequence[dict]) -> str:
  """The depth report's comparison: per depth and weights, each method's largest stable delay on
  the sharpest sampled block (the stem apart) against the longest block delay, beside what the
  study measured; then :func:`verdicts`."""
  if not limit_records:
    return ("No curvature measured yet: run `scripts/depth_limits.py` (its docstring) with "
            "`--output=` this study's `limits.jsonl`.")
  header = ("| stages | weights | λ stem (delay) | λ blocks, sampled | longest block delay | "
            + " | ".join(f"{m}: limit · measured" for m in LIMIT_METHODS) + " |")
  lines = [header, "|" + "---|" * (5 + len(LIMIT_METHODS))]
  for depth, samples, method, stem, blocks, _ in _points(limit_records):
    sharpest = max(blocks, key=lambda r: r["lr_sharpness"])
    longest = max(r["delay"] for r in blocks)
    cells = [f"{_limit_text(sharpest, m, depth)} · {_outcomes(study_records, m, depth)}"
             for m in LIMIT_METHODS]
    stem_text = f"{stem['sharpness']:.1f} ({stem['delay']})" if stem else "—"
    lines.append(f"| {depth} | {_weights_label(depth, samples, method)} | {stem_text} | "
                 f"{min(r['sharpness'] for r in blocks):.1f}–{sharpest['sharpness']:.1f} | "
                 f"{longest} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n\n" + verdicts(study_records, limit_records)


def _points_text(value: float) -> str:
  return f"{value:+.2f}".replace("-", "−")


def measured_text(study_records: Sequence[RunRecord], method: str, depth: int) -> str:
  """The study's outcome for ``method`` at ``depth`` in words: how many runs diverged, where and
  when (from the records' ``divergence``, the trainer's own report), and the paired gap to SGD
  with its 95% CI."""
  runs = _runs_of(study_records, method, depth)
  diverged = [r for r in runs.values() if is_diverged(r)]
  parts = []
  if diverged:
    points = [r.divergence for r in diverged if r.divergence]
    text = f"diverged {len(diverged)} of {len(runs)}"
    if points:
      samples = sorted(p["samples"] for p in points)
      stages = sorted({s for p in points for s in p["stages"]})
      text += (f" (first non-finite value at {samples[0]:,}–{samples[-1]:,} samples"
               if len(samples) > 1 else f" (first non-finite value at {samples[0]:,} samples")
      text += ", in stage" + ("s " if len(stages) > 1 else " ") + ", ".join(map(str, stages))
      text += ")" if len(points) == len(diverged) else \
          f"; {len(diverged) - len(points)} without a recorded point)"
    else:
      text += " (the records name no sample or stage)"
    parts.append(text)
  gaps = _paired_gaps(study_records, method, depth)
  if gaps:
    gap = statistics.paired(gaps)
    ci = (f" [{_points_text(gap.low)}, {_points_text(gap.high)}]"
          if math.isfinite(gap.low) else "")
    parts.append(f"trained {len(runs) - len(diverged)} of {len(runs)}, gap to SGD "
                 f"{_points_text(gap.mean)}{ci} points (n = {gap.n})")
  return "; ".join(parts)


def _prediction(method: str, depth: int, stem: dict | None, blocks: list, rows: list
                ) -> tuple[bool | None, str]:
  """Whether the quadratic says ``method`` breaks at one point (a sampled stage unstable at its
  own delay at the peak step; None when no record says), and the limits behind it."""
  sharpest = max(blocks, key=lambda r: r["lr_sharpness"])
  longest = max(r["delay"] for r in blocks)
  text = f"limit {_limit_text(sharpest, method, depth)} on the sharpest block against {longest}"
  if stem is not None and method in stem.get("largest_stable_delay", {}):
    text += f", {_limit_text(stem, method, depth)} on the stem against {stem['delay']}"
  flags = [r["stable_at_delay"][method] for r in rows
           if method in r.get("stable_at_delay", {})]
  if not flags:
    return None, text
  unstable = [r["stage"] for r in rows if not r.get("stable_at_delay", {}).get(method, True)]
  if not unstable:
    return False, text + ": no break (every sampled stage stable at its own delay)"
  blocks_named = [str(s) for s in unstable if s]
  named = " and ".join((["the stem"] if 0 in unstable else []) + (
      [("stages " if len(blocks_named) > 1 else "stage ") + ", ".join(blocks_named)]
      if blocks_named else []))
  own = "its own delay" if len(unstable) == 1 else "their own delays"
  return True, text + f": a break ({named} unstable at {own})"


def _agreement(breaks: bool | None, runs: int, diverged: int) -> str:
  if breaks is None or not runs:
    return "not judged"
  if breaks:
    return ("agrees" if diverged == runs else
            "disagrees: no run diverged" if not diverged else
            f"partly: {diverged} of {runs} diverged")
  return ("agrees: no run diverged" if not diverged else
          "disagrees: every run diverged" if diverged == runs else
          f"disagrees for {diverged} of {runs} runs")


def verdicts(study_records: Sequence[RunRecord], limit_records: Sequence[dict]) -> str:
  """Per method and depth, the quadratic's verdict at each point where the curvature was read
  (the peak step, every sampled stage at its own delay) against the study's outcome there: agrees
  when it predicts a break and every run diverged, or no break and none did."""
  points = _points(limit_records)
  lines = ["Per method, at each depth with curvature records: what the study measured, then at "
           "each reading of the curvature the quadratic's limits, its prediction and whether the "
           "outcome agrees. A prediction is a break when a sampled stage is unstable at its own "
           "delay at the peak step; it agrees when then every run diverged, or when no stage is "
           "unstable and no run diverged. A reading taken after every run of the method had "
           "diverged is marked: it comes too late to judge them."]
  for method in LIMIT_METHODS:
    depths = sorted({p[0] for p in points if _runs_of(study_records, method, p[0])})
    if not depths:
      continue
    lines += ["", f"- **{DISPLAY_NAMES.get(method, method)}**"]
    for depth in depths:
      runs = _runs_of(study_records, method, depth)
      diverged = [r for r in runs.values() if is_diverged(r)]
      broke_by = max((r.divergence["samples"] for r in diverged if r.divergence),
                     default=None) if len(diverged) == len(runs) else None
      readings = []
      for d, samples, whose, stem, blocks, rows in points:
        if d != depth:
          continue
        breaks, text = _prediction(method, depth, stem, blocks, rows)
        verdict = (f"too late to judge: every run had diverged by {broke_by:,} samples"
                   if broke_by is not None and samples > broke_by else
                   _agreement(breaks, len(runs), len(diverged)))
        readings.append(f"{_weights_label(depth, samples, whose)}: {text}; {verdict}")
      lines.append(f"  - {depth} stages, measured: {measured_text(study_records, method, depth)}.")
      lines += [f"    - {r}." for r in readings]
  return "\n".join(lines)
