"""Tests of :mod:`pipejax.optim.scaling`, batch-size scaling: ``Recipe``, ``scale_recipe`` and
``steps_for_samples``.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipejax.optim import Recipe, scale_recipe, steps_for_samples


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
# Bad input.


BAD_INPUTS = {
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
