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
    delay: the gradient delay ``D >= 0`` (Python number or jax array).
    momentum: the momentum ``m`` in ``[0, 1)`` (Python number or jax array).

  Returns:
    ``(a, b)``, Python floats for Python inputs, jax arrays otherwise.

  Example:
    >>> from pipejax.optim import spike_coefficients
    >>> spike_coefficients(2, 0.5)
    (0.25, 1.5)
  """
  _checks.check_range(momentum, 'momentum', 'spike_coefficients', low=0, high=1, high_open=True)
  _checks.check_range(delay, 'delay', 'spike_coefficients', low=0)
  a = momentum**delay
  b = (1 - a) / (1 - momentum)
  return a, b


def _check_delay_and_momentum(delay: Any, momentum: Any, owner: str) -> None:
  _checks.check_range(delay, 'delay', owner, low=0)
  _checks.check_range(momentum, 'momentum', owner, low=0, high=1, high_open=True)


def spike_compensation(delay: Any, momentum: Any) -> optax.GradientTransformationExtraArgs:
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

  With ``delay=0`` it is ``optax.trace(decay=momentum)`` exactly, so
  ``optax.chain(spike_compensation(0, m), optax.scale_by_learning_rate(lr))`` is
  ``optax.sgd(lr, momentum=m)`` bit for bit.

  Args:
    delay: gradient delay ``D >= 0`` in steps; a stage ``s`` of an ``S``-stage pipeline has
      ``D = 2(S - 1 - s)``. May be a jax array (``optax.inject_hyperparams``).
    momentum: heavy-ball momentum ``m`` in ``[0, 1)``.

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

  References:
    Kosson et al., `Pipelined Backpropagation at Scale: Training Large Models without Batches
    <https://arxiv.org/abs/2003.11666>`_, MLSys 2021.
  """
  _check_delay_and_momentum(delay, momentum, 'spike_compensation')

  def init_fn(params):
    return SpikeCompensationState(count=jnp.zeros([], jnp.int32),
                                  trace=optax.tree_utils.tree_zeros_like(params))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    # Same operation order as optax.trace (g + m * v), so that delay 0 matches it bit for bit.
    trace = jax.tree.map(lambda g, v: g + jnp.asarray(momentum, v.dtype) * v, updates, state.trace)
    if _checks.is_concrete_zero(delay):
      compensated = trace
    else:
      a, b = spike_coefficients(_checks.at_least_float32(delay), _checks.at_least_float32(momentum))
      compensated = jax.tree.map(
          lambda v, g: jnp.asarray(a, v.dtype) * v + jnp.asarray(b, g.dtype) * g, trace, updates)
    trace = optax.tree_utils.tree_cast_like(trace, state.trace)
    return compensated, SpikeCompensationState(count=optax.safe_increment(state.count),
                                               trace=trace)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def sgd_sc(learning_rate: optax.ScalarOrSchedule, delay: Any, momentum: Any,
           weight_decay: Any = 0.0) -> optax.GradientTransformationExtraArgs:
  r"""Momentum SGD with Spike Compensation: the per-stage update rule of PB + SC.

  .. math::

    g \leftarrow g + \lambda w, \qquad v \leftarrow m v + g, \qquad
    w \leftarrow w - \eta\,(m^D v + \tfrac{1 - m^D}{1 - m}\,g)

  Weight decay is coupled (an L2 term added to the gradient before the momentum, as
  ``optax.sgd`` with ``optax.add_decayed_weights`` in front), so it is delayed and compensated
  like the gradient it joins; it is left out of the chain when ``weight_decay`` is a Python 0.

  Args:
    learning_rate: ``eta``, a float or an optax schedule of the step count.
    delay: gradient delay ``D >= 0`` of the stage.
    momentum: heavy-ball momentum ``m`` in ``[0, 1)``.
    weight_decay: coupled weight decay ``lambda >= 0``.

  Returns:
    ``optax.chain(add_decayed_weights, spike_compensation, scale_by_learning_rate)``.

  Example:
    >>> import optax
    >>> from pipejax.optim import sgd_sc
    >>> opt = optax.inject_hyperparams(sgd_sc)(learning_rate=0.1, delay=2, momentum=0.9)

  References:
    Kosson et al., `Pipelined Backpropagation at Scale: Training Large Models without Batches
    <https://arxiv.org/abs/2003.11666>`_, MLSys 2021.
  """
  _check_delay_and_momentum(delay, momentum, 'sgd_sc')
  _checks.check_range(weight_decay, 'weight_decay', 'sgd_sc', low=0)
  if not callable(learning_rate):
    _checks.check_range(learning_rate, 'learning_rate', 'sgd_sc', low=0)
  parts = []
  if not _checks.is_concrete_zero(weight_decay):
    parts.append(optax.add_decayed_weights(weight_decay))
  parts.append(spike_compensation(delay, momentum))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return optax.chain(*parts)


def _check_adam(delay: Any, b1: Any, b2: Any, eps: Any, owner: str) -> None:
  _checks.check_range(delay, 'delay', owner, low=0)
  _checks.check_range(b1, 'b1', owner, low=0, high=1, high_open=True)
  _checks.check_range(b2, 'b2', owner, low=0, high=1, high_open=True)
  _checks.check_range(eps, 'eps', owner, low=0)


