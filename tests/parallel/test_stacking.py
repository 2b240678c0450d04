"""Stacks of identical stages give the per-stage engine's numbers (docs/design.md §8)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax
from pipejax.train import plan as plan_lib
from pipejax.core import accounting, parts, stackable
from pipejax import methods, models
from pipejax.core.checks import PipelineError
from pipejax.core.engine import Pipeline
from pipejax.profiling import workloads
from tests import helpers
from tests.helpers import IN_DIM, NUM_CLASSES, dense_model, make_stream

EVEN = (5, 5, 5, 5)  # stages 1..3 identical (the first and the last never stack)


def both_layouts(model, method, b, ticks, fill_value=0.0, **kwargs):
  """Runs ``ticks`` ticks per stage and stacked from one initial state; both logical states and
  metrics, on the host."""
  x, y = make_stream(ticks, b)
  pipe = Pipeline(model, method, x[0], y[0], **kwargs)
  stacked = pipe.restacked()
  assert stacked.stacked
  x, y, valid = pipe.to_ticks(x, y)
  logical = pipe.init(jax.random.PRNGKey(5), fill_value=fill_value)
  start = stacked.from_logical(logical)
  # The stacked init (one vmap over a stack's keys) makes the per-stage init's bits.
  assert_same(jax.tree.map(np.asarray, stacked.init(jax.random.PRNGKey(5), fill_value)),
              jax.tree.map(np.asarray, start), exact=True)
  per_stage, per_stage_metrics = pipe.run(logical, x, y, valid)
  stacked_end, stacked_metrics = stacked.run(start, x, y, valid)
  host = lambda tree: jax.tree.map(np.asarray, tree)
  return (host(per_stage), host(per_stage_metrics), host(stacked.to_logical(stacked_end)),
          host(stacked_metrics))


def assert_same(actual, expected, exact):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    if exact:
      np.testing.assert_array_equal(a, e)
    else:  # float32 rounding: the same maths with m**D in float32 rather than in Python floats
      np.testing.assert_allclose(a, e, rtol=2e-5, atol=1e-6)


def test_identical_runs_are_found_and_the_rest_left_alone():
  x, y = make_stream(1, 1)
  pb = methods.make_method("pb", learning_rate=0.1)
  find = lambda model, x: stackable.find_parts(Pipeline(model, pb, x, y[0]).initial)
  assert find(dense_model(EVEN), x[0]) == [(0, 1), (1, 4), (4, 5)]
  # Widths 5, 7, 7, 3: stages 2 and 3 take inputs of 7 and 7 but give 7 and 3: no two alike.
  assert find(dense_model((5, 7, 7, 3)), x[0]) == [(s, s + 1) for s in range(5)]
  blocks = models.build("residual_mlp", num_classes=NUM_CLASSES, depth=7, width=8)
  assert find(blocks, np.zeros((1, 3, 3), np.float32)) == [(0, 1), (1, 6), (6, 7)]  # flattened


def test_the_stacked_init_does_not_grow_with_a_groups_length():
  """A stack initializes under one vmap, whose weights' names (and so the constants flax folds
  into their keys) differ from stage to stage: 3 or 9 blocks, one program, the per-stage bits."""
  _, y = make_stream(1, 1)
  x = np.zeros((1, 3, 3), np.float32)
  method = methods.make_method("pb_sc_lwp", learning_rate=0.1)
  pipes = {n: Pipeline(models.build("residual_mlp", num_classes=NUM_CLASSES, depth=n, width=8),
                       method, x, y[0]) for n in (5, 11)}
  stacked = {n: pipe.restacked() for n, pipe in pipes.items()}
  equations = lambda f: str(jax.make_jaxpr(f)(jax.random.PRNGKey(0))).count(" = ")
  assert equations(stacked[5].init) == equations(stacked[11].init)
  assert equations(pipes[11].init) > equations(pipes[5].init) + 50  # the reference grows
  assert_same(jax.tree.map(np.asarray, stacked[11].to_logical(stacked[11].init(7))),
              jax.tree.map(np.asarray, pipes[11].init(7)), exact=True)


def test_a_declared_stack_traces_once_and_gives_the_per_stage_numbers(monkeypatch):
  """One Stage object repeated declares a stack: the model traces it once, find_parts takes the
  run without tracing its stages' updates, and the stacked numbers are the per-stage ones."""
  calls = {"init": 0, "signature": 0}
  block = pipejax.from_flax(nn.Dense(5))
  traced_initial = block.initial

  def counted_initial(*args):
    calls["init"] += 1
    return traced_initial(*args)

  object.__setattr__(block, "initial", counted_initial)
  signature = stackable._signature
  monkeypatch.setattr(stackable, "_signature",
                      lambda *a: calls.__setitem__("signature", calls["signature"] + 1)
                      or signature(*a))
  model = pipejax.Model([pipejax.from_flax(nn.Dense(5))] + [block] * 5
                        + [pipejax.from_flax(nn.Dense(NUM_CLASSES))])
  assert [model.repeats(s) for s in range(7)] == [False, False, True, True, True, True, False]
  method = methods.make_method("pb", learning_rate=0.01)
  x, y = make_stream(1, 2)
  assert stackable.find_parts(Pipeline(model, method, x[0], y[0]).initial) == [
      (0, 1), (1, 6), (6, 7)]
  assert calls == {"init": 1, "signature": 1}  # the block's first stage alone
  per_stage, per_stage_metrics, stacked_end, stacked_metrics = both_layouts(
      model, method, 2, 24, fill_value=jnp.nan)
  assert_same(stacked_end, per_stage, exact=True)
  assert_same(stacked_metrics, per_stage_metrics, exact=True)
  assert np.isfinite(per_stage_metrics["loss"]).all() and per_stage_metrics["valid"].sum() > 4
  blocks = [st.params for st in per_stage.stages[1:6]]  # each stage drew its own weights
  kernels = [jax.tree.leaves(p)[-1] for p in blocks]
  assert min(np.abs(a - b).max() for a, b in zip(kernels, kernels[1:])) > 1e-3
  with pytest.raises(pipejax.ModelError, match="declared_stack .* needs layers_per_stage=1"):
    models.build("residual_mlp", num_classes=NUM_CLASSES, depth=6, layers_per_stage=2,
                 declared_stack=True)
  declared = models.build("residual_mlp", num_classes=NUM_CLASSES, depth=6, width=8,
                          declared_stack=True)
  assert [declared.repeats(s) for s in range(6)] == [False, False, True, True, True, False]


