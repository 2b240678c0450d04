"""What the study tests share: records, small studies and a fake trainer."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

from pipejax.study import spec as study_lib
from pipejax.study import records as study_records
from pipejax.study import launcher
from pipejax.study.spec import Study, Table

from tests.helpers import ROOT, as_from_a_terminal


def record(method, depth, seed, accuracy, status=study_records.FINISHED):
  overrides = {"model_kwargs.depth": depth, "method": method, "seed": seed}
  return study_records.parse_record(
      {"run": study_lib.run_id(overrides), "overrides": overrides, "status": status,
       "test_accuracy": accuracy, "fixed": {}, "config": "c.py", "init_digest": f"w{seed}"})


def changed(record_, **fields):
  """``record_`` with ``fields`` set (None: left out), parsed again as results.jsonl's line."""
  line = {**record_.to_json(), **fields}
  return study_records.parse_record({k: v for k, v in line.items() if v is not None})


STUDY = Study(name="t", config="c.py",
              grids=[{"model_kwargs.depth": (4, 8), "method": ("sgd", "pb"), "seed": (0, 1, 2)}],
              baseline={"method": "sgd"}, min_accuracy=0.5,
              tables=[Table("acc", rows="model_kwargs.depth", columns="method")])


# Takes a trainer's flags; its first argument says how it behaves. On SIGTERM it takes a moment
# (a checkpoint), then exits 75 as scripts/train.py does.
FAKE_TRAINER = """
import json, os, signal, sys, time
mode = sys.argv[1]
flag = lambda name: [a.split("=", 1)[1] for a in sys.argv if a.startswith(name + "=")][0]
workdir, seed = flag("--workdir"), flag("--config.seed")

def stop(*_):
  time.sleep(1)
  open(os.path.join(workdir, "saved"), "w").close()
  sys.exit(75)

signal.signal(signal.SIGTERM, stop)
open(os.path.join(workdir, "pid"), "w").write(str(os.getpid()))
if mode == "sleep":
  time.sleep(120)
if mode == "stop-seed-1" and seed == "1":
  print("STOPPED by SIGTERM after 0 samples; rerun to resume.")
  sys.exit(75)
if mode == "fail":
  sys.exit("error: no trainer should have started")
with open(os.path.join(workdir, "summary.json"), "w") as f:
  json.dump({"test_accuracy": 0.5 + int(seed) / 10, "test_loss": 1.0, "stopped_by": None,
             "init_digest": "w" + seed}, f)
"""


TWO_RUNS = Study(name="two", config="configs/default.py:smoke",
                 grids=[{"method": ("sgd",), "seed": (0, 1)}], fixed={"epochs": 1.0})


def run_main(workdir, trainer, study=TWO_RUNS, **kwargs):
  return launcher.main(study, str(workdir), parallel=2, command="", trainer=trainer, **kwargs)


STUDY_PROCESS = """
import sys
from pipejax.study import launcher
from pipejax.study.spec import Study
study = Study(name="two", config="c.py", grids=[{"method": ("sgd",), "seed": (0, 1)}])
sys.exit(launcher.main(study, sys.argv[1], parallel=2, command="", trainer=sys.argv[2:]))
"""


def start_study(workdir, trainer):
  process = subprocess.Popen([sys.executable, "-c", STUDY_PROCESS, str(workdir), *trainer],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                             preexec_fn=as_from_a_terminal)
  pids = [workdir / "runs" / f"method=sgd,seed={s}" / "pid" for s in (0, 1)]
  deadline = time.time() + 60
  while not all(p.exists() and p.read_text() for p in pids):
    assert time.time() < deadline and process.poll() is None, process.communicate()[0]
    time.sleep(0.05)
  return process, [int(p.read_text()) for p in pids]


def alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/stat") as f:  # a trainer reaped by no one yet is a zombie: ended
    return f.read().rpartition(")")[2].split()[0] != "Z"


def loss_record(method, depth, seed, loss):
  return changed(record(method, depth, seed, 0.5), test_loss=loss, initial_test_loss=5.0)


def sectioned_study(*sections):
  from pipejax.study.spec import Figure  # pylint: disable=import-outside-toplevel
  return dataclasses.replace(
      STUDY, figures=[Figure("f.png", x="model_kwargs.depth", series="method", title="By depth")],
      sections=sections)


def write_records(workdir):
  for m, d, s, acc in [("sgd", 4, 0, 0.9), ("pb", 4, 0, 0.8), ("sgd", 8, 0, 0.85)]:
    study_records.append_result(str(workdir), record(m, d, s, acc))
