r"""Normalization study: none / LayerNorm / Online Norm at micro-batch 1 through PB + SC + LWP.

    python scripts/study.py --study=configs/studies/normalization.py --parallel=1 \
        --workdir=docs/studies/normalization
    python scripts/study.py --study=configs/studies/normalization.py:deep \
        --workdir=docs/studies/normalization_deep
    python scripts/study.py --study=configs/studies/normalization.py:conv \
        --workdir=docs/studies/normalization_conv
    python scripts/study.py --study=configs/studies/normalization.py:smoke --workdir=/tmp/norm

configs/default.py's MLP on Fashion-MNIST (784-256-128-10, 3 stages) and a deeper one (seven hidden
layers of 128, 8 stages), three seeds each, on a reduced budget: 2 epochs of a 20,000-sample
subset of the training set (40,000 samples), evaluated on the whole test set. GroupNorm has no
meaning for a dense layer's features taken one sample at a time beyond LayerNorm, so the MLPs
compare the three. ``:deep`` compares the same three as the pre-norm of the depth study's residual
MLP (configs/deep_mlp.py at 8 stages), on the same budget (``:deep_smoke`` for a quick run).
``:conv`` adds GroupNorm, where it differs from LayerNorm: configs/fashion_resnet20.py's ResNet-20
(20 stages, one conv per stage) at width 8 instead of 16, on 10,000 samples, three seeds: none /
GroupNorm (8 groups) / LayerNorm / Online Norm (``:conv_smoke`` for a quick run).
docs/normalization.md discusses the results.
"""

from pipejax.study import Study, Table

MODELS = ((256, 128), (128,) * 7)
NORMALIZATIONS = (None, "layer", "online")
VARIANTS = ("smoke", "deep", "deep_smoke", "conv", "conv_smoke")


def get_study(arg: str | None = None) -> Study:
  if arg and arg not in VARIANTS:
    raise ValueError(f"Unknown study argument {arg!r}; known: {', '.join(VARIANTS)}.")
  deep, conv = arg in ("deep", "deep_smoke"), arg in ("conv", "conv_smoke")
  fixed = {"max_train_examples": 20000, "epochs": 2.0, "eval_every_samples": 10 ** 7,
           "checkpoint_every_samples": 10 ** 7}
  normalizations = NORMALIZATIONS
  if conv:
    # Convolutions at batch 1 are the slow part of a CPU (docs/performance.md): half the width
    # and half an epoch of a 20k subset keep a run at a few minutes of one core.
    grid = {"model_kwargs.width": (8,)}
    rows, config, name = "model_kwargs.width", "configs/fashion_resnet20.py", "normalization (conv)"
    normalizations = (None, "group", "layer", "online")
    fixed.update(epochs=0.5)
  elif deep:
    grid = {"model_kwargs.depth": (8,)}
    rows, config, name = "model_kwargs.depth", "configs/deep_mlp.py", "normalization at depth"
  else:
    grid = {"model_kwargs.hidden": MODELS}
    rows, config, name = "model_kwargs.hidden", "configs/default.py", "normalization"
  grid.update({"model_kwargs.normalization": normalizations,
               "seed": (0, 1, 2)})
  if arg and arg.endswith("smoke"):
    fixed.update(max_train_examples=2000, epochs=0.5, max_test_examples=1000)
    grid["seed"] = (0,)
  return Study(
      name=name + (" (smoke)" if arg and arg.endswith("smoke") else ""), config=config,
      grids=[grid], fixed=fixed,
      tables=[Table("Test accuracy (%)", rows=rows, columns="model_kwargs.normalization")])
