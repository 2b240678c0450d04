"""Bad input to the optax API: gradients and params that do not fit, and hyperparameters out of
range, directly and through ``optax.inject_hyperparams``."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipejax import optim
from pipejax.optim import adam_family


PARAMS = jnp.ones(3)


def _lwp(**kwargs):
  return optim.linear_weight_prediction(optax.sgd(0.1, momentum=0.9), 2, **kwargs)


def _lwp_velocity(form, **kwargs):
  return optim.linear_weight_prediction(lambda rate: optax.sgd(rate, momentum=0.9), 2, form=form,
                                        learning_rate=0.1, **kwargs)


# Every transformation of pipejax.optim, built for PARAMS.
TRANSFORMS = {
    "adam_sc": lambda: optim.adam_sc(0.1, 2),
    "adam_sc with weight decay": lambda: optim.adam_sc(0.1, 2, weight_decay=0.1),
    "scale_by_adam_sc": lambda: optim.scale_by_adam_sc(2),
    "sgd_sc": lambda: optim.sgd_sc(0.1, 2, 0.9),
    "spike_compensation": lambda: optim.spike_compensation(2, 0.9),
    "delay_gradients": lambda: optim.delay_gradients(2),
    "delay_compensation": lambda: optim.delay_compensation(0.04),
    "pipemare": lambda: optim.pipemare(0.1, 2, 0.9, 10),
    "pipemare_discrepancy": lambda: optim.pipemare_discrepancy(),
    "linear_weight_prediction update": _lwp,
    "linear_weight_prediction update outermost": lambda: _lwp(outermost=True),
    "linear_weight_prediction velocity": lambda: _lwp_velocity("velocity"),
    "linear_weight_prediction next_velocity": lambda: _lwp_velocity("next_velocity",
                                                                    momentum=0.9),
    "linear_weight_prediction velocity outermost": lambda: _lwp_velocity("velocity",
                                                                         outermost=True),
    "adam_weight_prediction": lambda: adam_family.adam_weight_prediction(0.1, 2),
    "nesterov_asyncpp": lambda: adam_family.nesterov_asyncpp(0.1, 2, 4, 10),
    "nesterov_asyncpp as released": lambda: adam_family.nesterov_asyncpp(
        0.1, 2, b1=0.99, adaptive_momentum=False, lr_correction=False),
    "delayed_error_feedback": lambda: optim.delayed_error_feedback(optax.adamw(0.1), 2),
    "muon_sc": lambda: optim.muon_sc(0.1, 2, weight_decay=0.1, adam_weight_decay=0.1),
}

WRONG_GRADIENTS = {
    "(1,)": jnp.ones(1), "()": jnp.ones(()), "(4,)": jnp.ones(4), "(3, 1)": jnp.ones((3, 1)),
    "dict": {"w": jnp.ones(3)}, "list": [jnp.ones(3)],
}


@pytest.mark.parametrize("gradients", sorted(WRONG_GRADIENTS))
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_every_transform_refuses_gradients_that_do_not_fit_the_params(name, gradients):
  tx = TRANSFORMS[name]()
  state = tx.init(PARAMS)
  extra = {"gradient_params": PARAMS} if name == "delay_compensation" else {}
  with pytest.raises(ValueError, match="the gradients must have the structure and leaf shapes"
                     ) as error:
    tx.update(WRONG_GRADIENTS[gradients], state, PARAMS, **extra)
  assert "\n" not in str(error.value)
  # Under jit too (the check is on shapes, known when tracing).
  with pytest.raises(ValueError, match="the gradients must have"):
    jax.jit(lambda g, s: tx.update(g, s, PARAMS, **extra))(WRONG_GRADIENTS[gradients], state)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_every_transform_takes_gradients_that_fit_and_none_for_frozen_leaves(name):
  tx = TRANSFORMS[name]()
  params = {"w": PARAMS, "frozen": jnp.ones(2)}
  state = tx.init(params)
  extra = {"gradient_params": params} if name == "delay_compensation" else {}
  updates, _ = tx.update({"w": jnp.ones(3), "frozen": jnp.ones(2)}, state, params, **extra)
  assert jax.tree.map(jnp.shape, updates) == {"w": (3,), "frozen": (2,)}
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))


BAD_HYPERPARAMETERS = {
    # (factory, good keyword arguments, bad ones: name -> values, expected message)
    "adam_weight_prediction": (
        adam_family.adam_weight_prediction, dict(learning_rate=0.1, horizon=2),
        {"b1": (1.0, -0.1), "b2": (1.0, 1.5), "eps": (-1e-8, float("nan")),
         "weight_decay": (-0.1,), "learning_rate": (-0.1,)}),
    "nesterov_asyncpp": (
        adam_family.nesterov_asyncpp, dict(learning_rate=0.1, delay=2, max_delay=4,
                                           anneal_steps=10),
        {"b2": (1.0, 1.5), "eps": (-1e-8,), "weight_decay": (-0.1,), "delay": (2.5, 6),
         "max_delay": (4.5,), "learning_rate": (-0.1, float("nan"))}),
    "adam_sc": (
        optim.adam_sc, dict(learning_rate=0.1, delay=2),
        {"b1": (1.0,), "b2": (1.0,), "eps": (-1e-8,), "weight_decay": (-0.1,), "delay": (2.5,)}),
    "scale_by_adam_sc": (
        optim.scale_by_adam_sc, dict(delay=2),
        {"b1": (1.0,), "b2": (1.0,), "eps": (-1e-8,), "delay": (2.5,)}),
}

HYPERPARAMETER_CASES = [(name, key, value, injected)
                        for name, (_, _, bad) in BAD_HYPERPARAMETERS.items()
                        for key, values in bad.items() for value in values
                        for injected in (False, True)]


@pytest.mark.parametrize("name, key, value, injected", HYPERPARAMETER_CASES,
                         ids=[f"{n}-{k}={v}-{'injected' if i else 'direct'}"
                              for n, k, v, i in HYPERPARAMETER_CASES])
def test_adam_family_refuses_hyperparameters_out_of_range(name, key, value, injected):
  factory, good, _ = BAD_HYPERPARAMETERS[name]
  kwargs = dict(good, **{key: value})
  with pytest.raises(ValueError, match=f"{name}: ") as error:
    if injected:  # inject_hyperparams hands the factory jax arrays, concrete at init
      optax.inject_hyperparams(factory)(**kwargs).init(PARAMS)
    else:
      factory(**kwargs)
  assert key in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("name", sorted(BAD_HYPERPARAMETERS))
def test_adam_family_takes_its_defaults_and_edges_of_its_ranges(name):
  factory, good, _ = BAD_HYPERPARAMETERS[name]
  edges = dict(good, eps=0.0, b2=0.0, **({"weight_decay": 0.0} if "weight_decay" in
                                         BAD_HYPERPARAMETERS[name][2] else {}))
  for kwargs in (good, edges):
    for tx in (factory(**kwargs), optax.inject_hyperparams(factory)(**kwargs)):
      updates, _ = tx.update(jnp.ones(3), tx.init(PARAMS), PARAMS)
      assert np.all(np.isfinite(updates))




def test_adam_predicted_params_refuses_weights_or_decays_that_do_not_fit_its_state():
  tx = adam_family.adam_weight_prediction(0.1, 2)
  state = tx.init(PARAMS)
  _, state = tx.update(jnp.ones(3), state, PARAMS)
  for params in (jnp.ones(1), jnp.ones(()), {"w": PARAMS}):
    with pytest.raises(ValueError, match="adam_predicted_params: params must have the structure"):
      adam_family.adam_predicted_params(params, state)
  for kwargs in ({"b1": 1.0}, {"b2": 1.0}, {"eps": -1e-3}):
    with pytest.raises(ValueError, match=f"adam_predicted_params: {next(iter(kwargs))} must be"):
      adam_family.adam_predicted_params(PARAMS, state, **kwargs)
  assert adam_family.adam_predicted_params(PARAMS, state).shape == (3,)


@pytest.mark.parametrize("name", ["adam_sc with weight decay", "adam_weight_prediction",
                                  "nesterov_asyncpp", "sgd_sc with weight decay"])
@pytest.mark.parametrize("params", ["(1,)", "()"])
def test_transforms_that_decay_the_weights_refuse_params_that_do_not_fit(name, params):
  # optax.add_decayed_weights alone would broadcast them into a (3,) update.
  tx = TRANSFORMS_WITH_DECAY[name]()
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match="params must have the structure and leaf shapes"):
    tx.update(jnp.ones(3), state, WRONG_GRADIENTS[params])


TRANSFORMS_WITH_DECAY = {
    "adam_sc with weight decay": TRANSFORMS["adam_sc with weight decay"],
    "adam_weight_prediction": lambda: adam_family.adam_weight_prediction(0.1, 2, weight_decay=0.1),
    "nesterov_asyncpp": lambda: adam_family.nesterov_asyncpp(0.1, 2, 4, 10, weight_decay=0.1),
    "sgd_sc with weight decay": lambda: optim.sgd_sc(0.1, 2, 0.9, weight_decay=0.1),
}



# Every factory that takes a delay, with good values for its other arguments.
DELAY_FACTORIES = {
    "sgd_sc": lambda delay: optim.sgd_sc(0.1, delay, 0.9),
    "spike_compensation": lambda delay: optim.spike_compensation(delay, 0.9),
    "scale_by_adam_sc": lambda delay: optim.scale_by_adam_sc(delay),
    "adam_sc": lambda delay: optim.adam_sc(0.1, delay),
    "nesterov_asyncpp": lambda delay: adam_family.nesterov_asyncpp(0.1, delay, max_delay=400,
                                                                   anneal_steps=10),
    "pipemare": lambda delay: optim.pipemare(0.1, delay, 0.9, 10),
}


@pytest.mark.parametrize("name", sorted(DELAY_FACTORIES))
def test_a_delay_in_a_floating_array_is_refused_since_its_dtype_may_have_rounded_it(name):
  factory = DELAY_FACTORIES[name]
  bfloat16 = jnp.zeros(3, jnp.bfloat16)
  # inject_hyperparams casts a float delay to the params' dtype: 301.0 arrives as bfloat16 300.
  injected = optax.inject_hyperparams(lambda delay: factory(delay))(delay=301.0)
  with pytest.raises(ValueError, match=rf"{name}\w*: delay .*integer dtype.*bfloat16") as error:
    injected.init(bfloat16)
  assert "\n" not in str(error.value) and "Python int" in str(error.value)
  for delay in (jnp.float32(3.0), np.float32(3.0) * np.ones(())):  # a float array, even whole
    with pytest.raises(ValueError, match=rf"{name}\w*: delay .*integer dtype"):
      factory(delay)
  with pytest.raises(ValueError, match=rf"{name}\w*: delay .*integer dtype"):  # traced, under jit
    jax.jit(lambda delay: factory(delay).init(PARAMS))(jnp.float32(3.0))
  # A whole Python number, and an int under inject_hyperparams (which keeps ints as they are).
  state = optax.inject_hyperparams(lambda delay: factory(delay))(delay=301).init(bfloat16)
  assert int(state.hyperparams["delay"]) == 301
  for delay in (301, 301.0, np.int32(301), jnp.int32(301)):
    factory(delay).init(PARAMS)
