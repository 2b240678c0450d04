"""Every preset checks its hyperparameters in one place (``hyperparameters.check_number``),
whatever form they arrive in: Python numbers, jax arrays as ``optax.inject_hyperparams`` passes
them, schedules; and a config's annealing lengths are checked before a run starts."""

import jax
import jax.numpy as jnp
import optax
import pytest

from pipejax import methods
from pipejax.train import config_checks

from tests.helpers import digits_config

# The presets whose updates are optax's own transforms (optax.sgd, optax.adamw,
# optax.contrib.muon), which check nothing themselves.
OPTAX_BUILT = ("pb", "sgd", "sync", "pipedream", "pb_lwp", "pb_error_feedback", "muon", "pb_muon",
               "pipedream_muon", "pb_muon_error_feedback")


def _base(name):
  preset = methods.preset_of(name)
  return {"optimizer": preset.optimizers[-1]} | (
      {"num_stages": 2} if "num_stages" in preset.fields() else {})


@pytest.mark.parametrize("name", methods.METHODS)
@pytest.mark.parametrize("kwargs, message", [
    ({"momentum": jnp.asarray(1.0)}, r"momentum must be in \[0, 1\); got 1.0"),
    ({"learning_rate": jnp.asarray(-0.1)}, r"learning_rate must be in \[0, inf\); got -0.1"),
    ({"weight_decay": jnp.asarray(jnp.inf)}, r"weight_decay must be in \[0, inf\); got inf"),
    ({"momentum": optax.constant_schedule(0.9)}, "momentum must be a number; got the function"),
    ({"momentum": jnp.ones(2)}, "momentum must be a real number"),
])
def test_every_preset_refuses_an_array_or_a_schedule_out_of_its_range(name, kwargs, message):
  with pytest.raises(methods.MethodError, match=message):
    methods.make_method(name, **{"learning_rate": 0.1, **_base(name), **kwargs})


def test_a_momentum_rounded_to_one_in_bfloat16_says_how_to_keep_it():
  with pytest.raises(methods.MethodError, match=r"got 1.0. It is a bfloat16 array.*"
                     r"hyperparam_dtype=jnp.float32"):
    methods.make_method("pb_muon", learning_rate=0.1, optimizer="adam",
                        momentum=jnp.asarray(0.999, jnp.bfloat16))


@pytest.mark.parametrize("name", OPTAX_BUILT)
def test_a_preset_under_inject_hyperparams_is_checked_at_init_and_trains_under_jit(name):
  """The values optax.inject_hyperparams hands over: concrete at init (checked), traced inside
  jit at each update (not comparable, so let through, as pipejax.optim lets them through)."""
  def build(learning_rate, momentum):
    return methods.make_method(name, learning_rate=learning_rate, momentum=momentum,
                               **_base(name)).optimizer(2)
  params = {"w": jnp.ones((3, 3)), "b": jnp.ones(3)}
  with pytest.raises(methods.MethodError, match=r"momentum must be in \[0, 1\); got 1.0"):
    optax.inject_hyperparams(build)(learning_rate=0.1, momentum=1.0).init(params)
  with pytest.raises(methods.MethodError, match=r"learning_rate must be in \[0, inf\)"):
    optax.inject_hyperparams(build)(learning_rate=-0.1, momentum=0.5).init(params)
  tx = optax.inject_hyperparams(build)(learning_rate=optax.linear_schedule(0.1, 0.0, 10),
                                       momentum=0.5)
  updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  assert all(bool(jnp.all(jnp.isfinite(u))) and bool(jnp.all(u < 0))
             for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("name", ["pipemare", "nesterov_asyncpp", "pb_muon_delay_warmup", "sgd"])
@pytest.mark.parametrize("steps", [2.5, float("inf"), True, None, "10", jnp.asarray(10.0)])
def test_an_annealing_length_in_steps_must_be_a_whole_number(name, steps):
  with pytest.raises(methods.MethodError, match="anneal_steps"):
    methods.make_method(name, learning_rate=0.1, anneal_steps=steps, **_base(name))
  methods.make_method(name, learning_rate=0.1, anneal_steps=10.0, **_base(name))  # whole: taken


@pytest.mark.parametrize("key", ["anneal_epochs", "anneal_fraction"])
@pytest.mark.parametrize("value, message", [
    (None, "must be a number; got None"), ("1", "must be a number; got '1'"),
    (True, "must be a number; got True"), (float("inf"), "must be in"),
    (float("nan"), "must be in"), (-1, "must be in")])
def test_an_annealing_length_in_method_kwargs_is_a_config_error(key, value, message):
  config = digits_config(method="pipemare")
  config.method_kwargs = {"pipemare": {key: value}}
  with pytest.raises(config_checks.ConfigError,
                     match=f"config.method_kwargs.pipemare: {key} {message}"):
    config_checks.check_fields(config)
