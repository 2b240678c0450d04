"""Every method preset through the engine against the naive oracle (docs/design.md §2, §3)."""

import dataclasses
import importlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax
from pipejax import methods
from pipejax.core.engine import Pipeline
from tests import oracle
from tests.helpers import (NUM_CLASSES, WIDTHS, assert_trees_close, make_model, make_stream,
                           leaves_equal, stage_params)

LR, M = 0.05, 0.9
ANNEAL, GAMMA = 6, 0.7  # short annealing so the oracle run crosses k = K
DC = 3.0  # DC-ASGD's lambda, large so that its correction shows above float rounding
B1, B2, ADAM_LR = 0.8, 0.95, 0.01

# The presets on Adam (optimizer='adam'), against AdamW written out in numpy.
ADAM_ORACLES = {
    "pb": oracle.OracleMethod(lambda d: oracle.Adam(ADAM_LR, B1, B2)),
    "pb_sc": oracle.OracleMethod(lambda d: oracle.Adam(ADAM_LR, B1, B2, d,
                                                       spike_compensation=True)),
    "pb_sc_lwp": oracle.OracleMethod(lambda d: oracle.Adam(ADAM_LR, B1, B2, d,
                                                           spike_compensation=True),
                                     forward="predicted_update"),
    "pipedream": oracle.OracleMethod(lambda d: oracle.Adam(ADAM_LR, B1, B2), backward="stashed"),
}

ORACLES = {
    "sgd": oracle.OracleMethod(lambda d: oracle.Accumulate(oracle.Momentum(LR, M), 1)),
    "sync": oracle.OracleMethod(lambda d: oracle.Accumulate(oracle.Momentum(LR, M), 2)),
    "pb": oracle.OracleMethod(lambda d: oracle.Momentum(LR, M)),
    "pb_sc": oracle.OracleMethod(lambda d: oracle.Momentum(LR, M, d, spike_compensation=True)),
    "pb_lwp": oracle.OracleMethod(lambda d: oracle.Momentum(LR, M), forward="predicted_update"),
    "pb_sc_lwp": oracle.OracleMethod(lambda d: oracle.Momentum(LR, M, d, spike_compensation=True),
                                     forward="predicted_update"),
    "pipedream": oracle.OracleMethod(lambda d: oracle.Momentum(LR, M), backward="stashed"),
    "spectrain": oracle.OracleMethod(lambda d: oracle.Momentum(LR, M),
                                     forward="predicted_next_velocity"),
    "dcasgd": oracle.OracleMethod(lambda d: oracle.DelayCompensated(LR, M, strength=DC),
                                  backward="stashed"),
    "pipemare": oracle.OracleMethod(lambda d: oracle.PipeMareRule(LR, M, d, ANNEAL, GAMMA),
                                    backward="pipemare"),
}


# The presets defined for Adam only, against their update rules written out in numpy.
ADAM_KWARGS = {"learning_rate": ADAM_LR, "momentum": B1, "b2": B2, "optimizer": "adam",
               "anneal_steps": ANNEAL, "micro_batches": 2}
MAX_DELAY = 2 * (make_model().num_stages - 1)
ORACLES.update({
    "pipeoptim": oracle.OracleMethod(lambda d: oracle.Adam(ADAM_LR, B1, B2), forward="rule"),
    "nesterov_asyncpp": oracle.OracleMethod(
        lambda d: oracle.NAdam(ADAM_LR, B1, B2, d, MAX_DELAY, ANNEAL), backward="stashed"),
    "pb_muon": oracle.OracleMethod(lambda d: oracle.Muon(ADAM_LR, B1, B2)),
    "muon": oracle.OracleMethod(lambda d: oracle.Accumulate(oracle.Muon(ADAM_LR, B1, B2), 1)),
    "pb_muon_sc_lwp": oracle.OracleMethod(
        lambda d: oracle.Muon(ADAM_LR, B1, B2, delay=d, spike_compensation=True),
        forward="predicted_update"),
    "nesterov_asyncpp_released": oracle.OracleMethod(
        lambda d: oracle.TorchNAdam(ADAM_LR, B1, B2, 0.004), backward="stashed"),
})
# On momentum SGD, error feedback around the heavy ball.
ORACLES["pb_error_feedback"] = oracle.OracleMethod(
    lambda d: oracle.ErrorFeedback(oracle.Momentum(LR, M), d))
