r"""The price of asynchrony at 32 stages: the sequences each method needs to reach a target loss,
from one run per budget, and the token tax against synchronous Muon.

    python scripts/study.py --study=configs/studies/lm_budget.py --workdir=docs/studies/lm_budget \
        --parallel=2 --where=epochs=1.333333,seed=0
    python scripts/study.py --study=configs/studies/lm_budget.py:smoke --workdir=/tmp/budget_smoke

The network, data and recipe are configs/studies/lm_regime.py's: the 32-stage transformer (30
blocks of width 64, one block per stage, delays up to 62), micro-batch 1, Muon (b1 0.9, b2 0.99
for its AdamW leaves), cosine with warm-up. The budget is the run's length in epochs of the
training split (35,887 sequences of 64 bytes): x0.5, x1, x2 and x4 of lm_regime's 23,924
sequences. A cosine schedule is shaped by its end, so each budget is its own run with the whole
schedule scaled to it: the warm-up stays 7.5% of the run.

The x1 cells are lm_regime's runs, copied into this study's records with their run identities
(the same overrides on the same config): Muon at 4e-3 (its best) and 2e-3, PipeDream + Muon at
2e-3 (its best) and 1e-3, PB + Muon at 2e-3 and 1e-3, and both at 8 sequences per update. Their
workdirs are gone, so they carry no training curve.

Each budget's rates: the x1 best and half of it at x2 (the best rate falls as runs lengthen),
the x1 best and twice it at x0.5; x4 at the rates best at x2. The methods:

* synchronous Muon at batch 1 (``method=muon``) and at batch 8 (``micro_batch_size=8``), the
  baselines: at 8 sequences per update a GPipe or 1F1B flush idles 31 of every 39 device-slots
  on 32 devices, which is the price the time-to-target section sets against the token tax;
* synchronous Muon at batch 32: under ZB-H1 on 32 devices its time per sequence is 0.44
  of batch 8's in the cost model, level with PipeDream-2BW at 8, so whether the synchronous
  pipeline at its best batch comes first turns on its token efficiency. Swept at x1 (8e-3,
  1.6e-2, 3.2e-2), then at x0.25, x0.5, x2 and x4 at the x1 best, two seeds at each budget, and
  at half of it at x2;
* synchronous Muon at batch 64, so that the synchronous batch is bracketed from above: under
  ZB-H2 its time per sequence is 0.79 of batch 32's (33.4 against 42.0 x 10^6 in the cost
  model), below PipeDream-2BW's at 32 per update, and at x4 batch 32 cost no more tokens than
  batch 8. Swept at x1 at batch 32's best, half and twice it, then at x0.5 and at x2 at the
  two best (seed 0);
* PipeDream + Muon at 1 and 8 sequences per update, the best asynchronous method at x1;
* PipeDream + Muon at 32 sequences per update, a pilot at x1 and x0.5 (seed 0; half of batch
  32's x1 best first, since PipeDream at 8 per update came out best at half of batch 8's, then
  that rate itself), then at x2 at its x1 best (1.6e-2) and half of it: under PipeDream-2BW
  its time per sequence is 0.81 of ZB-H2's at batch 32 in the cost model, so it comes first
  wherever its token tax against batch 32 is below 1.24x, and its delay in updates is a quarter
  of that at 8 per update;
* PB + Muon, the pipeline without stashing.

The baseline at batch 8 also runs at x0.125 and x0.25 (its x1 best rate, twice and four times
it, since the best rate rises as runs shorten): it is cheap (an eighth of the optimizer steps),
and a pipeline's x0.5 loss lies above the baseline's x0.5 loss, so the tax there needs a shorter
baseline budget to bracket it. At x1 and x2 it also runs at twice its best rate: lm_regime's
batch-8 sweep (4e-3 and 8e-3) ended at its best, and at x2 its best beat half of it. Twice its
best then came out best from x0.125 to x2, the highest rate tried from x0.5 up, so x0.5 to x2
also run at four times it (seed 0): the report's budgets table marks each budget whose best has
no tried rate on one side.

Order: the short baseline budgets first (minutes each), then x2 on seed 0
(``--where=epochs=1.333333,seed=0``), since the trend from x1 to x2 decides the rest; then x0.5
on seed 0, PipeDream + Muon at 8 sequences per update first among them (under PipeDream-2BW it
ties with ZB-H1 at batch 8 at a tax of 2.32x, where at 1 sequence per update it needs 0.89x,
and at x1 the two end level); then seed 1 for the best synchronous baseline (Muon at batch 8,
the sooner to every target measured), the best asynchronous method (PipeDream + Muon, at 1
and 8 sequences per update) and PB + Muon at x0.5 and x1 (where its tax is read), each at the
rate seed 0 found best at that budget; then x4, two seeds, for the baseline and the
asynchronous series whose tax falls with the budget (PipeDream + Muon at 8 sequences per update:
at 1 its tax shows no trend), which also tests whether under PipeDream-2BW it overtakes ZB-H1
at batch 8 at the lower targets (the two are level at 2.6 bits per byte in the x2 records).

Cost, measured on the 2-core CPU beside one to two other trainers (wall time of one run):
Muon at batch 8 6 to 11 minutes at x0.125 and x0.25, 15 to 35 at x0.5, 30 at x1, 122 at x2;
a 32-stage pipeline at batch 1 50 to 57 minutes at x0.5 and 49 to 90 at x1; PipeDream + Muon
at 8 sequences per update 127 minutes at x1; one-stage Muon at batch 1 33 to 100 minutes at x1.
Another machine of the same kind, with two or three trainers at a time, ran them 2.5 to 6 times
faster: a 32-stage pipeline at batch 1 23 minutes at x0.5, Muon at batch 8 21 to 33 at x2.
Run time scales with the budget. The grid below, without the x1 cells it copies: 12 runs at x2
(about 20 trainer-hours), 10 at x0.5 (about 7), the 8 extra baseline runs at x0.125 to x1 on seed 0
(about 1.5), the 12 seed-1 runs (about 14: the baseline's five about 3.5, PipeDream's x0.5 and x2
about 4.5, PipeDream's at 8 sequences per update about 4, PB + Muon's about 2) and 4 at x4 (the
baseline's about 8, PipeDream's about 10 each: 28): about 71 trainer-hours, or 36 hours of the
slower CPU at two trainers at a time, five to six sessions. x2 and x0.5 on seed 0 alone are
about 14 hours of that CPU. On the faster machine: the baseline's three runs at four times its
best about 1.5 trainer-hours (15, 30 and 35 minutes beside another trainer); PipeDream + Muon at 8
sequences per update 92 to 95 minutes at x2, so about 3.2 hours a run at x4, longer than a
session (each resumes from its checkpoint where the machine is kept); the baseline's four x4
runs about 65 minutes each: x4 is about 11 trainer-hours. Muon at batch 32 took 8 to 9 minutes a
run at x1 beside one other trainer and 17 at x2, so its eleven runs are about 2.5 trainer-hours;
PipeDream + Muon at 32 per update about as long as at 8 (one micro-batch a tick either way): 45
to 53 minutes a run at x1 and 102 at x2, so its five runs are about 5.5 trainer-hours. Muon at batch
64 took 3 minutes at x0.5, 8 to 10 a run at x1 and 25 at x2 (beside one to two trainers and the
test suite): its six runs about 1.3 trainer-hours.

``:smoke`` runs the 4-stage smoke network, one seed: Muon without a pipeline at two budgets and
PB + Muon at the longer, with the tokens-to-target section (CI).
"""

