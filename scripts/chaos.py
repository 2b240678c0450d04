r"""Fault injection: kills and corrupted checkpoints never turn into a different result with exit 0.

    python scripts/chaos.py --trials=10 --workdir=/tmp/chaos
    python scripts/chaos.py --cases=study --study_trials=1 --workdir=/tmp/chaos

Trains the smoke config on a few samples once without interruption (the reference), then:

* ``--trials`` kill trials: start the run, send SIGTERM or SIGKILL at a random moment, either
  while a checkpoint is being written (its ``*.orbax-checkpoint-tmp`` directory exists) or at a
  random time, then rerun the same command until it exits;
* ``--trials`` corruption trials: take a run stopped half-way (or the finished reference), damage
  its newest checkpoint (flip a bit, garble 4096 bytes, truncate or delete a file) and rerun.

Every rerun must either exit 0 with exactly the reference's result (final state digest, verified
on restore, test loss and accuracy, every metrics record), or exit non-zero with a message that
names the damaged step.

The study runner (``--cases=study``; ``--study`` and ``--study_where`` choose the runs, by default
two runs of the depth smoke study) is tried the same way against an uninterrupted study:
``--study_trials`` times each of

* a kill of the study (SIGTERM or SIGKILL at a random moment): no trainer may outlive it;
* a kill of one of its trainers (SIGTERM or SIGKILL): the study must not exit 0 with an
  incomplete grid;
* a results line cut at a random byte (a full disk's half-written record);

after which one rerun of the same command must exit 0 with every run's status, test accuracy,
test loss and samples equal to the reference's, and a results.jsonl with no damaged line.

Anything else is a failure; the script exits 1 if there is one. It prints one line per trial and
the counts.
"""

import collections
import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

from absl import app, flags, logging

from pipejax import cli
from pipejax import study_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = ("--config.max_train_examples=1000", "--config.max_test_examples=200",
             "--config.ticks_per_chunk=100", "--config.checkpoint_every_samples=200",
             "--config.eval_every_samples=500")


# Measured, not computed: they differ between any two runs, interrupted or not.
TIMING_FIELDS = frozenset({"samples_per_second"})


def command(workdir):
  return [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
          f"--config={os.path.join(ROOT, 'configs', 'default.py')}:smoke",
          f"--workdir={workdir}", *OVERRIDES]


def run(workdir, timeout=600):
  done = subprocess.run(command(workdir), capture_output=True, text=True, timeout=timeout,
                        env=_env())
  return done.returncode, done.stdout + done.stderr


