"""Where a sharded pipeline's state lives on a ``('data', 'stage')`` mesh, and how it gets there.

Shards differ in shapes (uneven stages, uneven shard sizes), while ``shard_map`` wants one array
shape on every device. So each shard's slice of the :class:`~pipejax.core.state.PipelineState` is
flattened into 1-D buffers padded to the largest shard's and stacked along a leading ``stage``
dimension sharded over the mesh (the plan is :class:`pipejax.parallel.packing.Packing`), in two
families:

* ``shared`` buffers, global shape ``(stage, n)``, replicated over ``data``: weights, optimizer
  states, PipeDream's stashed weights, stateful stages' variables (live and stashed), and the valid
  flags and sample indices of delay lines and packets (the same on every replica);
* ``local`` buffers, global shape ``(data, stage, n)``: everything that carries the micro-batch
  axis (stashed inputs, forward packets' activations and labels, backward cotangents); replica r
  holds samples ``r*b/data .. (r+1)*b/data - 1`` of every micro-batch.

Within a family, the ``'per_leaf'`` packing (default) gives every state leaf a buffer of its own:
the i-th largest leaf of each shard shares buffer i, so padding stays small and XLA can update each
leaf in place as it does on one device. The ``'flat'`` packing puts all leaves of one dtype in one
buffer at static offsets (least padding; XLA then copies the buffer every tick). In both, the two
registers that leave a shard (its last stage's ``forward_out`` packet and its first stage's
``backward_out`` cotangent) sit at the same place on every device, so every device cuts its outgoing
message the same way.

A cotangent held by a data replica is the gradient of the *replica's* mean loss, ``data`` times the
gradient of the whole micro-batch's mean loss that the single-device state holds;
:meth:`ShardedLayout.from_logical` and :meth:`ShardedLayout.to_logical` convert, so
``to_logical(run(from_logical(s)))`` compares directly with ``Pipeline.run(s)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from pipejax.core import checks
from pipejax.parallel import packing
from pipejax.core.checks import PipelineError
from pipejax.parallel.mesh import DATA, STAGE, MeshError, to_global, to_host, tree_to_host
from pipejax.parallel.packing import LOCAL, SHARED, BufferKey, PackedState
from pipejax.core.state import Batch, PipelineState

if TYPE_CHECKING:
  from pipejax.core.engine import Pipeline


class ShardedLayout:
  """A pipeline's packed state over a mesh: its buffers' shardings and global shapes, and the
  transfers between it, the host and the logical :class:`~pipejax.core.state.PipelineState`.

  Args:
    pipeline: the single-device pipeline whose state is laid out.
    mesh: a mesh with ``stage`` and ``data`` axes (:func:`pipejax.parallel.mesh.normalized_mesh`).
    partition: the ``(start, stop)`` shard of logical stages of each stage-axis device.
    policy: ``'per_leaf'``, ``'flat'`` or ``'auto'``
      (:meth:`pipejax.parallel.packing.Packing.plan`).
    shard_parts: each shard's parts (:func:`pipejax.core.parts.cut_parts`); default every
      stage a part of its own.

  Raises:
    MeshError: data replicas of a stateful stage, or of an activation whose micro-batch axis is
      not its first.
  """

  def __init__(self, pipeline: Pipeline, mesh: Mesh, partition, policy: str, shard_parts=None):
    self.mesh = mesh
    self.partition = partition
    self.num_shards = mesh.shape[STAGE]
    self.num_replicas = mesh.shape[DATA]
    abstract = pipeline.state_spec
    if self.num_replicas > 1:
      _check_replicable(pipeline, abstract, self.num_replicas)
    self.packing = packing.Packing.plan(abstract, partition, self.num_replicas, policy,
                                        shard_parts)
    self._line_treedefs = [jax.tree.structure(st.delay_line) for st in abstract.stages]
    self.replicated = NamedSharding(mesh, P())

  # ------------------------------------------------------------------ buffers

  def partition_spec(self, key: BufferKey) -> P:
    return P(STAGE) if key[0] == SHARED else P(DATA, STAGE)

  def global_shape(self, key: BufferKey) -> tuple[int, ...]:
    n = self.packing.buffer_sizes[key]
    return (self.num_shards, n) if key[0] == SHARED else (self.num_replicas, self.num_shards, n)

  def state_shardings(self) -> PackedState:
    """Where each part of a :class:`~pipejax.parallel.packing.PackedState` lives."""
    families = {SHARED: {}, LOCAL: {}}
    for key in self.packing.buffer_sizes:
      families[key[0]][packing.buffer_name(key)] = NamedSharding(self.mesh,
                                                                 self.partition_spec(key))
    return PackedState(families[SHARED], families[LOCAL], self.replicated, self.replicated)

  def buffers(self, packed: PackedState) -> dict[BufferKey, Any]:
    """The packed state's buffers by key (family, dtype, name)."""
    by_name = {(k[0], packing.buffer_name(k)): k for k in self.packing.buffer_sizes}
    out = {by_name[SHARED, name]: v for name, v in packed.shared.items()}
    out.update({by_name[LOCAL, name]: v for name, v in packed.local.items()})
    return out

  @staticmethod
  def packed_state(buffers: dict[BufferKey, Any], tick, rng) -> PackedState:
    """The :class:`~pipejax.parallel.packing.PackedState` of buffers by key: :meth:`buffers`
    undone."""
    return PackedState({packing.buffer_name(k): v for k, v in buffers.items() if k[0] == SHARED},
                       {packing.buffer_name(k): v for k, v in buffers.items() if k[0] == LOCAL},
                       tick, rng)

  # ------------------------------------------------------------------ transfers

  def place_batch(self, batch: Batch, ticks: bool = True) -> Batch:
    """A checked batch laid out over the mesh, each data replica given its part: a stream of
    ticks (a leading time axis), or one tick's with ``ticks=False``."""
    by_replica = NamedSharding(self.mesh, P(None, DATA) if ticks else P(DATA))
    return Batch(jax.tree.map(lambda a: to_global(np.asarray(a), by_replica), batch.inputs),
                 jax.tree.map(lambda a: to_global(np.asarray(a), by_replica), batch.labels),
                 to_global(np.asarray(batch.valid), self.replicated))

  def from_logical(self, state: PipelineState) -> PackedState:
    """Lays a logical state of the pipeline out over the mesh (every process passes the same)."""
    host = {k: np.zeros(self.global_shape(k), np.dtype(k[1])) for k in self.packing.buffer_sizes}
    for d, (a, z) in enumerate(self.partition):
      parts = packing.split_shard(jax.tree.map(np.asarray, state.stages[a:z]),
                                  self.packing.shard_parts[d])
      for part, placement in zip(parts, self._shard_placements(d)):
        for slot, leaf in zip(placement.slots, placement.treedef.flatten_up_to(part)):
          leaf = np.asarray(leaf)
          if leaf.dtype.name != slot.key[1]:
            raise PipelineError(f"State leaf of dtype {leaf.dtype.name} where the pipeline holds "
                                f"{slot.key[1]}; lay out states made by this pipeline's init.")
          span = slice(slot.offset, slot.offset + slot.size)
          if slot.role.batch_axis is None:
            host[slot.key][d, span] = leaf.reshape(-1)
            continue
          if slot.role.cotangent:
            leaf = leaf * np.asarray(self.num_replicas, leaf.dtype)
          pieces = np.split(leaf, self.num_replicas, axis=slot.role.batch_axis)
          for r, piece in enumerate(pieces):
            host[slot.key][r, d, span] = piece.reshape(-1)
    buffers = {k: to_global(v, NamedSharding(self.mesh, self.partition_spec(k)))
               for k, v in host.items()}
    return self.packed_state(buffers, to_global(np.asarray(state.tick), self.replicated),
                             to_global(np.asarray(state.rng), self.replicated))

  def to_logical(self, packed: PackedState) -> PipelineState:
    """The logical state; in a multi-process run every process must call it (it gathers)."""
    host = tree_to_host(self.buffers(packed))
    stages = []
    for d, (a, z) in enumerate(self.partition):
      parts = []
      for placement in self._shard_placements(d):
        leaves = []
        for slot in placement.slots:
          span = slice(slot.offset, slot.offset + slot.size)
          if slot.role.batch_axis is None:
            leaves.append(host[slot.key][d, span].reshape(slot.shape))
            continue
          leaf = np.concatenate([host[slot.key][r, d, span].reshape(slot.shape)
                                 for r in range(self.num_replicas)], axis=slot.role.batch_axis)
          if slot.role.cotangent:
            leaf = leaf / np.asarray(self.num_replicas, leaf.dtype)
          leaves.append(leaf)
        parts.append(placement.treedef.unflatten(leaves))
      (body, stack_lines), packet, cotangent = parts
      stages.extend(packing.join_lines(packing.join_registers(body, packet, cotangent),
                                       stack_lines, self.packing.shard_parts[d],
                                       self._line_treedefs[a:z]))
    state = PipelineState(tuple(stages), to_host(packed.tick), to_host(packed.rng))
    return jax.tree.map(jnp.asarray, state)

  # ------------------------------------------------------------------ reading the packed state

  def check_state(self, packed: PackedState) -> None:
    """Refuses a logical state, a state of another layout, or one a run consumed."""
    if isinstance(packed, PipelineState):
      raise PipelineError("This is a logical PipelineState; a ShardedPipeline runs the packed "
                          "state of its init(), or sharded.from_logical(state) of a logical one.")
    if not isinstance(packed, PackedState):
      raise PipelineError(f"Expected the PackedState of sharded.init() or sharded.from_logical(); "
                          f"got {type(packed).__name__}.")
    checks.check_not_donated(packed)
    names = {family: {packing.buffer_name(k) for k in self.packing.buffer_sizes if k[0] == family}
             for family in (SHARED, LOCAL)}
    fits = set(packed.shared) == names[SHARED] and set(packed.local) == names[LOCAL] and all(
        tuple(a.shape) == self.global_shape(k) for k, a in self.buffers(packed).items())
    if not fits:
      raise PipelineError(
          "The state does not belong to this sharded pipeline: its buffers differ from this "
          "mesh's and partition's (another pipeline, mesh or partition made it). Use this "
          "pipeline's init(), or to_logical() the state with the pipeline that made it and "
          "from_logical() it here.")

  def flags_all_set(self, packed: PackedState) -> bool:
    """Whether every boolean leaf of the packed state is True (only the flag buffers are read)."""
    flags = tree_to_host({k: v for k, v in self.buffers(packed).items() if k[1] == "bool"})
    for d in range(self.num_shards):
      for placement in self._shard_placements(d):
        for slot in placement.slots:
          if slot.key in flags:
            span = flags[slot.key][..., d, slot.offset:slot.offset + slot.size]
            if not span.all():
              return False
    return True

  def _shard_placements(self, d: int) -> tuple:
    """Shard d's body, outgoing packet and outgoing cotangent placements."""
    plan = self.packing
    return plan.body_placements[d], plan.packet_placements[d], plan.cotangent_placements[d]


