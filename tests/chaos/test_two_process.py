"""The two-process rounds of :mod:`pipejax.chaos.two_process` (scripts/chaos.py), one trial of
each: a process started with a mismatched config must be refused, and a killed one must leave a
run whose rerun is exact.

The image model's round covers the data-parallel processes; the LM's splits its stages over the
processes (``mesh.stage=2``). The LM's data-parallel round runs in scripts/chaos.py
(``--cases=lm_two_process``), not here, to keep the suite short.
"""

import random

import pytest

from pipejax.chaos import lm, two_process


@pytest.mark.slow
@pytest.mark.chaos
def test_a_chaos_round_of_two_processes_has_no_failure(tmp_path):
  """scripts/chaos.py's two-process trials, one of each: a mismatched process, a killed one."""
  outcomes = two_process.two_process_round(str(tmp_path), random.Random(0), trials=1)
  assert outcomes == {"two processes, mismatch: refused": 1,
                      "two processes, kill one: exact": 1}, outcomes


@pytest.mark.slow
@pytest.mark.chaos
def test_a_chaos_round_of_the_lm_with_stages_over_two_processes_has_no_failure(tmp_path):
  outcomes = two_process.two_process_round(str(tmp_path), random.Random(0), 1, lm.LM_STAGES)
  assert outcomes == {"two processes, lm stages, mismatch: refused": 1,
                      "two processes, lm stages, kill one: exact": 1}, outcomes
