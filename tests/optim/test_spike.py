"""Tests of :mod:`pipejax.optim.spike`, Spike Compensation: ``spike_compensation``, ``sgd_sc``,
``adam_sc`` and ``scale_by_adam_sc`` against optax's SGD and Adam and against the closed forms
of a delayed gradient.

The shared suite (jit, no retrace, convergence, ``inject_hyperparams``, dtypes) runs it in
``test_transforms.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import chex
import numpy as np
import optax
import pytest
from absl.testing import parameterized

from pipejax.optim import (adam_sc, delay_gradients, scale_by_adam_sc, sgd_sc, spike_coefficients,
                           spike_compensation)
from tests.optim.common import GRADS, trajectory, random_gradients


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
  for grads in random_gradients(40):
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
  for grads in random_gradients(5):
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
  for grads in random_gradients(30):
    updates, state = opt.update(grads, state, params)
    expected, reference_state = reference.update(grads, reference_state, params)
    np.testing.assert_allclose(updates, expected, rtol=1e-6, atol=1e-9)
    params = optax.apply_updates(params, updates)


def test_adam_sc_compensates_the_first_moment_after_bias_correction():
  delay, b1 = 3, 0.9
  opt = scale_by_adam_sc(delay, b1=b1, b2=0.99, eps=0.0)
  state = opt.init(jnp.zeros(5))
  mu = nu = jnp.zeros(5)
  for t, g in enumerate(random_gradients(4), start=1):
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

  undelayed = trajectory(optax.sgd(lr, momentum=momentum), gradient, start, steps)
  compensated = trajectory(
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

  undelayed = trajectory(optax.sgd(lr, momentum=momentum), gradient, start, steps)
  compensated = trajectory(
      optax.chain(delay_gradients(delay), sgd_sc(lr, delay, momentum)), gradient, start, steps)
  delayed = trajectory(
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


def test_hyperparameters_as_arrays_are_not_checked_eagerly():
  # The examples of the brief: inject_hyperparams hands the factories jax arrays.
  params = jnp.zeros(3)
  for opt in (optax.inject_hyperparams(spike_compensation)(delay=3, momentum=0.9),
              optax.inject_hyperparams(sgd_sc)(learning_rate=0.1, delay=2, momentum=0.9)):
    state = opt.init(params)
    updates, state = jax.jit(opt.update)(jnp.ones(3), state, params)
    assert np.all(np.isfinite(updates))


# ------------------------------------------------------------------------------------------------
# As a library: every check under jit and without it (chex.variants).


class LibraryTest(chex.TestCase):
  """The transformations as a library: position in a chain, frozen leaves, optax's knobs."""

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
    for grads in random_gradients(20):
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

    undelayed = trajectory(optax.sgd(lr, momentum=momentum, nesterov=True), gradient, start,
                           steps)
    compensated = trajectory(optax.chain(delay_gradients(delay),
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
    'momentum None': (lambda: sgd_sc(0.1, 2, None), 'momentum must be a real number, got None'),
    'delay None': (lambda: spike_compensation(None, 0.9), 'delay must be a real number'),
    'momentum list': (lambda: sgd_sc(0.1, 2, [0.9]), 'momentum must be a real number, got'),
    'delay bool': (lambda: spike_compensation(True, 0.9), 'delay must be a real number, got the '
                   'bool'),
    'fractional delay': (lambda: spike_compensation(2.5, 0.9), 'whole number'),
    'fractional adam delay': (lambda: adam_sc(0.1, 1.5), 'whole number'),
    'nan learning rate': (lambda: sgd_sc(float('nan'), 2, 0.9), 'learning_rate'),
    'nesterov as number': (lambda: sgd_sc(0.1, 2, 0.9, nesterov=1), 'nesterov must be a Python '
                           'bool'),
    'accumulator dtype int': (lambda: sgd_sc(0.1, 2, 0.9, accumulator_dtype=jnp.int32),
                              'floating dtype'),
    'mu dtype': (lambda: scale_by_adam_sc(2, mu_dtype='int8'), 'mu_dtype'),
    'mu dtype unknown': (lambda: scale_by_adam_sc(2, mu_dtype='half-ish'), 'mu_dtype'),
    'adam eps_root': (lambda: adam_sc(0.1, 2, eps_root=-1.0), 'eps_root'),
    'sc gradient tree': (
        lambda: spike_compensation(2, 0.9).update({'b': jnp.zeros(2)},
                                                  spike_compensation(2, 0.9).init(
                                                      {'a': jnp.zeros(2)})),
        'the gradients must have the structure and leaf shapes of the params'),
    'adam gradient shape': (
        lambda: scale_by_adam_sc(2).update(jnp.zeros(3), scale_by_adam_sc(2).init(jnp.zeros(2))),
        'scale_by_adam_sc: the gradients must have'),
}


@pytest.mark.parametrize('name', sorted(BAD_INPUTS))
def test_bad_input_raises_a_clear_error(name):
  make, message = BAD_INPUTS[name]
  with pytest.raises(ValueError, match=message):
    make()
