r"""The depth study's convolutional row: ResNet-20 (20 stages, one conv each) on Fashion-MNIST.

    python scripts/study.py --study=configs/studies/resnet.py --workdir=docs/studies/resnet

configs/fashion_resnet20.py (20000 samples, micro-batch 1). Fewer methods and seeds than the MLP
rows: on the 2-core reference CPU a pipelined ResNet-20 run takes several minutes, so this study
runs SGD, plain PB and PB + SC + LWP, two seeds each.
"""

from pipejax.study import Study, Table


def get_study(arg: str | None = None) -> Study:
  config, seeds = "configs/fashion_resnet20.py", (0, 1)
  if arg == "smoke":
    config, seeds = "configs/fashion_resnet20.py:smoke", (0,)
  elif arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  return Study(
      name="resnet" + (" (smoke)" if arg else ""), config=config,
      grids=[{"model": ("cifar_resnet20",), "method": ("sgd", "pb", "pb_sc_lwp"),
              "seed": seeds}],
      baseline={"method": "sgd"},
      tables=[Table("Test accuracy (%)", rows="model", columns="method"),
              Table("Gap to SGD (points)", rows="model", columns="method", kind="gap")])
