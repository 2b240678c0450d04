r"""Language-model regime study at 32 stages: which betas, rate and method let a pipeline match the
best synchronous baseline, and why the paper's compensation fails where it does.

    python scripts/study.py --study=configs/studies/lm_regime.py --workdir=docs/studies/lm_regime \
        --parallel=2 --where=method=sgd
    python scripts/study.py --study=configs/studies/lm_regime.py:smoke --workdir=/tmp/regime_smoke

The network is configs/studies/lm_depth.py's 32-stage transformer (30 blocks of width 64, 4
heads, one block per stage, delays up to 62), on the same data and schedule: micro-batch 1,
23,924 sequences of 64 bytes (two thirds of an epoch), AdamW with the decay mask and decay
0.01, cosine with warm-up.
Validation loss is reported in bits per byte.

The study runs in phases, each a ``--where`` part of the grid chosen from the records of the one
before:

1. baselines (``--where=method=sgd``): Adam without a pipeline over b1 in {0.9, 0.99, 0.999} x
   b2 in {0.99, 0.999, 0.9999} where b1² < b2 (8 settings), each at the rates 1e-3, 2e-3 and 4e-3
   (lm_depth's sweep put the 0.9 / 0.99 baseline's best at 4e-3), seed 0; and Muon without a
   pipeline (``--where=method=muon``: ``pb_muon``'s parameter split as one stage) at the same
   three rates and at 8e-3, since the best of the three was the largest. The best cell of this
   phase over two or more seeds is the baseline of every gap, whatever its optimizer (Muon at
   4e-3; the final table also sets each method against Adam's best).
2. methods at b1 0.9, b2 0.99, seed 0: PB, PB + SC, PB + SC + LWP, PipeOptim, PB + error
   feedback and the Nesterov AsyncPP preset at the rates 1e-4, 3e-4 and 1e-3 (lm_depth put their
   best between 3e-5 and 6e-4); PB + Muon and PB + Muon + SC + LWP at Muon's rates 1e-3, 2e-3 and
   4e-3; Nesterov AsyncPP as its authors released it at their b1 0.99, b2 0.999 and the Adam
   rates; PB + error feedback also with its trend smoothed (0.9 and 0.99) at 3e-4 and 1e-3, and
   PB + Muon + error feedback (the pairing Zmushko et al. 2026 found most robust) with the same
   two smoothings at 2e-3; and two PB + Muon variants at 2e-3, one for each part of the
   delay's harm: PipeDream + Muon (weight stashing removes the forward/backward mismatch) and
   PB + Muon with a delay warm-up (each stage's rate starts at η / D and anneals to η over the
   first 0.17 of the run, 4,067 steps, where PB + Muon makes most of its gap); PipeDream + Muon,
   ahead of PB + Muon at every evaluation, also at 1e-3 and 4e-3; and Muon's momentum (its b1,
   also its NAdamW leaves'), raised from 0.9 to 0.98 so that D_max (1 - b1) falls from 6.2 to
   1.2, for Muon without a pipeline at its best rate and PipeDream + Muon and PB + Muon + SC +
   LWP at theirs (``--where=reference.momentum=0.98``): the hypothesis says compensation and
   prediction gain as D (1 - b1) falls; and accumulation (``--where=reference.batch_size=8``):
   PipeDream + Muon applying one update per 8 sequences, the mean of their gradients, so that a
   gradient is stale by about D / 8 updates (at most 8 rather than 62), beside Muon without a
   pipeline at the same batch of 8 (``micro_batch_size=8``), each at three rates; the recipe is
   stated at that batch, so no scaling rule changes it. A method's pilot is
   ``--where=method=NAME,reference.lr=0.001`` (Muon's: ``0.002``).
   The other beta settings join this phase where the baselines put Adam within 0.1 bits per byte
   of its best. The mechanism grid's other settings (PB, PB + SC, PB + SC + LWP and PipeOptim at
   b1 0.99, b2 0.999 and b1 0.999, b2 0.9999, rate 1e-3) are trained to the end too, so that its
   report can set their mismatch beside their loss at every b1.
3. the final table (``--where=seed=1|2|3|4``): the baseline (Muon at 4e-3), the best
   asynchronous method of the pilots (PipeDream + Muon, 2.90 at 2e-3 against PB + Muon's 3.06;
   2.98 at 1e-3 and 3.06 at 4e-3)
   and the paper's method at its best setting (PB + Muon + SC + LWP: on Adam,
   lm_depth's sweep never took it below 3.98), each at its pilot's best rate, five paired seeds;
   and Adam's best without a pipeline (2e-3 at b1 0.9, b2 0.99) on the same seeds, for a second
   gap table against Adam, since the study asks whether a pipeline reaches Adam's loss.

Cost. Measured beside two to five other trainers on the 2-core CPU (the records'
``train_seconds``), a pipelined Muon-family run trains for 5,000 to 7,600 s, a one-stage Muon
run for 3,300 to 4,900 s and a one-stage Adam run for 1,200 to 3,300 s; with two trainers at a
time on a quiet CPU, lm_depth's one-stage and pipelined Adam runs took 575 to 1,540 s. At the
medians of this study's records (``wall_seconds``: about 4,900 s for a Muon-family run, one
stage or pipelined, 2,300 s for a one-stage Adam run) the whole grid (98 runs) is about 80 hours
of trainers. The study was given about 20 hours of this CPU; its records hold about 38 hours of
run time, and the runs left about 40 hours more. The report's section "What the grid did not
train" says which runs were left and why: each was decided by a run that was trained (a pruning
rule, or lm_depth's cells of the same network), or left for the budget.

``:smoke`` runs the 4-stage smoke network on 1,500 sequences: Adam without a pipeline at two beta
settings and PB, one seed each (CI).
"""

