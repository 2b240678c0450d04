"""Runs a study's grid as trainer processes, N at a time: the scheduler behind scripts/study.py.

Each run is its own ``scripts/train.py`` process in ``WORKDIR/runs/RUN_ID`` (its log in
``log.txt`` there). A finished, diverged or skipped run is appended to ``WORKDIR/results.jsonl``
and never run again; a failed one is retried on the next invocation.

What makes a study as safe as one run:

* one study per workdir: :func:`hold` takes ``WORKDIR/.study.lock``, and a second study on the
  workdir refuses, naming the first;
* trainers die with their study: a SIGINT, SIGTERM or SIGHUP to the study asks each trainer to
  save a checkpoint and stop; an error in the study does the same; and a study killed outright
  (SIGKILL) still stops them, since each trainer gets SIGTERM when its parent dies
  (``PR_SET_PDEATHSIG``, Linux). The trainers inherit the study's lock, so a rerun waits until
  the last of them has saved its checkpoint instead of colliding with it;
* the exit code says whether the grid is complete: 0 every selected run done; 75 some not run to
  the end (stopped by a signal; named, and rerunning the same command continues); 1 some failed
  (named), or the study could not run (another study holds the workdir, a full or read-only
  disk); 2 a study that does not fit the workdir's records (a changed recipe). Each problem is
  one paragraph.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Sequence

from pipejax import cli
from pipejax.study import spec as study_lib
from pipejax.study.lock import StudyBusy, describe_holder, hold, running_trainer
from pipejax.study.preflight import check_report_workdir, check_selection, selected
from pipejax.study import records as study_records
from pipejax.study import report as study_report
from pipejax.train import workdir as workdir_lib
from pipejax.train.metrics import format_duration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = (sys.executable, os.path.join(ROOT, "scripts", "train.py"))
EXIT_COMPLETE, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_STOPPED = 75  # as scripts/train.py: stopped by a signal; rerunning the command continues
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_RERUN = "finished runs are kept and stopped ones resume from their checkpoints"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


# ----------------------------------------------------------------------------- trainer processes


class _Stop:
  """SIGINT/SIGTERM/SIGHUP: stop launching, ask every trainer to checkpoint and exit, then stop.

  A second signal kills the trainers that are still saving. The previous handlers come back when
  the block ends.
  """

  def __init__(self):
    self.count = 0

  def __enter__(self):
    self._previous = {sig: signal.signal(sig, self._handle) for sig in cli.honoured(SIGNALS)}
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  @property
  def requested(self) -> bool:
    return self.count > 0

  def _handle(self, signum, frame):
    del frame
    if signum == signal.SIGHUP:  # the terminal is gone: a print to it would raise
      cli.detach_from_terminal()
    self.count += 1
    name = signal.Signals(signum).name
    if self.count == 1:
      print(f"\n{name}: stopping; each running training saves a checkpoint. Rerun the same "
            "command to continue (a second signal kills the trainings instead).", flush=True)
    elif self.count == 2:
      print(f"\n{name} again: killing the trainings; each resumes from its last checkpoint.",
            flush=True)


def _die_with(parent: int):
  """A ``preexec_fn``: the child gets SIGTERM when ``parent`` dies, as if the study had sent it."""
  import ctypes  # pylint: disable=import-outside-toplevel
  libc = ctypes.CDLL(None, use_errno=True)

  def preexec():
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the study died before prctl: nothing would send the signal
      os.kill(os.getpid(), signal.SIGTERM)
  return preexec


def _trainer_env(parallel: int, workdir: str, at_once: int = 1) -> dict:
  """The trainers' environment; ``at_once`` trainers run together, and each one's memory check
  then counts on 1/``at_once`` of the memory, so that together they fit."""
  env = dict(os.environ)
  if at_once > 1:
    env[cli.TRAINERS_AT_ONCE] = str(at_once)
  else:
    env.pop(cli.TRAINERS_AT_ONCE, None)
  if parallel > 1:
    # Several trainings share the cores: no operation split over threads avoids oversubscription.
    # XLA's CPU runtime may still run two independent operations on two threads at once.
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                        "intra_op_parallelism_threads=1").strip()
    # Several trainings share one accelerator: JAX's default takes 75% of its memory at start,
    # which would leave the second trainer too little to start at all.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
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


def stop_trainers(processes, timeout: float = 120.0) -> None:
  """SIGTERM to each trainer still running (it saves a checkpoint and exits), then waits; kills
  the ones still running after ``timeout`` seconds."""
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


# ----------------------------------------------------------------------------- the grid


@dataclasses.dataclass
class Outcome:
  """Where the selected runs stand after :func:`run_study`, read back from results.jsonl."""

  planned: list[str]
  done: list[str]
  failed: list[str]
  not_done: list[str]  # neither done nor failed: stopped by a signal, or never started

  @property
  def exit_code(self) -> int:
    if self.failed:
      return EXIT_FAILED
    return EXIT_STOPPED if self.not_done else EXIT_COMPLETE


def outcome(study: study_lib.Study, workdir: str, where: dict[str, str] | None = None) -> Outcome:
  """Where the runs selected by ``where`` stand in ``workdir``'s results.jsonl."""
  records = {r.run: r for r in study_records.read_results(workdir)}
  result = Outcome([], [], [], [])
  for overrides in selected(study, where):
    rid = study_lib.run_id(overrides)
    result.planned.append(rid)
    getattr(result, _standing(records.get(rid), study, overrides)).append(rid)
  return result


