r"""Fault injection: kills and corrupted checkpoints never turn into a different result with exit 0.

    python scripts/chaos.py --trials=10 --workdir=/tmp/chaos
    python scripts/chaos.py --cases=study --study_trials=1 --workdir=/tmp/chaos

Trains the smoke config on a few samples once without interruption (the reference), then:

* ``--trials`` kill trials: start the run, send SIGTERM or SIGKILL at a random moment, either
  while a checkpoint is being written (its ``*.orbax-checkpoint-tmp`` directory exists) or at a
  random time, then rerun the same command until it exits;
* ``--trials`` corruption trials: take a run stopped half-way (or the finished reference), damage
  its newest checkpoint (flip a bit, garble 4096 bytes, truncate or delete a file) and rerun;
* ``--two_process_trials`` trials of a run of two processes (docs/distributed.md), after a
  two-process reference: process 1 started with one config field changed (both processes must
  refuse, naming the field, before the workdir exists), and one process killed with SIGTERM or
  SIGKILL at a random time (the other must end within TWO_PROCESS_DEADLINE seconds, and rerunning
  both must give the reference's exact result).

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
import socket
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
    from pipejax import experiment  # pylint: disable=g-import-not-at-top
    spec = importlib.util.spec_from_file_location("default", os.path.join(ROOT, "configs",
                                                                         "default.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("smoke")
    for override in OVERRIDES:
      key, value = override[len("--config."):].split("=")
      config[key] = type(config[key])(value)
    _LIKE.append(experiment.build(config).pipeline.init(jax.random.PRNGKey(0)))
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


# ----------------------------------------------------------------------------- two processes

# The two-process run of docs/distributed.md made small: 400 samples in 8 chunks of 25 ticks of
# b = 2 on a data=2 x stage=2 mesh over two processes of two CPU devices each.
TWO_PROCESS_OVERRIDES = (
    "--config.mesh.stage=2", "--config.mesh.data=2", "--config.micro_batch_size=2",
    "--config.max_train_examples=400", "--config.max_test_examples=100",
    "--config.ticks_per_chunk=25", "--config.model_kwargs.hidden=(32,16)",
    "--config.eval_every_samples=400", "--config.checkpoint_every_samples=100")
# Fields a process may be started with by mistake, and a wrong value for each.
MISMATCHES = (("seed", "1"), ("reference.lr", "0.4"), ("method", "pb"), ("epochs", "2.0"))
# Seconds within which both processes must end once one is killed or refuses (heartbeat 5 s).
TWO_PROCESS_DEADLINE = 120


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def start_two(workdir, extras=((), ())):
  """Starts the two processes of a run (logs beside the workdir); returns [(process, log path)]."""
  address = f"localhost:{_free_port()}"
  env = dict(_env(), JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
  started = []
  for i in range(2):
    log = f"{workdir}.process{i}.log"
    with open(log, "w") as out:
      started.append((subprocess.Popen(
          command(workdir)[:-len(OVERRIDES)] + list(TWO_PROCESS_OVERRIDES) + [
              f"--coordinator_address={address}", "--num_processes=2", f"--process_id={i}",
              "--heartbeat_timeout=5", "--startup_timeout=60", *extras[i]],
          stdout=out, stderr=subprocess.STDOUT, env=env), log))
  return started


def finish_two(started, timeout=600):
  """[(exit code, log)] of both processes; a process still alive at ``timeout`` is killed (-9)."""
  deadline = time.monotonic() + timeout
  results = []
  for process, log in started:
    try:
      process.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
    results.append((process.returncode, open(log).read()))
  return results


def two_process_result(workdir):
  """What a finished two-process run produced: final state digest, summary numbers, metrics."""
  directory = checkpoints(workdir)
  step = max(int(d) for d in os.listdir(directory) if d.isdigit())
  with open(os.path.join(directory, str(step), "meta", "metadata")) as f:
    meta = json.load(f)
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  return {"step": step, "digest": meta["state_digest"], "test_accuracy": summary["test_accuracy"],
          "test_loss": summary["test_loss"], "records": comparable_records(workdir)}


def _last_error(log: str) -> str:
  lines = [line for line in log.splitlines() if line.startswith(("error: ", "STOPPED"))]
  return lines[-1][:300] if lines else (log.strip().splitlines() or [""])[-1][:300]


def mismatch_trial(workdir, rng):
  """Process 1 started with one field changed: both must refuse, naming it, creating nothing."""
  key, value = rng.choice(MISMATCHES)
  start = time.monotonic()
  results = finish_two(start_two(workdir, ((), (f"--config.{key}={value}",))),
                       timeout=TWO_PROCESS_DEADLINE)
  seconds = time.monotonic() - start
  what = f"process 1 with --config.{key}={value}"
  for i, (code, log) in enumerate(results):
    if code == 0 or code < 0:
      return what, f"FAIL: process {i} exit {code} after {seconds:.0f} s: {_last_error(log)}"
    if f"config.{key}" not in _last_error(log) or "Traceback" in log:
      return what, f"FAIL: process {i} exit {code} without naming config.{key}: {_last_error(log)}"
  if os.path.exists(workdir):
    return what, "FAIL: refused, but after creating the workdir"
  return what, f"refused (both exit 1 naming config.{key}, {seconds:.0f} s)"


def kill_one_trial(workdir, rng, reference, reference_seconds):
  """One process killed (SIGTERM or SIGKILL) at a random time: the other must end within
  TWO_PROCESS_DEADLINE; rerunning both must give the reference's exact result."""
  sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
  victim = rng.randrange(2)
  delay = rng.uniform(0.1, 1.0) * reference_seconds
  started = start_two(workdir)
  time.sleep(delay)
  if started[victim][0].poll() is None:
    started[victim][0].send_signal(sig)
  killed_at = time.monotonic()
  codes = [code for code, _ in finish_two(started, timeout=TWO_PROCESS_DEADLINE)]
  what = (f"{signal.Signals(sig).name} to process {victim} at {delay:.1f} s (exits {codes[0]}, "
          f"{codes[1]} after {time.monotonic() - killed_at:.0f} s)")
  if any(code == -signal.SIGKILL for i, code in enumerate(codes) if i != victim):
    return what, f"FAIL: process {1 - victim} hung after the kill (killed after " \
        f"{TWO_PROCESS_DEADLINE} s)"
  results = finish_two(start_two(workdir))
  if any(code != 0 for code, _ in results):
    (code, log), = [(c, l) for c, l in results if c != 0][:1]
    return what, f"FAIL: rerun exit {code}: {_last_error(log)}"
  try:
    got = two_process_result(workdir)
  except (OSError, ValueError, KeyError) as e:
    return what, f"FAIL: rerun exit 0 but the result cannot be read ({str(e)[:200]})"
  differing = [k for k in reference if got[k] != reference[k]]
  if differing:
    return what, f"FAIL: rerun exit 0 with a different {', '.join(differing)}"
  return what, "exact"


