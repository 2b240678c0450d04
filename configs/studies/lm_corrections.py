r"""Two corrections of the delay on Muon at 32 stages, piloted at lm_regime's budget on one seed;
one joins the budget study (configs/studies/lm_budget.py) only if it beats PipeDream + Muon.

    python scripts/study.py --study=configs/studies/lm_corrections.py \
        --workdir=docs/studies/lm_corrections --parallel=1
    python scripts/study.py --study=configs/studies/lm_corrections.py:smoke \
        --workdir=/tmp/corrections_smoke

Network, data and recipe: lm_regime's (the 32-stage transformer, micro-batch 1, 23,924
sequences, Muon with b1 0.9 and b2 0.99, cosine with warm-up), at PipeDream + Muon's best rate
there, 2e-3, seed 0, whose run (2.898 bits per byte) is copied into the records as the yardstick.

* (a) Linear Weight Prediction along Muon's applied step (the orthogonalised update times the
  rate: ``w + D (w − w_prev)``), not along the raw momentum that Muon orthogonalises; without
  stashing (``pb_muon_lwp``) and with the predicted weights stashed for the backward
  (``pipedream_muon_lwp``). ``pb_muon_sc_lwp`` predicts along the same applied step, with the
  momenta compensated too (``linear_weight_prediction(..., outermost=True)`` extrapolates the
  update the stage applied).
* (b) Per-stage momentum and rate by delay on PipeDream + Muon
  (``pipedream_muon_delay_adaptive``): Nesterov AsyncPP's momentum rule and PipeMare's rate,
  ``η / D`` annealed to ``η`` over 0.17 of the run, lm_regime's delay warm-up length.

Cost: three 32-stage pipelined runs at lm_regime's budget, 2,900 to 9,400 s each there (median
about 5,000 s) beside other trainers on the 2-core CPU: about 4 hours one at a time.

``:smoke`` runs the three on the 4-stage smoke network, one seed (CI).
"""

import math

from pipejax.study import Study, Table

BLOCKS = 30
WIDTH = 64
RATE = 2e-3
CORRECTIONS = ("pipedream_muon_lwp", "pb_muon_lwp", "pipedream_muon_delay_adaptive")
ANNEAL_FRACTION = 0.17
BITS_PER_NAT = 1 / math.log(2)
MARGIN = 0.02 / BITS_PER_NAT  # 0.02 bits per byte, in nats
BITS = {"metric": "test_loss", "scale": BITS_PER_NAT, "unit": "bits per byte"}
ANNEALING = {"method_kwargs.pipedream_muon_delay_adaptive.anneal_fraction": (ANNEAL_FRACTION,)}


def _grids(net: dict) -> list[dict]:
  cell = {**net, "reference.momentum": (0.9,), "reference.b2": (0.99,), "reference.lr": (RATE,),
          "seed": (0,)}
  return [{**cell, "method": ("pipedream_muon",)},
          {**cell, "method": CORRECTIONS[:2]},
          {**cell, "method": CORRECTIONS[2:], **ANNEALING}]


def get_study(arg: str | None = None) -> Study:
  if arg == "smoke":
    return Study(name="lm corrections (smoke)", config="configs/char_lm.py:smoke",
                 grids=_grids({"model_kwargs.blocks": (2,)}),
                 baseline={"method": "pipedream_muon"},
                 tables=[Table("Validation bits per byte", rows="method", columns="method",
                               kind="cells", **BITS)])
  if arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  return Study(
      name="lm corrections", config="configs/char_lm.py",
      grids=_grids({"model_kwargs.blocks": (BLOCKS,), "model_kwargs.width": (WIDTH,)}),
      baseline={"method": "pipedream_muon"}, margin=MARGIN,
      baseline_name=f"PipeDream + Muon at {RATE:g}, the best asynchronous method at x1",
      labels={"method_kwargs.pipedream_muon_delay_adaptive.anneal_fraction":
              "rate warm-up (of the run)"},
      tables=[Table("The corrections at 32 stages, seed 0: validation bits per byte and the gap "
                    "to PipeDream + Muon", rows="method", columns="method", kind="cells",
                    **BITS)])
