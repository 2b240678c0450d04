r"""Stability, first sweep: multipliers a factor of 2 apart, one seed, to place each method's limit.

    python scripts/study.py --study=configs/studies/stability_first_sweep.py \
        --workdir=docs/studies/stability_first_sweep

The sweep that placed the limits around which configs/studies/stability.py centres its sqrt(2)
ladder of three seeds a cell. It predates matched starting weights and counts only non-finite
results as diverged; its report is kept because stability.py is built on it.

The deepest setting of the depth study (configs/deep_mlp.py at 32 stages, delays up to 62,
micro-batch 1, Fashion-MNIST), with the batch-128 reference learning rate 0.1 multiplied by 1, 2,
4, 8, 16, 32, 64 and 256 before the scaling rules convert it to micro-batch 1. Each run trains a
quarter epoch (15000 samples) with the depth study's schedule compressed to it (warm-up over the
first fifth, then cosine): whether a learning rate is stable shows within the first thousands of
samples after the warm-up, and a quarter epoch keeps a run at two to five minutes of one core. A
method "still trains" at a multiplier when no seed diverged and its mean test accuracy is at least
70%; a method that fails at a multiplier is not run at the larger ones (reported as "not run").
docs/study.md sets the result beside the ranking the convex-quadratic analysis predicts
(scripts/quadratic.py).
"""

from pipejax.study import Figure, Study, Table

METHODS = ("sgd", "pb", "pb_sc", "pb_lwp", "pb_sc_lwp", "pipedream", "spectrain", "pipemare",
           "dcasgd")
REFERENCE_LR = 0.1


def get_study(arg: str | None = None) -> Study:
  # Up to 16 as planned, then 64 and 256: at 16 no method had failed yet in the first runs;
  # then 32, because seven methods trained at 16 and failed at 64.
  multipliers = (1, 2, 4, 8, 16, 32, 64, 256)
  config, seeds, methods = "configs/deep_mlp.py", (0,), METHODS
  if arg == "smoke":
    config, multipliers, methods = "configs/deep_mlp.py:smoke", (1, 64), ("sgd", "pb")
  elif arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  return Study(
      name="stability" + (" (smoke)" if arg else ""), config=config,
      grids=[{"reference.lr": tuple(REFERENCE_LR * k for k in multipliers), "method": methods,
              "seed": seeds}] + ([] if arg else [
                  # Two more seeds where plain PB fails and PB + SC + LWP still trains.
                  {"reference.lr": (REFERENCE_LR * 32,), "method": ("pb", "pb_sc_lwp"),
                   "seed": (1, 2)}]),
      fixed={} if arg else {"epochs": 0.25, "warmup_epochs": 0.05},
      min_accuracy=0.7,
      # A method that fails at one learning rate is not run at the larger ones.
      skip_beyond_failure="reference.lr",
      tables=[Table("Test accuracy (%) by reference learning rate", rows="reference.lr",
                    columns="method"),
              Table("Largest reference learning rate that trains", rows="reference.lr",
                    columns="method", kind="stability")],
      figures=[Figure("accuracy_vs_lr.png", x="reference.lr", series="method", log_x=True,
                      x_unit=0.1, threshold=0.7,
                      title="Test accuracy after a quarter epoch, 32 stages (first sweep)",
                      x_label="learning-rate multiplier (x batch-128 lr 0.1)")])