def _standing(record: study_records.RunRecord | None, study: study_lib.Study,
              overrides: study_lib.Overrides) -> str:
  """Which list of :class:`Outcome` a run's record puts it in: "done", "failed" or "not_done"."""
  if study_records.is_done(record, study, overrides):
    return "done"
  if record is not None and record.status == study_records.FAILED:
    return "failed"
  return "not_done"


def _checkpointed_samples(run_dir: str) -> int | None:
  """The samples of the newest checkpoint directory of a run (orbax names each by its samples),
  read from the names alone: listing must not wait on orbax, nor touch a running trainer's."""
  try:
    names = os.listdir(os.path.join(run_dir, "checkpoints"))
  except OSError:
    return None
  samples = [int(name) for name in names if name.isdigit()]
  return max(samples) if samples else None


def list_runs(study: study_lib.Study, workdir: str,
              where: dict[str, str] | None = None) -> str:
  """Each run ``where`` selects, in the order the study runs them, with where it stands in
  ``workdir``: done (finished, diverged or skipped), failed, running, stopped at a checkpoint, or
  to run. Reads the records and the runs' directories and writes nothing, so it may run beside
  the study that holds the workdir."""
  records = {r.run: r for r in study_records.read_results(workdir)} if os.path.isdir(
      workdir) else {}
  lines, counts = [], {}
  for overrides in selected(study, where):
    rid = study_lib.run_id(overrides)
    record = records.get(rid)
    standing = _standing(record, study, overrides)
    if standing == "done":
      kind, detail = record.status, ""
    elif standing == "failed":
      kind, detail = "failed", " (retried on rerun)"
    else:
      run_dir = os.path.join(workdir, "runs", study_lib.directory_name(rid))
      samples, pid = _checkpointed_samples(run_dir), running_trainer(run_dir)
      at = f"last checkpoint at {samples:,} samples" if samples is not None else ""
      if pid is not None:
        kind, detail = "running", f" (process {pid}{', ' + at if at else ''})"
      elif samples is not None:
        kind, detail = "stopped", f" ({at}: resumes from it on rerun)"
      else:
        kind, detail = "to run", ""
    counts[kind] = counts.get(kind, 0) + 1
    lines.append(f"{kind}{detail}: {rid}")
  summary = ", ".join(f"{n} {kind}" for kind, n in counts.items())
  return "\n".join([f"Study {study.name!r}, {workdir}: {sum(counts.values())} runs selected"
                    + (f" ({summary})." if summary else "."), *lines])


