"""The engine against the naive oracle, the two exact identities, NaN fill, and boundary errors."""

import dataclasses
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax
from pipejax.core import accounting
from pipejax import methods
from pipejax.core import engine
from pipejax.core import initial
from pipejax.core import runner as runnerlib
from pipejax.core.checks import PipelineError
from pipejax.core.engine import Pipeline
from pipejax.models import online_norm
from pipejax.core.state import Packet, raw_key
from pipejax.parallel.stacking import StackedPipeline
from tests import oracle
from tests import helpers
from tests.helpers import (IN_DIM, NUM_CLASSES, WIDTHS, assert_trees_close, leaves_equal,
                           make_model, make_stream, stage_params)

EVEN = (5, 5, 5, 5)  # stages 1..3 identical: the stacked layout runs them as one stack
LAYOUTS = ("per_stage", "stacked")
LR, MOMENTUM = 0.05, 0.9


CASES = {
    "pb": (lambda: methods.pb(optax.sgd(LR, momentum=MOMENTUM)),
           oracle.OracleMethod(lambda d: oracle.Momentum(LR, MOMENTUM))),
    "pipedream": (lambda: methods.pipedream(optax.sgd(LR, momentum=MOMENTUM)),
                  oracle.OracleMethod(lambda d: oracle.Momentum(LR, MOMENTUM),
                                      backward="stashed")),
    "sync": (lambda: methods.sync(optax.sgd(LR, momentum=MOMENTUM), micro_batches=2),
             oracle.OracleMethod(lambda d: oracle.Accumulate(oracle.Momentum(LR, MOMENTUM), 2))),
}


def runner_for(layout, pipe):
  """The pipeline itself, or its stacked layout (which must then hold a stack)."""
  if layout == "per_stage":
    return pipe
  stacked = StackedPipeline(pipe)
  assert stacked.stacked
  return stacked


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_matches_naive_oracle(name, b, layout):
  make_method, oracle_method = CASES[name]
  model = make_model(EVEN if layout == "stacked" else WIDTHS)
  num_stages = model.num_stages
  x, y = make_stream(2 * ((3 * num_stages + 3) // 2), b)  # whole steps of M = 2
  pipe = Pipeline(model, make_method(), x[0], y[0])
  runner = runner_for(layout, pipe)
  x, y, valid = pipe.to_ticks(x, y)
  assert len(valid) >= 3 * num_stages
  logical = pipe.init(jax.random.PRNGKey(42))
  init_params = stage_params(logical)
  expected_params, expected_metrics = oracle.run_oracle(model, oracle_method, init_params, x, y,
                                                        valid)
  state, metrics = runner.run(runner.from_logical(logical), x, y, valid)
  state = runner.to_logical(state)
  assert_trees_close(stage_params(state), expected_params)
  expected_valid = np.array([m["valid"] for m in expected_metrics])
  np.testing.assert_array_equal(np.asarray(metrics["valid"]), expected_valid)
  assert expected_valid.sum() >= 2 * num_stages  # many samples met the loss, not just one
  np.testing.assert_allclose(np.asarray(metrics["loss"]),
                             [m["loss"] for m in expected_metrics], rtol=2e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(metrics["accuracy"]),
                             [m.get("accuracy", 0.0) for m in expected_metrics])
  # The weights did move: the comparison above is not between two untouched initialisations.
  moved = [np.abs(np.asarray(a) - np.asarray(b)).max()
           for a, b in zip(jax.tree.leaves(stage_params(state)), jax.tree.leaves(init_params))]
  assert min(moved) > 1e-4


def make_stateful_model(widths=WIDTHS, stateless=(1,)):
  """Online Norm in every stage but those ``stateless`` and in the head (fast decays, so the
  variables move within a few samples). By default a mix, each stage with its own variable
  shapes."""
  norm = lambda: online_norm.OnlineNorm(alpha_fwd=0.9, alpha_bkw=0.95)
  layer = lambda w, stateful: nn.Sequential([nn.Dense(w)] + ([norm()] if stateful else [])
                                            + [nn.tanh])
  stages = [pipejax.from_flax(layer(w, s not in stateless), name=f"dense{w}")
            for s, w in enumerate(widths)]
  head = nn.Sequential([nn.Dense(NUM_CLASSES), norm()])
  return pipejax.Model(stages + [pipejax.from_flax(head, name="head")])


def stage_variables(state):
  return jax.tree.map(np.array, [st.variables for st in state.stages])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,b", [("pb", 1), ("pipedream", 3)])
def test_stateful_stages_match_naive_oracle(name, b, layout):
  """Forward variables stashed with the input, backward variables advanced by the VJP's increment;
  the delay lines start out NaN, so an empty slot that touched a variable would show."""
  make_method, oracle_method = CASES[name]
  model = (make_stateful_model() if layout == "per_stage"
           else make_stateful_model(EVEN, stateless=(0,)))
  x, y = make_stream(3 * model.num_stages + 2, b)
  pipe = Pipeline(model, make_method(), x[0], y[0])
  runner = runner_for(layout, pipe)
  state = pipe.init(jax.random.PRNGKey(42), fill_value=jnp.nan)
  stateless = 1 if layout == "per_stage" else 0
  assert state.stages[stateless].variables is None
  assert state.stages[stateless].delay_line.variables is None
  init_params, init_variables = stage_params(state), stage_variables(state)
  expected_params, expected_metrics, expected_variables = oracle.run_oracle(
      model, oracle_method, init_params, x, y, init_variables=init_variables)
  state, metrics = runner.run(runner.from_logical(state), x, y)
  state = runner.to_logical(state)
  assert_trees_close(stage_params(state), expected_params, rtol=1e-5, atol=1e-5)
  assert_trees_close(stage_variables(state), expected_variables, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(metrics["loss"]),
                             [m["loss"] for m in expected_metrics], rtol=1e-5, atol=1e-5)
  assert np.asarray(metrics["finite"]).all()
  # Both kinds of variables moved in every stateful stage.
  for before, after in zip(init_variables, stage_variables(state)):
    if before is not None:
      for part in ("forward", "backward"):
        moved = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(getattr(after, part)),
                                                     jax.tree.leaves(getattr(before, part)))]
        assert min(moved) > 1e-3, part


