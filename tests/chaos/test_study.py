"""The study launcher's round of :mod:`pipejax.chaos.study`, run as scripts/chaos.py runs it."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
@pytest.mark.chaos
def test_a_chaos_round_of_the_study_launcher_ends_complete_and_exact(tmp_path):
  """scripts/chaos.py's study cases, once each, on two runs of the depth smoke study: a kill of
  the study, a kill of one trainer, a results line cut short (each rerun must match the
  uninterrupted study), and `--report_only` in a loop beside the study (which must end as the
  uninterrupted one, with a whole report)."""
  chaos = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "chaos.py"),
                          "--cases=study", "--study_trials=1", f"--workdir={tmp_path / 'chaos'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=1500)
  assert chaos.returncode == 0, chaos.stdout[-3000:] + chaos.stderr[-3000:]
  counts = chaos.stdout.strip().splitlines()[-1]
  assert counts.startswith("COUNTS ") and "FAIL" not in counts, chaos.stdout[-3000:]
  kinds = [entry.split(":")[0] for entry in counts[len("COUNTS "):].split(", ")]
  assert sorted(kinds) == ["study cut line", "study kill", "study report beside",
                          "study trainer kill"], counts
  assert "rerun: exact" in chaos.stdout
