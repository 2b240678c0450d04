r"""Language-model depth study: the Adam family's validation bits per byte as the pipeline deepens.

    python scripts/study.py --study=configs/studies/lm_depth.py --workdir=docs/studies/lm_depth
    python scripts/study.py --study=configs/studies/lm_depth.py:smoke --workdir=/tmp/lm_smoke

The network is configs/char_lm.py's byte-level transformer on the fortunes corpus, one block per
stage: ``model_kwargs.blocks`` = 6, 14 and 30 blocks are 8, 16 and 32 stages (delays up to 62).
Micro-batch 1 (one sequence of 128 bytes), one epoch, AdamW with the decay mask. Every method of a
seed starts from the same weights (the one-stage baseline from the pipelined split's, merged), and
the seed sets both those weights and the order of the data. The baseline of every gap is Adam without
a pipeline (method ``sgd``: the whole network as one stage), paired by seed at the same depth.
Validation loss is reported in bits per byte (the mean next-byte cross-entropy over ln 2). A
learning-rate sweep of the baseline and of the default method (``pb_sc``) at 8 and 32 stages,
one seed, checks that the comparison does not hinge on the recipe's rate.
``:smoke`` runs the 4-stage smoke network on 1500 sequences, three methods, two seeds (CI).
"""

import math

from pipejax.study import Figure, Study, Table

METHODS = ("sgd", "pb", "pb_sc", "pipeoptim", "pipedream", "nesterov_asyncpp", "pb_muon")
DEFAULT_METHOD = "pb_sc"  # configs/char_lm.py's
LEARNING_RATES = (1e-4, 3e-4, 1e-3, 3e-3)
BITS_PER_NAT = 1 / math.log(2)
MAIN = (("reference.lr", None),)  # the runs at the recipe's rate
BITS = {"metric": "test_loss", "scale": BITS_PER_NAT}


def get_study(arg: str | None = None) -> Study:
  if arg == "smoke":
    return Study(
        name="lm depth (smoke)", config="configs/char_lm.py:smoke",
        grids=[{"model_kwargs.blocks": (2,), "method": ("sgd", "pb_sc", "nesterov_asyncpp"),
                "seed": (0, 1)}],
        baseline={"method": "sgd"},
        tables=[Table("Validation bits per byte", rows="model_kwargs.blocks", columns="method",
                      **BITS),
                Table("Gap to Adam without a pipeline (bits per byte)",
                      rows="model_kwargs.blocks", columns="method", kind="gap", **BITS)])
  if arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  return Study(
      name="lm depth", config="configs/char_lm.py",
      grids=[{"model_kwargs.blocks": (30, 14, 6), "method": METHODS, "seed": (0, 1, 2)},
             {"model_kwargs.blocks": (6, 30), "method": ("sgd", DEFAULT_METHOD), "seed": (0,),
              "reference.lr": LEARNING_RATES}],
      baseline={"method": "sgd"},
      tables=[Table("Validation bits per byte", rows="model_kwargs.blocks", columns="method",
                    where=MAIN, **BITS),
              Table("Gap to Adam without a pipeline, paired by seed (bits per byte)",
                    rows="model_kwargs.blocks", columns="method", kind="gap", where=MAIN,
                    **BITS),
              Table("Learning-rate sweep at 8 stages (bits per byte, one seed)",
                    rows="reference.lr", columns="method", where=(("model_kwargs.blocks", 6),),
                    **BITS),
              Table("Learning-rate sweep at 32 stages (bits per byte, one seed)",
                    rows="reference.lr", columns="method", where=(("model_kwargs.blocks", 30),),
                    **BITS)],
      figures=[Figure("gap_vs_depth.png", x="model_kwargs.blocks", series="method", kind="gap",
                      metric="test_loss", where=MAIN)])
