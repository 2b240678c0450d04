"""Where the convex quadratic says each method breaks, on a trained network's own curvature.

The quadratic's stability edge is in units of ``ηλ``; a network has no one ``λ``. Each stage's
update sees the curvature of its own block of the Hessian (:mod:`pipejax.analysis.sharpness`)
through its own delay ``D_s``, so the quadratic makes one prediction a stage: stage ``s`` is
stable under a method when ``ρ(method, η λ_s, m, D_s) < 1``, and its limit is the largest delay
still stable at ``η λ_s`` (:func:`pipejax.analysis.quadratic.largest_stable_delay`). A pipeline
whose stages all pass is predicted to train; the first stage (the longest delay) usually decides.

:func:`measure` reads the curvature where a study's run was (its initial weights and its
checkpoints) and writes one record a (weights, stage), with the predictions at the run's peak
learning rate and momentum. ``scripts/depth_limits.py`` is its command line.
"""

from __future__ import annotations

import json
import math
from typing import Iterable, Iterator, Sequence

import jax
import numpy as np

from pipejax.analysis import quadratic
from pipejax.analysis import sharpness
from pipejax.train import experiment
from pipejax.train.checkpoint import Checkpointer

# The methods the quadratic models with a step that does not shrink with the delay; PipeMare is
# judged at its stage's delay only (its step is η/D at the start of its annealing).
LIMIT_METHODS = ("pb", "pb_sc", "pb_lwp", "pb_sc_lwp", "spectrain")
AT_DELAY_METHODS = LIMIT_METHODS + ("pipemare",)


