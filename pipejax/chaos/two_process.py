"""A run of two processes (docs/distributed.md): a mismatched process, and one process killed."""

import collections
import dataclasses
import json
import os
import signal
import socket
import subprocess
import time

from pipejax import methods
from pipejax.chaos import child_env
from pipejax.chaos.trainer import MLP, TrainerCase, checkpoints, command, comparable_records

# The two-process run of docs/distributed.md made small: 400 samples in 8 chunks of 25 ticks of
# b = 2 on a data=2 x stage=2 mesh over two processes of two CPU devices each.
TWO_PROCESS_OVERRIDES = (
    "--config.mesh.stage=2", "--config.mesh.data=2", "--config.micro_batch_size=2",
    "--config.max_train_examples=400", "--config.max_test_examples=100",
    "--config.ticks_per_chunk=25", "--config.model_kwargs.hidden=(32,16)",
    "--config.eval_every_samples=400", "--config.checkpoint_every_samples=100")
# Fields a process may be started with by mistake, and a wrong value for each.
MISMATCHES = (("seed", "1"), ("reference.lr", "0.4"), ("method", methods.PLAIN_PIPELINE),
              ("epochs", "2.0"))
# Seconds within which both processes must end once one is killed or refuses (heartbeat 5 s).
TWO_PROCESS_DEADLINE = 120


@dataclasses.dataclass(frozen=True)
class TwoProcessCase:
  """A run of two processes the trials start: a trainer case, the overrides that replace its own
  (the mesh over the processes) and the CPU devices each process has."""

  label: str  # starts each outcome's name
  trainer: TrainerCase
  overrides: tuple[str, ...]
  devices_per_process: int = 2
  mismatches: tuple[tuple[str, str], ...] = MISMATCHES


IMAGE = TwoProcessCase("two processes", MLP, TWO_PROCESS_OVERRIDES)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def start_two(workdir, extras=((), ()), case=IMAGE):
  """Starts the two processes of a run (logs beside the workdir); returns [(process, log path)]."""
  address = f"localhost:{_free_port()}"
  env = child_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count="
                  f"{case.devices_per_process}")
  own = command(workdir, case.trainer)
  started = []
  for i in range(2):
    log = f"{workdir}.process{i}.log"
    with open(log, "w") as out:
      started.append((subprocess.Popen(
          own[:len(own) - len(case.trainer.overrides)] + list(case.overrides) + [
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


def mismatch_trial(workdir, rng, case=IMAGE):
  """Process 1 started with one field changed: both must refuse, naming it, creating nothing."""
  key, value = rng.choice(case.mismatches)
  start = time.monotonic()
  results = finish_two(start_two(workdir, ((), (f"--config.{key}={value}",)), case),
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


def kill_one_trial(workdir, rng, reference, reference_seconds, case=IMAGE):
  """One process killed (SIGTERM or SIGKILL) at a random time: the other must end within
  TWO_PROCESS_DEADLINE; rerunning both must give the reference's exact result."""
  sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
  victim = rng.randrange(2)
  delay = rng.uniform(0.1, 1.0) * reference_seconds
  started = start_two(workdir, case=case)
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
  results = finish_two(start_two(workdir, case=case))
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


def two_process_round(workdir, rng, trials: int, case=IMAGE) -> collections.Counter:
  """A two-process reference run, then ``trials`` mismatch and kill trials; prints a line each."""
  outcomes = collections.Counter()
  if trials < 1:
    return outcomes
  if case is not IMAGE:
    workdir = os.path.join(workdir, case.label.replace(" ", "_").replace(",", ""))
    os.makedirs(workdir, exist_ok=True)
  reference_dir = os.path.join(workdir, "two_reference")
  start = time.perf_counter()
  results = finish_two(start_two(reference_dir, case=case))
  reference_seconds = time.perf_counter() - start
  if any(code != 0 for code, _ in results):
    print(f"{case.label}: the reference run failed (exits {[c for c, _ in results]}): "
          f"{_last_error(results[0][1])} / {_last_error(results[1][1])}", flush=True)
    outcomes[f"{case.label}: FAIL"] += 1
    return outcomes
  reference = two_process_result(reference_dir)
  print(f"{case.label}: reference: {reference['step']} samples, test accuracy "
        f"{reference['test_accuracy']}, {reference_seconds:.0f} s", flush=True)
  for trial in range(trials):
    what, verdict = mismatch_trial(os.path.join(workdir, f"mismatch{trial}"), rng, case)
    outcomes[f"{case.label}, mismatch: " + _two_process_category(verdict)] += 1
    print(f"{case.label}: mismatch {trial}: {what}: {verdict}", flush=True)
    what, verdict = kill_one_trial(os.path.join(workdir, f"kill_one{trial}"), rng, reference,
                                   reference_seconds, case)
    outcomes[f"{case.label}, kill one: " + _two_process_category(verdict)] += 1
    print(f"{case.label}: kill one {trial}: {what}; rerun: {verdict}", flush=True)
  return outcomes