def test_drain_finishes_every_backward_in_flight():
  model = make_model()
  x, y = make_stream(5, 2)
  pipe = Pipeline(model, methods.pb(optax.sgd(LR, momentum=MOMENTUM)), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0))
  init_params = stage_params(state)
  state, run_metrics = pipe.run(state, x, y)
  state, drain_metrics = pipe.drain(state)
  pad = accounting.fill_ticks(model.num_stages)
  x_all = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
  y_all = np.concatenate([y, np.zeros((pad,) + y.shape[1:], y.dtype)])
  valid = np.arange(len(x_all)) < len(x)
  expected_params, expected_metrics = oracle.run_oracle(
      model, CASES["pb"][1], init_params, x_all, y_all, valid)
  assert_trees_close(stage_params(state), expected_params)
  # After draining, every one of the 5 samples has met the loss exactly once.
  met = np.concatenate([run_metrics["sample"][run_metrics["valid"]],
                        drain_metrics["sample"][drain_metrics["valid"]]])
  np.testing.assert_array_equal(met, np.arange(5))
  assert sum(m["valid"] for m in expected_metrics) == 5


@pytest.mark.parametrize("name", ["pb", "pipedream"])
def test_nan_in_empty_slots_never_reaches_weights_or_metrics(name):
  model = make_model()
  x, y = make_stream(3 * model.num_stages, 1)
  pipe = Pipeline(model, CASES[name][0](), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0), fill_value=jnp.nan)
  # The delay lines and registers really start out poisoned.
  assert np.isnan(np.asarray(state.stages[1].delay_line.x)).all()
  state, metrics = pipe.run(state, x, y)
  for leaf in jax.tree.leaves((stage_params(state), [st.opt_state for st in state.stages])):
    assert np.isfinite(np.asarray(leaf)).all()
  for key, value in metrics.items():
    assert np.isfinite(np.asarray(value, np.float64)).all(), key
  assert np.asarray(metrics["finite"]).all()
  # Poison stays only in slots flagged empty (stage 0's line is 7 slots, 12 ticks: all real now).
  assert np.isfinite(np.asarray(state.stages[0].delay_line.x)).all()