def _names(runs: Sequence[str], limit: int = 10) -> str:
  more = f" and {len(runs) - limit} more" if len(runs) > limit else ""
  return ", ".join(runs[:limit]) + more


def check_records(study: study_lib.Study, workdir: str) -> list[study_records.RunRecord]:
  """Prints what is wrong with results.jsonl (each skipped line), refuses a changed recipe
  (:class:`pipejax.study.StudyError`), and returns the records."""
  records, problems = study_records.load_results(workdir)
  for problem in problems:
    print(f"warning: {problem}", flush=True)
  change = study_records.recipe_change(study, records, workdir)
  if change:
    raise study_lib.StudyError(change)
  return records


def run_study(study: study_lib.Study, workdir: str, parallel: int, command: str,
              where: dict[str, str] | None = None, lock: workdir_lib.FileLock | None = None,
              trainer: Sequence[str] = TRAINER) -> Outcome:
  """Runs every run not yet done (of those matching ``where``); returns where the runs stand.

  ``lock`` (from :func:`hold`) is passed on to the trainers and names them; ``trainer`` is the
  command of a trainer, to which each run's ``--config``, ``--workdir`` and overrides are added.
  """
  os.makedirs(os.path.join(workdir, "runs"), exist_ok=True)
  message = study_records.set_aside_partial_line(workdir)
  if message:
    print(f"warning: {message}", flush=True)
  done = {r.run: r for r in check_records(study, workdir)}
  planned = selected(study, where)
  todo = [o for o in planned if not study_records.is_done(done.get(study_lib.run_id(o)), study, o)]
  # Every cell's first seed before any cell's second: a study stopped part-way (or spread over
  # several sessions) then has a result in every cell.
  todo.sort(key=lambda o: o.get("seed", 0))
  print(f"Study '{study.name}': {len(planned)} runs, {len(planned) - len(todo)} already done, "
        f"{len(todo)} to run, {parallel} at a time. Workdir: {workdir}", flush=True)
  at_once = min(parallel, len(todo))
  warning = parallel_warning(at_once)
  if warning:
    print(f"warning: {warning}", flush=True)
  env = _trainer_env(parallel, workdir, at_once)
  running: dict[str, tuple] = {}  # run id -> (process, overrides, start time, log path)
  durations, failed, started_at, last_status = [], 0, time.time(), 0.0
  signalled: dict[int, int] = {}  # trainer pid -> 1 (sent SIGTERM) or 2 (sent SIGKILL)

  def status_line():
    finished = sum(study_records.is_done(done.get(study_lib.run_id(o)), study, o) for o in planned)
    now = time.time()
    left = eta(durations, [now - start for _, _, start, _ in running.values()], len(todo),
               parallel)
    return (f"[{finished}/{len(planned)} done, {len(running)} running, {failed} failed, "
            f"ETA {'?' if left is None else format_duration(left)}]")

  def record(rid, result):
    message = study_records.append_result(workdir, result)
    if message:
      print(f"warning: {message}", flush=True)
    done[rid] = result

  def trainers_changed():
    if lock is not None:
      describe_holder(lock, [process.pid for process, *_ in running.values()])

  with _Stop() as stop:
    try:
      while (todo or running) and not (stop.requested and not running):
        while todo and len(running) < parallel and not stop.requested:
          overrides = todo.pop(0)
          rid = study_lib.run_id(overrides)
          failed_at = study_records.failed_below(study, done.values(), overrides)
          if failed_at is not None:
            record(rid, study_records.skipped_record(study, overrides, failed_at))
            print(f"{status_line()} skipped {rid}: {done[rid].reason}", flush=True)
            continue
          process, log_path = _start_trainer(study, overrides, run_directory(workdir, overrides),
                                             trainer, env, lock)
          running[rid] = (process, overrides, time.time(), log_path)
          trainers_changed()
          print(f"{status_line()} started {rid}", flush=True)
        _pass_on_stop(stop.count, [process for process, *_ in running.values()], signalled)
        time.sleep(0.5)
        for rid, (process, overrides, start, log_path) in list(running.items()):
          if process.poll() is None:
            continue
          del running[rid]
          trainers_changed()
          wall = time.time() - start
          tail = _log_tail(log_path)
          if process.returncode == EXIT_STOPPED or (stop.requested and process.returncode < 0):
            who = "" if stop.requested else " by a signal the study did not send"
            print(f"{status_line()} stopped {rid}{who} (resumes on rerun)", flush=True)
            continue
          result = study_records.record_from_run(study, overrides, os.path.dirname(log_path),
                                             process.returncode, wall, tail)
          record(rid, result)
          durations.append(wall)
          failed += result.status == study_records.FAILED
          line = _finished_line(rid, result, process.returncode, wall, tail, log_path)
          print(f"{status_line()} {line}", flush=True)
          study_report.write_report(study, workdir, command)
        if running and time.time() - last_status > 120:
          last_status = time.time()
          print(f"{status_line()} running for {format_duration(time.time() - started_at)}",
                flush=True)
    finally:
      # Normally none is left. After an error in the study (a bug, a full disk) the trainers,
      # in sessions of their own, would go on unwatched and their results never be recorded.
      stop_trainers([process for process, *_ in running.values()])
  study_report.write_report(study, workdir, command)
  result = outcome(study, workdir, where)
  _print_outcome(result, workdir)
  return result


