"""ShardedPipeline against the single-device engine; partitions, accounting, errors; two processes.

The ``test_mesh_*`` tests need 8 devices: run the suite with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` to run them in this process. Without it they
skip here and :func:`test_mesh_checks_in_a_subprocess_with_eight_cpu_devices` runs them in a fresh
interpreter that has the flag (JAX reads it once, when its backend starts, so this process cannot
switch).
"""

import functools
import itertools
import os
import pathlib
import subprocess
import sys
import time

import flax.linen as nn
import jax
import numpy as np
import pytest

import pipejax
from pipejax.train import plan as plan_lib
from pipejax import methods
from pipejax.parallel import partition as partition_lib
from pipejax.models import online_norm
from pipejax.core.checks import PipelineError
from pipejax.core.engine import Pipeline
from pipejax.core.runner import Runner
from pipejax.parallel.mesh import MeshError, make_mesh
from pipejax.profiling import hlo
from pipejax.parallel.sharding import ShardedPipeline
from pipejax.parallel.stacking import StackedPipeline
from tests import _two_process_worker as worker
from tests import helpers
from tests.helpers import IN_DIM, NUM_CLASSES, dense_model, make_stream

ROOT = pathlib.Path(helpers.ROOT)
DEVICES = 8
MICRO_BATCH = 4
WIDTHS = (5, 7, 3, 9, 4, 6, 8, 5)  # 9 stages with the head: more than 8 devices, all shapes uneven
NUM_STAGES = len(WIDTHS) + 1
# From a fresh state: the fill, then every stage in steady state. Even: the mesh runs ticks in
# pairs, and an odd count compiles the tick a third time (the full-pipeline test's 9 ticks do).
NUM_TICKS = 3 * NUM_STAGES + 3
STREAM = (NUM_TICKS, MICRO_BATCH)  # make_stream's arguments for the runs compared
# One explicit partition per stage-only mesh size, with single-stage shards at the ends and in the
# middle; None takes the default (balanced by parameter count).
PARTITIONS = {2: None, 4: [(0, 1), (1, 5), (5, 6), (6, 9)], 8: None}


def make_stateful_model(widths=WIDTHS):
  """Online Norm (fast decays) in every other stage and the head; the rest stateless."""
  norm = lambda: online_norm.OnlineNorm(alpha_fwd=0.9, alpha_bkw=0.95)
  stages = [pipejax.from_flax(nn.Sequential([nn.Dense(w)] + [norm()] * (s % 2 == 0) + [nn.tanh]),
                              name=f"dense{w}") for s, w in enumerate(widths)]
  head = nn.Sequential([nn.Dense(NUM_CLASSES), norm()])
  return pipejax.Model(stages + [pipejax.from_flax(head, name="head")])


@functools.cache
def make_pipeline(method_name, b=MICRO_BATCH, widths=WIDTHS, stateful=False):
  x, y = make_stream(1, b)
  method = methods.make_method(method_name, learning_rate=0.05, momentum=0.9)
  model = make_stateful_model(widths) if stateful else dense_model(widths)
  return Pipeline(model, method, x[0], y[0])


def host(tree):
  return jax.tree.map(np.asarray, tree)


@functools.cache
def initial_state(method_name):
  # NaN in every empty slot: padding and exchanges must never let one reach weights or metrics.
  init = make_pipeline(method_name).init
  return host(init(jax.random.PRNGKey(42), np.float32(np.nan)))


@functools.cache
def single_device_run(method_name):
  """(final logical state, metrics) of the single-device engine: the reference."""
  pipe = make_pipeline(method_name)
  state, metrics = pipe.run(jax.tree.map(np.copy, initial_state(method_name)),
                            *make_stream(*STREAM))
  return host(state), host(metrics)


