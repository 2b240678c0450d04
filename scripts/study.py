r"""Runs a study: a grid of trainings (config x method x seed x overrides), N at a time.

    python scripts/study.py --study=configs/studies/depth.py --workdir=docs/studies/depth
    python scripts/study.py --study=configs/studies/depth.py:smoke --workdir=/tmp/depth_smoke
    python scripts/study.py --study=configs/studies/depth.py --workdir=docs/studies/depth --report_only

Each run is its own ``scripts/train.py`` process in ``WORKDIR/runs/RUN_ID`` (its log in
``log.txt`` there). A finished or diverged run is appended to ``WORKDIR/results.jsonl`` and never
run again; a failed one is retried on the next invocation. Ctrl-C (or SIGTERM) stops every
running trainer through its own checkpoint, so rerunning the same command continues the study
where it stopped. ``WORKDIR/report.md``, ``results.csv`` and the figures are rewritten after every
run. Runs share a persistent XLA compilation cache (``WORKDIR/runs/.jax_cache``), so runs that
differ only by seed compile once.
"""

import os
import shlex
import signal
import subprocess
import sys
import time

from absl import app, flags, logging

from pipejax import cli
from pipejax import study as study_lib
from pipejax import study_report

_STUDY = flags.DEFINE_string("study", None, "Study file, e.g. configs/studies/depth.py[:smoke].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where results.jsonl, report.md, the figures and "
                               "runs/ (the trainers' workdirs) go.")
_PARALLEL = flags.DEFINE_integer("parallel", None, "Trainings at a time; default: the number of "
                                 "CPU cores (each training then uses one core).")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Only rewrite the report from results.jsonl.")
_WHERE = flags.DEFINE_list("where", [], "Run only the grid points with these overrides, e.g. "
                           "--where=model_kwargs.depth=32,method=pb (the report covers all).")
flags.mark_flags_as_required(["study", "workdir"])

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_STOPPED = 75  # scripts/train.py: stopped by a signal after its checkpoint; resumes on rerun


class _Stop:
  """SIGINT/SIGTERM: stop launching, ask every trainer to checkpoint and exit, then stop."""

  def __init__(self):
    self.requested = False
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    if not self.requested:
      print(f"\n{signal.Signals(signum).name}: stopping; each running training saves a "
            "checkpoint. Rerun the same command to continue.", flush=True)
    self.requested = True


def _duration(seconds: float) -> str:
  seconds = max(0, int(seconds))
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
      f"{seconds // 60}m{seconds % 60:02d}s"


def _trainer_env(parallel: int, workdir: str) -> dict:
  env = dict(os.environ)
  if parallel > 1:
    # Several trainings share the cores: one thread each avoids oversubscription.
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                        "intra_op_parallelism_threads=1").strip()
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(workdir, "runs", ".jax_cache"))
  env["PYTHONUNBUFFERED"] = "1"
  return env


def _log_tail(path: str, size: int = 4000) -> str:
  try:
    with open(path, "rb") as f:
      f.seek(0, os.SEEK_END)
      f.seek(max(0, f.tell() - size))
      return f.read().decode("utf-8", "replace")
  except OSError:
    return ""


