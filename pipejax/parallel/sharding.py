"""Pipelined Backpropagation over many devices: ``shard_map`` over a ``('data', 'stage')`` mesh.

Each device on the ``stage`` axis owns a contiguous shard of logical stages and advances it with
the one tick over parts, :func:`pipejax.core.parts.advance_parts`: there is no second engine, and
delays, delay lines and optimizer states stay per logical stage. Devices on the optional ``data``
axis run replicas of the pipeline on different parts of every micro-batch and average each stage's
weight gradient (``lax.pmean``) before the stage's update, so all replicas keep the same weights.

The state is packed into per-device buffers of one shape on every device, ``shared`` ones
replicated over ``data`` and ``local`` ones split along the micro-batch
(:class:`~pipejax.parallel.sharded_layout.ShardedLayout`, which also moves states between the host,
the mesh and the logical layout). The two registers that leave a shard, its last stage's forward
packet and its first stage's cotangent, sit at the same place in every device's buffers.

**A tick** (inside ``lax.scan`` inside ``shard_map``): (1) each device cuts its outgoing registers
from the carry, i.e. what its shard wrote last tick, and ``lax.ppermute`` moves them one device on
(forward packet ``d -> d+1``, cotangent ``d -> d-1``); (2) ``lax.switch`` on
``lax.axis_index('stage')`` runs branch d, which unpacks shard d at static offsets, takes its
inbound packet (the batch on device 0) and cotangent (None on the last device) from the received
messages, calls ``advance_parts``, and writes the new shard state back (a whole buffer by a
reshape, part of one by ``lax.dynamic_update_slice``, never by concatenation). Step (1) reads
exactly what the single-device tick reads (registers written by the previous tick), so the
timing, and with it every number, is that of :meth:`~pipejax.core.engine.Pipeline.run`.

XLA writes a conditional's results into buffers of its own, never into its operands', so a loop
that carried the state through the switch copied every weight and optimizer state back once per
tick. The loop carries two sets of buffers instead and runs two ticks per iteration, the first
writing the second set and the second the first (:func:`_ping_pong`): nothing is copied back.
Delay lines (PipeDream's weight stashes among them) are not in the two sets: a tick changes one
slot of each stage's (a stacked part keeps its stages' rings end to end, one slot per stage), so
the switch returns those rows alone and the loop writes them in place after the switch
(``packing.ring_windows``), instead of rewriting the whole line into the other set.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from pipejax.parallel import packing, stacking
from pipejax.core import checks, initial, parts
from pipejax.core.checks import PipelineError
from pipejax.core.engine import Pipeline
from pipejax.core.stage_maths import TickOptions, all_finite
from pipejax.parallel.mesh import DATA, STAGE, MeshError, normalized_mesh, to_global, to_host
from pipejax.parallel.packing import SHARED, PackedState
from pipejax.parallel.partition import check_partition, param_counts, partition_stages
from pipejax.core.runner import Runner
from pipejax.parallel.sharded_layout import ShardedLayout
from pipejax.core.state import Batch, Packet, PipelineState, raw_key


class ShardedPipeline(Runner):
  """A :class:`~pipejax.core.engine.Pipeline` run over a ``('data', 'stage')`` device mesh: the
  sharded layout of :class:`~pipejax.core.runner.Runner`.

  ``inputs``/``labels`` of ``run`` and ``tick`` hold the global micro-batch ``b``; each data
  replica takes its ``b / data`` slice. Metrics come back replicated on every device (readable in
  every process): ``loss`` and the loss's metrics averaged over the data replicas, ``valid``,
  ``sample`` and ``finite`` (one flag per logical stage). ``run`` and ``tick`` are programs over
  the mesh and cannot be traced into a caller's ``jax.jit``.

  Args:
    pipeline: the local runner (model, method, micro-batch shape). Its micro-batch ``b`` is the
      global one; each data replica takes ``b / data`` samples of it. Where it has stacked parts,
      each device ticks its share of each under ``vmap``
      (:func:`pipejax.parallel.stacking.advance_shard`); the state and the numbers are the same.
    mesh: a mesh with a ``stage`` axis and optionally a ``data`` axis (see
      :func:`pipejax.parallel.mesh.make_mesh`).
    partition: explicit ``(start, stop)`` shards of logical stages, one per stage-axis device.
      Default: :func:`pipejax.parallel.partition.partition_stages` on ``costs``.
    costs: per-stage costs to balance (default :func:`pipejax.parallel.partition.param_counts`; or
      :func:`pipejax.parallel.partition.measure_stage_costs`).
    packing_policy: how a shard's state is packed: ``'per_leaf'`` (each state leaf in a buffer of
      its own, padded to the largest leaf it shares the buffer with on other devices), ``'flat'``
      (one buffer per dtype) or ``'auto'`` (per-leaf unless its padding costs over 25% more
      memory). Results are identical; per-leaf buffers are faster because XLA updates them in
      place.

  Raises:
    MeshError: more stage-axis devices than stages, a data axis that does not divide ``b``, a bad
      partition or a mesh without a ``stage`` axis.
  """

  def __init__(self, pipeline: Pipeline, mesh: Mesh, partition=None, costs=None,
               packing_policy: str = "auto"):
    if packing_policy not in ("auto", "flat", "per_leaf"):
      raise MeshError("packing_policy must be 'auto', 'flat' or 'per_leaf'; got "
                      f"{packing_policy!r}.")
    if not isinstance(pipeline, Pipeline):
      raise MeshError(f"ShardedPipeline takes a Pipeline (with or without stacked parts); got "
                      f"{type(pipeline).__name__}.")
    self.pipeline, self.spec = pipeline, pipeline.spec
    # The parts each device cuts to its shard and stacks; None: stage by stage.
    self.part_spans = pipeline.part_spans if pipeline.stacked else None
    self.mesh = normalized_mesh(mesh)
    self.num_shards = self.mesh.shape[STAGE]
    self.num_replicas = self.mesh.shape[DATA]
    num_stages = pipeline.num_stages
    if self.num_shards > num_stages:
      raise MeshError(
          f"The mesh's stage axis has {self.num_shards} devices but the pipeline has only "
          f"{num_stages} logical stages; each stage-axis device needs at least one stage. Use "
          f"mesh.stage <= {num_stages} (and put the other devices on the data axis), or split the "
          "model into more stages.")
    b = pipeline.micro_batch_size
    if b % self.num_replicas:
      raise MeshError(
          f"The data axis has {self.num_replicas} replicas but the micro-batch has b = {b} "
          "samples, which does not divide evenly. Choose a micro-batch size that is a multiple "
          f"of {self.num_replicas} or a data axis size that divides {b}.")
    if partition is not None:
      self.partition = check_partition(partition, num_stages, self.num_shards)
    else:
      if costs is None:
        costs = param_counts(pipeline)
      if len(costs) != num_stages:
        raise MeshError(f"Got {len(costs)} stage costs for a pipeline of {num_stages} stages.")
      self.partition = partition_stages(costs, self.num_shards)
    # Each device's parts: a stacked part cut at the devices' boundaries is stacked on each.
    self.shard_parts = tuple(parts.cut_parts(self.part_spans, pipeline.delays, a, z)
                             for a, z in self.partition)
    self._mesh_layout = ShardedLayout(pipeline, self.mesh, self.partition, packing_policy,
                                      self.shard_parts)
    self.packing = self._mesh_layout.packing
    self.packing_policy = self.packing.policy  # "auto" resolved
    self._max_shard = max(z - a for a, z in self.partition)
    metrics = pipeline.metric_shapes()
    self._metric_template = {k: v for k, v in metrics.items() if k != "finite"}
    self._jit_tick, self._jit_run, self._jit_run_full = self._compile(
        out_shardings=(self._mesh_layout.state_shardings(), self._mesh_layout.replicated))
    self._jit_weights_finite = jax.jit(self._weights_finite)
    shardings = self._mesh_layout.state_shardings()
    self._jit_init = jax.jit(self._init, out_shardings=(
        {k: NamedSharding(self.mesh, self._mesh_layout.partition_spec(k))
         for k in self.packing.buffer_sizes}, shardings.rng))
    self._compiled_init = None

  # ------------------------------------------------------------------ facts

  @property
  def num_stages(self) -> int:
    return self.pipeline.num_stages

  @property
  def ticks_per_iteration(self) -> int:
    """Ticks per iteration of the compiled loop of :meth:`run`: 2 on a stage axis of several
    devices, which advances two ticks per iteration (see :func:`_ping_pong`), else 1."""
    return 1 if self.num_shards == 1 else 2

  def stage_to_device(self) -> list[int]:
    """Index on the stage axis of the device that owns each logical stage."""
    return [d for d, (a, z) in enumerate(self.partition) for _ in range(a, z)]

  def buffer_sizes(self) -> dict[str, int]:
    """Elements per device of each packed buffer, keyed ``'shared/float32'`` etc."""
    return {f"{k[0]}/{packing.buffer_name(k)}": v
            for k, v in sorted(self.packing.buffer_sizes.items())}

  # ------------------------------------------------------------------ state

  def init(self, rng: jax.Array, fill_value: float = 0.0) -> PackedState:
    """The initial state, made on the mesh: each device initializes its own stages into its own
    buffers, and no device or host holds the whole state. The same numbers as
    ``from_logical(pipeline.initial(rng, fill_value))``: the same programs compiled the same way
    (:data:`pipejax.core.initial.INIT_COMPILER`).
    """
    checks.refuse_traced("ShardedPipeline", (rng, fill_value))
    checks.check_state_fits(self.packing.allocated_bytes(), self.num_stages)
    key, fill = raw_key(rng), jnp.float32(fill_value)
    if self._compiled_init is None:
      self._compiled_init = initial.compiled_for_init(self._jit_init, key, fill)
    buffers, run_key = self._compiled_init(key, fill)
    tick = to_global(np.zeros((), np.int32), self._mesh_layout.replicated)
    return self._mesh_layout.packed_state(buffers, tick, run_key)

  def _init(self, key, fill_value):
    """The buffers of the initial state, each device's stages made by that device, and the run's
    key (replicated)."""
    pipe, plan = self.pipeline, self.packing
    stage_keys, run_key = pipe.initial.keys(key)
    roles_of = packing.Packing.roles

    def replica_part(leaf, role):
      """A data replica's share of a leaf (its slice of the micro-batch axis)."""
      if role.batch_axis is None or self.num_replicas == 1:
        return leaf
      size = leaf.shape[role.batch_axis] // self.num_replicas
      part = jax.lax.dynamic_slice_in_dim(leaf, jax.lax.axis_index(DATA) * size, size,
                                          role.batch_axis)
      return part * jnp.asarray(self.num_replicas, part.dtype) if role.cotangent else part

    def branch(d, buffers, stage_keys, fill):
      a, z = self.partition[d]
      # Stage by stage, also in a stacked part: under vmap in this program a stacked part's init
      # differs from the per-stage one in the last bit of some weights.
      stages = tuple(pipe.initial.stage_state(s, pipe.initial.weights(s, stage_keys[s]), fill)
                     for s in range(a, z))
      stages = tuple(jax.tree.map(replica_part, st, roles_of(st)) for st in stages)
      body, packet, cotangent = packing.split_shard(stages, self.shard_parts[d])
      buffers = packing.write_tree(buffers, plan.body_placements[d], body)
      buffers = packing.write_tree(buffers, plan.packet_placements[d], packet)
      return packing.write_tree(buffers, plan.cotangent_placements[d], cotangent)

    def on_device(stage_keys, fill):
      buffers = {k: jnp.zeros((n,), k[1]) for k, n in plan.buffer_sizes.items()}
      branches = [functools.partial(branch, d) for d in range(self.num_shards)]
      if self.num_shards == 1:
        buffers = branches[0](buffers, stage_keys, fill)
      else:
        buffers = jax.lax.switch(jax.lax.axis_index(STAGE), branches, buffers, stage_keys, fill)
      return {k: v.reshape((1,) * (1 if k[0] == SHARED else 2) + (v.size,))
              for k, v in buffers.items()}

    specs = {k: self._mesh_layout.partition_spec(k) for k in plan.buffer_sizes}
    buffers = jax.shard_map(on_device, mesh=self.mesh, in_specs=(P(), P()), out_specs=specs,
                            check_vma=False)(stage_keys, fill_value)
    return buffers, run_key

  def from_logical(self, state: PipelineState) -> PackedState:
    """Lays a logical :class:`PipelineState` out over the mesh (works in multi-process runs).

    Every process passes the same logical state; each keeps only its own devices' parts.
    """
    if len(state.stages) != self.num_stages:
      raise PipelineError(f"The state has {len(state.stages)} stages; this pipeline has "
                          f"{self.num_stages}.")
    checks.check_state(state, self.pipeline.state_spec, self.num_stages)
    return self._mesh_layout.from_logical(state)

  def check_state(self, packed: PackedState) -> None:
    """Refuses a logical state, a state of another mesh or pipeline, or one a run consumed."""
    self._mesh_layout.check_state(packed)

  def to_logical(self, packed: PackedState) -> PipelineState:
    """The logical :class:`PipelineState` (for checkpoints and comparisons).

    In a multi-process run every process must call it (it gathers the other processes' parts).
    """
    self.check_state(packed)
    return self._mesh_layout.to_logical(packed)

  # ------------------------------------------------------------------ running

  traceable = False

  def _stream(self, inputs, labels, valid, ticks) -> tuple[Batch, bool]:
    if isinstance(labels, jax.Array) and not labels.is_fully_addressable:
      # Already on the mesh, each process having filled its own devices (host_feed.HostFeed).
      batch = Batch(inputs, labels, valid)
    else:
      batch = self._mesh_layout.place_batch(
          self.spec.checked_batch(inputs, labels, valid, ticks=ticks), ticks=ticks)
    return batch, bool(np.all(to_host(batch.valid)))

  def placed_batch(self, inputs, labels, valid=None) -> Batch:
    """A checked stream of ``T`` ticks laid out over the mesh: each data replica gets its part
    (what :attr:`programs` take)."""
    return self._stream(inputs, labels, valid, ticks=True)[0]

  def every_slot_full(self, packed: PackedState) -> bool:
    """:meth:`Pipeline.every_slot_full` of the packed state, reading only its flags.

    The flags are the state's boolean leaves (delay-line and packet ``valid``); only those small
    buffers come to the host. Any other boolean leaf that is False (none of the built-in
    optimizers keeps one) would only keep the guarded program running.
    """
    return self._mesh_layout.flags_all_set(packed)

  def host_params(self, packed: PackedState) -> list:
    """See :meth:`pipejax.core.runner.Runner.host_params`; every process must call it (it
    gathers the other processes' parts, as :meth:`to_logical` does)."""
    return [jax.device_get(st.params) for st in self.to_logical(packed).stages]

  def weights_finite(self, packed: PackedState) -> np.ndarray:
    """See :meth:`pipejax.core.runner.Runner.weights_finite`: each device checks its own stages'
    weights in its buffers; only the flags leave the devices."""
    self.check_state(packed)
    flags = to_host(self._jit_weights_finite(self._mesh_layout.buffers(packed)))
    return self._per_stage(flags.reshape(self.num_shards, self._max_shard))

  def _per_stage(self, by_device):
    """Logical stage s's entry of ``(..., stage, max_shard)`` per-device values."""
    device = np.array(self.stage_to_device())
    position = np.array([s - self.partition[d][0] for s, d in enumerate(device)])
    return by_device[..., device, position]

  def _weights_finite(self, buffers):
    def branch(d, buffers):
      stages, _ = packing.read_tree(buffers, self.packing.body_placements[d])
      flags = jnp.stack([all_finite((st.params, st.opt_state)) for st in stages])
      return jnp.pad(flags, (0, self._max_shard - flags.shape[0]))

    def on_device(buffers):
      buffers = {k: v.reshape(-1) for k, v in buffers.items()}
      if self.num_shards == 1:
        return branch(0, buffers)
      return jax.lax.switch(jax.lax.axis_index(STAGE),
                            [functools.partial(branch, d) for d in range(self.num_shards)],
                            buffers)

    specs = {k: self._mesh_layout.partition_spec(k) for k in buffers}
    return jax.shard_map(on_device, mesh=self.mesh, in_specs=(specs,), out_specs=P(STAGE),
                         check_vma=False)(buffers)

  # ------------------------------------------------------------------ the tick on the mesh

  def _tick(self, packed: PackedState, batch: Batch, every_slot_full: bool = False):
    """One tick: :meth:`_run` over a stream of one."""
    packed, metrics = self._run(packed, jax.tree.map(lambda a: a[None], batch), every_slot_full)
    return packed, jax.tree.map(lambda a: a[0], metrics)

  def _run(self, packed: PackedState, batch: Batch, every_slot_full: bool = False):
    buffers = self._mesh_layout.buffers(packed)
    buffer_specs = {k: self._mesh_layout.partition_spec(k) for k in buffers}
    batch_specs = Batch(jax.tree.map(lambda _: P(None, DATA), batch.inputs),
                        jax.tree.map(lambda _: P(None, DATA), batch.labels), P())
    metric_specs = {k: P(None, STAGE) for k in self._metric_template}
    run_on_device = jax.shard_map(
        functools.partial(self._device_run, every_slot_full=every_slot_full), mesh=self.mesh,
        in_specs=(buffer_specs, P(), P(), batch_specs),
        out_specs=(buffer_specs, P(), P(None, STAGE), metric_specs),
        check_vma=False)  # replicas stay equal through pmean; the checker cannot see that
    buffers, tick, finite, last = run_on_device(buffers, packed.tick, packed.rng, batch)
    # finite: (T, stage * max_shard), device d's stages first; pick logical stage s's flag.
    finite = finite.reshape(finite.shape[0], self.num_shards, self._max_shard)
    metrics = {k: v[:, -1] for k, v in last.items()}  # the last stage lives on the last device
    metrics["finite"] = self._per_stage(finite)
    return self._mesh_layout.packed_state(buffers, tick, packed.rng), metrics

  def _device_run(self, buffers, tick, rng, batch: Batch, every_slot_full: bool = False):
    """One device's ``T`` ticks (inside ``shard_map``): exchange registers, run its shard."""
    carry_shapes = self.packing.carry_shapes()
    buffers = {k: v.reshape(carry_shapes.get(k, v.shape[-1:])) for k, v in buffers.items()}
    rings = {k: buffers.pop(k) for k in self.packing.ring_widths}
    branches = [functools.partial(self._advance_shard, d, every_slot_full=every_slot_full)
                for d in range(self.num_shards)]
    shard_index = jax.lax.axis_index(STAGE)

    def one_tick(buffers, rings, tick, tick_batch):
      """The state after one tick (a new set of buffers, the delay lines written in place), and
      the tick's metrics."""
      packet_msg, cotangent_msg = self._exchange(buffers)
      operands = ({**buffers, **rings}, packet_msg, cotangent_msg, tick_batch, tick, rng)
      if self.num_shards == 1:
        buffers, windows, finite, last = branches[0](*operands)
      else:
        buffers, windows, finite, last = jax.lax.switch(shard_index, branches, *operands)
      return buffers, packing.write_windows(rings, windows), (finite, last)

    if self.num_shards == 1:
      def step(carry, tick_batch):
        buffers, rings, tick = carry
        buffers, rings, outputs = one_tick(buffers, rings, tick, tick_batch)
        return (buffers, rings, tick + 1), outputs

      (buffers, rings, tick), (finite, last) = jax.lax.scan(step, (buffers, rings, tick), batch)
    else:
      buffers, rings, tick, (finite, last) = _ping_pong(one_tick, buffers, rings, tick, batch)
    buffers.update(rings)
    if self.num_replicas > 1:  # a replica's loss is its b/data samples' mean: mean of means
      last = {k: jax.lax.pmean(v, DATA) if jnp.issubdtype(v.dtype, jnp.inexact) else v
              for k, v in last.items()}
    buffers = {k: v.reshape((1,) * (1 if k[0] == SHARED else 2) + (v.size,))
               for k, v in buffers.items()}
    return buffers, tick, finite, {k: v[:, None] for k, v in last.items()}

  def _exchange(self, buffers):
    """Sends the registers the shard wrote last tick: packet to d+1, cotangent to d-1."""
    if self.num_shards == 1:
      return None, None
    cut = lambda regions: {k: jax.lax.slice_in_dim(buffers[k].reshape(-1), a, z)
                           for k, (a, z) in regions.items()}
    forward = [(d, d + 1) for d in range(self.num_shards - 1)]
    backward = [(d + 1, d) for d in range(self.num_shards - 1)]
    return (jax.lax.ppermute(cut(self.packing.packet_region), STAGE, forward),
            jax.lax.ppermute(cut(self.packing.cotangent_region), STAGE, backward))

  def _advance_shard(self, d: int, buffers, packet_msg, cotangent_msg, tick_batch: Batch, tick,
                     rng, every_slot_full: bool = False):
    """lax.switch branch d: unpack shard d at static offsets, advance it one tick, pack it back."""
    plan = self.packing
    body_placement = plan.body_placements[d]
    packet_placement, cotangent_placement = plan.packet_placements[d], plan.cotangent_placements[d]
    stages, stack_lines = packing.read_tree(buffers, body_placement)
    stages = packing.join_registers(stages, packing.read_tree(buffers, packet_placement),
                                    packing.read_tree(buffers, cotangent_placement))
    if d == 0:
      inbound = Packet(tick_batch.inputs, tick_batch.labels, tick_batch.valid, tick)
    else:  # what shard d-1's last stage forwarded last tick, cut from its packet region
      inbound = packing.read_tree(packet_msg, plan.packet_placements[d - 1])
    cotangent = None
    if d < self.num_shards - 1:  # what shard d+1's first stage sent back last tick
      region_starts = {k: a for k, (a, _) in plan.cotangent_region.items()}
      cotangent = packing.read_tree(cotangent_msg, plan.cotangent_placements[d + 1], region_starts)
    in_place = plan.ring_widths
    options = TickOptions(
        reduce_grads=(lambda g: jax.lax.pmean(g, DATA)) if self.num_replicas > 1 else None,
        every_slot_full=every_slot_full, delay_line_entries=bool(in_place))
    stages, stack_lines, part_metrics = stacking.advance_shard(
        self.pipeline.maths, self.shard_parts[d], stages, stack_lines, inbound, cotangent, tick,
        rng, options)
    stages, packet, cotangent_out = packing.split_registers(stages)
    body = (stages, stack_lines)
    windows = packing.ring_windows(buffers, body_placement, body, tick, plan)
    buffers = packing.write_tree(buffers, body_placement, body, skip=in_place)
    buffers = packing.write_tree(buffers, packet_placement, packet)
    buffers = packing.write_tree(buffers, cotangent_placement, cotangent_out)
    buffers = {k: v for k, v in buffers.items() if k not in in_place}
    finite = jnp.concatenate([jnp.atleast_1d(m["finite"]) for m in part_metrics])
    finite = jnp.pad(finite, (0, self._max_shard - finite.shape[0]))
    if d == self.num_shards - 1:
      last = {k: v for k, v in part_metrics[-1].items() if k != "finite"}
    else:
      last = {k: jnp.zeros(v.shape, v.dtype) for k, v in self._metric_template.items()}
    return buffers, windows, finite, last