def assert_states_equal(actual, expected, rtol=1e-6, atol=1e-6):
  """Every leaf (weights, optimizer states, delay lines, registers, metrics) within tolerance."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
                               err_msg=jax.tree_util.keystr(path))


@pytest.fixture
def eight_devices():
  if jax.device_count() < DEVICES:
    pytest.skip(f"needs {DEVICES} devices (XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{DEVICES}); test_mesh_checks_in_a_subprocess_with_eight_cpu_devices runs it")
  return jax.devices()[:DEVICES]


# ----------------------------------------------------------------------------- partitions


def brute_force_best(costs, num_shards):
  best = float("inf")
  for cuts in itertools.combinations(range(1, len(costs)), num_shards - 1):
    bounds = (0,) + cuts + (len(costs),)
    best = min(best, max(sum(costs[a:z]) for a, z in zip(bounds, bounds[1:])))
  return best


@pytest.mark.parametrize("seed", range(6))
def test_partition_stages_is_optimal_against_brute_force(seed):
  rng = np.random.default_rng(seed)
  costs = [int(c) for c in rng.integers(0, 20, rng.integers(1, 10))]
  for num_shards in range(1, len(costs) + 1):
    partition = partition_lib.partition_stages(costs, num_shards)
    assert len(partition) == num_shards
    assert partition[0][0] == 0 and partition[-1][1] == len(costs)
    assert all(a < z for a, z in partition)
    assert all(z == a_next for (_, z), (a_next, _) in zip(partition, partition[1:]))
    assert max(sum(costs[a:z]) for a, z in partition) == brute_force_best(costs, num_shards)


def test_partition_stages_spreads_free_stages_and_reports_imbalance():
  assert partition_lib.partition_stages([0, 0, 0, 0], 2) == [(0, 2), (2, 4)]
  costs = [4, 1, 1, 1, 1]
  partition = partition_lib.partition_stages(costs, 2)
  assert partition == [(0, 1), (1, 5)]
  assert partition_lib.imbalance(costs, partition) == 1.0
  assert partition_lib.imbalance([3, 1], [(0, 1), (1, 2)]) == 1.5


def test_partition_errors_say_what_is_wrong():
  with pytest.raises(MeshError, match="Cannot split 3 stages into 4"):
    partition_lib.partition_stages([1, 2, 3], 4)
  with pytest.raises(MeshError, match="finite and >= 0"):
    partition_lib.partition_stages([1, -2, 3], 2)
  with pytest.raises(MeshError, match="has 1 shards but the mesh's stage axis has 2"):
    partition_lib.check_partition([(0, 3)], 3, 2)
  with pytest.raises(MeshError, match=r"not contiguous.*expected a shard starting at 1"):
    partition_lib.check_partition([(0, 1), (2, 3)], 3, 2)
  with pytest.raises(MeshError, match="not contiguous"):
    partition_lib.check_partition([(0, 2), (1, 3)], 3, 2)
  with pytest.raises(MeshError, match="non-empty"):
    partition_lib.check_partition([(0, 0), (0, 3)], 3, 2)
  with pytest.raises(MeshError, match=r"covers stages 0\.\.1 but the pipeline has 3 stages"):
    partition_lib.check_partition([(0, 1), (1, 2)], 3, 2)
  with pytest.raises(MeshError, match=r"list of \(start, stop\) pairs"):
    partition_lib.check_partition([0, 1], 3, 2)


def test_make_mesh_with_the_wrong_device_count_is_a_clear_error():
  with pytest.raises(MeshError, match=r"stage=2 x data=2 needs 4 devices, but there are 1"):
    make_mesh(2, 2, jax.devices()[:1])
  with pytest.raises(MeshError, match=r"XLA_FLAGS=--xla_force_host_platform_device_count=4 "):
    make_mesh(2, 2, jax.devices("cpu")[:1])
  with pytest.raises(MeshError, match="mesh.data must be an integer >= 1"):
    make_mesh(1, 0, jax.devices()[:1])


def test_one_device_mesh_is_the_single_device_engine():
  pipe = make_pipeline("pb")
  sharded = ShardedPipeline(pipe, make_mesh(1, 1, jax.devices()[:1]))
  # init is from_logical(pipeline.init): the same initial state as one device, NaN fill included.
  packed, metrics = sharded.run(sharded.init(jax.random.PRNGKey(42), np.nan),
                                *make_stream(*STREAM))
  expected_state, expected_metrics = single_device_run("pb")
  assert_states_equal(sharded.to_logical(packed), expected_state)
  assert_states_equal(metrics, expected_metrics)


def test_param_counts_and_measured_costs_drive_the_partition():
  pipe = make_pipeline("pb", widths=(5, 7, 3))
  inputs = (IN_DIM, 5, 7, 3)
  outputs = (5, 7, 3, NUM_CLASSES)
  assert partition_lib.param_counts(pipe) == [i * o + o for i, o in zip(inputs, outputs)]
  seconds = partition_lib.measure_stage_costs(pipe, repeats=1)
  assert len(seconds) == 4 and all(0 < t < 1 for t in seconds)
  with pytest.raises(MeshError, match="Got 2 stage costs for a pipeline of 4 stages"):
    ShardedPipeline(pipe, make_mesh(1, 1, jax.devices()[:1]), costs=[1.0, 2.0])


# ----------------------------------------------------------------------------- many devices


# Every mesh size and every kind of weights (current, predicted, stashed) at least once; one case
# packs with the 'flat' packing instead of the default 'per_leaf'. PB on two devices also runs in
# the tick-and-drain and the stacked-pieces tests below. The full cross product adds compilations
# and nothing the layout code does not already see here.
@pytest.mark.parametrize("method_name, stage, packing_policy", [
    ("pb", 4, "flat"), ("pb_sc_lwp", 2, "auto"), ("pb_sc_lwp", 8, "auto"),
    ("pipedream", 4, "auto")])
def test_mesh_stage_axis_matches_one_device(eight_devices, method_name, stage, packing_policy):
  pipe = make_pipeline(method_name)
  mesh = make_mesh(stage, 1, eight_devices[:stage])
  sharded = ShardedPipeline(pipe, mesh, partition=PARTITIONS[stage],
                            packing_policy=packing_policy)
  assert sharded.num_shards == stage < pipe.num_stages
  assert sharded.packing_policy == ("flat" if packing_policy == "flat" else "per_leaf")
  packed, metrics = sharded.run(sharded.from_logical(initial_state(method_name)),
                                *make_stream(*STREAM))
  expected_state, expected_metrics = single_device_run(method_name)
  assert_states_equal(sharded.to_logical(packed), expected_state)
  assert set(metrics) == set(expected_metrics)
  assert_states_equal(metrics, expected_metrics)
  assert np.asarray(metrics["valid"]).sum() >= 2 * NUM_STAGES  # many samples met the loss
  assert np.asarray(metrics["finite"]).all()  # NaN fill never reached an output


def test_mesh_with_stateful_stages_matches_one_device(eight_devices):
  """Online Norm's variables, live and stashed in the delay lines, live with their stage."""
  pipe = make_pipeline("pb_sc_lwp", stateful=True)
  sharded = ShardedPipeline(pipe, make_mesh(8, 1, eight_devices))
  state = host(pipe.init(jax.random.PRNGKey(42), np.float32(np.nan)))
  packed, metrics = sharded.run(sharded.from_logical(state), *make_stream(*STREAM))
  expected_state, expected_metrics = pipe.run(jax.tree.map(np.copy, state), *make_stream(*STREAM))
  actual = sharded.to_logical(packed)
  assert_states_equal(actual, host(expected_state))
  assert_states_equal(metrics, host(expected_metrics))
  assert np.asarray(metrics["finite"]).all()
  variables = [leaf for st in actual.stages for leaf in jax.tree.leaves(st.variables)]
  assert len(variables) == 4 * 5  # mean, var, u, v in stages 0, 2, 4, 6 and the head
  initial = [leaf for st in state.stages for leaf in jax.tree.leaves(st.variables)]
  assert min(np.abs(a - b).max() for a, b in zip(variables, initial)) > 1e-3  # they all moved
  assert sum(row["variables"] for row in sharded.packing.device_memory()) > 0
  with pytest.raises(MeshError, match=r"stage 0 \('dense5'\) keeps state.*data = 1"):
    ShardedPipeline(pipe, make_mesh(4, 2, eight_devices))


