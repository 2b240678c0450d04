"""One trainer process: kill trials and checkpoint corruption trials against a reference run."""

import collections
import dataclasses
import functools
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import time

from pipejax import config as config_lib
from pipejax.chaos import ROOT, ReferenceFailed, child_env, python

# The trainer's config: the smoke variant, made smaller still by the overrides.
CONFIG = f"{os.path.join(ROOT, 'configs', 'default.py')}:smoke"
OVERRIDES = ("--config.max_train_examples=1000", "--config.max_test_examples=200",
             "--config.ticks_per_chunk=100", "--config.checkpoint_every_samples=200",
             "--config.eval_every_samples=500")



@dataclasses.dataclass(frozen=True)
class TrainerCase:
  """A trainer set-up the trials run: its config file and overrides.

  ``label`` starts each outcome's name ('' for the image model's case); ``half_way`` is a
  progress line's start at which the run kept for the corruption trials is stopped.
  """

  label: str
  config: str
  overrides: tuple[str, ...]
  half_way: str


MLP = TrainerCase("", CONFIG, OVERRIDES, "[500/1000 samples")


# Measured, not computed: they differ between any two runs, interrupted or not.
TIMING_FIELDS = frozenset({"samples_per_second"})


def command(workdir, case=MLP):
  """The trainer's command line: the case's smoke config on a few samples, in ``workdir``."""
  return [*python("train.py"), f"--config={case.config}", f"--workdir={workdir}",
          *case.overrides]


def run(workdir, timeout=600, case=MLP):
  done = subprocess.run(command(workdir, case), capture_output=True, text=True, timeout=timeout,
                        env=child_env())
  return done.returncode, done.stdout + done.stderr


def checkpoints(workdir):
  return os.path.join(workdir, "checkpoints")


def comparable_records(workdir):
  """The run's metrics records without the fields that measure time."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS} for line in f]


def result(workdir, case=MLP):
  """What a finished run produced: final state digest (verified), summary numbers, metrics."""
  from pipejax.train import checkpoint  # pylint: disable=g-import-not-at-top
  saver = checkpoint.Checkpointer(checkpoints(workdir))
  step = saver.latest_samples()
  state, meta = saver.restore(step, _like_state(case))  # raises if the digest does not match
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  records = comparable_records(workdir)
  saver.close()
  return {"step": step, "digest": checkpoint.state_digest(state, meta["data_position"]),
          "test_accuracy": summary["test_accuracy"], "test_loss": summary["test_loss"],
          "records": records}


@functools.cache
def _like_state(case=MLP):
  """A state of the trainer's pipeline, the structure its checkpoints restore into."""
  # JAX only here: a process that only starts trainers never loads it.
  import jax  # pylint: disable=g-import-not-at-top
  from pipejax.train import experiment  # pylint: disable=g-import-not-at-top
  from pipejax.train import plan as plan_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.load_config(case.config)
  for override in case.overrides:
    key, value = override[len("--config."):].split("=")
    config[key] = type(config[key])(value)
  return experiment.build(plan_lib.resolve(config)).pipeline.init(jax.random.PRNGKey(0))


def kill_at_random(workdir, rng, reference_seconds, case=MLP):
  """Starts a run and kills it; returns a description and the killed run's exit code."""
  sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
  during_write = rng.random() < 0.5
  process = subprocess.Popen(command(workdir, case), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=child_env())
  if during_write:
    # The n-th checkpoint write (n random), caught while its temporary directory exists.
    wanted, seen, writing = rng.randint(1, 4), 0, False
    while process.poll() is None:
      now_writing = bool(glob.glob(os.path.join(checkpoints(workdir), "*.orbax-checkpoint-tmp*")))
      if now_writing and not writing:
        seen += 1
        if seen == wanted:
          process.send_signal(sig)
          break
      writing = now_writing
      time.sleep(0.002)
    where = f"during checkpoint write #{wanted}"
  else:
    delay = rng.uniform(0.2, 1.0) * reference_seconds
    try:
      process.wait(timeout=delay)
    except subprocess.TimeoutExpired:
      process.send_signal(sig)
    where = f"at {delay:.1f} s"
  code = process.wait(timeout=600)
  return f"{signal.Signals(sig).name} {where}", code