ORACLES["pb_muon_error_feedback"] = oracle.OracleMethod(
    lambda d: oracle.ErrorFeedback(oracle.Muon(ADAM_LR, B1, B2), d))
def pipedream_muon_oracle(micro_batches):
  """PipeDream + Muon written out: the numpy Muon on the mean of each M stashed gradients."""
  return oracle.OracleMethod(
      lambda d: oracle.Accumulate(oracle.Muon(ADAM_LR, B1, B2), micro_batches),
      backward="stashed")


ORACLES["pipedream_muon"] = pipedream_muon_oracle(ADAM_KWARGS["micro_batches"])


def delay_warmup_rate(delay):
  """PipeMare's rate written out: step k takes lr max(D, 1)^-(1 - min(k / K, 1))."""
  return lambda k: ADAM_LR * max(delay, 1) ** -(1 - min(k / ANNEAL, 1.0))


ORACLES["pb_muon_delay_warmup"] = oracle.OracleMethod(
    lambda d: oracle.Muon(delay_warmup_rate(d), B1, B2))
# Prediction along Muon's applied step, with and without stashing the predicted weights.
ORACLES["pb_muon_lwp"] = oracle.OracleMethod(lambda d: oracle.Muon(ADAM_LR, B1, B2),
                                             forward="predicted_update")
ORACLES["pipedream_muon_lwp"] = oracle.OracleMethod(
    lambda d: oracle.Muon(ADAM_LR, B1, B2), forward="predicted_update", backward="stashed")


def asyncpp_b1(delay):
  """AsyncPP's per-stage first moment written out: b1 + D (0.99 - b1) / (D_max + 1)."""
  return B1 + delay * (0.99 - B1) / (MAX_DELAY + 1)


ORACLES["pipedream_muon_delay_adaptive"] = oracle.OracleMethod(
    lambda d: oracle.Muon(delay_warmup_rate(d), asyncpp_b1(d), B2), backward="stashed")


def taking(name, **kwargs):
  """The keywords of ``kwargs`` that preset ``name``'s hyperparameters have."""
  return {key: value for key, value in kwargs.items() if key in methods.preset_of(name).fields()}


def test_every_preset_has_an_oracle():
  assert sorted(ORACLES) == sorted(methods.METHODS)


def test_every_preset_has_a_name_for_reports():
  assert set(methods.METHODS) <= set(methods.DISPLAY_NAMES)


def test_no_two_presets_share_a_colour():
  # A figure with one series per method (the phase diagram draws every preset a study ran) must
  # tell each apart.
  colours = [preset.color for preset in methods.PRESETS.values()]
  assert len(colours) == len(set(colours)), sorted(c for c in colours if colours.count(c) > 1)


def tolerance(name):
  """How close the preset stays to its oracle."""
  if "sgd" in methods.optimizers_of(name):
    return {"rtol": 1e-5, "atol": 2e-6}
  return {"rtol": 1e-4, "atol": 1e-5}  # the Adam family: float32 division by sqrt(v) rounds more


@functools.cache
def oracle_stream():
  return make_stream(3 * make_model().num_stages + 2, 2)


@functools.cache
def preset_pipeline(name):
  """The preset's pipeline as the oracle comparison builds it."""
  model = make_model()
  if "sgd" in methods.optimizers_of(name):
    method = methods.make_method(name, **taking(name, learning_rate=LR, momentum=M,
                                                micro_batches=2, anneal_steps=ANNEAL,
                                                gamma=GAMMA, dc_strength=DC))
  else:
    method = methods.make_method(name, **taking(name, num_stages=model.num_stages,
                                                **ADAM_KWARGS))
  x, y = oracle_stream()
  return Pipeline(model, method, x[0], y[0])


@functools.cache
def initial_params():
  """The weights every preset's pipeline starts from in the oracle comparison (key 7)."""
  return stage_params(preset_pipeline("pb").init(jax.random.PRNGKey(7)))


