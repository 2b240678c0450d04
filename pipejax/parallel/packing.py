"""How a sharded pipeline's state is packed into per-device buffers (``pipejax.parallel.sharding``).

Shards of stages differ in shapes, while ``shard_map`` wants one array shape on every device. So
each shard's slice of the :class:`~pipejax.core.state.PipelineState` is flattened into 1-D buffers
padded to the largest shard's and stacked along a leading ``stage`` dimension, in two families:
``shared`` buffers (the same on every data replica: weights, optimizer states, flags) and ``local``
ones (everything with a micro-batch axis, split over the replicas). :class:`Packing` is the plan:
which buffer and offset every leaf of every shard gets, and what the buffers cost.

A shard's stages are held stage by stage, but for the delay lines of a stacked part
(:func:`pipejax.core.parts.cut_parts`): those lie end to end, as
:class:`~pipejax.core.parts.Rings`, like a stacked part's on one device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.core import accounting, parts
from pipejax.core.checks import PipelineError
from pipejax.core.state import DelayLine, Packet, PipelineState, StageState

PyTree = Any
SHARED, LOCAL = "shared", "local"
BufferKey = tuple[str, str, str]  # (family, dtype, buffer name)


@dataclasses.dataclass(frozen=True)
class _Role:
  """How a state leaf is distributed: its micro-batch axis (None: same on every replica)."""

  batch_axis: int | None
  cotangent: bool = False  # a replica holds data x the whole-micro-batch value
  ring: bool = False  # a delay line: a tick writes one slot (its leading axis) and keeps the rest
  rings: parts.Rings | None = None  # a stacked part's lines end to end: one slot per stage a tick


def _roles(st: StageState) -> StageState:
  """A StageState-shaped tree of :class:`_Role` leaves."""
  every = lambda tree, role: jax.tree.map(lambda _: role, tree)
  shared, line, ring = _Role(None), st.delay_line, _Role(None, ring=True)
  packet = st.forward_out
  return StageState(
      params=every(st.params, shared),
      opt_state=every(st.opt_state, shared),
      delay_line=DelayLine(every(line.x, _Role(1, ring=True)), every(line.valid, ring),
                           every(line.index, ring), every(line.weights, ring),
                           every(line.variables, ring)),
      forward_out=None if packet is None else Packet(
          every(packet.x, _Role(0)), every(packet.labels, _Role(0)), every(packet.valid, shared),
          every(packet.index, shared)),
      backward_out=every(st.backward_out, _Role(0, cotangent=True)),
      variables=every(st.variables, shared))


def split_registers(stages: Sequence[StageState]):
  """(stages, outgoing forward packet, outgoing cotangent): the two registers that leave a shard
  of stage states taken out of it."""
  stages = list(stages)
  outgoing_packet, outgoing_cotangent = stages[-1].forward_out, stages[0].backward_out
  stages[-1] = stages[-1]._replace(forward_out=None)
  stages[0] = stages[0]._replace(backward_out=None)
  return tuple(stages), outgoing_packet, outgoing_cotangent


def join_registers(stages, outgoing_packet, outgoing_cotangent) -> tuple[StageState, ...]:
  """:func:`split_registers` undone."""
  stages = list(stages)
  stages[-1] = stages[-1]._replace(forward_out=outgoing_packet)
  stages[0] = stages[0]._replace(backward_out=outgoing_cotangent)
  return tuple(stages)


def split_lines(stages: Sequence[StageState], shard: Sequence[parts.Part], join=None):
  """``(stages, stack_lines)``: each stacked part's delay lines taken out of its stages (left
  None) and laid end to end (``join(part, lines)``; default the part's :meth:`Rings.join`)."""
  join = join or (lambda part, lines: part.rings.join(lines))
  stages, stack_lines, first = list(stages), [], shard[0].start
  for part in shard:
    if part.stacked:
      own = range(part.start - first, part.stop - first)
      stack_lines.append(join(part, [stages[i].delay_line for i in own]))
      for i in own:
        stages[i] = stages[i]._replace(delay_line=None)
  return tuple(stages), tuple(stack_lines)


def join_lines(stages, stack_lines, shard: Sequence[parts.Part], line_treedefs):
  """:func:`split_lines` undone (``line_treedefs``: every stage's delay-line structure)."""
  stages, lines, first = list(stages), iter(stack_lines), shard[0].start
  for part in shard:
    if part.stacked:
      cut = part.rings.cut(next(lines), line_treedefs[part.start - first:part.stop - first])
      for i, line in enumerate(cut, start=part.start - first):
        stages[i] = stages[i]._replace(delay_line=line)
  return tuple(stages)


def split_shard(stages: Sequence[StageState], shard: Sequence[parts.Part], join=None):
  """(body, outgoing forward packet, outgoing cotangent) of a shard of stage states, the body
  ``(stages, stack_lines)`` of :func:`split_lines`."""
  stages, packet, cotangent = split_registers(stages)
  return split_lines(stages, shard, join), packet, cotangent


@dataclasses.dataclass(frozen=True)
class _Slot:
  """Where one leaf lives: its buffer, offset and size in it, and its per-device shape."""

  key: tuple[str, str, str]  # (family, dtype, buffer name): one packed buffer
  offset: int
  size: int
  shape: tuple[int, ...]
  role: _Role


@dataclasses.dataclass(frozen=True)
class _Placement:
  treedef: Any
  slots: tuple[_Slot, ...]

  def sizes(self) -> dict[tuple[str, str, str], int]:
    out = {}
    for slot in self.slots:
      out[slot.key] = out.get(slot.key, 0) + slot.size
    return out


def _placement(spec_tree, role_tree, data: int, base: dict,
               slot_prefix: str | None = None) -> _Placement:
  """Assigns each leaf of ``spec_tree`` a buffer and an offset in it.

  With ``slot_prefix`` None ("flat"), leaves follow one another in one buffer per (family, dtype),
  starting at ``base[key]``. Otherwise ("per_leaf") each leaf gets a buffer of its own at offset 0:
  the i-th largest leaf of each (family, dtype) goes to buffer ``f"{slot_prefix}{i}"``, so across
  puts large leaves in buffers with large ones and the padding stays small. Delay lines go to
  buffers of their own, ``f"ring{i}"``, so that a mesh tick can write the one slot it changes
  (see :attr:`Packing.ring_widths`).
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
    kinds = [f + (role.ring,) for f, role in zip(families, roles)]
    for kind in set(kinds):
      members = [i for i, k in enumerate(kinds) if k == kind]
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
      prefix = "ring" if role.ring else slot_prefix
      key, offset = families[i] + (f"{prefix}{rank[i]}",), 0
    slots.append(_Slot(key, offset, size, shape, role))
  return _Placement(treedef, tuple(slots))


def _cut(buffer, start: int, size: int, shape):
  if start == 0 and size == buffer.size:  # a whole buffer: a reshape, which XLA aliases
    return buffer.reshape(shape)
  return jax.lax.slice_in_dim(buffer.reshape(-1), start, start + size).reshape(shape)


def read_tree(buffers, placement: _Placement, shift: dict | None = None):
  """The tree ``placement`` describes, cut from ``buffers`` (whose offset 0 is ``shift[key]``)."""
  shift = shift or {}
  leaves = [_cut(buffers[s.key], s.offset - shift.get(s.key, 0), s.size, s.shape)
            for s in placement.slots]
  return placement.treedef.unflatten(leaves)


def write_tree(buffers, placement: _Placement, tree, skip=()):
  """Writes ``tree``'s leaves in place (``dynamic_update_slice``, never a concatenation).

  Leaves in the buffers ``skip`` are left out (delay lines: see :func:`ring_windows`).
  """
  buffers = dict(buffers)
  for slot, leaf in zip(placement.slots, placement.treedef.flatten_up_to(tree)):
    if slot.key in skip:
      continue
    if jnp.dtype(leaf.dtype).name != slot.key[1] or tuple(leaf.shape) != slot.shape:
      raise PipelineError(f"A stage's state changed from {slot.shape} {slot.key[1]} to "
                          f"{tuple(leaf.shape)} {jnp.dtype(leaf.dtype).name} in one tick; the "
                          "engine and optimizers must keep every state leaf's shape and dtype.")
    buffer = buffers[slot.key]
    if slot.offset == 0 and slot.size == buffer.size:
      buffers[slot.key] = leaf.reshape(buffer.shape)
    else:
      buffers[slot.key] = jax.lax.dynamic_update_slice(buffer, leaf.reshape(-1), (slot.offset,))
  return buffers


def ring_windows(buffers, placement: _Placement, tree, tick, plan: Packing):
  """What one tick writes into each delay-line buffer: ``{key: [(window, start), ...]}``, one
  window per stage whose line lies there, written in order (:func:`write_windows`).

  ``tree`` holds, in place of each delay line, the entry the tick writes into it
  (``pipejax.core.parts.advance_parts`` with ``TickOptions(delay_line_entries=True)``): a single
  stage's goes to slot ``tick mod slots`` (:meth:`pipejax.core.state.DelayLine.write`), a
  stacked part's to one slot per stage (:meth:`pipejax.core.parts.Rings.write`). In a 1-D buffer
  each window has ``plan.ring_widths[key]`` elements: the entry, then the buffer's own elements up
  to the window's width (a shard whose slots are narrower than another's keeps what follows as it
  was, and a stage's window written after it rewrites its own slot). A buffer carried in its
  leaf's own shape (``Packing.carry_shapes``) gets the entries themselves, and ``start`` is the
  slot's index. Every shard gives ``plan.ring_rows[key]`` windows: a shard with fewer stages there
  first rewrites the buffer's first window as it was, as does one that holds none of its delay
  lines.
  """
  windows = {}
  for slot, leaf in zip(placement.slots, placement.treedef.flatten_up_to(tree)):
    if slot.key in plan.ring_widths:
      windows[slot.key] = _windows(buffers[slot.key], slot, leaf, tick,
                                   plan.ring_widths[slot.key])
  for key, rows in plan.ring_rows.items():
    own = windows.get(key, [])
    if len(own) < rows:
      buffer = buffers[key]
      kept = (buffer[0] if buffer.ndim > 1
              else jax.lax.slice_in_dim(buffer, 0, plan.ring_widths[key]))
      windows[key] = [(kept, jnp.zeros((), jnp.int32))] * (rows - len(own)) + own
  return windows


def _windows(buffer, slot: _Slot, entries, tick, width: int) -> list:
  """The ``(window, start)`` of each entry a tick writes into ``slot``'s line (or rings)."""
  if slot.role.rings is None:  # a single stage's line
    rows, starts = [entries], [tick % slot.shape[0]]
  else:
    rings = slot.role.rings
    rows = [entries[i] for i in range(len(rings.offsets))]
    starts = [offset + tick % length for offset, length in zip(rings.offsets, rings.lengths)]
  if buffer.ndim > 1:
    return list(zip(rows, starts))
  size = slot.size // slot.shape[0]
  windows = []
  for row, index in zip(rows, starts):
    start = slot.offset + index * size
    row = row.reshape(-1)
    if width > size:
      row = jnp.concatenate([row, jax.lax.dynamic_slice_in_dim(buffer, start + size, width - size)])
    windows.append((row, start))
  return windows


def write_windows(buffers, windows):
  """Writes :func:`ring_windows`' windows in place, in order."""
  buffers = dict(buffers)
  for key, pairs in windows.items():
    buffer = buffers[key]
    for window, start in pairs:
      if buffer.ndim > 1:
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, window, start, 0)
      else:
        buffer = jax.lax.dynamic_update_slice_in_dim(buffer, window, start, 0)
    buffers[key] = buffer
  return buffers


