r"""Normalization at depth: none / LayerNorm / Online Norm in the depth study's residual MLP.

    python scripts/study.py --study=configs/studies/normalization_deep.py \
        --workdir=docs/studies/normalization_deep

configs/deep_mlp.py at 8 stages (pre-norm residual blocks, whose norm is the one compared),
PB + SC + LWP at micro-batch 1, three seeds, on the budget of configs/studies/normalization.py:
2 epochs of a 20,000-sample subset (40,000 samples), the whole test set.
"""

from pipejax.study import Study, Table


def get_study(arg: str | None = None) -> Study:
  fixed = {"max_train_examples": 20000, "epochs": 2.0, "eval_every_samples": 10 ** 7,
           "checkpoint_every_samples": 10 ** 7}
  grid = {"model_kwargs.depth": (8,), "model_kwargs.normalization": (None, "layer", "online"),
          "seed": (0, 1, 2)}
  if arg == "smoke":
    fixed.update(max_train_examples=2000, epochs=0.5, max_test_examples=1000)
    grid["seed"] = (0,)
  elif arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  return Study(
      name="normalization at depth" + (" (smoke)" if arg else ""), config="configs/deep_mlp.py",
      grids=[grid], fixed=fixed,
      tables=[Table("Test accuracy (%), residual MLP of 8 stages", rows="model_kwargs.depth",
                    columns="model_kwargs.normalization")])