def _stop_trainers(processes, timeout: float = 120.0) -> None:
  """SIGTERM to each trainer still running (it saves a checkpoint and exits), then waits."""
  for process in processes:
    if process.poll() is None:
      process.send_signal(signal.SIGTERM)
  deadline = time.time() + timeout
  for process in processes:
    try:
      process.wait(max(0.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()


def run_study(study: study_lib.Study, workdir: str, parallel: int, command: str,
              where: dict[str, str] | None = None) -> int:
  """Runs every run not yet done (of those matching ``where``); returns the number that failed."""
  os.makedirs(os.path.join(workdir, "runs"), exist_ok=True)
  done = {r["run"]: r for r in study_lib.read_results(workdir)}
  planned = [o for o in study.runs()
             if all(study_lib.format_value(o.get(k)) == v for k, v in (where or {}).items())]
  todo = [o for o in planned if not study_lib.is_done(done.get(study_lib.run_id(o)), study, o)]
  # Every cell's first seed before any cell's second: a study stopped part-way (or spread over
  # several sessions) then has a result in every cell.
  todo.sort(key=lambda o: o.get("seed", 0))
  print(f"Study '{study.name}': {len(planned)} runs, {len(planned) - len(todo)} already done, "
        f"{len(todo)} to run, {parallel} at a time. Workdir: {workdir}", flush=True)
  stop = _Stop()
  env = _trainer_env(parallel, workdir)
  running: dict[str, tuple] = {}  # run id -> (process, overrides, start time, log path)
  durations, failed, started_at = [], 0, time.time()
  last_status = 0.0
  already_done = len(planned) - len(todo)

  def status_line():
    finished = already_done + len(durations)
    remaining = len(planned) - finished
    eta = "?"
    if durations:
      eta = _duration(sum(durations) / len(durations) * remaining / parallel)
    return (f"[{finished}/{len(planned)} done, {len(running)} running, {failed} failed, "
            f"ETA {eta}]")

  try:
    while (todo or running) and not (stop.requested and not running):
      while todo and len(running) < parallel and not stop.requested:
        overrides = todo.pop(0)
        rid = study_lib.run_id(overrides)
        failed_at = study_lib.failed_below(study, done.values(), overrides)
        if failed_at is not None:
          record = study_lib.skipped_record(study, overrides, failed_at)
          study_lib.append_result(workdir, record)
          done[rid] = record
          already_done += 1
          print(f"{status_line()} skipped {rid}: {record['reason']}", flush=True)
          continue
        run_dir = os.path.join(workdir, "runs", rid)
        os.makedirs(run_dir, exist_ok=True)
        argv = [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
                f"--config={os.path.join(ROOT, study.config)}", f"--workdir={run_dir}",
                *study_lib.trainer_flags(study, overrides)]
        log_path = os.path.join(run_dir, "log.txt")
        with open(log_path, "ab") as log:
          log.write(f"$ {shlex.join(argv)}\n".encode())
          process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=ROOT, start_new_session=True)
        running[rid] = (process, overrides, time.time(), log_path)
        print(f"{status_line()} started {rid}", flush=True)
      if stop.requested:
        for process, *_ in running.values():
          if process.poll() is None:
            process.send_signal(signal.SIGTERM)
      time.sleep(0.5)
      for rid, (process, overrides, start, log_path) in list(running.items()):
        if process.poll() is None:
          continue
        del running[rid]
        wall = time.time() - start
        tail = _log_tail(log_path)
        if stop.requested or process.returncode == EXIT_STOPPED:
          print(f"{status_line()} stopped {rid} (resumes on rerun)", flush=True)
          continue
        record = study_lib.record_from_run(study, overrides, os.path.dirname(log_path),
                                           process.returncode, wall, tail)
        study_lib.append_result(workdir, record)
        done[rid] = record
        durations.append(wall)
        if record["status"] == study_lib.FAILED:
          failed += 1
          last_line = [l for l in tail.strip().splitlines() if l.strip()][-1:] or [""]
          print(f"{status_line()} FAILED {rid} (exit {process.returncode}, log {log_path}): "
                f"{last_line[0][:300]}", flush=True)
        else:
          accuracy = record.get("test_accuracy")
          result = f"test accuracy {accuracy:.4f}" if isinstance(accuracy, float) else "diverged"
          print(f"{status_line()} {record['status']} {rid}: {result} ({_duration(wall)})",
                flush=True)
        study_report.write_report(study, workdir, command)
      if running and time.time() - last_status > 120:
        last_status = time.time()
        print(f"{status_line()} running for {_duration(time.time() - started_at)}", flush=True)
  except BaseException:
    # The study itself failed (a bug, a full disk). Its trainers run in sessions of their own and
    # would go on unwatched, their results never recorded: ask each to checkpoint and stop.
    _stop_trainers([process for process, *_ in running.values()])
    raise
  study_report.write_report(study, workdir, command)
  print(f"{status_line()} report: {os.path.join(workdir, 'report.md')}", flush=True)
  return failed


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    study = study_lib.load_study(_STUDY.value)
  except study_lib.StudyError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  workdir = os.path.abspath(_WORKDIR.value)
  command = f"python scripts/study.py --study={_STUDY.value} --workdir={_WORKDIR.value}"
  if _REPORT_ONLY.value:
    os.makedirs(workdir, exist_ok=True)
    print(study_report.write_report(study, workdir, command))
    return
  parallel = _PARALLEL.value or os.cpu_count() or 1
  if parallel < 1:
    print(f"error: --parallel must be at least 1; got {parallel}.", file=sys.stderr)
    sys.exit(2)
  where = {}
  for item in _WHERE.value:
    key, sep, value = item.partition("=")
    if not sep or key not in study.keys():
      print(f"error: --where takes KEY=VALUE items with a grid key of the study "
            f"({', '.join(study.keys())}); got {item!r}.", file=sys.stderr)
      sys.exit(2)
    where[key] = value
  failed = run_study(study, workdir, parallel, command, where)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  logging.set_verbosity(logging.WARNING)
  cli.run(main)
