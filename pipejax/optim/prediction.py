"""Linear Weight Prediction: run the forward pass on the weights the backward pass will see.

A gradient that arrives ``D`` updates after its forward pass was computed on weights ``D`` updates
old. Linear Weight Prediction (Kosson et al., 2021) extrapolates the recent motion of the weights
``T`` steps ahead (``T = D`` by default) and runs the forward pass on that prediction instead, so
the forward and the backward see nearly the same weights. The transformation leaves the update
alone and keeps what the prediction needs in its state; :func:`predicted_params` derives the
predicted weights from that state and the current weights, as optax's
``schedule_free_eval_params`` derives the weights to evaluate.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pipejax.optim import _checks

_FORMS = ('update', 'velocity', 'next_velocity')
_INJECTED = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)


class WeightPredictionState(NamedTuple):
  """State of :func:`linear_weight_prediction`."""

  count: jax.Array  # shape=(), dtype=int32: updates so far (the learning-rate schedule's step).
  inner_state: optax.OptState
  # outermost=True: the prediction itself, w_{t+1} + o_t, and none of the fields below (None
  # otherwise). Third, where it has always been, so that the presets' checkpoints still load.
  forward_params: optax.Params
  horizon: jax.Array  # shape=(), dtype=float32: T of the last update (update form, else None).
  # Update form: the weights before the last update, w_t, so that the prediction extrapolates the
  # update actually applied, w_{t+1} - w_t, wherever this sits in a chain (None otherwise).
  previous_params: optax.Params
  # Velocity forms: the offset o_t from the weights to the prediction (None otherwise).
  offset: optax.Updates


def _find_velocity(inner_state: optax.OptState) -> optax.Updates:
  return _checks.get_unique(
      inner_state, 'trace', helper="linear_weight_prediction(form='velocity')",
      provider='a momentum trace (optax.trace, optax.sgd(momentum=...), spike_compensation)',
      hint="For other inner transformations use form='update'.")


def _injected_learning_rate(inner_state: optax.OptState) -> Any:
  """The learning rate the inner transformation applied, when one was injected (else None).

  ``optax.inject_hyperparams`` keeps the values its last update used in ``hyperparams``.
  """
  rates = [s.hyperparams['learning_rate'] for s in _checks.states_of_type(
      inner_state, _INJECTED) if 'learning_rate' in s.hyperparams]
  return rates[0] if len(rates) == 1 else None


def linear_weight_prediction(
    inner: optax.GradientTransformation | Callable[[Any], optax.GradientTransformation],
    horizon: Any,
    form: str = 'update',
    learning_rate: optax.ScalarOrSchedule | None = None,
    momentum: Any = None,
    outermost: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""Wraps ``inner`` and keeps what predicting its weights ``horizon`` steps ahead needs.

  The updates of ``inner`` pass through unchanged. After the update that took the weights from
  :math:`w_t` to :math:`w_{t+1}`, :func:`predicted_params` gives :math:`\hat w_{t+1} = w_{t+1} +
  o_t` with

  .. math::

    \text{update form:}\quad o_t = T\,(w_{t+1} - w_t), \qquad
    \text{velocity form:}\quad o_t = -\eta_t\,T\,v_t, \qquad
    \text{next-velocity form:}\quad o_t = -\eta_t\,T\,(m\,v_t + g_t)

  and the forward pass of the next step runs on :math:`\hat w_{t+1}`. The update form keeps
  :math:`w_t` (the ``params`` given to ``update``) and extrapolates the update that was actually
  applied, so it is right wherever the transformation sits: before a learning rate or a clip in
  ``optax.chain``, or with weights projected after ``apply_updates``. :math:`v_t` is the momentum
  trace of ``inner`` (its state field named ``trace``) and :math:`\eta_t` the learning rate of the
  update just taken, so for plain momentum SGD (:math:`u_t = -\eta_t v_t`) all forms agree, even
  under a learning-rate schedule. Under Spike Compensation they differ: the update form carries the
  spike, the velocity form does not; the paper recommends the update form with SC. The velocity
  forms take the step from the trace and :math:`\eta_t`, not from the update applied, so they too
  hold wherever the transformation sits, given the learning rate the weights move by.

  The velocity forms read :math:`\eta_t` where it cannot differ from the rate ``inner`` applies:
  from ``inner``'s state when ``inner`` is built with ``optax.inject_hyperparams``, or from
  ``learning_rate`` when ``inner`` is a function that builds the update rule from that rate (e.g.
  ``lambda lr: optax.sgd(lr, momentum=0.9)``). A built ``inner`` beside a ``learning_rate`` is
  refused: nothing could check that the two rates agree, and a mismatch would only scale the
  prediction silently.

  The next-velocity form is SpecTrain as its reference implementation computes it
  (``load_predicted_weights`` in ntueclab/SpecTrain-PyTorch, ``src/optimizer.py``): the step
  ahead is taken with the velocity the *next* update would have if its gradient equalled the last
  one, :math:`m v_t + g_t`, where :math:`g_t` is the raw gradient this update received.

  Args:
    inner: the update rule, e.g. ``sgd_sc(lr, D, m)`` or ``optax.sgd(lr, momentum=m)``; with
      ``learning_rate`` (velocity forms), a function of the learning rate that returns it, e.g.
      ``lambda lr: sgd_sc(lr, D, m)``.
    horizon: prediction horizon ``T >= 0`` in steps, usually the stage's delay ``D``. May be a jax
      array (``optax.inject_hyperparams``).
    form: ``'update'`` (any inner), ``'velocity'`` or ``'next_velocity'`` (inner must keep a
      ``trace``).
    learning_rate: the velocity forms' :math:`\eta`, a float or schedule of the step count,
      handed to ``inner`` (a function of it) to build the update rule, so that the prediction
      and the update use one rate. Leave it None when ``inner`` is built with
      ``optax.inject_hyperparams``: the rate is then read from its state (giving both is an
      error). The update form takes none.
    momentum: the heavy-ball momentum ``m`` of ``inner``; required by the next-velocity form.
    outermost: a promise that the updates this returns are applied as they are (nothing after it
      in a chain, the weights not changed after ``apply_updates``). The prediction is then made
      once, at ``update``, from the inner update and kept whole, so reading it costs nothing;
      otherwise every :func:`predicted_params` call computes it from the current weights (one
      pass over them). The pipeline's presets (:mod:`pipejax.methods`) make this promise, as the
      whole update of a stage; broken, the prediction is silently wrong, so leave it False
      unless the forward pass's weight traffic matters.

  Returns:
    A ``GradientTransformationExtraArgs`` whose state is a :class:`WeightPredictionState`.

  Raises:
    ValueError: for an unknown form, a negative horizon, a learning rate with the update form or
      beside a built ``inner``, a non-bool ``outermost``, or (at ``init``) a velocity form whose
      inner state has no ``trace`` or whose learning rate is missing or given twice.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import linear_weight_prediction, predicted_params
    >>> opt = optax.chain(linear_weight_prediction(optax.scale_by_adam(), horizon=4),
    ...                   optax.scale_by_learning_rate(1e-3))
    >>> params = jnp.array([1.0, -2.0])
    >>> state = opt.init(params)
    >>> updates, state = opt.update(jnp.array([0.5, 0.5]), state, params)
    >>> params = optax.apply_updates(params, updates)  # [0.999, -2.001]
    >>> [round(float(w), 4) for w in predicted_params(state, params)]  # params + 4 * update
    [0.995, -2.005]

  References:
    Kosson et al., `Pipelined Backpropagation at Scale: Training Large Models without Batches
    <https://arxiv.org/abs/2003.11666>`_, MLSys 2021;
    Chen et al., `Efficient and Robust Parallel DNN Training through Model Parallelism on
    Multi-GPU Platform <https://arxiv.org/abs/1809.02839>`_ (SpecTrain), 2018.
  """
  inner = _checked_inner(inner, horizon, form, learning_rate, momentum, outermost)
  prediction = _Prediction(inner, horizon, form, learning_rate, momentum, outermost)
  return optax.GradientTransformationExtraArgs(prediction.init, prediction.update)