import math

from pipejax.study import Figure, Section, Study, Table
from pipejax.study import cells as study_cells

BLOCKS = 30
WIDTH = 64
BETAS = tuple((b1, b2) for b1 in (0.9, 0.99, 0.999) for b2 in (0.99, 0.999, 0.9999)
              if b1 * b1 < b2)
BASELINE_RATES = (1e-3, 2e-3, 4e-3)
MUON_BASELINE_RATES = (*BASELINE_RATES, 8e-3)  # its best of the three was the largest, 4e-3
ADAM_METHODS = ("pb", "pb_sc", "pb_sc_lwp", "pipeoptim", "pb_error_feedback", "nesterov_asyncpp")
ADAM_METHOD_RATES = (1e-4, 3e-4, 1e-3)
MUON_METHODS = ("pb_muon", "pb_muon_sc_lwp")
# Error feedback's trend decay: at 0 (its default) the applied update is u_t + D (u_t - u_{t-1}),
# the difference of two one-sample updates magnified D-fold.
ERROR_FEEDBACK_SMOOTHING = (0.9, 0.99)
# PB + Muon's gap to Muon is made in the first 4,000 sequences (0.72 bits per byte there, 0.57 at
# the end): the delay warm-up anneals over them, 0.17 of the run's 23,924 steps.
DELAY_WARMUP_FRACTION = 0.17
# Muon's momentum, raised towards the hypothesis's D_max (1 - b1) < 1 (1.2 at 0.98), where the
# b2 of 0.99 still exceeds b1².
MUON_MOMENTA = (0.98,)
# Sequences per update of the accumulation phase: D_max / 8 < 8 updates of staleness. Muon
# without a pipeline at this batch and 8e-3 reached 2.487 bits per byte, batch 1's best 2.495.
ACCUMULATION = 8
ACCUMULATION_RATES = (4e-3, 8e-3, 1.6e-2)
# The mechanism grid's (scripts/mechanism.py) other settings, trained to the end for their losses.
MECHANISM_METHODS = ("pb", "pb_sc", "pb_sc_lwp", "pipeoptim")
MECHANISM_BETAS = ((0.99, 0.999), (0.999, 0.9999))
# The lowest run of the baselines phase, the baseline of every gap: Muon's best rate (its table).
BEST_BASELINE = {"method": "muon", "reference.lr": 4e-3, "reference.momentum": 0.9,
                 "reference.b2": 0.99}