def test_single_stage_is_plain_optax_training():
  model = pipejax.Model([pipejax.from_flax(nn.Dense(NUM_CLASSES))])
  x, y = make_stream(10, 3)
  tx = optax.sgd(LR, momentum=MOMENTUM)
  pipe = Pipeline(model, methods.pb(tx), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0))
  params = stage_params(state)[0]
  state, metrics = pipe.run(state, x, y)

  def loss_fn(p, xb, yb):
    return model.loss(model.stages[0].apply(p, xb, None), yb)[0]

  def step(carry, batch):
    p, opt = carry
    loss, g = jax.value_and_grad(loss_fn)(p, *batch)
    u, opt = tx.update(g, opt, p)
    return (optax.apply_updates(p, u), opt), loss

  (params, _), losses = jax.lax.scan(step, (params, tx.init(params)), (x, y))
  assert_trees_close(state.stages[0].params, params, rtol=1e-7, atol=0)
  np.testing.assert_allclose(metrics["loss"], losses, rtol=1e-7)


def test_synchronous_mode_is_minibatch_sgd_at_batch_m_times_b():
  model = make_model()
  m, b, steps = 3, 2, 4
  x, y = make_stream(m * steps, b)
  tx = optax.sgd(LR, momentum=MOMENTUM)
  pipe = Pipeline(model, methods.sync(tx, micro_batches=m), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0))
  params = stage_params(state)
  state, _ = pipe.run(state, *pipe.to_ticks(x, y))

  def loss_fn(ps, xb, yb):
    return model.loss(model.apply(ps, xb), yb)[0]

  opt = tx.init(params)
  for k in range(steps):
    xb = x[k * m:(k + 1) * m].reshape((m * b, IN_DIM))
    yb = y[k * m:(k + 1) * m].reshape((m * b,))
    g = jax.grad(loss_fn)(params, xb, yb)
    u, opt = tx.update(g, opt, params)
    params = optax.apply_updates(params, u)
  assert_trees_close(stage_params(state), params, rtol=1e-5, atol=1e-6)


def test_held_stash_bytes_equal_the_formula():
  model = make_model()
  b = 3
  x, y = make_stream(1, b)
  pipe = Pipeline(model, methods.pb(optax.sgd(LR)), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0))
  # By hand: inputs of widths 6, 5, 7, 3 held D_s + 1 = 7, 5, 3, 1 times, float32, b = 3.
  by_hand = 4 * b * (7 * IN_DIM + 5 * 5 + 3 * 7 + 1 * 3)
  assert pipe.spec.stash_bytes() == by_hand
  assert pipe.held_stash_bytes(state) == by_hand
  assert [st.delay_line.valid.shape[0] for st in state.stages] == [7, 5, 3, 1]


def test_misfitting_stage_names_both_stages_and_shapes():
  stages = [pipejax.from_flax(nn.Dense(5), name="wide"),
            pipejax.from_flax(nn.Dense(3), name="picky", input_shape=(7,)),
            pipejax.from_flax(nn.Dense(NUM_CLASSES))]
  x, y = make_stream(1, 2)
  with pytest.raises(pipejax.ModelError, match=r"stage 0 \('wide'\).*\(2, 5\).*stage 1 "
                     r"\('picky'\).*\(7,\)"):
    Pipeline(pipejax.Model(stages), methods.pb(optax.sgd(LR)), x[0], y[0])


def test_conv_stage_fed_a_vector_is_a_clear_error():
  stages = [pipejax.from_flax(nn.Dense(5), name="dense"),
            pipejax.from_flax(nn.Conv(4, (3, 3)), name="conv")]
  x, y = make_stream(1, 2)
  with pytest.raises(pipejax.ModelError, match=r"stage 0 \('dense'\) produces \(2, 5\).*"
                     r"stage 1 \('conv'\) cannot take"):
    Pipeline(pipejax.Model(stages), methods.pb(optax.sgd(LR)), x[0], y[0])


def test_no_stages_is_a_clear_error():
  with pytest.raises(pipejax.ModelError, match="at least one stage"):
    pipejax.Model([])


def test_empty_micro_batch_is_a_clear_error():
  with pytest.raises(PipelineError, match="b must be at least 1"):
    Pipeline(make_model(), methods.pb(optax.sgd(LR)), np.zeros((0, IN_DIM), np.float32),
             np.zeros((0,), np.int32))


