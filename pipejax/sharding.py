"""Pipelined Backpropagation over many devices: ``shard_map`` over a ``('data', 'stage')`` mesh.

Each device on the ``stage`` axis owns a contiguous group of logical stages and advances it with
the engine's own :meth:`pipejax.engine.Pipeline.advance_stages`: there is no second engine, and
delays, delay lines and optimizer states stay per logical stage. Devices on the optional ``data``
axis run replicas of the pipeline on different parts of every micro-batch and average each stage's
weight gradient (``lax.pmean``) before the stage's update, so all replicas keep the same weights.

**Packing.** Groups differ in shapes (uneven stages, uneven group sizes), while ``shard_map`` wants
one array shape on every device. So each group's slice of the :class:`~pipejax.engine.PipelineState`
is flattened into 1-D buffers padded to the largest group's and stacked along a leading ``stage``
dimension sharded over the mesh, in two families:

* ``shared`` buffers, global shape ``(stage, n)``, replicated over ``data``: weights, optimizer
  states, PipeDream's stashed weights, stateful stages' variables (live and stashed), and the valid
  flags and sample indices of delay lines and packets (the same on every replica);
* ``local`` buffers, global shape ``(data, stage, n)``: everything that carries the micro-batch
  axis (stashed inputs, forward packets' activations and labels, backward cotangents); replica r
  holds samples ``r*b/data .. (r+1)*b/data - 1`` of every micro-batch.

Within a family, the ``'slots'`` layout (default) gives every state leaf a buffer of its own: the
i-th largest leaf of each group shares buffer i, so padding stays small and XLA can update each
leaf in place as it does on one device. The ``'flat'`` layout puts all leaves of one dtype in one
buffer at static offsets (least padding; XLA then copies the buffer every tick). In both, the two
registers that leave a group (its last stage's ``forward_out`` packet and its first stage's
``backward_out`` cotangent) sit at the same place on every device, so every device cuts its
outgoing message the same way.

**A tick** (inside ``lax.scan`` inside ``shard_map``): (1) each device cuts its outgoing registers
from the carry, i.e. what its group wrote last tick, and ``lax.ppermute`` moves them one device on
(forward packet ``d -> d+1``, cotangent ``d -> d-1``); (2) ``lax.switch`` on
``lax.axis_index('stage')`` runs branch d, which unpacks group d at static offsets, takes its
inbound packet (the batch on device 0) and cotangent (None on the last device) from the received
messages, calls ``advance_stages``, and writes the new group state back (a whole buffer by a
reshape, part of one by ``lax.dynamic_update_slice``, never by concatenation) so that XLA can
keep the carry in place (it still copies a conditional's outputs once per tick). Step (1) reads
exactly what the single-device tick reads (registers written by the previous tick), so the
timing, and with it every number, is that of :meth:`~pipejax.engine.Pipeline.run`.

A cotangent held by a data replica is the gradient of the *replica's* mean loss, ``data`` times the
gradient of the whole micro-batch's mean loss that the single-device state holds; :meth:`pack` and
:meth:`unpack` convert, so ``unpack(run(pack(s)))`` compares directly with ``Pipeline.run(s)``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from typing import Any, NamedTuple, Sequence

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from pipejax import accounting, engine
from pipejax.engine import (Batch, DelayLine, Packet, Pipeline, PipelineError,
                            PipelineRunner, PipelineState, StageState)

PyTree = Any
STAGE, DATA = "stage", "data"
SHARED, LOCAL = "shared", "local"


class MeshError(PipelineError):
  """A mesh, partition or micro-batch that does not fit the pipeline; says how to fix it."""


# ----------------------------------------------------------------------------- meshes


def make_mesh(stage: int, data: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``('data', 'stage')`` mesh over ``devices`` (default: all global devices).

  ``data`` is the innermost (fastest) axis of ``jax.make_mesh``'s topology-aware order: each tick
  all-reduces every stage's gradient over ``data`` but sends only one activation packet along
  ``stage``, so the data replicas of one stage should share the fastest links (one host). Axes are
  ``Auto``: the pipeline places its buffers itself.

  Raises:
    MeshError: ``stage * data`` differs from the number of devices, or an axis is < 1.
  """
  for name, size in (("stage", stage), ("data", data)):
    if not isinstance(size, (int, np.integer)) or size < 1:
      raise MeshError(f"mesh.{name} must be an integer >= 1; got {size!r}.")
  devices = list(jax.devices() if devices is None else devices)
  if stage * data != len(devices):
    count = len(devices)
    fits = [f"stage={count // d} x data={d}" for d in range(1, count + 1) if count % d == 0]
    raise MeshError(
        f"A mesh of stage={stage} x data={data} needs {stage * data} devices, but there are "
        f"{count} ({_describe_devices(devices)}). Choose mesh.stage * mesh.data = {count}: "
        f"{', '.join(fits[:4])}{', ...' if len(fits) > 4 else ''}.")
  grid = np.array(devices, dtype=object).reshape(stage, data)
  if devices == list(jax.devices()):
    try:  # the physical topology's order on TPU and GPU
      grid = jax.make_mesh((stage, data), (STAGE, DATA),
                           axis_types=(AxisType.Auto, AxisType.Auto)).devices
    except (ValueError, NotImplementedError):  # a shape the topology helper cannot lay out
      pass
  return Mesh(np.asarray(grid).T, (DATA, STAGE), axis_types=(AxisType.Auto, AxisType.Auto))