def _check_replicable(pipeline: Pipeline, abstract: PipelineState, num_replicas: int) -> None:
  """Refuses a state that data replicas cannot split along the micro-batch."""
  b = pipeline.micro_batch_size
  stateful = [s for s, st in enumerate(abstract.stages) if st.variables is not None]
  if stateful:
    raise MeshError(
        f"{pipeline.model.stage_label(stateful[0])} keeps state (running statistics such "
        "as Online Normalization's) that depends on every sample it sees, in order. Data "
        f"replicas (data = {num_replicas}) each see only their part of every micro-batch, "
        "so their statistics would differ from each other and from one device's. Put every "
        "device on the stage axis (data = 1) for a stateful model, or use a stateless "
        "normalization ('layer' or 'group').")
  for s, st in enumerate(abstract.stages):
    for leaf, role in zip(jax.tree.leaves(st), jax.tree.leaves(packing.Packing.roles(st))):
      if role.batch_axis is not None and leaf.shape[role.batch_axis] != b:
        raise MeshError(
            f"Stage {s} keeps an activation of shape {leaf.shape} whose axis "
            f"{role.batch_axis} is not the micro-batch (b = {b}); data-parallel replicas "
            "split every activation along its leading micro-batch axis. Keep the micro-batch "
            "axis first in every stage's output, or use a mesh with data = 1.")