def test_wrong_batch_shape_or_dtype_is_a_clear_error():
  x, y = make_stream(4, 2)
  pipe = Pipeline(make_model(), methods.pb(optax.sgd(LR)), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0))
  with pytest.raises(PipelineError, match=r"inputs have shape \(4, 3, 6\).*built for \(4, 2, 6\)"):
    pipe.run(state, np.zeros((4, 3, IN_DIM), np.float32), y)
  with pytest.raises(PipelineError, match=r"inputs have shape \(4, 2, 6\) float64"):
    pipe.run(state, x.astype(np.float64), y)
  with pytest.raises(PipelineError, match=r"labels have shape \(2,\) float32.*"
                     r"cast the labels \(e.g. .astype\(np.int32\)\)"):
    pipe.tick(state, x[0], y[0].astype(np.float32))
  with pytest.raises(PipelineError, match="leading time axis"):
    pipe.run(state, np.float32(1.0), np.int32(0))
  with pytest.raises(PipelineError, match=r"inputs have \[4\] ticks and the labels \[3\]"):
    pipe.run(state, x, y[:3])
  with pytest.raises(PipelineError, match=r"K micro-batches each; their leading axes are \[3, 4\]"):
    pipe.to_ticks(x, y[:3])


def test_a_model_or_method_of_the_wrong_kind_is_named():
  x, y = make_stream(1, 2)
  with pytest.raises(PipelineError, match="method must be a pipejax Method.*got GradientTransf"):
    Pipeline(make_model(), optax.sgd(LR), x[0], y[0])
  with pytest.raises(PipelineError, match=r"model must be a pipejax.Model.*got list"):
    Pipeline(list(make_model().stages), methods.pb(optax.sgd(LR)), x[0], y[0])


def test_wrong_number_of_classes_is_a_clear_error():
  x, y = make_stream(1, 2)
  model = pipejax.Model([pipejax.from_flax(nn.Dense(3))])
  y = np.zeros((2, 5), np.int32)  # labels of the wrong rank for cross-entropy
  with pytest.raises(PipelineError, match="loss cannot take"):
    Pipeline(model, methods.pb(optax.sgd(LR)), x[0], y)


def test_a_loss_without_its_metrics_dict_is_named():
  x, y = make_stream(1, 2)
  bare = lambda logits, labels: pipejax.softmax_cross_entropy(logits, labels)[0]
  model = pipejax.Model(make_model().stages, loss=bare)
  with pytest.raises(PipelineError, match=r"must return a pair \(scalar loss, dict of scalar"):
    Pipeline(model, methods.pb(optax.sgd(LR)), x[0], y[0])


def test_an_integer_parameter_is_named_with_its_stage():
  x, y = make_stream(1, 2)
  counted = pipejax.Stage(lambda rng, x: {"w": jnp.zeros((IN_DIM, 3)), "n": jnp.array(3)},
                          lambda p, x, rng: x @ p["w"] + p["n"])
  with pytest.raises(PipelineError, match=r"trainable parameter \['n'\] of dtype int32"):
    Pipeline(pipejax.Model([counted]), methods.pb(optax.sgd(LR)), x[0], y[0])


def test_batchnorm_stage_is_refused_at_micro_batch_one_only():
  stage = pipejax.from_flax(nn.BatchNorm(use_running_average=None), name="bn",
                            train_kwargs={"use_running_average": False},
                            eval_kwargs={"use_running_average": True})
  model = pipejax.Model([stage, pipejax.from_flax(nn.Dense(4))])
  x, y = make_stream(1, 1)
  with pytest.raises(pipejax.ModelError, match="batch_stats.*micro-batch size 1.*OnlineNorm"):
    Pipeline(model, methods.pb(optax.sgd(LR)), x[0], y[0])
  # At b > 1 its running statistics are forward variables like any other stage state.
  x, y = make_stream(1, 3)
  state = Pipeline(model, methods.pb(optax.sgd(LR)), x[0], y[0]).init(jax.random.PRNGKey(0))
  assert set(state.stages[0].variables.forward) == {"batch_stats"}


@pytest.mark.parametrize("backend", sorted(runnerlib.REGION_ANALYSIS_OPTION))
def test_every_backends_compiler_option_is_one_xla_knows(backend):
  # XLA's debug options are shared by its backends, so a CPU compile refuses a misspelled GPU
  # option as it would on a GPU, where CI never runs.
  option = runnerlib.REGION_ANALYSIS_OPTION[backend]
  jax.jit(lambda x: x + 1, compiler_options={option: True}).lower(jnp.ones(3)).compile()
  with pytest.raises(Exception, match="No such compile option"):
    jax.jit(lambda x: x + 1, compiler_options={option + "_typo": True}).lower(
        jnp.ones(3)).compile()