def test_mesh_tick_and_drain_match_one_device(eight_devices):
  pipe = make_pipeline("pb", widths=(5, 7, 3))
  sharded = ShardedPipeline(pipe, make_mesh(2, 1, eight_devices[:2]), costs=[1, 1, 1, 1])
  assert sharded.partition == [(0, 2), (2, 4)]
  x, y = make_stream(3, MICRO_BATCH)
  state = host(pipe.init(jax.random.PRNGKey(0)))
  before = sharded.from_logical(state)
  packed, tick_metrics = sharded.tick(before, x[0], y[0])
  # A tick donates nothing, on the mesh as on one device: the state passed in stays readable.
  assert_states_equal(sharded.to_logical(before), state)
  packed, drain_metrics = sharded.drain(packed)
  state, expected_tick = pipe.tick(jax.tree.map(np.copy, state), x[0], y[0])
  state, expected_drain = pipe.drain(state)
  assert_states_equal(sharded.to_logical(packed), host(state))
  assert_states_equal(tick_metrics, host(expected_tick))
  assert_states_equal(drain_metrics, host(expected_drain))
  assert np.asarray(drain_metrics["valid"]).sum() == 1  # the one sample has met the loss


def test_mesh_data_and_stage_axes_match_one_device_with_the_whole_micro_batch(eight_devices):
  pipe = make_pipeline("pb_sc_lwp")
  sharded = ShardedPipeline(pipe, make_mesh(4, 2, eight_devices))
  assert (sharded.num_replicas, sharded.num_shards) == (2, 4)
  packed, metrics = sharded.run(sharded.from_logical(initial_state("pb_sc_lwp")),
                                *make_stream(*STREAM))
  # Each replica saw half of every micro-batch; the averaged gradients are the whole batch's.
  expected_state, expected_metrics = single_device_run("pb_sc_lwp")
  assert_states_equal(sharded.to_logical(packed), expected_state)
  assert_states_equal(metrics, expected_metrics)


