"""The run's directory: checked writable, held by one run at a time, storage errors said plainly.

:func:`claim` creates the workdir, proves it can be written (by writing and removing a small file)
and takes an exclusive ``flock`` on ``workdir/.lock`` for as long as the run lasts, so a second run
started on the same workdir stops at once with a message instead of overwriting the first one's
checkpoints. The lock is advisory and local to one machine (``flock`` over NFS depends on the
server); a multi-host run takes it in process 0 only. A study holds its own workdir the same way
(:class:`FileLock`, in ``pipejax.study.launcher``).

No JAX here: the study launcher, which only starts trainer processes, uses it too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket

from pipejax import files

LOCK_FILE = ".lock"


class WorkdirBusy(RuntimeError):
  """Another run holds the workdir; the message names it."""


class StorageError(RuntimeError):
  """The workdir cannot be written (full disk, read-only, no permission); the message says how."""


def first_line(error: BaseException) -> str:
  """The first line of an error's message (its type's name when it has none), at most 300 chars."""
  return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def storage_error(action: str, path: str, error: BaseException,
                  rerun: str = "the run resumes from its last complete checkpoint"
                  ) -> StorageError | None:
  """The one-paragraph error for a write that failed for want of space or permission, else None.

  ``rerun`` completes "rerun the same command:" in the full-disk message.
  """
  text = str(error)
  if (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)) or \
      "RESOURCE_EXHAUSTED" in text or "No space left" in text:
    return StorageError(
        f"{action} failed: the disk holding {path} is full ({first_line(error)}). Free some space "
        f"(or point --workdir to a larger disk) and rerun the same command: {rerun}.")
  if isinstance(error, PermissionError) or (isinstance(error, OSError) and error.errno in (
      errno.EACCES, errno.EPERM, errno.EROFS)) or "Permission denied" in text or \
      "Read-only file system" in text:
    return StorageError(
        f"{action} failed: {path} cannot be written ({first_line(error)}). Make the directory "
        "writable for this user, or choose another --workdir.")
  return None


def check_writable(workdir: str) -> None:
  """Creates ``workdir`` if needed and writes a probe file in it; a :class:`StorageError` if not."""
  probe = os.path.join(workdir, f".write-test-{os.getpid()}")
  try:
    os.makedirs(workdir, exist_ok=True)
    files.write(probe, "pipejax")  # as the run writes: a file of its own, renamed
    os.remove(probe)
  except OSError as e:
    raise _unusable(workdir, e) from None


def _unusable(workdir: str, error: OSError) -> StorageError:
  problem = storage_error("Preparing the workdir", os.path.abspath(workdir), error)
  return problem or StorageError(
      f"The workdir {os.path.abspath(workdir)} cannot be used ({error}). Choose a --workdir that "
      "is a directory this user can write.")


def check_usable(workdir: str) -> None:
  """What :func:`check_writable` and :func:`check_layout` refuse, found without creating or
  writing anything: a run checks its workdir before its slower checks (loading the data,
  building the model), and claims it only after them, so that a refused run leaves no directory.
  """
  existing = os.path.abspath(workdir)
  while not os.path.lexists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise _unusable(workdir, NotADirectoryError(errno.ENOTDIR, "Not a directory", existing))
  if not os.access(existing, os.W_OK | os.X_OK):
    raise _unusable(workdir, PermissionError(errno.EACCES, "Permission denied", existing))
  if os.path.isdir(workdir):
    check_layout(workdir)


# What a run writes in its workdir: files, and directories.
RUN_FILES = (LOCK_FILE, "config.json", "summary.json", "metrics.jsonl", "config_changes.jsonl",
             "curves.png")
RUN_DIRECTORIES = ("checkpoints", "tensorboard")


def check_layout(workdir: str) -> None:
  """A :class:`StorageError` naming a directory where the run writes a file, or a file where it
  keeps a directory: found before the run starts, not when it writes there at its end."""
  for names, wrong, is_wrong in ((RUN_FILES, "a directory", os.path.isdir),
                                 (RUN_DIRECTORIES, "a file", lambda p: os.path.lexists(p) and
                                  not os.path.isdir(p))):
    for name in names:
      path = os.path.join(os.path.abspath(workdir), name)
      if is_wrong(path):
        raise StorageError(
            f"{path} is {wrong}, where the run keeps its {name}. Move it away (or delete it) "
            "and rerun, or choose another --workdir.")


class FileLock:
  """An exclusive ``flock`` on a file whose text names the holder.

  The lock belongs to the open file: a child process that inherits the descriptor holds it too,
  until the last holder closes it or exits.
  """

  def __init__(self, path: str):
    self.path = path
    self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

  def acquire(self) -> bool:
    """Takes the lock if no one holds it; False (and nothing changed) if someone does."""
    try:
      fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      return False
    return True

  def wait(self) -> None:
    """Takes the lock, waiting for its holder to release it."""
    fcntl.flock(self.fd, fcntl.LOCK_EX)

  def holder(self) -> str:
    """What the holder wrote with :meth:`describe`."""
    return os.pread(self.fd, 4096, 0).decode(errors="replace").strip()

  def describe(self, text: str) -> None:
    os.ftruncate(self.fd, 0)
    os.pwrite(self.fd, text.encode(), 0)

  def close(self) -> None:
    os.close(self.fd)  # releases the lock unless a child still holds the descriptor


def this_process() -> str:
  """'process PID on HOST', as the locks name their holder."""
  return f"process {os.getpid()} on {socket.gethostname()}"


@contextlib.contextmanager
def claim(workdir: str, lock: bool = True):
  """Checks ``workdir`` is writable and, with ``lock``, holds its lock until the block ends."""
  check_writable(workdir)
  check_layout(workdir)
  if not lock:
    yield
    return
  held = FileLock(os.path.join(workdir, LOCK_FILE))
  try:
    if not held.acquire():
      raise WorkdirBusy(
          f"Another run ({held.holder() or 'another process'}) is using the workdir "
          f"{os.path.abspath(workdir)}. Two runs on one workdir would overwrite each other's "
          "checkpoints. Wait for it to finish (or stop it with SIGTERM: it saves a checkpoint), or "
          "choose another --workdir.")
    held.describe(this_process())
    yield
  finally:
    held.close()
