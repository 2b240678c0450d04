r"""Depth study: each method's accuracy gap to SGD as the pipeline gets deeper (one epoch).

    python scripts/study.py --study=configs/studies/depth.py --workdir=docs/studies/depth
    python scripts/study.py --study=configs/studies/depth.py:smoke --workdir=/tmp/depth_smoke

The network is configs/deep_mlp.py's residual MLP on Fashion-MNIST, one weight layer per stage,
at 4 to 256 stages (delays up to 510), micro-batch 1, one epoch, the batch-128 recipe converted by
the scaling rules. SGD (the whole network as one stage, the same samples at batch 1, starting from
the same weights as the pipelined runs of its seed) is the baseline of every gap, paired by depth
and seed. Three seeds per cell, five for SGD, PB and PB + SC + LWP at 128 stages; the runner does
every cell's first seed before any second one, so restrict a session to cheap depths with
``--where=model_kwargs.depth=8``.

* Every depth from 4 to 32: SGD, plain PB and PB + SC + LWP (the paper's claim), then the rivals.
* 64 stages: SGD, PB, PB + SC + LWP, SpecTrain and PipeMare (a 64-stage run costs about twice a
  32-stage one, so not every rival).
* 128 and 256 stages (delays up to 254 and 510, the paper's one layer per stage at ResNet
  depths): SGD, PB, PB + SC + LWP, PB + SC, SpecTrain and PipeMare, three seeds, and five seeds of
  SGD, PB and PB + SC + LWP at 128 stages (42 runs). Restrict a session to them with
  ``--where=model_kwargs.depth=128|256``. On the 2-core reference CPU, shared with other
  trainers, one of these runs took 1 to 50 minutes (the diverged ones least) and the 42 about
  11 hours summed over runs; each record's ``wall_seconds`` in docs/studies/depth/results.jsonl
  gives its own.
* One seed of every method at 8 stages also logs the per-stage weight discrepancy between forward
  and backward (config.diagnostics); Adam rows (optimizer='adam', the batch-128 recipe lr 1e-3)
  repeat the comparison at 8 stages.

``:smoke`` runs 4- and 6-stage networks on 500 samples, two methods, two seeds, and one run at a
learning rate that diverges (CI, about a minute).
"""

import os

from pipejax.study import Figure, Section, Study, Table

PAPER = ("sgd", "pb", "pb_sc_lwp")
RIVALS = ("pb_sc", "pb_lwp", "pipedream", "spectrain", "pipemare", "dcasgd")
DEEP_RIVALS = ("pb_sc", "spectrain", "pipemare")
ADAM_METHODS = ("sgd", "pb", "pb_sc", "pb_sc_lwp", "pipedream")
SGD = (("optimizer", None), ("diagnostics", None))
ADAM = (("optimizer", "adam"),)
BREAKS_INTRODUCTION = """\
The convex quadratic (`pipejax.analysis.quadratic`, docs/quadratic.md) is stable at a step ηλ
and a delay D or it is not. On this network each stage's update meets the curvature of its own
block of the Hessian, λ_s (its top eigenvalue, mean loss over 256 training examples, power
iteration: `pipejax.analysis.sharpness`), through its own delay D_s = 2(S − 1 − s). Each row
reads λ_s on sampled stages of one network's weights, `python scripts/depth_limits.py` (its
docstring gives the command): the initial weights, or PB's seed-0 run after that many samples
(at 256 stages a rerun of PB's diverged run with checkpoints every 250 samples of the warm-up).
Every method's column uses those weights; the methods that diverged left no checkpoint to read.
Each column gives the quadratic's largest stable delay on the sharpest sampled block at the
study's peak step (η = 6.43e-6 at momentum m = 0.99918, the batch-128 recipe at micro-batch 1),
searched up to twice the pipeline's longest delay ("none ≤ N": every delay up to N is stable),
beside the longest delay a block has at that depth. The stem (stage 0, the longest delay) is
shown apart: it sees the raw pixels and is the sharpest sampled stage at the initial weights.

PipeMare's column comes from the same λ records, with no new curvature reading. The quadratic
models PipeMare at the start of its annealing, PB at ηλ/D, so its stable delays need not be an
interval and `quadratic.largest_stable_delay` refuses it; `depth_limits.pipemare_limit` gives
its limit instead. Its largest stable base ηλ is exactly 1 − m = 8.2e-4 at D = 1 and grows with
D (to π/2 (1 − m)), so a base ηλ below 1 − m is stable at every delay. Every measured ηλ_s is
below it, the largest (the 32-stage stem at the initial weights, 3.8e-4) by a factor of 2.1. In
this study PipeMare anneals over the whole epoch, K = 60,000 steps, so after k samples its step
is η D^−(1 − k/K): PipeMare at base ηλ D^(k/K), which at every reading is at most 0.47 of 1 − m.
The quadratic therefore predicts no break for PipeMare at any depth or reading.

The measured cells are each method's outcome at that depth, the same on every row of the
depth: the mean gap to SGD paired by seed (momentum SGD runs) and the runs that diverged. The
study measures no break point, no delay at which a method starts to fail: only whether each
depth's runs diverged and, for a run that did, after how many samples and in which stages the
trainer first saw a non-finite value (its divergence message, kept in the run's record as
`divergence`). Below the table, each method's verdict at each depth and reading."""