def test_mesh_full_pipeline_program_matches_one_device(eight_devices):
  """Once every slot is full, run() switches to the unguarded program, on a mesh as on one."""
  pipe = make_pipeline("pb_sc_lwp")
  sharded = ShardedPipeline(pipe, make_mesh(2, 2, eight_devices[:4]))
  assert not sharded.every_slot_full(sharded.from_logical(initial_state("pb_sc_lwp")))
  filled, _ = single_device_run("pb_sc_lwp")  # after the fill: every slot holds a sample
  packed = sharded.from_logical(filled)
  assert sharded.every_slot_full(packed) and pipe.every_slot_full(filled)
  stream = make_stream(NUM_STAGES, MICRO_BATCH, seed=1)
  packed, metrics = sharded.run(packed, *stream)
  expected_state, expected_metrics = pipe.run(jax.tree.map(np.copy, filled), *stream)
  assert_states_equal(sharded.to_logical(packed), host(expected_state))
  assert_states_equal(metrics, host(expected_metrics))
  assert np.asarray(metrics["valid"]).all()
  # Both runners compiled their full-pipeline program for this call (and only for it).
  assert sharded.programs[1]._cache_size() == 1 and pipe.programs[1]._cache_size() >= 1


@pytest.mark.parametrize("method_name", ["pb", "pipedream"])
def test_mesh_loop_copies_no_weights(eight_devices, method_name):
  """On two devices the compiled loop copies no weight- or momentum-sized buffer, nor a delay line.

  Carried through ``lax.switch`` and back into the loop's buffers, every weight and momentum was
  copied once per tick, and so was every delay line, PipeDream's weight stashes included (a stash
  holds D + 1 copies of a stage's weights). The loop now alternates between two sets of buffers
  for the weights and writes the one slot a tick changes into each delay line after the switch.
  The weight-sized leaves of this model are its 32x32 kernels and their momenta, the stashes are
  several of them; what copies XLA keeps (flags, indices, biases) are smaller.
  """
  width = 32
  pipe = make_pipeline(method_name, b=1, widths=(width,) * 3)  # 6->32, 32->32 | 32->32, 32->4
  sharded = ShardedPipeline(pipe, make_mesh(2, 1, eight_devices[:2]))
  assert sharded.partition == [(0, 2), (2, 4)]
  x, y = make_stream(4, b=1)
  program = sharded.programs[1].lower(sharded.init(jax.random.PRNGKey(0)),
                                        sharded.placed_batch(x, y))
  sizes = [copy.elements for copy in hlo.unfused_copies(program.compile().as_text())]
  assert max(sizes, default=0) < width * width, sorted(sizes)[-8:]


@pytest.mark.parametrize("packing_policy", ["flat", "per_leaf"])
def test_mesh_pack_unpack_round_trip_and_buffer_placement(eight_devices, packing_policy):
  pipe = make_pipeline("pipedream")
  sharded = ShardedPipeline(pipe, make_mesh(4, 2, eight_devices),
                            packing_policy=packing_policy)
  state = initial_state("pipedream")
  packed = sharded.from_logical(state)
  # Bit-exact, NaN fill and the per-replica cotangent scaling included.
  for a, e in zip(jax.tree.leaves(sharded.to_logical(packed)), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), e)
  sizes = sharded.buffer_sizes()
  for dtype, buffer in packed.shared.items():
    assert buffer.shape == (4, sizes[f"shared/{dtype}"])
    assert buffer.sharding.spec == jax.sharding.PartitionSpec("stage")
  for dtype, buffer in packed.local.items():
    assert buffer.shape == (2, 4, sizes[f"local/{dtype}"])
    assert buffer.sharding.spec == jax.sharding.PartitionSpec("data", "stage")
  assert packed.tick.sharding.is_fully_replicated
  if packing_policy == "flat":  # one buffer per family and dtype
    assert set(packed.shared) == {"bool", "float32", "int32"}
    assert set(packed.local) == {"float32", "int32"}
  else:  # one per state leaf of the largest shard; delay lines in buffers of their own
    assert len(packed.shared) + len(packed.local) > 5
    plan = sharded.packing
    for placement, (a, z) in zip(plan.body_placements, sharded.partition):
      lines = jax.tree.leaves(tuple(st.delay_line for st in state.stages[a:z]))
      ring_slots = [slot for slot in placement.slots if slot.key in plan.ring_widths]
      assert len(ring_slots) == len(lines)  # every delay-line leaf, and nothing else
      assert all(slot.role.ring for slot in ring_slots)
      for slot in ring_slots:  # the window a tick writes never runs past the buffer
        row = slot.size // slot.shape[0]
        assert row <= plan.ring_widths[slot.key]
        assert slot.size - row + plan.ring_widths[slot.key] <= plan.buffer_sizes[slot.key]


