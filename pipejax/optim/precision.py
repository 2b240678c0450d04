"""Optimizer states in float32 for parameters of fewer bits.

A momentum trace kept in bfloat16 stops growing where its increment falls below half a unit in the
last place: at ``m = 0.99918`` (heavy-ball momentum at batch 1) ``0.99918 * 256 + 1`` rounds to
256, so a trace that should reach ``1 / (1 - m)``, about 1200, stays at 256 (docs/optax.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def _narrow(x) -> bool:
  """Whether ``x`` is an array of floating point numbers of fewer than 32 bits."""
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and \
      jnp.finfo(dtype).bits < 32


def _widened(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32) if _narrow(x) else x, tree)


def float32_state(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``inner`` run in float32 on the parameters of fewer bits (bfloat16, float16).

  Such parameters, their gradients and any extra arguments of theirs reach ``inner`` in
  float32, so that its state (momentum traces, moments, predictions) is kept in float32; its
  updates return in the parameters' dtype. The state has ``inner``'s own structure, so that
  helpers which read it (:func:`pipejax.optim.predicted_params`) find what they look for. Leaves
  of 32 bits or more pass through untouched: on float32 parameters the result is bit-identical
  to ``inner``'s.

  Args:
    inner: any optax transformation.

  Returns:
    The transformation, with ``inner``'s state structure.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from pipejax.optim import float32_state
    >>> params = {'w': jnp.zeros(3, jnp.bfloat16)}
    >>> tx = float32_state(optax.sgd(1e-2, momentum=0.99918))
    >>> state = tx.init(params)
    >>> updates, state = tx.update({'w': jnp.ones(3, jnp.bfloat16)}, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> print(state[0].trace['w'].dtype, params['w'].dtype)
    float32 bfloat16
  """
  inner = optax.with_extra_args_support(inner)

  def init(params):
    return inner.init(_widened(params))

  def update(updates, state, params=None, **extra_args):
    # Extra arguments too: DC-ASGD's gradient_params meet the weights in one dtype.
    new, state = inner.update(_widened(updates), state,
                              None if params is None else _widened(params),
                              **_widened(extra_args))
    like = updates if params is None else params
    new = jax.tree.map(lambda u, p: u.astype(p.dtype) if _narrow(p) else u, new, like)
    return new, state

  return optax.GradientTransformationExtraArgs(init, update)
