"""Stopping a run on a signal: set-up phases said in the log, and a stop flag read between chunks.

A signal before the first chunk has trained ends the run at once (nothing to save); after it, the
training loop saves a checkpoint at the end of its chunk and returns. With several processes, all
of them agree on every stop, so that none is left to fail in a collective the others skipped.
"""

from __future__ import annotations

import signal
import threading
import time

from absl import logging
import jax

from pipejax import cli

# Seconds between the set-up's "still ..." lines: a deep model builds and compiles for minutes.
SETUP_REPORT_EVERY = 30.0


class StoppedDuringSetup(Exception):
  """A signal asked a run of several processes to stop before its first chunk; all of them stop."""

  def __init__(self, signal_name: str, phase: str):
    super().__init__(f"STOPPED by {signal_name} during set-up ({phase}), before this session "
                     "trained or saved anything; rerun the same commands to continue.")


def agree_to_stop(requested: bool) -> bool:
  """Whether any process was asked to stop; all processes then stop at the same chunk."""
  if jax.process_count() == 1:
    return requested
  from pipejax.parallel import distributed  # pylint: disable=g-import-not-at-top
  return distributed.any_process(requested)


class StopRequest:
  """Turns SIGTERM/SIGINT/SIGHUP into a flag the loop checks between chunks (then saves and exits).

  In a binary that started a :class:`pipejax.cli.SignalWatch`, the watch takes the signals: it
  ends the process at once until the first chunk has trained (there is nothing to save), and
  from then on only raises the flag. Without one (library use), signal handlers raise it.
  """

  def __init__(self):
    self._watch = cli.signal_watch()
    self._signal_name = None
    self._previous = {}

  @property
  def signal_name(self) -> str | None:
    """The name of the signal that asked this process to stop, or None."""
    return self._watch.signal_name if self._watch else self._signal_name

  def training_started(self) -> None:
    """A chunk has trained: from now on a signal only raises the flag."""
    if self._watch:
      self._watch.hold()

  def __enter__(self):
    if self._watch:
      return self
    for sig in cli.honoured():
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. inside some test runners): no handler.
        pass
    return self

  def _handle(self, signum, frame):
    del frame
    self._signal_name = signal.Signals(signum).name

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


class SetupPhases:
  """Says in the log what the set-up is doing (again every :data:`SETUP_REPORT_EVERY` seconds
  while a phase lasts), and tells the signal watch.

  With several processes, an immediate exit of one would leave the others to fail in their next
  collective, so the watch holds signals from the start and the processes agree at every phase
  whether one of them was asked to stop (:class:`StoppedDuringSetup` on all of them).
  """

  def __init__(self):
    self._watch = cli.signal_watch()
    self._start = time.perf_counter()
    self._several = jax.process_count() > 1
    self._phase = None
    self._done = threading.Event()
    if self._watch and self._several:
      self._watch.hold()

  def __enter__(self):
    threading.Thread(target=self._report, name="pipejax-setup-progress", daemon=True).start()
    return self

  def __exit__(self, *exc):
    self.done()

  def _report(self):
    while not self._done.wait(SETUP_REPORT_EVERY):
      if self._phase:
        logging.info("Set-up (%.0f s): still %s.", time.perf_counter() - self._start, self._phase)

  def enter(self, phase: str) -> None:
    """Starts ``phase`` (logged); raises :class:`StoppedDuringSetup` if a process was signalled.

    Raises:
      StoppedDuringSetup: in a run of several processes, one of them was asked to stop.
    """
    self._phase = phase
    logging.info("Set-up (%.0f s): %s.", time.perf_counter() - self._start, phase)
    if self._watch is None:
      return
    self._watch.set_phase(phase)
    if self._several and agree_to_stop(self._watch.signal_name is not None):
      raise StoppedDuringSetup(self._watch.signal_name or "a signal to another process", phase)

  def done(self) -> None:
    """The first chunk has trained: the set-up is over."""
    self._done.set()