def test_mesh_accounting_by_hand(eight_devices):
  pipe = make_pipeline("pb")
  partition = [(0, 2), (2, 5), (5, 7), (7, 9)]
  one = ShardedPipeline(pipe, make_mesh(4, 1, eight_devices[:4]), partition=partition)
  two = ShardedPipeline(pipe, make_mesh(4, 2, eight_devices), partition=partition)
  b, f32 = MICRO_BATCH, 4
  inputs = (IN_DIM,) + WIDTHS  # input width of each stage
  # A packet is activations + labels (int32) + valid flag (1 byte) + sample index (int32).
  forward = sum(b * inputs[a] * f32 + b * 4 + 1 + 4 for a, _ in partition[1:])
  backward = sum(b * inputs[a] * f32 for a, _ in partition[1:])
  traffic = one.packing.boundary_bytes_per_tick()
  assert (traffic["forward"], traffic["backward"], traffic["gradient_all_reduce"]) == (
      forward, backward, 0)
  assert traffic["forward_padded"] >= forward and traffic["backward_padded"] >= backward
  weight_bytes = sum(f32 * (i * o + o) for i, o in zip(inputs, WIDTHS + (NUM_CLASSES,)))
  traffic = two.packing.boundary_bytes_per_tick()
  assert traffic["forward"] == forward + 5 * (len(partition) - 1)  # flags travel on each replica
  assert traffic["backward"] == backward
  assert traffic["gradient_all_reduce"] == 2 * weight_bytes
  assert traffic["total"] == traffic["forward"] + traffic["backward"] + 2 * weight_bytes

  flags = sum(d + 1 for d in pipe.delays) * (1 + 4)  # valid + index per delay-line slot
  for sharded, data in ((one, 1), (two, 2)):
    memory = sharded.packing.device_memory()
    assert [row["stages"] for row in memory] == partition
    assert sum(row["weights"] for row in memory) == weight_bytes
    assert sum(row["optimizer"] for row in memory) == weight_bytes  # one momentum per weight
    assert sum(row["delay_lines"] for row in memory) == pipe.spec.stash_bytes() // data + flags
    assert all(row["weight_stash"] == 0 for row in memory)
    allocated = sum(n * np.dtype(k.split("/")[1]).itemsize
                    for k, n in sharded.buffer_sizes().items())
    assert all(row["allocated"] == allocated >= row["logical"] for row in memory)


def test_mesh_run_refuses_a_state_it_cannot_run(eight_devices):
  pipe = make_pipeline("pb")
  sharded = ShardedPipeline(pipe, make_mesh(2, 1, eight_devices[:2]))
  other = ShardedPipeline(pipe, make_mesh(4, 1, eight_devices[:4]))
  # The stream of test_mesh_stage_axis_matches_one_device[pb-2-auto]: the run compiles nothing new.
  x, y = make_stream(*STREAM)
  key = jax.random.PRNGKey(0)
  with pytest.raises(PipelineError, match=r"logical PipelineState.*sharded.from_logical\(state\)"):
    sharded.run(pipe.init(key), x, y)
  with pytest.raises(PipelineError, match="does not belong to this sharded pipeline"):
    sharded.run(other.init(key), x, y)
  with pytest.raises(PipelineError, match="does not belong to this pipeline"):
    sharded.from_logical(make_pipeline("pb", widths=(6, 7, 3, 9, 4, 6, 8, 5)).init(key))
  state = sharded.init(key)
  sharded.run(state, x, y)
  with pytest.raises(PipelineError, match="donated to an earlier run"):
    sharded.run(state, x, y)


def test_mesh_errors_say_how_to_fix_them(eight_devices):
  with pytest.raises(MeshError, match=r"stage=4 x data=4 needs 16 devices, but there are 8"):
    make_mesh(4, 4, eight_devices)
  small = make_pipeline("pb", widths=(5, 7, 3))
  with pytest.raises(MeshError, match=r"stage axis has 8 devices but the pipeline has only 4 "
                     r"logical stages"):
    ShardedPipeline(small, make_mesh(8, 1, eight_devices))
  odd = make_pipeline("pb", b=3)
  with pytest.raises(MeshError, match=r"data axis has 2 replicas but the micro-batch has b = 3"):
    ShardedPipeline(odd, make_mesh(4, 2, eight_devices))
  with pytest.raises(MeshError, match=r"not contiguous"):
    ShardedPipeline(make_pipeline("pb"), make_mesh(2, 1, eight_devices[:2]),
                    partition=[(0, 4), (5, 9)])
  with pytest.raises(MeshError, match=r"has 3 shards but the mesh's stage axis has 2"):
    ShardedPipeline(make_pipeline("pb"), make_mesh(2, 1, eight_devices[:2]),
                    partition=[(0, 3), (3, 6), (6, 9)])
  wrong_axes = jax.sharding.Mesh(np.array(eight_devices[:2]), ("pipe",))
  with pytest.raises(MeshError, match=r"must have a 'stage' axis.*\('pipe',\)"):
    ShardedPipeline(make_pipeline("pb"), wrong_axes)
  with pytest.raises(MeshError, match="packing_policy must be 'auto', 'flat' or 'per_leaf'"):
    ShardedPipeline(make_pipeline("pb"), make_mesh(2, 1, eight_devices[:2]),
                    packing_policy="packed")
  assert issubclass(MeshError, PipelineError) and issubclass(MeshError, ValueError)


