"""Methods as data: per stage, the weights the forward sees, the weights the backward sees, the update.

Every training method of docs/design.md §3 is three choices per stage, each a function of the
stage's delay ``D_s``. The engine never branches on a method's name; it asks the method for

* ``optimizer(delay)``: the stage's optax transformation;
* ``forward_weights(params, opt_state, delay)``: the weights the forward pass uses;
* ``backward_weights(params, opt_state, delay)``: the weights the backward's recompute uses;
* ``stash_forward_weights``: keep the forward's weights beside the stashed input and use them in
  the backward (PipeDream's weight stashing; overrides ``backward_weights``);
* ``micro_batches_per_step``: an int M means synchronous (GPipe / 1F1B-flush) training: the stream is
  fed in groups of M micro-batches separated by 2(S-1) empty ticks and each stage accumulates M
  gradients before one step.

Adding a method is a few lines: a new :class:`Method` built from optax transformations and, where
needed, a weight view.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import optax

from pipejax import optim

PyTree = Any
WeightView = Callable[[PyTree, PyTree, int], PyTree]


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
  micro_batches_per_step: int | None = None  # None: asynchronous, never drains.


class MethodError(ValueError):
  """An unknown method or bad method hyperparameters; the message says how to fix it."""


def _per_stage(optimizer) -> Callable[[int], optax.GradientTransformation]:
  """Accepts either one optax transformation for every stage or a ``delay -> tx`` factory."""
  if isinstance(optimizer, optax.GradientTransformation):
    return lambda delay: optimizer
  if callable(optimizer):
    return optimizer
  raise MethodError(f"optimizer must be an optax GradientTransformation or a function from a "
                    f"stage's delay to one; got {type(optimizer).__name__}.")


def pb(optimizer) -> Method:
  """Plain Pipelined Backpropagation: forward with w_t, backward with the current w_{t+D}."""
  return Method("pb", _per_stage(optimizer))


def pipedream(optimizer) -> Method:
  """PipeDream weight stashing: the backward uses the very weights the forward used.

  Each stage keeps a ring buffer of ``D_s + 1`` weight copies beside its stashed inputs.
  """
  return Method("pipedream", _per_stage(optimizer), stash_forward_weights=True)


def sync(optimizer, micro_batches: int) -> Method:
  """Synchronous pipeline (GPipe / 1F1B-flush): M micro-batches, then one step; fill and drain.

  Numerically this is mini-batch training at batch ``M * b``: ``optax.MultiSteps`` averages the M
  micro-batch gradients, and no stage's weights change while a group is in flight because the
  2(S-1) empty ticks between groups let every backward finish first.
  """
  if not isinstance(micro_batches, int) or micro_batches < 1:
    raise MethodError(f"sync needs micro_batches >= 1 (the M of GPipe); got {micro_batches!r}.")
  per_stage = _per_stage(optimizer)

  def accumulate(delay):
    if micro_batches == 1:
      return per_stage(delay)
    return optax.MultiSteps(per_stage(delay), every_k_schedule=micro_batches).gradient_transformation()

  return Method("sync", accumulate, micro_batches_per_step=micro_batches)


# ----------------------------------------------------------------------------- presets by name


def _predicted(params, opt_state, delay):
  del delay  # the horizon lives in the transformation's state
  return optim.predicted_params(params, opt_state)


def _pipemare_past(params, opt_state, delay):
  return optim.pipemare_backward_params(params, opt_state, delay)


def make_method(name: str, *, learning_rate, momentum: float = 0.9, weight_decay: float = 0.0,
                micro_batches: int = 1, horizon: int | None = None,
                anneal_steps: int = 1000, gamma: float = optim.DEFAULT_GAMMA) -> Method:
  """The methods of docs/design.md §3 by name, with heavy-ball momentum SGD as the base optimizer.

  Args:
    name: one of :data:`METHODS`.
    learning_rate: float or optax schedule (in optimizer steps).
    momentum: heavy-ball momentum ``m`` in ``[0, 1)``.
    weight_decay: coupled L2 weight decay, added to the gradient.
    micro_batches: M of the synchronous mode (``sync``); ignored otherwise.
    horizon: Linear Weight Prediction horizon T; None predicts each stage's own delay D_s.
    anneal_steps: PipeMare's learning-rate annealing length K, in steps.
    gamma: PipeMare's discrepancy-correction EMA decay.
  """
  if name not in METHODS:
    raise MethodError(f"Unknown method '{name}'. Known methods: {', '.join(METHODS)}.")
  if not 0 <= momentum < 1:
    raise MethodError(f"momentum must be in [0, 1); got {momentum}.")
  if horizon is not None and horizon < 0:
    raise MethodError(f"The prediction horizon must be >= 0 (or None for the stage's delay); "
                      f"got {horizon}.")

  def decayed(tx):
    return optax.chain(optax.add_decayed_weights(weight_decay), tx) if weight_decay else tx

  def momentum_sgd(delay):
    del delay
    return decayed(optax.sgd(learning_rate, momentum=momentum))

  def spike_compensated(delay):
    return optim.sgd_sc(learning_rate, delay, momentum, weight_decay=weight_decay)

  def predicting(base, form="update"):
    def factory(delay):
      return optim.linear_weight_prediction(
          base(delay), delay if horizon is None else horizon, form=form,
          learning_rate=learning_rate if form == "velocity" else None)
    return factory

  if name == "sgd":
    return dataclasses.replace(sync(momentum_sgd, micro_batches=1), name="sgd")
  if name == "sync":
    return sync(momentum_sgd, micro_batches=micro_batches)
  if name == "pb":
    return Method("pb", momentum_sgd)
  if name == "pb_sc":
    return Method("pb_sc", spike_compensated)
  if name == "pb_lwp":
    return Method("pb_lwp", predicting(momentum_sgd), forward_weights=_predicted)
  if name == "pb_sc_lwp":
    return Method("pb_sc_lwp", predicting(spike_compensated), forward_weights=_predicted)
  if name == "pipedream":
    return Method("pipedream", momentum_sgd, stash_forward_weights=True)
  if name == "spectrain":
    return Method("spectrain", predicting(momentum_sgd, form="velocity"),
                  forward_weights=_predicted)
  # pipemare
  return Method("pipemare",
                lambda delay: decayed(optim.pipemare(learning_rate, delay, momentum,
                                                     anneal_steps, gamma)),
                backward_weights=_pipemare_past)


METHODS = ("sgd", "sync", "pb", "pb_sc", "pb_lwp", "pb_sc_lwp", "pipedream", "spectrain",
           "pipemare")