def _describe_devices(devices) -> str:
  kinds = sorted({d.platform for d in devices})
  processes = len({d.process_index for d in devices})
  return f"{'/'.join(kinds) or 'none'} on {processes} process{'es' if processes != 1 else ''}"


def _normalized_mesh(mesh: Mesh) -> Mesh:
  """The mesh as ``('data', 'stage')`` with Auto axes (a missing ``data`` axis has size 1)."""
  if not isinstance(mesh, Mesh):
    raise MeshError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}. Build one with "
                    "pipejax.sharding.make_mesh(stage, data).")
  names = tuple(mesh.axis_names)
  extra = [n for n in names if n not in (STAGE, DATA)]
  if STAGE not in names or extra:
    raise MeshError(f"The mesh must have a '{STAGE}' axis and optionally a '{DATA}' axis; it has "
                    f"axes {names}. Build one with pipejax.sharding.make_mesh(stage, data).")
  devices = np.asarray(mesh.devices)
  if DATA not in names:
    devices = devices[None]
  elif names.index(DATA) != 0:
    devices = devices.T
  return Mesh(devices, (DATA, STAGE), axis_types=(AxisType.Auto, AxisType.Auto))


# ----------------------------------------------------------------------------- partitions


def partition_stages(costs: Sequence[float], num_groups: int) -> list[tuple[int, int]]:
  """Contiguous groups ``(start, stop)`` of stages minimising the largest group's cost.

  Exact dynamic programme over split points (O(G S^2)); among partitions with the same largest
  cost it prefers the one whose costliest groups are shortest, so stages that cost nothing are
  spread rather than piled onto one device.

  Args:
    costs: non-negative cost per logical stage (parameter counts, measured seconds, ...).
    num_groups: number of groups, 1 <= num_groups <= len(costs).

  Returns:
    ``num_groups`` pairs covering ``range(len(costs))`` in order, none empty.
  """
  costs = [float(c) for c in costs]
  num_stages = len(costs)
  if any(not math.isfinite(c) or c < 0 for c in costs):
    raise MeshError(f"Stage costs must be finite and >= 0; got {costs}.")
  if not 1 <= num_groups <= num_stages:
    raise MeshError(f"Cannot split {num_stages} stages into {num_groups} non-empty groups: the "
                    f"stage axis must have between 1 and {num_stages} devices.")
  prefix = [0.0] + list(itertools.accumulate(costs))
  worst = (math.inf, math.inf)
  # best[g][i]: the best (largest group cost, its length) for the first i stages in g groups.
  best = [[worst] * (num_stages + 1) for _ in range(num_groups + 1)]
  split = [[0] * (num_stages + 1) for _ in range(num_groups + 1)]
  best[0][0] = (0.0, 0)
  for g in range(1, num_groups + 1):
    for i in range(g, num_stages - (num_groups - g) + 1):
      for j in range(g - 1, i):
        if best[g - 1][j] == worst:
          continue
        candidate = max(best[g - 1][j], (prefix[i] - prefix[j], i - j))
        if candidate < best[g][i]:
          best[g][i], split[g][i] = candidate, j
  bounds, stop = [], num_stages
  for g in range(num_groups, 0, -1):
    start = split[g][stop]
    bounds.append((start, stop))
    stop = start
  return bounds[::-1]


def imbalance(costs: Sequence[float], partition: Sequence[tuple[int, int]]) -> float:
  """Largest group cost over the mean group cost: 1.0 is perfect balance.

  A pipeline ticks at the pace of its slowest device, so this is the slowdown against an ideal
  split of the same total work.
  """
  group_costs = [float(sum(costs[a:b])) for a, b in partition]
  mean = sum(group_costs) / len(group_costs)
  return max(group_costs) / mean if mean > 0 else 1.0


def check_partition(partition, num_stages: int, num_groups: int) -> list[tuple[int, int]]:
  """Validates an explicit partition: ``num_groups`` contiguous, non-empty, covering groups."""
  try:
    bounds = [(int(a), int(b)) for a, b in partition]
  except (TypeError, ValueError):
    raise MeshError(f"A partition is a list of (start, stop) pairs, one per stage-axis device; got "
                    f"{partition!r}.") from None
  example = partition_stages([1.0] * num_stages, num_groups) if num_groups <= num_stages else None
  hint = f" For example {example} for an even split." if example else ""
  if len(bounds) != num_groups:
    raise MeshError(f"The partition {bounds} has {len(bounds)} groups but the mesh's stage axis "
                    f"has {num_groups} devices; give exactly one (start, stop) per device.{hint}")
  expected_start = 0
  for a, b in bounds:
    if a != expected_start or b <= a:
      raise MeshError(
          f"The partition {bounds} is not contiguous: groups must be non-empty (start < stop), "
          f"start at 0, and each must start where the previous one stopped (expected a group "
          f"starting at {expected_start}, got ({a}, {b})).{hint}")
    expected_start = b
  if expected_start != num_stages:
    raise MeshError(f"The partition {bounds} covers stages 0..{expected_start - 1} but the "
                    f"pipeline has {num_stages} stages (0..{num_stages - 1}).{hint}")
  return bounds


def param_counts(pipeline: Pipeline) -> list[int]:
  """Number of weights of each logical stage (a proxy for its compute at fixed micro-batch)."""
  state = jax.eval_shape(pipeline.init, jax.random.PRNGKey(0))
  return [sum(math.prod(a.shape) for a in jax.tree.leaves(st.params)) for st in state.stages]