def test_synchronous_stream_without_its_bubbles_is_refused():
  model = make_model()
  x, y = make_stream(8, 1)
  pipe = Pipeline(model, CASES["sync"][0](), x[0], y[0])
  with pytest.raises(PipelineError,
                     match=r"inputs, labels, valid = pipe.to_ticks\(inputs, labels\)"):
    pipe.run(pipe.init(jax.random.PRNGKey(0)), x, y)
  on_ticks = pipe.to_ticks(x, y)
  pipe.run(pipe.init(jax.random.PRNGKey(0)), *on_ticks)  # laid out, it runs


@pytest.mark.parametrize("runner_class", ["Pipeline", "StackedPipeline", "ShardedPipeline"])
def test_every_runner_has_the_protocols_members_as_instance_methods(runner_class):
  from pipejax.parallel import sharding  # pylint: disable=import-outside-toplevel
  from pipejax.core.runner import Runner  # pylint: disable=import-outside-toplevel
  cls = {"Pipeline": Pipeline, "StackedPipeline": StackedPipeline,
         "ShardedPipeline": sharding.ShardedPipeline}[runner_class]
  assert Runner in cls.__mro__
  for name in ("init", "run", "tick", "drain", "to_ticks", "to_logical", "from_logical",
               "every_slot_full"):
    assert inspect.isfunction(inspect.getattr_static(cls, name)), f"{runner_class}.{name}"


def test_every_runner_schedules_a_synchronous_stream_alike():
  x, y = make_stream(8, 1)
  pipe = Pipeline(make_model(), CASES["sync"][0](), x[0], y[0])
  for runner in (pipe, StackedPipeline(pipe)):
    on_ticks = runner.to_ticks(x, y)
    m = pipe.method.micro_batches_per_flush
    assert on_ticks[0].shape[0] == 8 // m * (m + 2 * (pipe.num_stages - 1))
    jax.tree.map(np.testing.assert_array_equal, on_ticks, pipe.to_ticks(x, y))
    runner.run(runner.init(0), *on_ticks)


def test_init_takes_typed_keys_raw_keys_and_seeds_alike():
  x, y = make_stream(4, 1)
  pipe = Pipeline(make_model(), CASES["pb"][0](), x[0], y[0])
  states = [pipe.init(key) for key in (jax.random.PRNGKey(3), jax.random.key(3), 3)]
  for state in states[1:]:
    jax.tree.map(np.testing.assert_array_equal, state, states[0])
  pipe.run(states[1], x, y)  # a state made from a typed key is this pipeline's own


def test_the_init_compilers_emitters_make_the_weights_xla_makes_by_default():
  # INIT_COMPILER picks XLA:CPU's faster-compiling emitters for the initial state: a choice of
  # speed only, so it must give the default emitters' bits, over the initializers and the many
  # weight shapes of a transformer and a residual MLP.
  from pipejax import models  # pylint: disable=import-outside-toplevel
  default = {k: v for k, v in initial.INIT_COMPILER.items()
             if k != "xla_cpu_use_fusion_emitters"}
  assert default != initial.INIT_COMPILER
  cases = ((models.build("transformer_lm", num_classes=256, blocks=2, width=16, heads=2),
            jnp.zeros((1, 8)), jnp.zeros((1, 8), jnp.int32)),
           (models.build("residual_mlp", num_classes=NUM_CLASSES, depth=4, width=8),
            jnp.zeros((1, IN_DIM)), jnp.zeros((1,), jnp.int32)))
  for model, x, y in cases:
    pipe = Pipeline(model, methods.make_method("pb_sc_lwp", learning_rate=LR), x, y)
    key, fill = raw_key(jax.random.PRNGKey(7)), jnp.float32(0)
    lowered = jax.jit(pipe.initial._state).lower(key, fill)  # pylint: disable=protected-access
    ours, xlas = (lowered.compile(compiler_options=options)(key, fill)
                  for options in (initial.INIT_COMPILER, default))
    jax.tree.map(np.testing.assert_array_equal, ours, xlas)


def test_accounting_names_a_stage_count_that_is_not_an_int():
  assert accounting.stage_delays(3) == [4, 2, 0]
  with pytest.raises(ValueError, match=r"num_stages must be an int .*got 2.0"):
    accounting.stage_delays(2.0)
  with pytest.raises(ValueError, match="at least one stage; got num_stages=0"):
    accounting.stage_delays(0)


