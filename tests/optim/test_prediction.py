"""Tests of :mod:`pipejax.optim.prediction`, Linear Weight Prediction: ``linear_weight_prediction``
and ``predicted_params``, in its three forms and wherever it sits in a chain.

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

from pipejax.optim import linear_weight_prediction, predicted_params, sgd_sc, spike_coefficients
from tests.optim.common import random_gradients, run_prediction


def test_update_form_offset_is_horizon_times_last_update():
  horizon = 3
  opt = linear_weight_prediction(sgd_sc(0.1, 2, 0.9), horizon=horizon)
  for params, updates, state in run_prediction(opt):
    # The update applied, read back from the weights: (w + u) - w may round differently from u.
    chex.assert_trees_all_close(predicted_params(state, params), params + horizon * updates,
                                rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('learning_rate', [0.1, optax.linear_schedule(0.1, 0.01, 5)],
                         ids=['constant', 'schedule'])
def test_velocity_and_update_forms_agree_for_momentum_sgd(learning_rate):
  by_update = run_prediction(
      linear_weight_prediction(optax.sgd(learning_rate, momentum=0.9), 4))
  by_velocity = run_prediction(linear_weight_prediction(
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
  for params, updates, state in run_prediction(opt):
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
# As a library: every check under jit and without it (chex.variants).


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
    for grads in [jnp.array([0.5, 0.5])] + random_gradients(3, shape=(2,)):
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
    for grads in random_gradients(4, shape=(4,)):
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
    for grads in random_gradients(4, shape=(3,)):
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


  @parameterized.parameters('velocity', 'next_velocity')
  def test_velocity_forms_read_the_injected_learning_rate(self, form):
    schedule = optax.linear_schedule(0.1, 0.01, 4)
    momentum = dict(momentum=0.9) if form == 'next_velocity' else {}
    injected = linear_weight_prediction(
        optax.inject_hyperparams(optax.sgd)(learning_rate=schedule, momentum=0.9), 3, form=form,
        **momentum)
    explicit = linear_weight_prediction(lambda rate: optax.sgd(rate, momentum=0.9), 3, form=form,
                                        learning_rate=schedule, **momentum)
    for (params, _, state), (_, _, reference) in zip(run_prediction(injected),
                                                     run_prediction(explicit)):
      chex.assert_trees_all_close(predicted_params(state, params),
                                  predicted_params(reference, params), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# Bad input.


BAD_INPUTS = {
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
    'predicted_params with two predictions': (
        lambda: predicted_params(optax.chain(
            linear_weight_prediction(optax.sgd(0.1), 1),
            linear_weight_prediction(optax.sgd(0.1), 2)).init(jnp.zeros(2)), jnp.zeros(2)),
        '2 linear_weight_prediction states cover the same parameter'),
    'injected lwp horizon': (
        lambda: optax.inject_hyperparams(linear_weight_prediction)(
            inner=optax.sgd(0.1), horizon=-1).init(jnp.zeros(2)), 'horizon'),
    'horizon None': (lambda: linear_weight_prediction(optax.sgd(0.1), None), 'horizon'),
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
}


@pytest.mark.parametrize('name', sorted(BAD_INPUTS))
def test_bad_input_raises_a_clear_error(name):
  make, message = BAD_INPUTS[name]
  with pytest.raises(ValueError, match=message):
    make()