@functools.cache
def oracle_result(name):
  """The naive oracle's (final weights, metrics) for preset ``name`` from :func:`initial_params`
  over :func:`oracle_stream`, and the stream as the preset's pipeline ticks it."""
  pipe = preset_pipeline(name)
  x, y, valid = pipe.to_ticks(*oracle_stream())
  expected, metrics = oracle.run_oracle(pipe.model, ORACLES[name], initial_params(), x, y, valid)
  return expected, metrics, (x, y, valid)


@pytest.mark.parametrize("name", methods.METHODS)
def test_preset_matches_naive_oracle(name):
  pipe = preset_pipeline(name)
  state = pipe.init(jax.random.PRNGKey(7))
  # Every method starts from the same weights at a key: the oracle's, computed once.
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(stage_params(state)),
                                                  jax.tree.leaves(initial_params())))
  expected, expected_metrics, ticks = oracle_result(name)
  state, metrics = pipe.run(state, *ticks)
  assert_trees_close(stage_params(state), expected, **tolerance(name))
  np.testing.assert_allclose(np.asarray(metrics["loss"]), [m["loss"] for m in expected_metrics],
                             **tolerance(name))


def test_the_oracles_the_presets_match_differ_from_each_other():
  """The oracle comparison would pass vacuously if presets did the same thing. Each preset is
  within its tolerance of its own oracle (above), so oracles that differ by far more than twice
  that tolerance make presets that differ."""
  finals = {name: np.concatenate([np.ravel(a) for a in jax.tree.leaves(oracle_result(name)[0])])
            for name in methods.METHODS}
  names = sorted(finals)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      atol = max(tolerance(a)["atol"], tolerance(b)["atol"])
      assert np.abs(finals[a] - finals[b]).max() > 20 * atol, (a, b)


@pytest.mark.parametrize("name", sorted(ADAM_ORACLES))
def test_adam_presets_match_naive_oracle(name):
  method = methods.make_method(name, learning_rate=ADAM_LR, momentum=B1, b2=B2, optimizer="adam")
  model = make_model()
  x, y = make_stream(3 * model.num_stages + 2, 2)
  pipe = Pipeline(model, method, x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(3))
  expected, _ = oracle.run_oracle(model, ADAM_ORACLES[name], stage_params(state), x, y)
  state, _ = pipe.run(state, x, y)
  assert_trees_close(stage_params(state), expected, rtol=1e-4, atol=1e-5)


def test_pipedream_muon_without_accumulation_matches_its_oracle():
  """The preset's oracle comparison above runs it at M = 2 (a stage updates once per two of its
  backwards, and the pipeline never flushes); this is the plain method, M = 1."""
  method = methods.make_method("pipedream_muon", learning_rate=ADAM_LR, momentum=B1, b2=B2,
                               optimizer="adam")
  assert method.micro_batches_per_flush is None and method.micro_batches_per_update == 1
  model = make_model()
  x, y = make_stream(3 * model.num_stages + 2, 2)
  pipe = Pipeline(model, method, x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(3))
  expected, _ = oracle.run_oracle(model, pipedream_muon_oracle(1), stage_params(state), x, y)
  state, _ = pipe.run(state, x, y)
  assert_trees_close(stage_params(state), expected, rtol=1e-4, atol=1e-5)


def test_an_accumulating_method_refuses_a_count_of_micro_batches_that_is_not_a_positive_int():
  for bad in (0, -2, 1.5, True, "4"):
    with pytest.raises(methods.MethodError, match="micro_batches must be an int >= 1"):
      methods.make_method("pipedream_muon", learning_rate=ADAM_LR, optimizer="adam",
                          micro_batches=bad)


@pytest.mark.parametrize("name", ["spectrain", "pipemare"])
def test_momentum_only_methods_refuse_adam(name):
  with pytest.raises(methods.MethodError, match="defined for the base optimizer"):
    methods.make_method(name, learning_rate=0.1, optimizer="adam")


