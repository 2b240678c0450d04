"""A gradient delay line: staleness without a pipeline.

Putting :func:`delay_gradients` in front of any optimizer makes every gradient arrive ``delay``
steps late, the staleness a pipeline stage with delay ``D`` sees (but not its weight
inconsistency: the gradient is still computed on one set of weights). It lets any ordinary
training loop study stale gradients and the methods that compensate them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from pipejax.optim import _checks


class DelayGradientsState(NamedTuple):
  """State of :func:`delay_gradients`."""

  count: jax.Array  # shape=(), dtype=int32: calls so far; ``count % delay`` is the ring slot.
  buffer: optax.Updates  # leaves of shape (delay, *leaf.shape): the gradients in flight.


def delay_gradients(delay: int) -> optax.GradientTransformationExtraArgs:
  r"""Emits the gradient received ``delay`` calls ago (zeros for the first ``delay`` calls).

  .. math::

    u_t = \begin{cases} g_{t-D} & t \ge D \\ 0 & t < D \end{cases}

  The gradients in flight live in a ring buffer of ``delay`` slots per leaf: call ``t`` reads slot
  ``t % delay`` (the gradient of call ``t - delay``) and writes ``g_t`` in its place. With
  ``delay=0`` it is the identity. A ``None`` gradient leaf (a frozen parameter) passes through as
  ``None`` and leaves its slots alone.

  ``delay`` sets the buffer's shape, so it must be a concrete Python int known when the state is
  built; it cannot be a jax array. Under ``optax.inject_hyperparams`` mark it static:
  ``optax.inject_hyperparams(delay_gradients, static_args='delay')(delay=3)``.

  Args:
    delay: number of calls each gradient waits, a whole Python number ``>= 0`` (2.0 is 2).

  Returns:
    A ``GradientTransformationExtraArgs`` whose state is a :class:`DelayGradientsState`.

  Raises:
    ValueError: if ``delay`` is not a whole Python number or is negative.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import delay_gradients
    >>> opt = optax.chain(delay_gradients(2), optax.sgd(0.1))
    >>> params = jnp.array([1.0])
    >>> state = opt.init(params)
    >>> for g in (1.0, 2.0, 3.0):
    ...   updates, state = opt.update(jnp.array([g]), state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params  # the first two updates were zeros; the third applied the first gradient
    Array([0.9], dtype=float32)

    With Spike Compensation for the staleness, momentum SGD on gradients 3 steps stale:

    >>> from pipejax.optim import sgd_sc
    >>> opt = optax.chain(delay_gradients(3), sgd_sc(0.01, delay=3, momentum=0.9))

  References:
    Kosson et al., `Pipelined Backpropagation at Scale: Training Large Models without Batches
    <https://arxiv.org/abs/2003.11666>`_, MLSys 2021.
  """
  delay = _checks.check_static_int(delay, 'delay', 'delay_gradients')

  def init_fn(params):
    buffer = jax.tree.map(lambda p: jnp.zeros((delay, *jnp.shape(p)), jnp.result_type(p)), params)
    return DelayGradientsState(count=jnp.zeros([], jnp.int32), buffer=buffer)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _checks.check_gradients(updates, state.buffer, 'delay_gradients',
                            shape_of=lambda ring: ring.shape[1:])
    count = optax.safe_increment(state.count)
    if delay == 0:
      return updates, DelayGradientsState(count=count, buffer=state.buffer)
    slot = state.count % delay
    delayed = _checks.map_gradients(lambda g, ring: ring[slot], updates, state.buffer)
    buffer = _checks.keep_where_no_gradient(
        updates,
        _checks.map_gradients(lambda g, ring: ring.at[slot].set(g.astype(ring.dtype)), updates,
                              state.buffer),
        state.buffer)
    return delayed, DelayGradientsState(count=count, buffer=buffer)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