def sampled_stages(num_stages: int) -> list[int]:
  """The stem, the first block, evenly spread blocks and the head: where a deep pipeline's delays
  go from their longest, ``2(S - 1)``, to zero."""
  s = num_stages
  return sorted({0, 1, s // 8, s // 4, s // 2, (3 * s) // 4, s - 2, s - 1} & set(range(s)))


def stable_at(lr_sharpness: float, momentum: float, delay: int) -> dict:
  """Per method, whether ``η λ`` is stable at ``delay`` (one eigensolve each)."""
  if not (math.isfinite(lr_sharpness) and lr_sharpness > 0):
    return {m: True for m in AT_DELAY_METHODS}
  return {m: quadratic.spectral_radius(m, lr_sharpness, momentum, delay) < 1.0
          for m in AT_DELAY_METHODS}


def limits_at(lr_sharpness: float, momentum: float, max_delay: int) -> dict:
  """Per method, the largest stable delay at ``η λ``: None when ``max_delay`` is stable too, -1
  when not even no delay is. Costs ``O(D³)`` eigensolves up to the limit, so :func:`measure`
  asks it only of the stages that decide (the stem and the sharpest block)."""
  if not (math.isfinite(lr_sharpness) and lr_sharpness > 0):
    return {m: None for m in LIMIT_METHODS}
  return {m: quadratic.largest_stable_delay(m, lr_sharpness, momentum, max_delay)
          for m in LIMIT_METHODS}


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


def measure(config, run_dir: str | None = None, at_samples: Iterable[int] = (0,),
            stages: Sequence[int] | None = None, batch: int = 512, iterations: int = 30
            ) -> Iterator[dict]:
  """One record a (point of ``at_samples``, stage of ``stages``), yielded as each point is done.

  Args:
    config: The run's training config (its model, data, recipe and seed).
    run_dir: The run's workdir, whose checkpoints give the weights after training; None: only
      the initial weights (``at_samples`` = (0,)).
    at_samples: Where to read the curvature: 0 is the initial weights, else a checkpoint's step.
    stages: Which stages; default :func:`sampled_stages`.
    batch: Training examples in the loss whose Hessian is read.
    iterations: Power-iteration products a stage.

  Yields:
    Records with the keys ``num_stages, samples, stage, delay, sharpness, weight_norm`` (the
    stage's weights' Euclidean norm), ``learning_rate`` (the schedule's peak), ``momentum,
    lr_sharpness`` (at the peak), ``stable_at_delay`` (per method, at the peak),
    ``largest_stable_delay`` (per method, at the peak, up to twice the pipeline's
    longest delay; empty but for the stem and the sharpest block), and the schedule's rate after
    ``samples`` with the stability there: ``learning_rate_now, stable_at_delay_now``.
  """
  at_samples = [int(v) for v in at_samples]
  checkpoints = (Checkpointer(f"{run_dir}/checkpoints", primary=False) if run_dir else None)
  saved = checkpoints.all_steps() if checkpoints is not None else []
  missing = [v for v in at_samples if v and v not in saved]
  if missing:  # before the build, which takes minutes at depth
    raise ValueError(f"No checkpoint at {missing[0]} samples"
                     f"{'' if checkpoints is None else ' in ' + checkpoints.directory}; "
                     f"saved: {saved}.")
  setup = experiment.build(config)
  model, pipe = setup.model, setup.pipeline
  stages = sampled_stages(model.num_stages) if stages is None else list(stages)
  initial = setup.init(jax.random.PRNGKey(config.seed))
  x, y = _batch(setup, batch, config.seed)
  eta, momentum = float(setup.recipe.learning_rate), float(setup.recipe.momentum)
  schedule = experiment.learning_rate_schedule(config, setup.recipe, len(setup.train_source))

  def loss(params):
    return model.loss(model.apply(params, x), y)[0]

  for samples in at_samples:
    params = _weights_at(setup, initial, checkpoints, samples)
    values = sharpness.stage_sharpness(loss, params, stages, jax.random.PRNGKey(samples),
                                       iterations)
    eta_now = float(schedule(int(samples) // setup.recipe.batch_size))
    blocks = [i for i, s in enumerate(stages) if 0 < s < model.num_stages - 1]
    deciding = {0, max(blocks, key=lambda i: values[i])} if blocks else {0}
    longest = max(int(d) for d in pipe.delays)
    for i, (s, value) in enumerate(zip(stages, values)):
      delay = int(pipe.delays[s])
      yield {"num_stages": model.num_stages, "samples": int(samples), "stage": s,
             "delay": delay, "sharpness": float(value), "weight_norm": _norm(params[s]),
             "learning_rate": eta,
             "momentum": momentum, "lr_sharpness": eta * float(value),
             "stable_at_delay": stable_at(eta * float(value), momentum, delay),
             "largest_stable_delay": (limits_at(eta * float(value), momentum,
                                                max(2 * longest, 16)) if i in deciding else {}),
             "learning_rate_now": eta_now,
             "stable_at_delay_now": stable_at(eta_now * float(value), momentum, delay)}
  if checkpoints is not None:
    checkpoints.close()


def read_records(path: str) -> list[dict]:
  """The records of a ``scripts/depth_limits.py --output`` file; [] when there is none."""
  try:
    with open(path) as f:
      return [json.loads(line) for line in f if line.strip()]
  except FileNotFoundError:
    return []


def _limit_text(limit) -> str:
  return "none ≤ 1024" if limit is None else ("unstable at 0" if limit < 0 else str(limit))


def _outcomes(study_records: Sequence[dict], method: str, depth: int) -> str:
  """What the study measured for ``method`` at ``depth`` (momentum SGD runs): the mean gap to
  SGD in points over the seeds both finished, with their count, and the diverged runs; '—' when
  none ran."""
  def runs_of(name):
    return {r["overrides"].get("seed"): r for r in study_records
            if r["overrides"].get("method") == name
            and r["overrides"].get("model_kwargs.depth") == depth
            and r["overrides"].get("optimizer") is None
            and r["overrides"].get("diagnostics") is None
            and r["status"] in ("finished", "diverged")}
  runs, baseline = runs_of(method), runs_of("sgd")
  if not runs:
    return "—"
  gaps = [100 * (r["test_accuracy"] - baseline[seed]["test_accuracy"])
          for seed, r in runs.items() if r["status"] == "finished"
          and seed in baseline and baseline[seed]["status"] == "finished"]
  diverged = sum(r["status"] == "diverged" for r in runs.values())
  parts = [f"{sum(gaps) / len(gaps):+.1f} pts (n={len(gaps)})".replace("-", "−")] if gaps else []
  if diverged:
    parts.append(f"div. {diverged}/{len(runs)}")
  return ", ".join(parts) or f"trained ({len(runs)}), no SGD pair yet"


def report_section(study_records: Sequence[dict], limit_records: Sequence[dict]) -> str:
  """The depth report's comparison: per depth and weights, each method's largest stable delay on
  the sharpest sampled block (the stem apart) against the longest block delay, beside what the
  study measured."""
  if not limit_records:
    return ("No curvature measured yet: run `scripts/depth_limits.py` (its docstring) with "
            "`--output=` this study's `limits.jsonl`.")
  points = sorted({(r["num_stages"], r["samples"], r["method"]) for r in limit_records})
  header = ("| stages | weights | λ stem (delay) | λ blocks, sampled | longest block delay | "
            + " | ".join(f"{m}: limit · measured" for m in LIMIT_METHODS) + " |")
  lines = [header, "|" + "---|" * (5 + len(LIMIT_METHODS))]
  for depth, samples, method in points:
    rows = [r for r in limit_records if (r["num_stages"], r["samples"], r["method"]) ==
            (depth, samples, method)]
    stem = next((r for r in rows if r["stage"] == 0), None)
    blocks = [r for r in rows if 0 < r["stage"] < depth - 1]
    if not blocks:
      continue
    sharpest = max(blocks, key=lambda r: r["lr_sharpness"])
    longest = max(r["delay"] for r in blocks)
    weights = "initial" if samples == 0 else f"{method} after {samples:,}"
    cells = [f"{_limit_text(sharpest['largest_stable_delay'][m])} · {_outcomes(study_records, m, depth)}"
             for m in LIMIT_METHODS]
    stem_text = f"{stem['sharpness']:.1f} ({stem['delay']})" if stem else "—"
    lines.append(f"| {depth} | {weights} | {stem_text} | "
                 f"{min(r['sharpness'] for r in blocks):.1f}–{sharpest['sharpness']:.1f} | "
                 f"{longest} | " + " | ".join(cells) + " |")
  return "\n".join(lines)