_OWNER = 'linear_weight_prediction'


def _checked_inner(inner, horizon, form, learning_rate, momentum,
                   outermost) -> optax.GradientTransformationExtraArgs:
  """:func:`linear_weight_prediction`'s arguments checked; returns the built ``inner``."""
  owner = _OWNER
  if form not in _FORMS:
    raise ValueError(f'{owner}: form must be one of {_FORMS}, got {form!r}.')
  _checks.check_range(horizon, 'horizon', owner, low=0)
  if form != 'update' and learning_rate is not None:
    inner = _built_from_learning_rate(inner, learning_rate, form, owner)
  if not isinstance(inner, optax.GradientTransformation):
    hint = (f' (did you mean {inner.__name__}(...), called with its arguments?)'
            if callable(inner) else '')
    raise ValueError(f'{owner}: inner must be an optax GradientTransformation, e.g. '
                     f'optax.sgd(0.1, momentum=0.9); got {type(inner).__name__}{hint}.')
  if form == 'update':
    if learning_rate is not None or momentum is not None:
      raise ValueError(f"{owner}: form='update' extrapolates the update applied and takes no "
                       'learning_rate or momentum; they belong to inner.')
  else:
    if form == 'next_velocity':
      _checks.check_range(momentum, 'momentum', owner, low=0, high=1, high_open=True)
    elif momentum is not None:
      raise ValueError(f"{owner}: form='velocity' takes no momentum (only 'next_velocity' "
                       'does).')
  if not isinstance(outermost, bool):
    raise ValueError(f'{owner}: outermost must be a Python bool, got {outermost!r}.')
  return optax.with_extra_args_support(inner)