import math
import os

from pipejax.analysis import price
from pipejax.study import Section, Study, Table
from pipejax.study import budget as study_budget

BLOCKS = 30
WIDTH = 64
EPOCHS_X1 = 2 / 3  # lm_regime's 23,924 of 35,887 sequences
SEQUENCES_X1 = 23_924
WARMUP_FRACTION = 0.075  # of the run: lm_regime's 0.05 of an epoch over its 2/3
# Budget multipliers besides x1, whose runs are lm_regime's. Epochs are written to six places so
# that a run's identity and a --where read as typed.
BUDGETS = (0.5, 2.0, 4.0)
SEQUENCES_PER_UPDATE = 8
# (method, extra overrides, x1 best rate); the x1 best of each from lm_regime's records.
MUON = ("muon", {}, 4e-3)
MUON_BATCH = ("muon", {"micro_batch_size": (SEQUENCES_PER_UPDATE,),
                       "reference.batch_size": (SEQUENCES_PER_UPDATE,)}, 8e-3)
PIPEDREAM = ("pipedream_muon", {}, 2e-3)
PIPEDREAM_BATCH = ("pipedream_muon", {
    "method_kwargs.pipedream_muon.micro_batches": (SEQUENCES_PER_UPDATE,),
    "reference.batch_size": (SEQUENCES_PER_UPDATE,)}, 8e-3)
