"""Tests of :mod:`pipejax.optim.compensation`, delay compensation (DC-ASGD):
``delay_compensation``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import chex
import optax
import pytest

from pipejax import optim


# ------------------------------------------------------------------------------------------------
# As a library: every check under jit and without it (chex.variants).


class LibraryTest(chex.TestCase):
  """The transformations as a library: position in a chain, frozen leaves, optax's knobs."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_delay_compensation_accepts_frozen_parameters(self):
    opt = optim.delay_compensation(0.5)
    params = {'w': jnp.ones(2), 'b': jnp.ones(2)}
    updates, _ = self.variant(opt.update)({'w': jnp.ones(2), 'b': None}, optax.EmptyState(),
                                          params, gradient_params=jax.tree.map(jnp.zeros_like,
                                                                               params))
    assert updates['b'] is None
    chex.assert_trees_all_close(updates['w'], jnp.full(2, 1.5))


# ------------------------------------------------------------------------------------------------
# Bad input.


BAD_INPUTS = {
    'infinite strength': (lambda: optim.delay_compensation(float('inf')), 'strength'),
    'dc gradient params tree': (
        lambda: optim.delay_compensation().update(jnp.zeros(2), optax.EmptyState(), jnp.zeros(2),
                                                  gradient_params=jnp.zeros(3)),
        'gradient_params must have the structure and leaf shapes of params'),
}


@pytest.mark.parametrize('name', sorted(BAD_INPUTS))
def test_bad_input_raises_a_clear_error(name):
  make, message = BAD_INPUTS[name]
  with pytest.raises(ValueError, match=message):
    make()