# ----------------------------------------------------------------------------- stacks

GROUPED = (5, 5, 5, 5, 5)  # stages 1..4 identical (a stack); stage 0 and the head single
# Each device's piece of the stack: one stage (devices 0 and 1), two (device 2), then the head
# alone; and on two devices, the stack split 2 | 2, the head with the second piece.
GROUPED_PARTITIONS = {2: [(0, 3), (3, 6)], 4: [(0, 2), (2, 3), (3, 5), (5, 6)]}


@functools.cache
def grouped_pipeline(method_name, stateful=False):
  if not stateful:
    return make_pipeline(method_name, widths=GROUPED)
  norm = lambda: online_norm.OnlineNorm(alpha_fwd=0.9, alpha_bkw=0.95)
  stages = [pipejax.from_flax(nn.Sequential([nn.Dense(w), norm(), nn.tanh])) for w in GROUPED]
  model = pipejax.Model(stages + [pipejax.from_flax(nn.Dense(NUM_CLASSES))])
  x, y = make_stream(1, MICRO_BATCH)
  return Pipeline(model, methods.make_method(method_name, learning_rate=0.05, momentum=0.9),
                  x[0], y[0])


def stacked_and_mesh(method_name, stage, data=1, stateful=False):
  """The single-device stacked Pipeline's run and the mesh's (stacked pieces) from one state."""
  pipe = grouped_pipeline(method_name, stateful)
  stacked = pipe.restacked()
  assert stacked.part_spans == ((0, 1), (1, 5), (5, 6))
  mesh = make_mesh(stage, data, jax.devices()[:stage * data])
  sharded = ShardedPipeline(stacked, mesh, partition=GROUPED_PARTITIONS[stage])
  assert sharded.pipeline is stacked and sharded.part_spans == stacked.part_spans
  x, y = make_stream(2 * pipe.num_stages + 4, MICRO_BATCH)  # even, as NUM_TICKS
  state = host(pipe.init(jax.random.PRNGKey(42), np.float32(np.nan)))
  expected, expected_metrics = stacked.run(stacked.from_logical(state), x, y)
  packed, metrics = sharded.run(sharded.from_logical(state), x, y)
  return (host(stacked.to_logical(expected)), host(expected_metrics),
          host(sharded.to_logical(packed)), host(metrics))


def assert_bit_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(a, e, err_msg=jax.tree_util.keystr(path))


# pb_sc_lwp's coefficients come from the traced delay (float32 m**D), as in the single-device
# stacked runner, even in a piece of one stage: bit for bit with it, not with Pipeline.
@pytest.mark.parametrize("method_name, stage", [("pb", 2), ("pb_sc_lwp", 4), ("pipedream", 4)])
def test_mesh_stacked_pieces_match_one_device_bit_for_bit(eight_devices, method_name, stage):
  expected, expected_metrics, actual, metrics = stacked_and_mesh(method_name, stage)
  assert_bit_equal(actual, expected)
  assert_bit_equal(metrics, expected_metrics)
  assert metrics["valid"].sum() >= 6 and metrics["finite"].all()  # NaN fill reached nothing


def test_mesh_stacked_online_norm_matches_one_device(eight_devices):
  expected, expected_metrics, actual, metrics = stacked_and_mesh("pb", 2, stateful=True)
  assert_bit_equal(actual, expected)
  assert_bit_equal(metrics, expected_metrics)
  initial = grouped_pipeline("pb", stateful=True).init(jax.random.PRNGKey(42))
  assert all(np.abs(a - e).max() > 1e-3 for a, e in zip(  # the stack's statistics moved
      jax.tree.leaves(actual.stages[2].variables), jax.tree.leaves(initial.stages[2].variables)))


def test_mesh_stacked_data_replicas_match_one_device(eight_devices):
  """Replicas average their gradients (pmean under vmap): one device's numbers, to rounding."""
  expected, expected_metrics, actual, metrics = stacked_and_mesh("pb_sc_lwp", 2, data=2)
  assert_states_equal(actual, expected)
  assert_states_equal(metrics, expected_metrics)


