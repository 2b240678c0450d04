"""The analysis binaries' outputs, run as a user runs them."""

import json
import os
import random
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def run_script(*args):
  result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", args[0]), *args[1:]],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
  return result


def test_schedule_json_for_four_stages():
  result = run_script("schedule.py", "--num_stages=4", "--format=json")
  assert result.returncode == 0, result.stderr
  info = json.loads(result.stdout)
  assert info["delays"] == [6, 4, 2, 0]
  assert info["stash_slots"] == [7, 5, 3, 1]
  assert info["stash_bytes"] == 16 * 256 * 4  # (7+5+3+1) slots of 256 float32 numbers
  assert info["utilization"] == 1.0
  # Tick 6: stage 0 forwards sample 6 and backwards sample 0 (its first backward).
  assert info["grid"][6][0] == {"forward": 6, "backward": 0}
  assert info["grid"][3][3] == {"forward": 0, "backward": 0}


def test_schedule_sync_mode_has_bubbles_and_draws_png(tmp_path):
  png = tmp_path / "grid.png"
  result = run_script("schedule.py", "--num_stages=3", "--micro_batches=2", "--format=json",
                      f"--output={png}")
  assert result.returncode == 0, result.stderr
  info = json.loads(result.stdout)
  assert info["utilization"] == pytest.approx(2 / (2 + 4))
  # The synchronous mode is never stale and holds at most M = 2 inputs per stage.
  assert info["delays"] == [0, 0, 0]
  assert info["stash_slots"] == [2, 2, 1]
  assert info["buffer_slots"] == [5, 3, 1]
  # Ticks 2..5 feed no new sample into stage 0: fill and drain of the first step.
  assert [row[0]["forward"] for row in info["grid"][:8]] == [0, 1, None, None, None, None, 2, 3]
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("schedule,bubble_rate", [("1f1b", 3 / 8), ("zb_h1", 1 / 8)])
def test_schedule_bubble_rates_of_1f1b_and_zb_h1(schedule, bubble_rate):
  # F = B = W: 1F1B (p-1)/m, ZB-H1 (p-1)/(3m) with p = 4, m = 8.
  result = run_script("schedule.py", f"--schedule={schedule}", "--num_stages=4",
                      "--micro_batches=8", "--format=json")
  assert result.returncode == 0, result.stderr
  info = json.loads(result.stdout)
  assert info["bubble_rate"] == pytest.approx(bubble_rate)
  assert info["delays"] == [0, 0, 0, 0]


