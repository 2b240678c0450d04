"""Checks of hyperparameters and trees, shared by the transformations of :mod:`pipejax.optim`.

A factory checks each hyperparameter when it is called. Python and NumPy numbers, 0-d NumPy arrays
and concrete jax arrays are all checked: ``optax.inject_hyperparams`` calls the factory again with
the values turned into jax arrays, concrete when ``init`` runs eagerly. Only a traced value (a
factory called inside ``jit``, as ``inject_hyperparams`` does on every ``update``) cannot be
compared in Python; it must still be a scalar, and its range is the caller's to keep.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax


def is_concrete_number(value: Any) -> bool:
  """True for Python and NumPy real scalars, False for arrays (concrete or traced)."""
  return isinstance(value, numbers.Real)


def _describe(value: Any) -> str:
  return f'{value!r} ({type(value).__name__})'


def scalar(value: Any, name: str, owner: str) -> float | None:
  """The value of a real scalar hyperparameter as a Python number; None when it is traced.

  Raises:
    ValueError: for anything but a real scalar: None, text, a bool, a list, an array with more
      than one element, a complex or boolean array.
  """
  what = f'{owner}: {name} must be a real number'
  if isinstance(value, (str, bytes)):  # a number typed as text, e.g. read from a file
    raise ValueError(f'{what}, got the string {value!r}.')
  if isinstance(value, (bool, np.bool_)):
    raise ValueError(f'{what}, got the bool {value!r}.')
  if isinstance(value, numbers.Real):
    return value
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    if value.shape != () or not (jnp.issubdtype(value.dtype, jnp.integer) or
                                 jnp.issubdtype(value.dtype, jnp.floating)):
      raise ValueError(f'{what} (a scalar), got an array of shape {value.shape} and dtype '
                       f'{value.dtype}.')
    if isinstance(value, jax.core.Tracer):
      return None
    return value.item()
  raise ValueError(f'{what}, got {_describe(value)}.')


def check_range(value: Any, name: str, owner: str, *, low: float | None = None,
                high: float | None = None, low_open: bool = False,
                high_open: bool = False) -> None:
  """Raises ``ValueError`` unless ``value`` is a finite real scalar in the given interval.

  A traced scalar is accepted unchecked (see the module docstring).

  Args:
    value: the hyperparameter.
    name: its argument name, for the message.
    owner: the function it was given to, for the message.
    low: smallest allowed value (None: unbounded).
    high: largest allowed value (None: unbounded).
    low_open: exclude ``low`` itself.
    high_open: exclude ``high`` itself.
  """
  number = scalar(value, name, owner)
  if number is None:
    return
  too_low = low is not None and (number <= low if low_open else number < low)
  too_high = high is not None and (number >= high if high_open else number > high)
  if too_low or too_high or not math.isfinite(number):
    left = '(' if low_open or low is None else '['
    right = ')' if high_open or high is None else ']'
    low_text = '-inf' if low is None else f'{low:g}'
    high_text = 'inf' if high is None else f'{high:g}'
    hint = ''
    if getattr(value, 'dtype', None) is not None and jnp.issubdtype(value.dtype, jnp.floating) \
        and jnp.finfo(value.dtype).bits < 32:
      # inject_hyperparams stores hyperparameters in the params' dtype unless told otherwise.
      hint = (f' It is a {value.dtype} array, so it may have been rounded (0.9999 is 1.0 in '
              'bfloat16); under optax.inject_hyperparams pass hyperparam_dtype=jnp.float32.')
    raise ValueError(f'{owner}: {name} must be in {left}{low_text}, {high_text}{right}, '
                     f'got {number!r}.{hint}')


def check_count(value: Any, name: str, owner: str) -> None:
  """Raises unless ``value`` is a whole number ``>= 0`` (a delay in steps; 2.0 counts as 2).

  An array (concrete or traced) must have an integer dtype: a floating one may already have been
  rounded, as ``optax.inject_hyperparams`` casts a float hyperparameter to the params' dtype and
  bfloat16 holds 301 as 300. A traced integer scalar is accepted unchecked.
  """
  scalar(value, name, owner)  # the type checks first: None, text, bools, arrays of many values
  if isinstance(value, (np.ndarray, np.generic, jax.Array)) and not jnp.issubdtype(
      value.dtype, jnp.integer):
    got = 'a traced' if isinstance(value, jax.core.Tracer) else f'{value.item()!r} as a'
    raise ValueError(f'{owner}: {name} is a number of steps and must be a Python int or an '
                     f'array of an integer dtype; got {got} {value.dtype} array, which may '
                     f'have been rounded (bfloat16 holds 301 as 300, and '
                     "optax.inject_hyperparams casts a float hyperparameter to the params' "
                     f'dtype). Pass {name} as a Python int, which inject_hyperparams keeps as it '
                     'is.')
  check_range(value, name, owner, low=0)
  number = scalar(value, name, owner)
  if number is not None and number != int(number):
    raise ValueError(f'{owner}: {name} is a number of steps and must be a whole number, got '
                     f'{number!r}.')


def check_static_int(value: Any, name: str, owner: str, *, minimum: int = 0) -> int:
  """Returns ``value`` as a Python int, or raises if it is not a concrete whole number >= minimum.

  For hyperparameters that fix array shapes: they must be known when the state is built, so a jax
  array is refused even when concrete (under ``inject_hyperparams`` it is traced at ``update``).
  """
  if isinstance(value, jax.Array):
    raise ValueError(f'{owner}: {name} must be a Python int, got a jax array '
                     f'({type(value).__name__}). It sets the size of the state, so it cannot be '
                     f"a jax array; under optax.inject_hyperparams pass static_args='{name}'.")
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or (
      not isinstance(value, numbers.Integral) and not float(value).is_integer()):
    raise ValueError(f'{owner}: {name} must be a Python int, got {_describe(value)}.')
  value = operator.index(value) if isinstance(value, numbers.Integral) else int(value)
  if value < minimum:
    raise ValueError(f'{owner}: {name} must be an int >= {minimum}, got {value}.')
  return value


def check_learning_rate(learning_rate: Any, owner: str) -> None:
  """A learning rate: a schedule (any callable) or a finite number ``>= 0``."""
  if not callable(learning_rate):
    check_range(learning_rate, 'learning_rate', owner, low=0)


def canonicalize_dtype(dtype: Any, name: str, owner: str) -> Any:
  """``None`` or a floating dtype, as optax's ``accumulator_dtype`` and ``mu_dtype`` take them."""
  if dtype is None:
    return None
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as error:
    raise ValueError(f'{owner}: {name} must be None or a floating dtype such as jnp.float32, '
                     f'got {_describe(dtype)}.') from error
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f'{owner}: {name} must be None or a floating dtype such as jnp.float32, '
                     f'got {dtype}.')
  return dtype