def measure_stage_costs(pipeline: Pipeline, state: PipelineState | None = None,
                        repeats: int = 5) -> list[float]:
  """Seconds per tick of each stage's work, measured one stage at a time.

  Times a jitted forward, recompute and VJP (the stage's share of a tick) on the stage's own
  weights and an input of its micro-batch shape; best of ``repeats``. Measured costs beat parameter
  counts when stages differ in kind (convolutions against dense layers).
  """
  if state is None:
    state = jax.jit(pipeline.init)(jax.random.PRNGKey(0))
  seconds = []
  for s, stage in enumerate(pipeline.model.stages):
    key = jax.random.PRNGKey(s)

    def work(params, variables, x, forward=stage.forward, key=key):
      y, _ = forward(params, x, key, variables)
      y2, vjp = jax.vjp(lambda w, h: forward(w, h, key, variables)[0], params, x)
      return y, vjp(jax.tree.map(jnp.ones_like, y2))

    params, variables = state.stages[s].params, state.stages[s].variables
    x = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), pipeline.stage_input_shapes[s])
    fn = jax.jit(work)
    jax.block_until_ready(fn(params, variables, x))
    best = math.inf
    for _ in range(max(repeats, 1)):
      start = time.perf_counter()
      jax.block_until_ready(fn(params, variables, x))
      best = min(best, time.perf_counter() - start)
    seconds.append(best)
  return seconds


# ----------------------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class _Role:
  """How a state leaf is distributed: its micro-batch axis (None: same on every replica)."""

  batch_axis: int | None
  cotangent: bool = False  # a replica holds data x the whole-micro-batch value


def _roles(st: StageState) -> StageState:
  """A StageState-shaped tree of :class:`_Role` leaves."""
  every = lambda tree, role: jax.tree.map(lambda _: role, tree)
  shared, line = _Role(None), st.delay_line
  packet = st.forward_out
  return StageState(
      params=every(st.params, shared),
      opt_state=every(st.opt_state, shared),
      delay_line=DelayLine(every(line.x, _Role(1)), every(line.valid, shared),
                           every(line.index, shared), every(line.weights, shared),
                           every(line.variables, shared)),
      forward_out=None if packet is None else Packet(
          every(packet.x, _Role(0)), every(packet.labels, _Role(0)), every(packet.valid, shared),
          every(packet.index, shared)),
      backward_out=every(st.backward_out, _Role(0, cotangent=True)),
      variables=every(st.variables, shared))


def _split_group(group: Sequence[StageState]):
  """(body, outgoing forward packet, outgoing cotangent) of a group of stage states."""
  body = list(group)
  outgoing_packet, outgoing_cotangent = body[-1].forward_out, body[0].backward_out
  body[-1] = body[-1]._replace(forward_out=None)
  body[0] = body[0]._replace(backward_out=None)
  return tuple(body), outgoing_packet, outgoing_cotangent


def _join_group(body, outgoing_packet, outgoing_cotangent) -> tuple[StageState, ...]:
  group = list(body)
  group[-1] = group[-1]._replace(forward_out=outgoing_packet)
  group[0] = group[0]._replace(backward_out=outgoing_cotangent)
  return tuple(group)


@dataclasses.dataclass(frozen=True)
class _Slot:
  """Where one leaf lives: its buffer, offset and size in it, and its per-device shape."""

  key: tuple[str, str, str]  # (family, dtype, buffer name): one packed buffer
  offset: int
  size: int
  shape: tuple[int, ...]
  role: _Role


@dataclasses.dataclass(frozen=True)
class _Layout:
  treedef: Any
  slots: tuple[_Slot, ...]

  def sizes(self) -> dict[tuple[str, str, str], int]:
    out = {}
    for slot in self.slots:
      out[slot.key] = out.get(slot.key, 0) + slot.size
    return out


def _layout(spec_tree, role_tree, data: int, base: dict, slot_prefix: str | None = None) -> _Layout:
  """Assigns each leaf of ``spec_tree`` a buffer and an offset in it.

  With ``slot_prefix`` None ("flat"), leaves follow one another in one buffer per (family, dtype),
  starting at ``base[key]``. Otherwise ("slots") each leaf gets a buffer of its own at offset 0:
  the i-th largest leaf of each (family, dtype) goes to buffer ``f"{slot_prefix}{i}"``, so across
  groups large leaves share buffers with large ones and the padding stays small.
  """
  leaves, treedef = jax.tree.flatten(spec_tree)
  roles = treedef.flatten_up_to(role_tree)
  shapes, families = [], []
  for leaf, role in zip(leaves, roles):
    shape = list(leaf.shape)
    if role.batch_axis is not None:
      shape[role.batch_axis] //= data
    shapes.append(tuple(shape))
    families.append((SHARED if role.batch_axis is None else LOCAL, jnp.dtype(leaf.dtype).name))
  rank = {}
  if slot_prefix is not None:
    for family in set(families):
      members = [i for i, f in enumerate(families) if f == family]
      for r, i in enumerate(sorted(members, key=lambda i: -math.prod(shapes[i]))):
        rank[i] = r
  cursor, slots = dict(base), []
  for i, (shape, role) in enumerate(zip(shapes, roles)):
    size = math.prod(shape)
    if slot_prefix is None:
      key = families[i] + ("",)
      offset = cursor.get(key, 0)
      cursor[key] = offset + size
    else:
      key, offset = families[i] + (f"{slot_prefix}{rank[i]}",), 0
    slots.append(_Slot(key, offset, size, shape, role))
  return _Layout(treedef, tuple(slots))


