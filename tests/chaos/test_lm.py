"""The language model's round of :mod:`pipejax.chaos.lm` in one process (scripts/chaos.py
``--cases=lm``). tests/models/test_lm.py retrains the LM past a damaged checkpoint at a fixed
step; this does it at random ones."""

import random

import pytest

from pipejax.chaos import lm, trainer


@pytest.mark.slow
@pytest.mark.chaos
def test_a_chaos_round_of_the_lm_in_one_process_ends_exact(tmp_path):
  """scripts/chaos.py --cases=lm, one trial of each: a kill at a random moment, a damaged newest
  checkpoint; each rerun must match the uninterrupted LM run bit for bit (or name the step)."""
  outcomes = trainer.trainer_trials(str(tmp_path), 1, random.Random(0), lm.LM)
  assert sorted(k.split(":")[0] for k in outcomes) == ["lm corruption", "lm kill"], outcomes
  assert not any(k.endswith("FAIL") for k in outcomes), outcomes
