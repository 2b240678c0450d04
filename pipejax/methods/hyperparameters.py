"""The hyperparameters every preset shares, and the base updates built from them.

A preset whose method takes more (a prediction horizon, an annealing length) subclasses
:class:`Hyperparameters` in its own module. Every field is checked when the dataclass is made, so
a bad value is refused before a pipeline is built, never trained on.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
import optax

from pipejax import optim
from pipejax.methods import method as method_lib
from pipejax.methods.method import MethodError
from pipejax.methods.preset import BASE_OPTIMIZERS
from pipejax.optim import _checks as optim_checks
from pipejax.optim import adam_family


def check_number(name: str, value, low: float = 0.0, high: float = math.inf, *,
                 high_open: bool = True, owner: str = "make_method") -> None:
  """Refuses a ``value`` that is not a finite real number in ``[low, high)`` (``[low, high]``).

  The one check of every preset's numbers, whatever form they arrive in: a Python or NumPy
  number, or a 0-d array as ``optax.inject_hyperparams`` hands it over (concrete when ``init``
  runs eagerly), is checked as its number. Only a traced value (the preset built inside ``jit``,
  as ``inject_hyperparams`` builds it at every ``update``) cannot be compared and is let through,
  as the transformations of :mod:`pipejax.optim` let it through. A function is refused: optax's
  own transforms take a schedule for the learning rate alone.
  """
  if value is None or isinstance(value, (str, bytes, bool, np.bool_)):
    raise MethodError(f"{owner}: {name} must be a number; got {value!r} "
                      f"({type(value).__name__}).")
  if callable(value):
    raise MethodError(f"{owner}: {name} must be a number; got the function {value!r}. Only "
                      f"learning_rate may be a schedule; for a {name} that changes in training, "
                      "build the optimizer inside optax.inject_hyperparams, which passes the "
                      "schedule's value.")
  try:
    number = optim_checks.scalar(value, name, owner)
  except ValueError as error:  # a list, a mapping, an array of many values: said in one line
    raise MethodError(" ".join(str(error).split())) from None
  if number is None:  # traced: see the docstring
    return
  inside = low <= number < high if high_open else low <= number <= high
  if not inside or not math.isfinite(number):
    interval = f"[{low:g}, {high:g}{')' if high_open or math.isinf(high) else ']'}"
    raise MethodError(f"{owner}: {name} must be in {interval}; got {number!r}.{_rounded(value)}")


def _rounded(value) -> str:
  """Why an array's number may not be the one given: inject_hyperparams stores hyperparameters
  in the params' dtype unless told otherwise, and bfloat16 holds 0.999 as 1.0."""
  dtype = getattr(value, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).bits >= 32:
    return ""
  return (f" It is a {dtype} array, so it may have been rounded; under "
          "optax.inject_hyperparams pass hyperparam_dtype=jnp.float32.")


def check_steps(name: str, value, owner: str = "make_method") -> None:
  """Refuses a number of steps (an annealing length) that is not a whole number ``>= 0``.

  2.0 counts as 2; an array must be of an integer dtype, as :mod:`pipejax.optim` takes a delay.
  """
  check_number(name, value, owner=owner)
  try:
    optim_checks.check_count(value, name, owner)
  except ValueError as error:
    raise MethodError(str(error)) from None