def test_mesh_stacked_resumes_per_stage_checkpoints_and_the_other_way(eight_devices):
  """Both layouts keep the logical state: half a run in one, the rest in the other."""
  pipe = grouped_pipeline("pb")
  sharded = ShardedPipeline(pipe.restacked(), make_mesh(4, 1, eight_devices[:4]),
                            partition=GROUPED_PARTITIONS[4])
  x, y = make_stream(24, MICRO_BATCH)
  state = host(pipe.init(jax.random.PRNGKey(7)))
  whole, _ = pipe.run(jax.tree.map(np.copy, state), x, y)
  half, _ = sharded.run(sharded.from_logical(state), x[:12], y[:12])
  rest, _ = pipe.run(sharded.to_logical(half), x[12:], y[12:])
  assert_bit_equal(host(rest), host(whole))
  half, _ = pipe.run(jax.tree.map(np.copy, state), x[:12], y[:12])
  rest, _ = sharded.run(sharded.from_logical(host(half)), x[12:], y[12:])
  assert_bit_equal(host(sharded.to_logical(rest)), host(whole))


def test_mesh_trainer_stacks_each_devices_piece_unless_told_not_to(eight_devices):
  from pipejax import config as configlib  # pylint: disable=import-outside-toplevel
  from pipejax.train import experiment
  config = configlib.base_config()
  config.dataset, config.model = "digits", "residual_mlp"
  config.model_kwargs = {"depth": 8, "width": 8, "layers_per_stage": 1}
  config.mesh.stage = DEVICES  # the trainer's mesh takes every device
  setup = experiment.build(plan_lib.resolve(config))
  assert isinstance(setup.runner, ShardedPipeline) and setup.runner.part_spans == ((0, 1), (1, 7),
                                                                             (7, 8))
  config.stack_stages = False
  assert experiment.build(plan_lib.resolve(config)).runner.part_spans is None


# ----------------------------------------------------------------------------- other processes


def _subprocess_env():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  env["JAX_PLATFORMS"] = "cpu"
  return env


def test_mesh_checks_in_a_subprocess_with_eight_cpu_devices():
  if jax.device_count() >= DEVICES:
    pytest.skip("this process has 8 devices: the test_mesh_* tests ran here")
  env = _subprocess_env()
  env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"),
                                            f"--xla_force_host_platform_device_count={DEVICES}"]))
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
       "test_mesh_ and not subprocess"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=600)
  assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
  assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


