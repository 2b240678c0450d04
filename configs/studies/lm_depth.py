r"""Language-model depth study: the Adam family's validation bits per byte as the pipeline deepens.

    python scripts/study.py --study=configs/studies/lm_depth.py --workdir=docs/studies/lm_depth \
        --parallel=2
    python scripts/study.py --study=configs/studies/lm_depth.py:smoke --workdir=/tmp/lm_smoke

The network is configs/char_lm.py's byte-level transformer on the fortunes corpus, one block per
stage: ``model_kwargs.blocks`` = 6, 14 and 30 blocks are 8, 16 and 32 stages (delays up to 62).
The width shrinks as the blocks grow (128, 96, 64; 4 heads) so that the parameter count stays
about constant (1.2 M, 1.5 M, 1.5 M): between the rows, depth and so staleness changes, not the
model's size. Micro-batch 1 (one sequence of 64 bytes), 24,104 sequences (two thirds of an epoch,
1.5 M bytes), AdamW with the decay mask at lr 1e-3 (b1 0.9, b2 0.99), cosine with 5% warm-up.
Every method of a seed starts from the same weights (the one-stage baseline from the pipelined
split's, merged), and the seed sets both those weights and the order of the data. The baseline of
every gap is Adam without a pipeline (method ``sgd``: the whole network as one stage), paired by
seed at the same depth. Validation loss is reported in bits per byte (the mean next-byte
cross-entropy over ln 2); count models on the same split score 3.11 (trigram) and 2.80 (4-gram).

Why this size. Measured with Adam without a pipeline on a quiet 2-core machine: 30 blocks of
width 64 at context 64 reach 2.89 bits per byte after 24,000 sequences (2.78 after a whole epoch,
1,347 s); 6 blocks of width 64 stand at 3.37 after 12,000, too small a model for the bar of 3.0,
hence width 128 at 6 blocks. Context 128 costs each 32-stage pipelined run 4 times the time for
the same bytes (10 against 40 sequences/s), so the study uses 64 throughout.

Grid (84 runs), in the order it runs (``--where`` picks a part, e.g.
``--where=model_kwargs.blocks=30,method=sgd|pb|pb_sc_lwp|nesterov_asyncpp``):

* 32 stages: every method × 3 seeds, and seeds 3 and 4 of sgd, pb, pb_sc_lwp and
  nesterov_asyncpp (5 seeds for the paper's comparison and the strongest rival);
* 16 stages: sgd, pb, pb_sc_lwp and nesterov_asyncpp × 3 seeds;
* 8 stages: every method × 3 seeds;
* the learning-rate sweep: sgd and :data:`SWEEP_METHOD` at 8 and 32 stages, seed 0, at four rates
  beside the main grid's 1e-3.

The runner does every cell's first seed before any second one.

Cost (measured, see docs/studies/lm_depth/report.md's timing column and docs/lm.md §4): the
per-run times and the total are in docs/lm.md §4, from the records' ``wall_seconds``.

``:smoke`` runs the 4-stage smoke network on 1500 sequences, three methods, two seeds (CI).
"""

import math

from pipejax.study import Figure, Study, Table

METHODS = ("sgd", "pb", "pb_sc", "pb_sc_lwp", "pipeoptim", "pipedream", "nesterov_asyncpp",
           "pb_muon")
FIVE_SEEDS = ("sgd", "pb", "pb_sc_lwp", "nesterov_asyncpp")
# The asynchronous method the sweep tunes beside the baseline: PB + SC + LWP, the paper's method
# and the one the study asks about, so that its gap is not an artefact of the baseline's rate.
SWEEP_METHOD = "pb_sc_lwp"
SWEEP_RATES = (3e-4, 6e-4, 2e-3, 4e-3)  # beside the main grid's 1e-3
WIDTH = {30: 64, 14: 96, 6: 128}  # blocks -> width: about 1.5 M parameters at every depth
BITS_PER_NAT = 1 / math.log(2)
MAIN = (("reference.lr", None),)  # the runs at the recipe's rate
MARGIN = 0.02 / BITS_PER_NAT  # 0.02 bits per byte, in the metric's nats
BITS = {"metric": "test_loss", "scale": BITS_PER_NAT}


def _at(blocks: int, methods, seeds, **more) -> dict:
  return {"model_kwargs.blocks": (blocks,), "model_kwargs.width": (WIDTH[blocks],),
          "method": tuple(methods), "seed": tuple(seeds), **more}


def get_study(arg: str | None = None) -> Study:
  if arg == "smoke":
    return Study(
        name="lm depth (smoke)", config="configs/char_lm.py:smoke",
        grids=[{"model_kwargs.blocks": (2,), "method": ("sgd", "pb_sc", "nesterov_asyncpp"),
                "seed": (0, 1)}],
        baseline={"method": "sgd"}, margin=MARGIN,
        tables=[Table("Validation bits per byte", rows="model_kwargs.blocks", columns="method",
                      **BITS),
                Table("Gap to Adam without a pipeline (bits per byte)",
                      rows="model_kwargs.blocks", columns="method", kind="gap", **BITS)])
  if arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  return Study(
      name="lm depth", config="configs/char_lm.py",
      grids=[_at(30, METHODS, (0, 1, 2)),
             _at(30, FIVE_SEEDS, (3, 4)),
             _at(14, FIVE_SEEDS, (0, 1, 2)),
             _at(6, METHODS, (0, 1, 2)),
             _at(6, ("sgd", SWEEP_METHOD), (0,), **{"reference.lr": SWEEP_RATES}),
             _at(30, ("sgd", SWEEP_METHOD), (0,), **{"reference.lr": SWEEP_RATES})],
      baseline={"method": "sgd"}, margin=MARGIN,
      tables=[Table("Validation bits per byte", rows="model_kwargs.blocks", columns="method",
                    where=MAIN, **BITS),
              Table("Gap to Adam without a pipeline, paired by seed (bits per byte)",
                    rows="model_kwargs.blocks", columns="method", kind="gap", where=MAIN,
                    baseline_label="Adam without a pipeline", **BITS),
              Table("Learning-rate sweep at 8 stages (bits per byte, seed 0)",
                    rows="reference.lr", columns="method", where=(("model_kwargs.blocks", 6),),
                    **BITS),
              Table("Learning-rate sweep at 32 stages (bits per byte, seed 0)",
                    rows="reference.lr", columns="method", where=(("model_kwargs.blocks", 30),),
                    **BITS)],
      figures=[Figure("gap_vs_depth.png", x="model_kwargs.blocks", series="method", kind="gap",
                      where=MAIN, x_label="transformer blocks (stages - 2)",
                      title="Gap to Adam without a pipeline against depth",
                      metric="test_loss")])
