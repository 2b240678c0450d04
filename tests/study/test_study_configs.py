"""What the study configs compute themselves: lm_regime's pruning of Adam's beta settings."""

import math

from pipejax.study import records as study_records
from pipejax.study import spec as study_lib


def _adam_pilot(b1, b2, bits, seed=0, lr=0.002):
  return study_records.parse_record(
      {"run": "", "overrides": {"method": "sgd", "reference.momentum": b1, "reference.b2": b2,
                                "reference.lr": lr, "seed": seed},
       "status": "finished", "test_loss": bits * math.log(2)})


def test_lm_regime_prunes_a_beta_setting_whose_pilot_ends_more_than_a_tenth_above_the_best():
  study = study_lib.load_study("configs/studies/lm_regime.py")
  section = next(s for s in study.sections if "pruning" in s.title)
  records = [_adam_pilot(0.9, 0.99, 2.85), _adam_pilot(0.9, 0.999, 2.94),
             _adam_pilot(0.99, 0.999, 2.96),
             _adam_pilot(0.99, 0.99, 2.70, seed=1),  # another seed: not a pilot
             _adam_pilot(0.999, 0.999, 2.70, lr=0.001)]  # another rate: not a pilot
  rows = {tuple(line.split(" | ")[:2]): line for line in section.body(records, "").splitlines()
          if line.startswith("| 0.")}
  assert rows[("| 0.9", "0.99")].endswith("| 2.850 | +0.000 | the best |")
  assert rows[("| 0.9", "0.999")].endswith("| +0.090 | due |")
  assert rows[("| 0.99", "0.999")].endswith("| +0.110 | pruned |")
  assert rows[("| 0.99", "0.99")].endswith("| not trained | — | undecided |")
  assert rows[("| 0.999", "0.999")].endswith("| not trained | — | undecided |")
  assert len(rows) == 8  # every setting where b1² < b2