def _python_delay_sgd(delay):
  if delay > 2:  # a Python branch on the delay: the init cannot be traced with a traced delay
    return optax.sgd(0.05)
  return optax.sgd(0.1, momentum=0.9)


@pytest.mark.parametrize("name", list(methods.METHODS) + ["python_delay"])
def test_state_spec_is_the_shape_of_what_init_makes(name):
  """``state_spec`` is put together from each stage's traced init; it must be exactly the abstract
  value of ``init`` (shapes, dtypes, weak types, structure), traced delay or not."""
  x, y = make_stream(1, 2)
  if name == "python_delay":
    method = methods.pb(_python_delay_sgd)
  else:
    optimizer = methods.optimizers_of(name)[0]
    method = methods.make_method(name, **helpers.taking(
        name, learning_rate=1e-3, optimizer=optimizer, num_stages=len(EVEN) + 1))
  pipe = Pipeline(make_model(EVEN), method, x[0], y[0], track_weight_discrepancy=True)
  whole = jax.eval_shape(pipe.init, jax.random.PRNGKey(0))
  assert jax.tree.structure(pipe.state_spec) == jax.tree.structure(whole)
  for got, want in zip(jax.tree.leaves(pipe.state_spec), jax.tree.leaves(whole)):
    assert (got.shape, got.dtype, got.weak_type) == (want.shape, want.dtype, want.weak_type)
  assert (pipe.initial.stage_program(1)[0] is None) == (name == "python_delay")


def test_pipelines_over_one_model_compile_its_initial_weights_once(monkeypatch):
  """The initial weights depend on the model alone: the pipelines of three methods over one model
  compile them once, start from the same bits, and each compiles only the state around them."""
  compiled = []
  compile_for_init = initial.compiled_for_init
  monkeypatch.setattr(initial, "compiled_for_init",
                      lambda jitted, *args: compiled.append(len(args)) or
                      compile_for_init(jitted, *args))
  x, y = make_stream(1, 2)
  model = pipejax.Model(list(make_model(EVEN).stages))  # a model no other test has initialized
  pipes = [Pipeline(model, methods.make_method(name, learning_rate=0.1), x[0], y[0])
           for name in ("pb", "pipedream", "pb_sc_lwp")]
  states = [pipe.init(jax.random.PRNGKey(3)) for pipe in pipes]
  assert compiled == [1, 3, 3, 3]  # the weights' program (of the key), then each state's
  for state in states[1:]:
    leaves_equal([st.params for st in state.stages], [st.params for st in states[0].stages])
  pipes[0].init(jax.random.key(4))  # a typed key, another seed: the same programs
  assert len(compiled) == 4
  # Traced whole (inside another program), the same state's shapes.
  assert (jax.tree.map(jnp.shape, jax.eval_shape(pipes[1].init, jax.random.PRNGKey(3)))
          == jax.tree.map(jnp.shape, states[1]))


def test_building_and_initializing_runs_each_stages_initialization_once():
  """The engine initializes each stage from the program the model's trace made: a stage's own
  Python runs once, at the build, and the weights are those of the stage's own init."""
  x, y = make_stream(1, 2)
  model = make_model(EVEN)
  calls = [0] * model.num_stages

  def counted(s, stage):
    def initial(rng, x):
      calls[s] += 1
      return stage.init_with_variables(rng, x)
    return dataclasses.replace(stage, init_with_variables=initial)

  counted_model = pipejax.Model([counted(s, st) for s, st in enumerate(model.stages)], model.loss)
  pipe = Pipeline(counted_model, methods.make_method("pb_sc_lwp", learning_rate=0.1), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(3))
  StackedPipeline(pipe).init(jax.random.PRNGKey(3))
  assert calls == [1] * model.num_stages
  stage_keys, _ = pipe.initial.keys(jax.random.PRNGKey(3))
  for s, stage in enumerate(model.stages):
    inputs = jnp.zeros(pipe.spec.stage_input_shapes[s].shape, pipe.spec.stage_input_shapes[s].dtype)
    expected = stage.init(stage_keys[s], inputs)
    assert jax.tree.structure(state.stages[s].params) == jax.tree.structure(expected)
    assert_trees_close(state.stages[s].params, expected)
