"""Model.apply, the whole network as one function, against flax and a stage-by-stage loop."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax
from pipejax.models import online_norm
from tests import helpers


def _init(model, x, rng=jax.random.key(0)):
  """Params (and variables) of every stage, each initialized on its predecessor's output."""
  params, variables = [], []
  for stage, key in zip(model.stages, jax.random.split(rng, model.num_stages)):
    params.append(stage.init(key, x))
    variables.append(stage.variables(key, x))
    x = stage.infer(params[-1], x, variables[-1])
  return params, variables


def test_apply_runs_every_stage_in_order():
  model = helpers.dense_model([5, 3])
  x = jax.random.normal(jax.random.key(1), (4, helpers.IN_DIM))
  params, _ = _init(model, x)
  expected = x
  for s, width in enumerate([5, 3]):
    kernel, bias = params[s]["layers_0"]["kernel"], params[s]["layers_0"]["bias"]
    expected = np.tanh(np.asarray(expected) @ np.asarray(kernel) + np.asarray(bias))
    assert expected.shape == (4, width)
  expected = expected @ np.asarray(params[2]["kernel"]) + np.asarray(params[2]["bias"])
  np.testing.assert_allclose(model.apply(params, x), expected, rtol=1e-5, atol=1e-6)
  loop = x  # the stage-by-stage loop Model.apply replaces: the same operations, the same bits
  for stage, p in zip(model.stages, params):
    loop = stage.apply(p, loop, None)
  np.testing.assert_array_equal(model.apply(params, x), loop)
  np.testing.assert_allclose(jax.jit(model.apply)(params, x), expected, rtol=1e-5, atol=1e-6)


def test_apply_gives_each_stage_its_own_randomness():
  dropout = nn.Dropout(0.5, deterministic=False)
  model = pipejax.Model([pipejax.from_flax(dropout, name=f"dropout{s}") for s in range(2)])
  x = jnp.ones((2, 64))
  rng = jax.random.key(3)
  expected = x
  for s in range(2):
    expected = dropout.apply({}, expected, rngs={"dropout": jax.random.fold_in(rng, s)})
  y = model.apply([{}, {}], x, rng)
  np.testing.assert_array_equal(y, expected)
  assert 0 < np.mean(np.asarray(y) == 0) < 1  # dropped, and not everything
  assert not np.array_equal(model.apply([{}, {}], x, jax.random.key(4)), y)


def test_apply_with_variables_evaluates_them_read_only():
  norm = nn.BatchNorm(use_running_average=True)
  model = pipejax.Model([pipejax.from_flax(nn.Dense(3)), pipejax.from_flax(norm)])
  x = jax.random.normal(jax.random.key(1), (4, helpers.IN_DIM))
  params, variables = _init(model, x)
  assert variables[0] is None and variables[1] is not None
  stats = {"mean": jnp.arange(3.0), "var": jnp.full((3,), 4.0)}
  variables[1] = variables[1]._replace(forward={"batch_stats": stats})
  h = x @ params[0]["kernel"] + params[0]["bias"]
  expected = norm.apply({"params": params[1], "batch_stats": stats}, h)
  np.testing.assert_allclose(model.apply(params, x, variables=variables), expected, rtol=1e-6)
  np.testing.assert_allclose(expected, (h - stats["mean"]) / np.sqrt(4.0 + 1e-5), rtol=1e-5)


def test_apply_names_what_does_not_fit():
  model = helpers.dense_model([5])
  x = jnp.zeros((2, helpers.IN_DIM))
  params, variables = _init(model, x)
  with pytest.raises(pipejax.ModelError, match="one params tree per stage: 1 for 2 stages"):
    model.apply(params[:1], x)
  with pytest.raises(pipejax.ModelError, match="one Variables .or None. per stage: 3 for 2"):
    model.apply(params, x, variables=variables + [None])
  with pytest.raises(pipejax.ModelError, match="pass rng=None with variables"):
    model.apply(params, x, jax.random.key(0), [None, variables[1] or object()])


def test_plain_step_is_one_optax_step_on_the_whole_network():
  import optax  # pylint: disable=import-outside-toplevel
  model = helpers.dense_model([5, 3])
  x, y = helpers.make_stream(1, 4)
  params, _ = _init(model, x[0])

  def loss(ps):  # written out: logits of the chained stages, mean cross-entropy
    logits = model.apply(ps, x[0])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y[0]))

  tx = optax.sgd(0.1, momentum=0.9)
  (stepped, opt_state), step_loss = pipejax.core.stages.plain_step(model, tx)(
      (params, tx.init(params)), (x[0], y[0]))
  np.testing.assert_allclose(step_loss, loss(params), rtol=1e-6)
  expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params))
  helpers.assert_trees_close(stepped, expected)
  assert jax.tree.structure(opt_state) == jax.tree.structure(tx.init(params))


@pytest.mark.parametrize("module", [nn.Dense(3), online_norm.OnlineNorm()],
                         ids=["stateless", "online_norm"])
