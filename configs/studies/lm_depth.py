r"""Language-model depth study: the Adam family's validation bits per byte as the pipeline deepens.

    python scripts/study.py --study=configs/studies/lm_depth.py --workdir=docs/studies/lm_depth \
        --parallel=2
    python scripts/study.py --study=configs/studies/lm_depth.py:smoke --workdir=/tmp/lm_smoke

The network is configs/char_lm.py's byte-level transformer on the fortunes corpus, one block per
stage: ``model_kwargs.blocks`` = 6, 14 and 30 blocks are 8, 16 and 32 stages (delays up to 62).
The width shrinks as the blocks grow (128, 96, 64; 4 heads) so that the parameter count stays
about constant (1.2 M, 1.5 M, 1.5 M): between the rows, depth and so staleness changes, not the
model's size. Micro-batch 1 (one sequence of 64 bytes), 24,104 sequences (two thirds of an epoch,
1.5 M bytes), AdamW with the decay mask at lr 1e-3 (b1 0.9, b2 0.99), cosine with a warm-up of
0.05 of an epoch (7.5% of the run).
Every method of a seed starts from the same weights (the one-stage baseline from the pipelined
split's, merged), and the seed sets both those weights and the order of the data. The baseline of
every gap is Adam without a pipeline (method ``sgd``: the whole network as one stage), paired by
seed at the same depth. Validation loss is reported in bits per byte (the mean next-byte
cross-entropy over ln 2); count models on the same split score 3.11 (trigram) and 2.80 (4-gram).

Why this size. Adam without a pipeline must beat the trigram model (3.11) at every depth; the
sizing runs (seed 0, ``docs/studies/lm_depth/sizing.jsonl``, on the corpus before duplicated
fortunes were dropped from the validation split) reached 2.77, 2.89 and 2.95 bits per byte at 8,
16 and 32 stages. Context 128 costs each 32-stage pipelined run 4 times the time for the same
bytes (10 against 40 sequences/s), so the study uses 64 throughout; 6 blocks of width 64 stand
at 3.37 after 12,000 sequences, too small a model for the bar, hence the widths above.

What the sizing runs already show, one seed each at 32 stages and lr 1e-3: PB ends at 4.14 and
PB + SC + LWP at 4.46 bits per byte against Adam's 2.95, while Nesterov AsyncPP was ahead of PB
when stopped (2.89 against 3.19 nats after 8,000 sequences). At Adam's rate the asynchronous
methods lose more than a bit per byte, so the sweep goes down to 1e-4 and covers Nesterov AsyncPP
(the strongest asynchronous method in the sizing runs) beside the baseline at both depths, and
PB + SC + LWP at 32 stages, so that no method's gap is an artefact of one rate; PB + SC + LWP
did best at the lowest of those rates, so 3e-5 and 1e-5 follow it there. PB + Muon, in
none of the sizing runs, ended as the grid's best asynchronous method at both depths, so it has a
sweep of its own: 3e-4, 2e-3 and 4e-3 beside 1e-3 at 32 stages (seed 0), and those four rates at
8 stages from seed 3 on the CPU (the grid's 8-stage seeds drew their weights on a GPU).

Grid (99 runs). The runner does every cell's first seed before any second one; run the parts in
this order with ``--where``:

1. ``--where=model_kwargs.blocks=30,method=sgd|pb|pb_sc_lwp|nesterov_asyncpp,reference.lr=None``:
   32 stages, the paper's comparison and the strongest rival, 5 seeds (20 runs);
2. ``--where=model_kwargs.blocks=6,seed=0|1|2`` : 8 stages, every method × 3 seeds and the sweep
   (32 runs);
3. the rest, e.g. ``--where=model_kwargs.blocks=30`` (the other 32-stage cells and sweeps, 27
   runs), ``--where=model_kwargs.blocks=14`` (16 stages, sgd, pb, pb_sc_lwp, nesterov_asyncpp × 3
   seeds, 12 runs) and ``--where=model_kwargs.blocks=6,seed=3`` (PB + Muon's 8-stage sweep, 4
   runs); or run the whole study without ``--where``.

Cost: on the 2-core reference CPU, two trainers at a time, a 32-stage run took 6 to 85 minutes
(PB + Muon the slowest, and the slowest neighbour), so the whole grid there is about a day; the
8- and 16-stage cells ran on a GPU instead. Each record's ``wall_seconds`` in
docs/studies/lm_depth/results.jsonl gives its own, and ``machine`` where it ran.

Where the cells ran. The 32-stage cells ran on the 2-core CPU. The 8- and 16-stage cells ran on a
lent NVIDIA H200 with 16 CPU cores, 12 trainers at a time (``--parallel=12``; the launcher then
turns off JAX's preallocation of the GPU's memory), with ``JAX_DEFAULT_MATMUL_PRECISION=highest``
so that float32 products are float32 as on the CPU. That machine had jax 0.11.2 (the pinned flax,
optax, chex and orbax went with the run); this CPU has the pinned 0.10.2.
The GPU draws a seed's starting weights to other last bits than a CPU: 8 stages, seed 0,
``init_digest`` ``f3a2baff…`` on the H200 and ``01b31565…`` on this CPU and on the H200 machine's
own CPU under jax 0.11.2 (``JAX_PLATFORMS=cpu``; a 40-sequence ``scripts/train.py`` run of ``pb``
each), so the platform makes the difference, not the jax version. A depth's cells therefore stay
on one machine. The code's version matters too: the 32-stage cells run at commit 77d66d7, and
since 48c404b compiles the initial state unoptimized, the same seed draws other last bits
(32 stages, seed 1: ``c51d0e37…`` at 77d66d7, ``4434fe54…`` after), so every 32-stage cell ran
from a worktree at 77d66d7; a rerun at a later commit would start from other weights, which the
report's starting-weights check flags.

``:smoke`` runs the 4-stage smoke network on 1500 sequences, three methods, two seeds (CI).
"""

