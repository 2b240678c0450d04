"""The pipeline's state: the registers between stages, and each stage's delay line.

One pytree of named tuples (docs/design.md §6), so ``lax.scan`` carries it and a checkpoint
saves it as it is. :mod:`pipejax.core.engine` advances it a tick at a time.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.core.stages import Variables

PyTree = Any


class Packet(NamedTuple):
  """A micro-batch in flight between stages: activations and what travels with them."""

  x: PyTree
  labels: PyTree
  valid: jax.Array  # bool[]: False for the empty slots of fill, drain and synchronous bubbles.
  index: jax.Array  # int32[]: tick at which the sample entered; seeds its per-stage randomness.


class DelayLine(NamedTuple):
  """A ring buffer of the D_s + 1 inputs (and, for PipeDream, weights) a stage holds in flight.

  Slot ``t mod (D_s + 1)`` is written at tick t and read back D_s ticks later, as slot
  ``(t + 1) mod (D_s + 1)`` of tick t + D_s (the same slot when D_s = 0).
  """

  x: PyTree  # leaves of shape (D_s + 1, b, ...)
  valid: jax.Array  # (D_s + 1,) bool
  index: jax.Array  # (D_s + 1,) int32
  weights: PyTree  # (D_s + 1, ...) weight copies for weight stashing, else None
  variables: PyTree = None  # (D_s + 1, ...) the forward variables each forward saw; None: stateless

  @property
  def slots(self) -> int:
    return self.valid.shape[0]

  def entry(self, packet: Packet, weights: PyTree = None, variables: PyTree = None) -> DelayLine:
    """What one tick stores: the packet's input, flag and index, and the weights and variables
    its forward used where this line keeps them, as single leaves (no slot axis)."""
    as_stored = lambda line, value: None if line is None else jax.tree.map(
        lambda b, a: jnp.asarray(a, b.dtype), line, value)
    return DelayLine(as_stored(self.x, packet.x), as_stored(self.valid, packet.valid),
                     as_stored(self.index, packet.index), as_stored(self.weights, weights),
                     as_stored(self.variables, variables))

  def write(self, tick, entry: DelayLine) -> DelayLine:
    """Stores ``entry`` in slot ``tick mod (D_s + 1)``.

    ``dynamic_update_index_in_dim`` writes the slot in place; ``.at[slot].set`` would compile to a
    scatter that also reads the old slot (to guard against an out-of-range index).
    """
    slot = tick % self.slots
    return jax.tree.map(lambda b, a: jax.lax.dynamic_update_index_in_dim(b, a, slot, 0),
                        self, entry)

  def read(self, tick, entry: DelayLine) -> DelayLine:
    """The entry written D_s ticks before ``tick``, when this tick writes ``entry``.

    It is read from the line as it is before this tick's write (slot ``(t + 1) mod (D_s + 1)`` is
    not the slot written; with D_s = 0 the entry read is ``entry`` itself), so no read depends on
    the write. On a mesh, a stage's code runs inside a ``lax.switch`` whose results XLA cannot
    write into its operands; there the switch returns only the entry and the line is written
    after it (``pipejax.parallel.sharding``).
    """
    if self.slots == 1:
      return entry
    slot = (tick + 1) % self.slots
    return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, slot, 0, keepdims=False), self)


class StageState(NamedTuple):
  params: PyTree
  opt_state: PyTree
  delay_line: DelayLine
  forward_out: Packet | None  # what this stage forwarded last tick (None for the last stage)
  backward_out: PyTree | None  # d loss / d input from last tick (None for stage 0)
  variables: Variables | None = None  # the stage's non-trainable state (None: stateless)


class PipelineState(NamedTuple):
  """The logical state: one entry per stage, whatever layout a runner keeps it in."""

  stages: tuple[StageState, ...]
  tick: jax.Array  # int32: ticks done so far; the next micro-batch is sample number `tick`.
  rng: jax.Array  # uint32 key; per-sample, per-stage keys are folded from it.

  @property
  def parts(self) -> tuple[StageState, ...]:
    """Each part's state, as a tick reads it: here every stage is a part of its own."""
    return self.stages


class Batch(NamedTuple):
  """One tick's micro-batch (or, with a leading time axis, many ticks' worth)."""

  inputs: PyTree  # (b, ...) per tick
  labels: PyTree  # (b, ...) per tick
  valid: jax.Array  # bool per tick: False feeds an empty slot (drain, bubbles)


class Forward(NamedTuple):
  """What a stage's forward step gives the rest of its tick."""

  params: PyTree  # the weights the forward used
  out: Packet | None  # the packet for the next stage (None for the last stage)
  ok: jax.Array  # bool[]: the output is finite, or the slot is empty
  variables: PyTree  # the forward variables after this input (None: stateless or last stage)
  entry: DelayLine  # what the stage's delay line stores this tick (single leaves, no slot axis)


def slots_full(stage_states) -> bool:
  """Whether the delay lines and forward registers of ``stage_states`` (one stage's or a
  stacked part's each) hold only real micro-batches."""
  flags = [(st.delay_line.valid, st.forward_out.valid if st.forward_out is not None else True)
           for st in stage_states]
  return all(bool(np.all(v)) for v in jax.tree.leaves(jax.device_get(flags)))


def raw_key(rng) -> jax.Array:
  """The uint32 key a state keeps, from a raw key (``jax.random.PRNGKey``), a typed one
  (``jax.random.key``) or an int seed: the state's layout must not depend on which one a user
  has."""
  if isinstance(rng, (int, np.integer)):
    return jax.random.PRNGKey(rng)
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(rng)
  return rng
