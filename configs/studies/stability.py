r"""Stability study: the learning-rate multiplier at which each method stops training, bracketed.

    python scripts/study.py --study=configs/studies/stability.py --workdir=docs/studies/stability
    python scripts/study.py --study=configs/studies/stability.py:smoke --workdir=/tmp/stab_smoke

configs/deep_mlp.py at 32 stages (delays up to 62), micro-batch 1, with the batch-128 reference
learning rate 0.1 multiplied before the scaling rules convert it to micro-batch 1. Each run
trains a quarter epoch (15000 samples) with the depth study's schedule compressed to it (warm-up
over the first fifth, then cosine; PipeMare's annealing over the first quarter of the run, the
same fraction whatever the run's length).

Multipliers are spaced by sqrt(2), five of them centred on each method's limit as a first sweep at
factors of 2 placed it (SGD and PB + SC + LWP x32, PB, PB + SC, PB + LWP, SpecTrain and PipeMare
x16, PipeDream and DC-ASGD x8), three seeds per cell. A run diverged when its numbers are not
finite or its final test loss is above its initial loss; a cell trains when no seed diverged and
its mean test accuracy is at least 70%, and a method's limit is reported as the interval between
its largest multiplier that trains and the next that fails. A seed that fails at a multiplier is
not run at the larger ones (reported as "not run").
"""

import math

from pipejax.study import Figure, Study, Table

REFERENCE_LR = 0.1
# The limit of each method at factors of 2 (one seed), around which the sqrt(2) ladder is centred.
FIRST_LIMITS = {"sgd": 32, "pb": 16, "pb_sc": 16, "pb_lwp": 16, "pb_sc_lwp": 32,
                "pipedream": 8, "spectrain": 16, "pipemare": 16, "dcasgd": 8}


def ladder(limit: float) -> tuple[float, ...]:
  """Five multipliers spaced by sqrt(2), from limit / 2 to limit * 2."""
  return tuple(round(limit * math.sqrt(2) ** k, 4) for k in range(-2, 3))


def get_study(arg: str | None = None) -> Study:
  config, seeds, limits = "configs/deep_mlp.py", (0, 1, 2), FIRST_LIMITS
  fixed = {"epochs": 0.25, "warmup_epochs": 0.05,
           "method_kwargs.pipemare.anneal_fraction": 0.25}
  if arg == "smoke":
    config, seeds, limits, fixed = "configs/deep_mlp.py:smoke", (0,), {"sgd": 64, "pb": 64}, {}
  elif arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  grids = [{"reference.lr": tuple(round(REFERENCE_LR * m, 6) for m in ladder(limit)),
            "method": (method,), "seed": seeds} for method, limit in limits.items()]
  return Study(
      name="stability" + (" (smoke)" if arg else ""), config=config, grids=grids, fixed=fixed,
      min_accuracy=0.7,
      # A seed that fails at one learning rate is not run at the larger ones.
      skip_beyond_failure="reference.lr",
      tables=[Table("Test accuracy (%) by reference learning rate", rows="reference.lr",
                    columns="method"),
              Table("Where each method stops training (reference learning rate)",
                    rows="reference.lr", columns="method", kind="stability")],
      figures=[Figure("accuracy_vs_lr.png", x="reference.lr", series="method", log_x=True,
                      x_unit=REFERENCE_LR, threshold=0.7,
                      title="Test accuracy after a quarter epoch, 32 stages",
                      x_label="learning-rate multiplier (x batch-128 lr 0.1)")])