def scale_by_adam_sc(delay: Any, b1: Any = 0.9, b2: Any = 0.999,
                     eps: Any = 1e-8) -> optax.GradientTransformationExtraArgs:
  r"""Adam whose first moment is spike-compensated for gradients ``delay`` steps late.

  Adam's first moment is the EMA form of momentum; its Spike Compensation (docs/design.md §3) is

  .. math::

    \mu_t = \beta_1 \mu_{t-1} + (1 - \beta_1) g_t, \qquad
    \hat\mu_t = \frac{\mu_t}{1 - \beta_1^t}, \qquad
    u^{(1)}_t = \beta_1^D\,\hat\mu_t + (1 - \beta_1^D)\,g_t

  and the update is :math:`u^{(1)}_t / (\sqrt{\hat\nu_t} + \epsilon)` with Adam's bias-corrected
  second moment :math:`\hat\nu_t` (no learning rate; see :func:`adam_sc`).

  **Bias correction comes first.** ``mu_hat`` is a weighted average of the gradients seen so far
  (weights summing to one), and the compensation mixes it with the new gradient with weights
  ``beta1**D`` and ``1 - beta1**D`` that again sum to one, so the compensated moment stays a
  normalised average of gradients at every step. Compensating the raw ``mu`` first and dividing by
  ``1 - beta1**t`` afterwards would instead give the gradient of step 1 the weight
  ``(1 - beta1**(D+1)) / (1 - beta1)``, i.e. an update about ``D + 1`` times too large at the start.

  The second moment is not compensated: it normalises the step size, and a gradient's share of it
  does not depend on when the gradient arrives.

  With ``delay=0`` it is ``optax.scale_by_adam(b1, b2, eps)`` exactly.

  Args:
    delay: gradient delay ``D >= 0``.
    b1: decay of the first moment, in ``[0, 1)``.
    b2: decay of the second moment, in ``[0, 1)``.
    eps: added to the denominator, ``>= 0``.

  Returns:
    A ``GradientTransformationExtraArgs`` whose state is a :class:`ScaleByAdamSCState`.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import scale_by_adam_sc
    >>> opt = optax.chain(scale_by_adam_sc(delay=4), optax.scale_by_learning_rate(1e-3))
    >>> state = opt.init(jnp.zeros(3))

  References:
    Kosson et al., `Pipelined Backpropagation at Scale: Training Large Models without Batches
    <https://arxiv.org/abs/2003.11666>`_, MLSys 2021;
    Kingma and Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, ICLR 2015.
  """
  _check_adam(delay, b1, b2, eps, 'scale_by_adam_sc')

  def init_fn(params):
    return ScaleByAdamSCState(count=jnp.zeros([], jnp.int32),
                              mu=optax.tree_utils.tree_zeros_like(params),
                              nu=optax.tree_utils.tree_zeros_like(params))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    # The same helpers as optax.scale_by_adam, so that delay 0 reproduces it exactly.
    mu = optax.tree_utils.tree_update_moment(updates, state.mu, b1, 1)
    nu = optax.tree_utils.tree_update_moment_per_elem_norm(updates, state.nu, b2, 2)
    count = optax.safe_increment(state.count)
    mu_hat = optax.tree_utils.tree_bias_correction(mu, b1, count)
    nu_hat = optax.tree_utils.tree_bias_correction(nu, b2, count)
    if not _checks.is_concrete_zero(delay):
      kept = _checks.at_least_float32(b1)**_checks.at_least_float32(delay)
      mu_hat = jax.tree.map(
          lambda m, g: jnp.asarray(kept, m.dtype) * m + jnp.asarray(1 - kept, g.dtype) * g,
          mu_hat, updates)
    adam_updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
    return adam_updates, ScaleByAdamSCState(
        count=count,
        mu=optax.tree_utils.tree_cast_like(mu, state.mu),
        nu=optax.tree_utils.tree_cast_like(nu, state.nu))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adam_sc(learning_rate: optax.ScalarOrSchedule, delay: Any, b1: Any = 0.9, b2: Any = 0.999,
            eps: Any = 1e-8, weight_decay: Any = 0.0) -> optax.GradientTransformationExtraArgs:
  r"""Adam (AdamW when ``weight_decay > 0``) with a spike-compensated first moment.

  .. math::

    w \leftarrow w - \eta\,\Big(\frac{u^{(1)}}{\sqrt{\hat\nu} + \epsilon} + \lambda w\Big)

  with :math:`u^{(1)}` from :func:`scale_by_adam_sc`. Weight decay is decoupled and scaled by the
  learning rate, as in ``optax.adamw``; with ``delay=0`` this is ``optax.adamw`` (``optax.adam``
  when ``weight_decay`` is 0).

  Args:
    learning_rate: ``eta``, a float or an optax schedule.
    delay: gradient delay ``D >= 0`` of the stage.
    b1: decay of the first moment, in ``[0, 1)``.
    b2: decay of the second moment, in ``[0, 1)``.
    eps: added to the denominator, ``>= 0``.
    weight_decay: decoupled weight decay ``lambda >= 0``.

  Returns:
    ``optax.chain(scale_by_adam_sc, add_decayed_weights, scale_by_learning_rate)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from pipejax.optim import adam_sc
    >>> opt = adam_sc(learning_rate=1e-3, delay=6, weight_decay=1e-4)
    >>> state = opt.init({'w': jnp.ones((2, 2))})

  References:
    Kosson et al., `Pipelined Backpropagation at Scale: Training Large Models without Batches
    <https://arxiv.org/abs/2003.11666>`_, MLSys 2021;
    Loshchilov and Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, ICLR 2019.
  """
  _check_adam(delay, b1, b2, eps, 'adam_sc')
  _checks.check_range(weight_decay, 'weight_decay', 'adam_sc', low=0)
  if not callable(learning_rate):
    _checks.check_range(learning_rate, 'learning_rate', 'adam_sc', low=0)
  parts = [scale_by_adam_sc(delay, b1, b2, eps)]
  if not _checks.is_concrete_zero(weight_decay):
    parts.append(optax.add_decayed_weights(weight_decay))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return optax.chain(*parts)