def test_a_method_that_needs_a_python_delay_runs_stage_by_stage():
  def per_delay(delay):
    if delay > 2:  # a Python branch on the delay: it cannot take a traced one
      return optax.sgd(0.05)
    return optax.sgd(0.1)
  x, y = make_stream(1, 1)
  pipe = Pipeline(dense_model(EVEN), methods.pb(per_delay), x[0], y[0])
  assert not pipe.restacked().stacked


@pytest.mark.parametrize("name", methods.METHODS)
def test_every_preset_gives_the_per_stage_numbers(name):
  """Bit for bit, but where a method's coefficients depend on the delay (m**D in float32 from a
  traced delay, in Python floats from an int one); NaN in every empty slot."""
  optimizer = methods.optimizers_of(name)[0]
  method = methods.make_method(name, **helpers.taking(
      name, learning_rate=0.05 if optimizer == "sgd" else 1e-3, momentum=0.9, micro_batches=2,
      anneal_steps=6, gamma=0.7, dc_strength=3.0, optimizer=optimizer,
      num_stages=dense_model(EVEN).num_stages))
  per_stage, per_stage_metrics, stacked_end, stacked_metrics = both_layouts(
      dense_model(EVEN), method, 2, 3 * len(EVEN) + 6, fill_value=jnp.nan)
  # Coefficients computed from the traced delay (a momentum or rate by delay, or a traced step's
  # powers, PyTorch's NAdam), or
  # Muon's Newton-Schulz on the mean of accumulated gradients, batched over the stack (PipeDream +
  # Muon at M = 2): the same numbers to float32 rounding.
  exact = name not in ("pb_sc", "pb_sc_lwp", "pipeoptim", "nesterov_asyncpp",
                       "nesterov_asyncpp_released", "pb_muon_sc_lwp", "pipedream_muon",
                       "pipedream_muon_delay_adaptive")
  assert_same(stacked_end, per_stage, exact)
  assert_same(stacked_metrics, per_stage_metrics, exact)
  assert np.isfinite(per_stage_metrics["loss"]).all() and per_stage_metrics["valid"].sum() > 4


def test_adam_with_spike_compensation_agrees_within_rounding():
  method = methods.make_method("pb_sc_lwp", learning_rate=0.01, optimizer="adam")
  per_stage, _, stacked_end, _ = both_layouts(dense_model(EVEN), method, 1, 20)
  assert_same(stacked_end, per_stage, exact=False)


