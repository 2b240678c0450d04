"""PipeMare: per-stage learning-rate rescheduling and discrepancy correction.

PipeMare (Yang et al.) trains asynchronously like Pipelined Backpropagation but tackles the delay
differently from Spike Compensation: each stage starts with a learning rate divided by its delay and
anneals it to the full rate (delayed momentum is stable only for ``lr / (1 - m) <~ 1 / D``), and the
backward pass runs on an estimate of the weights the forward pass saw, extrapolated back from an
exponential moving average of recent updates.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pipejax.optim import _checks

# Not taken from the PipeMare paper: its full text was not available where this was written, and
# the value it uses could not be checked. See pipemare_discrepancy for the reasoning.
DEFAULT_GAMMA = 0.9
"""The default decay ``gamma`` of :func:`pipemare_discrepancy`'s running average of updates."""


class PipeMareState(NamedTuple):
  """State of :func:`pipemare_discrepancy`."""

  count: jax.Array  # shape=(), dtype=int32.
  delta: optax.Updates  # EMA of the applied updates w_new - w_old (the weights' velocity).


def pipemare_learning_rate(learning_rate: optax.ScalarOrSchedule, delay: Any,
                           anneal_steps: Any) -> optax.Schedule:
  r"""PipeMare's per-stage learning-rate rescheduling, as an optax schedule.

  .. math::

    \alpha_{k} = \bar\alpha_k \cdot \tau^{-(1 - \min(k/K,\,1))}, \qquad \tau = \max(D, 1)

  so a stage with delay ``D`` starts at :math:`\bar\alpha_0 / \tau` and reaches the base rate
  :math:`\bar\alpha_k` after ``K = anneal_steps`` steps (at once when ``K = 0``). Stages without
  delay (the last) are not rescheduled.

  Args:
    learning_rate: the base rate :math:`\bar\alpha`, a float or an optax schedule.
    delay: the stage's delay ``D >= 0``.
    anneal_steps: annealing length ``K >= 0`` in steps.

  Returns:
    A schedule ``count -> learning rate`` (float32).

  Example:
    >>> from pipejax.optim import pipemare_learning_rate
    >>> schedule = pipemare_learning_rate(0.1, delay=4, anneal_steps=100)
    >>> float(schedule(0)), float(schedule(100))
    (0.02500000037252903, 0.10000000149011612)

  References:
    Yang et al., `PipeMare: Asynchronous Pipeline Parallel DNN Training
    <https://arxiv.org/abs/1910.05124>`_, MLSys 2021.
  """
  owner = 'pipemare_learning_rate'
  _checks.check_learning_rate(learning_rate, owner)
  _checks.check_count(delay, 'delay', owner)
  _checks.check_range(anneal_steps, 'anneal_steps', owner, low=0)

  def schedule(count):
    base = learning_rate(count) if callable(learning_rate) else learning_rate
    tau = jnp.maximum(jnp.asarray(delay, jnp.float32), 1.0)
    steps = jnp.asarray(anneal_steps, jnp.float32)
    # K = 0 means no annealing; the maximum only keeps the unused branch free of 0/0.
    progress = jnp.where(steps > 0, jnp.asarray(count, jnp.float32) / jnp.maximum(steps, 1.0), 1.0)
    exponent = -(1.0 - jnp.minimum(progress, 1.0))
    return base * tau**exponent

  return schedule


