"""Tests of the optax transformations in :mod:`pipejax.optim`.

The first half is one shared suite that runs every transformation through the same checks (jit
without recompiling, convergence on a parabola and on Rosenbrock's function,
optax.inject_hyperparams, dtypes, extra arguments); the second half checks each method's own
identities.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import inspect
import pkgutil
from typing import Any, Callable

import jax
import jax.numpy as jnp
import chex
import numpy as np
import optax
import pytest
from absl.testing import parameterized

from pipejax import optim
from pipejax.optim import (Recipe, adam_sc, delay_gradients, linear_weight_prediction, pipemare,
                           pipemare_backward_params, pipemare_discrepancy, pipemare_learning_rate,
                           predicted_params, scale_by_adam_sc, scale_recipe, sgd_sc,
                           spike_coefficients, spike_compensation, steps_for_samples)

# ------------------------------------------------------------------------------------------------
# Problems and helpers.


def parabola(w):
  curvatures = jnp.array([1.0, 0.3])
  return 0.5 * jnp.sum(curvatures * (w - jnp.array([1.0, -2.0]))**2)


def rosenbrock(w):
  return (1.0 - w[0])**2 + 100.0 * (w[1] - w[0]**2)**2


@dataclasses.dataclass(frozen=True)
class Problem:
  loss: Callable[[jax.Array], jax.Array]
  start: tuple[float, float]
  optimum: tuple[float, float]
  steps: int
  tolerance: float  # on the distance to the optimum at the end


PROBLEMS = {
    'parabola': Problem(parabola, (3.0, 1.0), (1.0, -2.0), steps=300, tolerance=1e-3),
    # Delayed momentum must keep lr * lambda_max / (1 - m) below about 1 / D, and the valley's
    # curvature is 2500 times smaller than lambda_max ~ 1000, hence the small rate and many steps
    # (a scan of 20k steps of a 2-vector takes well under a second).
    'rosenbrock': Problem(rosenbrock, (0.0, 0.0), (1.0, 1.0), steps=20_000, tolerance=1e-2),
}


@dataclasses.dataclass(frozen=True)
class Setting:
  """Hyperparameters of a convergence run: the delay is the gradients' staleness."""

  learning_rate: float
  delay: int
  momentum: float


DEFAULT_SETTINGS = {
    'parabola': Setting(learning_rate=0.05, delay=2, momentum=0.9),
    'rosenbrock': Setting(learning_rate=1e-4, delay=2, momentum=0.9),
}


def _delay_line(setting: Setting) -> list[optax.GradientTransformation]:
  return [delay_gradients(setting.delay)] if setting.delay else []


def _nothing(setting: Setting) -> list[optax.GradientTransformation]:
  del setting
  return []


def _current_weights(params, opt_state):
  del opt_state
  return params


def _predicted_weights(params, opt_state):
  return predicted_params(opt_state, params)


@dataclasses.dataclass(frozen=True)
class Case:
  """One transformation under the shared checks.

  The convergence runs use ``chain(*head(setting), factory(**kwargs(setting)), *tail(setting))``
  and take each gradient at ``view(params, opt_state)``; the other checks use the factory alone.
  """

  factory: Callable[..., optax.GradientTransformation]
  kwargs: Callable[[Setting], dict[str, Any]]
  # A numeric hyperparameter to inject and a new value for it (None: it has none).
  injected: tuple[str, Any] | None
  head: Callable[[Setting], list] = _delay_line
  tail: Callable[[Setting], list] = _nothing
  view: Callable[[Any, Any], Any] = _current_weights
  settings: dict[str, Setting] = dataclasses.field(default_factory=lambda: DEFAULT_SETTINGS)
  static_args: tuple[str, ...] = ()

  def optimizer(self, setting: Setting) -> optax.GradientTransformation:
    return optax.chain(*self.head(setting), self.factory(**self.kwargs(setting)),
                       *self.tail(setting))


def _learning_rate_after(setting):
  return [optax.scale_by_learning_rate(setting.learning_rate)]


CASES = {
    'spike_compensation': Case(
        spike_compensation,
        lambda s: dict(delay=s.delay, momentum=s.momentum),
        injected=('momentum', 0.5),
        tail=_learning_rate_after),
    'sgd_sc': Case(
        sgd_sc,
        lambda s: dict(learning_rate=s.learning_rate, delay=s.delay, momentum=s.momentum),
        injected=('learning_rate', 0.01)),
    'scale_by_adam_sc': Case(
        scale_by_adam_sc,
        # b2 = 0.999 is 1.0 in bfloat16, which inject_hyperparams would give it (and be refused).
        lambda s: dict(delay=s.delay, b1=s.momentum, b2=0.99),
        injected=('b1', 0.5),
        tail=_learning_rate_after,
        settings={'parabola': Setting(0.05, 2, 0.9), 'rosenbrock': Setting(1e-3, 2, 0.9)}),
    'adam_sc': Case(
        adam_sc,
        lambda s: dict(learning_rate=s.learning_rate, delay=s.delay, b1=s.momentum, b2=0.99,
                       weight_decay=0.0),
        injected=('delay', 5),
        settings={'parabola': Setting(0.05, 2, 0.9), 'rosenbrock': Setting(1e-3, 2, 0.9)}),
    'lwp_update': Case(
        linear_weight_prediction,
        lambda s: dict(inner=sgd_sc(s.learning_rate, s.delay, s.momentum), horizon=s.delay,
                       form='update'),
        injected=('horizon', 5),
        view=_predicted_weights),
    'lwp_velocity': Case(
        linear_weight_prediction,
        lambda s: dict(inner=lambda rate: optax.sgd(rate, momentum=s.momentum),
                       horizon=s.delay, form='velocity', learning_rate=s.learning_rate),
        injected=('learning_rate', 1.0),
        view=_predicted_weights,
        static_args=('inner',)),
    'delay_gradients': Case(
        delay_gradients,
        lambda s: dict(delay=s.delay),
        injected=None,
        head=_nothing,  # It is the delay line.
        tail=lambda s: [optax.sgd(s.learning_rate, momentum=s.momentum)],
        settings={'parabola': Setting(0.05, 2, 0.5), 'rosenbrock': Setting(5e-4, 1, 0.5)},
        static_args=('delay',)),
    'pipemare': Case(
        pipemare,
        lambda s: dict(learning_rate=s.learning_rate, delay=s.delay, momentum=s.momentum,
                       anneal_steps=100),
        injected=('learning_rate', 0.01),
        # After annealing PipeMare is plain delayed momentum, stable only for smaller lr * D.
        settings={'parabola': Setting(0.02, 2, 0.9), 'rosenbrock': Setting(1e-4, 1, 0.9)}),
    'pipemare_discrepancy': Case(
        pipemare_discrepancy,
        lambda s: dict(gamma=0.9),
        injected=('gamma', 0.5),
        head=lambda s: [optax.sgd(s.learning_rate, momentum=s.momentum)],  # Must come last.
        settings={'parabola': Setting(0.05, 0, 0.9), 'rosenbrock': Setting(5e-4, 0, 0.9)}),
}

CASE_NAMES = sorted(CASES)

_RNG = np.random.default_rng(0)
PARAMS = {'w': _RNG.normal(size=(2, 3)).astype(np.float32),
          'b': _RNG.normal(size=(3,)).astype(np.float32)}
GRADS = [jax.tree.map(lambda p: _RNG.normal(size=p.shape).astype(np.float32), PARAMS)
         for _ in range(4)]


def _tree(tree, dtype=jnp.float32):
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def _bare(case: Case) -> optax.GradientTransformationExtraArgs:
  return optax.with_extra_args_support(case.factory(**case.kwargs(case.settings['parabola'])))


def _injected(case: Case, hyperparam_dtype=None) -> optax.GradientTransformationExtraArgs:
  return optax.inject_hyperparams(case.factory, static_args=case.static_args,
                                  hyperparam_dtype=hyperparam_dtype)(
                                      **case.kwargs(case.settings['parabola']))


def _assert_trees_close(actual, expected, rtol=1e-6, atol=1e-7):
  jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=rtol, atol=atol),
               actual, expected)