def buffer_name(key) -> str:
  """``'float32'`` (flat) or ``'float32/body3'`` (slots): the key in PackedState's dicts."""
  return key[1] if not key[2] else f"{key[1]}/{key[2]}"


class PackedState(NamedTuple):
  """A :class:`~pipejax.core.state.PipelineState` laid out over a ``('data', 'stage')`` mesh.

  ``shared[name]`` has global shape ``(stage, n)`` (sharded over ``stage``, replicated over
  ``data``); ``local[name]`` has global shape ``(data, stage, n)``. Names are the dtype
  (``'float32'``) in the flat packing, dtype and slot (``'float32/body3'``) in the per-leaf packing.
  ``tick`` and ``rng`` are replicated. Use :meth:`ShardedPipeline.to_logical` for the logical state.
  """

  shared: dict[str, jax.Array]
  local: dict[str, jax.Array]
  tick: jax.Array
  rng: jax.Array


@dataclasses.dataclass(frozen=True)
class Packing:
  """Where every state leaf of every shard lives in the packed buffers, and what they cost.

  Built by :meth:`plan`. ``body_placements[d]``, ``packet_placements[d]`` and
  ``cotangent_placements[d]`` place shard d's stage states without the two registers that leave the
  shard, its outgoing forward packet and its outgoing cotangent. Those sit in ``packet_region`` and
  ``cotangent_region`` (``{buffer: (start, stop)}``), at the same place on every device, so every
  device cuts its outgoing message the same way. ``buffer_sizes`` gives the elements of each
  buffer on one device.
  """

  abstract_state: PipelineState  # ShapeDtypeStructs of the logical state
  partition: tuple[tuple[int, int], ...]
  num_replicas: int
  policy: str  # "per_leaf" (a buffer per leaf) or "flat" (a buffer per dtype)
  body_placements: tuple[_Placement, ...]
  packet_placements: tuple[_Placement, ...]
  cotangent_placements: tuple[_Placement, ...]
  packet_region: dict[BufferKey, tuple[int, int]]
  cotangent_region: dict[BufferKey, tuple[int, int]]
  buffer_sizes: dict[BufferKey, int]
  # Delay-line buffers (per-leaf policy) and the width of the window a tick writes into each: the
  # largest slot any shard keeps there. A shard with smaller slots rewrites the elements after
  # its slot as they were; the buffer is padded so that a window never runs past its end.
  ring_widths: dict[BufferKey, int] = dataclasses.field(default_factory=dict)
  # The rows a tick writes into each delay-line buffer: the most stages whose lines any shard
  # keeps there (a stacked part's lie end to end in one).
  ring_rows: dict[BufferKey, int] = dataclasses.field(default_factory=dict)
  # Each shard's parts (pipejax.core.parts.cut_parts): its stacked parts' lines lie end to end.
  shard_parts: tuple[tuple[parts.Part, ...], ...] = ()

  @classmethod
  def plan(cls, abstract_state: PipelineState, partition: Sequence[tuple[int, int]],
           num_replicas: int, policy: str = "auto",
           shard_parts: Sequence[Sequence[parts.Part]] | None = None) -> Packing:
    """The packing of ``policy``: ``'per_leaf'``, ``'flat'`` or ``'auto'`` (per-leaf unless their
    padding costs over 25% more memory than flat's). ``shard_parts``: each shard's parts
    (default: every stage a part of its own)."""
    if shard_parts is None:
      shard_parts = [parts.single_stages(a, z) for a, z in partition]
    shard_parts = tuple(tuple(p) for p in shard_parts)
    shards = [abstract_state.stages[a:z] for a, z in partition]
    abstract_join = lambda part, lines: jax.eval_shape(part.rings.join, lines)
    role_join = lambda part, lines: jax.tree.map(
        lambda role: dataclasses.replace(role, rings=part.rings), lines[0])
    split = [split_shard(g, p, abstract_join) for g, p in zip(shards, shard_parts)]
    role_split = [split_shard([_roles(st) for st in g], p, role_join)
                  for g, p in zip(shards, shard_parts)]

    def plan_of(policy):
      def region(index, base):
        prefix = None if policy == "flat" else ("body", "packet", "cotangent")[index]
        placements = [_placement(p[index], r[index], num_replicas, base, prefix)
                      for p, r in zip(split, role_split)]
        end = dict(base)
        for placement in placements:
          for key, size in placement.sizes().items():
            end[key] = max(end.get(key, 0), base.get(key, 0) + size)
        return tuple(placements), end

      # Flat: the outgoing packet at [0, F) of each buffer, the outgoing cotangent at [F, F + C),
      # the rest after. Slots: buffers of their own. Either way, the same on every device.
      packet_placements, packet_end = region(1, {})
      cotangent_placements, cotangent_end = region(2, packet_end)
      body_placements, body_end = region(0, cotangent_end)
      windows, before_last_slot, rows = {}, {}, {}
      for slot in (s for placement in body_placements for s in placement.slots):
        if policy != "flat" and slot.role.ring:
          stages = len(slot.role.rings.offsets) if slot.role.rings else 1
          rows[slot.key] = max(rows.get(slot.key, 0), stages)
          row = slot.size // slot.shape[0]
          windows[slot.key] = max(windows.get(slot.key, 0), row)
          before_last_slot[slot.key] = max(before_last_slot.get(slot.key, 0), slot.size - row)
      for key, width in windows.items():
        body_end[key] = max(body_end[key], before_last_slot[key] + width)
      return cls(abstract_state, tuple(partition), num_replicas, policy, body_placements,
                 packet_placements, cotangent_placements,
                 {k: (0, v) for k, v in packet_end.items() if v > 0},
                 {k: (packet_end.get(k, 0), v) for k, v in cotangent_end.items()
                  if v > packet_end.get(k, 0)},
                 {k: v for k, v in body_end.items() if v > 0}, windows, rows, shard_parts)

    if policy != "auto":
      return plan_of(policy)
    # Buffers of their own let XLA update weights and delay lines in place (one flat buffer per
    # dtype makes it copy the whole buffer every tick), but pair leaves of different sizes across
    # shards; fall back to flat when that padding would cost over a quarter more memory.
    per_leaf, flat = plan_of("per_leaf"), plan_of("flat")
    return flat if per_leaf.allocated_bytes() > 1.25 * flat.allocated_bytes() else per_leaf

  @staticmethod
  def region_bytes(sizes: dict[BufferKey, int | tuple[int, int]]) -> int:
    """Bytes of buffers or regions given as ``{key: elements}`` or ``{key: (start, stop)}``."""
    total = 0
    for key, size in sizes.items():
      count = size[1] - size[0] if isinstance(size, tuple) else size
      total += count * np.dtype(key[1]).itemsize
    return total

  def allocated_bytes(self) -> int:
    """Bytes of the padded buffers every device holds."""
    return self.region_bytes(self.buffer_sizes)

  def message_bytes(self) -> int:
    """Bytes of the two boundary messages a device sends per tick (each padded to the largest)."""
    return self.region_bytes(self.packet_region) + self.region_bytes(self.cotangent_region)

  def carry_shapes(self) -> dict[BufferKey, tuple[int, ...]]:
    """The buffers that hold one whole leaf of the same shape on every device, and that shape.

    A tick can carry those in the leaf's own shape instead of 1-D: then no update ends in a
    reshape, which XLA would fuse into (duplicating the momentum update into the weight update's
    fusion, so that the old momentum and weights had to be copied every tick).
    """
    shapes: dict[BufferKey, set] = {}
    for placements in (self.body_placements, self.packet_placements, self.cotangent_placements):
      for placement in placements:
        for slot in placement.slots:
          whole = slot.offset == 0 and slot.size == self.buffer_sizes[slot.key]
          shapes.setdefault(slot.key, set()).add(slot.shape if whole else None)
    return {key: next(iter(found)) for key, found in shapes.items()
            if len(found) == 1 and None not in found}

  @staticmethod
  def roles(st: StageState) -> StageState:
    """A StageState-shaped tree saying how each leaf is distributed over data replicas."""
    return _roles(st)

  def replica_bytes(self, tree: PyTree, role_tree: PyTree) -> int:
    """Bytes of ``tree`` one data replica holds (a micro-batch axis is split over them)."""
    total = 0
    for leaf, role in zip(jax.tree.leaves(tree), jax.tree.leaves(role_tree)):
      n = accounting.tree_bytes(leaf)
      total += n // self.num_replicas if role.batch_axis is not None else n
    return total

  # ------------------------------------------------------------------ what a mesh holds and sends

  def boundary_bytes_per_tick(self) -> dict[str, int]:
    """Bytes that cross device boundaries in one tick, over the whole mesh.

    Returns a dict:

    * ``forward``: packets (activations, labels, valid flag, sample index) from each shard's last
      stage to the next shard, summed over the boundaries and the data replicas;
    * ``backward``: cotangents from each shard's first stage to the previous shard;
    * ``gradient_all_reduce``: the data axis's gradient averaging, ``2 (data - 1) |g_s|`` summed
      over the stages (what a ring all-reduce sends in total; 0 without a data axis);
    * ``total``: the sum of the three;
    * ``forward_padded`` / ``backward_padded``: what ``ppermute`` actually sends, each message
      padded to the largest shard's register.
    """
    state, data = self.abstract_state, self.num_replicas
    forward = backward = 0
    for a, _ in self.partition[1:]:
      sender, receiver = state.stages[a - 1], state.stages[a]
      forward += data * self.replica_bytes(sender.forward_out, self.roles(sender).forward_out)
      backward += accounting.tree_bytes(receiver.backward_out)
    all_reduce = sum(2 * (data - 1) * accounting.tree_bytes(st.params) for st in state.stages)
    messages = (len(self.partition) - 1) * data
    return {
        "forward": forward,
        "backward": backward,
        "gradient_all_reduce": all_reduce,
        "total": forward + backward + all_reduce,
        "forward_padded": messages * self.region_bytes(self.packet_region),
        "backward_padded": messages * self.region_bytes(self.cotangent_region),
    }

  def device_memory(self) -> list[dict[str, Any]]:
    """Bytes each stage-axis device holds (the same on every data replica of it).

    Per device: ``stages`` (its ``(start, stop)``), ``weights``, ``optimizer``, ``delay_lines``
    (stashed inputs with their flags), ``weight_stash`` (PipeDream's weight copies), ``variables``
    (stateful stages' variables, live and stashed with the inputs), ``registers``
    (forward packets and cotangents), their sum ``logical``, ``allocated`` (the padded buffers
    every device actually holds) and ``messages`` (the two transient boundary buffers of a tick).
    Activations count the device's own ``b / data`` samples.
    """
    tree_bytes = accounting.tree_bytes
    report = []
    for a, z in self.partition:
      row = {"stages": (a, z), "weights": 0, "optimizer": 0, "delay_lines": 0, "weight_stash": 0,
             "variables": 0, "registers": 0}
      for st in self.abstract_state.stages[a:z]:
        roles = self.roles(st)
        line, line_roles = st.delay_line, roles.delay_line
        row["weights"] += tree_bytes(st.params)
        row["optimizer"] += tree_bytes(st.opt_state)
        row["delay_lines"] += self.replica_bytes(
            (line.x, line.valid, line.index), (line_roles.x, line_roles.valid, line_roles.index))
        row["weight_stash"] += tree_bytes(line.weights)
        row["variables"] += tree_bytes((st.variables, line.variables))
        row["registers"] += self.replica_bytes((st.forward_out, st.backward_out),
                                               (roles.forward_out, roles.backward_out))
      row["logical"] = sum(row[k] for k in ("weights", "optimizer", "delay_lines", "weight_stash",
                                            "variables", "registers"))
      row["allocated"] = self.allocated_bytes()
      row["messages"] = self.message_bytes()
      report.append(row)
    return report
