"""The staleness table refuses settings that would train nothing, or no stage, before it simulates
a schedule or loads the data: a usage error of one line (exit 2) from scripts/schedule.py."""

import os
import subprocess
import sys

import pytest

from pipejax.analysis import staleness

from tests.helpers import ROOT

GOOD = {"train_samples": 256, "seeds": [0], "learning_rate": 0.003, "momentum": 0.9,
        "micro_batch": 4, "epochs": 1}


@pytest.mark.parametrize("change, message", [
    ({"train_samples": 0}, "makes no update"),
    ({"train_samples": 3}, "makes no update"),
    ({"micro_batch": 0}, "--train_micro_batch must be an integer >= 1"),
    ({"epochs": 0}, "--epochs must be an integer >= 1"),
    ({"seeds": []}, "--seeds must be one or more integers"),
    ({"seeds": [-1]}, "--seeds must be one or more integers"),
    ({"learning_rate": float("nan")}, "--learning_rate must be a finite number"),
    ({"momentum": 1.0}, "--momentum in"),
])
def test_settings_that_train_nothing_are_refused(change, message):
  with pytest.raises(staleness.StalenessError, match=message):
    staleness.check_settings(3, **{**GOOD, **change})


def test_more_stages_than_updates_or_a_delay_past_the_run_is_refused():
  assert staleness.check_settings(3, **GOOD) == 64
  with pytest.raises(staleness.StalenessError, match=r"--num_stages=2147483649 is more stages"):
    staleness.check_settings(2**31 + 1, **GOOD)
  staleness.check_delays("pb", [4, 2, 0], updates=5)
  with pytest.raises(staleness.StalenessError, match="delays stage 0's gradients by 2147483648"):
    staleness.check_delays("pb", [2**31, 0], updates=64)


@pytest.mark.parametrize("flags, message", [
    (["--train_samples=0"], "--train_samples=0 with --train_micro_batch=4 makes no update"),
    (["--num_stages=2147483649"], "--num_stages=2147483649 is more stages than the run's"),
    (["--seeds=x"], "--seeds must be integers; got x."),
    (["--schedules="], "--schedules names no schedule"),
])
def test_the_script_says_it_in_one_line_with_exit_2(flags, message):
  result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "schedule.py"),
                           "--table=staleness", "--schedules=pb", *flags],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert result.returncode == 2, result.stderr
  lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(lines) == 1 and message in lines[0], result.stderr
  assert "Traceback" not in result.stderr