def pipemare_discrepancy(gamma: Any = DEFAULT_GAMMA) -> optax.GradientTransformationExtraArgs:
  r"""Tracks the EMA of the applied updates for PipeMare's discrepancy correction.

  Place it **last** in a chain, after the learning rate, so that the updates it sees are the ones
  applied, :math:`u_t = w_{t+1} - w_t`. It emits them unchanged and keeps

  .. math::

    \delta_t = \gamma\,\delta_{t-1} + (1 - \gamma)\,u_t

  from which :func:`pipemare_backward_params` estimates the weights of ``D`` steps ago as
  :math:`w - D\,\delta`, the weights the forward pass of the gradient now being computed saw.
  A ``None`` update leaf (a frozen parameter) passes through and keeps its average.

  **Default** ``gamma = 0.9``: not the paper's value (its text was not available here to check),
  but a choice by the following reasoning. ``D * delta`` should equal the sum of the last ``D``
  updates, i.e. ``delta`` should be their plain average; an EMA with decay ``gamma`` has the same
  mean lag as that average when ``gamma = (D - 1) / (D + 1)``. 0.9 matches ``D = 19``, the first
  stage of a 10-stage pipeline, and averages over the same 10-step horizon as momentum 0.9; for a
  stage with a very different delay, pass ``(D - 1) / (D + 1)``.

  Args:
    gamma: EMA decay in ``[0, 1)``; 0 keeps only the last update.

  Returns:
    A ``GradientTransformationExtraArgs`` whose state is a :class:`PipeMareState`.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import pipemare_backward_params, pipemare_discrepancy
    >>> opt = optax.chain(optax.sgd(0.1, momentum=0.9), pipemare_discrepancy(gamma=0.5))
    >>> params = jnp.array([1.0])
    >>> state = opt.init(params)
    >>> updates, state = opt.update(jnp.array([1.0]), state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> pipemare_backward_params(state, params, delay=4)  # 0.9 - 4 * 0.5 * (-0.1)
    Array([1.1], dtype=float32)

  References:
    Yang et al., `PipeMare: Asynchronous Pipeline Parallel DNN Training
    <https://arxiv.org/abs/1910.05124>`_, MLSys 2021.
  """
  _checks.check_range(gamma, 'gamma', 'pipemare_discrepancy', low=0, high=1, high_open=True)

  def init_fn(params):
    return PipeMareState(count=jnp.zeros([], jnp.int32),
                         delta=optax.tree_utils.tree_zeros_like(params))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _checks.check_gradients(updates, state.delta, 'pipemare_discrepancy')
    delta = _checks.keep_where_no_gradient(
        updates, optax.tree_utils.tree_update_moment(updates, state.delta, gamma, 1), state.delta)
    return updates, PipeMareState(count=optax.safe_increment(state.count),
                                  delta=optax.tree_utils.tree_cast_like(delta, state.delta))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def pipemare_backward_params(opt_state: optax.OptState, params: optax.Params,
                             delay: Any) -> optax.Params:
  """PipeMare's estimate of the weights ``delay`` steps ago: ``params - delay * delta``.

  **Only meaningful inside a pipeline.** There a stage with delay ``D`` receives, for its
  backward pass, the input of a forward that ran ``D`` updates ago on older weights; recomputing
  the stage on these estimated weights makes forward and backward see (nearly) the same weights
  without stashing old copies (PipeDream stashes them). In an ordinary training loop every
  gradient is computed on the current weights, so there is nothing to estimate; to study
  staleness alone there, use :func:`delay_gradients`.

  Arguments in the order of optax's ``schedule_free_eval_params(state, params)``, as
  :func:`predicted_params`. Under ``optax.masked`` or ``optax.multi_transform`` each parameter
  uses the :func:`pipemare_discrepancy` that updates it; parameters none updates are returned as
  they are.

  Args:
    opt_state: a state containing :func:`pipemare_discrepancy`'s (anywhere in chain /
      inject_hyperparams / MultiSteps / masked / multi_transform states).
    params: current weights.
    delay: the stage's delay ``D >= 0``.

  Returns:
    The estimated past weights, with the dtypes of ``params``.

  Raises:
    ValueError: if the state has no ``delta``, two cover one parameter, or the arguments are
      swapped.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import pipemare, pipemare_backward_params
    >>> opt = pipemare(0.1, delay=2, momentum=0.9, anneal_steps=0, gamma=0.0)
    >>> params = jnp.array([1.0])
    >>> state = opt.init(params)
    >>> updates, state = opt.update(jnp.array([1.0]), state, params)
    >>> params = optax.apply_updates(params, updates)  # a stage's update, as the engine makes it
    >>> # The stage's backward recomputes on the weights its forward saw two updates ago:
    >>> pipemare_backward_params(state, params, delay=2)  # 0.9 - 2 * (-0.1)
    Array([1.1], dtype=float32)
  """
  helper = 'pipemare_backward_params'
  _checks.check_count(delay, 'delay', helper)
  states = _checks.find_states(opt_state, params, PipeMareState, helper, 'pipemare_discrepancy',
                               f'{helper}(opt_state, params, delay)')

  def past(param, index, delta):
    del index
    return (param - jnp.asarray(delay, delta.dtype) * delta).astype(param.dtype)

  return _checks.merge_per_leaf(params, [s.delta for s in states], past, helper,
                                'pipemare_discrepancy')


def pipemare(learning_rate: optax.ScalarOrSchedule, delay: Any, momentum: Any, anneal_steps: Any,
             gamma: Any = DEFAULT_GAMMA) -> optax.GradientTransformationExtraArgs:
  r"""PipeMare's per-stage update: momentum SGD with rescheduled learning rate and discrepancy EMA.

  .. math::

    v \leftarrow m v + g, \qquad u = -\alpha_k v, \qquad
    \delta \leftarrow \gamma \delta + (1 - \gamma) u

  with :math:`\alpha_k` from :func:`pipemare_learning_rate`. Use
  :func:`pipemare_backward_params` for the backward pass's weights.

  Args:
    learning_rate: base rate, float or schedule.
    delay: the stage's delay ``D >= 0``.
    momentum: heavy-ball momentum in ``[0, 1)``.
    anneal_steps: length ``K >= 0`` of the learning-rate annealing, in steps.
    gamma: decay of the update EMA in ``[0, 1)`` (see :func:`pipemare_discrepancy`).

  Returns:
    ``optax.chain(trace, scale_by_learning_rate, pipemare_discrepancy)`` (its state too), whose
    ``update`` first checks that the gradients fit the params.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import pipemare
    >>> opt = pipemare(0.1, delay=4, momentum=0.9, anneal_steps=1000)
    >>> params = jnp.array([1.0, -1.0])
    >>> state = opt.init(params)
    >>> updates, state = opt.update(params, state, params)  # the gradient of |w|^2 / 2
    >>> optax.apply_updates(params, updates)  # the first step's rate is 0.1 / 4
    Array([ 0.975, -0.975], dtype=float32)

  References:
    Yang et al., `PipeMare: Asynchronous Pipeline Parallel DNN Training
    <https://arxiv.org/abs/1910.05124>`_, MLSys 2021.
  """
  _checks.check_range(momentum, 'momentum', 'pipemare', low=0, high=1, high_open=True)
  chain = optax.chain(
      optax.trace(decay=momentum),
      optax.scale_by_learning_rate(pipemare_learning_rate(learning_rate, delay, anneal_steps)),
      pipemare_discrepancy(gamma),
  )
  # optax.trace would broadcast a gradient of shape () or (1,) into every leaf.
  return _checks.checking_gradients(chain, 'pipemare', _checks.state_field('trace'))
