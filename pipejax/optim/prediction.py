"""Linear Weight Prediction: run the forward pass on the weights the backward pass will see.

A gradient that arrives ``D`` updates after its forward pass was computed on weights ``D`` updates
old. Linear Weight Prediction (Kosson et al., 2021) extrapolates the recent motion of the weights
``T`` steps ahead (``T = D`` by default) and runs the forward pass on that prediction instead, so
the forward and the backward see nearly the same weights. The transformation leaves the update
alone; it stores the offset from the updated weights to the prediction, and
:func:`predicted_params` adds it, as optax's ``schedule_free_eval_params`` derives the weights to
evaluate.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pipejax.optim import _checks

_FORMS = ('update', 'velocity', 'next_velocity')


class WeightPredictionState(NamedTuple):
  """State of :func:`linear_weight_prediction`."""

  count: jax.Array  # shape=(), dtype=int32: updates so far (the learning-rate schedule's step).
  inner_state: optax.OptState
  # The predicted forward weights w_{t+1} + o_t, kept whole rather than as the offset o_t: the
  # forward pass then reads them as they are, instead of adding two weight-sized trees every
  # step (at micro-batch 1 that extra pass cost as much as the matrix-vector products).
  forward_params: optax.Params


def _find_velocity(inner_state: optax.OptState) -> optax.Updates:
  return _checks.get_unique(
      inner_state, 'trace', helper="linear_weight_prediction(form='velocity')",
      provider='a momentum trace (optax.trace, optax.sgd(momentum=...), spike_compensation)',
      hint="For other inner transformations use form='update'.")


def linear_weight_prediction(
    inner: optax.GradientTransformation,
    horizon: Any,
    form: str = 'update',
    learning_rate: optax.ScalarOrSchedule | None = None,
    momentum: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Wraps ``inner`` and records where its weights are predicted to be ``horizon`` steps ahead.

  The updates of ``inner`` pass through unchanged. After the update :math:`u_t = w_{t+1} - w_t`
  the state holds ``forward_params`` :math:`\hat w_{t+1} = w_{t+1} + o_t` with

  .. math::

    \text{update form:}\quad o_t = T\,u_t, \qquad\qquad
    \text{velocity form:}\quad o_t = -\eta_t\,T\,v_t, \qquad
    \text{next-velocity form:}\quad o_t = -\eta_t\,T\,(m\,v_t + g_t)

  and the forward pass of the next step runs on :math:`\hat w_{t+1}` (see
  :func:`predicted_params`); ``update`` therefore needs ``params``. :math:`v_t` is the momentum trace of ``inner`` (its state field named
  ``trace``) and :math:`\eta_t` the learning rate of the update just taken, so for plain momentum
  SGD (:math:`u_t = -\eta_t v_t`) both forms agree, even under a learning-rate schedule. Under
  Spike Compensation they differ: the update form carries the spike, the velocity form does not;
  the paper recommends the update form with SC.

  The next-velocity form is SpecTrain as its reference implementation computes it
  (``load_predicted_weights`` in ntueclab/SpecTrain-PyTorch, ``src/optimizer.py``): the step
  ahead is taken with the velocity the *next* update would have if its gradient equalled the last
  one, :math:`m v_t + g_t`, where :math:`g_t` is the raw gradient this update received.

  Args:
    inner: the update rule, e.g. ``sgd_sc(lr, D, m)`` or ``optax.sgd(lr, momentum=m)``.
    horizon: prediction horizon ``T >= 0`` in steps, usually the stage's delay ``D``. May be a jax
      array (``optax.inject_hyperparams``).
    form: ``'update'`` (any inner), ``'velocity'`` or ``'next_velocity'`` (inner must keep a
      ``trace``).
    learning_rate: the learning rate of ``inner``, a float or schedule of the step count; required
      by the velocity forms, ignored by the update form.
    momentum: the heavy-ball momentum ``m`` of ``inner``; required by the next-velocity form.

  Returns:
    A ``GradientTransformationExtraArgs`` whose state is a :class:`WeightPredictionState`.

  Raises:
    ValueError: for an unknown form, a negative horizon, a velocity form without a learning rate,
      or (at ``init``) a velocity form whose inner state has no ``trace``.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import linear_weight_prediction, predicted_params, sgd_sc
    >>> opt = linear_weight_prediction(sgd_sc(0.1, delay=2, momentum=0.9), horizon=2)
    >>> params = jnp.array([1.0])
    >>> state = opt.init(params)
    >>> updates, state = opt.update(jnp.array([1.0]), state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> forward_params = predicted_params(params, state)  # params + 2 * updates

  References:
    Kosson et al., `Pipelined Backpropagation at Scale: Training Large Models without Batches
    <https://arxiv.org/abs/2003.11666>`_, MLSys 2021;
    Chen et al., `Efficient and Robust Parallel DNN Training through Model Parallelism on
    Multi-GPU Platform <https://arxiv.org/abs/1809.02839>`_ (SpecTrain), 2018.
  """
  owner = 'linear_weight_prediction'
  if form not in _FORMS:
    raise ValueError(f'{owner}: form must be one of {_FORMS}, got {form!r}.')
  _checks.check_range(horizon, 'horizon', owner, low=0)
  if not isinstance(inner, optax.GradientTransformation):
    hint = (f' (did you mean {inner.__name__}(...), called with its arguments?)'
            if callable(inner) else '')
    raise ValueError(f'{owner}: inner must be an optax GradientTransformation, e.g. '
                     f'optax.sgd(0.1, momentum=0.9); got {type(inner).__name__}{hint}.')
  if form != 'update':
    if learning_rate is None:
      raise ValueError(f"{owner}: form={form!r} needs the inner learning_rate (a float or "
                       'schedule) to turn the momentum trace into a step.')
    if form == 'next_velocity' and momentum is None:
      raise ValueError(f"{owner}: form='next_velocity' needs the inner momentum m (it predicts "
                       'the next velocity m v + g).')
    if not callable(learning_rate):
      _checks.check_range(learning_rate, 'learning_rate', owner, low=0)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    inner_state = inner.init(params)
    if form != 'update':
      _find_velocity(inner_state)  # Fails here rather than on the first update.
    return WeightPredictionState(count=jnp.zeros([], jnp.int32), inner_state=inner_state,
                                 forward_params=jax.tree.map(jnp.copy, params))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(f'{owner}: update needs params (the prediction is made from the weights '
                       'after this update).')
    gradient = updates
    updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    if form == 'update':
      offset = jax.tree.map(lambda u: jnp.asarray(horizon, u.dtype) * u, updates)
    else:
      eta = learning_rate(state.count) if callable(learning_rate) else learning_rate
      step_scale = -_checks.at_least_float32(eta) * _checks.at_least_float32(horizon)
      velocity = _find_velocity(inner_state)
      if form == 'next_velocity':
        velocity = jax.tree.map(lambda v, g: jnp.asarray(momentum, v.dtype) * v + g.astype(
            v.dtype), velocity, gradient)
      offset = jax.tree.map(lambda v: jnp.asarray(step_scale, v.dtype) * v, velocity)
    # The same rounding as the forward pass would see computing params_new + offset itself.
    forward = jax.tree.map(lambda p, o: (p + o).astype(p.dtype),
                           optax.apply_updates(params, updates), offset)
    return updates, WeightPredictionState(count=optax.safe_increment(state.count),
                                          inner_state=inner_state, forward_params=forward)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def predicted_params(params: optax.Params, opt_state: optax.OptState) -> optax.Params:
  """The weights the forward pass should use: ``params + o_t`` as predicted at the last update.

  ``opt_state`` is the state of an optimizer that contains :func:`linear_weight_prediction`
  anywhere (alone, in ``optax.chain``, ``optax.inject_hyperparams``, ``optax.MultiSteps``, ...);
  ``params`` are the weights after the update that produced it, i.e. ``apply_updates`` of the
  params and updates of that ``update`` call. The prediction is computed and kept at update time
  (see :class:`WeightPredictionState`), so this only looks it up.

  Args:
    params: current (updated) weights.
    opt_state: the optimizer state after that update.

  Returns:
    The predicted weights, a tree like ``params``.

  Raises:
    ValueError: if the state holds no prediction, or several.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import linear_weight_prediction, predicted_params
    >>> opt = optax.chain(optax.clip(1.0), linear_weight_prediction(optax.sgd(0.1), horizon=3))
    >>> params = jnp.zeros(2)
    >>> state = opt.init(params)
    >>> predicted_params(params, state)  # no update yet: no offset
    Array([0., 0.], dtype=float32)
  """
  del params  # the prediction was made from them at update time
  return _checks.get_unique(opt_state, 'forward_params', helper='predicted_params',
                            provider='linear_weight_prediction')
