"""What each process of a multi-process run feeds its devices and how it places a checkpoint.

A micro-batch enters the pipeline only at the first stage of each data replica, so
:class:`HostFeed` loads only the rows this process's devices consume; :func:`checkpoint_shardings`
places the logical state so that all processes save and restore it together
(``pipejax.train.checkpoint``). The processes' start-up is ``pipejax.parallel.distributed``'s; see
docs/distributed.md.
"""

from __future__ import annotations

import functools
from typing import Any

from absl import logging
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from pipejax.core.state import PipelineState
from pipejax.parallel.mesh import DATA, STAGE, MeshError


def _stage_axis_devices(mesh: Mesh, index: int) -> np.ndarray:
  """The devices at position ``index`` of the stage axis, one per data replica."""
  return np.take(np.asarray(mesh.devices), index, axis=mesh.axis_names.index(STAGE))


class HostFeed:
  """Feeds this process's devices with its share of every chunk of a shared data stream.

  A micro-batch enters the pipeline only at the device on stage-axis position 0 of each data
  replica (the devices further along receive activations, and the labels travel with them).
  Replica ``r`` takes rows ``[r * b / data, (r + 1) * b / data)`` of every micro-batch of ``b``.
  This process therefore reads exactly the rows of the replicas whose first stage it holds, and
  nothing on a process that holds no first stage (a stage-only mesh across hosts reads on the
  process of stage 0 alone). The other devices receive zeros, which they never read.

  Args:
    sharded: the :class:`~pipejax.parallel.sharding.ShardedPipeline` to feed.
  """

  def __init__(self, sharded):
    self.sharded = sharded
    self.mesh = sharded.mesh
    b, data = sharded.pipeline.micro_batch_size, sharded.num_replicas
    per_replica = b // data
    first_stage = _stage_axis_devices(self.mesh, 0)
    me = jax.process_index()
    self.replicas = [r for r, device in enumerate(first_stage) if device.process_index == me]
    # Rows of each replica this process reads, in the order of next_chunk's columns.
    self.rows = [s for r in self.replicas for s in range(r * per_replica, (r + 1) * per_replica)]
    self._replica_of = {device: r for r, device in enumerate(first_stage)}
    self._per_replica = per_replica

  def next_chunk(self, stream, num_ticks: int):
    """``(inputs, labels, valid)`` of the next ``num_ticks`` micro-batches, laid out on the mesh.

    Every process must call it with its own copy of the same stream (same seed and position); each
    reads only :attr:`rows`, but all advance by whole micro-batches. The method's schedule
    (``Runner.to_ticks``) is applied, so the arrays are ready for ``ShardedPipeline.run``.
    """
    pipe = self.sharded.pipeline
    if self.rows:
      x, y = stream.next_chunk(num_ticks, self.rows)
    else:  # this process holds no first stage: skip the chunk without loading it
      stream.skip(num_ticks)
      x = np.zeros((num_ticks, 0) + tuple(stream.source.example_shape), np.float32)
      y = np.zeros((num_ticks, 0) + tuple(stream.source.label_shape), np.int32)
    x, y, valid = pipe.to_ticks(x, y)
    pipe.spec.check_labels(y, valid)
    return (self._global(x), self._global(y),
            jax.make_array_from_callback(valid.shape, NamedSharding(self.mesh, P()),
                                         lambda index: valid[index]))

  def _global(self, local: np.ndarray) -> jax.Array:
    """The ``(ticks, b, ...)`` global array of which this process holds the columns :attr:`rows`."""
    ticks, b = local.shape[0], self.sharded.pipeline.micro_batch_size
    shape = (ticks, b) + local.shape[2:]
    by_replica = NamedSharding(self.mesh, P(None, DATA))
    blocks = []
    for device in by_replica.addressable_devices:
      r = self._replica_of.get(device)
      if r is None:  # not a first stage: its copy of the micro-batch is never read
        block = np.zeros((ticks, self._per_replica) + local.shape[2:], local.dtype)
      else:
        start = self.replicas.index(r) * self._per_replica
        block = local[:, start:start + self._per_replica]
      blocks.append(jax.device_put(block, device))
    return jax.make_array_from_single_device_arrays(shape, by_replica, blocks)


# ----------------------------------------------------------------------------- the trainer's parts


def trainer_parts(sharded) -> tuple[HostFeed, Any]:
  """The trainer's per-process data feed and checkpoint placement for ``sharded``.

  Raises:
    MeshError: ``sharded`` is None, i.e. the config has no mesh over the processes' devices.
  """
  if sharded is None:
    raise MeshError(
        f"This run has {jax.process_count()} processes but its config trains on one device "
        "(mesh.stage = mesh.data = 1), so every process would train a copy of its own. Set "
        f"--config.mesh.stage and --config.mesh.data so that stage * data = {jax.device_count()}, "
        "the devices of all processes together.")
  feed = HostFeed(sharded)
  logging.info("Process %d of %d loads rows %s of every micro-batch of %d (the first stage of "
               "data replica(s) %s is on its devices).", jax.process_index(), jax.process_count(),
               feed.rows, sharded.pipeline.micro_batch_size, feed.replicas)
  return feed, functools.partial(checkpoint_shardings, sharded)


def checkpoint_shardings(sharded, state: PipelineState) -> PipelineState:
  """Where each leaf of a logical state lives when the processes save or restore it together.

  Every leaf is replicated over the whole mesh. orbax refuses to save an array that lives on one
  process's devices only (it cannot tell such an array from an unrelated per-process value), and
  it splits the writing of a replicated array between its replicas (each writes a slice along an
  axis the replica count divides; an array no axis of which divides is written by one process).
  So every process writes its share of the arrays and holds the whole logical state, which it
  needs anyway to lay the state out on a mesh of any shape.
  """
  everywhere = NamedSharding(sharded.mesh, P())
  return jax.tree.map(lambda _: everywhere, state)
