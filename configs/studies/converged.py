r"""Converged depth study: the paper's claim at final accuracy, 10 epochs at 16 and 32 stages.

    python scripts/study.py --study=configs/studies/converged.py --workdir=docs/studies/converged
    python scripts/study.py --study=configs/studies/converged.py:smoke --workdir=/tmp/conv_smoke

One epoch is early training: the depth study's runs end at about 84%, where the same recipe
reaches 89% after 10 epochs. The paper's claim is about final accuracy, so this study trains
configs/deep_mlp.py's residual MLP for 10 epochs (the cosine schedule and PipeMare's annealing
stretched over them, warm-up over the first 5%), micro-batch 1, starting every method of a seed
from the same weights.

In the order the evidence matters (the runner takes every cell's first seed first; restrict a
session with ``--where``):

1. 32 stages: SGD, plain PB and PB + SC + LWP, five seeds each;
2. 16 stages: the same three, five seeds each;
3. 32 stages: PB + SC, PB + LWP, SpecTrain, PipeDream, PipeMare and DC-ASGD, three seeds each.

The report gives final test accuracy, its paired gap to SGD with verdicts at a margin of half a
point, the samples each run needed to reach 85% and 88% test accuracy, and the test curves.
"""

from pipejax.study import Figure, Study, Table

PAPER = ("sgd", "pb", "pb_sc_lwp")
RIVALS = ("pb_sc", "pb_lwp", "spectrain", "pipedream", "pipemare", "dcasgd")


def get_study(arg: str | None = None) -> Study:
  config, fixed = "configs/deep_mlp.py", {"epochs": 10.0, "warmup_epochs": 0.5,
                                          "method_kwargs.pipemare.anneal_fraction": 0.1}
  grids = [{"model_kwargs.depth": (32,), "method": PAPER, "seed": (0, 1, 2, 3, 4)},
           {"model_kwargs.depth": (16,), "method": PAPER, "seed": (0, 1, 2, 3, 4)},
           {"model_kwargs.depth": (32,), "method": RIVALS, "seed": (0, 1, 2)}]
  levels = (0.85, 0.88)
  if arg == "smoke":
    config, fixed = "configs/deep_mlp.py:smoke", {"epochs": 3.0, "eval_every_samples": 1000}
    grids = [{"model_kwargs.depth": (6,), "method": ("sgd", "pb"), "seed": (0, 1)}]
    levels = (0.6, 0.7)
  elif arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  tables = [Table("Final test accuracy (%)", rows="model_kwargs.depth", columns="method"),
            Table("Gap to SGD at the same depth and seed (points)", rows="model_kwargs.depth",
                  columns="method", kind="gap")]
  tables += [Table(f"Training samples to reach {level:.0%} test accuracy (thousands)",
                   rows="model_kwargs.depth", columns="method", metric=f"samples_to:{level}",
                   scale=1e-3, decimals=0) for level in levels]
  depths = (6,) if arg else (32, 16)
  return Study(
      name="converged depth" + (" (smoke)" if arg else ""), config=config, fixed=fixed,
      grids=grids, baseline={"method": "sgd"}, margin=0.005, tables=tables,
      figures=[Figure(f"test_curves_{d}.png", x="samples", series="method", kind="curves",
                      where=(("model_kwargs.depth", d),),
                      title=f"Test accuracy during training, {d} stages")
               for d in depths])
