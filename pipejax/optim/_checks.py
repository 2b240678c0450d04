"""Eager checks of hyperparameters, shared by the transformations of :mod:`pipejax.optim`.

A factory checks a hyperparameter only when it is a concrete Python (or NumPy) number. Under
``optax.inject_hyperparams`` the same factory is called again on every step with the values as jax
arrays, possibly traced, which cannot be compared in Python; those pass through unchecked (they were
checked when the user first wrote them down as numbers, or come from the user's own schedule).
"""

from __future__ import annotations

import numbers
import operator
from typing import Any

import jax
import jax.numpy as jnp
import optax


def is_concrete_number(value: Any) -> bool:
  """True for Python and NumPy real scalars, False for jax arrays (concrete or traced)."""
  return isinstance(value, numbers.Real)


def check_range(value: Any, name: str, owner: str, *, low: float | None = None,
                high: float | None = None, low_open: bool = False,
                high_open: bool = False) -> None:
  """Raises ``ValueError`` if a concrete ``value`` lies outside the given interval.

  Args:
    value: the hyperparameter; anything but a concrete number is accepted unchecked.
    name: its argument name, for the message.
    owner: the function it was given to, for the message.
    low: smallest allowed value (None: unbounded).
    high: largest allowed value (None: unbounded).
    low_open: exclude ``low`` itself.
    high_open: exclude ``high`` itself.
  """
  if isinstance(value, (str, bytes)):  # a number typed as text, e.g. read from a file
    raise ValueError(f'{owner}: {name} must be a number, got the string {value!r}.')
  if not is_concrete_number(value):
    return
  too_low = low is not None and (value <= low if low_open else value < low)
  too_high = high is not None and (value >= high if high_open else value > high)
  # NaN compares False with everything, so it needs its own test.
  if too_low or too_high or value != value:
    left = '(' if low_open or low is None else '['
    right = ')' if high_open or high is None else ']'
    low_text = '-inf' if low is None else f'{low:g}'
    high_text = 'inf' if high is None else f'{high:g}'
    raise ValueError(f'{owner}: {name} must be in {left}{low_text}, {high_text}{right}, '
                     f'got {value!r}.')


def check_static_int(value: Any, name: str, owner: str, *, minimum: int = 0) -> int:
  """Returns ``value`` as a Python int, or raises if it is not a concrete integer >= minimum.

  For hyperparameters that fix array shapes: they must be known when the state is built.
  """
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    hint = ''
    if isinstance(value, jax.Array):
      hint = (' It sets the size of the state, so it cannot be a jax array; under '
              f"optax.inject_hyperparams pass static_args='{name}'.")
    raise ValueError(f'{owner}: {name} must be a Python int, got {value!r} '
                     f'({type(value).__name__}).{hint}')
  value = operator.index(value)
  if value < minimum:
    raise ValueError(f'{owner}: {name} must be an int >= {minimum}, got {value}.')
  return value


def is_concrete_zero(value: Any) -> bool:
  """True when ``value`` is a concrete number equal to zero (a branch can then be skipped)."""
  return is_concrete_number(value) and value == 0


def at_least_float32(value: Any) -> Any:
  """Python numbers unchanged; arrays promoted to at least float32.

  Coefficients such as ``m**D`` are computed in at least float32 and only then cast to the leaf
  dtype: in bfloat16 ``0.999**D`` would round to 1 long before it should.
  """
  if is_concrete_number(value):
    return value
  value = jnp.asarray(value)
  return value.astype(jnp.promote_types(value.dtype, jnp.float32))


def get_unique(opt_state: optax.OptState, key: str, helper: str, provider: str,
               hint: str = '') -> Any:
  """Finds the one state field called ``key`` anywhere in a nested optimizer state.

  Args:
    opt_state: any optimizer state (chain, inject_hyperparams, MultiSteps, ...).
    key: the field name.
    helper: the public function asking, for the message.
    provider: what keeps the field, for the message.
    hint: a sentence appended to the message when the field is missing.

  Returns:
    The value of the field.

  Raises:
    ValueError: if no field or several fields are called ``key``.
  """
  try:
    value = optax.tree_utils.tree_get(opt_state, key)
  except KeyError as error:
    raise ValueError(f"{helper}: the optimizer state holds several '{key}' fields, so it is not "
                     f'clear which to use. Give {helper} the sub-state that holds the one you '
                     'mean.') from error
  if value is None:
    raise ValueError(f"{helper}: the optimizer state has no '{key}' field. It must come from an "
                     f'optimizer that contains {provider}, alone or inside chain, '
                     f'inject_hyperparams or MultiSteps.{" " + hint if hint else ""}')
  return value
