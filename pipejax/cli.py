"""What the absl binaries of ``scripts/`` share: how a usage error, an output that cannot be
written and a stop signal reach the user."""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading
from typing import Callable, NoReturn

from absl import app, flags

from pipejax import files

EXIT_USAGE = 2  # a bad command line, as the shell's own builtins and scripts/train.py use it
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal, not finished; rerunning resumes

# Set by scripts/study.py for its trainers: how many of them it runs at once. Each trainer's
# memory check then counts on that share of the memory, so that together they fit.
TRAINERS_AT_ONCE = "PIPEJAX_TRAINERS_AT_ONCE"


def trainers_at_once() -> int:
  """How many trainers a study runs beside this one, this one included (1 outside a study)."""
  try:
    return max(1, int(os.environ.get(TRAINERS_AT_ONCE, "1")))
  except ValueError:
    return 1


# SIGHUP is a closed terminal or SSH session: a stop like the others, never a half-written save.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def honoured(signals=STOP_SIGNALS) -> tuple[signal.Signals, ...]:
  """``signals`` less those the process was started ignoring: ``nohup`` ignores SIGHUP so that
  the run outlives its terminal, and a watch that blocks it would still receive it (Linux keeps
  a blocked signal pending even when ignored)."""
  return tuple(s for s in signals if signal.getsignal(s) is not signal.SIG_IGN)


def run(main: Callable[[list[str]], None], flags_parser=None, **kwargs) -> None:
  """``absl.app.run(main)``, with every usage error said in one line and exit 2.

  absl prints the binary's whole help (its docstring and every flag: a hundred lines for
  scripts/schedule.py) above an ``app.UsageError``'s message, which then scrolls out of sight,
  and ends a flag it cannot parse (``--paralel=2``, ``--parallel=two``, a required flag left
  out) with exit 1, the code of a run that failed. Here either is the message alone, with the
  way to the help, and :data:`EXIT_USAGE`; the help itself, asked for, ends with exit 0.
  """
  parse = flags_parser or flags.FLAGS

  def parse_with_usage_errors(argv):
    try:
      return parse(argv)
    except flags.Error as e:
      usage_error(str(e))
    except SystemExit as e:
      # absl's --help, --helpshort and --helpfull print the help and exit 1, a failure's code.
      if e.code == 1 and asks_for_help(argv):
        sys.exit(0)
      raise

  def main_with_usage_errors(argv):
    try:
      return main(argv)
    except app.UsageError as e:
      usage_error(str(e))

  app.run(main_with_usage_errors, flags_parser=parse_with_usage_errors, **kwargs)


HELP_FLAGS = ("help", "helpshort", "helpfull", "?")


def asks_for_help(argv: list[str]) -> bool:
  """Whether ``argv`` gives one of absl's help flags (before a ``--`` that ends the flags)."""
  for arg in argv[1:]:
    if arg == "--":
      return False
    if arg.startswith("-") and arg.lstrip("-").split("=", 1)[0] in HELP_FLAGS:
      return True
  return False


def usage_error(message: str) -> NoReturn:
  """Ends the binary with ``message`` and :data:`EXIT_USAGE`."""
  print(f"error: {message.rstrip()} (--help lists the flags.)", file=sys.stderr)
  sys.exit(EXIT_USAGE)


def check_output(flag: str, path: str, directory: bool = False,
                 suffixes: tuple[str, ...] = (), make: bool = True) -> None:
  """Raises an ``app.UsageError`` (exit 2 under :func:`run`) when ``--flag=path`` cannot be
  written (``pipejax.files.unwritable``: a directory with ``directory``, else a file ending in
  one of ``suffixes``), and otherwise makes the directories it needs (not with ``make=False``,
  for a binary that may yet refuse its inputs and should leave nothing behind). A binary calls
  it at start-up, for every output, so that a typo costs no work."""
  problem = files.unwritable(path, directory=directory, suffixes=suffixes)
  if problem is None and make:
    try:
      os.makedirs(path if directory else os.path.dirname(path) or os.curdir, exist_ok=True)
    except OSError as e:
      problem = f"its directory cannot be made ({e.strerror or e})"
  if problem is not None:
    raise app.UsageError(
        f"--{flag}={path} cannot be written: {problem}. Nothing was run; give a "
        f"{'directory' if directory else 'file'} path that can be written.")


class SignalWatch:
  """SIGTERM, SIGINT and SIGHUP taken by a thread of their own, in every phase of a run (SIGHUP
  not where the process was started ignoring it, as ``nohup`` starts it).

  A Python signal handler runs only when the main thread returns to the interpreter, so during a
  long XLA compile or a blocking ``jax.distributed`` call a signal waits (or, as a
  ``KeyboardInterrupt`` unwinding native code, crashes the process), and the coordination
  service's own SIGTERM handler swallows it. Here the signals are blocked in every thread before
  any library starts one (the mask is inherited), and one thread takes them with ``sigwait`` as
  they arrive, whatever the main thread is doing.

  Until :meth:`hold` is called, nothing of the run needs saving: the watch prints why it
  stops and ends the process with :data:`EXIT_STOPPED` at once. Inside it, a signal only sets
  :attr:`signal_name`, which the training loop checks between chunks (it then saves a checkpoint
  and exits with the same code).
  """

  def __init__(self):
    self.signal_name: str | None = None
    self.phase = "start-up"
    self._signals = STOP_SIGNALS
    self._deferred = False
    self._lock = threading.Lock()

  def start(self) -> "SignalWatch":
    self._signals = honoured()
    signal.pthread_sigmask(signal.SIG_BLOCK, self._signals)
    threading.Thread(target=self._watch, name="pipejax-signal-watch", daemon=True).start()
    return self

  def _watch(self):
    while True:
      signum = signal.sigwait(self._signals)
      if signum == signal.SIGHUP:
        detach_from_terminal()
      with self._lock:
        self.signal_name = signal.Signals(signum).name
        if self._deferred:
          continue
        # Under the lock: the main thread cannot start holding signals meanwhile.
        sys.stdout.flush()
        print(f"STOPPED by {self.signal_name} during {self.phase}, before this session trained "
              "or saved anything; rerun the same command to continue.", file=sys.stderr,
              flush=True)
        os._exit(EXIT_STOPPED)  # pylint: disable=protected-access

  def set_phase(self, phase: str) -> None:
    """Names what the run is doing, for the message of a stop."""
    self.phase = phase

  def hold(self) -> None:
    """From now on a signal is a request the run honours between chunks, not an exit."""
    with self._lock:
      self._deferred = True


def detach_from_terminal() -> None:
  """Points stdout and stderr at /dev/null where they are a terminal: after a SIGHUP the terminal
  is closed, and a write to it fails (EIO), which would turn a clean stop into a traceback and
  exit 1. Output to a file or pipe (a log, a study's) is kept."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  null = os.open(os.devnull, os.O_WRONLY)
  try:
    for fd in (1, 2):
      try:
        if stat.S_ISCHR(os.fstat(fd).st_mode):
          os.dup2(null, fd)
      except OSError:
        pass
  finally:
    os.close(null)


_WATCH: list[SignalWatch] = []


def watch_signals() -> SignalWatch:
  """Starts the process's :class:`SignalWatch` (once; call it before importing JAX)."""
  if not _WATCH:
    _WATCH.append(SignalWatch().start())
  return _WATCH[0]


def signal_watch() -> SignalWatch | None:
  """The process's :class:`SignalWatch` if a binary started one, else None (library use)."""
  return _WATCH[0] if _WATCH else None
