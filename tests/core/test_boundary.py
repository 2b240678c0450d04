"""The library's boundary with JAX: runners inside JAX's transforms, donated arrays, and states
too large for memory."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pipejax
from pipejax import methods
from pipejax.core import accounting
from pipejax.core.checks import PipelineError
from pipejax.core.engine import Pipeline
from pipejax.parallel.mesh import make_mesh
from pipejax.parallel.sharding import ShardedPipeline
from tests.helpers import NUM_CLASSES, assert_trees_close, make_model, make_stream

KEY = jax.random.PRNGKey(0)


def _pipeline(ticks=4, b=2, widths=(5,)):
  x, y = make_stream(ticks, b)
  return Pipeline(make_model(widths), methods.make_method("pb", learning_rate=0.05), x[0],
                  y[0]), x, y


@pytest.mark.parametrize("layout", ["per_stage", "stacked"])
def test_run_and_tick_inside_jit_compute_what_they_compute_outside(layout):
  if layout == "per_stage":
    pipe, x, y = _pipeline()
    runner = pipe
  else:  # stages 1 and 2 alike: a stack
    pipe, x, y = _pipeline(ticks=7, widths=(5, 5, 5))
    runner = pipe.restacked()
    assert runner.stacked
  state, metrics = runner.run(runner.init(KEY), x, y)
  jitted_state, jitted_metrics = jax.jit(runner.run)(runner.init(KEY), x, y)
  assert_trees_close(jitted_state, state)
  assert_trees_close(jitted_metrics, metrics)
  assert int(np.sum(metrics["valid"])) > 0  # some samples met the loss: the runs trained
  if layout == "per_stage":
    ticked = runner.tick(runner.init(KEY), x[0], y[0])
    assert_trees_close(jax.jit(runner.tick)(runner.init(KEY), x[0], y[0]), ticked)
  shapes = jax.eval_shape(runner.run, runner.init(KEY), x, y)  # traced alike, nothing computed
  assert jax.tree.map(lambda a: (a.shape, a.dtype), shapes) == jax.tree.map(
      lambda a: (a.shape, a.dtype), (state, metrics))


def test_run_under_vmap_is_one_run_per_state():
  pipe, x, y = _pipeline()
  keys = jnp.stack([jax.random.PRNGKey(1), jax.random.PRNGKey(2)])
  states, metrics = jax.vmap(pipe.run, in_axes=(0, None, None))(jax.vmap(pipe.init)(keys), x, y)
  for i, key in enumerate(keys):
    alone, alone_metrics = pipe.run(pipe.init(key), x, y)
    assert_trees_close(jax.tree.map(lambda a, i=i: a[i], (states, metrics)),
                       (alone, alone_metrics))
  assert not np.allclose(metrics["loss"][0], metrics["loss"][1])  # two seeds, two runs


def test_grad_through_a_tick_is_the_gradient_of_the_network():
  # One stage: a tick's loss is the loss of the stage's current weights on the micro-batch.
  model = pipejax.Model([pipejax.from_flax(nn.Dense(NUM_CLASSES))])
  x, y = make_stream(1, 3)
  pipe = Pipeline(model, methods.pb(optax.sgd(0.05)), x[0], y[0])
  state = pipe.init(KEY)
  params = jax.tree.map(np.array, state.stages[0].params)
  loss = lambda inputs: pipe.tick(state, inputs, y[0])[1]["loss"]
  got = jax.grad(loss)(jnp.asarray(x[0]))
  np.testing.assert_array_equal(jax.grad(jax.checkpoint(loss))(jnp.asarray(x[0])), got)
  want = jax.grad(lambda inputs: model.loss(model.apply([params], inputs), y[0])[0])(x[0])
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert np.abs(want).max() > 0
  # Through a run of several stages: the losses depend on every micro-batch fed.
  pipe, x, y = _pipeline()
  state = pipe.init(KEY)
  grads = jax.grad(lambda inputs: pipe.run(state, inputs, y)[1]["loss"].sum())(jnp.asarray(x))
  assert np.all(np.isfinite(grads)) and np.abs(grads[0]).max() > 0
  pipe.run(state, x, y)  # the traced runs donated nothing


def test_a_sharded_pipeline_inside_a_transform_says_what_to_do_in_one_line():
  pipe, x, y = _pipeline()
  sharded = ShardedPipeline(pipe, make_mesh(1, 1, jax.devices()[:1]))
  packed = sharded.init(KEY)
  for transform in (jax.jit, lambda f: jax.vmap(f, in_axes=(0, None, None))):
    state = packed if transform is jax.jit else jax.tree.map(lambda a: a[None], packed)
    for call in (sharded.run, lambda s, xs, ys: sharded.tick(s, xs[0], ys[0])):
      with pytest.raises(PipelineError, match="inside jax.jit, jax.vmap, jax.grad") as error:
        transform(call)(state, x, y)
      assert "\n" not in str(error.value)
      assert "transform a Pipeline on one device" in str(error.value)
  sharded.run(packed, x, y)  # untouched, and still usable


def test_every_use_of_an_array_a_run_donated_is_named():
  pipe, x, y = _pipeline()
  stacked = pipe.restacked()
  sharded = ShardedPipeline(pipe, make_mesh(1, 1, jax.devices()[:1]))
  state = pipe.init(KEY)
  params = [st.params for st in state.stages]  # references kept across the run
  stages, stacked_state, packed = state.stages, stacked.init(KEY), sharded.init(KEY)
  new, _ = pipe.run(state, x, y)
  stacked.run(stacked_state, x, y)
  sharded.run(packed, x, y)
  mixed = new._replace(stages=(stages[0],) + new.stages[1:])  # one old stage in a new state
  uses = {
      "run": lambda: pipe.run(mixed, x, y),
      "tick": lambda: pipe.tick(mixed, x[0], y[0]),
      "drain": lambda: pipe.drain(mixed),
      "to_logical": lambda: pipe.to_logical(mixed),
      "every_slot_full": lambda: pipe.every_slot_full(mixed),
      "stacked from_logical": lambda: stacked.from_logical(mixed),
      "stacked to_logical": lambda: stacked.to_logical(stacked_state),
      "sharded from_logical": lambda: sharded.from_logical(mixed),
      "sharded to_logical": lambda: sharded.to_logical(packed),
      "Model.apply": lambda: pipe.model.apply(params, x[0]),
  }
  for name, use in uses.items():
    with pytest.raises(ValueError, match="donated to an earlier run") as error:
      use()
    assert "params = state.stages[0].params" in str(error.value), name
    assert "\n" not in str(error.value), name
  pipe.run(new, x, y)  # the returned state is whole


def _too_large_for_memory():
  """A pipeline whose state is several times this machine's memory, from shapes alone: one
  micro-batch of stage 0's input is the whole memory, and its delay line holds five."""
  features = accounting.memory_available()[0] // 4 + 1
  x = jax.ShapeDtypeStruct((1, features), jnp.float32)
  y = jax.ShapeDtypeStruct((1,), jnp.int32)
  return Pipeline(make_model((5, 5)), methods.make_method("pb", learning_rate=0.05), x, y)