def test_online_norm_and_weight_stashing_with_discrepancy_tracking():
  norm = lambda: models.online_norm.OnlineNorm(alpha_fwd=0.9, alpha_bkw=0.95)
  stage = lambda: pipejax.from_flax(nn.Sequential([nn.Dense(5), norm(), nn.tanh]))
  model = pipejax.Model([stage() for _ in range(4)] + [pipejax.from_flax(nn.Dense(NUM_CLASSES))])
  method = methods.make_method("pipedream", learning_rate=0.05)
  per_stage, per_stage_metrics, stacked_end, stacked_metrics = both_layouts(
      model, method, 1, 18, fill_value=jnp.nan, track_weight_discrepancy=True)
  assert_same(stacked_end, per_stage, exact=True)
  assert_same(stacked_metrics, per_stage_metrics, exact=True)
  assert per_stage_metrics["weight_discrepancy"].shape == (18, 5)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(),
                                       per_stage.stages[2].variables.backward,
                                       stacked_end.stages[2].variables.backward))
  assert max(moved) == 0


def test_checkpoints_resume_in_either_layout():
  """Half a run per stage, the rest stacked (and the other way round): the whole run's numbers."""
  x, y = make_stream(24, 1)
  pipe = Pipeline(dense_model(EVEN), methods.make_method("pb_sc_lwp", learning_rate=0.05),
                  x[0], y[0])
  stacked = pipe.restacked()
  whole, _ = pipe.run(pipe.init(3), x, y)
  first, _ = pipe.run(pipe.init(3), x[:10], y[:10])
  resumed, _ = stacked.run(stacked.from_logical(first), x[10:], y[10:])
  first_stacked, _ = stacked.run(stacked.init(3), x[:10], y[:10])
  back, _ = pipe.run(stacked.to_logical(first_stacked), x[10:], y[10:])
  assert_same(jax.tree.map(np.asarray, stacked.to_logical(resumed)),
              jax.tree.map(np.asarray, whole), exact=False)
  assert_same(jax.tree.map(np.asarray, back), jax.tree.map(np.asarray, whole), exact=False)
  state = stacked.init(3)
  assert_same(jax.tree.map(np.asarray, stacked.to_logical(state)),
              jax.tree.map(np.asarray, pipe.init(3)), exact=True)


@pytest.mark.parametrize("name", ["pb", "pb_sc", "pb_lwp", "pb_sc_lwp", "pipedream", "spectrain",
                                  "pipemare", "dcasgd"])
def test_delay_lines_hold_the_formulas_bytes(name):
  b = 3
  x, y = make_stream(1, b)
  pipe = Pipeline(dense_model(EVEN), methods.make_method(name, learning_rate=0.1), x[0], y[0])
  stacked = pipe.restacked()
  state = stacked.init(0)
  assert len(state.parts) == 3
  # By hand: 5 stages, D_s + 1 = 9, 7, 5, 3, 1 slots; inputs of widths IN_DIM, 5, 5, 5, 5 and
  # weights of IN_DIM x 5 + 5, three of 5 x 5 + 5 and the head's 5 x NUM_CLASSES + NUM_CLASSES.
  slots = (9, 7, 5, 3, 1)
  inputs = (IN_DIM, 5, 5, 5, 5)
  weights = (IN_DIM * 5 + 5, 30, 30, 30, 5 * NUM_CLASSES + NUM_CLASSES)
  activations = 4 * b * sum(n * w for n, w in zip(slots, inputs))
  stashed = 4 * sum(n * w for n, w in zip(slots, weights)) if name in ("pipedream", "dcasgd") else 0
  for runner, held in ((stacked, state), (pipe, pipe.init(0))):
    parts = held.parts if runner is stacked else held.stages
    assert accounting.held_stash_bytes(parts) == activations
    assert accounting.held_weight_stash_bytes(parts) == stashed
  assert (pipe.spec.stash_bytes() == accounting.stash_bytes(pipe.spec.stage_input_shapes)
          == activations)
  assert (accounting.weight_stash_bytes(pipe.spec.stage_param_shapes) if pipe.spec.stashes_weights
          else 0) == stashed


# What docs/benchmarks/delay_lines.json measured for configs/deep_mlp.py's residual MLP:
# (stashed input bytes, stashed weight bytes for PipeDream) at 128 and 256 stages.
DEEP_MLP_DELAY_LINES = {128: (9_057_728, 2_249_455_144), 256: (34_895_296, 8_861_382_184)}


# One model per depth for both methods: it traces its 256 stages once (Model.trace).
depth_model = functools.cache(workloads.depth_model)