# The final table (phase 3): the baseline, the best asynchronous method and the paper's method at
# its best setting, each at its pilot's best rate, on five paired seeds (seed 0: the pilot's run).
# The paper's method on Muon (3.73 bits per byte at 2e-3, seed 0) is its best: on Adam, lm_depth's
# sweep from 1e-5 to 2e-3 never went below 3.98.
FINAL_SEEDS = (0, 1, 2, 3, 4)
FINAL = (("muon", 4e-3), ("pipedream_muon", 2e-3), ("pb_muon_sc_lwp", 2e-3))
# Adam's best without a pipeline (b1 0.9, b2 0.99: 2.84 bits per byte at 2e-3, seed 0) on the
# same seeds: the final table also sets each method against it, since the question the study
# started from is whether a pipeline reaches Adam's loss.
FINAL_ADAM = ("sgd", 2e-3)
FINAL_BETAS = (0.9, 0.99)
BITS_PER_NAT = 1 / math.log(2)
MARGIN = 0.02 / BITS_PER_NAT  # 0.02 bits per byte, in the metric's nats
BITS = {"metric": "test_loss", "scale": BITS_PER_NAT, "unit": "bits per byte"}


def _betas(b1: float, b2: float) -> dict:
  return {"reference.momentum": (b1,), "reference.b2": (b2,)}


def _baselines(seeds=(0,)) -> list[dict]:
  return [{"model_kwargs.blocks": (BLOCKS,),
           "model_kwargs.width": (WIDTH,), "method": ("sgd",), **_betas(b1, b2),
           "reference.lr": BASELINE_RATES, "seed": tuple(seeds)} for b1, b2 in BETAS]


def _muon_baselines(seeds=(0,)) -> list[dict]:
  return [{"model_kwargs.blocks": (BLOCKS,), "model_kwargs.width": (WIDTH,), "method": ("muon",),
           **_betas(0.9, 0.99), "reference.lr": MUON_BASELINE_RATES, "seed": tuple(seeds)}]


def _methods(seeds=(0,)) -> list[dict]:
  net = {"model_kwargs.blocks": (BLOCKS,), "model_kwargs.width": (WIDTH,), "seed": tuple(seeds)}
  return [{**net, "method": ADAM_METHODS, **_betas(0.9, 0.99), "reference.lr": ADAM_METHOD_RATES},
          {**net, "method": MUON_METHODS, **_betas(0.9, 0.99), "reference.lr": BASELINE_RATES},
          {**net, "method": ("nesterov_asyncpp_released",), **_betas(0.99, 0.999),
           "reference.lr": ADAM_METHOD_RATES},
          {**net, "method": ("pb_error_feedback",), **_betas(0.9, 0.99),
           "reference.lr": (3e-4, 1e-3),
           "method_kwargs.pb_error_feedback.smoothing": ERROR_FEEDBACK_SMOOTHING},
          {**net, "method": ("pb_muon_error_feedback",), **_betas(0.9, 0.99),
           "reference.lr": (2e-3,),
           "method_kwargs.pb_muon_error_feedback.smoothing": ERROR_FEEDBACK_SMOOTHING},
          {**net, "method": ("pipedream_muon",), **_betas(0.9, 0.99),
           "reference.lr": BASELINE_RATES},
          {**net, "method": ("pb_muon_delay_warmup",), **_betas(0.9, 0.99),
           "reference.lr": (2e-3,),
           "method_kwargs.pb_muon_delay_warmup.anneal_fraction": (DELAY_WARMUP_FRACTION,)}] + [
              {**net, "method": (method,), **_betas(b1, 0.99), "reference.lr": (lr,)}
              for b1 in MUON_MOMENTA for method, lr in FINAL] + [
              {**net, "method": MECHANISM_METHODS, **_betas(b1, b2), "reference.lr": (1e-3,)}
              for b1, b2 in MECHANISM_BETAS]


def _accumulation() -> list[dict]:
  batch = {"model_kwargs.blocks": (BLOCKS,), "model_kwargs.width": (WIDTH,), **_betas(0.9, 0.99),
           "reference.batch_size": (ACCUMULATION,), "reference.lr": ACCUMULATION_RATES,
           "seed": (0,)}
  return [{**batch, "method": ("muon",), "micro_batch_size": (ACCUMULATION,)},
          {**batch, "method": ("pipedream_muon",),
           "method_kwargs.pipedream_muon.micro_batches": (ACCUMULATION,)}]