def eta(durations: Sequence[float], running: Sequence[float], queued: int,
        parallel: int) -> float | None:
  """Seconds until the study's last run ends, None before a run has finished.

  Each run is taken to last the mean of the finished runs' wall times (measured while the study
  ran ``parallel`` at a time, so they include the sharing): a running run ends then (or now, if
  it is past it; ``running`` holds their seconds so far), and each of the ``queued`` runs starts
  in the first of the ``parallel`` slots to come free. So the last runs of a study, which run
  fewer than ``parallel`` at a time, are counted at their own length, not a share of it.
  """
  if not durations:
    return None
  mean = sum(durations) / len(durations)
  slots = [max(0.0, mean - elapsed) for elapsed in running]
  slots += [0.0] * max(0, parallel - len(slots))
  heapq.heapify(slots)
  for _ in range(queued):
    heapq.heappush(slots, heapq.heappop(slots) + mean)
  return max(slots) if running or queued else 0.0


def cpu_cores() -> int:
  """The CPU cores this process may run on (a container or ``taskset`` may allow fewer than the
  machine has)."""
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    return os.cpu_count() or 1


def parallel_warning(at_once: int) -> str | None:
  """The warning for more trainings at once than this process has CPU cores, else None."""
  cores = cpu_cores()
  if at_once <= cores:
    return None
  return (f"{at_once} trainings at once (--parallel) on {cores} CPU cores: each gets a share "
          f"of a core, so the study is no faster than with --parallel={cores}, and it holds "
          f"{at_once} trainings' memory at once (each trainer checks that its run fits in 1/"
          f"{at_once} of the memory). Give --parallel={cores} or less, unless the trainings mostly "
          "wait on an accelerator.")


def run_directory(workdir: str, overrides: dict) -> str:
  """``WORKDIR/runs/RUN_ID`` (a long id's start and digest: ``spec.directory_name``). A run
  stopped before run ids were the same whatever the order of a grid's keys has its directory
  under its grid's order: it is renamed, so the run resumes from its checkpoints."""
  path = os.path.join(workdir, "runs", study_lib.directory_name(study_lib.run_id(overrides)))
  old = os.path.join(workdir, "runs", ",".join(
      f"{k}={study_lib.format_value(v)}" for k, v in overrides.items()).replace(
          "/", "_").replace(" ", ""))
  if old != path and os.path.isdir(old) and not os.path.lexists(path):
    os.rename(old, path)
  return path