def _env():
  return dict(os.environ, PYTHONUNBUFFERED="1",
              PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def checkpoints(workdir):
  return os.path.join(workdir, "checkpoints")


def comparable_records(workdir):
  """The run's metrics records without the fields that measure time."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS} for line in f]


def result(workdir):
  """What a finished run produced: final state digest (verified), summary numbers, metrics."""
  from pipejax import checkpoint  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  saver = checkpoint.Checkpointer(checkpoints(workdir))
  step = saver.latest_step()
  state, meta = saver.restore(step, _like_state())  # raises if the digest does not match
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  records = comparable_records(workdir)
  saver.close()
  del jax
  return {"step": step, "digest": checkpoint.state_digest(state, meta["data_position"]),
          "test_accuracy": summary["test_accuracy"], "test_loss": summary["test_loss"],
          "records": records}


_LIKE = []


def _like_state():
  if not _LIKE:
    import importlib.util  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    from pipejax import training  # pylint: disable=g-import-not-at-top
    spec = importlib.util.spec_from_file_location("default", os.path.join(ROOT, "configs",
                                                                         "default.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("smoke")
    for override in OVERRIDES:
      key, value = override[len("--config."):].split("=")
      config[key] = type(config[key])(value)
    _LIKE.append(training.build(config).pipeline.init(jax.random.PRNGKey(0)))
  return _LIKE[0]


def kill_at_random(workdir, rng, reference_seconds):
  """Starts a run and kills it; returns a description and the killed run's exit code."""
  sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
  during_write = rng.random() < 0.5
  process = subprocess.Popen(command(workdir), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=_env())
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


def judge(workdir, code, output, reference, damaged_step=None):
  """'exact', 'refused (names step N)' or a failure starting with 'FAIL'."""
  if code == 0:
    try:
      got = result(workdir)
    except Exception as e:  # pylint: disable=broad-except
      return f"FAIL: exit 0 but the result cannot be read ({str(e)[:200]})"
    differing = [k for k in reference if got[k] != reference[k]]
    if differing:
      return f"FAIL: exit 0 with a different {', '.join(differing)}"
    aside = checkpoints(workdir) + ".damaged"
    if damaged_step is not None and os.path.isdir(aside):
      return f"exact (damage caught, step {damaged_step} set aside, resumed from an older one)"
    return "exact" if damaged_step is None else "exact (the damaged bytes were never read)"
  if damaged_step is not None and re.search(rf"\bstep {damaged_step}\b", output):
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


# ----------------------------------------------------------------------------- the study runner


def study_command(workdir):
  where = [f"--where={','.join(_STUDY_WHERE.value)}"] if _STUDY_WHERE.value else []
  # One run at a time: a kill then lands between runs as well as inside one.
  return [sys.executable, os.path.join(ROOT, "scripts", "study.py"), f"--study={_STUDY.value}",
          f"--workdir={workdir}", "--parallel=1", *where]


def run_study(workdir, env, timeout=900):
  done = subprocess.run(study_command(workdir), capture_output=True, text=True, timeout=timeout,
                        env=env, cwd=ROOT)
  return done.returncode, done.stdout + done.stderr


def study_results(workdir):
  """Each recorded run's numbers, and the sentences naming lines that are not records."""
  records, problems = study_records.load_results(workdir)
  return {r["run"]: {k: r.get(k) for k in ("status", "test_accuracy", "test_loss", "samples")}
          for r in records}, problems


def trainers_of(workdir):
  """The live processes whose command line names a run under ``workdir/runs``."""
  mark = f"--workdir={os.path.join(workdir, 'runs')}{os.sep}".encode()
  pids = []
  for entry in os.listdir("/proc"):
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        if mark not in f.read():
          continue
      with open(f"/proc/{entry}/stat") as f:
        if f.read().rpartition(")")[2].split()[0] != "Z":
          pids.append(int(entry))
    except (OSError, ValueError):
      continue
  return pids


def judge_study(workdir, code, output, reference):
  """'exact' or a failure starting with 'FAIL'."""
  if code != 0:
    return f"FAIL: exit {code}: {output.strip().splitlines()[-1][:300] if output.strip() else ''}"
  got, problems = study_results(workdir)
  if problems:
    return f"FAIL: exit 0 with a damaged results.jsonl: {problems[0]}"
  differing = sorted(k for k in set(got) | set(reference) if got.get(k) != reference.get(k))
  if differing:
    return f"FAIL: exit 0 with other results for {', '.join(differing)}"
  return "exact"


def study_moment(workdir, process, rng, seconds):
  """Waits for a random moment of a running study; returns its description ('' if the study
  ended first).

  The moments: a random time early in the run (a warm compilation cache makes later runs
  faster than the reference), a run's first checkpoint, the first record of results.jsonl.
  """
  kind = rng.choice(["time", "checkpoint", "record"])
  delay = rng.uniform(0.1, 0.5) * seconds
  results = os.path.join(workdir, study_records.RESULTS_FILE)
  start = time.time()
  while process.poll() is None:
    if kind == "time" and time.time() - start >= delay:
      return f"at {delay:.1f} s"
    if kind == "checkpoint" and glob.glob(os.path.join(workdir, "runs", "*", "checkpoints",
                                                       "[0-9]*")):
      return f"at the first checkpoint ({time.time() - start:.1f} s)"
    if kind == "record" and os.path.exists(results) and os.path.getsize(results):
      return f"after the first record ({time.time() - start:.1f} s)"
    time.sleep(0.05)
  return ""


def kill_study(workdir, env, rng, seconds):
  """Starts the study and kills it; returns a description, a failure if a trainer outlives it,
  and the study's exit code."""
  sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
  process = subprocess.Popen(study_command(workdir), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
  when = study_moment(workdir, process, rng, seconds)
  if when:
    process.send_signal(sig)
  code = process.wait(timeout=600)
  deadline = time.time() + 120
  while trainers_of(workdir) and time.time() < deadline:
    time.sleep(0.2)
  left = trainers_of(workdir)
  what = f"{signal.Signals(sig).name} to the study {when or 'too late'} (its exit {code})"
  return what, (f"FAIL: trainers {left} outlived the study by 120 s" if left else None), code


def kill_trainer(workdir, env, rng, seconds):
  """Starts the study and kills one of its trainers at a random moment."""
  sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
  process = subprocess.Popen(study_command(workdir), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
  when, victim = study_moment(workdir, process, rng, seconds), None
  trainers = trainers_of(workdir) if when else []
  if trainers:
    victim = rng.choice(sorted(trainers))
    os.kill(victim, sig)
  code = process.wait(timeout=600)
  who = f"trainer {victim} {when}" if victim else "no trainer (the study ended first)"
  return f"{signal.Signals(sig).name} to {who} (the study's exit {code})", code


def cut_results_line(workdir, rng):
  """Cuts results.jsonl inside its last line, as a full disk leaves a record half-written."""
  path = os.path.join(workdir, study_records.RESULTS_FILE)
  with open(path, "rb") as f:
    data = f.read()
  start = data.rstrip(b"\n").rfind(b"\n") + 1
  cut = rng.randrange(start + 1, len(data))
  os.truncate(path, cut)
  return f"results.jsonl cut at byte {cut - start} of its last line ({len(data) - start} bytes)"


def study_trials(workdir, trials, rng):
  """The study runner's trials (module docstring); returns their outcome counts."""
  env = dict(_env(), JAX_COMPILATION_CACHE_DIR=os.path.join(workdir, "jax_cache"))
  reference_dir = os.path.join(workdir, "study-reference")
  start = time.perf_counter()
  code, output = run_study(reference_dir, env)
  seconds = time.perf_counter() - start
  reference, problems = study_results(reference_dir)
  if code != 0 or problems:
    sys.exit(f"The reference study failed (exit {code}):\n{output[-3000:]}")
  print(f"study reference: {len(reference)} runs, {seconds:.0f} s", flush=True)
  outcomes = collections.Counter()

  def rerun(kind, trial, what, case_dir, failure=None, landed=True):
    code, output = run_study(case_dir, env)
    verdict = failure or judge_study(case_dir, code, output, reference)
    category = "FAIL" if verdict.startswith("FAIL") else verdict
    outcomes[f"study {kind}: {category}" + ("" if landed else " (ended before the kill)")] += 1
    print(f"study {kind} {trial}: {what}; rerun: {verdict}", flush=True)

  for trial in range(trials):
    case_dir = os.path.join(workdir, f"study-kill{trial}")
    what, failure, code = kill_study(case_dir, env, rng, seconds)
    if failure is None and code == 0:  # the study ended before the signal: it must be complete
      failure = judge_study(case_dir, 0, "", reference)
      failure = None if failure == "exact" else f"{failure} (before the rerun)"
    rerun("kill", trial, what, case_dir, failure, landed=code != 0)

    case_dir = os.path.join(workdir, f"study-trainer-kill{trial}")
    what, code = kill_trainer(case_dir, env, rng, seconds)
    failure = None
    if code == 0 and judge_study(case_dir, 0, "", reference) != "exact":
      failure = "FAIL: the study exited 0 with an incomplete grid"
    rerun("trainer kill", trial, what, case_dir, failure, landed="no trainer" not in what)

    case_dir = os.path.join(workdir, f"study-cut{trial}")
    shutil.copytree(reference_dir, case_dir)
    rerun("cut line", trial, cut_results_line(case_dir, rng), case_dir)
  return outcomes


def trainer_trials(workdir, trials, rng):
  """The single trainer's kill and corruption trials (module docstring); returns their counts."""
  reference_dir = os.path.join(workdir, "reference")
  start = time.perf_counter()
  code, output = run(reference_dir)
  reference_seconds = time.perf_counter() - start
  if code != 0:
    sys.exit(f"The reference run failed (exit {code}):\n{output[-3000:]}")
  reference = result(reference_dir)
  print(f"reference: {reference['step']} samples, test accuracy {reference['test_accuracy']}, "
        f"{reference_seconds:.0f} s", flush=True)

  # A run stopped half-way by SIGTERM, for the corruption trials (beside the finished one).
  stopped_dir = os.path.join(workdir, "stopped")
  process = subprocess.Popen(command(stopped_dir), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=_env())
  for line in process.stdout:
    if "[500/1000 samples" in line:
      process.send_signal(signal.SIGTERM)
      break
  process.communicate(timeout=600)

  outcomes = collections.Counter()
  # Kill and corruption trials alternate, so a run cut short still has counts of both.
  for trial in range(trials):
    run_dir = os.path.join(workdir, f"kill{trial}")
    what, killed_code = kill_at_random(run_dir, rng, reference_seconds)
    code, output = run(run_dir)  # a kill damages no complete checkpoint: one rerun must finish
    verdict = judge(run_dir, code, output, reference)
    outcomes["kill: " + _category(verdict)] += 1
    print(f"kill {trial}: {what} (killed run's exit {killed_code}); rerun: {verdict}", flush=True)

    source = rng.choice([stopped_dir, reference_dir])
    run_dir = os.path.join(workdir, f"corrupt{trial}")
    shutil.copytree(source, run_dir)
    step, what = corrupt_newest(run_dir, rng)
    code, output = run(run_dir)
    verdict = judge(run_dir, code, output, reference, damaged_step=step)
    outcomes["corruption: " + _category(verdict)] += 1
    print(f"corruption {trial}: {os.path.basename(source)} step {step}, {what}: {verdict}",
          flush=True)
  return outcomes


_TRIALS = flags.DEFINE_integer("trials", 10, "Kill trials, and as many corruption trials.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/pipejax-chaos", "Where the runs go (emptied).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random kill points and corruptions.")
_CASES = flags.DEFINE_multi_enum("cases", ["trainer", "study"], ["trainer", "study"],
                                 "Which trials: the single trainer's, the study runner's.")
_STUDY = flags.DEFINE_string("study", "configs/studies/depth.py:smoke",
                             "The study of the study runner's trials.")
_STUDY_WHERE = flags.DEFINE_list("study_where", ["model_kwargs.depth=4", "method=pb"],
                                 "The --where of the study runner's trials (empty: every run).")
_STUDY_TRIALS = flags.DEFINE_integer("study_trials", 2, "Trials of each study-runner case.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  rng = random.Random(_SEED.value)
  shutil.rmtree(_WORKDIR.value, ignore_errors=True)
  os.makedirs(_WORKDIR.value)
  outcomes = collections.Counter()
  if "trainer" in _CASES.value:
    outcomes += trainer_trials(_WORKDIR.value, _TRIALS.value, rng)
  if "study" in _CASES.value:
    outcomes += study_trials(_WORKDIR.value, _STUDY_TRIALS.value, rng)
  print("COUNTS " + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())))
  failures = sum(v for k, v in outcomes.items() if k.endswith(": FAIL"))
  sys.exit(1 if failures else 0)


if __name__ == "__main__":
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore of the judge's at INFO
  cli.run(main)