def test_weight_discrepancy_is_the_distance_between_forward_and_backward_weights():
  """PB's backward at tick t uses w(t); the sample's forward used w(t - D): their distance."""
  model = make_model()
  x, y = make_stream(3 * model.num_stages, 1)
  method = methods.make_method("pb", learning_rate=LR, momentum=M)
  tracked = Pipeline(model, method, x[0], y[0], track_weight_discrepancy=True)
  plain = Pipeline(model, method, x[0], y[0])
  state, reference = tracked.init(jax.random.PRNGKey(1)), plain.init(jax.random.PRNGKey(1))
  history, seen = [], []
  for t in range(len(x)):
    history.append([np.concatenate([np.ravel(a) for a in jax.tree.leaves(p)])
                    for p in stage_params(state)])
    state, metrics = tracked.tick(state, x[t], y[t])
    reference, _ = plain.tick(reference, x[t], y[t])
    seen.append(np.asarray(metrics["weight_discrepancy"]))
  for t, row in enumerate(seen):
    for s, delay in enumerate(tracked.delays):
      if t < delay:
        assert row[s] == 0  # nothing backwarded yet
        continue
      then, now = history[t - delay][s], history[t][s]
      np.testing.assert_allclose(row[s], np.linalg.norm(then - now) / np.linalg.norm(now),
                                 rtol=1e-4, atol=1e-7)
  assert max(r[0] for r in seen) > 1e-4  # stage 0 (delay 6) saw its weights move
  assert_trees_close(stage_params(state), stage_params(reference), rtol=1e-6, atol=1e-7)


def test_unknown_method_lists_the_known_ones():
  with pytest.raises(methods.MethodError, match="Unknown method 'pb_magic'.*pb_sc_lwp.*pipemare"):
    methods.make_method("pb_magic", learning_rate=0.1)


def test_sync_takes_a_numpy_integer_group_size():
  method = methods.make_method("sync", learning_rate=0.1, micro_batches=np.int64(4))
  assert method.micro_batches_per_flush == 4 and type(method.micro_batches_per_flush) is int