def test_initial_is_init_and_variables_from_one_call(module):
  """``Stage.initial`` (one flax init) makes the bits of ``init`` and ``variables`` called apart,
  and a hand-written stage without ``init_with_variables`` gets the same pair from the two."""
  stage = pipejax.from_flax(module)
  x, key = jax.random.normal(jax.random.key(1), (1, 3)), jax.random.key(2)
  params, variables = stage.initial(key, x)
  chex.assert_trees_all_equal(params, stage.init(key, x))
  chex.assert_trees_all_equal(variables, stage.variables(key, x))
  assert (variables is None) == (module.__class__ is nn.Dense)
  apart = pipejax.Stage(stage.init, stage.apply, init_variables=stage.init_variables,
                        infer_with=stage.infer_with)
  chex.assert_trees_all_equal(apart.initial(key, x), (params, variables))


def test_a_model_traces_once_per_input_signature():
  """Model.trace depends on the shapes and dtypes of the key and the input alone: the pipelines of
  two methods over one model share its trace, and another micro-batch size traces again."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from pipejax import methods  # pylint: disable=import-outside-toplevel
  base = helpers.dense_model([5, 3])
  calls = []

  def counted(stage):
    def initial(rng, x):
      calls.append(x.shape)
      return stage.init_with_variables(rng, x)
    return dataclasses.replace(stage, init_with_variables=initial)

  model = pipejax.Model([counted(stage) for stage in base.stages], base.loss)
  x, y = helpers.make_stream(1, 2)
  pb = pipejax.Pipeline(model, methods.make_method("pb", learning_rate=0.1), x[0], y[0])
  traced = len(calls)
  assert traced == model.num_stages
  stash = pipejax.Pipeline(model, methods.make_method("pipedream", learning_rate=0.1), x[0], y[0])
  assert len(calls) == traced  # the second method's build traced no stage again
  assert stash.spec.stage_input_shapes == pb.spec.stage_input_shapes
  x3, y3 = helpers.make_stream(1, 3)
  wider = pipejax.Pipeline(model, methods.make_method("pb", learning_rate=0.1), x3[0], y3[0])
  assert len(calls) == 2 * traced and wider.spec.stage_input_shapes[1].shape == (3, 5)


BATCH_NORM = dict(train_kwargs={"use_running_average": False},
                  eval_kwargs={"use_running_average": True})


def _batch_norm_pipeline(use_running_average=None, **kwargs):
  """Flax's BatchNorm as stage 0 (its input is the micro-batch itself), then a dense head."""
  from pipejax import methods  # pylint: disable=import-outside-toplevel
  norm = pipejax.from_flax(nn.BatchNorm(use_running_average, momentum=0.5), name="bn", **kwargs)
  model = pipejax.Model([norm, pipejax.from_flax(nn.Dense(helpers.NUM_CLASSES), name="head")])
  x, y = helpers.make_stream(5, 3)
  return pipejax.Pipeline(model, methods.make_method("pb", learning_rate=0.05), x[0], y[0]), x, y


def test_flax_batchnorm_trains_its_running_statistics_and_evaluates_with_them():
  pipe, x, y = _batch_norm_pipeline(**BATCH_NORM)
  state, _ = pipe.run(pipe.init(jax.random.key(0)), x, y)
  # Stage 0 forwarded micro-batch t at tick t: the running statistics are flax's moving
  # averages of the five batch means and (biased) variances, from mean 0 and variance 1.
  mean, var = np.zeros(helpers.IN_DIM), np.ones(helpers.IN_DIM)
  for batch in x.astype(np.float64):
    mean, var = 0.5 * mean + 0.5 * batch.mean(0), 0.5 * var + 0.5 * batch.var(0)
  stats = state.stages[0].variables.forward["batch_stats"]
  np.testing.assert_allclose(stats["mean"], mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stats["var"], var, rtol=1e-5, atol=1e-6)
  # Evaluation reads them, and changes nothing.
  params = [st.params for st in state.stages]
  variables = [st.variables for st in state.stages]
  out = pipe.model.apply(params, x[0], variables=variables)
  scale, bias = params[0]["scale"], params[0]["bias"]
  normalized = (x[0] - mean) / np.sqrt(var + 1e-5) * scale + bias
  expected = normalized @ params[1]["kernel"] + params[1]["bias"]
  np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(state.stages[0].variables.forward["batch_stats"]["mean"],
                                stats["mean"])


def test_flax_batchnorm_frozen_in_training_or_unable_to_evaluate_is_refused_when_built():
  frozen = dict(train_kwargs={"use_running_average": True},
                eval_kwargs={"use_running_average": True})
  with pytest.raises(pipejax.ModelError, match=r"stage 0 \('bn'\) keeps forward variables that "
                     r"its training forward returns unchanged \(\['batch_stats'\]\['mean'\]"):
    _batch_norm_pipeline(**frozen)
  # The other route: statistics updated in training, and by evaluation too, where they are
  # read-only.
  with pytest.raises(pipejax.ModelError, match=r"stage 0 \('bn'\) cannot evaluate: .*immutable"
                     r".*eval_kwargs.*'use_running_average': True") as error:
    _batch_norm_pipeline(use_running_average=False)
  assert "\n" not in str(error.value)


