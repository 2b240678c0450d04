r"""Each stage's curvature and the delay the convex quadratic allows it, for the depth study.

    python scripts/depth_limits.py --config=configs/deep_mlp.py \
        --config.model_kwargs.depth=128 --config.method=pb \
        --run_dir=docs/studies/depth/runs/model_kwargs.depth=128,method=pb,seed=0 \
        --at_samples=0,20000,60000 --output=docs/studies/depth/limits.jsonl

Reads the top eigenvalue of each sampled stage's block of the Hessian (mean loss over
``--batch`` training examples) at the run's initial weights (0) and at its checkpoints, and
appends one JSON record a (weights, stage) to ``--output`` with what the quadratic predicts at the
run's peak learning rate: the largest stable delay per method, and whether the stage's own delay
is stable (``pipejax.analysis.depth_limits``). Give the run's own config overrides: the
checkpoints restore into the state they build. Without ``--run_dir`` only the initial weights.
A 128-stage network takes about 10 minutes on one loaded CPU core (the build is most of it).
"""

from __future__ import annotations

import json
import os

from absl import app, flags
from ml_collections import config_flags

from pipejax import cli
from pipejax import config as configlib
from pipejax.analysis import depth_limits
from pipejax.train import plan as plan_lib
from pipejax.train.checkpoint import CheckpointError
from pipejax.train.config_checks import ConfigError

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's training config file.")
_RUN_DIR = flags.DEFINE_string("run_dir", None, "The run's workdir (its checkpoints).")
_AT_SAMPLES = flags.DEFINE_list("at_samples", ["0"], "0: initial weights; else checkpoint steps.")
_STAGES = flags.DEFINE_list("stages", None, "Stages to measure; default: the stem, the first "
                            "block, blocks spread evenly and the head.")
_BATCH = flags.DEFINE_integer("batch", 512, "Training examples in the loss.", lower_bound=1)
_ITERATIONS = flags.DEFINE_integer("iterations", 30, "Power-iteration products a stage.",
                                   lower_bound=2)
_OUTPUT = flags.DEFINE_string("output", None, "JSONL file the records are appended to.")


def _check_run_dir(plan: plan_lib.RunPlan, run_dir: str) -> None:
  path = os.path.join(run_dir, "config.json")
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise app.UsageError(f"--run_dir={run_dir} has no readable config.json ({e}); give a "
                         "training run's workdir.") from None
  for key in ("model", "method", "seed", "model_kwargs"):
    if saved.get(key) != plan.given.get(key):
      raise app.UsageError(f"--run_dir={run_dir} trained {key}={saved.get(key)!r} but the config "
                           f"here says {plan.given.get(key)!r}: give the run's own overrides, or "
                           "its checkpoints cannot be restored.")


def main(argv):
  del argv
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/deep_mlp.py.")
  if _OUTPUT.value is not None:
    cli.check_output("output", _OUTPUT.value)
  try:
    samples = [int(v) for v in _AT_SAMPLES.value]
  except ValueError:
    raise app.UsageError(f"--at_samples takes integers, got {_AT_SAMPLES.value}.") from None
  if any(samples) and not _RUN_DIR.value:
    raise app.UsageError("--at_samples other than 0 needs --run_dir (the checkpoints).")
  try:
    stages = None if _STAGES.value is None else [int(v) for v in _STAGES.value]
  except ValueError:
    raise app.UsageError(f"--stages takes integers, got {_STAGES.value}.") from None
  try:
    plan = plan_lib.resolve(config, configlib.overridden_keys())
  except ConfigError as e:
    raise app.UsageError(str(e)) from None
  if _RUN_DIR.value:
    _check_run_dir(plan, _RUN_DIR.value)
  try:
    for r in depth_limits.measure(plan, _RUN_DIR.value, samples, stages=stages,
                                  batch=_BATCH.value, iterations=_ITERATIONS.value):
      _write(r, plan)
  except (ValueError, CheckpointError) as e:  # a missing or unreadable checkpoint
    raise app.UsageError(str(e)) from None


def _write(r: dict, plan: plan_lib.RunPlan) -> None:
  r.update(method=plan.method, seed=plan.seed)
  line = json.dumps(r)
  print(line)
  if _OUTPUT.value:
    with open(_OUTPUT.value, "a") as f:
      f.write(line + "\n")


if __name__ == "__main__":
  cli.run(main, flags_parser=configlib.parse_flags)
