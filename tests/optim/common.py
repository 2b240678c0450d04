"""What the tests of :mod:`pipejax.optim` share: a small parameter tree, its gradients, and the
weights a transformation moves them through."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

_RNG = np.random.default_rng(0)
PARAMS = {'w': _RNG.normal(size=(2, 3)).astype(np.float32),
          'b': _RNG.normal(size=(3,)).astype(np.float32)}
GRADS = [jax.tree.map(lambda p: _RNG.normal(size=p.shape).astype(np.float32), PARAMS)
         for _ in range(4)]


def tree(values, dtype=jnp.float32):
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), values)


def assert_trees_close(actual, expected, rtol=1e-6, atol=1e-7):
  jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=rtol, atol=atol),
               actual, expected)


def trees_differ(first, second) -> bool:
  return any(not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
             for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)))


def current_weights(params, opt_state):
  del opt_state
  return params


def trajectory(opt, gradient_fn, start, steps, view=current_weights):
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


def random_gradients(steps, shape=(5,), seed=1):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(steps)]


def run_prediction(opt, steps=6, params=None):
  """Yields (params after the update, the update, state) for a few random gradients."""
  params = jnp.linspace(-1.0, 1.0, 4) if params is None else params
  state = opt.init(params)
  for grads in random_gradients(steps, shape=params.shape):
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    yield params, updates, state


def frozen(tree, name):
  """The gradients of a model whose parameter ``name`` is frozen (a None leaf, as optax allows)."""
  return {k: None if k == name else v for k, v in tree.items()}