def _two_process_category(verdict: str) -> str:
  return "FAIL" if verdict.startswith("FAIL") else verdict.split(" (")[0]


def two_process_round(workdir, rng, trials: int) -> collections.Counter:
  """A two-process reference run, then ``trials`` mismatch and kill trials; prints a line each."""
  outcomes = collections.Counter()
  if trials < 1:
    return outcomes
  reference_dir = os.path.join(workdir, "two_reference")
  start = time.perf_counter()
  results = finish_two(start_two(reference_dir))
  reference_seconds = time.perf_counter() - start
  if any(code != 0 for code, _ in results):
    print(f"two processes: the reference run failed (exits {[c for c, _ in results]}): "
          f"{_last_error(results[0][1])} / {_last_error(results[1][1])}", flush=True)
    outcomes["two processes: FAIL"] += 1
    return outcomes
  reference = two_process_result(reference_dir)
  print(f"two-process reference: {reference['step']} samples, test accuracy "
        f"{reference['test_accuracy']}, {reference_seconds:.0f} s", flush=True)
  for trial in range(trials):
    what, verdict = mismatch_trial(os.path.join(workdir, f"mismatch{trial}"), rng)
    outcomes["two processes, mismatch: " + _two_process_category(verdict)] += 1
    print(f"mismatch {trial}: {what}: {verdict}", flush=True)
    what, verdict = kill_one_trial(os.path.join(workdir, f"kill_one{trial}"), rng, reference,
                                   reference_seconds)
    outcomes["two processes, kill one: " + _two_process_category(verdict)] += 1
    print(f"kill one {trial}: {what}; rerun: {verdict}", flush=True)
  return outcomes


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
_CASES = flags.DEFINE_multi_enum("cases", ["trainer", "study", "two_process"],
                                 ["trainer", "study", "two_process"],
                                 "Which trials: the single trainer's, the study runner's, a "
                                 "two-process run's.")
_STUDY = flags.DEFINE_string("study", "configs/studies/depth.py:smoke",
                             "The study of the study runner's trials.")
_STUDY_WHERE = flags.DEFINE_list("study_where", ["model_kwargs.depth=4", "method=pb"],
                                 "The --where of the study runner's trials (empty: every run).")
_STUDY_TRIALS = flags.DEFINE_integer("study_trials", 2, "Trials of each study-runner case.")
_TWO_PROCESS_TRIALS = flags.DEFINE_integer(
    "two_process_trials", 2, "Trials of a two-process run: a mismatched process, and a kill of "
    "one process, each.")


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
  if "two_process" in _CASES.value:
    outcomes += two_process_round(_WORKDIR.value, rng, _TWO_PROCESS_TRIALS.value)
  print("COUNTS " + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())))
  failures = sum(v for k, v in outcomes.items() if k.endswith(": FAIL"))
  sys.exit(1 if failures else 0)


if __name__ == "__main__":
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore of the judge's at INFO
  cli.run(main)
