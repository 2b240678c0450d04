r"""The depth study's convolutional row: ResNet-20 (20 stages, one conv each) on Fashion-MNIST.

    python scripts/study.py --study=configs/studies/resnet.py --workdir=docs/studies/resnet

configs/fashion_resnet20.py's network (GroupNorm, delays up to 38, micro-batch 1) at width 8
instead of 16, trained on 10,000 samples (half an epoch of a 20,000-sample subset), the budget of
the normalization study's convolutional row (configs/studies/normalization.py:conv), so that its
GroupNorm cells are this study's PB + SC + LWP cells at other seeds. Fewer methods and seeds than
the MLP rows: on the 2-core reference CPU convolutions at batch 1 are the slow part (see
docs/performance.md), so this study runs SGD, plain PB and PB + SC + LWP first (three seeds),
then the rivals.
"""

from pipejax.study import Study, Table


def get_study(arg: str | None = None) -> Study:
  config, seeds = "configs/fashion_resnet20.py", (0, 1, 2)
  fixed = {"model_kwargs.width": 8, "max_train_examples": 20000, "epochs": 0.5,
           "eval_every_samples": 10 ** 7, "checkpoint_every_samples": 10 ** 7}
  if arg == "smoke":
    config, seeds, fixed = "configs/fashion_resnet20.py:smoke", (0,), {}
  elif arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  return Study(
      name="resnet" + (" (smoke)" if arg else ""), config=config, fixed=fixed,
      grids=[{"model": ("cifar_resnet20",), "method": ("sgd", "pb", "pb_sc_lwp"),
              "seed": seeds}] + ([] if arg else [
                  {"model": ("cifar_resnet20",),
                   "method": ("pb_sc", "pb_lwp", "pipedream", "spectrain", "pipemare"),
                   "seed": seeds}]),
      baseline={"method": "sgd"},
      tables=[Table("Test accuracy (%)", rows="model", columns="method"),
              Table("Gap to SGD (points)", rows="model", columns="method", kind="gap")])