class _Prediction(NamedTuple):
  """The ``init`` and ``update`` of :func:`linear_weight_prediction`, given its checked
  arguments."""

  inner: optax.GradientTransformationExtraArgs
  horizon: Any
  form: str
  learning_rate: optax.ScalarOrSchedule | None
  momentum: Any
  outermost: bool

  def check_learning_rate_source(self, inner_state):
    owner, form, learning_rate = _OWNER, self.form, self.learning_rate
    injected = _injected_learning_rate(inner_state)
    if learning_rate is None and injected is None:
      raise ValueError(f"{owner}: form={form!r} needs the inner learning rate to turn the "
                       'momentum trace into a step: build inner with optax.inject_hyperparams '
                       'so that it is read from its state, or pass learning_rate (a float or '
                       'schedule) with inner as a function of it, e.g. '
                       'inner=lambda lr: optax.sgd(lr, momentum=0.9).')
    if learning_rate is not None and injected is not None:
      raise ValueError(f'{owner}: the learning rate is given twice, as learning_rate and as '
                       "the injected 'learning_rate' of inner; leave learning_rate out so that "
                       'the one inner applies is used.')

  def stored_horizon(self):
    # Only predicted_params's extrapolation needs it; elsewhere it is already in the prediction.
    return (jnp.asarray(self.horizon, jnp.float32) if self.form == 'update' and not self.outermost
            else None)

  def init(self, params):
    form, outermost = self.form, self.outermost
    inner_state = self.inner.init(params)
    previous, offset, forward = None, None, None
    if form != 'update':
      # Fails here rather than on the first update; the offset takes the trace's dtype.
      offset = optax.tree_utils.tree_zeros_like(_find_velocity(inner_state))
      self.check_learning_rate_source(inner_state)
    if outermost:
      offset, forward = None, jax.tree.map(jnp.copy, params)
    elif form == 'update':
      previous = jax.tree.map(jnp.copy, params)
    return WeightPredictionState(
        count=jnp.zeros([], jnp.int32), inner_state=inner_state, horizon=self.stored_horizon(),
        previous_params=previous, offset=offset, forward_params=forward)

  def velocity_offset(self, gradient, state, inner_state):
    """The velocity forms' offset ``o_t = -eta_t T v`` (``v`` the next velocity, or the trace)."""
    if self.learning_rate is None:
      eta = _injected_learning_rate(inner_state)
    else:
      eta = (self.learning_rate(state.count) if callable(self.learning_rate)
             else self.learning_rate)
    step_scale = -_checks.at_least_float32(eta) * _checks.at_least_float32(self.horizon)
    velocity = _find_velocity(inner_state)
    if self.form == 'next_velocity':
      velocity = _checks.map_gradients(
          lambda g, v: jnp.asarray(self.momentum, v.dtype) * v + g.astype(v.dtype), gradient,
          velocity)
    offset = jax.tree.map(lambda v: jnp.asarray(step_scale, v.dtype) * v, velocity)
    if not self.outermost:
      offset = optax.tree_utils.tree_cast_like(
          _checks.keep_where_no_gradient(gradient, offset, state.offset), state.offset)
    return offset

  def update(self, updates, state, params=None, **extra_args):
    form, outermost, horizon = self.form, self.outermost, self.horizon
    if params is None:
      raise ValueError(f'{_OWNER}: update needs params (the weights before this update, from '
                       'which the prediction extrapolates).')
    _checks.check_same_structure(
        params, state.forward_params if outermost else
        state.previous_params if form == 'update' else state.offset, 'params',
        'the params given to init', _OWNER)
    _checks.check_gradients(updates, params, _OWNER)
    gradient = updates
    updates, inner_state = self.inner.update(updates, state.inner_state, params, **extra_args)
    previous, offset, forward = None, None, None
    if form == 'update':
      if outermost:
        offset = _checks.map_gradients(lambda u: jnp.asarray(horizon, u.dtype) * u, updates)
      else:
        previous = params
    else:
      offset = self.velocity_offset(gradient, state, inner_state)
    if outermost:
      # From the weights before the update, not after: a prediction that read the new weights
      # would keep the old ones alive past the update whenever the update reads them (coupled
      # weight decay), and the compiled loop would then copy the new weights every step. A
      # frozen leaf (None update) stays where it is.
      forward = jax.tree.map(
          lambda p, u, o: p if u is None else ((p + o) + u).astype(p.dtype),
          params, updates, offset)
      offset = None
    return updates, WeightPredictionState(
        count=optax.safe_increment(state.count), inner_state=inner_state,
        horizon=self.stored_horizon(), previous_params=previous, offset=offset,
        forward_params=forward)