def _cut(buffer, start: int, size: int, shape):
  if start == 0 and size == buffer.shape[0]:  # a whole buffer: a reshape, which XLA aliases
    return buffer.reshape(shape)
  return jax.lax.slice_in_dim(buffer, start, start + size).reshape(shape)


def _read(buffers, layout: _Layout, shift: dict | None = None):
  """The tree ``layout`` describes, cut from ``buffers`` (whose offset 0 is ``shift[key]``)."""
  shift = shift or {}
  leaves = [_cut(buffers[s.key], s.offset - shift.get(s.key, 0), s.size, s.shape)
            for s in layout.slots]
  return layout.treedef.unflatten(leaves)


def _write(buffers, layout: _Layout, tree):
  """Writes ``tree``'s leaves in place (``dynamic_update_slice``, never a concatenation)."""
  buffers = dict(buffers)
  for slot, leaf in zip(layout.slots, layout.treedef.flatten_up_to(tree)):
    if jnp.dtype(leaf.dtype).name != slot.key[1] or tuple(leaf.shape) != slot.shape:
      raise PipelineError(f"A stage's state changed from {slot.shape} {slot.key[1]} to "
                          f"{tuple(leaf.shape)} {jnp.dtype(leaf.dtype).name} in one tick; the "
                          "engine and optimizers must keep every state leaf's shape and dtype.")
    buffer = buffers[slot.key]
    if slot.offset == 0 and slot.size == buffer.shape[0]:
      buffers[slot.key] = leaf.reshape(-1)
    else:
      buffers[slot.key] = jax.lax.dynamic_update_slice(buffer, leaf.reshape(-1), (slot.offset,))
  return buffers


def _buffer_name(key) -> str:
  """``'float32'`` (flat) or ``'float32/body3'`` (slots): the key in PackedState's dicts."""
  return key[1] if not key[2] else f"{key[1]}/{key[2]}"


class PackedState(NamedTuple):
  """A :class:`~pipejax.engine.PipelineState` laid out over a ``('data', 'stage')`` mesh.

  ``shared[name]`` has global shape ``(stage, n)`` (sharded over ``stage``, replicated over
  ``data``); ``local[name]`` has global shape ``(data, stage, n)``. Names are the dtype
  (``'float32'``) in the flat layout, dtype and slot (``'float32/body3'``) in the slots layout.
  ``tick`` and ``rng`` are replicated. Use :meth:`ShardedPipeline.unpack` for the logical state.
  """

  shared: dict[str, jax.Array]
  local: dict[str, jax.Array]
  tick: jax.Array
  rng: jax.Array


# ----------------------------------------------------------------------------- the pipeline


