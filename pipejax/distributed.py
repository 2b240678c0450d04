"""Many processes (hosts) as one JAX program: start-up and the global ``('data', 'stage')`` mesh.

Every process runs the same training program. :func:`initialize` connects the processes (it must
come before any other JAX call); afterwards ``jax.devices()`` lists the devices of all processes,
:func:`make_mesh` lays them out as ``('data', 'stage')``, and
:class:`pipejax.sharding.ShardedPipeline` runs one pipeline over them. See docs/distributed.md.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from pipejax import sharding
from pipejax.sharding import MeshError

__all__ = ["MeshError", "any_process", "initialize", "make_mesh", "shutdown"]


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: Sequence[int] | None = None,
               num_cpu_devices: int | None = None, cpu_collectives: str = "gloo",
               initialization_timeout: int = 300) -> None:
  """Connects this process to the others; call it first, before any other JAX call.

  On a Cloud TPU pod slice or under SLURM/Open MPI, leave the first three arguments None: JAX
  detects them from the environment. Elsewhere (several GPU hosts, CPU processes) give all three;
  process 0 serves as coordinator at ``coordinator_address`` (``host:port``, reachable from every
  process). With ``num_processes == 1`` this does nothing, so one program serves both cases.

  Args:
    coordinator_address: ``host:port`` of process 0.
    num_processes: total number of processes.
    process_id: this process's index in ``[0, num_processes)``.
    local_device_ids: the local devices this process drives (e.g. one GPU per process).
    num_cpu_devices: on CPU, how many devices this process exposes (testing without accelerators).
    cpu_collectives: the cross-process collectives CPU devices use: ``'gloo'`` (TCP, ships with
      jaxlib) or ``'mpi'``. Without one, CPU computations that span processes cannot run.
    initialization_timeout: seconds to wait for every process to connect.

  Raises:
    RuntimeError: JAX was already used in this process (its backends are fixed by then).
  """
  if num_processes == 1:
    return
  if num_cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", num_cpu_devices)
  # Read by the CPU client when it is created, i.e. after initialize: set it first.
  jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  try:
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids,
                               initialization_timeout=initialization_timeout)
  except RuntimeError as e:
    if "before" in str(e) or "already" in str(e):
      raise RuntimeError(
          f"pipejax.distributed.initialize must run before any other JAX call in the process "
          f"(JAX said: {e}). Call it at the very start of main(), before building models or "
          "data.") from e
    raise


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


def make_mesh(stage: int, data: int = 1) -> jax.sharding.Mesh:
  """A ``('data', 'stage')`` mesh over all devices of all processes.

  Raises:
    MeshError: ``stage * data`` is not the global device count (the message gives the count).
  """
  return sharding.make_mesh(stage, data)