def _built_from_learning_rate(make_inner: Any, learning_rate: Any, form: str,
                              owner: str) -> optax.GradientTransformation:
  """``make_inner(learning_rate)``: the update rule built from the rate the prediction uses."""
  _checks.check_learning_rate(learning_rate, owner)
  if isinstance(make_inner, optax.GradientTransformation) or not callable(make_inner):
    raise ValueError(
        f'{owner}: form={form!r} with learning_rate needs inner as a function of the learning '
        'rate, e.g. inner=lambda lr: optax.sgd(lr, momentum=0.9), so that the prediction steps '
        'with the rate the update applies; the rate inside a built inner cannot be checked '
        f'against learning_rate (got {type(make_inner).__name__}). An inner built with '
        'optax.inject_hyperparams needs no learning_rate: it is read from its state.')
  inner = make_inner(learning_rate)
  if not isinstance(inner, optax.GradientTransformation):
    raise ValueError(f'{owner}: inner(learning_rate) must return an optax '
                     f'GradientTransformation; got {type(inner).__name__}.')
  return inner


def _extrapolate(param, horizon, previous):
  # Promoted to at least float32: the step T (w - w_prev) is small beside w.
  dtype = jnp.promote_types(param.dtype, jnp.float32)
  now = param.astype(dtype)
  return (now + horizon.astype(dtype) * (now - previous.astype(dtype))).astype(param.dtype)


def predicted_params(opt_state: optax.OptState, params: optax.Params) -> optax.Params:
  """The weights the forward pass should use, ``params + o_t`` (:func:`linear_weight_prediction`).

  Arguments in the order of optax's ``optax.contrib.schedule_free_eval_params(state, params)``.
  ``opt_state`` is the state of an optimizer that contains :func:`linear_weight_prediction`
  anywhere: alone, in ``optax.chain``, ``optax.inject_hyperparams``, ``optax.MultiSteps``,
  ``optax.masked`` or ``optax.multi_transform``, once or once per set of parameters (e.g. one
  per pipeline stage, each with its own horizon); each parameter is predicted by the one that
  updates it, and parameters that none updates are returned as they are. ``params`` are the
  weights after the update that produced ``opt_state``; the update form extrapolates from them,
  so weights clipped or projected after ``apply_updates`` are predicted from where they are.

  Args:
    opt_state: the optimizer state after the last update.
    params: the current weights.

  Returns:
    The predicted weights, a tree like ``params`` with its dtypes.

  Raises:
    ValueError: if the state holds no prediction, two predictions cover one parameter, the
      arguments are swapped, or ``params`` do not fit the state.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import linear_weight_prediction, predicted_params
    >>> opt = optax.chain(optax.clip(1.0), linear_weight_prediction(optax.sgd(0.1), horizon=3))
    >>> params = jnp.zeros(2)
    >>> state = opt.init(params)
    >>> predicted_params(state, params)  # no update yet: no offset
    Array([0., 0.], dtype=float32)
    >>> updates, state = opt.update(jnp.array([2.0, -0.5]), state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> predicted_params(state, params)  # 4 steps of -0.1 * clip(g)
    Array([-0.4,  0.2], dtype=float32)
  """
  helper = 'predicted_params'
  states = _checks.find_states(opt_state, params, WeightPredictionState, helper,
                               'linear_weight_prediction', f'{helper}(opt_state, params)')

  def predict(param, index, cover):
    state = states[index]
    if state.forward_params is not None:  # outermost: made at update time
      return cover.astype(param.dtype)  # made in float32 under float32_state
    if state.previous_params is None:
      return (param + cover).astype(param.dtype)
    return _extrapolate(param, state.horizon, cover)

  covers = [next(tree for tree in (s.forward_params, s.previous_params, s.offset)
                 if tree is not None) for s in states]
  return _checks.merge_per_leaf(params, covers, predict, helper, 'linear_weight_prediction')