def _final() -> list[dict]:
  return [{"model_kwargs.blocks": (BLOCKS,), "model_kwargs.width": (WIDTH,), "method": (method,),
           **_betas(*FINAL_BETAS), "reference.lr": (lr,), "seed": FINAL_SEEDS}
          for method, lr in (*FINAL, FINAL_ADAM)]


OTHER_PARTS = """\
The study's other parts are reported beside this one:

* where each method holds, by D_max (1 − β), over this study's runs and those of `lm_depth`,
  `depth` and `mlp_regime`, with the non-inferiority verdicts at each study's margin (0.02 bits
  per byte here, half a point on the MLP) and the product's warning thresholds beside them:
  [the phase diagram](../phase/report.md);
* the mechanism per stage (forward/backward weight mismatch and the delayed gradient's cosine
  with the current one): on Adam at b1 0.9, 0.99 and 0.999,
  [mechanism](../mechanism/report.md); on Muon, [mechanism_muon](../mechanism_muon/report.md);
* the deep MLP at 128 and 256 stages: [mlp_regime](../mlp_regime/report.md)."""


# How far above Adam's best a beta setting's pilot may end and still bring its other rates and
# the methods to that setting.
BETA_PRUNING = 0.1  # bits per byte


def _beta_pruning(records, _workdir) -> str:
  """Each beta setting's Adam pilot at 2e-3 (seed 0) against Adam's best seed-0 run, and what the
  pruning rule makes of it."""
  where = (("method", FINAL_ADAM[0]), ("reference.lr", FINAL_ADAM[1]), ("seed", 0),
           ("micro_batch_size", None))
  pilots = {(r.overrides["reference.momentum"], r.overrides["reference.b2"]):
            r.test_loss * BITS_PER_NAT
            for r in study_cells.select(records, where) if r.status == "finished"}
  if not pilots:
    return "No beta setting's pilot is recorded yet."
  best = min(pilots.values())
  lines = [f"Adam without a pipeline at {FINAL_ADAM[1]:g}, seed 0, by beta setting; a setting "
           f"whose pilot ends more than {BETA_PRUNING:g} bits per byte above the best brings "
           "nothing more to the grid.", "",
           "| b1 | b2 | bits per byte | above the best | its other rates and the methods |",
           "|---|---|---|---|---|"]
  for b1, b2 in BETAS:
    if (b1, b2) not in pilots:
      lines.append(f"| {b1:g} | {b2:g} | not trained | — | undecided |")
      continue
    above = pilots[(b1, b2)] - best
    verdict = ("the best" if above == 0 else "due" if above <= BETA_PRUNING else "pruned")
    lines.append(f"| {b1:g} | {b2:g} | {pilots[(b1, b2)]:.3f} | +{above:.3f} | {verdict} |")
  return "\n".join(lines)


NOT_TRAINED = """\
The grid is the study as designed; the header above counts the runs recorded. The others were
not trained, for these reasons:

* **Decided by a rule and a run.** Adam at each other beta setting is trained at 2e-3 first, its
  other two rates only where that run ends within 0.1 bits per byte of Adam's best, and the
  Adam-family methods at a setting only where Adam does: the next section gives each setting's
  pilot.
* **Decided by `lm_depth`.** It trained PB, PB + SC, PB + SC + LWP, PipeOptim and Nesterov
  AsyncPP on this network, data and schedule at 32 stages, at 1e-3 over three to five seeds
  (0.47 to 1.46 bits per byte behind Adam there), and PB + SC + LWP and Nesterov AsyncPP over
  seven and five rates on seed 0 (best 3.98 and 3.42, against Adam's 2.83 on that seed), PB +
  Muon over four (best 3.05). The phase diagram holds those cells; this study trains only what
  `lm_depth` lacks.
* **Left for the budget** (the study was given about 20 hours of this CPU; the header gives the
  run time its records hold): PB + Muon + SC + LWP's seeds 2 to 4 in the final table (two put
  it 1.23 bits per byte above the baseline, 60 times the margin), Nesterov AsyncPP as released
  at its other rates, PB + Muon + SC + LWP at 1e-3 and 4e-3, error feedback's smoothed variants,
  Muon's momentum at 0.98, accumulation at 4e-3 and 1.6e-2, the mechanism grid's other
  settings trained to the end, Adam's pilots at b1 0.999 (single runs outside the grid at 1e-3,
  in docs/lm.md's "How to choose β", put them at 4.08 and 4.40), and what the rule makes due at
  b1 0.99, b2 0.99, whose pilot ended within 0.1 of Adam's best: Adam's other two rates there
  and the methods."""


