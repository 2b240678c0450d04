r"""Tuned baselines: SGD, PB and PB + SC + LWP each at learning-rate multipliers x1/8 to x2.

    python scripts/study.py --study=configs/studies/tuning.py --workdir=docs/studies/tuning
    python scripts/study.py --study=configs/studies/tuning.py:smoke --workdir=/tmp/tuning_smoke

The depth study runs every method at the one batch-128 recipe lr 0.1 (converted to micro-batch 1).
If SGD's own step is too large there, a method that shrinks the effective step could end above
SGD without removing any staleness. So this study runs configs/deep_mlp.py at 32 stages, one
epoch, with the reference lr at x1/8, x1/4, x1/2, x1 and x2 for each of the three, three seeds
each (starting weights shared per seed), and compares each method at its own best multiplier as
well as at x1. x1/8 is there so that a best multiplier at x1/4 is bracketed from both sides.
"""

from pipejax.study import Figure, Study, Table

REFERENCE_LR = 0.1


def get_study(arg: str | None = None) -> Study:
  config, fixed, multipliers, seeds = ("configs/deep_mlp.py", {"model_kwargs.depth": 32},
                                       (0.125, 0.25, 0.5, 1, 2), (0, 1, 2))
  if arg == "smoke":
    config, fixed, multipliers, seeds = "configs/deep_mlp.py:smoke", {}, (0.5, 1), (0, 1)
  elif arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  lrs = tuple(REFERENCE_LR * m for m in multipliers)
  at_one = (("reference.lr", REFERENCE_LR),)
  return Study(
      name="tuning" + (" (smoke)" if arg else ""), config=config, fixed=fixed,
      grids=[{"reference.lr": lrs, "method": ("sgd", "pb", "pb_sc_lwp"), "seed": seeds}],
      baseline={"method": "sgd"}, margin=0.005,
      tables=[Table("Test accuracy (%) by reference learning rate", rows="reference.lr",
                    columns="method"),
              Table("Gap to SGD at the same learning rate and seed (points)",
                    rows="reference.lr", columns="method", kind="gap"),
              Table("Each method at its own best learning rate", rows="reference.lr",
                    columns="method", kind="tuned"),
              Table("Gap to SGD at x1 (points)", rows="reference.lr", columns="method",
                    kind="gap", where=at_one)],
      figures=[Figure("accuracy_vs_multiplier.png", x="reference.lr", series="method",
                      log_x=True, x_unit=REFERENCE_LR,
                      title="Test accuracy against the learning-rate multiplier, 32 stages",
                      x_label="learning-rate multiplier (x batch-128 lr 0.1)")])
