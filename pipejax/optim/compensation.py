"""Delay compensation (DC-ASGD): correct a stale gradient with a cheap curvature estimate."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from pipejax.optim import _checks


def delay_compensation(strength: Any = 0.04) -> optax.GradientTransformationExtraArgs:
  r"""DC-ASGD's correction of a gradient computed on other weights than those it updates.

  .. math::

    \tilde g = g + \lambda\, g \odot g \odot (w_\text{now} - w_\text{then})

  A gradient computed at :math:`w_\text{then}` but applied at :math:`w_\text{now}` is moved to
  :math:`w_\text{now}` by a first-order Taylor step whose Hessian is approximated by the
  diagonal of the gradient's outer product, :math:`\lambda\, g \odot g` (Zheng et al., 2017). The
  transformation is stateless; ``update`` needs ``params`` (:math:`w_\text{now}`) and the extra
  argument ``gradient_params`` (:math:`w_\text{then}`, the weights the gradient was computed on).
  In a pipeline those are the forward's weights, kept beside the stashed input as PipeDream does
  (the ``dcasgd`` method of :mod:`pipejax.methods`). A ``None`` gradient leaf stays ``None``.

  Args:
    strength: :math:`\lambda \ge 0`; 0.04 is the default of MXNet's ``dcasgd`` optimizer.

  Returns:
    A stateless ``GradientTransformationExtraArgs``; put it before the momentum and weight decay.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import delay_compensation
    >>> opt = optax.chain(delay_compensation(0.04), optax.sgd(0.1, momentum=0.9))
    >>> w = jnp.array([1.0, 2.0])
    >>> state = opt.init(w)
    >>> # The gradient was computed at [0, 2]; the weights have since moved to [1, 2].
    >>> updates, state = opt.update(jnp.array([0.5, -1.0]), state, w,
    ...                             gradient_params=jnp.array([0.0, 2.0]))
    >>> optax.apply_updates(w, updates)  # g + 0.04 * g**2 * (w - w_then) = [0.51, -1]
    Array([0.949, 2.1  ], dtype=float32)

  References:
    Zheng et al., `Asynchronous Stochastic Gradient Descent with Delay Compensation
    <https://arxiv.org/abs/1609.08326>`_, ICML 2017.
  """
  owner = 'delay_compensation'
  _checks.check_range(strength, 'strength', owner, low=0)

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, gradient_params=None, **extra_args):
    del extra_args
    if params is None or gradient_params is None:
      raise ValueError(f'{owner}: update needs params (the weights being updated) and '
                       'gradient_params (the weights the gradient was computed on).')
    _checks.check_same_structure(gradient_params, params, 'gradient_params', 'params', owner)
    _checks.check_gradients(updates, params, owner)
    corrected = _checks.map_gradients(
        lambda g, now, then: g + jnp.asarray(strength, g.dtype) * g * g * (now - then).astype(
            g.dtype), updates, params, gradient_params)
    return corrected, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