def test_from_flax_refuses_one_set_of_call_arguments_for_both_passes():
  with pytest.raises(pipejax.ModelError, match=r"train_kwargs for training .* eval_kwargs for "
                     r"evaluation; got use_running_average=False on its own.*train_kwargs="
                     r"\{'use_running_average': False\}"):
    pipejax.from_flax(nn.BatchNorm(), use_running_average=False)
  with pytest.raises(pipejax.ModelError, match="eval_kwargs must be a dict"):
    pipejax.from_flax(nn.BatchNorm(), eval_kwargs=["use_running_average"])


class _DenseDropout(nn.Module):
  @nn.compact
  def __call__(self, x, deterministic: bool):
    return nn.Dropout(0.5)(nn.Dense(5)(x), deterministic=deterministic)


def test_flax_dropout_drops_in_training_with_the_stages_key_and_not_in_evaluation():
  from pipejax import methods  # pylint: disable=import-outside-toplevel
  dropout = pipejax.from_flax(_DenseDropout(), name="drop",
                              train_kwargs={"deterministic": False},
                              eval_kwargs={"deterministic": True})
  model = pipejax.Model([dropout, pipejax.from_flax(nn.Dense(helpers.NUM_CLASSES))])
  x, y = helpers.make_stream(4, 3)
  pipe = pipejax.Pipeline(model, methods.make_method("pb", learning_rate=0.0), x[0], y[0])
  state = pipe.init(jax.random.key(0))
  params = jax.tree.map(np.array, [st.params for st in state.stages])  # run() donates the state
  trained = dropout.apply(params[0], x[0], jax.random.key(1))
  assert 0 < np.mean(np.asarray(trained) == 0) < 1  # some units dropped in training
  plain = x[0] @ params[0]["Dense_0"]["kernel"] + params[0]["Dense_0"]["bias"]
  np.testing.assert_allclose(dropout.infer(params[0], x[0]), plain, rtol=1e-6)
  evaluated = model.apply(params, x[0], variables=[None, None])
  np.testing.assert_allclose(
      evaluated, plain @ params[1]["kernel"] + params[1]["bias"], rtol=1e-5, atol=1e-6)
  # In the pipeline the dropout draws from the stage's key: the losses differ from evaluation's.
  _, metrics = pipe.run(state, x, y)
  valid = np.asarray(metrics["valid"])
  losses = [float(model.loss(model.apply(params, x[t], variables=[None, None]), y[t])[0])
            for t in np.asarray(metrics["sample"])[valid]]
  assert not np.allclose(np.asarray(metrics["loss"])[valid], losses)
  # A dropout that needs a key in evaluation too is refused when the pipeline is built.
  always = pipejax.from_flax(nn.Dropout(0.5, deterministic=False), name="always")
  with pytest.raises(pipejax.ModelError, match=r"stage 0 \('always'\) cannot evaluate: .*"
                     r"'deterministic': True"):
    pipejax.Pipeline(pipejax.Model([always] + list(model.stages[1:])),
                     methods.make_method("pb", learning_rate=0.0), x[0], y[0])


def test_flax_attention_takes_its_mask_as_a_call_argument_of_each_pass():
  from pipejax import methods  # pylint: disable=import-outside-toplevel
  length, width = 4, 8
  attention = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.5)
  # Two equal masks, not one object: arrays in the two sets are compared without their ``==``.
  stage = pipejax.from_flax(
      attention, name="attention",
      train_kwargs={"mask": nn.make_causal_mask(jnp.ones((1, length))), "deterministic": False},
      eval_kwargs={"mask": nn.make_causal_mask(jnp.ones((1, length))), "deterministic": True})
  model = pipejax.Model([stage, pipejax.from_flax(nn.Dense(3), name="head")])
  x = np.random.default_rng(0).standard_normal((2, length, width)).astype(np.float32)
  pipe = pipejax.Pipeline(model, methods.make_method("pb", learning_rate=0.05), x,
                          np.zeros((2, length), np.int32))
  params = jax.tree.map(np.array, [st.params for st in pipe.init(jax.random.key(0)).stages])
  # Evaluated at another batch size: causal (a later position does not change an earlier one's
  # output) and without dropout.
  batch = np.random.default_rng(1).standard_normal((5, length, width)).astype(np.float32)
  changed = batch.copy()
  changed[:, -1] += 1.0
  out, out_changed = (model.apply(params, b, variables=[None, None]) for b in (batch, changed))
  np.testing.assert_allclose(out[:, :-1], out_changed[:, :-1], rtol=1e-5, atol=1e-6)
  assert not np.allclose(out[:, -1], out_changed[:, -1])
  expected = attention.apply({"params": params[0]}, batch, mask=nn.make_causal_mask(
      jnp.ones((1, length))), deterministic=True)
  np.testing.assert_allclose(stage.infer(params[0], batch), expected, rtol=1e-6)
