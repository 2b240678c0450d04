"""Many processes (hosts) as one JAX program: start-up, agreement, stopping together, failure.

Every process runs the same training program. :func:`initialize` connects the processes (it must
come before any other JAX call); afterwards ``jax.devices()`` lists the devices of all processes,
:func:`pipejax.parallel.mesh.make_mesh` lays them out as ``('data', 'stage')``, and
:class:`pipejax.parallel.sharding.ShardedPipeline` runs one pipeline over them. :func:`agree` and
its kin check that every process starts the same run; :func:`any_process` makes them stop
together and :func:`lost_process_message` says what happened when one of them died. What each
process feeds and saves (:class:`HostFeed`, :func:`trainer_parts`, :func:`checkpoint_shardings`)
is ``pipejax.parallel.host_feed``'s, importable from here too. See docs/distributed.md.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import socket
import sys
import threading
import time
from typing import Any, Sequence

from absl import logging
import jax
import numpy as np

from pipejax.parallel.host_feed import HostFeed, checkpoint_shardings, trainer_parts

__all__ = ["HostFeed", "StartupError", "agree", "agree_on_data", "agree_on_shared_workdir",
           "any_process", "checkpoint_shardings", "code_version", "exchange", "initialize",
           "lost_process_message", "shutdown", "trainer_parts"]

# Seconds without a heartbeat after which a process counts as dead (JAX's default is 100).
HEARTBEAT_TIMEOUT = 30


# Seconds every process waits at start-up for the others (to connect, then to compare their
# fingerprints) before it gives up with a message; scripts/train.py's --startup_timeout.
STARTUP_TIMEOUT = 300
# Seconds between the lines that say what a waiting process waits for.
WAIT_REPORT_EVERY = 10


class StartupError(RuntimeError):
  """The processes of a run could not start together; the message says why and what to do."""


class SharedRefusal(StartupError):
  """A refusal that every process reached from the same exchanged values, so all of them can
  leave together (:func:`leave_together`)."""


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: Sequence[int] | None = None,
               num_cpu_devices: int | None = None, cpu_collectives: str = "gloo",
               initialization_timeout: int = STARTUP_TIMEOUT,
               heartbeat_timeout: int = HEARTBEAT_TIMEOUT) -> None:
  """Connects this process to the others; call it first, before any other JAX call.

  On a Cloud TPU pod slice or under SLURM/Open MPI, leave the first three arguments None: JAX
  detects them from the environment. Elsewhere (several GPU hosts, CPU processes) give all three;
  process 0 serves as coordinator at ``coordinator_address`` (``host:port``, reachable from every
  process). With ``num_processes == 1`` this does nothing, so one program serves both cases.

  While it waits for the others it logs, every :data:`WAIT_REPORT_EVERY` seconds, what it waits
  for; after ``initialization_timeout`` seconds it prints why it gives up and ends the process
  with exit code 1 (JAX itself would abort it with a C++ stack trace).

  Args:
    coordinator_address: ``host:port`` of process 0.
    num_processes: total number of processes.
    process_id: this process's index in ``[0, num_processes)``.
    local_device_ids: the local devices this process drives (e.g. one GPU per process).
    num_cpu_devices: on CPU, how many devices this process exposes (testing without accelerators).
    cpu_collectives: the cross-process collectives CPU devices use: ``'gloo'`` (TCP, ships with
      jaxlib) or ``'mpi'``. Without one, CPU computations that span processes cannot run.
    initialization_timeout: seconds to wait for every process to connect.
    heartbeat_timeout: seconds after which a process that stopped sending heartbeats (killed,
      crashed, its host gone) counts as dead. The coordination service then ends every other
      process with "Terminating process because the JAX distributed service detected fatal
      errors ... The following tasks are unhealthy (stopped sending heartbeats)", instead of
      leaving them blocked in a collective that can never complete. Shorter detects a death
      sooner; it must stay well above the longest pause of a live process (a GC, a slow disk).

  Raises:
    RuntimeError: JAX was already used in this process (its backends are fixed by then).
    StartupError: process 0 cannot serve at the coordinator's port (it is in use).
  """
  if num_processes == 1:
    return
  if num_cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", num_cpu_devices)
  # Read by the CPU client when it is created, i.e. after initialize: set it first.
  jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  if process_id == 0 and coordinator_address:
    _check_port_free(coordinator_address)
  who = (f"process {process_id} of {num_processes}" if process_id is not None
         else "this process")
  waiting = _Waiting(
      who, "for all processes to connect to the coordinator at "
      f"{coordinator_address or '(detected from the environment)'}",
      initialization_timeout,
      advice=("Start every process with the same --coordinator_address and --num_processes "
              "(and its own --process_id); check that process 0 runs and that its port is "
              "reachable from this host."))
  try:
    with waiting:
      # JAX's own deadline comes later: at ours, the waiting thread says why and exits.
      jax.distributed.initialize(coordinator_address=coordinator_address,
                                 num_processes=num_processes, process_id=process_id,
                                 local_device_ids=local_device_ids,
                                 initialization_timeout=initialization_timeout + 30,
                                 heartbeat_timeout_seconds=heartbeat_timeout)
  except RuntimeError as e:
    if "before" in str(e) or "already" in str(e):
      raise RuntimeError(
          "pipejax.parallel.distributed.initialize must run before any other JAX call in the "
          f"process (JAX said: {e}). Call it at the very start of main(), before building models "
          "or data.") from e
    if "Failed to start RPC server" in str(e):
      raise StartupError(_port_in_use_message(coordinator_address)) from None
    raise


def _port_in_use_message(address: str) -> str:
  return (f"Process 0 cannot serve as coordinator at {address}: port "
          f"{address.rpartition(':')[2]} is in use on this host (another run, or a process of an "
          "earlier one that is still alive). Choose a free port for --coordinator_address on "
          "every process, or end the process that holds it.")


def _check_port_free(address: str) -> None:
  """A :class:`StartupError` naming the port if another program listens on it."""
  port = address.rpartition(":")[2]
  if not port.isdigit():
    raise StartupError(f"--coordinator_address must be host:port; got {address!r}.")
  with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as probe:
    # A port left in TIME_WAIT by an earlier run is free for the coordinator, which reuses it.
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      probe.bind(("", int(port)))
    except OSError as e:
      if e.errno == errno.EADDRINUSE:
        raise StartupError(_port_in_use_message(address)) from None


class _Waiting:
  """While its block runs: a line every :data:`WAIT_REPORT_EVERY` seconds saying what it waits
  for and, at ``timeout`` seconds, a message and exit code 1 (the block cannot be interrupted)."""

  def __init__(self, who: str, what: str, timeout: float, advice: str):
    self.who, self.what, self.timeout, self.advice = who, what, timeout, advice
    self._done = threading.Event()

  def __enter__(self):
    threading.Thread(target=self._report, name="pipejax-startup-wait", daemon=True).start()
    return self

  def _report(self):
    start = time.monotonic()
    while not self._done.wait(min(WAIT_REPORT_EVERY,
                                  max(self.timeout - (time.monotonic() - start), 0))):
      waited = time.monotonic() - start
      if waited >= self.timeout:
        print(f"error: Start-up failed: {self.who} waited {self.timeout:.0f} s "
              f"(--startup_timeout) {self.what}, in vain. {self.advice}", file=sys.stderr,
              flush=True)
        os._exit(1)  # pylint: disable=protected-access
      logging.warning("Start-up: %s waits %s (%.0f s of the %.0f s start-up timeout, "
                      "--startup_timeout).", self.who, self.what, waited, self.timeout)

  def __exit__(self, *exc):
    self._done.set()


def code_version() -> str:
  """A digest of pipejax's source files and JAX's version: equal iff the same code runs."""
  digest = hashlib.sha256(jax.__version__.encode())
  package = pathlib.Path(__file__).resolve().parent.parent
  for path in sorted(package.rglob("*.py")):
    digest.update(str(path.relative_to(package)).encode())
    digest.update(path.read_bytes())
  return f"pipejax source {digest.hexdigest()[:16]}, jax {jax.__version__}"


def _client():
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  return jax_distributed.global_state.client


def exchange(name: str, value: str, timeout: float = STARTUP_TIMEOUT) -> list[str]:
  """Every process's ``value`` of ``name``, by index, over JAX's coordination service.

  Each process publishes its value and reads the others', logging what it waits for every
  :data:`WAIT_REPORT_EVERY` seconds; a process missing after ``timeout`` seconds is a
  :class:`StartupError`. On one process: ``[value]``.
  """
  if jax.process_count() == 1:
    return [value]
  client = _client()
  client.key_value_set(f"pipejax/{name}/{jax.process_index()}", value)
  values, start = [], time.monotonic()
  for process in range(jax.process_count()):
    while True:
      left = timeout - (time.monotonic() - start)
      try:
        values.append(client.blocking_key_value_get(
            f"pipejax/{name}/{process}", int(1000 * max(min(WAIT_REPORT_EVERY, left), 0.001))))
        break
      except jax.errors.JaxRuntimeError as e:
        if "DEADLINE_EXCEEDED" not in str(e) and "deadline" not in str(e).lower():
          raise
      if time.monotonic() - start >= timeout:
        raise StartupError(
            f"Process {jax.process_index()} waited {timeout:.0f} s (--startup_timeout) for "
            f"process {process} to publish its {name}, in vain: that process stopped during its "
            "set-up (its log says why) or hangs. End all processes and start them again.")
      logging.warning("Start-up: process %d waits for process %d's %s (%.0f s of the %.0f s "
                      "start-up timeout, --startup_timeout).", jax.process_index(), process,
                      name, time.monotonic() - start, timeout)
  return values


def agree(fingerprint: dict[str, Any], timeout: float = STARTUP_TIMEOUT) -> None:
  """Refuses, on every process, to go on unless all processes have the same ``fingerprint``.

  ``fingerprint`` maps field names (config keys, ``code``, ``workdir``) to JSON-able values. All
  processes exchange theirs (:func:`exchange`) and compare all of them, so they reach the same
  verdict and stop together, before any of them creates or trains anything.

  Raises:
    StartupError: the processes differ; the message names every differing field and its value
      on each process.
  """
  everyone = [json.loads(v) for v in exchange("fingerprint", json.dumps(fingerprint, default=str,
                                                                        sort_keys=True), timeout)]
  keys = sorted(set().union(*everyone))
  differing = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in everyone}) > 1]
  if differing:
    details = "; ".join(
        f"{k}: " + ", ".join(f"{f.get(k)!r} on process {p}" for p, f in enumerate(everyone))
        for k in differing)
    raise SharedRefusal(
        f"The {len(everyone)} processes of this run differ in {', '.join(differing)} ({details}). "
        "Every process must run the same code with the same config and --workdir (one directory "
        "shared by all hosts); only --process_id differs. Start them again with the same "
        "command.")


def agree_on_data(fingerprint: dict, timeout: float = STARTUP_TIMEOUT) -> None:
  """Refuses, on every process, data that differs between the processes.

  Each process reads its own copy of the data set (``data_dir`` may differ between hosts); a copy
  that differs would feed its devices other examples than the run's stream, and evaluate on
  another test split, without any error. ``fingerprint`` is this process's
  :func:`pipejax.data.fingerprint.fingerprint`.

  Raises:
    DataError: the copies differ; the message names each process's differences from process 0's.
  """
  from pipejax.data import DataError  # pylint: disable=g-import-not-at-top
  from pipejax.data import fingerprint as fingerprint_lib  # pylint: disable=g-import-not-at-top
  everyone = [json.loads(v) for v in exchange("data", json.dumps(fingerprint, sort_keys=True),
                                              timeout)]
  differing = {p: fingerprint_lib.differences(everyone[0], theirs)
               for p, theirs in enumerate(everyone)}
  differing = {p: changes for p, changes in differing.items() if changes}
  if differing:
    message = (
        f"The {len(everyone)} processes of this run read different data (each reads its own copy, "
        "from its --config.data_dir): " + "; ".join(
            f"process {p}, against process 0: {'; '.join(changes)}"
            for p, changes in differing.items())
        + ". Give every process the same copy of the data set, then start them all again.")
    # Every process reached this verdict from the same values: they leave together, so that
    # process 0, which hosts the coordination service, does not go while another still reads.
    leave_together(timeout)
    raise DataError(message)


def agree_on_shared_workdir(workdir: str, timeout: float = STARTUP_TIMEOUT) -> None:
  """Refuses, on every process, a workdir that is not one directory shared by all of them.

  Process 0 writes a token into ``workdir`` (creating it) and every process reads it back: a
  host whose path leads elsewhere (a shared mount missing on it) sees no token or another one.
  """
  path = os.path.join(workdir, ".processes-share-this")
  token = f"{os.getpid()}-{time.time_ns()}"
  problem = ""
  if jax.process_index() == 0:
    try:
      os.makedirs(workdir, exist_ok=True)
      with open(path, "w") as f:
        f.write(token)
    except OSError as e:
      problem = f"cannot write {path}: {e}"
  tokens = exchange("workdir_token", token if jax.process_index() == 0 else "", timeout)
  if not problem and jax.process_index() != 0:
    try:
      with open(path) as f:
        seen = f.read()
      if seen != tokens[0]:
        problem = f"{path} holds another run's token"
    except OSError as e:
      problem = f"cannot read {os.path.abspath(path)} ({e.strerror})"
  verdicts = exchange("workdir_verdict", problem, timeout)
  bad = {p: v for p, v in enumerate(verdicts) if v}
  if bad:
    raise SharedRefusal(
        f"The workdir {os.path.abspath(workdir)} is not one directory shared by all "
        f"{len(verdicts)} processes: " + "; ".join(f"process {p} {v}" for p, v in bad.items())
        + ". Mount the same shared directory at this path on every host (or give every process "
        "the same local path on one machine), then start all processes again.")


def leave_together(timeout: float = STARTUP_TIMEOUT) -> None:
  """Disconnects through JAX's shutdown barrier, after a :class:`SharedRefusal` on every process.

  Process 0 hosts the coordination service: were it to exit first, a process still printing its
  refusal would lose the service and JAX would abort it. The barrier lets the service go last.
  After ``timeout`` seconds the process exits anyway (code 1), without the barrier.
  """
  with _Waiting(f"process {jax.process_index()}", "for the others to leave after the refusal",
                timeout, advice="The refusal above is the reason."):
    jax.distributed.shutdown()


def lost_process_message(error: BaseException) -> str:
  """The one-paragraph message for a computation across processes that failed.

  On CPU (gloo) and on most networks a process that dies closes its connections, and the next
  collective of the others fails at once with an error such as "Connection closed by peer"; the
  trainer then prints this instead of a traceback. (A peer that vanishes without closing them is
  caught by the heartbeat instead: see :func:`initialize`.)
  """
  first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
  return (f"A computation across the {jax.process_count()} processes of this run failed in "
          f"process {jax.process_index()} ({first}). This almost always means that another "
          "process of the run died (killed, out of memory, its host lost): its own log says why. "
          "Checkpoints written before are intact; start all processes again with the same "
          "commands to resume from the last one.")


def shutdown() -> None:
  """Disconnects from the other processes (optional: JAX does it at exit)."""
  jax.distributed.shutdown()


def any_process(flag: bool) -> bool:
  """True on every process if ``flag`` is True on any of them (a collective: all must call it).

  The trainer calls it between chunks with "a signal asked me to stop", so a SIGTERM delivered to
  one host stops all of them at the same chunk: each saves its part of the checkpoint and exits,
  instead of the others blocking in the next collective of a process that left. On one process
  it returns ``flag`` without communicating.
  """
  if jax.process_count() == 1:
    return bool(flag)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  flags = multihost_utils.process_allgather(np.asarray(flag, np.int32))
  return bool(np.any(flags))