PB_MUON = ("pb_muon", {}, 2e-3)
# Synchronous Muon at 32 sequences per update: under ZB-H1 on 32 devices its time per sequence is
# 0.44 of batch 8's (the cost model), level with PipeDream-2BW at 8, so the time comparison turns
# on its token efficiency. Swept at x1 (1.6e-2 best, bracketed on both sides), then run at that
# rate at every budget on two seeds, and at half of it at x2 (the best rate falls as runs
# lengthen).
WIDE_BATCH = 32
MUON_WIDE = ("muon", {"micro_batch_size": (WIDE_BATCH,),
                      "reference.batch_size": (WIDE_BATCH,)}, 1.6e-2)
WIDE_RATES_X1 = (8e-3, 1.6e-2, 3.2e-2)
# x0.25 so that its curve brackets the targets its x0.5 runs already pass (3.0 to 3.2).
WIDE_BUDGETS = (0.25, 0.5, 2.0, 4.0)
# Synchronous Muon at 64 sequences per update, so that the synchronous batch is bracketed from
# above: under ZB-H2 its time per sequence is 0.79 of batch 32's (the cost model), and at x4
# batch 32 cost no more tokens than batch 8. Swept at x1 at batch 32's best, half and twice it
# (3.2e-2 and 1.6e-2 level within 0.001 bits per byte, 8e-3 0.15 above), then run at x2 at the
# two level rates and at x0.5, so that its curve brackets the targets its x1 run passes.
LARGE_BATCH = 64
MUON_LARGE = ("muon", {"micro_batch_size": (LARGE_BATCH,),
                       "reference.batch_size": (LARGE_BATCH,)}, 1.6e-2)
# budget multiplier: rates (seed 0); x0.5 at the higher, since the best rate rises as runs shorten
LARGE_RATES = {0.5: (3.2e-2,), 2.0: (1.6e-2, 3.2e-2)}
# PipeDream + Muon at 32 sequences per update: a pilot at x1 at half and at the whole of batch
# 32's x1 best, and at x0.5 at half of it, so that its tax against batch 32 has two budgets; then
# at x2 at its x1 best (1.6e-2) and half of it, since its tax fell the fastest of the
# asynchronous series from x0.5 to x1 and x2 tests that first.
PIPEDREAM_WIDE = ("pipedream_muon", {
    "method_kwargs.pipedream_muon.micro_batches": (WIDE_BATCH,),
    "reference.batch_size": (WIDE_BATCH,)}, 1.6e-2)