@pytest.mark.parametrize("num_stages", [128, 256])
@pytest.mark.parametrize("name", ["pb", "pipedream"])
def test_delay_lines_at_depth_hold_the_formulas_bytes(name, num_stages):
  """configs/deep_mlp.py's residual MLP, stacked, read off the shapes of its init (PipeDream's
  weight copies at 256 stages are 8.9 GB): the formulas counted by hand from the paper's
  D_s = 2(S - 1 - s) and the model's layer widths, with no call to the library's accounting."""
  s_max = num_stages - 1
  slots = [2 * (s_max - s) + 1 for s in range(num_stages)]
  # Micro-batch 1 of float32: the stem takes a 28 x 28 x 1 image, every later stage the width-128
  # residual stream.
  inputs = [4 * 28 * 28 * 1] + [4 * 128] * s_max
  # The stem's dense layer 784 -> 128; a block's LayerNorm (scale and bias) and two 128 -> 128
  # dense layers; the head's LayerNorm and its dense layer 128 -> 10.
  stem, block, head = 784 * 128 + 128, 2 * 128 + 2 * (128 * 128 + 128), 2 * 128 + 128 * 10 + 10
  weights = [4 * stem] + [4 * block] * (num_stages - 2) + [4 * head]
  activations = sum(n * size for n, size in zip(slots, inputs))
  stashed = sum(n * w for n, w in zip(slots, weights)) if name == "pipedream" else 0
  measured_inputs, measured_weights = DEEP_MLP_DELAY_LINES[num_stages]
  assert activations == measured_inputs
  assert stashed == (measured_weights if name == "pipedream" else 0)

  x, y = np.zeros((1, 28, 28, 1), np.float32), np.zeros((1,), np.int32)
  method = methods.make_method(name, learning_rate=1e-3, momentum=0.9)
  stacked = Pipeline(depth_model(num_stages), method, x, y, stack=True)
  runs = ((0, 1), (1, s_max), (s_max, num_stages))  # the stem, the blocks' stack, the head
  assert stacked.part_spans == runs
  state = jax.eval_shape(lambda: stacked.init(jax.random.PRNGKey(0)))
  nbytes = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))
  # A stack's rings lie end to end, so each part's delay line holds its stages' slots together.
  for part, (start, stop) in zip(state.parts, runs):
    assert part.delay_line.valid.shape == (sum(slots[start:stop]),)
    held = zip(slots[start:stop], inputs[start:stop])
    assert nbytes(part.delay_line.x) == sum(n * size for n, size in held)
  assert sum(nbytes(part.delay_line.x) for part in state.parts) == activations
  assert sum(nbytes(part.delay_line.weights) for part in state.parts) == stashed


def test_a_logical_or_foreign_state_is_refused():
  x, y = make_stream(2, 1)
  pipe = Pipeline(dense_model(EVEN), methods.make_method("pb", learning_rate=0.1), x[0], y[0])
  stacked = pipe.restacked()
  with pytest.raises(PipelineError, match="logical PipelineState"):
    stacked.run(pipe.init(0), x, y)
  other = Pipeline(dense_model((5, 5, 5, 5, 5)), pipe.method, x[0], y[0], stack=True)
  with pytest.raises(PipelineError, match="does not belong"):
    stacked.run(other.init(0), x, y)


def test_the_trainer_stacks_identical_runs_unless_told_not_to():
  # pylint: disable-next=import-outside-toplevel
  from pipejax import config as configlib
  from pipejax.train import experiment, resume
  config = configlib.base_config()
  config.dataset, config.model = "digits", "residual_mlp"
  config.model_kwargs = {"depth": 5, "width": 8, "layers_per_stage": 1}
  setup = experiment.build(plan_lib.resolve(config))
  assert isinstance(setup.runner, Pipeline) and setup.runner.part_spans == ((0, 1), (1, 4), (4, 5))
  assert setup.runner.stacked and not setup.pipeline.stacked
  state = setup.init(jax.random.PRNGKey(0))
  assert_same(jax.tree.map(np.asarray, setup.runner.to_logical(state)),
              jax.tree.map(np.asarray, setup.pipeline.init(jax.random.PRNGKey(0))),
              exact=True)
  config.stack_stages = False
  unstacked = experiment.build(plan_lib.resolve(config))
  assert unstacked.runner is unstacked.pipeline
  assert "stack_stages" in resume.FREE_KEYS  # a checkpoint resumes in either layout


