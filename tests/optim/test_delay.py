"""Tests of :mod:`pipejax.optim.delay`: the gradient delay line, ``delay_gradients``.

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

from pipejax.optim import delay_gradients
from tests.optim.common import PARAMS, GRADS, tree


def test_delay_gradients_of_zero_is_the_identity():
  opt = delay_gradients(0)
  params = tree(PARAMS)
  state = opt.init(params)
  for grads in GRADS:
    updates, state = opt.update(tree(grads), state, params)
    jax.tree.map(np.testing.assert_array_equal, updates, tree(grads))
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
# As a library: every check under jit and without it (chex.variants).


class LibraryTest(chex.TestCase):
  """The transformations as a library: position in a chain, frozen leaves, optax's knobs."""

  def test_delay_as_a_whole_float_is_the_int(self):
    params = jnp.zeros(2)
    for integral in (delay_gradients(2.0), delay_gradients(np.int64(2))):
      state = integral.init(params)
      chex.assert_shape(state.buffer, (2, 2))


# ------------------------------------------------------------------------------------------------
# Bad input.


BAD_INPUTS = {
    'delay negative': (lambda: delay_gradients(-1), 'delay must be an int >= 0'),
    'delay fractional': (lambda: delay_gradients(2.5), 'delay must be a Python int'),
    'delay array': (lambda: delay_gradients(jnp.asarray(2)), 'static_args'),
    'delay_gradients bool': (lambda: delay_gradients(True), 'delay must be a Python int'),
    'delay gradient shape': (
        lambda: delay_gradients(2).update(jnp.zeros(3), delay_gradients(2).init(jnp.zeros(2))),
        'delay_gradients: the gradients must have'),
}


@pytest.mark.parametrize('name', sorted(BAD_INPUTS))
def test_bad_input_raises_a_clear_error(name):
  make, message = BAD_INPUTS[name]
  with pytest.raises(ValueError, match=message):
    make()
