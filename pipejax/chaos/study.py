"""The study launcher: the study killed, one of its trainers killed, its results file cut, its
report rewritten by ``--report_only`` beside it."""

import collections
import glob
import os
import shutil
import signal
import subprocess
import time
from typing import NamedTuple, Sequence

from pipejax.study import records as study_records
from pipejax.chaos import ROOT, ReferenceFailed, child_env, python


class StudyCase(NamedTuple):
  """The study the trials run: a study file (``path[:arg]``) and its ``--where`` items."""
  study: str
  where: Sequence[str] = ()

  def command(self, workdir):
    """The study's command line, one run at a time: a kill then lands between runs as well as
    inside one."""
    where = [f"--where={','.join(self.where)}"] if self.where else []
    return [*python("study.py"), f"--study={self.study}", f"--workdir={workdir}", "--parallel=1",
            *where]


def run_study(case, workdir, env, timeout=900):
  done = subprocess.run(case.command(workdir), capture_output=True, text=True, timeout=timeout,
                        env=env, cwd=ROOT)
  return done.returncode, done.stdout + done.stderr


def study_results(workdir):
  """Each recorded run's numbers, and the sentences naming lines that are not records."""
  records, problems = study_records.load_results(workdir)
  return {r.run: {k: r.get(k) for k in ("status", "test_accuracy", "test_loss", "samples")}
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


def kill_study(case, workdir, env, rng, seconds):
  """Starts the study and kills it; returns a description, a failure if a trainer outlives it,
  and the study's exit code."""
  sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
  process = subprocess.Popen(case.command(workdir), stdout=subprocess.DEVNULL,
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


def kill_trainer(case, workdir, env, rng, seconds):
  """Starts the study and kills one of its trainers at a random moment."""
  sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
  process = subprocess.Popen(case.command(workdir), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
  when, victim = study_moment(workdir, process, rng, seconds), None
  trainers = trainers_of(workdir) if when else []
  if trainers:
    victim = rng.choice(sorted(trainers))
    os.kill(victim, sig)
  code = process.wait(timeout=600)
  who = f"trainer {victim} {when}" if victim else "no trainer (the study ended first)"
  return f"{signal.Signals(sig).name} to {who} (the study's exit {code})", code


def report_problem(workdir):
  """Why the study's report.md is not a whole report of its records (or a writer's temporary file
  is left beside it), None when it is."""
  records, _ = study_records.load_results(workdir)
  path = os.path.join(workdir, "report.md")
  text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
  if not text.startswith("# Study") or f"\n{len(records)} of " not in text or \
      not text.endswith("\n"):
    return f"FAIL: report.md is not a whole report of the {len(records)} records"
  left = [name for name in os.listdir(workdir) if ".tmp" in name]
  return f"FAIL: temporary files left: {', '.join(left)}" if left else None


def report_beside(case, workdir, env, rng, reference):
  """Runs the study while ``--report_only`` rewrites its report in a loop beside it, from a random
  moment on; returns a description and the verdict: the study must end complete and exact by
  itself, every report of the loop must succeed, and the last report must be whole."""
  process = subprocess.Popen(case.command(workdir), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
  report = [*python("study.py"), f"--study={case.study}", f"--workdir={workdir}",
            "--report_only"]
  while process.poll() is None and not os.path.isdir(os.path.join(workdir, "runs")):
    time.sleep(0.05)
  time.sleep(rng.uniform(0.0, 2.0))
  reports, failure = 0, None
  while process.poll() is None and failure is None:
    done = subprocess.run(report, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    reports += 1
    if done.returncode != 0:
      failure = f"FAIL: --report_only exited {done.returncode}: {done.stderr.strip()[-300:]}"
  code = process.wait(timeout=900)
  what = f"{reports} reports beside the study (its exit {code})"
  verdict = failure or judge_study(workdir, code, process.stderr.read(), reference)
  if verdict == "exact":
    verdict = report_problem(workdir) or verdict
  return what, verdict


def cut_results_line(workdir, rng):
  """Cuts results.jsonl inside its last line, as a full disk leaves a record half-written."""
  path = os.path.join(workdir, study_records.RESULTS_FILE)
  with open(path, "rb") as f:
    data = f.read()
  start = data.rstrip(b"\n").rfind(b"\n") + 1
  cut = rng.randrange(start + 1, len(data))
  os.truncate(path, cut)
  return f"results.jsonl cut at byte {cut - start} of its last line ({len(data) - start} bytes)"


def study_trials(case: StudyCase, workdir, trials, rng) -> collections.Counter:
  """An uninterrupted reference study, then ``trials`` of each study-runner case
  (scripts/chaos.py); prints a line each and returns their outcome counts.

  Raises:
    ReferenceFailed: the reference study failed.
  """
  env = child_env(JAX_COMPILATION_CACHE_DIR=os.path.join(workdir, "jax_cache"))
  reference_dir = os.path.join(workdir, "study-reference")
  start = time.perf_counter()
  code, output = run_study(case, reference_dir, env)
  seconds = time.perf_counter() - start
  reference, problems = study_results(reference_dir)
  if code != 0 or problems:
    raise ReferenceFailed(f"The reference study failed (exit {code}):\n{output[-3000:]}")
  print(f"study reference: {len(reference)} runs, {seconds:.0f} s", flush=True)
  outcomes = collections.Counter()

  def rerun(kind, trial, what, case_dir, failure=None, landed=True):
    code, output = run_study(case, case_dir, env)
    verdict = failure or judge_study(case_dir, code, output, reference)
    category = "FAIL" if verdict.startswith("FAIL") else verdict
    outcomes[f"study {kind}: {category}" + ("" if landed else " (ended before the kill)")] += 1
    print(f"study {kind} {trial}: {what}; rerun: {verdict}", flush=True)

  for trial in range(trials):
    case_dir = os.path.join(workdir, f"study-kill{trial}")
    what, failure, code = kill_study(case, case_dir, env, rng, seconds)
    if failure is None and code == 0:  # the study ended before the signal: it must be complete
      failure = judge_study(case_dir, 0, "", reference)
      failure = None if failure == "exact" else f"{failure} (before the rerun)"
    rerun("kill", trial, what, case_dir, failure, landed=code != 0)

    case_dir = os.path.join(workdir, f"study-trainer-kill{trial}")
    what, code = kill_trainer(case, case_dir, env, rng, seconds)
    failure = None
    if code == 0 and judge_study(case_dir, 0, "", reference) != "exact":
      failure = "FAIL: the study exited 0 with an incomplete grid"
    rerun("trainer kill", trial, what, case_dir, failure, landed="no trainer" not in what)

    case_dir = os.path.join(workdir, f"study-cut{trial}")
    shutil.copytree(reference_dir, case_dir)
    rerun("cut line", trial, cut_results_line(case_dir, rng), case_dir)

    case_dir = os.path.join(workdir, f"study-report-beside{trial}")
    what, verdict = report_beside(case, case_dir, env, rng, reference)
    outcomes[f"study report beside: {'FAIL' if verdict.startswith('FAIL') else verdict}"] += 1
    print(f"study report beside {trial}: {what}: {verdict}", flush=True)
  return outcomes