class ShardedPipeline(PipelineRunner):
  """A :class:`~pipejax.engine.Pipeline` run over a ``('data', 'stage')`` device mesh.

  Args:
    pipeline: the single-device pipeline (model, method, micro-batch shape). Its micro-batch ``b``
      is the global one; each data replica takes ``b / data`` samples of it.
    mesh: a mesh with a ``stage`` axis and optionally a ``data`` axis (see :func:`make_mesh`).
    partition: explicit ``(start, stop)`` groups of logical stages, one per stage-axis device.
      Default: :func:`partition_stages` on ``costs``.
    costs: per-stage costs to balance (default :func:`param_counts`; or
      :func:`measure_stage_costs`).
    layout: how a group's state is packed: ``'slots'`` (each state leaf in a buffer of its own,
      padded to the largest leaf it shares the buffer with on other devices), ``'flat'`` (one
      buffer per dtype) or ``'auto'`` (slots unless their padding costs over 25% more memory).
      Results are identical; slots are faster because XLA updates them in place.

  Raises:
    MeshError: more stage-axis devices than stages, a data axis that does not divide ``b``, a bad
      partition or a mesh without a ``stage`` axis.
  """

  def __init__(self, pipeline: Pipeline, mesh: Mesh, partition=None, costs=None,
               layout: str = "auto"):
    if layout not in ("auto", "flat", "slots"):
      raise MeshError(f"layout must be 'auto', 'flat' or 'slots'; got {layout!r}.")
    self.pipeline = pipeline
    self.mesh = _normalized_mesh(mesh)
    self.num_groups = self.mesh.shape[STAGE]
    self.num_replicas = self.mesh.shape[DATA]
    num_stages = pipeline.num_stages
    if self.num_groups > num_stages:
      raise MeshError(
          f"The mesh's stage axis has {self.num_groups} devices but the pipeline has only "
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
      self.partition = check_partition(partition, num_stages, self.num_groups)
    else:
      if costs is None:
        costs = param_counts(pipeline)
      if len(costs) != num_stages:
        raise MeshError(f"Got {len(costs)} stage costs for a pipeline of {num_stages} stages.")
      self.partition = partition_stages(costs, self.num_groups)
    self.layout = layout  # "auto" resolves to "slots" or "flat" in _build_layouts
    self._build_layouts()
    out_shardings = (self._state_shardings(), self._replicated)
    self._jit_run = engine.jit(self._run, donate_argnums=0, out_shardings=out_shardings)
    self._jit_run_full = engine.jit(functools.partial(self._run, every_slot_full=True),
                                    donate_argnums=0, out_shardings=out_shardings)
    # Compiled, not op by op: eager init dispatches hundreds of tiny computations.
    self._jit_init = jax.jit(pipeline.init)

  # ------------------------------------------------------------------ static layout

  def _build_layouts(self):
    abstract = jax.eval_shape(self.pipeline.init, jax.random.PRNGKey(0))
    self._abstract_state = abstract
    b = self.pipeline.micro_batch_size
    groups = [abstract.stages[a:z] for a, z in self.partition]
    parts = [_split_group(g) for g in groups]
    role_parts = [_split_group([_roles(st) for st in g]) for g in groups]
    if self.num_replicas > 1:
      stateful = [s for s, st in enumerate(abstract.stages) if st.variables is not None]
      if stateful:
        raise MeshError(
            f"{self.pipeline.model.stage_label(stateful[0])} keeps state (running statistics such "
            "as Online Normalization's) that depends on every sample it sees, in order. Data "
            f"replicas (data = {self.num_replicas}) each see only their part of every micro-batch, "
            "so their statistics would differ from each other and from one device's. Put every "
            "device on the stage axis (data = 1) for a stateful model, or use a stateless "
            "normalization ('layer' or 'group').")
      for s, st in enumerate(abstract.stages):
        for leaf, role in zip(jax.tree.leaves(st), jax.tree.leaves(_roles(st))):
          if role.batch_axis is not None and leaf.shape[role.batch_axis] != b:
            raise MeshError(
                f"Stage {s} keeps an activation of shape {leaf.shape} whose axis "
                f"{role.batch_axis} is not the micro-batch (b = {b}); data-parallel replicas "
                "split every activation along its leading micro-batch axis. Keep the micro-batch "
                "axis first in every stage's output, or use a mesh with data = 1.")

    def plan(policy):
      """(layouts per part, packet region, cotangent region, buffer sizes) of one policy."""

      def region(index, base):
        prefix = None if policy == "flat" else ("body", "packet", "cotangent")[index]
        layouts = [_layout(p[index], r[index], self.num_replicas, base, prefix)
                   for p, r in zip(parts, role_parts)]
        end = dict(base)
        for layout in layouts:
          for key, size in layout.sizes().items():
            end[key] = max(end.get(key, 0), base.get(key, 0) + size)
        return layouts, end

      # Flat: the outgoing packet at [0, F) of each buffer, the outgoing cotangent at [F, F + C),
      # the rest after. Slots: buffers of their own. Either way, the same on every device.
      packet_layouts, packet_end = region(1, {})
      cotangent_layouts, cotangent_end = region(2, packet_end)
      body_layouts, body_end = region(0, cotangent_end)
      return ((body_layouts, packet_layouts, cotangent_layouts),
              {k: (0, v) for k, v in packet_end.items() if v > 0},
              {k: (packet_end.get(k, 0), v) for k, v in cotangent_end.items()
               if v > packet_end.get(k, 0)},
              {k: v for k, v in body_end.items() if v > 0})

    def allocated(sizes):
      return sum(n * np.dtype(k[1]).itemsize for k, n in sizes.items())

    chosen = plan("flat" if self.layout == "flat" else "slots")
    if self.layout == "auto":
      # Buffers of their own let XLA update weights and delay lines in place (one flat buffer per
      # dtype makes it copy the whole buffer every tick), but pair leaves of different sizes
      # across groups; fall back to flat when that padding would cost over a quarter more memory.
      flat = plan("flat")
      self.layout = "slots"
      if allocated(chosen[3]) > 1.25 * allocated(flat[3]):
        chosen, self.layout = flat, "flat"
    layouts, self._packet_region, self._cotangent_region, self._buffer_sizes = chosen
    self._body_layouts, self._packet_layouts, self._cotangent_layouts = layouts
    self._max_group = max(z - a for a, z in self.partition)
    metrics = self.pipeline.metric_shapes()
    self._metric_template = {k: v for k, v in metrics.items() if k != "finite"}

  def _spec(self, key) -> P:
    return P(STAGE) if key[0] == SHARED else P(DATA, STAGE)

  def _global_shape(self, key) -> tuple[int, ...]:
    n = self._buffer_sizes[key]
    return (self.num_groups, n) if key[0] == SHARED else (self.num_replicas, self.num_groups, n)

  @property
  def _replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def _state_shardings(self) -> PackedState:
    families = {SHARED: {}, LOCAL: {}}
    for key in self._buffer_sizes:
      families[key[0]][_buffer_name(key)] = NamedSharding(self.mesh, self._spec(key))
    return PackedState(families[SHARED], families[LOCAL], self._replicated, self._replicated)

  def _by_key(self, packed: PackedState) -> dict[tuple[str, str, str], Any]:
    """Buffers by internal key (family, dtype, name)."""
    by_name = {(k[0], _buffer_name(k)): k for k in self._buffer_sizes}
    out = {by_name[SHARED, name]: v for name, v in packed.shared.items()}
    out.update({by_name[LOCAL, name]: v for name, v in packed.local.items()})
    return out

  @staticmethod
  def _families(buffers) -> tuple[dict, dict]:
    return ({_buffer_name(k): v for k, v in buffers.items() if k[0] == SHARED},
            {_buffer_name(k): v for k, v in buffers.items() if k[0] == LOCAL})

  # ------------------------------------------------------------------ facts

  @property
  def data(self) -> int:
    """The former name of :attr:`num_replicas`, kept so that older code keeps working."""
    return self.num_replicas

  @property
  def num_stages(self) -> int:
    return self.pipeline.num_stages

  def stage_to_device(self) -> list[int]:
    """Index on the stage axis of the device that owns each logical stage."""
    return [d for d, (a, z) in enumerate(self.partition) for _ in range(a, z)]

  def buffer_sizes(self) -> dict[str, int]:
    """Elements per device of each packed buffer, keyed ``'shared/float32'`` etc."""
    return {f"{k[0]}/{_buffer_name(k)}": v for k, v in sorted(self._buffer_sizes.items())}

  # ------------------------------------------------------------------ state

  def init(self, rng: jax.Array, fill_value: float = 0.0) -> PackedState:
    """``pack(pipeline.init(rng, fill_value))``: the same initial state as one device."""
    return self.pack(self._jit_init(rng, jnp.float32(fill_value)))

  def pack(self, state: PipelineState) -> PackedState:
    """Lays a logical :class:`PipelineState` out over the mesh (works in multi-process runs).

    Every process passes the same logical state; each keeps only its own devices' parts.
    """
    if len(state.stages) != self.num_stages:
      raise PipelineError(f"The state has {len(state.stages)} stages; this pipeline has "
                          f"{self.num_stages}.")
    host = {k: np.zeros(self._global_shape(k), np.dtype(k[1])) for k in self._buffer_sizes}
    for d, (a, z) in enumerate(self.partition):
      parts = _split_group(state.stages[a:z])
      layouts = (self._body_layouts[d], self._packet_layouts[d], self._cotangent_layouts[d])
      for part, layout in zip(parts, layouts):
        for slot, leaf in zip(layout.slots, layout.treedef.flatten_up_to(part)):
          leaf = np.asarray(leaf)
          if leaf.dtype.name != slot.key[1]:
            raise PipelineError(f"State leaf of dtype {leaf.dtype.name} where the pipeline holds "
                                f"{slot.key[1]}; pack states made by this pipeline's init.")
          span = slice(slot.offset, slot.offset + slot.size)
          if slot.role.batch_axis is None:
            host[slot.key][d, span] = leaf.reshape(-1)
            continue
          if slot.role.cotangent:
            leaf = leaf * np.asarray(self.num_replicas, leaf.dtype)
          parts = np.split(leaf, self.num_replicas, axis=slot.role.batch_axis)
          for r, part_r in enumerate(parts):
            host[slot.key][r, d, span] = part_r.reshape(-1)
    buffers = {k: self._to_global(v, NamedSharding(self.mesh, self._spec(k)))
               for k, v in host.items()}
    shared, local = self._families(buffers)
    return PackedState(shared, local, self._to_global(np.asarray(state.tick), self._replicated),
                       self._to_global(np.asarray(state.rng), self._replicated))

  def unpack(self, packed: PackedState) -> PipelineState:
    """The logical :class:`PipelineState` (for checkpoints and comparisons).

    In a multi-process run every process must call it (it gathers the other processes' parts).
    """
    host = {k: _to_host(v) for k, v in self._by_key(packed).items()}
    stages = []
    for d, (a, z) in enumerate(self.partition):
      layouts = (self._body_layouts[d], self._packet_layouts[d], self._cotangent_layouts[d])
      parts = []
      for layout in layouts:
        leaves = []
        for slot in layout.slots:
          span = slice(slot.offset, slot.offset + slot.size)
          if slot.role.batch_axis is None:
            leaves.append(host[slot.key][d, span].reshape(slot.shape))
            continue
          leaf = np.concatenate([host[slot.key][r, d, span].reshape(slot.shape)
                                 for r in range(self.num_replicas)], axis=slot.role.batch_axis)
          if slot.role.cotangent:
            leaf = leaf / np.asarray(self.num_replicas, leaf.dtype)
          leaves.append(leaf)
        parts.append(layout.treedef.unflatten(leaves))
      stages.extend(_join_group(*parts))
    state = PipelineState(tuple(stages), _to_host(packed.tick), _to_host(packed.rng))
    return jax.tree.map(jnp.asarray, state)

  def to_logical(self, packed: PackedState) -> PipelineState:
    """:meth:`unpack`: the device-independent state (the :class:`PipelineRunner` interface)."""
    return self.unpack(packed)

  def from_logical(self, logical_state: PipelineState) -> PackedState:
    """:meth:`pack`: the logical state laid out over this mesh."""
    return self.pack(logical_state)

  def _to_global(self, host_array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(host_array.shape, sharding, lambda index: host_array[index])

  # ------------------------------------------------------------------ running

  def run(self, packed: PackedState, inputs, labels, valid=None):
    """Advances ``T`` ticks; the same arguments and metrics as :meth:`Pipeline.run`.

    ``inputs``/``labels`` have shape ``(T, b, ...)`` with the global micro-batch ``b``; each data
    replica takes its ``b / data`` slice. ``packed`` is donated. Metrics come back replicated on
    every device (readable in every process): ``loss`` and the loss's metrics averaged over the
    data replicas, ``valid``, ``sample`` and ``finite`` (one flag per logical stage).
    """
    batch = self.pipeline.checked_batch(inputs, labels, valid, ticks=True)
    valid_flags = batch.valid
    by_replica = NamedSharding(self.mesh, P(None, DATA))
    batch = Batch(jax.tree.map(lambda a: self._to_global(np.asarray(a), by_replica), batch.inputs),
                  jax.tree.map(lambda a: self._to_global(np.asarray(a), by_replica), batch.labels),
                  self._to_global(np.asarray(batch.valid), self._replicated))
    if bool(np.all(np.asarray(valid_flags))) and self.every_slot_full(packed):
      return self._jit_run_full(packed, batch)
    return self._jit_run(packed, batch)

  def tick(self, packed: PackedState, inputs, labels, valid=True):
    """One tick (``run`` with T = 1); metrics without the time axis."""
    add_time = lambda tree: jax.tree.map(lambda a: np.asarray(a)[None], tree)
    packed, metrics = self.run(packed, add_time(inputs), add_time(labels),
                               np.asarray(valid, bool)[None])
    return packed, jax.tree.map(lambda a: a[0], metrics)

  def every_slot_full(self, packed: PackedState) -> bool:
    """:meth:`Pipeline.every_slot_full` of the packed state, reading only its flags.

    The flags are the state's boolean leaves (delay-line and packet ``valid``); only those small
    buffers come to the host. Any other boolean leaf that is False (none of the built-in
    optimizers keeps one) would only keep the guarded program running.
    """
    flags = {k: _to_host(v) for k, v in self._by_key(packed).items() if k[1] == "bool"}
    for d in range(self.num_groups):
      for layout in (self._body_layouts[d], self._packet_layouts[d], self._cotangent_layouts[d]):
        for slot in layout.slots:
          if slot.key in flags:
            span = flags[slot.key][..., d, slot.offset:slot.offset + slot.size]
            if not span.all():
              return False
    return True

  def _run(self, packed: PackedState, batch: Batch, every_slot_full: bool = False):
    buffers = self._by_key(packed)
    buffer_specs = {k: self._spec(k) for k in buffers}
    batch_specs = Batch(jax.tree.map(lambda _: P(None, DATA), batch.inputs),
                        jax.tree.map(lambda _: P(None, DATA), batch.labels), P())
    metric_specs = {k: P(None, STAGE) for k in self._metric_template}
    run_on_device = jax.shard_map(
        functools.partial(self._device_run, every_slot_full=every_slot_full), mesh=self.mesh,
        in_specs=(buffer_specs, P(), P(), batch_specs),
        out_specs=(buffer_specs, P(), P(None, STAGE), metric_specs),
        check_vma=False)  # replicas stay equal through pmean; the checker cannot see that
    buffers, tick, finite, last = run_on_device(buffers, packed.tick, packed.rng, batch)
    # finite: (T, stage * max_group), device d's stages first; pick logical stage s's flag.
    num_ticks = finite.shape[0]
    finite = finite.reshape(num_ticks, self.num_groups, self._max_group)
    device = np.array(self.stage_to_device())
    position = np.array([s - self.partition[d][0] for s, d in enumerate(device)])
    metrics = {k: v[:, -1] for k, v in last.items()}  # the last stage lives on the last device
    metrics["finite"] = finite[:, device, position]
    shared, local = self._families(buffers)
    return PackedState(shared, local, tick, packed.rng), metrics

  def _device_run(self, buffers, tick, rng, batch: Batch, every_slot_full: bool = False):
    """One device's ``T`` ticks (inside ``shard_map``): exchange registers, run its group."""
    buffers = {k: v.reshape(v.shape[-1]) for k, v in buffers.items()}
    branches = [functools.partial(self._advance_group, d, every_slot_full=every_slot_full)
                for d in range(self.num_groups)]
    group_index = jax.lax.axis_index(STAGE)

    def one_tick(carry, tick_batch):
      buffers, tick = carry
      packet_msg, cotangent_msg = self._exchange(buffers)
      operands = (buffers, packet_msg, cotangent_msg, tick_batch, tick, rng)
      if self.num_groups == 1:
        buffers, finite, last = branches[0](*operands)
      else:
        buffers, finite, last = jax.lax.switch(group_index, branches, *operands)
      return (buffers, tick + 1), (finite, last)

    (buffers, tick), (finite, last) = jax.lax.scan(one_tick, (buffers, tick), batch)
    if self.num_replicas > 1:  # a replica's loss is its b/data samples' mean: mean of means
      last = {k: jax.lax.pmean(v, DATA) if jnp.issubdtype(v.dtype, jnp.inexact) else v
              for k, v in last.items()}
    buffers = {k: v.reshape((1,) * (1 if k[0] == SHARED else 2) + v.shape)
               for k, v in buffers.items()}
    return buffers, tick, finite, {k: v[:, None] for k, v in last.items()}

  def _exchange(self, buffers):
    """Sends the registers the group wrote last tick: packet to d+1, cotangent to d-1."""
    if self.num_groups == 1:
      return None, None
    cut = lambda regions: {k: jax.lax.slice_in_dim(buffers[k], a, z)
                           for k, (a, z) in regions.items()}
    forward = [(d, d + 1) for d in range(self.num_groups - 1)]
    backward = [(d + 1, d) for d in range(self.num_groups - 1)]
    return (jax.lax.ppermute(cut(self._packet_region), STAGE, forward),
            jax.lax.ppermute(cut(self._cotangent_region), STAGE, backward))

  def _advance_group(self, d: int, buffers, packet_msg, cotangent_msg, tick_batch: Batch, tick,
                     rng, every_slot_full: bool = False):
    """lax.switch branch d: unpack group d at static offsets, advance it one tick, pack it back."""
    body_layout = self._body_layouts[d]
    packet_layout, cotangent_layout = self._packet_layouts[d], self._cotangent_layouts[d]
    group = _join_group(_read(buffers, body_layout), _read(buffers, packet_layout),
                        _read(buffers, cotangent_layout))
    if d == 0:
      inbound = Packet(tick_batch.inputs, tick_batch.labels, tick_batch.valid, tick)
    else:  # what group d-1's last stage forwarded last tick, cut from its packet region
      inbound = _read(packet_msg, self._packet_layouts[d - 1])
    cotangent = None
    if d < self.num_groups - 1:  # what group d+1's first stage sent back last tick
      region_starts = {k: a for k, (a, _) in self._cotangent_region.items()}
      cotangent = _read(cotangent_msg, self._cotangent_layouts[d + 1], region_starts)
    reduce_grads = (lambda g: jax.lax.pmean(g, DATA)) if self.num_replicas > 1 else None
    start = self.partition[d][0]
    group, stage_metrics = self.pipeline.advance_stages(start, group, inbound, cotangent, tick, rng,
                                                        reduce_grads, every_slot_full)
    body, packet, cotangent_out = _split_group(group)
    buffers = _write(buffers, body_layout, body)
    buffers = _write(buffers, packet_layout, packet)
    buffers = _write(buffers, cotangent_layout, cotangent_out)
    finite = jnp.stack([m["finite"] for m in stage_metrics])
    finite = jnp.pad(finite, (0, self._max_group - finite.shape[0]))
    if d == self.num_groups - 1:
      last = {k: v for k, v in stage_metrics[-1].items() if k != "finite"}
    else:
      last = {k: jnp.zeros(v.shape, v.dtype) for k, v in self._metric_template.items()}
    return buffers, finite, last


def _to_host(array) -> np.ndarray:
  if isinstance(array, jax.Array) and not array.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
  return np.asarray(array)


# ----------------------------------------------------------------------------- accounting


def _tree_bytes_per_replica(tree, roles, data: int) -> int:
  total = 0
  for leaf, role in zip(jax.tree.leaves(tree), jax.tree.leaves(roles)):
    n = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    total += n // data if role.batch_axis is not None else n
  return total


def boundary_bytes_per_tick(sharded: ShardedPipeline) -> dict[str, int]:
  """Bytes that cross device boundaries in one tick, over the whole mesh.

  Returns a dict:

  * ``forward``: packets (activations, labels, valid flag, sample index) from each group's last
    stage to the next group, summed over the boundaries and the data replicas;
  * ``backward``: cotangents from each group's first stage to the previous group;
  * ``gradient_all_reduce``: the data axis's gradient averaging, ``2 (data - 1) |g_s|`` summed over
    the stages (what a ring all-reduce sends in total; 0 without a data axis);
  * ``total``: the sum of the three;
  * ``forward_padded`` / ``backward_padded``: what ``ppermute`` actually sends, each message padded
    to the largest group's register.
  """
  state, data = sharded._abstract_state, sharded.num_replicas
  forward = backward = 0
  for a, _ in sharded.partition[1:]:
    sender, receiver = state.stages[a - 1], state.stages[a]
    forward += data * _tree_bytes_per_replica(sender.forward_out, _roles(sender).forward_out, data)
    backward += accounting.tree_bytes(receiver.backward_out)
  all_reduce = sum(2 * (data - 1) * accounting.tree_bytes(st.params) for st in state.stages)

  def region_bytes(regions):
    return sum((z - a) * np.dtype(k[1]).itemsize for k, (a, z) in regions.items())

  messages = (sharded.num_groups - 1) * data
  return {
      "forward": forward,
      "backward": backward,
      "gradient_all_reduce": all_reduce,
      "total": forward + backward + all_reduce,
      "forward_padded": messages * region_bytes(sharded._packet_region),
      "backward_padded": messages * region_bytes(sharded._cotangent_region),
  }


def device_memory(sharded: ShardedPipeline) -> list[dict[str, Any]]:
  """Bytes each stage-axis device holds (the same on every data replica of it).

  Per device: ``stages`` (its ``(start, stop)``), ``weights``, ``optimizer``, ``delay_lines``
  (stashed inputs with their flags), ``weight_stash`` (PipeDream's weight copies), ``variables``
  (stateful stages' variables, live and stashed with the inputs), ``registers``
  (forward packets and cotangents), their sum ``logical``, ``allocated`` (the padded buffers every
  device actually holds) and ``messages`` (the two transient boundary buffers of a tick).
  Activations count the device's own ``b / data`` samples.
  """
  state, data = sharded._abstract_state, sharded.num_replicas
  allocated = sum(n * np.dtype(k[1]).itemsize for k, n in sharded._buffer_sizes.items())
  messages = sum((z - a) * np.dtype(k[1]).itemsize
                 for regions in (sharded._packet_region, sharded._cotangent_region)
                 for k, (a, z) in regions.items())
  report = []
  for a, z in sharded.partition:
    row = {"stages": (a, z), "weights": 0, "optimizer": 0, "delay_lines": 0, "weight_stash": 0,
           "variables": 0, "registers": 0}
    for st in state.stages[a:z]:
      roles = _roles(st)
      line, line_roles = st.delay_line, roles.delay_line
      row["weights"] += accounting.tree_bytes(st.params)
      row["optimizer"] += accounting.tree_bytes(st.opt_state)
      row["delay_lines"] += _tree_bytes_per_replica((line.x, line.valid, line.index),
                                                    (line_roles.x, line_roles.valid,
                                                     line_roles.index), data)
      row["weight_stash"] += accounting.tree_bytes(line.weights)
      row["variables"] += accounting.tree_bytes((st.variables, line.variables))
      row["registers"] += _tree_bytes_per_replica((st.forward_out, st.backward_out),
                                                  (roles.forward_out, roles.backward_out), data)
    row["logical"] = sum(row[k] for k in ("weights", "optimizer", "delay_lines", "weight_stash",
                                          "variables", "registers"))
    row["allocated"] = allocated
    row["messages"] = messages
    report.append(row)
  return report