def is_concrete_zero(value: Any) -> bool:
  """True when ``value`` is a Python or NumPy number equal to zero (a branch can then be skipped).

  Arrays never count: under ``inject_hyperparams`` the same value arrives concrete at ``init`` and
  traced at ``update``, and both calls must build the same transformation.
  """
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


def is_none(x: Any) -> bool:
  return x is None


def map_gradients(fn: Callable[..., Any], updates: optax.Updates, *trees: Any) -> Any:
  """``jax.tree.map(fn, updates, *trees)`` that leaves ``None`` gradient leaves ``None``.

  A ``None`` leaf is a parameter without a gradient (frozen), as ``optax.sgd`` accepts them.
  """
  return jax.tree.map(lambda g, *rest: None if g is None else fn(g, *rest), updates, *trees,
                      is_leaf=is_none)


def keep_where_no_gradient(updates: optax.Updates, new: Any, old: Any) -> Any:
  """``new`` with the leaves of ``old`` wherever the gradient is ``None``.

  A frozen parameter's state is kept as it was, so that the state's structure does not depend on
  which leaves had gradients (``optax.trace`` replaces it by ``None``, which a ``lax.scan`` carry
  cannot hold).
  """
  return jax.tree.map(lambda g, n, o: o if g is None else n, updates, new, old, is_leaf=is_none)


def check_gradients(updates: Any, reference: Any, owner: str,
                    shape_of: Callable[[Any], tuple[int, ...]] = jnp.shape) -> None:
  """Raises a one-paragraph ``ValueError`` unless ``updates`` fit the params given to ``init``.

  Args:
    updates: the gradients given to ``update``; ``None`` leaves (frozen parameters) are fine.
    reference: a state tree built like the params at ``init``.
    owner: the transformation, for the message.
    shape_of: the params' leaf shape from a leaf of ``reference``.
  """
  try:
    map_gradients(lambda g, r: chex.assert_shape(g, shape_of(r)), updates, reference)
  except (AssertionError, ValueError, TypeError) as error:
    raise ValueError(f'{owner}: the gradients must have the structure and leaf shapes of the '
                     'params given to init (None leaves, for frozen parameters, are fine). '
                     f'{str(error).splitlines()[0] if str(error) else ""}') from error


def checking_gradients(transformation: optax.GradientTransformation, owner: str,
                       reference: Callable[[Any], Any]) -> optax.GradientTransformationExtraArgs:
  """``transformation`` whose ``update`` first refuses gradients, and params when given, that do
  not fit the params given to ``init``.

  For transformations built from optax's own (``optax.trace``, ``optax.adamw``), whose ``update``
  would broadcast a gradient of shape ``()`` or ``(1,)`` into a finite update of every leaf (and
  ``optax.add_decayed_weights`` a parameter of such a shape into the update).

  Args:
    transformation: the transformation to guard; its state is left as it is.
    owner: the public function that built it, for the message.
    reference: from the transformation's state, a tree with the params' structure and leaf shapes
      (a momentum trace, Adam's ``mu``).
  """
  transformation = optax.with_extra_args_support(transformation)

  def update_fn(updates, state, params=None, **extra_args):
    check_gradients(updates, reference(state), owner)
    if params is not None:
      check_params(params, reference(state), owner)
    return transformation.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(transformation.init, update_fn)