def _start_trainer(study: study_lib.Study, overrides: dict, run_dir: str,
                   trainer: Sequence[str], env: dict, lock: workdir_lib.FileLock | None):
  """Starts the trainer of one run in ``run_dir``, its output appended to its log; returns the
  process and the log's path."""
  os.makedirs(run_dir, exist_ok=True)
  argv = [*trainer, f"--config={os.path.join(ROOT, study.config)}",
          f"--workdir={run_dir}", *study_lib.trainer_flags(study, overrides)]
  log_path = os.path.join(run_dir, "log.txt")
  with open(log_path, "ab") as log:
    log.write(f"$ {shlex.join(argv)}\n".encode())
    # A session of its own: Ctrl-C reaches the study alone, which stops each trainer
    # through its checkpoint.
    process = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        start_new_session=True, pass_fds=(lock.fd,) if lock is not None else (),
        preexec_fn=_die_with(os.getpid()) if sys.platform == "linux" else None)
  return process, log_path


def _pass_on_stop(stop_count: int, processes, signalled: dict[int, int]) -> None:
  """SIGTERM to each running trainer at the first stop request, SIGKILL at the second."""
  for process in processes:
    # Once per trainer and signal: a trainer that is saving its checkpoint is left alone.
    wanted = min(stop_count, 2)
    if signalled.get(process.pid, 0) < wanted and process.poll() is None:
      process.send_signal(signal.SIGTERM if wanted == 1 else signal.SIGKILL)
      signalled[process.pid] = wanted


def _finished_line(rid: str, result: study_records.RunRecord, returncode: int, wall: float,
                   tail: str, log_path: str) -> str:
  """What the progress line says of a run whose trainer exited."""
  if result.status == study_records.FAILED:
    last_line = [l for l in tail.strip().splitlines() if l.strip()][-1:] or [""]
    return f"FAILED {rid} (exit {returncode}, log {log_path}): {last_line[0][:300]}"
  accuracy = result.test_accuracy
  text = f"test accuracy {accuracy:.4f}" if isinstance(accuracy, float) else "diverged"
  return f"{result.status} {rid}: {text} ({format_duration(wall)})"


def _print_outcome(result: Outcome, workdir: str) -> None:
  """The study's last lines: how many runs are done, and which failed or were stopped."""
  print(f"[{len(result.done)}/{len(result.planned)} done, {len(result.failed)} failed] report: "
        f"{os.path.join(workdir, 'report.md')}", flush=True)
  if result.failed:
    print(f"Failed ({len(result.failed)}, retried on rerun; each one's log is "
          f"{os.path.join(workdir, 'runs', 'RUN', 'log.txt')}): {_names(result.failed)}",
          flush=True)
  if result.not_done:
    print(f"Not done ({len(result.not_done)}, stopped before the end): "
          f"{_names(result.not_done)}. Rerun the same command to continue.", flush=True)


def main(study: study_lib.Study, workdir: str, *, parallel: int, command: str,
         where: dict[str, str] | None = None, report_only: bool = False,
         list_only: bool = False, trainer: Sequence[str] = TRAINER) -> int:
  """What scripts/study.py does; returns its exit code. A problem a user can fix is printed
  as one paragraph, never as a traceback."""
  action = "Writing the report" if report_only else "Running the study"
  try:
    check_selection(study, where)
    if list_only:
      print(list_runs(study, workdir, where))
      return EXIT_COMPLETE
    if report_only:
      check_report_workdir(workdir)
      check_records(study, workdir)
      os.makedirs(workdir, exist_ok=True)
      print(study_report.write_report(study, workdir, command))
      return EXIT_COMPLETE
    with hold(workdir) as lock:
      return run_study(study, workdir, parallel, command, where, lock, trainer).exit_code
  except (StudyBusy, study_lib.StudyError) as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USAGE if isinstance(e, study_lib.StudyError) else EXIT_FAILED
  except KeyboardInterrupt:  # before the trainers start (run_study handles signals after)
    print("\nInterrupted; no training was started.", file=sys.stderr)
    return EXIT_STOPPED
  except OSError as e:
    problem = workdir_lib.storage_error(action, e.filename or workdir, e, _RERUN)
    if problem is None:
      raise
    print(f"error: {problem}", file=sys.stderr)
    return EXIT_FAILED