def _trees_differ(first, second) -> bool:
  return any(not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
             for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)))


def _trajectory(opt, gradient_fn, start, steps, view=_current_weights):
  """Weights after 0, 1, ..., steps updates, the gradient of update t taken by gradient_fn(t, w)."""

  @jax.jit
  def run(start):
    def body(carry, t):
      params, state = carry
      grads = gradient_fn(t, view(params, state))
      updates, state = opt.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      return (params, state), params

    _, history = jax.lax.scan(body, (start, opt.init(start)), jnp.arange(steps))
    return jnp.concatenate([start[None], history])

  return run(start)


# ------------------------------------------------------------------------------------------------
# The shared suite.


@pytest.mark.parametrize('name', CASE_NAMES)
def test_jit_matches_eager_and_does_not_recompile(name):
  opt = _bare(CASES[name])
  traces = []

  @jax.jit
  def step(params, state, grads):
    traces.append(None)  # Runs once per trace, not per call.
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params, state = _tree(PARAMS), opt.init(_tree(PARAMS))
  eager_params, eager_state = params, state
  for grads in GRADS[:3]:
    params, state = step(params, state, _tree(grads))
    updates, eager_state = opt.update(_tree(grads), eager_state, eager_params)
    eager_params = optax.apply_updates(eager_params, updates)
  assert len(traces) == 1
  _assert_trees_close(params, eager_params, rtol=1e-5, atol=1e-6)
  _assert_trees_close(state, eager_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('problem_name', sorted(PROBLEMS))
@pytest.mark.parametrize('name', CASE_NAMES)
def test_converges(name, problem_name):
  case, problem = CASES[name], PROBLEMS[problem_name]
  opt = case.optimizer(case.settings[problem_name])
  gradient = jax.grad(problem.loss)
  history = _trajectory(opt, lambda t, w: gradient(w), jnp.array(problem.start), problem.steps,
                        view=case.view)
  distance = float(jnp.linalg.norm(history[-1] - jnp.array(problem.optimum)))
  assert distance < problem.tolerance, (
      f'{name} ended {distance:.3g} from the optimum of {problem_name}')


@pytest.mark.parametrize('name', CASE_NAMES)
def test_inject_hyperparams(name):
  case = CASES[name]
  opt, reference = _injected(case), _bare(case)
  traces = []

  @jax.jit
  def step(params, state, grads):
    traces.append(None)
    return opt.update(grads, state, params)

  params = _tree(PARAMS)
  state, reference_state = opt.init(params), reference.init(params)
  changed_state = state
  for i, grads in enumerate(GRADS[:3]):
    updates, state = step(params, state, _tree(grads))
    reference_updates, reference_state = reference.update(_tree(grads), reference_state, params)
    # Injected arrays and plain Python numbers give the same updates.
    _assert_trees_close(updates, reference_updates, rtol=1e-5, atol=1e-6)
    if case.injected is not None:
      changed_updates, changed_state = step(params, changed_state, _tree(grads))
      if i == 0:
        hyperparam, new_value = case.injected
        old = changed_state.hyperparams[hyperparam]
        # jit's cache keys on weak types too (inject_hyperparams leaves ints weakly typed), so
        # the new value keeps the old one's dtype and weak type: zeros_like + value does both.
        changed_state = changed_state._replace(hyperparams={
            **changed_state.hyperparams, hyperparam: jnp.zeros_like(old) + new_value})
  assert len(traces) == 1  # Changing a hyperparameter's value does not retrace.
  if case.injected is not None:
    assert _trees_differ((changed_updates, changed_state.inner_state),
                         (updates, state.inner_state)), f'changing {case.injected} had no effect'


@pytest.mark.parametrize('injected', [False, True], ids=['plain', 'injected'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['float32', 'bfloat16'])
@pytest.mark.parametrize('name', CASE_NAMES)
def test_keeps_dtypes(name, dtype, injected):
  case = CASES[name]
  opt = _injected(case) if injected else _bare(case)
  params = _tree(PARAMS, dtype)
  step = jax.jit(opt.update)
  state = opt.init(params)
  for grads in GRADS[:2]:
    updates, state = step(_tree(grads, dtype), state, params)
    params = optax.apply_updates(params, updates)
  for leaf in jax.tree.leaves(updates) + jax.tree.leaves(params):
    assert leaf.dtype == dtype
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    if jax.tree_util.keystr(path).endswith('.horizon'):  # a float32 scalar, like a step count
      chex.assert_shape(leaf, ())
    elif jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == dtype, jax.tree_util.keystr(path)
    else:
      assert leaf.dtype == jnp.int32, jax.tree_util.keystr(path)


@pytest.mark.parametrize('name', CASE_NAMES)
def test_accepts_extra_arguments(name):
  opt = _bare(CASES[name])
  params = _tree(PARAMS)
  state = opt.init(params)
  updates, new_state = opt.update(_tree(GRADS[0]), state, params, value=jnp.ones([]), key='x')
  expected_updates, expected_state = opt.update(_tree(GRADS[0]), state, params)
  _assert_trees_close((updates, new_state), (expected_updates, expected_state), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Spike Compensation.


def _random_gradients(steps, shape=(5,), seed=1):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(steps)]


def test_spike_coefficients():
  assert spike_coefficients(0, 0.9) == (1.0, 0.0)
  a, b = spike_coefficients(3, 0.5)
  assert (a, b) == (0.125, 1.75)  # b = 1 + 0.5 + 0.25
  a, b = spike_coefficients(jnp.asarray(3), jnp.asarray(0.5))
  np.testing.assert_allclose([a, b], [0.125, 1.75])


def test_spike_compensation_without_delay_is_optax_sgd_bit_for_bit():
  lr, momentum = 0.1, 0.9
  candidates = {
      'chain': optax.chain(spike_compensation(0, momentum), optax.scale_by_learning_rate(lr)),
      'sgd_sc': sgd_sc(lr, 0, momentum),
  }
  reference = optax.sgd(lr, momentum=momentum)
  params = jnp.zeros(5)
  reference_state = reference.init(params)
  states = {name: opt.init(params) for name, opt in candidates.items()}
  trace_state = optax.trace(momentum).init(params)
  sc_state = spike_compensation(0, momentum).init(params)
  for grads in _random_gradients(40):
    expected, reference_state = reference.update(grads, reference_state, params)
    for name, opt in candidates.items():
      updates, states[name] = opt.update(grads, states[name], params)
      np.testing.assert_array_equal(updates, expected, err_msg=name)
    trace_updates, trace_state = optax.trace(momentum).update(grads, trace_state)
    sc_updates, sc_state = spike_compensation(0, momentum).update(grads, sc_state)
    np.testing.assert_array_equal(sc_updates, trace_updates)
    params = optax.apply_updates(params, expected)
  assert int(sc_state.count) == 40


def test_sgd_sc_weight_decay_is_coupled():
  params = jnp.linspace(-1.0, 1.0, 5)
  opt = sgd_sc(0.1, 0, 0.9, weight_decay=0.01)
  reference = optax.chain(optax.add_decayed_weights(0.01), optax.sgd(0.1, momentum=0.9))
  state, reference_state = opt.init(params), reference.init(params)
  for grads in _random_gradients(5):
    updates, state = opt.update(grads, state, params)
    expected, reference_state = reference.update(grads, reference_state, params)
    np.testing.assert_array_equal(updates, expected)
    params = optax.apply_updates(params, updates)


@pytest.mark.parametrize('weight_decay', [0.0, 0.01])
def test_adam_sc_without_delay_is_optax_adam(weight_decay):
  lr = optax.linear_schedule(1e-2, 1e-3, 20)
  opt = adam_sc(lr, 0, b1=0.8, b2=0.99, eps=1e-6, weight_decay=weight_decay)
  reference = optax.adamw(lr, b1=0.8, b2=0.99, eps=1e-6, weight_decay=weight_decay)
  params = jnp.linspace(-1.0, 1.0, 5)
  state, reference_state = opt.init(params), reference.init(params)
  for grads in _random_gradients(30):
    updates, state = opt.update(grads, state, params)
    expected, reference_state = reference.update(grads, reference_state, params)
    np.testing.assert_allclose(updates, expected, rtol=1e-6, atol=1e-9)
    params = optax.apply_updates(params, updates)


def test_adam_sc_compensates_the_first_moment_after_bias_correction():
  delay, b1 = 3, 0.9
  opt = scale_by_adam_sc(delay, b1=b1, b2=0.99, eps=0.0)
  state = opt.init(jnp.zeros(5))
  mu = nu = jnp.zeros(5)
  for t, g in enumerate(_random_gradients(4), start=1):
    updates, state = opt.update(g, state)
    mu, nu = b1 * mu + (1 - b1) * g, 0.99 * nu + 0.01 * g**2
    mu_hat, nu_hat = mu / (1 - b1**t), nu / (1 - 0.99**t)
    expected = (b1**delay * mu_hat + (1 - b1**delay) * g) / jnp.sqrt(nu_hat)
    np.testing.assert_allclose(updates, expected, rtol=2e-5)
  # The first step is a normalised average of one gradient, not a spike D + 1 times too large.
  first, _ = opt.update(jnp.ones(5), opt.init(jnp.zeros(5)))
  np.testing.assert_allclose(first, jnp.ones(5), rtol=1e-6)


@pytest.mark.parametrize('delay', [1, 3])
def test_spike_compensation_follows_undelayed_momentum_once_a_gradient_arrives(delay):
  """One gradient ``g``, computed at update ``t0`` and applied at update ``t0 + D``.

  Undelayed momentum moves the weights by ``-lr m**k g`` at update ``t0 + k``. With SC the weights
  stay put until the gradient arrives; update ``t0 + D`` applies ``-lr (a + b) g``, which is
  ``-lr sum_{k<=D} m**k g``, everything undelayed momentum had applied by then, and update
  ``t0 + D + j`` applies ``-lr a m**j g = -lr m**(D+j) g`` as undelayed momentum does. So
  ``w_sc(t) = w0`` for ``t <= t0 + D`` and ``w_sc(t) = w_momentum(t)`` for ``t > t0 + D``
  (``w(t)``: the weights after ``t`` updates).
  """
  lr, momentum, t0, steps = 0.1, 0.8, 2, 15
  impulse = jnp.array([1.0, -2.0, 0.5])
  start = jnp.array([0.3, 0.1, -0.2])

  def gradient(t, w):
    del w
    return jnp.where(t == t0, 1.0, 0.0) * impulse

  undelayed = _trajectory(optax.sgd(lr, momentum=momentum), gradient, start, steps)
  compensated = _trajectory(
      optax.chain(delay_gradients(delay), sgd_sc(lr, delay, momentum)), gradient, start, steps)
  arrival = t0 + delay
  np.testing.assert_array_equal(compensated[:arrival + 1],
                                jnp.broadcast_to(start, (arrival + 1, 3)))
  np.testing.assert_allclose(compensated[arrival + 1:], undelayed[arrival + 1:], rtol=1e-6,
                             atol=1e-6)
  assert not np.allclose(compensated[arrival], undelayed[arrival])


@pytest.mark.parametrize('delay', [2, 4])
def test_spike_compensation_on_a_linear_loss(delay):
  r"""SC moves like undelayed momentum from update ``D`` on; delayed momentum lags ``D`` updates.

  On ``L(w) = c . w`` every gradient is ``c``. Let ``d(n) = -lr c sum_{j<n} m**j`` be how far one
  gradient has moved the weights ``n`` updates after it was applied by undelayed momentum; the
  weights after ``t`` updates are ``w_mom(t) = w0 + sum_{n=1..t} d(n)``, in closed form
  ``w0 - lr c sum_{n=1..t} (1 - m**n) / (1 - m)``.

  Through ``delay_gradients(D)`` the first ``D`` updates see zeros and update ``s >= D`` sees the
  gradient computed at ``s - D``. By the single-gradient identity (previous test) each gradient
  that has arrived has moved the weights exactly as far as under undelayed momentum, so after
  ``t >= D`` updates the gradients computed at updates ``0 .. t-1-D`` have arrived and

  ``w_sc(t) = w0 + sum_{s=0..t-1-D} d(t - s) = w0 + sum_{n=D+1..t} d(n)
  = w_mom(t) - (w_mom(D) - w0)``:

  SC is undelayed momentum minus the constant contribution of the ``D`` gradients still in
  flight, so from update ``D`` on its steps equal undelayed momentum's steps *at the same update*.
  Plain delayed momentum instead is undelayed momentum shifted in time,
  ``w_del(t) = w_mom(t - D)``, so its steps are the smaller ones of ``D`` updates earlier.
  """
  lr, momentum, steps = 0.05, 0.9, 30
  slope = jnp.array([1.0, -0.5])
  start = jnp.array([2.0, 1.0])

  def gradient(t, w):
    del t
    return jax.grad(lambda w: jnp.dot(slope, w))(w)

  undelayed = _trajectory(optax.sgd(lr, momentum=momentum), gradient, start, steps)
  compensated = _trajectory(
      optax.chain(delay_gradients(delay), sgd_sc(lr, delay, momentum)), gradient, start, steps)
  delayed = _trajectory(
      optax.chain(delay_gradients(delay), optax.sgd(lr, momentum=momentum)), gradient, start,
      steps)

  n = np.arange(steps + 1, dtype=np.float64)
  partial_sums = np.cumsum((1 - momentum**n) / (1 - momentum))  # includes n = 0, which is 0
  closed_form = np.asarray(start) - lr * partial_sums[:, None] * np.asarray(slope)
  np.testing.assert_allclose(undelayed, closed_form, rtol=1e-5, atol=1e-5)

  in_flight = undelayed[delay] - start
  np.testing.assert_allclose(compensated[delay:], undelayed[delay:] - in_flight,
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(compensated[:delay + 1], jnp.broadcast_to(start, (delay + 1, 2)))
  np.testing.assert_allclose(delayed[delay:], undelayed[:steps + 1 - delay], rtol=1e-5, atol=1e-5)
  # Delayed momentum's steps lag; SC's do not.
  sc_steps, delayed_steps = np.diff(compensated, axis=0), np.diff(delayed, axis=0)
  undelayed_steps = np.diff(undelayed, axis=0)
  np.testing.assert_allclose(sc_steps[delay:], undelayed_steps[delay:], rtol=1e-4, atol=1e-6)
  assert np.all(np.abs(delayed_steps[delay:]) < np.abs(undelayed_steps[delay:]))


# ------------------------------------------------------------------------------------------------
# Gradient delay line.


def test_delay_gradients_of_zero_is_the_identity():
  opt = delay_gradients(0)
  params = _tree(PARAMS)
  state = opt.init(params)
  for grads in GRADS:
    updates, state = opt.update(_tree(grads), state, params)
    jax.tree.map(np.testing.assert_array_equal, updates, _tree(grads))
  assert int(state.count) == len(GRADS)


def test_delay_gradients_shifts_the_stream():
  delay, steps = 3, 10
  opt = delay_gradients(delay)
  params = {'a': jnp.zeros(2), 'b': jnp.zeros((2, 2))}
  stream = [{'a': jnp.full(2, t + 1.0), 'b': jnp.full((2, 2), -(t + 1.0))} for t in range(steps)]
  state = opt.init(params)
  assert state.buffer['b'].shape == (delay, 2, 2)
  step = jax.jit(opt.update)
  for t, grads in enumerate(stream):
    updates, state = step(grads, state)
    expected = stream[t - delay] if t >= delay else jax.tree.map(jnp.zeros_like, grads)
    jax.tree.map(np.testing.assert_array_equal, updates, expected)


def test_delay_gradients_under_inject_hyperparams_needs_static_delay():
  opt = optax.inject_hyperparams(delay_gradients, static_args='delay')(delay=2)
  state = opt.init(jnp.zeros(2))
  for t in range(3):
    updates, state = opt.update(jnp.full(2, t + 1.0), state)
  np.testing.assert_array_equal(updates, jnp.full(2, 1.0))
  with pytest.raises(ValueError, match="static_args='delay'"):
    optax.inject_hyperparams(delay_gradients)(delay=2).init(jnp.zeros(2))


# ------------------------------------------------------------------------------------------------
# Linear Weight Prediction.


def _run_prediction(opt, steps=6, params=None):
  """Yields (params after the update, the update, state) for a few random gradients."""
  params = jnp.linspace(-1.0, 1.0, 4) if params is None else params
  state = opt.init(params)
  for grads in _random_gradients(steps, shape=params.shape):
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    yield params, updates, state


def test_update_form_offset_is_horizon_times_last_update():
  horizon = 3
  opt = linear_weight_prediction(sgd_sc(0.1, 2, 0.9), horizon=horizon)
  for params, updates, state in _run_prediction(opt):
    # The update applied, read back from the weights: (w + u) - w may round differently from u.
    chex.assert_trees_all_close(predicted_params(state, params), params + horizon * updates,
                                rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('learning_rate', [0.1, optax.linear_schedule(0.1, 0.01, 5)],
                         ids=['constant', 'schedule'])
def test_velocity_and_update_forms_agree_for_momentum_sgd(learning_rate):
  by_update = _run_prediction(
      linear_weight_prediction(optax.sgd(learning_rate, momentum=0.9), 4))
  by_velocity = _run_prediction(linear_weight_prediction(
      lambda rate: optax.sgd(rate, momentum=0.9), 4, form='velocity', learning_rate=learning_rate))
  for (params, _, update_state), (_, _, velocity_state) in zip(by_update, by_velocity):
    update_offset = predicted_params(update_state, params) - params
    chex.assert_trees_all_close(predicted_params(velocity_state, params) - params, update_offset,
                                rtol=1e-5, atol=1e-7)
    assert np.any(update_offset != 0)


def test_velocity_and_update_forms_differ_under_spike_compensation():
  lr, delay, momentum, horizon = 0.1, 3, 0.9, 3
  a, b = spike_coefficients(delay, momentum)
  opt = linear_weight_prediction(lambda rate: sgd_sc(rate, delay, momentum), horizon,
                                 form='velocity', learning_rate=lr)
  previous_trace = jnp.zeros(4)
  for params, updates, state in _run_prediction(opt):
    trace = optax.tree_utils.tree_get(state, 'trace')
    gradient = trace - momentum * previous_trace
    previous_trace = trace
    velocity_offset = predicted_params(state, params) - params
    np.testing.assert_allclose(velocity_offset, -lr * horizon * trace, rtol=1e-5, atol=1e-6)
    # The update form would be T u = -lr T (a v + b g): it carries the spike b g.
    np.testing.assert_allclose(updates, -lr * (a * trace + b * gradient), rtol=1e-5, atol=1e-6)
    assert not np.allclose(velocity_offset, horizon * updates)


def test_predicted_params_finds_the_prediction_in_nested_states():
  params = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.bfloat16)
  lwp = linear_weight_prediction(optax.sgd(0.1, momentum=0.9), horizon=2)
  optimizers = {
      'chain': optax.chain(optax.clip(10.0), lwp),
      'inject': optax.inject_hyperparams(linear_weight_prediction)(
          inner=optax.sgd(0.1, momentum=0.9), horizon=2),
      'multi_steps': optax.MultiSteps(lwp, every_k_schedule=1),
  }
  grads = jnp.ones(4, jnp.bfloat16)
  for name, opt in optimizers.items():
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    predicted = predicted_params(state, new_params)
    chex.assert_type(predicted, jnp.bfloat16)
    # From the update applied, in float32: w + 2 (w - w_prev).
    new, old = new_params.astype(jnp.float32), params.astype(jnp.float32)
    chex.assert_trees_all_equal(predicted, (new + 2 * (new - old)).astype(jnp.bfloat16))


# ------------------------------------------------------------------------------------------------
# PipeMare.


def test_pipemare_learning_rate_values():
  schedule = pipemare_learning_rate(0.1, delay=4, anneal_steps=100)
  np.testing.assert_allclose(schedule(0), 0.1 / 4, rtol=1e-6)
  np.testing.assert_allclose(schedule(50), 0.1 * 4**-0.5, rtol=1e-6)
  for k in (100, 101, 10_000):
    np.testing.assert_array_equal(schedule(k), jnp.float32(0.1))
  # No delay: nothing to reschedule; no annealing: the base rate at once.
  np.testing.assert_allclose(pipemare_learning_rate(0.1, 0, 100)(0), 0.1, rtol=1e-6)
  np.testing.assert_allclose(pipemare_learning_rate(0.1, 6, 0)(0), 0.1, rtol=1e-6)
  base = optax.linear_schedule(1.0, 0.5, 10)
  np.testing.assert_allclose(pipemare_learning_rate(base, 2, 10)(5), 0.75 * 2**-0.5, rtol=1e-6)


def test_pipemare_discrepancy_tracks_the_applied_updates():
  gamma, delay = 0.7, 3
  opt = pipemare(0.1, delay, 0.9, anneal_steps=4, gamma=gamma)
  params = jnp.linspace(-1.0, 1.0, 4)
  state = opt.init(params)
  delta = jnp.zeros(4)
  for grads in _random_gradients(6, shape=(4,)):
    updates, state = opt.update(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    delta = gamma * delta + (1 - gamma) * (new_params - params)
    params = new_params
    np.testing.assert_allclose(optax.tree_utils.tree_get(state, 'delta'), delta, rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(pipemare_backward_params(state, params, delay),
                               params - delay * delta, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Batch-size scaling.


@pytest.mark.parametrize('form', ['heavy_ball', 'ema'])
def test_scale_recipe_round_trip_and_invariants(form):
  recipe = Recipe(batch_size=256, learning_rate=0.2, momentum=0.9, weight_decay=5e-4, form=form,
                  b2=0.99)
  for batch_size in (1, 16, 1024):
    scaled = scale_recipe(recipe, batch_size)
    back = scale_recipe(scaled, recipe.batch_size)
    assert back.batch_size == recipe.batch_size and back.form == form
    np.testing.assert_allclose([back.learning_rate, back.momentum, back.weight_decay, back.b2],
                               [recipe.learning_rate, recipe.momentum, recipe.weight_decay,
                                recipe.b2], rtol=1e-9)
    # The momentum's and the second moment's decay per sample.
    np.testing.assert_allclose(scaled.momentum**(1 / batch_size),
                               recipe.momentum**(1 / recipe.batch_size), rtol=1e-12)
    np.testing.assert_allclose(scaled.b2**(1 / batch_size), 0.99**(1 / 256), rtol=1e-12)
    # Each sample's total displacement.
    def per_sample(r):
      return r.learning_rate / (r.batch_size * (1 - r.momentum if form == 'heavy_ball' else 1))
    np.testing.assert_allclose(per_sample(scaled), per_sample(recipe), rtol=1e-9)
    assert scaled.weight_decay == recipe.weight_decay


@pytest.mark.parametrize('form', ['heavy_ball', 'ema'])
def test_scaled_recipes_move_the_weights_alike_per_sample(form):
  """Same samples at batch 64 and at batch 4: the weights end in nearly the same place.

  Each sample's gradient is the constant 1 and the weight decay pulls towards 0, so the weight
  after N samples depends on the per-sample displacement and shrinkage that scaling keeps.
  Heavy-ball form: coupled decay (sgd_sc). EMA form: decoupled, lr-scaled decay (adamw-like).
  """
  recipe = Recipe(batch_size=64, learning_rate=0.05, momentum=0.9, weight_decay=0.02, form=form)
  num_samples = 64 * 400
  finals = []
  for r in (recipe, scale_recipe(recipe, 4)):
    w, v = 1.0, 0.0
    for _ in range(steps_for_samples(num_samples, r.batch_size)):
      if form == 'heavy_ball':
        v = r.momentum * v + (1.0 + r.weight_decay * w)
        w -= r.learning_rate * v
      else:
        v = r.momentum * v + (1 - r.momentum) * 1.0
        w -= r.learning_rate * (v + r.weight_decay * w)
    finals.append(w)
  np.testing.assert_allclose(finals[1], finals[0], rtol=0.03)


def test_steps_for_samples():
  assert steps_for_samples(50_000, 128) == 391
  assert steps_for_samples(256, 128) == 2
  assert steps_for_samples(0, 7) == 0


# ------------------------------------------------------------------------------------------------
# In other people's training code: every check under jit and without it (chex.variants).


def _frozen(tree, name):
  """The gradients of a model whose parameter ``name`` is frozen (a None leaf, as optax allows)."""
  return {k: None if k == name else v for k, v in tree.items()}


class LibraryTest(chex.TestCase):
  """The transformations as a library: position in a chain, frozen leaves, optax's knobs."""

  def _apply(self, opt, grads_list, params):
    update = self.variant(opt.update)
    state = opt.init(params)
    for grads in grads_list:
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params, updates, state

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ('adam_then_learning_rate', lambda lwp: optax.chain(
          lwp(optax.scale_by_adam()), optax.scale_by_learning_rate(1e-3))),
      ('sgd_then_clip', lambda lwp: optax.chain(lwp(optax.sgd(1.0)), optax.clip(0.01))),
      ('sgd_sc_alone', lambda lwp: lwp(sgd_sc(0.1, 2, 0.9))),
      ('injected_scale_after', lambda lwp: optax.chain(
          lwp(optax.scale_by_adam()), optax.inject_hyperparams(optax.scale)(step_size=-1e-3))),
  )
  def test_prediction_extrapolates_the_update_applied_wherever_it_sits(self, build):
    horizon = 4
    opt = build(lambda inner: linear_weight_prediction(inner, horizon))
    params = jnp.array([1.0, -2.0])
    state = opt.init(params)
    update = self.variant(opt.update)
    for grads in [jnp.array([0.5, 0.5])] + _random_gradients(3, shape=(2,)):
      updates, state = update(grads, state, params)
      new_params = optax.apply_updates(params, updates)
      expected = np.asarray(new_params) + horizon * (np.asarray(new_params) - np.asarray(params))
      chex.assert_trees_all_close(predicted_params(state, new_params), expected, rtol=1e-6,
                                  atol=1e-7)
      params = new_params

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ('update', dict(form='update')),
      ('velocity', dict(form='velocity', learning_rate=0.1)),
      ('next_velocity', dict(form='next_velocity', learning_rate=0.1, momentum=0.9)),
  )
  def test_outermost_keeps_the_same_prediction_whole(self, kwargs):
    """When nothing follows it, outermost=True gives the prediction of the default mode."""
    inner = sgd_sc(0.1, 2, 0.9)
    if kwargs['form'] != 'update':
      inner = lambda rate: sgd_sc(rate, 2, 0.9)  # pylint: disable=unnecessary-lambda-assignment
    whole = linear_weight_prediction(inner, 3, outermost=True, **kwargs)
    computed = linear_weight_prediction(inner, 3, **kwargs)
    params = jnp.linspace(-1.0, 1.0, 4)
    state, reference = whole.init(params), computed.init(params)
    update, reference_update = self.variant(whole.update), self.variant(computed.update)
    for grads in _random_gradients(4, shape=(4,)):
      updates, state = update(grads, state, params)
      _, reference = reference_update(grads, reference, params)
      new_params = optax.apply_updates(params, updates)
      assert state.previous_params is None and state.offset is None
      chex.assert_trees_all_close(predicted_params(state, new_params),
                                  predicted_params(reference, new_params), rtol=1e-6, atol=1e-6)
      if kwargs['form'] == 'update':  # made at update time from the update (jit may fuse it)
        chex.assert_trees_all_close(predicted_params(state, new_params),
                                    new_params + 3 * updates, rtol=1e-6, atol=1e-7)
      params = new_params

  def test_prediction_of_the_issue_example(self):
    # chain(LWP(scale_by_adam), lr): the documented w1 + 4 u, not [6, 3].
    opt = optax.chain(linear_weight_prediction(optax.scale_by_adam(), 4),
                      optax.scale_by_learning_rate(1e-3))
    params = jnp.array([1.0, -2.0])
    state = opt.init(params)
    updates, state = opt.update(jnp.array([0.5, 0.5]), state, params)
    params = optax.apply_updates(params, updates)
    chex.assert_trees_all_close(predicted_params(state, params), jnp.array([0.995, -2.005]),
                                rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_prediction_follows_weights_projected_after_the_update(self):
    horizon, bound = 3, 0.05
    opt = linear_weight_prediction(optax.sgd(0.1, momentum=0.9), horizon)
    params = jnp.zeros(3)
    state = opt.init(params)
    update = self.variant(opt.update)
    for grads in _random_gradients(4, shape=(3,)):
      updates, state = update(grads, state, params)
      projected = jnp.clip(optax.apply_updates(params, updates), -bound, bound)
      expected = projected + horizon * (projected - params)
      chex.assert_trees_all_close(predicted_params(state, projected), expected, rtol=1e-6,
                                  atol=1e-7)
      params = projected
    assert np.all(np.abs(params) == bound)  # the projection did bite

  @chex.variants(with_jit=True, without_jit=True)
  def test_one_prediction_per_stage_under_multi_transform(self):
    """Two stages with their own horizons and a frozen embedding: merged, no MaskedNode."""
    horizons = {'stage0': 4, 'stage1': 2}
    params = {'stage0': {'w': jnp.ones((2, 3))}, 'stage1': {'w': -jnp.ones(3)},
              'embedding': jnp.full(2, 0.5)}
    labels = {'stage0': {'w': 'stage0'}, 'stage1': {'w': 'stage1'}, 'embedding': 'frozen'}
    opt = optax.multi_transform(
        {'stage0': linear_weight_prediction(sgd_sc(0.1, 4, 0.9), horizons['stage0']),
         'stage1': linear_weight_prediction(optax.sgd(0.1, momentum=0.9), horizons['stage1']),
         'frozen': optax.set_to_zero()}, labels)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.3), params)
    new_params, _, state = self._apply(opt, [grads, grads], params)
    before, _, _ = self._apply(opt, [grads], params)
    predicted = self.variant(predicted_params)(state, new_params)
    chex.assert_trees_all_equal_shapes_and_dtypes(predicted, params)
    for stage, horizon in horizons.items():
      applied = new_params[stage]['w'] - before[stage]['w']
      chex.assert_trees_all_close(predicted[stage]['w'], new_params[stage]['w'] + horizon * applied,
                                  rtol=1e-6, atol=1e-7)
      assert np.any(np.asarray(applied) != 0)
    chex.assert_trees_all_equal(predicted['embedding'], params['embedding'])

  def test_prediction_feeds_a_flax_model_under_multi_transform(self):
    import flax.linen as nn  # pylint: disable=import-outside-toplevel
    model = nn.Dense(2)
    params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 3)))['params']
    labels = {'kernel': 'predicted', 'bias': 'plain'}
    opt = optax.multi_transform({'predicted': linear_weight_prediction(optax.sgd(0.1), 2),
                                 'plain': optax.sgd(0.1)}, labels)
    state = opt.init(params)
    updates, state = opt.update(jax.tree.map(jnp.ones_like, params), state, params)
    params = optax.apply_updates(params, updates)
    out = model.apply({'params': predicted_params(state, params)}, jnp.ones((1, 3)))
    chex.assert_shape(out, (1, 2))

  @chex.variants(with_jit=True, without_jit=True)
  def test_hyperparameters_traced_at_init_never_give_nan(self):
    # jit(init) hands the factory traced values that cannot be range-checked; the maths stays
    # finite at the edge momentum = 1 (b = D rather than 0 / 0).
    opt = optax.inject_hyperparams(sgd_sc)(learning_rate=0.1, delay=2, momentum=0.9)
    params = jnp.zeros(3)
    state = self.variant(opt.init)(params)
    state.hyperparams['momentum'] = jnp.asarray(1.0)
    updates, _ = jax.jit(opt.update)(jnp.ones(3), state, params)
    chex.assert_tree_all_finite(updates)
    a, b = jax.jit(spike_coefficients)(2, jnp.asarray(1.0))
    chex.assert_trees_all_close((a, b), (1.0, 2.0))

  @chex.variants(with_jit=True, without_jit=True)
  def test_bfloat16_momentum_close_to_one_needs_a_float32_accumulator(self):
    """The README's batch-1 momentum: 2000 unit gradients of momentum SGD in bfloat16."""
    momentum, steps = 0.99918, 2000
    exact = (1 - momentum**steps) / (1 - momentum)  # 983.2
    params = jnp.zeros(1, jnp.bfloat16)
    ones = jnp.ones(1, jnp.bfloat16)

    def last_update(opt):
      state = opt.init(params)
      update = self.variant(opt.update)
      step = jax.jit(lambda state, _: (update(ones, state, params)[1], None))
      state, _ = jax.lax.scan(step, state, None, length=steps - 1)
      updates, state = update(ones, state, params)
      return float(updates[0]), state

    wide, state = last_update(sgd_sc(1.0, 0, momentum, accumulator_dtype=jnp.float32))
    chex.assert_type(optax.tree_utils.tree_get(state, 'trace'), [jnp.float32])
    reference, _ = last_update(optax.sgd(1.0, momentum, accumulator_dtype=jnp.float32))
    assert wide == reference
    np.testing.assert_allclose(-wide, exact, rtol=1e-3)
    narrow, _ = last_update(sgd_sc(1.0, 0, momentum))  # momentum rounds to 1.0 in bfloat16
    assert -narrow == 256.0
    # With a delay the spike's coefficients are computed in float32 too.
    delayed, _ = last_update(sgd_sc(1.0, 4, momentum, accumulator_dtype=jnp.float32))
    np.testing.assert_allclose(-delayed, momentum**4 * exact + (1 - momentum**4) / (1 - momentum),
                               rtol=1e-3)

  @chex.variants(with_jit=True, without_jit=True)
  def test_nesterov_without_delay_is_optax_sgd_bit_for_bit(self):
    opt = sgd_sc(0.1, 0, 0.9, nesterov=True)
    reference = optax.sgd(0.1, momentum=0.9, nesterov=True)
    params = jnp.zeros(5)
    state, reference_state = opt.init(params), reference.init(params)
    update, reference_update = self.variant(opt.update), self.variant(reference.update)
    for grads in _random_gradients(20):
      updates, state = update(grads, state, params)
      expected, reference_state = reference_update(grads, reference_state, params)
      chex.assert_trees_all_equal(updates, expected)
      params = optax.apply_updates(params, updates)

  @parameterized.parameters(1, 3)
  def test_nesterov_follows_undelayed_nesterov_once_a_gradient_arrives(self, delay):
    """As the heavy-ball identity above: one gradient at t0, applied at t0 + D."""
    lr, momentum, t0, steps = 0.1, 0.8, 2, 15
    impulse, start = jnp.array([1.0, -2.0, 0.5]), jnp.array([0.3, 0.1, -0.2])

    def gradient(t, w):
      del w
      return jnp.where(t == t0, 1.0, 0.0) * impulse

    undelayed = _trajectory(optax.sgd(lr, momentum=momentum, nesterov=True), gradient, start,
                            steps)
    compensated = _trajectory(optax.chain(delay_gradients(delay),
                                          sgd_sc(lr, delay, momentum, nesterov=True)),
                              gradient, start, steps)
    arrival = t0 + delay
    chex.assert_trees_all_close(compensated[arrival + 1:], undelayed[arrival + 1:], rtol=1e-6,
                                atol=1e-6)
    chex.assert_trees_all_equal(compensated[:arrival + 1],
                                jnp.broadcast_to(start, (arrival + 1, 3)))

  @chex.variants(with_jit=True, without_jit=True)
  def test_adam_knobs_without_delay_are_optax_adamw(self):
    params = {'kernel': jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), 'bias': jnp.ones(3)}
    mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    knobs = dict(b1=0.8, b2=0.99, eps=1e-6, eps_root=1e-8, mu_dtype=jnp.bfloat16,
                 weight_decay=0.1, mask=mask)
    opt, reference = adam_sc(1e-2, 0, **knobs), optax.adamw(1e-2, **knobs)
    state, reference_state = opt.init(params), reference.init(params)
    # Both compiled alike: a float32 difference of fusion can flip a bfloat16 rounding of mu.
    update, reference_update = self.variant(opt.update), self.variant(reference.update)
    for grads in GRADS:
      grads = {'kernel': jnp.asarray(grads['w']), 'bias': jnp.asarray(grads['b'])}
      updates, state = update(grads, state, params)
      expected, reference_state = reference_update(grads, reference_state, params)
      chex.assert_trees_all_close(updates, expected, rtol=1e-6, atol=1e-9)
      params = optax.apply_updates(params, updates)
    mu = optax.tree_utils.tree_get(state, 'mu')
    chex.assert_trees_all_equal_dtypes(mu, jax.tree.map(lambda p: p.astype(jnp.bfloat16), params))
    chex.assert_trees_all_close(mu, optax.tree_utils.tree_get(reference_state, 'mu'))

  def test_adam_mask_keeps_decay_off_the_bias(self):
    params = {'kernel': jnp.ones((2, 2)), 'bias': jnp.ones(2)}
    masked = adam_sc(0.1, 3, weight_decay=0.5, mask={'kernel': True, 'bias': False})
    unmasked = adam_sc(0.1, 3, weight_decay=0.5)
    grads = jax.tree.map(jnp.ones_like, params)
    (with_mask, _), (without, _) = (masked.update(grads, masked.init(params), params),
                                    unmasked.update(grads, unmasked.init(params), params))
    chex.assert_trees_all_close(with_mask['kernel'], without['kernel'])
    chex.assert_trees_all_close(without['bias'] - with_mask['bias'], -0.1 * 0.5 * params['bias'])

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      # Last: whether the state keeps its structure (optax.trace swaps a frozen leaf's for None).
      ('sgd_sc', lambda: sgd_sc(0.1, 2, 0.9, weight_decay=0.01), True),
      ('sgd_sc_nesterov', lambda: sgd_sc(0.1, 2, 0.9, nesterov=True), True),
      ('spike_compensation', lambda: spike_compensation(2, 0.9), True),
      ('adam_sc', lambda: adam_sc(0.1, 2), True),
      ('pipemare', lambda: pipemare(0.1, 2, 0.9, anneal_steps=10), False),
      ('pipemare_discrepancy', lambda: optax.chain(optax.sgd(0.1), pipemare_discrepancy()), True),
      ('delay_gradients', lambda: optax.chain(delay_gradients(2), optax.sgd(0.1)), True),
      ('lwp', lambda: linear_weight_prediction(sgd_sc(0.1, 2, 0.9), 2), True),
      ('lwp_outermost', lambda: linear_weight_prediction(sgd_sc(0.1, 2, 0.9), 2, outermost=True),
       True),
      ('lwp_next_velocity', lambda: linear_weight_prediction(
          lambda rate: sgd_sc(rate, 2, 0.9), 2, form='next_velocity', learning_rate=0.1,
          momentum=0.9), True),
  )
  def test_frozen_parameters_as_none_gradients(self, build, keeps_structure):
    """A None gradient leaf gives a None update; the other leaves move as without the leaf."""
    opt = build()
    params = _tree(PARAMS)
    grads = [_frozen(_tree(g), 'b') for g in GRADS]
    update = self.variant(opt.update)
    state = opt.init(params)
    structure = jax.tree.structure(state)
    alone_params = {'w': params['w']}
    alone_state = opt.init(alone_params)
    for g in grads:
      updates, state = update(g, state, params)
      assert updates['b'] is None
      if keeps_structure:  # so that a lax.scan carry can hold it
        assert jax.tree.structure(state) == structure
      alone_updates, alone_state = opt.update({'w': g['w']}, alone_state, alone_params)
      chex.assert_trees_all_close(updates['w'], alone_updates['w'], rtol=1e-6, atol=1e-7)
      params = {**params, 'w': params['w'] + updates['w']}  # apply_updates refuses None updates
      alone_params = optax.apply_updates(alone_params, alone_updates)

  @chex.variants(with_jit=True, without_jit=True)
  def test_delay_compensation_accepts_frozen_parameters(self):
    opt = optim.delay_compensation(0.5)
    params = {'w': jnp.ones(2), 'b': jnp.ones(2)}
    updates, _ = self.variant(opt.update)({'w': jnp.ones(2), 'b': None}, optax.EmptyState(),
                                          params, gradient_params=jax.tree.map(jnp.zeros_like,
                                                                               params))
    assert updates['b'] is None
    chex.assert_trees_all_close(updates['w'], jnp.full(2, 1.5))

  def test_delay_as_a_whole_float_is_the_int(self):
    params = jnp.zeros(2)
    for integral in (delay_gradients(2.0), delay_gradients(np.int64(2))):
      state = integral.init(params)
      chex.assert_shape(state.buffer, (2, 2))

  @parameterized.parameters('velocity', 'next_velocity')
  def test_velocity_forms_read_the_injected_learning_rate(self, form):
    schedule = optax.linear_schedule(0.1, 0.01, 4)
    momentum = dict(momentum=0.9) if form == 'next_velocity' else {}
    injected = linear_weight_prediction(
        optax.inject_hyperparams(optax.sgd)(learning_rate=schedule, momentum=0.9), 3, form=form,
        **momentum)
    explicit = linear_weight_prediction(lambda rate: optax.sgd(rate, momentum=0.9), 3, form=form,
                                        learning_rate=schedule, **momentum)
    for (params, _, state), (_, _, reference) in zip(_run_prediction(injected),
                                                     _run_prediction(explicit)):
      chex.assert_trees_all_close(predicted_params(state, params),
                                  predicted_params(reference, params), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# Bad input.

BAD_INPUTS = {
    'sc negative delay': (lambda: spike_compensation(-1, 0.9), r'delay must be in \[0, inf\)'),
    'sc momentum 1': (lambda: spike_compensation(2, 1.0), r'momentum must be in \[0, 1\)'),
    'sc negative momentum': (lambda: spike_compensation(2, -0.1), 'momentum'),
    'spike coefficients momentum 1': (lambda: spike_coefficients(2, 1.0),
                                      r'momentum must be in \[0, 1\)'),
    'sc delay as text': (lambda: spike_compensation('2', 0.9),
                         "delay must be a real number, got the string '2'"),
    'sgd_sc momentum': (lambda: sgd_sc(0.1, 2, 1.5), 'momentum'),
    'sgd_sc negative delay': (lambda: sgd_sc(0.1, -2, 0.9), 'delay'),
    'sgd_sc weight decay': (lambda: sgd_sc(0.1, 2, 0.9, weight_decay=-1.0), 'weight_decay'),
    'sgd_sc learning rate': (lambda: sgd_sc(-0.1, 2, 0.9), 'learning_rate'),
    'adam b1': (lambda: scale_by_adam_sc(2, b1=1.0), 'b1'),
    'adam b2': (lambda: adam_sc(0.1, 2, b2=1.0), 'b2'),
    'adam delay': (lambda: adam_sc(0.1, -1), 'delay'),
    'adam eps': (lambda: scale_by_adam_sc(2, eps=-1.0), 'eps'),
    'lwp horizon': (lambda: linear_weight_prediction(optax.sgd(0.1), -1), 'horizon'),
    'lwp uncalled factory': (lambda: linear_weight_prediction(optax.sgd, 2),
                             r'did you mean sgd\(...\), called with its arguments'),
    'lwp form': (lambda: linear_weight_prediction(optax.sgd(0.1), 2, form='both'), 'form'),
    'lwp outermost': (lambda: linear_weight_prediction(optax.sgd(0.1), 2, outermost='yes'),
                      'outermost must be a Python bool'),
    'lwp velocity without lr': (
        lambda: linear_weight_prediction(optax.sgd(0.1, momentum=0.9), 2,
                                         form='velocity').init(jnp.zeros(2)),
        'needs the inner learning rate'),
    'lwp velocity without trace': (
        lambda: linear_weight_prediction(optax.adam, 2, form='velocity',
                                         learning_rate=0.1).init(jnp.zeros(2)),
        "no 'trace' field"),
    'lwp velocity lr beside a built inner': (
        lambda: linear_weight_prediction(optax.sgd(0.1, momentum=0.9), 2, form='velocity',
                                         learning_rate=0.2),
        'needs inner as a function of the learning rate'),
    'lwp next velocity lr beside a built inner': (
        lambda: linear_weight_prediction(sgd_sc(0.1, 2, 0.9), 2, form='next_velocity',
                                         learning_rate=0.1, momentum=0.9),
        'needs inner as a function of the learning rate'),
    'lwp inner of the learning rate returns no transformation': (
        lambda: linear_weight_prediction(lambda rate: rate, 2, form='velocity',
                                         learning_rate=0.1),
        'inner\\(learning_rate\\) must return'),
    'predicted_params without prediction': (
        lambda: predicted_params(optax.sgd(0.1).init(jnp.zeros(2)), jnp.zeros(2)),
        'holds no linear_weight_prediction state'),
    'delay negative': (lambda: delay_gradients(-1), 'delay must be an int >= 0'),
    'delay fractional': (lambda: delay_gradients(2.5), 'delay must be a Python int'),
    'delay array': (lambda: delay_gradients(jnp.asarray(2)), 'static_args'),
    'pipemare gamma 1': (lambda: pipemare_discrepancy(1.0), r'gamma must be in \[0, 1\)'),
    'pipemare gamma negative': (lambda: pipemare(0.1, 2, 0.9, 10, gamma=-0.1), 'gamma'),
    'pipemare momentum': (lambda: pipemare(0.1, 2, 1.0, 10), 'momentum'),
    'pipemare anneal': (lambda: pipemare_learning_rate(0.1, 2, -5), 'anneal_steps'),
    'pipemare delay': (lambda: pipemare(0.1, -2, 0.9, 10), 'delay'),
    'predicted_params with two predictions': (
        lambda: predicted_params(optax.chain(
            linear_weight_prediction(optax.sgd(0.1), 1),
            linear_weight_prediction(optax.sgd(0.1), 2)).init(jnp.zeros(2)), jnp.zeros(2)),
        '2 linear_weight_prediction states cover the same parameter'),
    'backward without delta': (
        lambda: pipemare_backward_params(optax.sgd(0.1).init(jnp.zeros(2)), jnp.zeros(2), 2),
        'holds no pipemare_discrepancy state'),
    # Values as optax.inject_hyperparams hands them over (jax arrays), and 0-d NumPy arrays.
    'injected momentum 1': (
        lambda: optax.inject_hyperparams(sgd_sc)(learning_rate=0.1, delay=2,
                                                 momentum=1.0).init(jnp.zeros(2)),
        r'sgd_sc: momentum must be in \[0, 1\), got 1.0'),
    'injected momentum 1.5': (
        lambda: optax.inject_hyperparams(sgd_sc)(learning_rate=0.1, delay=2,
                                                 momentum=1.5).init(jnp.zeros(2)),
        'momentum'),
    'injected negative delay': (
        lambda: optax.inject_hyperparams(sgd_sc)(learning_rate=0.1, delay=-3,
                                                 momentum=0.9).init(jnp.zeros(2)),
        r'delay must be in \[0, inf\)'),
    'injected momentum rounded by bfloat16': (
        lambda: optax.inject_hyperparams(sgd_sc)(learning_rate=0.1, delay=2,
                                                 momentum=0.999).init(jnp.zeros(2, jnp.bfloat16)),
        'hyperparam_dtype=jnp.float32'),
    'numpy 0-d momentum': (lambda: sgd_sc(0.1, 2, np.array(1.0)), 'momentum'),
    'jax momentum': (lambda: spike_compensation(2, jnp.asarray(1.0)), 'momentum'),
    'array momentum': (lambda: spike_compensation(2, np.array([0.9])), 'a scalar'),
    'injected lwp horizon': (
        lambda: optax.inject_hyperparams(linear_weight_prediction)(
            inner=optax.sgd(0.1), horizon=-1).init(jnp.zeros(2)), 'horizon'),
    # The smaller gaps.
    'momentum None': (lambda: sgd_sc(0.1, 2, None), 'momentum must be a real number, got None'),
    'delay None': (lambda: spike_compensation(None, 0.9), 'delay must be a real number'),
    'horizon None': (lambda: linear_weight_prediction(optax.sgd(0.1), None), 'horizon'),
    'momentum list': (lambda: sgd_sc(0.1, 2, [0.9]), 'momentum must be a real number, got'),
    'delay bool': (lambda: spike_compensation(True, 0.9), 'delay must be a real number, got the '
                   'bool'),
    'delay_gradients bool': (lambda: delay_gradients(True), 'delay must be a Python int'),
    'fractional delay': (lambda: spike_compensation(2.5, 0.9), 'whole number'),
    'fractional adam delay': (lambda: adam_sc(0.1, 1.5), 'whole number'),
    'infinite strength': (lambda: optim.delay_compensation(float('inf')), 'strength'),
    'nan learning rate': (lambda: sgd_sc(float('nan'), 2, 0.9), 'learning_rate'),
    'nesterov as number': (lambda: sgd_sc(0.1, 2, 0.9, nesterov=1), 'nesterov must be a Python '
                           'bool'),
    'accumulator dtype int': (lambda: sgd_sc(0.1, 2, 0.9, accumulator_dtype=jnp.int32),
                              'floating dtype'),
    'mu dtype': (lambda: scale_by_adam_sc(2, mu_dtype='int8'), 'mu_dtype'),
    'mu dtype unknown': (lambda: scale_by_adam_sc(2, mu_dtype='half-ish'), 'mu_dtype'),
    'adam eps_root': (lambda: adam_sc(0.1, 2, eps_root=-1.0), 'eps_root'),
    'lwp update form with lr': (
        lambda: linear_weight_prediction(optax.sgd(0.1), 2, learning_rate=0.1), 'belong to inner'),
    'lwp velocity lr twice': (
        lambda: linear_weight_prediction(
            lambda rate: optax.inject_hyperparams(optax.sgd)(learning_rate=rate, momentum=0.9),
            2, form='velocity', learning_rate=0.1).init(jnp.zeros(2)),
        'learning rate is given twice'),
    'predicted_params swapped': (
        lambda: predicted_params(jnp.zeros(2), linear_weight_prediction(
            optax.sgd(0.1), 1).init(jnp.zeros(2))), 'arguments are swapped'),
    'predicted_params wrong tree': (
        lambda: predicted_params(linear_weight_prediction(optax.sgd(0.1), 1).init(
            {'a': jnp.zeros(2)}), {'b': jnp.zeros(2)}), 'structure'),
    'predicted_params wrong shape': (
        lambda: predicted_params(linear_weight_prediction(optax.sgd(0.1), 1).init(
            jnp.zeros(2)), jnp.zeros(3)), 'shapes'),
    'backward params swapped': (
        lambda: pipemare_backward_params(jnp.zeros(2), pipemare_discrepancy().init(jnp.zeros(2)),
                                         2), 'arguments are swapped'),
    'sc gradient tree': (
        lambda: spike_compensation(2, 0.9).update({'b': jnp.zeros(2)},
                                                  spike_compensation(2, 0.9).init(
                                                      {'a': jnp.zeros(2)})),
        'the gradients must have the structure and leaf shapes of the params'),
    'delay gradient shape': (
        lambda: delay_gradients(2).update(jnp.zeros(3), delay_gradients(2).init(jnp.zeros(2))),
        'delay_gradients: the gradients must have'),
    'adam gradient shape': (
        lambda: scale_by_adam_sc(2).update(jnp.zeros(3), scale_by_adam_sc(2).init(jnp.zeros(2))),
        'scale_by_adam_sc: the gradients must have'),
    'discrepancy gradient shape': (
        lambda: pipemare_discrepancy().update(jnp.zeros(3),
                                              pipemare_discrepancy().init(jnp.zeros(2))),
        'pipemare_discrepancy: the gradients must have'),
    'dc gradient params tree': (
        lambda: optim.delay_compensation().update(jnp.zeros(2), optax.EmptyState(), jnp.zeros(2),
                                                  gradient_params=jnp.zeros(3)),
        'gradient_params must have the structure and leaf shapes of params'),
    'recipe batch 0': (lambda: Recipe(0, 0.1, 0.9), 'batch_size must be an int >= 1'),
    'recipe momentum': (lambda: Recipe(8, 0.1, 1.0), 'momentum'),
    'recipe learning rate': (lambda: Recipe(8, 0.0, 0.9), 'learning_rate'),
    'recipe weight decay': (lambda: Recipe(8, 0.1, 0.9, weight_decay=-1e-4), 'weight_decay'),
    'recipe form': (lambda: Recipe(8, 0.1, 0.9, form='nesterov'), 'form'),
    'recipe b2': (lambda: Recipe(8, 0.1, 0.9, form='ema', b2=1.0), 'b2'),
    'scale to batch 0': (lambda: scale_recipe(Recipe(8, 0.1, 0.9), 0), 'batch_size'),
    'scale to batch 2.5': (lambda: scale_recipe(Recipe(8, 0.1, 0.9), 2.5), 'batch_size'),
    'steps batch 0': (lambda: steps_for_samples(100, 0), 'batch_size'),
    'steps negative samples': (lambda: steps_for_samples(-1, 4), 'num_samples'),
}


@pytest.mark.parametrize('name', sorted(BAD_INPUTS))
def test_bad_input_raises_a_clear_error(name):
  make, message = BAD_INPUTS[name]
  with pytest.raises(ValueError, match=message):
    make()


def test_hyperparameters_as_arrays_are_not_checked_eagerly():
  # The examples of the brief: inject_hyperparams hands the factories jax arrays.
  params = jnp.zeros(3)
  for opt in (optax.inject_hyperparams(spike_compensation)(delay=3, momentum=0.9),
              optax.inject_hyperparams(sgd_sc)(learning_rate=0.1, delay=2, momentum=0.9)):
    state = opt.init(params)
    updates, state = jax.jit(opt.update)(jnp.ones(3), state, params)
    assert np.all(np.isfinite(updates))


# ------------------------------------------------------------------------------------------------
# Documentation.


# Every public module of pipejax.optim, so that a new one cannot be missed.
@pytest.mark.parametrize('module_name', sorted(
    m.name for m in pkgutil.iter_modules(optim.__path__) if not m.name.startswith('_')))
def test_docstring_examples_run(module_name):
  # By import path: the package re-exports a function named like its module (pipemare).
  module = importlib.import_module(f'pipejax.optim.{module_name}')
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0
  # Every 'Example:' section holds examples doctest really ran (a missing '>>>' would skip one).
  with_examples = [t for t in doctest.DocTestFinder().find(module) if t.examples]
  assert result.attempted > 0
  assert len(with_examples) == inspect.getsource(module).count('Example:')


TRANSFORMATIONS = ('adam_sc', 'adam_weight_prediction', 'delay_compensation', 'delay_gradients',
                   'delayed_error_feedback', 'linear_weight_prediction', 'muon_sc',
                   'nesterov_asyncpp', 'pipemare', 'pipemare_discrepancy', 'scale_by_adam_sc',
                   'scale_by_muon_sc', 'scale_by_torch_nadam', 'sgd_sc', 'spike_compensation')


@pytest.mark.parametrize('name', TRANSFORMATIONS + ('predicted_params', 'pipemare_backward_params',
                                                     'error_feedback_virtual_params'))
def test_docstring_examples_train_a_toy_problem(name):
  # A training step as optax's own docstrings show one: init, update, apply_updates.
  examples = [e.source for t in doctest.DocTestFinder().find(getattr(optim, name), name)
              for e in t.examples]
  for call in ('.init(', '.update(', 'optax.apply_updates('):
    assert any(call in source for source in examples), f'{name} shows no {call}'


def test_every_transformation_is_in_the_list_above():
  returns_one = [name for name in optim.__all__ if inspect.isfunction(getattr(optim, name)) and
                 'GradientTransformation' in str(inspect.signature(getattr(optim, name)))]
  assert sorted(returns_one) == sorted(TRANSFORMATIONS)


def test_pipemare_backward_params_says_it_belongs_in_a_pipeline():
  assert 'Only meaningful inside a pipeline' in pipemare_backward_params.__doc__


def test_public_api_is_reexported():
  for name in optim.__all__:
    assert hasattr(optim, name), name
