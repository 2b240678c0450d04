"""What the engine asks of a method: per stage, the update and the weights each pass sees.

Every training method of docs/design.md §3 is three choices per stage, each a function of the
stage's delay ``D_s``. The engine never branches on a method's name; it asks the :class:`Method`
for

* ``optimizer(delay)``: the stage's optax transformation;
* ``forward_weights(params, opt_state, delay)``: the weights the forward pass uses;
* ``backward_weights(params, opt_state, delay)``: the weights the backward's recompute uses;
* ``stash_forward_weights``: keep the forward's weights beside the stashed input and use them in
  the backward (PipeDream's weight stashing; overrides ``backward_weights``);
* ``pass_gradient_weights``: give the update the weights the gradient was computed on, as the
  extra argument ``gradient_params`` (DC-ASGD's delay compensation needs them);
* ``micro_batches_per_flush``: an int M means synchronous (GPipe / 1F1B-flush) training: the
  stream is fed M micro-batches a step, then the pipeline is flushed by 2(S-1) empty ticks, and
  each stage accumulates M gradients before one step. None: asynchronous, never flushed.
* ``micro_batches_per_update``: the micro-batches whose mean gradient one update applies (the
  optimizer accumulates them, ``optax.MultiSteps``): the synchronous M, or an asynchronous
  method's accumulation, where the pipeline stays full.

:func:`pb`, :func:`pipedream` and :func:`sync` build a method around any optax transformation;
the presets by name are one module each in this package (:func:`pipejax.methods.make_method`).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable
import warnings

import optax

PyTree = Any
WeightView = Callable[[PyTree, PyTree, int], PyTree]


class MethodError(ValueError):
  """An unknown method or bad method hyperparameters; the message says how to fix it."""


def current_weights(params, opt_state, delay):
  """The stage's weights as they are now (the default view)."""
  del opt_state, delay
  return params


@dataclasses.dataclass(frozen=True)
class Method:
  """A pipelined training method (see the module docstring)."""

  name: str
  optimizer: Callable[[int], optax.GradientTransformation]
  forward_weights: WeightView = current_weights
  backward_weights: WeightView = current_weights
  stash_forward_weights: bool = False
  micro_batches_per_flush: int | None = None  # None: asynchronous, never drains.
  micro_batches_per_update: int = 1
  pass_gradient_weights: bool = False

  @property
  def micro_batches_per_step(self) -> int | None:
    """The old name of :attr:`micro_batches_per_flush` (a DeprecationWarning)."""
    warnings.warn("Method.micro_batches_per_step is renamed micro_batches_per_flush (the "
                  "micro-batches between two flushes; micro_batches_per_update counts those of "
                  "one update).", DeprecationWarning, stacklevel=2)
    return self.micro_batches_per_flush


def per_stage(optimizer) -> Callable[[int], optax.GradientTransformation]:
  """Accepts either one optax transformation for every stage or a ``delay -> tx`` factory."""
  if isinstance(optimizer, optax.GradientTransformation):
    return lambda delay: optimizer
  if callable(optimizer):
    return optimizer
  raise MethodError(f"optimizer must be an optax GradientTransformation or a function from a "
                    f"stage's delay to one; got {type(optimizer).__name__}.")


def pb(optimizer) -> Method:
  """Plain Pipelined Backpropagation: forward with w_t, backward with the current w_{t+D}."""
  return Method("pb", per_stage(optimizer))


def pipedream(optimizer) -> Method:
  """PipeDream weight stashing: the backward uses the very weights the forward used.

  Each stage keeps a ring buffer of ``D_s + 1`` weight copies beside its stashed inputs.
  """
  return Method("pipedream", per_stage(optimizer), stash_forward_weights=True)


def check_micro_batches(micro_batches) -> int:
  """``micro_batches`` as an int >= 1 (the M of GPipe), or a :class:`MethodError`."""
  if isinstance(micro_batches, bool) or not isinstance(micro_batches, numbers.Integral) or \
      micro_batches < 1:
    raise MethodError(f"micro_batches must be an int >= 1 (the micro-batches whose mean gradient "
                      f"one update applies: GPipe's M); got {micro_batches!r}.")
  return int(micro_batches)  # a NumPy integer too


def sync(optimizer, micro_batches: int) -> Method:
  """Synchronous pipeline (GPipe / 1F1B-flush): M micro-batches, then one step; fill and drain.

  Numerically this is mini-batch training at batch ``M * b``: ``optax.MultiSteps`` averages the M
  micro-batch gradients, and no stage's weights change while a step is in flight because the
  2(S-1) empty ticks between steps let every backward finish first.
  """
  micro_batches = check_micro_batches(micro_batches)
  return Method("sync", accumulating(optimizer, micro_batches),
                micro_batches_per_flush=micro_batches, micro_batches_per_update=micro_batches)


def accumulating(optimizer, micro_batches: int) -> Callable[[int], optax.GradientTransformation]:
  """``optimizer`` (a transformation or a ``delay -> tx`` factory) applying one update per
  ``micro_batches`` gradients, their mean (``optax.MultiSteps``); unchanged at 1."""
  stage_optimizer = per_stage(optimizer)
  if micro_batches == 1:
    return stage_optimizer
  return lambda delay: optax.MultiSteps(
      stage_optimizer(delay), every_k_schedule=micro_batches).gradient_transformation()
