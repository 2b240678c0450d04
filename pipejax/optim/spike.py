"""Spike Compensation: momentum that applies a late gradient as if it had arrived on time.

In Pipelined Backpropagation a stage's gradient arrives ``D`` updates after the forward pass that
produced it. Heavy-ball momentum spreads a gradient over all later steps, so a late gradient has
already missed the first ``D`` of its contributions. Spike Compensation (Kosson et al., 2021) pays
those missed contributions at once, as a spike, and scales down what the momentum trace still owes,
so that from the step the gradient arrives on, the weights move exactly as undelayed momentum
would have moved them for that gradient.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipejax.optim import _checks


class SpikeCompensationState(NamedTuple):
  """State of :func:`spike_compensation`."""

  count: jax.Array  # shape=(), dtype=int32: number of updates so far.
  trace: optax.Updates  # heavy-ball momentum v; other code finds it by this name.


class ScaleByAdamSCState(NamedTuple):
  """State of :func:`scale_by_adam_sc` (the fields of ``optax.ScaleByAdamState``)."""

  count: jax.Array  # shape=(), dtype=int32.
  mu: optax.Updates  # EMA of gradients (first moment), before bias correction.
  nu: optax.Updates  # EMA of squared gradients (second moment), before bias correction.


def spike_coefficients(delay: Any, momentum: Any) -> tuple[Any, Any]:
  r"""Coefficients of Spike Compensation in the heavy-ball form.

  .. math::

    a = m^D, \qquad b = \frac{1 - m^D}{1 - m} = \sum_{k=0}^{D-1} m^k

  ``b`` is what undelayed momentum would have applied of a gradient during the ``D`` steps it was
  in flight, and ``a`` the fraction of the gradient still left in the trace after them.

  Args:
    delay: the gradient delay ``D >= 0``, a whole number (Python number or jax array).
    momentum: the momentum ``m`` in ``[0, 1)`` (Python number or jax array).

  Returns:
    ``(a, b)``, Python floats for Python inputs, jax arrays otherwise.

  Example:
    >>> from pipejax.optim import spike_coefficients
    >>> spike_coefficients(2, 0.5)
    (0.25, 1.5)
  """
  _check_delay_and_momentum(delay, momentum, 'spike_coefficients')
  delay = _checks.at_least_float32(delay)  # an int array, checked: float32 as m is
  a = momentum**delay
  if _checks.is_concrete_number(momentum):
    return a, (1 - a) / (1 - momentum)
  # A traced momentum escapes the range check; at m = 1 the sum is D, not 0 / 0.
  at_one = momentum == 1
  b = jnp.where(at_one, jnp.asarray(delay, jnp.result_type(a)),
                (1 - a) / jnp.where(at_one, 1, 1 - momentum))
  return a, b


def _check_delay_and_momentum(delay: Any, momentum: Any, owner: str) -> None:
  _checks.check_count(delay, 'delay', owner)
  _checks.check_range(momentum, 'momentum', owner, low=0, high=1, high_open=True)


def spike_compensation(delay: Any, momentum: Any, nesterov: bool = False,
                       accumulator_dtype: Any = None) -> optax.GradientTransformationExtraArgs:
  r"""Heavy-ball momentum with Spike Compensation for gradients ``delay`` steps late.

  With the gradient :math:`g_t` that arrives at step :math:`t` (computed ``D`` steps earlier):

  .. math::

    v_t = m\,v_{t-1} + g_t, \qquad u_t = a\,v_t + b\,g_t,
    \qquad a = m^D,\; b = \frac{1 - m^D}{1 - m}

  and the weights then move by ``-lr * u_t`` (this transformation has no learning rate: chain it
  with ``optax.scale_by_learning_rate``). A gradient applied by undelayed momentum ``k`` steps after
  it was computed contributes :math:`m^k g`; here it contributes nothing before it arrives,
  :math:`(a + b) g = \sum_{k=0}^{D} m^k g` at arrival (everything it missed, plus its due), and
  :math:`a\,m^j g = m^{D+j} g` ``j`` steps later, so from its arrival on the weights follow the
  trajectory undelayed momentum would have given that gradient.

  **Nesterov.** Nesterov momentum, :math:`u_t = g_t + m v_t` (``optax.trace(nesterov=True)``),
  applies a gradient ``k`` steps after it was computed with the weight :math:`m^{k+1}` (and
  :math:`1 + m` at once): it is heavy-ball momentum one step ahead. Its compensation is therefore
  the one above with ``D + 1``: :math:`u_t = m^{D+1} v_t + \frac{1 - m^{D+1}}{1 - m} g_t`.

  With ``delay=0`` it is ``optax.trace(decay=momentum, nesterov=nesterov)`` exactly, so
  ``optax.chain(spike_compensation(0, m), optax.scale_by_learning_rate(lr))`` is
  ``optax.sgd(lr, momentum=m)`` bit for bit. A ``None`` gradient leaf (a frozen parameter) gives a
  ``None`` update, and its trace is kept as it was.

  Args:
    delay: gradient delay ``D >= 0`` in steps, a whole number; a stage ``s`` of an ``S``-stage
      pipeline has ``D = 2(S - 1 - s)``. May be a jax array (``optax.inject_hyperparams``).
    momentum: heavy-ball momentum ``m`` in ``[0, 1)``.
    nesterov: use Nesterov momentum (a Python bool).
    accumulator_dtype: dtype of the trace (None: the params' dtype), as in ``optax.trace``. Give
      ``jnp.float32`` for bfloat16 params whenever ``m`` is close to 1: in bfloat16 0.99918 is 1.0.

  Returns:
    A ``GradientTransformationExtraArgs`` whose state is a :class:`SpikeCompensationState`.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import spike_compensation
    >>> opt = optax.chain(spike_compensation(delay=2, momentum=0.5),
    ...                   optax.scale_by_learning_rate(0.1))
    >>> params = jnp.array([1.0, 2.0])
    >>> state = opt.init(params)
    >>> updates, state = opt.update(jnp.array([1.0, -1.0]), state, params)
    >>> updates  # -0.1 * (0.25 + 1.5) * g
    Array([-0.175,  0.175], dtype=float32)
    >>> optax.apply_updates(params, updates)
    Array([0.825, 2.175], dtype=float32)

  References:
    Kosson et al., `Pipelined Backpropagation at Scale: Training Large Models without Batches
    <https://arxiv.org/abs/2003.11666>`_, MLSys 2021.
  """
  owner = 'spike_compensation'
  _check_delay_and_momentum(delay, momentum, owner)
  _check_flag(nesterov, 'nesterov', owner)
  accumulator_dtype = _checks.canonicalize_dtype(accumulator_dtype, 'accumulator_dtype', owner)

  def init_fn(params):
    return SpikeCompensationState(
        count=jnp.zeros([], jnp.int32),
        trace=optax.tree_utils.tree_zeros_like(params, dtype=accumulator_dtype))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _checks.check_gradients(updates, state.trace, owner)
    # Same operation order as optax.trace (g + m * v), so that delay 0 matches it bit for bit.
    trace = _checks.map_gradients(lambda g, v: g + jnp.asarray(momentum, v.dtype) * v, updates,
                                  state.trace)
    if _checks.is_concrete_zero(delay):
      compensated = (_checks.map_gradients(
          lambda g, v: g + jnp.asarray(momentum, v.dtype) * v, updates, trace)
                     if nesterov else trace)
    else:
      a, b = spike_coefficients(delay + (1 if nesterov else 0),
                                _checks.at_least_float32(momentum))
      compensated = _checks.map_gradients(
          lambda g, v: jnp.asarray(a, v.dtype) * v + jnp.asarray(b, g.dtype) * g, updates, trace)
    trace = optax.tree_utils.tree_cast_like(
        _checks.keep_where_no_gradient(updates, trace, state.trace), state.trace)
    return compensated, SpikeCompensationState(count=optax.safe_increment(state.count),
                                               trace=trace)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_flag(value: Any, name: str, owner: str) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f'{owner}: {name} must be a Python bool, got {value!r} '
                     f'({type(value).__name__}).')


def sgd_sc(learning_rate: optax.ScalarOrSchedule, delay: Any, momentum: Any,
           weight_decay: Any = 0.0, nesterov: bool = False,
           accumulator_dtype: Any = None) -> optax.GradientTransformationExtraArgs:
  r"""Momentum SGD with Spike Compensation: the per-stage update rule of PB + SC.

  .. math::

    g \leftarrow g + \lambda w, \qquad v \leftarrow m v + g, \qquad
    w \leftarrow w - \eta\,(m^D v + \tfrac{1 - m^D}{1 - m}\,g)

  Weight decay is coupled (an L2 term added to the gradient before the momentum, as
  ``optax.sgd`` with ``optax.add_decayed_weights`` in front), so it is delayed and compensated
  like the gradient it joins; it is left out of the chain when ``weight_decay`` is a Python 0.
  With ``delay=0`` it is ``optax.sgd(learning_rate, momentum, nesterov, accumulator_dtype)``.

  Args:
    learning_rate: ``eta``, a float or an optax schedule of the step count.
    delay: gradient delay ``D >= 0`` of the stage, a whole number.
    momentum: heavy-ball momentum ``m`` in ``[0, 1)``.
    weight_decay: coupled weight decay ``lambda >= 0``.
    nesterov: Nesterov momentum, compensated as :func:`spike_compensation` says.
    accumulator_dtype: dtype of the momentum trace (None: the params' dtype). With bfloat16
      params and a momentum close to 1, give ``jnp.float32``.

  Returns:
    ``optax.chain(add_decayed_weights, spike_compensation, scale_by_learning_rate)`` (its state
    too), whose ``update`` first checks that the gradients and params fit the params of ``init``.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import sgd_sc
    >>> opt = sgd_sc(learning_rate=0.1, delay=2, momentum=0.5)
    >>> params = {'w': jnp.array([1.0, -1.0])}
    >>> state = opt.init(params)
    >>> for _ in range(3):  # minimise |w|^2 / 2, whose gradient is w
    ...   updates, state = opt.update(params, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params['w']
    Array([ 0.5346..., -0.5346...], dtype=float32)

    Under ``optax.inject_hyperparams`` the hyperparameters live in the state and can be changed
    between steps (``hyperparam_dtype`` keeps them in float32 for bfloat16 params):

    >>> opt = optax.inject_hyperparams(sgd_sc, hyperparam_dtype=jnp.float32)(
    ...     learning_rate=0.1, delay=2, momentum=0.9)
    >>> state = opt.init(params)
    >>> state.hyperparams['learning_rate'] = jnp.float32(0.05)

  References:
    Kosson et al., `Pipelined Backpropagation at Scale: Training Large Models without Batches
    <https://arxiv.org/abs/2003.11666>`_, MLSys 2021.
  """
  _check_delay_and_momentum(delay, momentum, 'sgd_sc')
  _checks.check_range(weight_decay, 'weight_decay', 'sgd_sc', low=0)
  _checks.check_learning_rate(learning_rate, 'sgd_sc')
  parts = []
  if not _checks.is_concrete_zero(weight_decay):
    parts.append(optax.add_decayed_weights(weight_decay))
  parts.append(spike_compensation(delay, momentum, nesterov, accumulator_dtype))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  # optax.add_decayed_weights would broadcast a parameter of shape () or (1,) into the update.
  return _checks.checking_gradients(optax.chain(*parts), 'sgd_sc', _checks.state_field('trace'))


def _check_adam(delay: Any, b1: Any, b2: Any, eps: Any, eps_root: Any, owner: str) -> None:
  _checks.check_count(delay, 'delay', owner)
  _checks.check_range(b1, 'b1', owner, low=0, high=1, high_open=True)
  _checks.check_range(b2, 'b2', owner, low=0, high=1, high_open=True)
  _checks.check_range(eps, 'eps', owner, low=0)
  _checks.check_range(eps_root, 'eps_root', owner, low=0)


def compensated_first_moment(updates: optax.Updates, mu: optax.Updates, b1: Any, count: Any,
                             delay: Any, nesterov: bool) -> optax.Updates:
  r"""The bias-corrected EMA first moment, spike-compensated for gradients ``delay`` steps late.

  With :math:`\mu_t` the raw moment after step :math:`t` (``count``) and :math:`g_t` the gradient:

  .. math::

    \text{plain:}\quad \beta^D\,\frac{\mu_t}{1 - \beta^t} + (1 - \beta^D)\,g_t, \qquad
    \text{Nesterov:}\quad \beta^{D+1}\,\frac{\mu_t}{1 - \beta^{t+D+1}}
    + (1 - \beta^{D+1})\,\frac{g_t}{1 - \beta^{t+D}}

  At ``D = 0`` they are optax's ``mu_hat`` of ``scale_by_adam`` (and of
  ``optax.contrib.scale_by_muon``), plain and Nesterov (Dozat's form), exactly: the Nesterov form is
  the plain one a step ahead, so its compensation is the plain one with ``D + 1``, as for heavy-ball
  momentum (:func:`spike_compensation`). Both keep the weights of all gradients summing to one for
  large ``t``; the Nesterov form's bias corrections are those of Dozat's, ``D`` steps later, so that
  its first step is bounded for any ``D`` (by ``1 + beta / (1 + beta)`` times ``g``, optax's own).

  Args:
    updates: the gradients :math:`g_t` (``None`` leaves stay ``None``).
    mu: the raw moment :math:`\mu_t`, already updated with :math:`g_t`.
    b1: the moment's decay :math:`\beta`.
    count: :math:`t`, the number of updates including this one.
    delay: :math:`D`; a Python 0 reproduces optax's arithmetic bit for bit.
    nesterov: the Nesterov form (a Python bool).

  Returns:
    The compensated moment, a tree like ``updates``.
  """
  if not nesterov:
    mu_hat = optax.tree_utils.tree_bias_correction(mu, b1, count)
    if _checks.is_concrete_zero(delay):
      return mu_hat
    kept = _checks.at_least_float32(b1)**_checks.at_least_float32(delay)
    return _checks.map_gradients(
        lambda g, m: jnp.asarray(kept, m.dtype) * m + jnp.asarray(1 - kept, g.dtype) * g,
        updates, mu_hat)
  if _checks.is_concrete_zero(delay):  # The helpers and order of scale_by_adam(nesterov=True).
    return _checks.map_gradients(
        lambda g, m: b1 * m + (1 - b1) * g,
        optax.tree_utils.tree_bias_correction(updates, b1, count),
        optax.tree_utils.tree_bias_correction(mu, b1, optax.safe_increment(count)))
  beta = _checks.at_least_float32(b1)
  ahead = _checks.at_least_float32(delay) + 1  # Nesterov is the plain form one step ahead.
  kept = beta**ahead
  t = jnp.asarray(count, jnp.float32)
  moment_scale = kept / (1 - beta**(t + ahead))
  gradient_scale = (1 - kept) / (1 - beta**(t + ahead - 1))
  return _checks.map_gradients(
      lambda g, m: (jnp.asarray(moment_scale, m.dtype) * m
                    + jnp.asarray(gradient_scale, g.dtype) * g), updates, mu)


def scale_by_adam_sc(delay: Any, b1: Any = 0.9, b2: Any = 0.999, eps: Any = 1e-8,
                     eps_root: Any = 0.0, mu_dtype: Any = None,
                     nesterov: bool = False) -> optax.GradientTransformationExtraArgs:
  r"""Adam whose first moment is spike-compensated for gradients ``delay`` steps late.

  Adam's first moment is the EMA form of momentum; its Spike Compensation (docs/design.md §3) is

  .. math::

    \mu_t = \beta_1 \mu_{t-1} + (1 - \beta_1) g_t, \qquad
    \hat\mu_t = \frac{\mu_t}{1 - \beta_1^t}, \qquad
    u^{(1)}_t = \beta_1^D\,\hat\mu_t + (1 - \beta_1^D)\,g_t

  and the update is :math:`u^{(1)}_t / (\sqrt{\hat\nu_t + \epsilon_\text{root}} + \epsilon)`
  with Adam's bias-corrected second moment :math:`\hat\nu_t` (no learning rate; see
  :func:`adam_sc`).

  **Bias correction comes first.** ``mu_hat`` is a weighted average of the gradients seen so far
  (weights summing to one), and the compensation mixes it with the new gradient with weights
  ``beta1**D`` and ``1 - beta1**D`` that again sum to one, so the compensated moment stays a
  normalised average of gradients at every step. Compensating the raw ``mu`` first and dividing by
  ``1 - beta1**t`` afterwards would instead give the gradient of step 1 the weight
  ``(1 - beta1**(D+1)) / (1 - beta1)``, i.e. an update about ``D + 1`` times too large at the start.

  The second moment is not compensated: it normalises the step size, and a gradient's share of it
  does not depend on when the gradient arrives.

  **Nesterov** (NAdam, Dozat's form as ``optax.scale_by_adam(nesterov=True)``): the first moment
  is then :func:`compensated_first_moment`'s Nesterov form, the plain compensation ``D + 1`` steps
  ahead.

  With ``delay=0`` it is ``optax.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov)``
  exactly. A ``None`` gradient leaf gives a ``None`` update and keeps its moments.

  Args:
    delay: gradient delay ``D >= 0``, a whole number.
    b1: decay of the first moment, in ``[0, 1)``.
    b2: decay of the second moment, in ``[0, 1)``.
    eps: added to the denominator outside the square root, ``>= 0``.
    eps_root: added to the second moment inside the square root, ``>= 0`` (as in
      ``optax.scale_by_adam``: keeps the gradient of the update finite when differentiating
      through it).
    mu_dtype: dtype of the first moment (None: the params' dtype), as in ``optax.scale_by_adam``.
    nesterov: NAdam's Nesterov first moment (a Python bool).

  Returns:
    A ``GradientTransformationExtraArgs`` whose state is a :class:`ScaleByAdamSCState`.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import scale_by_adam_sc
    >>> opt = optax.chain(scale_by_adam_sc(delay=4), optax.scale_by_learning_rate(1e-3))
    >>> params = jnp.array([1.0, -2.0])
    >>> state = opt.init(params)
    >>> updates, state = opt.update(jnp.array([0.5, 0.5]), state, params)
    >>> optax.apply_updates(params, updates)  # Adam's first step: -lr * sign(g)
    Array([ 0.999, -2.001], dtype=float32)

  References:
    Kosson et al., `Pipelined Backpropagation at Scale: Training Large Models without Batches
    <https://arxiv.org/abs/2003.11666>`_, MLSys 2021;
    Kingma and Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, ICLR 2015.
  """
  owner = 'scale_by_adam_sc'
  _check_adam(delay, b1, b2, eps, eps_root, owner)
  _check_flag(nesterov, 'nesterov', owner)
  mu_dtype = _checks.canonicalize_dtype(mu_dtype, 'mu_dtype', owner)

  def init_fn(params):
    return ScaleByAdamSCState(count=jnp.zeros([], jnp.int32),
                              mu=optax.tree_utils.tree_zeros_like(params, dtype=mu_dtype),
                              nu=optax.tree_utils.tree_zeros_like(params))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _checks.check_gradients(updates, state.nu, owner)
    # The same helpers as optax.scale_by_adam, so that delay 0 reproduces it exactly.
    mu = optax.tree_utils.tree_update_moment(updates, state.mu, b1, 1)
    nu = optax.tree_utils.tree_update_moment_per_elem_norm(updates, state.nu, b2, 2)
    count = optax.safe_increment(state.count)
    mu_hat = compensated_first_moment(updates, mu, b1, count, delay, nesterov)
    nu_hat = optax.tree_utils.tree_bias_correction(nu, b2, count)
    adam_updates = _checks.map_gradients(lambda g, m, v: m / (jnp.sqrt(v + eps_root) + eps),
                                         updates, mu_hat, nu_hat)
    return adam_updates, ScaleByAdamSCState(
        count=count,
        mu=optax.tree_utils.tree_cast_like(
            _checks.keep_where_no_gradient(updates, mu, state.mu), state.mu),
        nu=optax.tree_utils.tree_cast_like(
            _checks.keep_where_no_gradient(updates, nu, state.nu), state.nu))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adam_sc(learning_rate: optax.ScalarOrSchedule, delay: Any, b1: Any = 0.9, b2: Any = 0.999,
            eps: Any = 1e-8, weight_decay: Any = 0.0, eps_root: Any = 0.0, mu_dtype: Any = None,
            mask: Any = None) -> optax.GradientTransformationExtraArgs:
  r"""Adam (AdamW when ``weight_decay > 0``) with a spike-compensated first moment.

  .. math::

    w \leftarrow w - \eta\,\Big(\frac{u^{(1)}}{\sqrt{\hat\nu + \epsilon_\text{root}}
    + \epsilon} + \lambda w\Big)

  with :math:`u^{(1)}` from :func:`scale_by_adam_sc`. Weight decay is decoupled and scaled by the
  learning rate, as in ``optax.adamw``; with ``delay=0`` this is ``optax.adamw`` (``optax.adam``
  when ``weight_decay`` is 0), ``mask`` included.

  Args:
    learning_rate: ``eta``, a float or an optax schedule.
    delay: gradient delay ``D >= 0`` of the stage, a whole number.
    b1: decay of the first moment, in ``[0, 1)``.
    b2: decay of the second moment, in ``[0, 1)``.
    eps: added to the denominator, ``>= 0``.
    weight_decay: decoupled weight decay ``lambda >= 0``.
    eps_root: added inside the square root, ``>= 0``.
    mu_dtype: dtype of the first moment (None: the params' dtype).
    mask: which leaves weight decay applies to, as in ``optax.adamw``: a tree of bools like the
      params, or a function of the params returning one (None: every leaf). Leave biases and
      normalisation scales out.

  Returns:
    ``optax.chain(scale_by_adam_sc, add_decayed_weights, scale_by_learning_rate)`` (its state
    too), whose ``update`` first checks that the gradients and params fit the params of ``init``.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import adam_sc
    >>> params = {'kernel': jnp.ones((2, 2)), 'bias': jnp.zeros(2)}
    >>> decay_kernels = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    >>> opt = adam_sc(learning_rate=1e-3, delay=6, weight_decay=1e-4, mask=decay_kernels)
    >>> state = opt.init(params)
    >>> grads = {'kernel': jnp.ones((2, 2)), 'bias': jnp.ones(2)}
    >>> updates, state = opt.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> [round(float(b), 6) for b in params['bias']]  # no decay on the bias: -lr * sign(g)
    [-0.001, -0.001]

  References:
    Kosson et al., `Pipelined Backpropagation at Scale: Training Large Models without Batches
    <https://arxiv.org/abs/2003.11666>`_, MLSys 2021;
    Loshchilov and Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, ICLR 2019.
  """
  _check_adam(delay, b1, b2, eps, eps_root, 'adam_sc')
  _checks.check_range(weight_decay, 'weight_decay', 'adam_sc', low=0)
  _checks.check_learning_rate(learning_rate, 'adam_sc')
  parts = [scale_by_adam_sc(delay, b1, b2, eps, eps_root, mu_dtype)]
  if not _checks.is_concrete_zero(weight_decay):
    parts.append(optax.add_decayed_weights(weight_decay, mask))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  # optax.add_decayed_weights would broadcast a parameter of shape () or (1,) into the update.
  return _checks.checking_gradients(optax.chain(*parts), 'adam_sc', _checks.state_field('mu'))