PIPEDREAM_WIDE_RATES_X1 = (8e-3, 1.6e-2)
PIPEDREAM_WIDE_RATES = {0.5: (8e-3,), 2.0: (8e-3, 1.6e-2)}  # budget multiplier: rates (seed 0)
METHODS = (MUON, MUON_BATCH, PIPEDREAM, PIPEDREAM_BATCH, PB_MUON)
# Seed 1 for the best synchronous baseline (batch 8: the sooner to every target measured), the
# best asynchronous methods (PipeDream + Muon at 1 sequence per update, the lower tax; at 8, the
# sooner on time) and PB + Muon where it has a tax (x0.5 and x1), at each budget at the rate seed
# 0 found best there (batch 8 up to x1: twice its x1 best, level with its x1 best within 0.005
# bits per byte at x0.5 and x1).
SECOND_SEED = ((MUON_BATCH, {0.125: 1.6e-2, 0.25: 1.6e-2, 0.5: 1.6e-2, 1.0: 1.6e-2, 2.0: 8e-3}),
               (PIPEDREAM, {0.5: 2e-3, 2.0: 2e-3}),
               (PIPEDREAM_BATCH, {0.5: 8e-3, 1.0: 8e-3, 2.0: 8e-3}),
               (PB_MUON, {0.5: 2e-3, 1.0: 2e-3}))
# PipeDream + Muon at 8 sequences per update came out best at x2 at half its x1 best (4e-3 on
# seed 0, 0.07 bits per byte below 8e-3), the lowest rate it tried there, and level with it at
# x1 (0.003 below): so it also runs at a quarter of it at x2, at half of it at x0.5 (where twice
# it lost), and at half of it on seed 1 at x1 and x2, so that those points keep two seeds.
# (budget multiplier, rate, seed) of each.
RETUNED_PIPEDREAM_BATCH = ((2.0, 2e-3, 0), (0.5, 4e-3, 0), (2.0, 4e-3, 1), (1.0, 4e-3, 1))
# lm_regime's seed-1 runs at x1, copied: Muon at batch 1 and PipeDream + Muon.
SECOND_SEED_X1 = (MUON, PIPEDREAM)
# x4 only for these, two seeds each (2.7 epochs of the training split): the cheap baseline at
# both of its x2 rates, level there within 0.003 bits per byte; PipeDream + Muon at 8 sequences
# per update at its x2 best.
LONGEST = ((MUON_BATCH, (1.6e-2, 8e-3)), (PIPEDREAM_BATCH, (4e-3,)))
# Budgets below x0.5 for the cheap baseline only: a pipeline's loss at x0.5 lies above what the
# baseline reaches at x0.5, and its tax there needs the baseline's curve to bracket that loss.
SHORT = (0.125, 0.25)
BITS_PER_NAT = 1 / math.log(2)
BITS = {"metric": "test_loss", "scale": BITS_PER_NAT, "unit": "bits per byte"}
# Target losses of the tokens-to-target table, in bits per byte: from the x2 baseline's 2.31 up
# to where the pipelines' x0.5 runs end.
TARGETS_BITS = (2.3, 2.4, 2.5, 2.6, 2.7, 2.8, 2.9, 3.0, 3.1, 3.2)
NUM_DEVICES = 32
# The stage costs of this network (scripts/price.py), beside this study's records.
STAGE_COSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                           "studies", "lm_budget", "stage_costs.json")


def epochs(multiplier: float) -> float:
  return round(EPOCHS_X1 * multiplier, 6)


def _rates(multiplier: float, best: float) -> tuple:
  return (best, best * 2) if multiplier < 1 else (best, best / 2)


def _schedule(multiplier: float) -> dict:
  """The schedule's overrides of a budget; none at x1, whose runs are lm_regime's (the config's
  own schedule), so that a run there has lm_regime's identity."""
  if multiplier == 1:
    return {}
  return {"epochs": (epochs(multiplier),),
          "warmup_epochs": (round(epochs(multiplier) * WARMUP_FRACTION, 6),)}


def _cell(method, extra: dict, rates: tuple, seeds: tuple, schedule: dict) -> dict:
  return {"model_kwargs.blocks": (BLOCKS,), "model_kwargs.width": (WIDTH,), "method": (method,),
          "reference.momentum": (0.9,), "reference.b2": (0.99,), **extra, **schedule,
          "reference.lr": rates, "seed": seeds}