def test_schedule_draws_a_gantt_chart_and_prints_its_table(tmp_path):
  png = tmp_path / "pb.png"
  result = run_script("schedule.py", "--schedule=pb", "--num_stages=3", f"--output={png}")
  assert result.returncode == 0, result.stderr
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  rows = [line.split("|") for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
  # Device, layers, F, B, W, bubble, peak activations, weight versions, delay.
  assert [int(row[6]) for row in rows] == [5, 3, 1]
  assert [int(row[8]) for row in rows] == [4, 2, 0]


def test_schedule_table_of_all_schedules():
  result = run_script("schedule.py", "--table=schedules", "--num_stages=4", "--micro_batches=8",
                      "--format=json")
  assert result.returncode == 0, result.stderr
  rows = {row["schedule"]: row for row in json.loads(result.stdout)}
  assert rows["gpipe"]["of_ideal"] == pytest.approx(8 / 11)
  assert rows["pb"]["delays"] == [6, 4, 2, 0]
  assert rows["pipedream"]["weight_versions"] == [4, 3, 2, 1]


def test_schedule_takes_the_users_layer_costs():
  # Layer 1 (F 2, B 2, W 2) dominates; LayerPipe's inter-layer split balances 4 against 4.
  result = run_script("schedule.py", "--schedule=layerpipe_inter", "--layer_costs=1:0:1,2:2:2",
                      "--num_stages=2", "--format=json")
  assert result.returncode == 0, result.stderr
  assert json.loads(result.stdout)["throughput"] == pytest.approx(1 / 4)


def test_schedule_trains_under_a_schedules_delays():
  result = run_script("schedule.py", "--table=staleness", "--num_stages=3", "--schedules=pb",
                      "--train_samples=256", "--epochs=1", "--seeds=0", "--format=json")
  assert result.returncode == 0, result.stderr
  (row,) = json.loads(result.stdout)
  assert row["delays"] == [4, 2, 0]
  assert 0.2 < row["test_accuracy"][0] <= 1.0  # above chance (0.1) after 64 updates


def test_schedule_rejects_more_devices_than_layers():
  result = run_script("schedule.py", "--schedule=gpipe", "--num_stages=5", "--num_layers=3")
  assert result.returncode != 0
  assert "a device needs at least one layer" in result.stderr


def test_schedule_rejects_zero_stages_in_one_line():
  result = run_script("schedule.py", "--num_stages=0")
  assert result.returncode == 2
  # The message alone: absl would print the whole --help (a hundred lines) above it.
  assert result.stderr.strip().splitlines() == [
      "error: --num_stages must be at least 1; got 0. (--help lists the flags.)"]


def test_schedule_refuses_a_flag_its_mode_does_not_read():
  result = run_script("schedule.py", "--model=garbage", "--num_layers=3")
  assert result.returncode == 2, result.stderr
  [line] = result.stderr.strip().splitlines()
  assert line.startswith("error: --model, --num_layers are not read by the tick grid"), line
  result = run_script("schedule.py", "--schedule=gpipe", "--layer_costs=1:1:1,2:2:2",
                      "--forward=3")
  assert result.returncode == 2 and "--forward is not read by --schedule" in result.stderr
  result = run_script("schedule.py", "--schedule=gpipe", "--num_layers=0")
  assert result.returncode == 2 and "--num_layers=0" in result.stderr, result.stderr


# What each mode of scripts/schedule.py reads, from the functions that read the flags
# (tick_grid_main, schedule_main, schedules_table, layerpipe_table, staleness_table and
# layer_costs): the reference the fuzz below holds the script's own table to.
_ALWAYS_READ = {"num_stages", "micro_batches", "format"}
_MODE_READS = {
    None: {"ticks", "micro_batch_size", "activation_size", "dtype_bytes", "output"},
    "schedule": {"schedule", "output"},
    "schedules": {"table", "layers_per_stage"},
    "layerpipe": {"table", "device_counts"},
    "staleness": {"table", "schedules", "train_samples", "epochs", "seeds", "learning_rate",
                  "momentum", "train_micro_batch"},
}
_VALUES = {"num_stages": "4", "ticks": "8", "micro_batches": "4", "micro_batch_size": "2",
           "activation_size": "16", "dtype_bytes": "2", "format": "json", "output": "/tmp/x.png",
           "model": "vgg", "input_shape": "32,32,3", "transfer_flops_per_byte": "1.0",
           "layer_costs": "1:1:1", "num_layers": "4", "forward": "2", "input_grad": "1",
           "weight_grad": "1", "transfer": "0.5", "layers_per_stage": "1",
           "device_counts": "2,3", "schedules": "pb", "train_samples": "100", "epochs": "1",
           "seeds": "0", "learning_rate": "0.1", "momentum": "0.5", "train_micro_batch": "2"}


def _schedule_reads(flags_given: dict) -> set:
  table, schedule = flags_given.get("table"), flags_given.get("schedule")
  mode = table or ("schedule" if schedule else None)
  read = _ALWAYS_READ | _MODE_READS[mode]
  if mode == "schedule" and schedule != "pb":
    read = read - {"layers_per_stage"}
  if mode in ("schedule", "schedules", "layerpipe"):  # layer_costs()
    if "layer_costs" in flags_given:
      read |= {"layer_costs"}
    elif "model" in flags_given:
      read |= {"model", "input_shape", "micro_batch_size", "transfer_flops_per_byte"}
    else:
      read |= {"num_layers", "forward", "input_grad", "weight_grad", "transfer"}
  return read


_DRIVER = """
import importlib.util, json, sys
from absl import app, flags
spec = importlib.util.spec_from_file_location("schedule_script", sys.argv[1])
schedule = importlib.util.module_from_spec(spec)
spec.loader.exec_module(schedule)
for line in sys.stdin:
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["schedule.py", *json.loads(line)])
  try:
    schedule.check_unread_flags()
    print(json.dumps(None))
  except app.UsageError as e:
    print(json.dumps(str(e)))
"""


def test_fuzz_schedule_refuses_exactly_the_flags_its_mode_does_not_read():
  """Seeded random command lines of every mode and way of giving layer costs: refused exactly
  when one of their flags is not read, naming those flags and no other."""
  rng = random.Random(0)
  lines = []
  for _ in range(300):
    given = dict(rng.sample(sorted(_VALUES.items()), rng.randint(0, 4)))
    if rng.random() < 0.6:
      given["schedule"] = rng.choice(["pb", "gpipe", "1f1b"])
    if rng.random() < 0.5:
      given["table"] = rng.choice(["schedules", "layerpipe", "staleness"])
    lines.append(given)
  done = subprocess.run([sys.executable, "-c", _DRIVER, os.path.join(ROOT, "scripts",
                                                                      "schedule.py")],
                        input="".join(json.dumps([f"--{k}={v}" for k, v in given.items()]) + "\n"
                                      for given in lines),
                        capture_output=True, text=True, timeout=120, cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": ROOT})
  assert done.returncode == 0, done.stderr[-3000:]
  verdicts = [json.loads(line) for line in done.stdout.splitlines()]
  assert len(verdicts) == len(lines)
  for given, verdict in zip(lines, verdicts):
    unread = sorted(set(given) - _schedule_reads(given))
    assert (verdict is None) == (not unread), (given, verdict)
    if unread:
      named = verdict.split(" not read by ")[0]
      assert sorted(name.strip("- ") for name in named.replace(" are", "").replace(
          " is", "").split(",")) == unread, (given, verdict)
