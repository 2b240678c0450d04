"""One study per workdir: the lock a study holds, and hands on to the trainers it starts."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from typing import Sequence

from pipejax.train import workdir as workdir_lib

LOCK_FILE = ".study.lock"


class StudyBusy(RuntimeError):
  """Another study holds the workdir; the message names it."""


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has ended
  except OSError:
    pass
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def describe_holder(lock: workdir_lib.FileLock, trainers: Sequence[int] = ()) -> None:
  lock.describe(f"study {workdir_lib.this_process()}\n"
                f"trainers: {' '.join(str(p) for p in trainers)}\n")


def running_trainer(run_dir: str) -> int | None:
  """The process id of the trainer that holds ``run_dir`` on this host, read from the text its
  lock file keeps (never by taking the lock, which would make a trainer starting that instant
  refuse its workdir); None when none runs there."""
  try:
    with open(os.path.join(run_dir, workdir_lib.LOCK_FILE)) as f:
      holder = re.search(r"process (\d+) on (\S+)", f.read())
  except OSError:
    return None
  if holder and holder.group(2) == socket.gethostname() and _alive(int(holder.group(1))):
    return int(holder.group(1))
  return None


@contextlib.contextmanager
def hold(workdir: str, wait_s: float = 300.0):
  """Holds ``workdir``'s study lock for the block; :class:`StudyBusy` if another study has it.

  When the holder is a study of this host that has ended (killed outright), the lock is held by
  the trainers it started, which are saving their checkpoints: this waits for them up to
  ``wait_s`` seconds.
  """
  os.makedirs(workdir, exist_ok=True)
  lock = workdir_lib.FileLock(os.path.join(workdir, LOCK_FILE))
  try:
    if not lock.acquire():
      holder = lock.holder()
      study = re.search(r"study process (\d+) on (\S+)", holder)
      trainers = " ".join(re.findall(r"\d+", holder.partition("trainers:")[2])) or "unknown"
      if not (study and study.group(2) == socket.gethostname() and not _alive(int(study[1]))):
        who = study[0] if study else (holder or "another process")
        raise StudyBusy(
            f"Another study ({who}) is running in {workdir}. Two studies on one workdir would "
            "start the same trainings twice and interleave their records. Wait for it to finish, "
            f"stop it (Ctrl-C in its terminal, or kill {study[1] if study else 'PID'}: its "
            "trainers save checkpoints), or give this study another --workdir.")
      print(f"The study that held {workdir} ({study[0]}) has ended; waiting up to "
            f"{wait_s:.0f} s for the trainers it started (processes {trainers}) to save their "
            "checkpoints and exit.", flush=True)
      deadline = time.monotonic() + wait_s
      while not lock.acquire():
        if time.monotonic() > deadline:
          raise StudyBusy(
              f"The trainers (processes {trainers}) of the study that held {workdir} "
              f"({study[0]}, now ended) still hold it after {wait_s:.0f} s. Stop them (kill PID: "
              "each saves a checkpoint) and rerun the same command.")
        time.sleep(0.5)
    describe_holder(lock)
    yield lock
  finally:
    lock.close()