@pytest.mark.parametrize("kwargs, message", [
    ({"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
    ({"horizon": -1}, "horizon must be an int >= 0"),
    ({"micro_batches": 0}, "micro_batches must be an int >= 1"),
    ({"learning_rate": -0.1}, r"learning_rate must be in \[0, inf\); got -0.1"),
    ({"learning_rate": float("nan")}, r"learning_rate must be in \[0, inf\); got nan"),
    ({"learning_rate": "0.1"}, "learning_rate must be a number; got '0.1' \\(str\\)"),
    ({"weight_decay": -1.0}, r"weight_decay must be in \[0, inf\)"),
    ({"optimizer": "adam", "b2": 1.0}, r"b2 must be in \[0, 1\)"),
    ({"gamma": 1.5}, r"gamma must be in \[0, 1\)"),
    ({"anneal_steps": -5}, r"anneal_steps must be in \[0, inf\)"),
])
def test_bad_hyperparameters_are_clear_errors(kwargs, message):
  name = ("sync" if "micro_batches" in kwargs
          else "pipemare" if {"gamma", "anneal_steps"} & set(kwargs) else "pb_lwp")
  with pytest.raises(methods.MethodError, match=message):
    methods.make_method(name, **{"learning_rate": 0.1, **kwargs})


@pytest.mark.parametrize("name", ["pb_sc_lwp", "pipedream"])
def test_full_pipeline_fast_path_matches_naive_oracle(name):
  """Pipeline.run drops the empty-slot guard once every slot is full; the numbers stay right."""
  method = methods.make_method(name, learning_rate=LR, momentum=M)
  model = make_model()
  x, y = make_stream(4 * model.num_stages, 1)
  pipe = Pipeline(model, method, x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(5))
  init_params = stage_params(state)
  split = 2 * model.num_stages  # past the fill: every delay line is full
  state, first = pipe.run(state, x[:split], y[:split])
  assert pipe.every_slot_full(state)
  state, second = pipe.run(state, x[split:], y[split:])
  expected, expected_metrics = oracle.run_oracle(model, ORACLES[name], init_params, x, y)
  assert_trees_close(stage_params(state), expected, rtol=1e-5, atol=2e-6)
  np.testing.assert_allclose(np.concatenate([first["loss"], second["loss"]]),
                             [m["loss"] for m in expected_metrics], rtol=1e-5, atol=2e-6)


def test_pipeline_is_not_full_during_fill():
  model = make_model()
  x, y = make_stream(2 * model.num_stages - 2, 1)
  pipe = Pipeline(model, methods.make_method("pb", learning_rate=LR), x[0], y[0])
  state, _ = pipe.run(pipe.init(jax.random.PRNGKey(0)), x, y)
  assert not pipe.every_slot_full(state)  # stage 0's 7-slot line has seen only 6 inputs


def test_sgd_with_pipemare_rates_gives_each_layer_its_stages_reon_ticks_rate():
  # Closed form: from zero momentum, the first update of a layer is -lr / max(D, 1) * g; after
  # K steps of annealing every layer is at the base rate.
  method = methods.sgd_with_pipemare_rates({"a": 6, "b": 2, "c": 0}, learning_rate=0.1,
                                           momentum=0.0, anneal_steps=4)
  assert method.name == "sgd" and method.micro_batches_per_flush == 1
  tx = method.optimizer(0)
  params = {name: jnp.ones(2) for name in "abc"}
  grads = {name: jnp.full(2, 2.0) for name in "abc"}
  state = tx.init(params)
  updates, state = tx.update(grads, state, params)
  np.testing.assert_allclose(updates["a"], -0.1 / 6 * 2.0, rtol=1e-6)
  np.testing.assert_allclose(updates["b"], -0.1 / 2 * 2.0, rtol=1e-6)
  np.testing.assert_allclose(updates["c"], -0.1 * 2.0, rtol=1e-6)
  for _ in range(4):
    updates, state = tx.update(grads, state, params)
  np.testing.assert_allclose(updates["a"], -0.1 * 2.0, rtol=1e-6)
  with pytest.raises(methods.MethodError, match="no delay for the layers"):
    tx.init({"d": jnp.ones(2)})


WD = 0.5  # large, so that a decayed bias would move visibly in a few steps


@pytest.mark.parametrize("name, rule", [
    ("pb", lambda d, mask: oracle.Adam(ADAM_LR, B1, B2, weight_decay=WD, decay_mask=mask)),
    ("pb_sc", lambda d, mask: oracle.Adam(ADAM_LR, B1, B2, d, spike_compensation=True,
                                          weight_decay=WD, decay_mask=mask)),
    ("nesterov_asyncpp", lambda d, mask: oracle.NAdam(ADAM_LR, B1, B2, d, MAX_DELAY, ANNEAL,
                                                      weight_decay=WD, decay_mask=mask)),
])
def test_adamw_decay_mask_spares_biases(name, rule):
  """decay_mask=True: AdamW decays the kernels only; the (1-D) biases take no decay."""
  model = make_model()
  x, y = make_stream(3 * model.num_stages + 2, 2)
  method = methods.make_method(name, **taking(name, weight_decay=WD, decay_mask=True,
                                              num_stages=model.num_stages, **ADAM_KWARGS))
  pipe = Pipeline(model, method, x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(4))
  init_params = stage_params(state)
  backward = "stashed" if name == "nesterov_asyncpp" else "current"
  masked, _ = oracle.run_oracle(model, oracle.OracleMethod(lambda d: rule(d, True),
                                                           backward=backward),
                                init_params, x, y)
  unmasked, _ = oracle.run_oracle(model, oracle.OracleMethod(lambda d: rule(d, False),
                                                             backward=backward),
                                  init_params, x, y)
  state, _ = pipe.run(state, x, y)
  assert_trees_close(stage_params(state), masked, rtol=1e-4, atol=1e-5)
  biases = lambda tree: [b for stage in tree for b in jax.tree.leaves(stage) if b.ndim == 1]
  assert max(np.abs(a - b).max() for a, b in zip(biases(masked), biases(unmasked))) > 1e-3


def warmup_cosine(peak, warmup_steps, total_steps):
  """The trainer's learning-rate schedule (pipejax.train.experiment), written out: from 0 up to
  ``peak`` linearly over ``warmup_steps``, then half a cosine down to 0 at ``total_steps``."""
  def rate(k):
    if k < warmup_steps:
      return peak * k / warmup_steps
    done = min(k - warmup_steps, total_steps - warmup_steps) / (total_steps - warmup_steps)
    return peak * 0.5 * (1 + np.cos(np.pi * done))
  return rate


def test_adam_pb_sc_lwp_with_masked_decay_under_a_schedule_matches_naive_oracle():
  """The LM study's PB + SC + LWP (configs/studies/lm_depth.py): Adam-form Spike Compensation,
  AdamW's decoupled decay on the kernels only (decay_mask=True), a warm-up + cosine learning rate
  that scales the decay as well, and the forward on the applied update's linear prediction.

  Biases start away from zero, so that decaying them, or not decaying the kernels, would move
  both the weights and the predictions they extrapolate."""
  biased = nn.initializers.normal(0.5)
  model = pipejax.Model(
      [pipejax.from_flax(nn.Sequential([nn.Dense(w, bias_init=biased), nn.tanh]), name=f"dense{w}")
       for w in WIDTHS] + [pipejax.from_flax(nn.Dense(NUM_CLASSES, bias_init=biased), name="head")])
  num_stages, ticks = model.num_stages, 4 * model.num_stages
  schedule = optax.warmup_cosine_decay_schedule(0.0, ADAM_LR, 2, ticks)
  method = methods.make_method("pb_sc_lwp", learning_rate=schedule, momentum=B1, b2=B2,
                               optimizer="adam", weight_decay=WD, decay_mask=True)
  x, y = make_stream(ticks, 2)
  pipe = Pipeline(model, method, x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(6))
  init_params = stage_params(state)

  def run_oracle(num_ticks, weight_decay=WD, decay_mask=True):
    rule = lambda d: oracle.Adam(warmup_cosine(ADAM_LR, 2, ticks), B1, B2, d,
                                 spike_compensation=True, weight_decay=weight_decay,
                                 decay_mask=decay_mask)
    return oracle.run_oracle(model, oracle.OracleMethod(rule, forward="predicted_update"),
                             init_params, x[:num_ticks], y[:num_ticks])

  expected, expected_metrics = run_oracle(ticks)
  before_last, _ = run_oracle(ticks - 1)
  state, metrics = pipe.run(state, x, y)
  assert_trees_close(stage_params(state), expected, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(metrics["loss"]), [m["loss"] for m in expected_metrics],
                             rtol=1e-4, atol=1e-5)
  # Every stage updated at the last tick; its forward now runs on w_T + D_s (w_T - w_{T-1}).
  for s, st in enumerate(state.stages):
    delay = 2 * (num_stages - 1 - s)
    predicted = jax.tree.map(lambda now, then, d=delay: now + d * (now - then), expected[s],
                             before_last[s])
    assert_trees_close(method.forward_weights(st.params, st.opt_state, pipe.delays[s]),
                       predicted, rtol=1e-4, atol=1e-5)
  # The decay and its mask each move the weights well past the tolerance.
  for changed in ({"decay_mask": False}, {"weight_decay": 0.0}):
    other, _ = run_oracle(ticks, **changed)
    gap = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(other),
                                                  jax.tree.leaves(expected)))
    assert gap > 1e-3, changed