def test_a_mesh_stacks_each_devices_piece_of_a_group():
  """On a one-device mesh the piece is the whole stack: the stacked runner's numbers, bit for
  bit (tests/parallel/test_sharding.py splits stacks over 2 and 4 devices)."""
  from pipejax.parallel import sharding  # pylint: disable=import-outside-toplevel
  from pipejax.parallel.mesh import MeshError, make_mesh  # pylint: disable=import-outside-toplevel
  spans, delays = ((0, 1), (1, 8), (8, 9)), tuple(range(16, -1, -2))
  # A device's piece of a stack is a stack, however short, its rings laid end to end.
  assert parts.cut_parts(spans, delays, 0, 3) == (
      parts.Part(0, 1), parts.Part(1, 3, parts.Rings((0, 15), (15, 13))))
  assert parts.cut_parts(spans, delays, 7, 9) == (
      parts.Part(7, 8, parts.Rings((0,), (3,))), parts.Part(8, 9))
  assert parts.cut_parts(None, delays, 2, 4) == (parts.Part(2, 3), parts.Part(3, 4))
  x, y = make_stream(14, 2)
  pipe = Pipeline(dense_model(EVEN), methods.make_method("pb_sc_lwp", learning_rate=0.05), x[0],
                  y[0])
  stacked = pipe.restacked()
  sharded = sharding.ShardedPipeline(stacked, make_mesh(1, 1, jax.devices()[:1]))
  assert sharded.part_spans == stacked.part_spans and sharded.pipeline is stacked
  assert sharded.shard_parts == (stacked.parts,)  # one device: the stacked runner's own parts
  expected, _ = stacked.run(stacked.init(1), x, y)
  actual, _ = sharded.run(sharded.init(1), x, y)
  assert_same(jax.tree.map(np.asarray, sharded.to_logical(actual)),
              jax.tree.map(np.asarray, stacked.to_logical(expected)), exact=True)
  assert sharding.ShardedPipeline(pipe, sharded.mesh).part_spans is None
  with pytest.raises(MeshError, match=r"takes a Pipeline \(with or without stacked parts\)"):
    sharding.ShardedPipeline(sharded, sharded.mesh)


def test_the_logical_state_outlives_the_stacked_one():
  """``to_logical`` cuts the rings on the host into arrays of their own: running on (which
  donates the stacked state's buffers) leaves the logical state as it was."""
  x, y = make_stream(12, 1)
  pipe = Pipeline(dense_model(EVEN), methods.make_method("pb", learning_rate=0.05), x[0], y[0])
  stacked = pipe.restacked()
  state, _ = stacked.run(stacked.init(3), x[:6], y[:6])
  logical = stacked.to_logical(state)
  before = jax.tree.map(np.array, logical)
  stacked.run(state, x[6:], y[6:])
  assert_same(jax.tree.map(np.asarray, logical), before, exact=True)
  assert any(np.asarray(st.delay_line.valid).any() for st in logical.stages)
  per_stage, _ = pipe.run(pipe.init(3), x[:6], y[:6])
  assert_same(before, jax.tree.map(np.asarray, per_stage), exact=True)


def test_the_old_stacked_runner_is_an_alias_that_says_what_replaced_it():
  x, y = make_stream(1, 1)
  pipe = Pipeline(dense_model(EVEN), methods.make_method("pb", learning_rate=0.1), x[0], y[0])
  with pytest.warns(DeprecationWarning, match=r"pipe\.restacked"):
    stacked = pipejax.StackedPipeline(pipe, ((0, 1), (1, 3), (3, 4), (4, 5)))
  assert type(stacked) is Pipeline and stacked.part_spans == ((0, 1), (1, 3), (3, 4), (4, 5))
  assert stacked.spec is pipe.spec and stacked.initial is pipe.initial  # nothing traced again
  assert pipe.restacked(False) is pipe and stacked.restacked(False) is stacked.restacked(False)
  assert not stacked.restacked(False).stacked
  for wrong in (((0, 1), (2, 5)), ((0, 3), (3, 4)), ((0, 0), (0, 5))):
    with pytest.raises(PipelineError, match=r"contiguous and covering stages 0 \.\. 4"):
      pipe.restacked(wrong)
  with pytest.raises(PipelineError, match="stage 4's state differs from stage 3's"):
    pipe.restacked(((0, 1), (1, 3), (3, 5)))  # the head is not a block
  from pipejax.parallel import stacking  # pylint: disable=import-outside-toplevel
  with pytest.warns(DeprecationWarning, match="find_parts"):
    assert stacking.find_stacks(pipe) == [(0, 1), (1, 4), (4, 5)]
