r"""Depth study: each method's accuracy gap to SGD as the pipeline gets deeper.

    python scripts/study.py --study=configs/studies/depth.py --workdir=docs/studies/depth
    python scripts/study.py --study=configs/studies/depth.py:smoke --workdir=/tmp/depth_smoke

The network is configs/deep_mlp.py's residual MLP on Fashion-MNIST, one weight layer per stage,
at 4 to 32 stages (delays up to 62), micro-batch 1, one epoch, the batch-128 recipe converted by
the scaling rules. SGD (the whole network as one stage, same samples, batch 1) is the baseline of
every gap, at the same depth and seed. Three seeds per cell; the runner does every cell's first
seed before any second one. One seed of every method at 8 stages also logs the per-stage weight
discrepancy between forward and backward (config.diagnostics), and Adam rows (optimizer='adam',
the batch-128 recipe lr 1e-3) repeat the comparison at 8 stages with another base optimizer (at
8 rather than 32 stages: a 32-stage run costs five times as much, and the CPU budget went to the
momentum-SGD rows).
``:smoke`` runs 4- and 6-stage networks on 2000 samples, two methods, two seeds, and one run at a
learning rate that diverges (CI, about two minutes).
"""

from pipejax.study import Figure, Study, Table

METHODS = ("sgd", "pb", "pb_sc", "pb_lwp", "pb_sc_lwp", "pipedream", "spectrain", "pipemare",
           "dcasgd")
ADAM_METHODS = ("sgd", "pb", "pb_sc", "pb_sc_lwp", "pipedream")
SGD = (("optimizer", None), ("diagnostics", None))
ADAM = (("optimizer", "adam"),)


def get_study(arg: str | None = None) -> Study:
  if arg == "smoke":
    return Study(
        name="depth (smoke)", config="configs/deep_mlp.py:smoke",
        grids=[{"model_kwargs.depth": (4, 6), "method": ("sgd", "pb"), "seed": (0, 1)},
               # A learning rate no method survives: the report must mark it, not average it.
               {"model_kwargs.depth": (5,), "method": ("pb",), "seed": (0,),
                "reference.lr": (1e4,)}],
        fixed={"epochs": 1.0, "eval_every_samples": 100000},
        baseline={"method": "sgd"},
        tables=[Table("Test accuracy (%)", rows="model_kwargs.depth", columns="method"),
                Table("Gap to SGD (points)", rows="model_kwargs.depth", columns="method",
                      kind="gap")],
        figures=[Figure("gap_vs_depth.png", x="model_kwargs.depth", series="method",
                        kind="gap")])
  if arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  return Study(
      name="depth", config="configs/deep_mlp.py",
      grids=[{"model_kwargs.depth": (32, 16, 8, 4), "method": METHODS, "seed": (0, 1, 2)},
             # The staleness figure: the weight stash that measures it costs O(S^2) weight
             # copies per tick, so it is drawn at 8 stages, one seed.
             {"model_kwargs.depth": (8,), "method": METHODS, "seed": (0,),
              "diagnostics": (True,)},
             # Adam rows: the batch-128 recipe lr 1e-3, betas (0.9, 0.999), converted to b = 1.
             {"model_kwargs.depth": (8,), "method": ADAM_METHODS, "seed": (0, 1, 2),
              "optimizer": ("adam",), "reference.lr": (1e-3,)}],
      baseline={"method": "sgd"},
      tables=[Table("Test accuracy (%), momentum SGD", rows="model_kwargs.depth",
                    columns="method", where=SGD),
              Table("Gap to SGD at the same depth and seed (points), momentum SGD",
                    rows="model_kwargs.depth", columns="method", kind="gap", where=SGD),
              Table("Test accuracy (%), Adam", rows="model_kwargs.depth", columns="method",
                    where=ADAM),
              Table("Gap to Adam without a pipeline (points)", rows="model_kwargs.depth",
                    columns="method", kind="gap", where=ADAM)],
      figures=[Figure("gap_vs_depth.png", x="model_kwargs.depth", series="method", kind="gap",
                      log_x=True, where=SGD),
               Figure("staleness_by_stage.png", x="stage", series="method", kind="staleness",
                      where=(("model_kwargs.depth", 8), ("diagnostics", True)))])