def check_params(params: Any, reference: Any, owner: str) -> None:
  """Raises a one-paragraph ``ValueError`` unless ``params`` have the structure and leaf shapes
  of ``reference``, a state tree built like the params at ``init``; where ``reference`` holds
  ``None`` (``optax.trace`` keeps no trace of a frozen parameter) any leaf is fine."""
  try:
    jax.tree.map(lambda r, p: None if r is None else chex.assert_shape(p, jnp.shape(r)),
                 reference, params, is_leaf=is_none)
  except (AssertionError, ValueError, TypeError) as error:
    raise ValueError(f'{owner}: params must have the structure and leaf shapes of the params '
                     'given to init. '
                     f'{str(error).splitlines()[0] if str(error) else ""}') from error


def state_field(name: str) -> Callable[[Any], Any]:
  """The one field ``name`` of an optimizer state (e.g. a trace, Adam's ``mu``), for
  :func:`checking_gradients`."""
  return lambda state: optax.tree_utils.tree_get(state, name)


def check_same_structure(tree: Any, reference: Any, what: str, reference_what: str,
                         owner: str) -> None:
  """Raises a one-paragraph ``ValueError`` unless two trees have the same structure and shapes."""
  try:
    chex.assert_trees_all_equal_shapes(tree, reference)
  except (AssertionError, ValueError) as error:
    raise ValueError(f'{owner}: {what} must have the structure and leaf shapes of '
                     f'{reference_what}. {str(error).splitlines()[0] if str(error) else ""}') \
        from error


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


def states_of_type(opt_state: Any, state_type: type | tuple[type, ...]) -> list[Any]:
  """Every ``state_type`` instance anywhere in a nested optimizer state, in tree order."""
  found = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, state_type))
  return [x for x in found if isinstance(x, state_type)]


def find_states(opt_state: Any, params: Any, state_type: type, helper: str, provider: str,
                call: str) -> list[Any]:
  """The ``state_type`` states in ``opt_state``, for a helper called as ``call``.

  Raises:
    ValueError: if there are none: the arguments are swapped, or the optimizer lacks
      ``provider``.
  """
  states = states_of_type(opt_state, state_type)
  if states:
    return states
  if states_of_type(params, state_type):
    raise ValueError(f'{helper}: the arguments are swapped; call {call}, in the order of '
                     'optax.contrib.schedule_free_eval_params(state, params).')
  raise ValueError(f'{helper}: the optimizer state holds no {provider} state. It must come from '
                   f'an optimizer that contains {provider}, alone or inside chain, '
                   'inject_hyperparams, MultiSteps, masked or multi_transform.')


def merge_per_leaf(params: Any, covers: list[Any], leaf_fn: Callable[[Any, int, Any], Any],
                   helper: str, provider: str) -> Any:
  """Maps each leaf of ``params`` through the one of several state trees that covers it.

  Args:
    params: the weights, a tree.
    covers: trees with the structure of ``params`` (one per state found), holding
      ``optax.MaskedNode`` where their transformation did not see the leaf (``optax.masked``,
      ``optax.multi_transform``).
    leaf_fn: ``(param_leaf, index_into_covers, cover_leaf) -> new leaf``.
    helper: the public function asking, for the messages.
    provider: the transformation whose states these are, for the messages.

  Returns:
    A tree like ``params``: leaves no state covers are returned unchanged.

  Raises:
    ValueError: if a tree does not fit ``params``, or two states cover the same leaf.
  """
  def mismatch(error):
    return ValueError(f'{helper}: params do not have the structure and shapes of the weights '
                      f'{provider} was initialised with ({str(error).splitlines()[0]}). Pass '
                      'the params the optimizer updates, as a whole tree.')

  for cover in covers:
    try:
      jax.tree.map(lambda p, c: None, params, cover)
    except ValueError as error:
      raise mismatch(error) from error

  def merge(p, *leaves):
    found = [(i, c) for i, c in enumerate(leaves) if not isinstance(c, optax.MaskedNode)]
    if not found:
      return p
    try:
      chex.assert_equal_shape([p] + [c for _, c in found])
    except AssertionError as error:
      raise mismatch(error) from error
    if len(found) > 1:
      raise ValueError(f'{helper}: {len(found)} {provider} states cover the same parameter, so '
                       'it is not clear which to use. Give each parameter one (e.g. one per '
                       f'label of optax.multi_transform), or give {helper} the sub-state that '
                       'holds the one you mean.')
    return leaf_fn(p, *found[0])

  return jax.tree.map(merge, params, *covers)