def test_decay_mask_needs_adam():
  with pytest.raises(methods.MethodError, match="decay_mask=True masks AdamW"):
    methods.make_method("pb", learning_rate=0.1, weight_decay=1e-4, decay_mask=True)


def test_nesterov_asyncpp_needs_the_stage_count():
  with pytest.raises(methods.MethodError, match="pass make_method\\(..., num_stages=S\\)"):
    methods.make_method("nesterov_asyncpp", learning_rate=1e-3, optimizer="adam")


@pytest.mark.parametrize("name", ["pipeoptim", "nesterov_asyncpp", "pb_muon"])
def test_adam_family_refuses_momentum_sgd(name):
  with pytest.raises(methods.MethodError, match="defined for the base optimizer\\(s\\) adam"):
    methods.make_method(name, **taking(name, learning_rate=0.1, num_stages=4))


@pytest.mark.parametrize("name", methods.METHODS)
def test_traits_agree_with_the_built_method(name):
  traits = methods.traits_of(name)
  kwargs = ({"learning_rate": LR, "micro_batches": 3} if "sgd" in methods.optimizers_of(name)
            else dict(ADAM_KWARGS, num_stages=4, micro_batches=3))
  method = methods.make_method(name, **taking(name, **kwargs))
  given = taking(name, **kwargs)
  hyperparameters = methods.hyperparameters_of(name, given.pop("learning_rate"), **given)
  assert hyperparameters.micro_batches_per_update == method.micro_batches_per_update
  with pytest.warns(DeprecationWarning, match="micro_batches_per_update"):
    assert traits.micro_batches_per_step(3) == method.micro_batches_per_update
  # Only a method that drains between steps never computes on stale weights.
  assert traits.delay_free == (method.micro_batches_per_flush is not None)