def _grids() -> list[dict]:
  m, extra, best = MUON_BATCH
  grids = [_cell(m, extra, (best, best * 2, best * 4), (0,), _schedule(multiplier))
           for multiplier in SHORT]
  # x1 and x2 at twice its best: lm_regime's batch-8 sweep (4e-3, 8e-3) ended at its best, and at
  # x2 its best beat half of it, so each bracket needs the rate above. At x2 that rate was the
  # best on seed 0, so it has seed 1 too.
  grids.append(_cell(m, extra, (best * 2,), (0,), {}))
  grids.append(_cell(m, extra, (best * 2,), (0, 1), _schedule(2.0)))
  # Four times its best at x0.5 to x2, where twice it is the best and the highest rate tried. It
  # lost at x0.25, but the best rate did not fall from x0.125 to x2, so the baseline's bracket
  # from above is measured rather than assumed.
  grids += [_cell(m, extra, (best * 4,), (0,), _schedule(multiplier))
            for multiplier in (0.5, 1.0, 2.0)]
  for multiplier in (2.0, 0.5):  # every method at the x1 best rate first, then the other rate
    for rate_of in (lambda rates: rates[:1], lambda rates: rates[1:]):
      grids += [_cell(m, extra, rate_of(_rates(multiplier, best)), (0,), _schedule(multiplier))
                for m, extra, best in METHODS]
  for (m, extra, _), rates in SECOND_SEED:
    grids += [_cell(m, extra, (rate,), (1,), _schedule(multiplier))
              for multiplier, rate in rates.items()]
  grids += [_cell(m, extra, (best,), (1,), {}) for m, extra, best in SECOND_SEED_X1]
  m, extra, _ = PIPEDREAM_BATCH
  grids += [_cell(m, extra, (rate,), (seed,), _schedule(multiplier))
            for multiplier, rate, seed in RETUNED_PIPEDREAM_BATCH]
  grids += [_cell(m, extra, rates, (0, 1), _schedule(4.0)) for (m, extra, _), rates in LONGEST]
  m, extra, best = MUON_WIDE
  grids.append(_cell(m, extra, WIDE_RATES_X1, (0,), {}))
  grids.append(_cell(m, extra, (best,), (1,), {}))
  grids += [_cell(m, extra, (best,), (0, 1), _schedule(multiplier))
            for multiplier in WIDE_BUDGETS]
  grids.append(_cell(m, extra, (best / 2,), (0,), _schedule(2.0)))
  m, extra, best = MUON_LARGE
  grids.append(_cell(m, extra, (best, best / 2, best * 2), (0,), {}))
  grids += [_cell(m, extra, rates, (0,), _schedule(multiplier))
            for multiplier, rates in LARGE_RATES.items()]
  m, extra, _ = PIPEDREAM_WIDE
  grids.append(_cell(m, extra, PIPEDREAM_WIDE_RATES_X1, (0,), {}))
  grids += [_cell(m, extra, rates, (0,), _schedule(multiplier))
            for multiplier, rates in PIPEDREAM_WIDE_RATES.items()]
  # x1: lm_regime's runs (no schedule keys: the config's own), copied, never trained here.
  grids += [_cell(m, extra, _rates(1.0, best), (0,), {}) for m, extra, best in METHODS]
  return grids


def _series() -> tuple:
  """The tokens-to-target table's rows: (label, where) of each method at each batch."""
  def where(method, extra):
    batch = extra.get("micro_batch_size") or extra.get(
        "method_kwargs.pipedream_muon.micro_batches")
    pairs = [("method", method), ("reference.batch_size", batch[0] if batch else None)]
    return tuple(pairs)
  return (("Muon, no pipeline, batch 1", where(*MUON[:2])),
          (f"Muon, no pipeline, batch {SEQUENCES_PER_UPDATE}", where(*MUON_BATCH[:2])),
          (f"Muon, no pipeline, batch {WIDE_BATCH}", where(*MUON_WIDE[:2])),
          (f"Muon, no pipeline, batch {LARGE_BATCH}", where(*MUON_LARGE[:2])),
          ("PipeDream + Muon, 1 sequence per update", where(*PIPEDREAM[:2])),
          (f"PipeDream + Muon, {SEQUENCES_PER_UPDATE} sequences per update",
           where(*PIPEDREAM_BATCH[:2])),
          (f"PipeDream + Muon, {WIDE_BATCH} sequences per update", where(*PIPEDREAM_WIDE[:2])),
          ("PB + Muon", where(*PB_MUON[:2])))