def get_study(arg: str | None = None) -> Study:
  if arg == "smoke":
    return Study(
        name="depth (smoke)", config="configs/deep_mlp.py:smoke",
        grids=[{"model_kwargs.depth": (4, 6), "method": ("sgd", "pb"), "seed": (0, 1)},
               # A learning rate no method survives: the report must mark it, not average it.
               {"model_kwargs.depth": (5,), "method": ("pb",), "seed": (0,),
                "reference.lr": (1e4,)}],
        # No curves.png per run: the report draws the figure a reader looks at.
        fixed={"epochs": 1.0, "max_train_examples": 500, "eval_every_samples": 100000,
               "plot_curves": False},
        baseline={"method": "sgd"}, margin=0.005,
        tables=[Table("Test accuracy (%)", rows="model_kwargs.depth", columns="method"),
                Table("Gap to SGD (points)", rows="model_kwargs.depth", columns="method",
                      kind="gap")],
        figures=[Figure("gap_vs_depth.png", x="model_kwargs.depth", series="method",
                        kind="gap", title="Gap to SGD against depth (smoke)",
                        x_label="pipeline stages")])
  if arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  seeds = (0, 1, 2)
  return Study(
      name="depth", config="configs/deep_mlp.py",
      grids=[{"model_kwargs.depth": (4, 8, 16, 32), "method": PAPER, "seed": seeds},
             {"model_kwargs.depth": (4, 8, 16, 32), "method": RIVALS, "seed": seeds},
             {"model_kwargs.depth": (64,), "method": PAPER + ("spectrain", "pipemare"),
              "seed": seeds},
             # One weight layer per stage at the paper's depths: delays up to 254.
             {"model_kwargs.depth": (128,), "method": PAPER, "seed": (0, 1, 2, 3, 4)},
             {"model_kwargs.depth": (128, 256), "method": DEEP_RIVALS, "seed": seeds},
             {"model_kwargs.depth": (256,), "method": PAPER, "seed": seeds},
             # The staleness figure: the weight stash that measures it costs O(S^2) weight
             # copies per tick, so it is drawn at 8 stages, one seed.
             {"model_kwargs.depth": (8,), "method": PAPER + RIVALS, "seed": (0,),
              "diagnostics": (True,)},
             # Adam rows: the batch-128 recipe lr 1e-3, betas (0.9, 0.999), converted to b = 1.
             {"model_kwargs.depth": (8,), "method": ADAM_METHODS, "seed": seeds,
              "optimizer": ("adam",), "reference.lr": (1e-3,)}],
      baseline={"method": "sgd"}, margin=0.005,
      tables=[Table("Test accuracy (%), momentum SGD", rows="model_kwargs.depth",
                    columns="method", where=SGD),
              Table("Gap to SGD at the same depth and seed (points), momentum SGD",
                    rows="model_kwargs.depth", columns="method", kind="gap", where=SGD),
              Table("Test accuracy (%), Adam", rows="model_kwargs.depth", columns="method",
                    where=ADAM),
              Table("Gap to Adam without a pipeline (points)", rows="model_kwargs.depth",
                    columns="method", kind="gap", where=ADAM,
                    baseline_label="Adam without a pipeline")],
      figures=[Figure("gap_vs_depth.png", x="model_kwargs.depth", series="method", kind="gap",
                      log_x=True, where=SGD, title="Gap to SGD against depth, one epoch",
                      x_label="pipeline stages"),
               Figure("staleness_by_stage.png", x="stage", series="method", kind="staleness",
                      where=(("model_kwargs.depth", 8), ("diagnostics", True)),
                      title="Weight discrepancy by stage, 8 stages")],
      sections=[Section("Where each method breaks, beside the convex quadratic", _breaks)])


def _breaks(records, workdir: str) -> str:
  from pipejax.analysis import depth_limits  # pylint: disable=import-outside-toplevel
  limits = depth_limits.read_records(os.path.join(workdir, "limits.jsonl"))
  return BREAKS_INTRODUCTION + "\n\n" + depth_limits.report_section(records, limits)