def test_traits_name_the_baselines_and_the_recommendation():
  having = lambda field: [n for n in methods.METHODS if getattr(methods.traits_of(n), field)]
  assert having("one_stage") == ["muon", "sgd"]
  assert having("plain_pipeline") == ["pb"]
  assert having("recommended") == [methods.RECOMMENDED] == ["pb_sc_lwp"]
  assert not methods.traits_of(methods.RECOMMENDED).delay_free
  with pytest.raises(methods.MethodError,
                     match="Unknown method 'gpipe'. Known methods: dcasgd, muon"):
    methods.traits_of("gpipe")


def test_stage_rates_build_the_one_stage_baseline():
  method = methods.STAGE_RATES["pipemare"]({"a": 2, "b": 0}, learning_rate=0.1)
  assert methods.traits_of(method.name).one_stage and method.micro_batches_per_flush == 1


def test_the_baseline_takes_stage_rates_as_a_hyperparameter():
  """``sgd``'s ``stage_rates`` (config.method_kwargs.sgd.stage_rates) gives each layer PipeMare's
  rate for its stage's delay: a layer at delay 4 starts at a quarter of the rate."""
  method = methods.make_method("sgd", learning_rate=0.1, momentum=0.0, stage_rates="pipemare",
                               layer_delays={"a": 4, "b": 0}, anneal_steps=100)
  params = {"a": jnp.ones(()), "b": jnp.ones(())}
  tx = method.optimizer(0)
  updates, _ = tx.update({"a": jnp.ones(()), "b": jnp.ones(())}, tx.init(params), params)
  assert float(updates["a"]) == pytest.approx(-0.1 / 4) and float(updates["b"]) == \
      pytest.approx(-0.1)
  with pytest.raises(methods.MethodError, match="stage_rates='pipemare' needs layer_delays"):
    methods.make_method("sgd", learning_rate=0.1, stage_rates="pipemare")
  with pytest.raises(methods.MethodError, match="stage_rates must be '' .* or one of pipemare"):
    methods.make_method("sgd", learning_rate=0.1, stage_rates="pb")
  with pytest.raises(methods.MethodError, match="it needs optimizer='sgd'"):
    methods.make_method("sgd", learning_rate=0.1, optimizer="adam", stage_rates="pipemare",
                        layer_delays={"a": 0})


def test_a_preset_refuses_a_hyperparameter_it_does_not_read():
  with pytest.raises(methods.MethodError, match="Method 'pb' takes no micro_batches: nothing "
                     "would read it. Its hyperparameters are learning_rate, momentum"):
    methods.make_method("pb", learning_rate=0.1, micro_batches=8)


@pytest.mark.parametrize("name", methods.METHODS)
def test_each_preset_is_one_module_holding_its_preset(name):
  preset = methods.preset_of(name)
  module = importlib.import_module(f"pipejax.methods.{name}")
  assert module.PRESET is preset and preset.name == name
  assert dataclasses.is_dataclass(preset.hyperparameters)
  assert issubclass(preset.hyperparameters, methods.Hyperparameters)
  assert preset.display_name == methods.DISPLAY_NAMES[name]


def test_the_builders_keep_their_names_beside_the_preset_modules():
  assert methods.pb is pipejax.methods.method.pb and callable(methods.pb)
  assert methods.pipedream.__module__ == "pipejax.methods.method"
  assert methods.sync.__module__ == "pipejax.methods.method"
  assert methods.pb(optax.sgd(0.1)).name == "pb"


# m = 0.99918 is heavy-ball momentum 0.9 at batch 128 scaled to batch 1 (docs/design.md §4).
_BATCH_ONE_MOMENTUM = 0.99918