def _time_to_target(tokens: study_budget.TokensToTarget) -> price.TimeToTarget:
  """Each synchronous series under every synchronous schedule at its batch; PipeDream at 1
  sequence per update under PipeDream's schedule, at 8 and 32 under PipeDream-2BW's; PB under
  PB's."""
  labels = [label for label, _ in tokens.series]
  (batch_one, batch_many, batch_wide, batch_large, pipedream, pipedream_many, pipedream_wide,
   pb) = labels
  runs = ([(batch_one, s, 1) for s in price.SYNCHRONOUS] +
          [(batch_many, s, SEQUENCES_PER_UPDATE) for s in price.SYNCHRONOUS] +
          [(batch_wide, s, WIDE_BATCH) for s in price.SYNCHRONOUS] +
          [(batch_large, s, LARGE_BATCH) for s in price.SYNCHRONOUS] +
          [(pipedream, "pipedream", 1), (pipedream_many, "2bw", SEQUENCES_PER_UPDATE),
           (pipedream_wide, "2bw", WIDE_BATCH), (pb, "pb", 1)])
  return price.TimeToTarget(tokens, tuple(runs), STAGE_COSTS, NUM_DEVICES,
                           goal_samples=SEQUENCES_X1)


def _smoke() -> Study:
  cell = {"model_kwargs.blocks": (2,), "seed": (0,)}
  # The baseline at two budgets, so that its curve brackets targets; PB + Muon at the longer.
  grids = [{**cell, "method": (m,), "epochs": (e,), "warmup_epochs": (round(e * 0.075, 6),)}
           for m, e in (("muon", 0.5), ("muon", 1.0), ("pb_muon", 1.0))]
  series = (("Muon, no pipeline", (("method", "muon"),)), ("PB + Muon", (("method", "pb_muon"),)))
  return Study(name="lm budget (smoke)", config="configs/char_lm.py:smoke", grids=grids,
               baseline={"method": "muon"},
               tables=[Table("Validation bits per byte, every run", rows="method",
                             columns="method", kind="cells", **BITS)],
               sections=[Section("Tokens to a target loss", study_budget.TokensToTarget(
                   series=series, baseline="Muon, no pipeline", targets=(4.0, 4.5),
                   scale=BITS_PER_NAT, unit="bits per byte"))])


def get_study(arg: str | None = None) -> Study:
  if arg == "smoke":
    return _smoke()
  if arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  tokens = study_budget.TokensToTarget(
      series=_series(), baseline="Muon, no pipeline, batch 1",
      synchronous=("Muon, no pipeline, batch 1",
                   f"Muon, no pipeline, batch {SEQUENCES_PER_UPDATE}",
                   f"Muon, no pipeline, batch {WIDE_BATCH}",
                   f"Muon, no pipeline, batch {LARGE_BATCH}"),
      targets=TARGETS_BITS, scale=BITS_PER_NAT, unit="bits per byte")
  return Study(
      name="lm budget", config="configs/char_lm.py", grids=_grids(),
      baseline={"method": "muon", "reference.lr": MUON[2], "reference.batch_size": None},
      baseline_name=f"Muon without a pipeline at {MUON[2]:g}, batch 1",
      labels={"muon": "Muon, no pipeline", "epochs": "budget (epochs)",
              "reference.batch_size": "sequences per update"},
      tables=[Table("Validation bits per byte, every run", rows="method", columns="method",
                    kind="cells", **BITS)],
      sections=[Section("Tokens to a target loss", tokens),
                Section(f"Time to a target loss on {NUM_DEVICES} devices",
                        _time_to_target(tokens))])