def corrupt_newest(workdir, rng):
  """Damages one file of the newest checkpoint; returns (step, description)."""
  steps = sorted(int(d) for d in os.listdir(checkpoints(workdir)) if d.isdigit())
  step = steps[-1]
  files = sorted(p for p in glob.glob(os.path.join(checkpoints(workdir), str(step), "**"),
                                      recursive=True) if os.path.isfile(p))
  data = [p for p in files if f"{os.sep}d{os.sep}" in p]
  kind = rng.choice(["flip a bit", "garble 4096 bytes", "truncate", "delete"])
  path = rng.choice(data if kind in ("flip a bit", "garble 4096 bytes") and data else files)
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    if kind == "flip a bit" and size:
      offset = rng.randrange(size)
      f.seek(offset)
      byte = f.read(1)[0]
      f.seek(offset)
      f.write(bytes([byte ^ (1 << rng.randrange(8))]))
    elif kind == "garble 4096 bytes" and size:
      offset = rng.randrange(size)
      f.seek(offset)
      f.write(bytes(rng.randrange(256) for _ in range(min(4096, size - offset))))
    elif kind == "truncate":
      f.truncate(rng.randrange(size) if size else 0)
  if kind == "delete":
    os.remove(path)
  return step, f"{kind} in {os.path.relpath(path, checkpoints(workdir))}"


def judge(workdir, code, output, reference, damaged_step=None, case=MLP):
  """'exact', 'refused (names step N)' or a failure starting with 'FAIL'."""
  if code == 0:
    try:
      got = result(workdir, case)
    except Exception as e:  # pylint: disable=broad-except
      return f"FAIL: exit 0 but the result cannot be read ({str(e)[:200]})"
    differing = [k for k in reference if got[k] != reference[k]]
    if differing:
      return f"FAIL: exit 0 with a different {', '.join(differing)}"
    aside = checkpoints(workdir) + ".damaged"
    if damaged_step is not None and os.path.isdir(aside):
      return f"exact (damage caught, step {damaged_step} set aside, resumed from an older one)"
    return "exact" if damaged_step is None else "exact (the damaged bytes were never read)"
  if damaged_step is not None and re.search(rf"\bat {damaged_step} samples\b", output):
    return f"refused (exit {code}, names step {damaged_step})"
  return f"FAIL: exit {code}: {output.strip().splitlines()[-1][:300] if output.strip() else ''}"


def _category(verdict: str) -> str:
  if verdict.startswith("FAIL"):
    return "FAIL"
  if verdict.startswith("refused"):
    return "refused naming the damaged step"
  if "damage caught" in verdict:
    return "exact after falling back from the damaged step"
  return "exact (bytes never read)" if "never read" in verdict else "exact"


def trainer_trials(workdir, trials, rng, case=MLP) -> collections.Counter:
  """A reference run, then ``trials`` kill and ``trials`` corruption trials (scripts/chaos.py);
  prints a line each and returns their outcome counts.

  Raises:
    ReferenceFailed: the uninterrupted reference run failed.
  """
  prefix = f"{case.label} " if case.label else ""
  workdir = os.path.join(workdir, case.label) if case.label else workdir
  reference_dir = os.path.join(workdir, "reference")
  start = time.perf_counter()
  code, output = run(reference_dir, case=case)
  reference_seconds = time.perf_counter() - start
  if code != 0:
    raise ReferenceFailed(f"The {prefix}reference run failed (exit {code}):\n{output[-3000:]}")
  reference = result(reference_dir, case)
  print(f"{prefix}reference: {reference['step']} samples, test accuracy "
        f"{reference['test_accuracy']}, {reference_seconds:.0f} s", flush=True)

  # A run stopped half-way by SIGTERM, for the corruption trials (beside the finished one).
  stopped_dir = os.path.join(workdir, "stopped")
  process = subprocess.Popen(command(stopped_dir, case), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=child_env())
  for line in process.stdout:
    if case.half_way in line:
      process.send_signal(signal.SIGTERM)
      break
  process.communicate(timeout=600)

  outcomes = collections.Counter()
  # Kill and corruption trials alternate, so a run cut short still has counts of both.
  for trial in range(trials):
    run_dir = os.path.join(workdir, f"kill{trial}")
    what, killed_code = kill_at_random(run_dir, rng, reference_seconds, case)
    # A kill damages no complete checkpoint: one rerun must finish.
    code, output = run(run_dir, case=case)
    verdict = judge(run_dir, code, output, reference, case=case)
    outcomes[f"{prefix}kill: " + _category(verdict)] += 1
    print(f"{prefix}kill {trial}: {what} (killed run's exit {killed_code}); rerun: {verdict}",
          flush=True)

    source = rng.choice([stopped_dir, reference_dir])
    run_dir = os.path.join(workdir, f"corrupt{trial}")
    shutil.copytree(source, run_dir)
    step, what = corrupt_newest(run_dir, rng)
    code, output = run(run_dir, case=case)
    verdict = judge(run_dir, code, output, reference, damaged_step=step, case=case)
    outcomes[f"{prefix}corruption: " + _category(verdict)] += 1
    print(f"{prefix}corruption {trial}: {os.path.basename(source)} step {step}, {what}: {verdict}",
          flush=True)
  return outcomes
