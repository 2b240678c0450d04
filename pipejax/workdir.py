"""The run's directory: checked writable, and held by one run at a time.

:func:`claim` creates the workdir, proves it can be written (by writing and removing a small file)
and takes an exclusive ``flock`` on ``workdir/.lock`` for as long as the run lasts, so a second run
started on the same workdir stops at once with a message instead of overwriting the first one's
checkpoints. The lock is advisory and local to one machine (``flock`` over NFS depends on the
server); a multi-host run takes it in process 0 only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket

from pipejax.checkpoint import StorageError, storage_error

LOCK_FILE = ".lock"


class WorkdirBusy(RuntimeError):
  """Another run holds the workdir; the message names it."""


def check_writable(workdir: str) -> None:
  """Creates ``workdir`` if needed and writes a probe file in it; a :class:`StorageError` if not."""
  probe = os.path.join(workdir, f".write-test-{os.getpid()}")
  try:
    os.makedirs(workdir, exist_ok=True)
    with open(probe, "w") as f:
      f.write("pipejax")
    os.remove(probe)
  except OSError as e:
    problem = storage_error("Preparing the workdir", os.path.abspath(workdir), e)
    raise (problem or StorageError(
        f"The workdir {os.path.abspath(workdir)} cannot be used ({e}). Choose a --workdir that is "
        "a directory this user can write.")) from None


@contextlib.contextmanager
def claim(workdir: str, lock: bool = True):
  """Checks ``workdir`` is writable and, with ``lock``, holds its lock until the block ends."""
  check_writable(workdir)
  if not lock:
    yield
    return
  path = os.path.join(workdir, LOCK_FILE)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
      raise WorkdirBusy(
          f"Another run ({holder}) is using the workdir {os.path.abspath(workdir)}. Two runs on "
          "one workdir would overwrite each other's checkpoints. Wait for it to finish (or stop it "
          "with SIGTERM: it saves a checkpoint), or choose another --workdir.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}".encode(), 0)
    yield
  finally:
    os.close(fd)  # closing releases the lock
