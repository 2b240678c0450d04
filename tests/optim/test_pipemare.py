"""Tests of :mod:`pipejax.optim.pipemare`: its learning-rate warm-up and the discrepancy that
estimates the backward pass's weights.

The shared suite (jit, no retrace, convergence, ``inject_hyperparams``, dtypes) runs it in
``test_transforms.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipejax.optim import (pipemare, pipemare_backward_params, pipemare_discrepancy,
                           pipemare_learning_rate)
from tests.optim.common import random_gradients


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
  for grads in random_gradients(6, shape=(4,)):
    updates, state = opt.update(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    delta = gamma * delta + (1 - gamma) * (new_params - params)
    params = new_params
    np.testing.assert_allclose(optax.tree_utils.tree_get(state, 'delta'), delta, rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(pipemare_backward_params(state, params, delay),
                               params - delay * delta, rtol=1e-5, atol=1e-6)


def test_pipemare_backward_params_says_it_belongs_in_a_pipeline():
  assert 'Only meaningful inside a pipeline' in pipemare_backward_params.__doc__


# ------------------------------------------------------------------------------------------------
# Bad input.


BAD_INPUTS = {
    'pipemare gamma 1': (lambda: pipemare_discrepancy(1.0), r'gamma must be in \[0, 1\)'),
    'pipemare gamma negative': (lambda: pipemare(0.1, 2, 0.9, 10, gamma=-0.1), 'gamma'),
    'pipemare momentum': (lambda: pipemare(0.1, 2, 1.0, 10), 'momentum'),
    'pipemare anneal': (lambda: pipemare_learning_rate(0.1, 2, -5), 'anneal_steps'),
    'pipemare delay': (lambda: pipemare(0.1, -2, 0.9, 10), 'delay'),
    'backward without delta': (
        lambda: pipemare_backward_params(optax.sgd(0.1).init(jnp.zeros(2)), jnp.zeros(2), 2),
        'holds no pipemare_discrepancy state'),
    'backward params swapped': (
        lambda: pipemare_backward_params(jnp.zeros(2), pipemare_discrepancy().init(jnp.zeros(2)),
                                         2), 'arguments are swapped'),
    'discrepancy gradient shape': (
        lambda: pipemare_discrepancy().update(jnp.zeros(3),
                                              pipemare_discrepancy().init(jnp.zeros(2))),
        'pipemare_discrepancy: the gradients must have'),
}


@pytest.mark.parametrize('name', sorted(BAD_INPUTS))
def test_bad_input_raises_a_clear_error(name):
  make, message = BAD_INPUTS[name]
  with pytest.raises(ValueError, match=message):
    make()