import math

from pipejax.study import Figure, Section, Study, Table

METHODS = ("sgd", "pb", "pb_sc", "pb_sc_lwp", "pipeoptim", "pipedream", "nesterov_asyncpp",
           "pb_muon")
FIVE_SEEDS = ("sgd", "pb", "pb_sc_lwp", "nesterov_asyncpp")
SWEEP_METHODS = ("sgd", "nesterov_asyncpp")  # the baseline and the strongest rival, both depths
SWEEP_RATES = (1e-4, 3e-4, 6e-4, 2e-3)  # beside the main grid's 1e-3
SWEEP_TITLE = "bits per byte, seed 0; lr 1e-3 is in the first table"
MUON_SWEEP_RATES = (3e-4, 2e-3, 4e-3)  # beside 1e-3
# The 8-stage cells ran on a GPU, whose seed-0 weights a CPU cannot draw: PB + Muon's 8-stage
# sweep runs on the CPU from a seed of its own, 1e-3 included, so that its rates share weights.
MUON_SEED_8 = 3
WIDTH = {30: 64, 14: 96, 6: 128}  # blocks -> width: about 1.5 M parameters at every depth
BITS_PER_NAT = 1 / math.log(2)
MAIN = (("reference.lr", None),)  # the runs at the recipe's rate
MARGIN = 0.02 / BITS_PER_NAT  # 0.02 bits per byte, in the metric's nats
BITS = {"metric": "test_loss", "scale": BITS_PER_NAT, "unit": "bits per byte"}
FIGURE_BITS = {"scale": BITS_PER_NAT, "unit": "bits per byte"}
NOT_SHOWN = """\
* **Model size.** About 1.2 to 1.5 M parameters at every depth. Whether the gaps shrink, hold or
  grow with width at a fixed depth is not measured here.
* **Tokens seen.** 24,104 sequences of 64 bytes (1.5 M bytes, two thirds of an epoch of the
  corpus) per run: far from convergence, where an asynchronous method's gap can close (or open)
  as the learning rate decays. The curves show each method's loss along the way, not where it
  would end.
* **One corpus, byte level.** The fortunes corpus (2.3 MB of English text to train on) with a
  256-symbol vocabulary. Nothing here says how a sub-word tokenizer, a larger corpus or another
  language would move the gaps.
* **One recipe.** AdamW at b1 0.9, b2 0.99, with the decay mask and a cosine schedule with a
  warm-up of 0.05 of an epoch (7.5% of the run). The sweeps tune the learning rate of the
  baseline, Nesterov AsyncPP and PB + Muon at 8 and 32 stages and of PB + SC + LWP at 32, not of
  every method, and not the betas, the warm-up or the weight decay.
* **Micro-batch 1.** One sequence per update, as in fine-grained pipelined backpropagation; the
  gaps at larger micro-batches (fewer, larger steps per delay) are not measured.
* **Wall-clock speed.** Every run is a simulation of the pipeline on one device; the study
  compares what each method learns from the same samples, not how fast a pipeline of real
  devices would run (docs/performance.md).
"""


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
      labels={"sgd": "Adam, no pipeline", "model_kwargs.blocks": "blocks (stages − 2)"},
      grids=[_at(30, METHODS, (0, 1, 2)),
             _at(30, FIVE_SEEDS, (3, 4)),
             _at(30, SWEEP_METHODS + ("pb_sc_lwp",), (0,), **{"reference.lr": SWEEP_RATES}),
             # Adam without a pipeline did best at the sweep's top rate at 32 stages; rates
             # above it look for the baseline's best.
             _at(30, ("sgd",), (0,), **{"reference.lr": (4e-3, 8e-3)}),
             # PB + SC + LWP did best at the sweep's lowest rate at 32 stages; rates below it
             # look for its best.
             _at(30, ("pb_sc_lwp",), (0,), **{"reference.lr": (1e-5, 3e-5)}),
             _at(14, FIVE_SEEDS, (0, 1, 2)),
             _at(6, METHODS, (0, 1, 2)),
             _at(6, SWEEP_METHODS, (0,), **{"reference.lr": SWEEP_RATES}),
             # PB + Muon, the best asynchronous method of the grid (neither sizing run had it).
             _at(30, ("pb_muon",), (0,), **{"reference.lr": MUON_SWEEP_RATES}),
             _at(6, ("pb_muon",), (MUON_SEED_8,), **{"reference.lr": (1e-3,) + MUON_SWEEP_RATES})],
      baseline={"method": "sgd"}, margin=MARGIN,
      tables=[Table("Validation bits per byte", rows="model_kwargs.blocks", columns="method",
                    where=MAIN, **BITS),
              Table("Gap to Adam without a pipeline, paired by seed (bits per byte)",
                    rows="model_kwargs.blocks", columns="method", kind="gap", where=MAIN,
                    baseline_label="Adam without a pipeline", **BITS),
              Table(f"Learning-rate sweep at 8 stages ({SWEEP_TITLE})", rows="reference.lr",
                    columns="method", where=(("model_kwargs.blocks", 6), ("seed", 0)), **BITS),
              Table(f"PB + Muon's learning-rate sweep at 8 stages (bits per byte, seed "
                    f"{MUON_SEED_8}, on the CPU, every rate from the same weights)",
                    rows="reference.lr", columns="method",
                    where=(("model_kwargs.blocks", 6), ("seed", MUON_SEED_8)), **BITS),
              Table(f"Learning-rate sweep at 32 stages ({SWEEP_TITLE})", rows="reference.lr",
                    columns="method", where=(("model_kwargs.blocks", 30),), **BITS)],
      figures=[Figure("gap_vs_depth.png", x="model_kwargs.blocks", series="method", kind="gap",
                      where=MAIN, x_label="transformer blocks (stages - 2)",
                      title="Gap to Adam without a pipeline against depth",
                      metric="test_loss", **FIGURE_BITS),
               Figure("curves_32_stages.png", x="samples", series="method", kind="curves",
                      where=MAIN + (("model_kwargs.blocks", 30),), metric="test_loss",
                      title="Validation loss over training, 32 stages", **FIGURE_BITS),
               Figure("curves_8_stages.png", x="samples", series="method", kind="curves",
                      where=MAIN + (("model_kwargs.blocks", 6),), metric="test_loss",
                      title="Validation loss over training, 8 stages", **FIGURE_BITS)],
      sections=[Section("What this does not show", NOT_SHOWN)])