def _after_unit_gradients(name, dtype, steps=2000):
  """A preset's method, weights, state and last update after ``steps`` unit gradients on 2x2
  weights of ``dtype`` (learning rate 1e-6: the weights stay near 1), with its first base
  optimizer (Adam's first moment, b1 = m, stalls in bfloat16 as a momentum trace does)."""
  # Nesterov AsyncPP takes b1 <= 0.99, where a bfloat16 first moment stalls near 0.9 of its value.
  momentum = 0.99 if name == "nesterov_asyncpp" else _BATCH_ONE_MOMENTUM
  method = methods.make_method(name, learning_rate=1e-6, momentum=momentum,
                               optimizer=methods.preset_of(name).optimizers[0],
                               **taking(name, num_stages=4))
  optimizer = method.optimizer(1)
  params = {"w": jnp.ones((2, 2), dtype)}
  grads = {"w": jnp.ones((2, 2), dtype)}

  def step(carry, _):
    params, state = carry
    extra = {"gradient_params": params} if method.pass_gradient_weights else {}
    updates, state = optimizer.update(grads, state, params, **extra)
    return (optax.apply_updates(params, updates), state), updates

  (params, state), updates = jax.jit(lambda p: jax.lax.scan(
      step, (p, optimizer.init(p)), None, length=steps))(params)
  return method, params, state, jax.tree.map(lambda u: u[-1], updates)


@pytest.mark.parametrize("name", methods.METHODS)
def test_bfloat16_weights_keep_a_float32_momentum_that_does_not_stall(name):
  """In bfloat16, 0.99918 * 256 + 1 rounds to 256: a trace kept in the weights' dtype stalls
  there instead of reaching about 983 after 2000 unit gradients (1200 at its limit)."""
  *_, reference = _after_unit_gradients(name, jnp.float32)
  method, params, state, update = _after_unit_gradients(name, jnp.bfloat16)
  assert update["w"].dtype == params["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(update["w"], np.float32), reference["w"], rtol=0.02)
  # The weights the passes use keep the weights' dtype.
  for view in (method.forward_weights, method.backward_weights):
    assert view(params, state, 1)["w"].dtype == jnp.bfloat16


def test_float32_weights_get_each_presets_own_updates_bit_for_bit():
  """make_method's float32 state changes nothing on float32 weights: the preset, built
  without it, gives the same bits."""
  params = {"w": jax.random.normal(jax.random.PRNGKey(0), (3, 2))}
  grads = [{"w": jax.random.normal(jax.random.PRNGKey(k), (3, 2))} for k in range(1, 4)]
  for name in methods.METHODS:
    kwargs = dict(learning_rate=0.1, momentum=0.9, optimizer=methods.preset_of(name).optimizers[0],
                  **taking(name, num_stages=4))
    wrapped = methods.make_method(name, **kwargs)
    learning_rate = kwargs.pop("learning_rate")
    bare = methods.preset_of(name).build(methods.hyperparameters_of(name, learning_rate, **kwargs))
    results = []
    for method in (wrapped, bare):
      optimizer, p = method.optimizer(2), params
      state = optimizer.init(p)
      for g in grads:
        extra = {"gradient_params": p} if method.pass_gradient_weights else {}
        updates, state = optimizer.update(g, state, p, **extra)
        p = optax.apply_updates(p, updates)
      results.append((p, method.forward_weights(p, state, 2)))
    leaves_equal(results[0], results[1])


@pytest.mark.parametrize("old, new", [("RECORDS", "PRESETS"), ("record_of", "preset_of"),
                                      ("Record", "Preset")])
def test_the_presets_old_names_answer_with_a_warning_naming_the_new(old, new):
  with pytest.warns(DeprecationWarning, match=f"replaced by pipejax.methods.{new}"):
    assert getattr(methods, old) is getattr(methods, new)


def test_the_old_preset_module_answers_with_a_warning_naming_the_new():
  from pipejax.methods import record  # pylint: disable=import-outside-toplevel
  with pytest.warns(DeprecationWarning, match=r"replaced by pipejax\.methods\.preset\.Preset"):
    assert record.Record is methods.Preset
  with pytest.raises(AttributeError):
    _ = record.RECORD
