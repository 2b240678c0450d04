"""The one tick over parts: its options, the two forms of a stack's delay lines, routing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipejax import methods
from pipejax.core import parts
from pipejax.core.engine import Pipeline
from pipejax.core.parts import Part, Rings, TickOptions
from pipejax.core.state import DelayLine, Packet
from pipejax.parallel import stacking
from tests.helpers import dense_model, make_model, make_stream

LR = 0.05
EVEN = (5, 5, 5, 5)  # stages 1..3 identical


def test_the_ticks_options_are_one_frozen_hashable_object():
  options = TickOptions(every_slot_full=True)
  assert hash(options) == hash(TickOptions(every_slot_full=True))
  with pytest.raises(dataclasses.FrozenInstanceError):
    options.every_slot_full = False  # pytype: disable=not-writable


def test_rings_lie_end_to_end_in_stage_order():
  rings = Rings.of([6, 4, 2])
  assert rings.lengths == (7, 5, 3)
  assert rings.offsets == (0, 7, 12)
  assert rings.slots == 15


@pytest.mark.parametrize("tick", [0, 1, 4, 11, 35])
def test_rings_read_and_write_the_slots_of_per_stage_lines(tick):
  # The oracle: each stage's own ring, slot t mod L written and slot (t + 1) mod L read.
  delays = [4, 2, 0]
  rings = Rings.of(delays)
  rng = np.random.default_rng(tick)
  own = [rng.normal(size=(d + 1, 3)).astype(np.float32) for d in delays]
  line = DelayLine(jnp.concatenate(own), jnp.ones((rings.slots,), bool),
                   jnp.arange(rings.slots, dtype=jnp.int32), None)
  oldest = rings.read(line, jnp.int32(tick))
  for i, ring in enumerate(own):
    np.testing.assert_array_equal(oldest.x[i], ring[(tick + 1) % len(ring)])
  entries = DelayLine(jnp.asarray(rng.normal(size=(3, 3)), jnp.float32), jnp.zeros((3,), bool),
                      jnp.full((3,), -7, jnp.int32), None)
  written = rings.write(line, jnp.int32(tick), entries)
  expected = [ring.copy() for ring in own]
  for i, ring in enumerate(expected):
    ring[tick % len(ring)] = np.asarray(entries.x[i])
  np.testing.assert_array_equal(written.x, np.concatenate(expected))
  assert int((~np.asarray(written.valid)).sum()) == 3


def test_delay_line_entries_returns_the_entry_that_writes_the_same_line():
  x, y = make_stream(2, 2)
  pipe = Pipeline(make_model(), methods.make_method("pb", learning_rate=LR), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0))
  inbound = Packet(x[0], y[0], jnp.array(True), state.tick)
  cotangent = state.stages[1].backward_out  # what stage 1 sent back last tick
  advance = lambda options: parts.advance_parts(
      pipe.maths, pipe.delays, [Part(0, 1)], state.stages[:1], inbound, cotangent, state.tick,
      state.rng, options)[0][0]
  written = advance(TickOptions())
  entry = advance(TickOptions(delay_line_entries=True))
  line = state.stages[0].delay_line.write(state.tick, entry.delay_line)
  jax.tree.map(np.testing.assert_array_equal, line, written.delay_line)


def _ticks(pipe, state, x, y, advance):
  for t in range(len(x)):
    inbound = Packet(x[t], y[t], jnp.array(True), state.tick)
    state = advance(state, inbound)
  return state


@pytest.mark.parametrize("method", ["pb", "pipedream"])
def test_a_stacks_entries_write_the_rings_its_tick_writes(method):
  # What a mesh writes after its switch (TickOptions.delay_line_entries) is one row per stage,
  # which Rings.write lays into the rings as the tick itself does; PipeDream's rows also stash
  # weights. Seven ticks pass every ring's length.
  x, y = make_stream(7, 2)
  pipe = Pipeline(dense_model(EVEN), methods.make_method(method, learning_rate=LR), x[0], y[0])
  stacked = pipe.restacked()
  assert stacked.part_spans == ((0, 1), (1, 4), (4, 5))
  stack = stacked.parts[1]
  tick = jax.jit(stacked._tick)
  state = stacked.init(jax.random.PRNGKey(3))
  for t in range(len(x)):
    inbound = Packet(x[t], y[t], jnp.array(True), state.tick)
    advance = lambda options: parts.advance_parts(
        pipe.maths, pipe.delays, stacked.parts, state.parts, inbound, None, state.tick, state.rng,
        options)[0][1]
    entries = advance(TickOptions(delay_line_entries=True)).delay_line
    assert jax.tree.leaves(entries)[0].shape[0] == stack.stop - stack.start
    written = stack.rings.write(state.parts[1].delay_line, state.tick, entries)
    state = tick(state, stacking.Batch(x[t], y[t], jnp.array(True)))[0]
    jax.tree.map(np.testing.assert_array_equal, written, state.parts[1].delay_line)


def test_each_stage_takes_its_neighbours_registers():
  # Routing: stage s's inbound is stage s-1's forward_out, its cotangent stage s+1's
  # backward_out, both as the previous tick left them (a stack's rows shift the same way; the
  # stacked runners' equality with this one is tests/parallel/test_stacking.py's).
  seen = {}

  class Recording:
    def __init__(self, pipe):
      self.pipe = pipe

    def forward_step(self, s, st, inbound, rng, number=None, delay=None):
      seen["in", s] = int(inbound.index)
      return self.pipe.forward_step(s, st, inbound, rng, number, delay)

    def backward_step(self, s, st, forward, oldest, inbound, cotangent, rng, number=None,
                      delay=None, options=TickOptions()):
      seen["cot", s] = None if cotangent is None else float(np.ravel(cotangent)[0])
      return self.pipe.backward_step(s, st, forward, oldest, inbound, cotangent, rng, number,
                                     delay, options)

  x, y = make_stream(1, 2)
  pipe = Pipeline(dense_model(EVEN), methods.make_method("pb", learning_rate=LR), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0))
  marked = [st._replace(
      forward_out=None if st.forward_out is None else st.forward_out._replace(
          index=jnp.int32(100 + s)),
      backward_out=None if st.backward_out is None else jnp.full(
          st.backward_out.shape, 200 + s, st.backward_out.dtype))
      for s, st in enumerate(state.stages)]
  inbound = Packet(x[0], y[0], jnp.array(True), jnp.int32(7))
  parts.advance_parts(Recording(pipe.maths), pipe.delays, parts.single_stages(0, 5), marked,
                      inbound, None, state.tick, state.rng)
  assert [seen["in", s] for s in range(5)] == [7, 100, 101, 102, 103]
  assert [seen["cot", s] for s in range(5)] == [201.0, 202.0, 203.0, 204.0, None]


def test_rings_join_each_stages_line_end_to_end_and_cut_them_back():
  rings = Rings.of([3, 1])
  own = [DelayLine(np.full((4, 2), 1.0, np.float32), np.ones((4,), bool), np.arange(4), None),
         DelayLine(np.full((2, 2), 2.0, np.float32), np.zeros((2,), bool), np.arange(2), None)]
  joined = rings.join(own)
  assert isinstance(joined.x, np.ndarray)  # host leaves stay on the host
  np.testing.assert_array_equal(joined.x, np.concatenate([own[0].x, own[1].x]))
  assert joined.x.shape[0] == rings.slots
  cut = rings.cut(joined, [jax.tree.structure(line) for line in own])
  jax.tree.map(np.testing.assert_array_equal, cut, tuple(own))
  on_device = rings.join([jax.tree.map(jnp.asarray, line) for line in own])
  assert isinstance(on_device.x, jax.Array)