def _ping_pong(one_tick, buffers, rings, tick, batch: Batch):
  """``T`` ticks of ``one_tick`` (whose ``lax.switch`` returns new buffers), two per iteration.

  XLA cannot update a conditional's operands in place: the branch that runs writes its results
  into the conditional's own output buffers. A loop that carries the state through the
  conditional then copies them back into the loop's buffers, every weight and optimizer state
  once per tick (2.2 passes over a device's weights, docs/performance.md). So the loop carries a
  second, spare set: the first tick of an iteration reads set A and writes set B, the second reads
  B and writes A, and what each conditional writes is the set whose old contents nothing reads
  any more. The spare set takes the memory that the conditional's output buffers took. The delay
  lines (``rings``), of which a tick rewrites one slot, are not in the sets: the conditional
  returns the slot, and ``one_tick`` writes it in place after the conditional.

  Why not the alternatives. Stacking homogeneous stages under ``vmap`` with no switch at all needs
  every device to run the same code, which no model here does: the first device reads the batch,
  the last holds the head and the loss, and stages often differ in shape (784-256-128-10).
  Returning only small results from the switch and updating the buffers outside it would move
  the optimizer's update out of the stage's code: the switch would return the weight gradients,
  an array as large as the weights, written and read once more per tick, and the engine's tick
  would have to be cut in two. Two sets of buffers work for every model and method as they are.
  An odd ``T`` runs its last tick after the loop (a third copy of the program's branches).
  """
  num_ticks = jax.tree.leaves(batch)[0].shape[0]
  pairs, odd = divmod(num_ticks, 2)
  outputs = []
  if pairs:
    def two_ticks(carry, pair_batch):
      (buffers, spare), rings, tick = carry
      first, second = (jax.tree.map(lambda a, i=i: a[i], pair_batch) for i in (0, 1))
      spare, rings, first_outputs = one_tick(buffers, rings, tick, first)
      buffers, rings, second_outputs = one_tick(spare, rings, tick + 1, second)
      both = jax.tree.map(lambda a, b: jnp.stack([a, b]), first_outputs, second_outputs)
      return ((buffers, spare), rings, tick + 2), both

    in_pairs = jax.tree.map(lambda a: a[:2 * pairs].reshape((pairs, 2) + a.shape[1:]), batch)
    spare = jax.tree.map(jnp.zeros_like, buffers)  # overwritten whole by the first tick
    ((buffers, _), rings, tick), paired = jax.lax.scan(two_ticks, ((buffers, spare), rings, tick),
                                                       in_pairs)
    outputs.append(jax.tree.map(lambda a: a.reshape((2 * pairs,) + a.shape[2:]), paired))
  if odd:
    buffers, rings, last_outputs = one_tick(buffers, rings, tick,
                                            jax.tree.map(lambda a: a[-1], batch))
    outputs.append(jax.tree.map(lambda a: a[None], last_outputs))
    tick = tick + 1
  return buffers, rings, tick, jax.tree.map(lambda *parts: jnp.concatenate(parts), *outputs)