def _final_cells(method_rates) -> tuple:
  """A table's or figure's ``where`` for the final table's runs of ``method_rates`` ((method,
  rate) pairs): each method at its own rate, at the final betas and batch 1."""
  return ((("method", "reference.lr"), tuple(method_rates)), ("reference.momentum", FINAL_BETAS[0]),
          ("reference.b2", FINAL_BETAS[1]), ("reference.batch_size", None))


def get_study(arg: str | None = None) -> Study:
  if arg == "smoke":
    grids = [{"method": ("sgd",), **_betas(b1, b2), "seed": (0,)}
             for b1, b2 in ((0.9, 0.99), (0.99, 0.999))]
    grids.append({"method": ("pb",), **_betas(0.9, 0.99), "seed": (0,)})
    return Study(name="lm regime (smoke)", config="configs/char_lm.py:smoke", grids=grids,
                 fixed={"model_kwargs.blocks": 2}, baseline={"method": "sgd"}, margin=MARGIN,
                 tables=[Table("Validation bits per byte, every run", rows="method",
                               columns="method", kind="cells", **BITS)])
  if arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  return Study(
      name="lm regime", config="configs/char_lm.py",
      grids=_baselines() + _muon_baselines() + _methods() + _accumulation() + _final(),
      baseline=BEST_BASELINE, margin=MARGIN,
      baseline_name=(f"Muon without a pipeline at {BEST_BASELINE['reference.lr']:g}, the best "
                     "baseline"),
      labels={"sgd": "Adam, no pipeline", "muon": "Muon, no pipeline", "reference.momentum": "b1",
              "reference.b2": "b2", "method_kwargs.pb_error_feedback.smoothing": "trend smoothing",
              "method_kwargs.pb_muon_error_feedback.smoothing": "trend smoothing",
              "method_kwargs.pb_muon_delay_warmup.anneal_fraction": "delay warm-up (of the run)",
              "method_kwargs.pipedream_muon.micro_batches": "sequences per update",
              "reference.batch_size": "batch of the recipe"},
      tables=[Table("Adam without a pipeline: validation bits per byte by betas and rate",
                    rows="reference.lr", columns="method", kind="cells",
                    where=(("method", "sgd"),), **BITS),
              Table("Muon without a pipeline (b2 0.99 for its AdamW leaves): validation "
                    "bits per byte by b1 and rate", rows="reference.lr", columns="method",
                    kind="cells",
                    where=(("method", "muon"),), **BITS),
              Table("The final table at 32 stages: the gap to the best baseline, paired by seed, "
                    "each method at its pilot's best rate (bits per byte)",
                    rows="reference.lr", columns="method", kind="gap",
                    where=_final_cells(FINAL), **BITS),
              Table("The final table against Adam's best without a pipeline (b1 0.9, b2 0.99, "
                    f"{FINAL_ADAM[1]:g}), paired by seed (bits per byte)",
                    rows="reference.lr", columns="method", kind="gap",
                    where=_final_cells((FINAL_ADAM, *FINAL[1:])),
                    baseline=(("method", FINAL_ADAM[0]), ("reference.lr", FINAL_ADAM[1]),
                              ("reference.momentum", FINAL_BETAS[0]),
                              ("reference.b2", FINAL_BETAS[1])),
                    baseline_label=f"Adam without a pipeline at {FINAL_ADAM[1]:g}", **BITS),
              Table("Pipelined methods at 32 stages: validation bits per byte by betas and rate, "
                    "beside Adam's and Muon's", rows="reference.lr", columns="method",
                    kind="cells", **BITS)],
      figures=[Figure("final_curves.png", x="samples", series="method", kind="curves",
                      where=_final_cells((*FINAL, FINAL_ADAM)), metric="test_loss",
                      title="The final table's methods over training, 32 stages, mean of the "
                      "seeds", scale=BITS_PER_NAT, unit="bits per byte")],
      sections=[Section("What the grid did not train", NOT_TRAINED),
                Section("Adam's beta settings: the pruning rule's pilots", _beta_pruning),
                Section("The rest of the study", OTHER_PARTS)])