@pytest.mark.parametrize("layout", ["per_stage", "stacked", "sharded"])
def test_a_state_too_large_for_memory_is_refused_before_anything_is_allocated(layout):
  pipe = _too_large_for_memory()
  runner = {"per_stage": lambda: pipe, "stacked": lambda: pipe.restacked(),
            "sharded": lambda: ShardedPipeline(pipe, make_mesh(1, 1, jax.devices()[:1]))}[layout]()
  with pytest.raises(PipelineError, match=r"state of about [\d.]+ GiB .*3 stages.*more than "
                     r"(this machine's|.*'s) memory \([\d.]+ GiB\)") as error:
    runner.init(KEY)
  assert "\n" not in str(error.value) and "fewer stages" in str(error.value)
  # Its abstract state, and its size, are still there to read.
  assert accounting.tree_bytes(jax.eval_shape(pipe.init, KEY)) > accounting.memory_available()[0]


def test_the_memory_check_of_init_is_the_trainers(monkeypatch):
  pipe, _, _ = _pipeline()
  needed = accounting.tree_bytes(pipe.state_spec)
  small = lambda: (needed - 1, "a small device's memory")
  monkeypatch.setattr(accounting, "memory_available", small)
  with pytest.raises(PipelineError, match="a small device's memory"):
    pipe.init(KEY)
  from pipejax.train import run_checks  # pylint: disable=import-outside-toplevel
  assert run_checks._memory_available() == (needed - 1, "a small device's memory")
  monkeypatch.setattr(accounting, "memory_available", lambda: (needed, "a small device's memory"))
  pipe.init(KEY)  # exactly fits


def test_the_calls_that_read_on_the_host_say_so_inside_a_transform_in_one_line():
  pipe, x, y = _pipeline()
  with pytest.raises(PipelineError, match="to_ticks lays a stream out on the host.*outside the "
                     "transform") as error:
    jax.jit(pipe.to_ticks)(x, y)
  assert "\n" not in str(error.value)
  for runner in (pipe, pipe.restacked()):
    with pytest.raises(PipelineError, match="every_slot_full reads .* on the host.*Call it "
                       "outside the transform"):
      jax.jit(runner.every_slot_full)(runner.init(KEY))


def test_run_under_shard_map_is_one_run_per_device():
  pipe, x, y = _pipeline()
  mesh = jax.make_mesh((2,), ("replica",), devices=jax.devices()[:2])
  keys = jnp.stack([jax.random.PRNGKey(1), jax.random.PRNGKey(2)])
  states = jax.device_put(jax.vmap(pipe.init)(keys), NamedSharding(mesh, P("replica")))

  def one_pipeline_per_device(state):
    state, metrics = pipe.run(jax.tree.map(lambda a: a[0], state), x, y)
    return jax.tree.map(lambda a: a[None], (state, metrics))

  _, metrics = jax.jit(jax.shard_map(one_pipeline_per_device, mesh=mesh, in_specs=P("replica"),
                                     out_specs=P("replica")))(states)
  for i, key in enumerate(keys):
    _, alone = pipe.run(pipe.init(key), x, y)
    np.testing.assert_allclose(np.asarray(metrics["loss"])[i], alone["loss"], rtol=1e-6)