def test_two_processes_through_jax_distributed_match_one_process(tmp_path):
  env = _subprocess_env()
  env.pop("XLA_FLAGS", None)  # each worker sets its own device count
  address = f"localhost:{helpers.free_port()}"
  outputs = [tmp_path / f"process{i}.npz" for i in range(2)]
  workers = [subprocess.Popen(
      [sys.executable, "-m", "tests._two_process_worker", f"--coordinator_address={address}",
       f"--process_id={i}", f"--out={out}"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i, out in enumerate(outputs)]
  deadline, logs = time.monotonic() + 240, []
  try:
    for process in workers:
      logs.append(process.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
  except subprocess.TimeoutExpired:
    for process in workers:
      process.kill()
    pytest.fail("the two-process run did not finish in 240 s")
  log = "\n".join(logs)
  if any(p.returncode for p in workers):
    if "UNIMPLEMENTED" in log and "ollective" in log:
      pytest.skip(f"this jaxlib has no cross-process CPU collectives: {log[-500:]}")
    pytest.fail(f"a worker failed:\n{log[-6000:]}")

  pipe, x, y = worker.make_problem()
  state, metrics = pipe.run(pipe.init(jax.random.PRNGKey(3)), x, y)
  expected = worker.flatten_result(state, metrics)
  for out in outputs:
    got = np.load(out)
    assert set(got) == set(expected)
    for key, value in expected.items():
      np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-6,
                                 err_msg=f"{out.name} {worker.MESH_NAME} {key}")


def _poisoned(state, stage: int, in_opt_state: bool):
  """``state`` with one NaN in stage ``stage``'s weights (or its optimizer state)."""
  st = state.stages[stage]
  tree = st.opt_state if in_opt_state else st.params
  leaves, treedef = jax.tree.flatten(tree)
  k = next(i for i, a in enumerate(leaves) if np.issubdtype(np.asarray(a).dtype, np.floating)
           and np.asarray(a).size)
  bad = np.array(leaves[k], copy=True)
  bad.reshape(-1)[bad.size // 2] = np.nan
  leaves[k] = bad
  tree = treedef.unflatten(leaves)
  st = st._replace(opt_state=tree) if in_opt_state else st._replace(params=tree)
  return state._replace(stages=state.stages[:stage] + (st,) + state.stages[stage + 1:])


@pytest.mark.parametrize("stage, in_opt_state", [(0, False), (3, True), (5, False)])
def test_mesh_and_every_layout_report_which_stages_weights_are_not_finite(eight_devices, stage,
                                                                  in_opt_state):
  # The trainer's weight check, computed where each layout keeps its state: the flags name the
  # same stage on one device, stacked, and on a mesh (stages 2..5 of EVEN widths stack).
  widths = (5, 5, 5, 5, 5, 5)
  pipe = make_pipeline("pb_sc_lwp", widths=widths)
  state = host(pipe.init(jax.random.PRNGKey(0)))
  expected = np.arange(pipe.num_stages) != stage
  assert pipe.weights_finite(state).all()
  bad = _poisoned(state, stage, in_opt_state)
  np.testing.assert_array_equal(pipe.weights_finite(jax.tree.map(np.copy, bad)), expected)
  stacked = pipe.restacked()
  assert stacked.stacked
  np.testing.assert_array_equal(stacked.weights_finite(stacked.from_logical(bad)), expected)
  sharded = ShardedPipeline(stacked, make_mesh(4, 2, eight_devices))
  packed = sharded.from_logical(bad)
  np.testing.assert_array_equal(sharded.weights_finite(packed), expected)
  assert sharded.weights_finite(sharded.from_logical(state)).all()
  # What the trainer digests, read in each layout without its logical copy on the device.
  want = [st.params for st in state.stages]
  for runner, laid_out in ((pipe, jax.tree.map(np.copy, state)),
                           (stacked, stacked.from_logical(state)),
                           (sharded, sharded.from_logical(state))):
    got = runner.host_params(laid_out)
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(got))
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("stage, data, stacked", [(4, 1, False), (4, 2, False), (8, 1, True),
                                                  (2, 2, True)])
def test_mesh_init_makes_each_devices_stages_on_it_with_one_devices_numbers(
    eight_devices, stage, data, stacked):
  # Each device initializes its own stages into its own buffers: the same bits as laying out the
  # single-device init, NaN fill, replicas' cotangent shares and stacked pieces included.
  pipe = make_pipeline("pb_sc_lwp", widths=(5, 5, 5, 5, 5, 5, 5, 5))
  runner = pipe.restacked() if stacked else pipe
  assert not stacked or runner.stacked
  sharded = ShardedPipeline(runner, make_mesh(stage, data, eight_devices[:stage * data]))
  made = sharded.init(jax.random.PRNGKey(7), np.nan)
  laid_out = sharded.from_logical(host(pipe.init(jax.random.PRNGKey(7), np.nan)))
  for name in made.shared:
    np.testing.assert_array_equal(np.asarray(made.shared[name]), np.asarray(laid_out.shared[name]))
  for name in made.local:
    np.testing.assert_array_equal(np.asarray(made.local[name]), np.asarray(laid_out.local[name]))
  np.testing.assert_array_equal(np.asarray(made.rng), np.asarray(laid_out.rng))
  assert int(made.tick) == 0
  assert_states_equal(sharded.to_logical(made), host(pipe.init(jax.random.PRNGKey(7), np.nan)))


def test_every_layout_runs_through_the_one_runner():
  # run, tick, drain, to_ticks, lower and programs are written once, in Runner; a layout gives
  # only the protocol (a layout overriding one would run its own copy of the logic).
  shared = ("run", "tick", "drain", "to_ticks", "lower", "programs")
  for layout in (Pipeline, StackedPipeline, ShardedPipeline):
    assert issubclass(layout, Runner)
    assert not layout.__abstractmethods__, layout.__name__
    for name in shared:
      assert getattr(layout, name) is getattr(Runner, name), (layout.__name__, name)
  assert Runner.__abstractmethods__ == {
      "init", "check_state", "to_logical", "from_logical", "every_slot_full", "host_params",
      "weights_finite", "_tick"}


def test_a_mesh_run_inside_a_callers_jit_is_refused_with_a_message(eight_devices):
  pipe = make_pipeline("pb", widths=(5, 7, 3))
  sharded = ShardedPipeline(pipe, make_mesh(2, 1, eight_devices[:2]), costs=[1, 1, 1, 1])
  x, y = make_stream(2, MICRO_BATCH)
  packed = sharded.init(jax.random.PRNGKey(0))
  for call in (lambda xs: sharded.run(packed, xs, y), lambda xs: sharded.tick(packed, xs[0], y[0])):
    with pytest.raises(PipelineError, match="cannot run inside jax.jit.*Call them outside"):
      jax.jit(call)(x)
