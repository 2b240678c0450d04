"""Every file the trainer and a study write: whole files replaced atomically, logs appended whole.

A whole file (summary.json, config.json, report.md, a figure) is written to a temporary file of
a name no other writer uses, in the destination's directory, flushed to disk and renamed over
the destination: a reader, a kill or a full disk mid-write leaves the old file or the new one,
never a file cut short, and two writers of one file (a study and ``--report_only`` beside it)
never touch each other's temporary files; the last rename wins. An append-only log (results.jsonl,
config_changes.jsonl) takes each line in one ``write``: a line is all there or cut at its end,
never interleaved with another, and its readers skip a cut last line.

No JAX here: the study launcher and the plotting helper use it too.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from typing import Any, Iterator


@contextlib.contextmanager
def replacing(path: str, suffix: str = "") -> Iterator[str]:
  """Yields a temporary path beside ``path`` for a writer that needs a file name (a figure, a
  CSV); once the block ends without an error, the file is put on disk and renamed over ``path``.
  An error leaves ``path`` as it was and removes the temporary file.

  ``suffix`` ends the temporary name, for writers that choose a format by it (``.png``).
  """
  directory = os.path.dirname(os.path.abspath(path))
  # The name's first bytes only: a name that fits the file system leaves room for the rest.
  start = os.fsencode(os.path.basename(path))[:64].decode(errors="ignore")
  fd, tmp = tempfile.mkstemp(prefix=f".{start}.", suffix=f".tmp{suffix}", dir=directory)
  os.close(fd)
  os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would make the file private to this user
  try:
    yield tmp
    _sync(tmp)
    os.replace(tmp, path)
  finally:
    if os.path.lexists(tmp):
      os.remove(tmp)
  _sync_directory(directory)


def write(path: str, data: bytes | str) -> None:
  """Replaces ``path`` by ``data`` (text is written as UTF-8), atomically."""
  if isinstance(data, str):
    data = data.encode()
  with replacing(path) as tmp:
    with open(tmp, "wb") as f:
      f.write(data)


def write_json(path: str, value: Any, **dump_kwargs) -> None:
  """Replaces ``path`` by ``value`` as JSON (``json.dumps``'s keywords), atomically. A value that
  cannot be serialised leaves ``path`` as it was."""
  write(path, json.dumps(value, **dump_kwargs))


def append(path: str, data: bytes | str, sync: bool = True) -> None:
  """Appends ``data`` (a whole line or lines) to ``path`` in one ``write``, then, with ``sync``,
  puts it on disk; a write cut short by a full disk is an ``OSError`` (ENOSPC) naming how much
  was written. A log written line by line without ``sync`` (metrics.jsonl) is put on disk by
  :func:`sync` at its checkpoints."""
  if isinstance(data, str):
    data = data.encode()
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    written = os.write(fd, data)
    if written != len(data):
      raise OSError(errno.ENOSPC, f"No space left on device: wrote {written} of {len(data)} "
                    "bytes", path)
    if sync:
      os.fsync(fd)
  finally:
    os.close(fd)


def unwritable(path: str, directory: bool = False, suffixes: tuple[str, ...] = ()) -> str | None:
  """Why ``path`` cannot be written as a file (with ``directory``: made a directory that files
  are written into), or None when it can. Checked before the work that would fill it, and
  creating nothing: the directories it needs exist or can be made (no file stands in their
  way, every new name fits the file system), the nearest one that exists takes a new file, and
  the path itself is not a directory (a file for ``directory``) nor a file that cannot be
  written. ``suffixes`` (lowercase, with the dot) are the endings a file may have.

  The path is walked as the system resolves it, not normalised: ``a-file/../out`` cannot be
  written however ``os.path.normpath`` reads it."""
  if not path:
    return "it is empty"
  if directory and os.path.lexists(path) and not os.path.isdir(path):
    return "it is a file, not a directory"
  if not directory:
    if os.path.basename(path) in ("", os.curdir, os.pardir):
      return "it is a directory; give the path of a file in it"
    suffix = os.path.splitext(path)[1].lower()
    if suffixes and suffix not in suffixes:
      return (f"its ending {suffix or '(none)'!r} is not one this writes; "
              f"give one of {', '.join(suffixes)}")
  return _unwritable_directory(path if directory else os.path.dirname(path) or os.curdir,
                               None if directory else os.path.basename(path))


def _unwritable_directory(directory: str, file_name: str | None) -> str | None:
  """Why ``directory`` cannot be made (if missing) and take ``file_name``, or None.

  The path is followed a name at a time as ``os.makedirs`` and the system would follow it: a
  name that exists must be a directory; below the first that does not, everything is made, and
  a ``..`` there leaves a directory that would be made, back towards those that exist."""
  current = os.sep if os.path.isabs(directory) else os.curdir
  made: list[str] = []  # the names that would be made below ``current``, in order
  new_names = []  # every name that would be made, those a ``..`` leaves again included
  for name in directory.split(os.sep):
    if name in ("", os.curdir):
      continue
    if made and name == os.pardir:
      made.pop()
      continue
    candidate = os.path.join(current, name)
    if made or not os.path.lexists(candidate):
      made.append(name)
      new_names.append(name)
    elif not os.path.isdir(candidate):
      return f"{candidate} is not a directory, so nothing can be made under it"
    else:
      current = candidate
  if file_name is not None and not made:  # the file's directory exists: what is there now
    existing = os.path.join(current, file_name)
    if os.path.isdir(existing):
      return "it is a directory; give the path of a file in it"
    if os.path.exists(existing) and not os.access(existing, os.W_OK):
      return "it is a file that cannot be written"
  try:
    longest = os.pathconf(current, "PC_NAME_MAX")
  except (OSError, ValueError):
    longest = 255
  for name in new_names + ([] if file_name is None else [file_name]):
    if len(os.fsencode(name)) > longest:
      return (f"the name {name[:40]!r}... is longer than the {longest} bytes the file system "
              "takes")
  try:
    fd, probe = tempfile.mkstemp(prefix=".pipejax-probe.", dir=current)
  except OSError as e:
    return f"{current} cannot be written ({e.strerror or e})"
  os.close(fd)
  os.remove(probe)
  return None


def sync(path: str) -> None:
  """Puts what was written to ``path`` on disk."""
  _sync(path)


def _umask() -> int:
  """This process's umask, read without setting it (``os.umask`` would change it for every thread
  for a moment)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except (OSError, ValueError, IndexError):
    pass
  return 0o022


def _sync(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _sync_directory(directory: str) -> None:
  """Puts a rename on disk; a file system that cannot sync a directory is left as it is."""
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)