def check_positive_int(name: str, value, why: str) -> None:
  """Refuses anything but an int >= 1 (a bool too), saying ``why`` the method needs it."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise MethodError(f"make_method: {name} must be a positive int ({why}); got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
  """What every preset is built from.

  Attributes:
    learning_rate: float or optax schedule (in optimizer steps).
    momentum: heavy-ball momentum ``m`` in ``[0, 1)`` (Adam: its first-moment decay b1).
    weight_decay: coupled L2 weight decay added to the gradient (Adam: decoupled, as AdamW).
    optimizer: the base update, 'sgd' (heavy-ball momentum) or 'adam'.
    b2: Adam's second-moment decay.
    eps: Adam's epsilon.
    decay_mask: AdamW's weight decay only on matrices and embedding tables, not on biases and
      norm scales (:func:`pipejax.optim.adam_family.decay_mask`); for optimizer='adam'.
  """

  learning_rate: Any
  momentum: float = 0.9
  weight_decay: float = 0.0
  optimizer: str = "sgd"
  b2: float = 0.999
  eps: float = 1e-8
  decay_mask: bool = False

  def __post_init__(self):
    self.check()

  def check(self) -> None:
    """Refuses a value out of range; a subclass adds its own fields' checks after these."""
    if self.optimizer not in BASE_OPTIMIZERS:
      raise MethodError(f"Unknown base optimizer '{self.optimizer}'. Known: "
                        f"{', '.join(BASE_OPTIMIZERS)}.")
    if not callable(self.learning_rate):
      check_number("learning_rate", self.learning_rate)
    check_number("momentum", self.momentum, 0.0, 1.0)
    check_number("weight_decay", self.weight_decay)
    check_number("b2", self.b2, 0.0, 1.0)
    check_number("eps", self.eps)
    if self.decay_mask and self.optimizer != "adam":
      raise MethodError("decay_mask=True masks AdamW's decoupled weight decay; it needs "
                        "optimizer='adam' (momentum SGD's decay is coupled to the gradient).")

  @property
  def micro_batches_per_update(self) -> int:
    """The micro-batches whose mean gradient one update applies."""
    return 1

  def unread(self) -> dict[str, str]:
    """``{field: why}`` of the fields this form of the preset never reads: a config that sets
    one is refused, since the run would train exactly as without it."""
    if self.optimizer == "adam":
      return {}
    why = (f"with optimizer {self.optimizer!r} reads no {{}}: only optimizer 'adam' has "
           "{}")
    return {"b2": why.format("b2", "a second moment"), "eps": why.format("eps", "an epsilon")}

  @property
  def mask(self):
    """AdamW's decay mask: :func:`pipejax.optim.adam_family.decay_mask` or None (decay all)."""
    return adam_family.decay_mask if self.decay_mask else None

  def base(self, delay: int) -> optax.GradientTransformation:
    """The plain update: momentum SGD with coupled decay, or AdamW (first moment ``momentum``)."""
    del delay
    if self.optimizer == "adam":
      return optax.adamw(self.learning_rate, b1=self.momentum, b2=self.b2, eps=self.eps,
                         weight_decay=self.weight_decay, mask=self.mask)
    sgd = optax.sgd(self.learning_rate, momentum=self.momentum)
    return optax.chain(optax.add_decayed_weights(self.weight_decay), sgd) if self.weight_decay \
        else sgd

  def spike_compensated(self, delay: int) -> optax.GradientTransformation:
    """The base update under Spike Compensation for ``delay`` (docs/design.md §3)."""
    if self.optimizer == "adam" and self.decay_mask:
      return optax.chain(optim.scale_by_adam_sc(delay, self.momentum, self.b2, self.eps),
                         optax.add_decayed_weights(self.weight_decay, self.mask),
                         optax.scale_by_learning_rate(self.learning_rate))
    if self.optimizer == "adam":
      return optim.adam_sc(self.learning_rate, delay, self.momentum, self.b2, self.eps,
                           self.weight_decay)
    return optim.sgd_sc(self.learning_rate, delay, self.momentum, weight_decay=self.weight_decay)


@dataclasses.dataclass(frozen=True)
class Accumulating(Hyperparameters):
  """Hyperparameters of a method that applies one update per ``micro_batches`` micro-batches.

  Attributes:
    micro_batches: M, the micro-batches whose mean gradient one update applies (GPipe's M).
  """

  micro_batches: int = 1

  def check(self) -> None:
    super().check()
    method_lib.check_micro_batches(self.micro_batches)

  @property
  def micro_batches_per_update(self) -> int:
    return self.micro_batches


@dataclasses.dataclass(frozen=True)
class Predicting(Hyperparameters):
  """Hyperparameters of a method that runs the forward on predicted weights.

  Attributes:
    horizon: the prediction horizon T; None predicts each stage's own delay D_s.
  """

  horizon: int | None = None

  def check(self) -> None:
    super().check()
    if self.horizon is not None:
      if isinstance(self.horizon, bool) or not isinstance(self.horizon, numbers.Integral) or \
          self.horizon < 0:
        raise MethodError(f"The prediction horizon must be an int >= 0 (or None for the stage's "
                          f"delay); got {self.horizon!r}.")

  def horizon_for(self, delay: int) -> int:
    return delay if self.horizon is None else self.horizon

  def predicting(self, inner: Callable[[Hyperparameters, int], optax.GradientTransformation],
                 form: str = "update") -> Callable[[int], optax.GradientTransformation]:
    """``inner`` (e.g. ``Hyperparameters.base``) under Linear Weight Prediction, per delay."""
    def factory(delay):
      horizon = self.horizon_for(delay)
      if form == "update":
        return optim.linear_weight_prediction(inner(self, delay), horizon, outermost=True)
      # The velocity forms build inner from the learning rate they predict with: one rate.
      return optim.linear_weight_prediction(
          lambda rate: inner(dataclasses.replace(self, learning_rate=rate), delay), horizon,
          form=form, learning_rate=self.learning_rate,
          momentum=self.momentum if form == "next_velocity" else None,
          outermost=True)  # the stage's whole update: the prediction is read, not recomputed
    return factory


def predicted_weights(params, opt_state, delay):
  """The forward's weights under Linear Weight Prediction (the horizon is in the state)."""
  del delay
  return optim.predicted_params(opt_state, params)
