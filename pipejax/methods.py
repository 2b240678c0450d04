"""Methods as data: per stage, the weights the forward sees, the weights the backward sees, the update.

Every training method of docs/design.md §3 is three choices per stage, each a function of the
stage's delay ``D_s``. The engine never branches on a method's name; it asks the method for

* ``optimizer(delay)``: the stage's optax transformation;
* ``forward_weights(params, opt_state, delay)``: the weights the forward pass uses;
* ``backward_weights(params, opt_state, delay)``: the weights the backward's recompute uses;
* ``stash_forward_weights``: keep the forward's weights beside the stashed input and use them in
  the backward (PipeDream's weight stashing; overrides ``backward_weights``);
* ``pass_gradient_weights``: give the update the weights the gradient was computed on, as the
  extra argument ``gradient_params`` (DC-ASGD's delay compensation needs them);
* ``micro_batches_per_step``: an int M means synchronous (GPipe / 1F1B-flush) training: the stream is
  fed M micro-batches a step, separated by 2(S-1) empty ticks and each stage accumulates M
  gradients before one step.

Adding a method is a few lines: a new :class:`Method` built from optax transformations and, where
needed, a weight view. What the trainer must know of a preset before building it (its batch per
step, whether it trains unpipelined) is its :class:`Traits` (:func:`traits_of`): no caller
compares a method's name.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable

import optax

from pipejax import optim
from pipejax.optim import adam_family

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
  pass_gradient_weights: bool = False


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
  micro-batch gradients, and no stage's weights change while a step is in flight because the
  2(S-1) empty ticks between steps let every backward finish first.
  """
  if isinstance(micro_batches, bool) or not isinstance(micro_batches, numbers.Integral) or \
      micro_batches < 1:
    raise MethodError(f"sync needs micro_batches >= 1 (the M of GPipe); got {micro_batches!r}.")
  micro_batches = int(micro_batches)  # a NumPy integer too
  per_stage = _per_stage(optimizer)

  def accumulate(delay):
    if micro_batches == 1:
      return per_stage(delay)
    return optax.MultiSteps(per_stage(delay), every_k_schedule=micro_batches).gradient_transformation()

  return Method("sync", accumulate, micro_batches_per_step=micro_batches)


# ----------------------------------------------------------------------------- presets by name


def _predicted(params, opt_state, delay):
  del delay  # the horizon lives in the transformation's state
  return optim.predicted_params(opt_state, params)


def _pipemare_past(params, opt_state, delay):
  return optim.pipemare_backward_params(opt_state, params, delay)


BASE_OPTIMIZERS = ("sgd", "adam")
MUON_CONSISTENT_RMS = 0.2  # Liu et al. 2025 (Moonlight): Muon's update RMS matched to AdamW's


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
  """What a preset is built from (see :func:`make_method` for each field)."""

  learning_rate: Any
  momentum: float = 0.9
  weight_decay: float = 0.0
  micro_batches: int = 1
  horizon: int | None = None
  anneal_steps: int = 1000
  gamma: float = optim.DEFAULT_GAMMA
  optimizer: str = "sgd"
  b2: float = 0.999
  eps: float = 1e-8
  dc_strength: float = 0.04
  num_stages: int | None = None
  decay_mask: bool = False

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
    if self.optimizer == "adam" and self.decay_mask:
      return optax.chain(optim.scale_by_adam_sc(delay, self.momentum, self.b2, self.eps),
                         optax.add_decayed_weights(self.weight_decay, self.mask),
                         optax.scale_by_learning_rate(self.learning_rate))
    if self.optimizer == "adam":
      return optim.adam_sc(self.learning_rate, delay, self.momentum, self.b2, self.eps,
                           self.weight_decay)
    return optim.sgd_sc(self.learning_rate, delay, self.momentum, weight_decay=self.weight_decay)

  def predicting(self, inner: Callable[[Hyperparameters, int], optax.GradientTransformation],
                 form: str = "update") -> Callable[[int], optax.GradientTransformation]:
    """``inner`` (e.g. ``Hyperparameters.base``) under Linear Weight Prediction, per delay."""
    def factory(delay):
      horizon = delay if self.horizon is None else self.horizon
      if form == "update":
        return optim.linear_weight_prediction(inner(self, delay), horizon, outermost=True)
      # The velocity forms build inner from the learning rate they predict with: one rate.
      return optim.linear_weight_prediction(
          lambda rate: inner(dataclasses.replace(self, learning_rate=rate), delay), horizon,
          form=form, learning_rate=self.learning_rate,
          momentum=self.momentum if form == "next_velocity" else None,
          outermost=True)  # the stage's whole update: the prediction is read, not recomputed
    return factory


@dataclasses.dataclass(frozen=True)
class Traits:
  """What a caller may ask of a preset from its name alone, before its transformations exist.

  A trainer needs some answers (the batch of one step, the model's split) before it has the
  learning-rate schedule that :func:`make_method` builds the optax transformations from.
  """

  # One step per ``micro_batches`` micro-batches (make_method's M): the synchronous pipeline.
  accumulates_micro_batches: bool = False
  # The reference without a pipeline: the whole network trains as one stage.
  one_stage: bool = False
  # No stage ever computes on stale weights, so there is no delay to compensate.
  delay_free: bool = False
  # Plain Pipelined Backpropagation, no mitigation of the delay: the other methods' yardstick.
  plain_pipeline: bool = False
  # The method to suggest when a delayed method diverges (spike compensation + prediction).
  recommended: bool = False

  def micro_batches_per_step(self, micro_batches: int) -> int:
    """The micro-batches one optimizer step sees, given the config's ``micro_batches``."""
    return micro_batches if self.accumulates_micro_batches else 1


_PRESETS: dict[str, Callable[[Hyperparameters], Method]] = {}
_OPTIMIZERS: dict[str, tuple[str, ...]] = {}
_TRAITS: dict[str, Traits] = {}


def _preset(name: str, optimizers: tuple[str, ...] = BASE_OPTIMIZERS, **traits):
  """Registers a preset; ``optimizers`` are the base optimizers it is defined for, ``traits``
  the :class:`Traits` fields that hold for it."""
  def register(build: Callable[[Hyperparameters], Method]):
    def checked(h: Hyperparameters) -> Method:
      if h.optimizer not in optimizers:
        raise MethodError(f"Method '{name}' is defined for the base optimizer(s) "
                          f"{', '.join(optimizers)}, not '{h.optimizer}'. Use "
                          f"optimizer='{optimizers[0]}' or another method.")
      return build(h)
    _PRESETS[name] = checked
    _OPTIMIZERS[name] = optimizers
    _TRAITS[name] = Traits(**traits)
    return build
  return register


@_preset("sgd", one_stage=True, delay_free=True)
def _sgd(h):
  return dataclasses.replace(sync(h.base, micro_batches=1), name="sgd")


@_preset("sync", accumulates_micro_batches=True, delay_free=True)
def _sync(h):
  return sync(h.base, micro_batches=h.micro_batches)


@_preset("pb", plain_pipeline=True)
def _pb(h):
  return Method("pb", h.base)


@_preset("pb_sc")
def _pb_sc(h):
  return Method("pb_sc", h.spike_compensated)


@_preset("pb_lwp")
def _pb_lwp(h):
  return Method("pb_lwp", h.predicting(Hyperparameters.base), forward_weights=_predicted)


@_preset("pb_sc_lwp", recommended=True)
def _pb_sc_lwp(h):
  return Method("pb_sc_lwp", h.predicting(Hyperparameters.spike_compensated),
                forward_weights=_predicted)


@_preset("pipedream")
def _pipedream(h):
  return Method("pipedream", h.base, stash_forward_weights=True)


@_preset("spectrain", optimizers=("sgd",))
def _spectrain(h):
  # The reference code predicts with the next velocity m v + g (see linear_weight_prediction).
  return Method("spectrain", h.predicting(Hyperparameters.base, form="next_velocity"),
                forward_weights=_predicted)


@_preset("pipemare", optimizers=("sgd",))
def _pipemare(h):
  def update(delay):
    tx = optim.pipemare(h.learning_rate, delay, h.momentum, h.anneal_steps, h.gamma)
    return optax.chain(optax.add_decayed_weights(h.weight_decay), tx) if h.weight_decay else tx
  return Method("pipemare", update, backward_weights=_pipemare_past)


@_preset("dcasgd")
def _dcasgd(h):
  # The gradient is computed on the forward's (stashed) weights, as an asynchronous worker's is,
  # then moved to the current weights by the delay compensation.
  return Method("dcasgd", lambda delay: optax.chain(optim.delay_compensation(h.dc_strength),
                                                    h.base(delay)),
                stash_forward_weights=True, pass_gradient_weights=True)


@_preset("pipeoptim", optimizers=("adam",))
def _pipeoptim(h):
  # PB + PipeOptim's weight prediction: the forward runs on w - lr s m_hat / (sqrt(v_hat) + eps).
  def update(delay):
    return adam_family.adam_weight_prediction(
        h.learning_rate, delay if h.horizon is None else h.horizon, b1=h.momentum, b2=h.b2,
        eps=h.eps, weight_decay=h.weight_decay, mask=h.mask)

  def forward_weights(params, opt_state, delay):
    del delay  # the horizon is in the state's step size
    return adam_family.adam_predicted_params(params, opt_state, h.momentum, h.b2, h.eps)

  return Method("pipeoptim", update, forward_weights=forward_weights)


@_preset("nesterov_asyncpp", optimizers=("adam",))
def _nesterov_asyncpp(h):
  if h.num_stages is None:
    raise MethodError("Method 'nesterov_asyncpp' sets each stage's momentum from its delay and "
                      "the pipeline's largest delay: pass make_method(..., num_stages=S).")
  max_delay = 2 * (h.num_stages - 1)  # docs/design.md §2: D_s = 2(S - 1 - s)
  return Method("nesterov_asyncpp", lambda delay: adam_family.nesterov_asyncpp(
      h.learning_rate, delay, max_delay, h.anneal_steps, b1=h.momentum, b2=h.b2, eps=h.eps,
      weight_decay=h.weight_decay, mask=h.mask), stash_forward_weights=True)


@_preset("pb_muon", optimizers=("adam",))
def _pb_muon(h):
  # Muon on every matrix (optax.contrib.muon's default split); the other leaves take its NAdamW.
  # consistent_rms=0.2 gives a Muon step an Adam step's RMS: one learning rate serves both.
  return Method("pb_muon", lambda delay: optax.contrib.muon(
      h.learning_rate, beta=h.momentum, eps=h.eps, weight_decay=h.weight_decay,
      adam_b1=h.momentum, adam_b2=h.b2, adam_weight_decay=0.0 if h.decay_mask else h.weight_decay,
      consistent_rms=MUON_CONSISTENT_RMS))


METHODS = tuple(_PRESETS)
RECOMMENDED = next(name for name, traits in _TRAITS.items() if traits.recommended)

# How reports and figures name the presets.
DISPLAY_NAMES = {"sgd": "SGD", "sync": "GPipe (sync)", "pb": "PB", "pb_sc": "PB + SC",
                 "pb_lwp": "PB + LWP", "pb_sc_lwp": "PB + SC + LWP", "pipedream": "PipeDream",
                 "spectrain": "SpecTrain", "pipemare": "PipeMare", "dcasgd": "DC-ASGD",
                 "pipeoptim": "PipeOptim", "nesterov_asyncpp": "Nesterov AsyncPP",
                 "pb_muon": "PB + Muon"}


def sgd_with_pipemare_rates(layer_delays: dict[str, int], *, learning_rate, momentum: float = 0.9,
                            weight_decay: float = 0.0, anneal_steps: int = 1000) -> Method:
  """SGD without a pipeline in which each layer follows PipeMare's rate for its pipeline stage.

  The control that separates PipeMare's learning-rate rescheduling from its pipeline: the network
  trains as one stage, without delay, but layer ``l`` takes
  ``optim.pipemare_learning_rate(learning_rate, D, anneal_steps)`` where ``D`` is the delay of the
  stage that holds it in the pipelined run (``layer_delays[l]``). If PipeMare's lead over SGD
  comes from the rescheduling alone, this run shares it.

  Args:
    layer_delays: ``{layer name: delay of its stage}`` for every top-level parameter key of the
      one-stage model (``pipejax.models.sequential`` keys parameters by layer name).
    learning_rate, momentum, weight_decay, anneal_steps: as for :func:`make_method`.
  """
  if not layer_delays or any(not isinstance(d, int) or d < 0 for d in layer_delays.values()):
    raise MethodError(f"layer_delays must map each layer name to its stage's delay (an int "
                      f">= 0); got {layer_delays!r}.")

  def rate_for(delay):
    tx = optax.sgd(optim.pipemare_learning_rate(learning_rate, delay, anneal_steps),
                   momentum=momentum)
    return optax.chain(optax.add_decayed_weights(weight_decay), tx) if weight_decay else tx

  def label(params):
    missing = sorted(set(params) - set(layer_delays))
    if missing:
      raise MethodError(f"sgd_with_pipemare_rates has no delay for the layers {missing}.")
    return {name: str(layer_delays[name]) for name in params}

  tx = optax.multi_transform({str(d): rate_for(d) for d in set(layer_delays.values())}, label)
  return dataclasses.replace(sync(lambda delay: tx, micro_batches=1), name="sgd")


# The per-layer rate rules the one-stage baseline can take (config.sgd_stage_rates), by the
# method whose rates they copy.
STAGE_RATES = {"pipemare": sgd_with_pipemare_rates}


def traits_of(name: str) -> Traits:
  """What preset ``name`` is, from its name alone (see :class:`Traits`)."""
  if name not in _TRAITS:
    raise MethodError(f"Unknown method '{name}'. Known methods: {', '.join(METHODS)}.")
  return _TRAITS[name]


def optimizers_of(name: str) -> tuple[str, ...]:
  """The base optimizers preset ``name`` is defined for (e.g. ``('sgd', 'adam')``)."""
  if name not in _OPTIMIZERS:
    raise MethodError(f"Unknown method '{name}'. Known methods: {', '.join(METHODS)}.")
  return _OPTIMIZERS[name]


def make_method(name: str, *, learning_rate, momentum: float = 0.9, weight_decay: float = 0.0,
                micro_batches: int = 1, horizon: int | None = None,
                anneal_steps: int = 1000, gamma: float = optim.DEFAULT_GAMMA,
                optimizer: str = "sgd", b2: float = 0.999, eps: float = 1e-8,
                dc_strength: float = 0.04, num_stages: int | None = None,
                decay_mask: bool = False) -> Method:
  """The methods of docs/design.md §3 by name.

  Args:
    name: one of :data:`METHODS`.
    learning_rate: float or optax schedule (in optimizer steps).
    momentum: heavy-ball momentum ``m`` in ``[0, 1)`` (Adam: its first-moment decay b1).
    weight_decay: coupled L2 weight decay added to the gradient (Adam: decoupled, as AdamW).
    micro_batches: M of the synchronous mode (``sync``); ignored otherwise.
    horizon: Linear Weight Prediction horizon T; None predicts each stage's own delay D_s.
    anneal_steps: PipeMare's learning-rate annealing length K, in steps.
    gamma: PipeMare's discrepancy-correction EMA decay.
    optimizer: the base update, 'sgd' (heavy-ball momentum) or 'adam'. SpecTrain and PipeMare
      are defined for momentum SGD only.
    b2: Adam's second-moment decay.
    eps: Adam's epsilon.
    dc_strength: DC-ASGD's lambda.
    num_stages: the pipeline's number of stages S; Nesterov AsyncPP needs it (its momentum rule
      divides by the largest delay + 1), the other methods ignore it.
    decay_mask: AdamW's weight decay only on matrices and embedding tables, not on biases and
      norm scales (:func:`pipejax.optim.adam_family.decay_mask`); for optimizer='adam'.
  """
  if name not in _PRESETS:
    raise MethodError(f"Unknown method '{name}'. Known methods: {', '.join(METHODS)}.")
  if optimizer not in BASE_OPTIMIZERS:
    raise MethodError(f"Unknown base optimizer '{optimizer}'. Known: "
                      f"{', '.join(BASE_OPTIMIZERS)}.")
  if not 0 <= momentum < 1:
    raise MethodError(f"momentum must be in [0, 1); got {momentum}.")
  if decay_mask and optimizer != "adam":
    raise MethodError("decay_mask=True masks AdamW's decoupled weight decay; it needs "
                      "optimizer='adam' (momentum SGD's decay is coupled to the gradient).")
  if num_stages is not None and (isinstance(num_stages, bool) or
                                 not isinstance(num_stages, numbers.Integral) or num_stages < 1):
    raise MethodError(f"num_stages must be a positive int (the pipeline's S); got "
                      f"{num_stages!r}.")
  if horizon is not None and horizon < 0:
    raise MethodError(f"The prediction horizon must be >= 0 (or None for the stage's delay); "
                      f"got {horizon}.")
  given = {"learning_rate": learning_rate, "weight_decay": weight_decay, "b2": b2, "eps": eps,
           "gamma": gamma, "anneal_steps": anneal_steps, "dc_strength": dc_strength}
  for key, value in given.items():
    if key == "learning_rate" and callable(value):
      continue  # an optax schedule
    if value is None or isinstance(value, (str, bytes)):
      raise MethodError(f"make_method: {key} must be a number; got {value!r} "
                        f"({type(value).__name__}).")
    if not isinstance(value, numbers.Real):
      continue  # a jax array: checked, if concrete, by the transformation that takes it
    # Here rather than in the transformation that uses it, which would only complain (or train
    # on NaN, or ascend) once the pipeline is built and run.
    below_one = key in ("b2", "gamma")
    if not (0 <= value < 1 if below_one else 0 <= value < math.inf):
      raise MethodError(f"make_method: {key} must be in {'[0, 1)' if below_one else '[0, inf)'}; "
                        f"got {value!r}.")
  return _PRESETS[name](Hyperparameters(
      learning_rate=learning_rate, momentum=momentum, weight_decay=weight_decay,
      micro_batches=micro_batches, horizon=horizon, anneal_steps=anneal_steps, gamma=gamma,
      optimizer=optimizer, b2=b2, eps=eps, dc_strength=dc_strength, num_stages=num_stages,
      decay_mask=bool(decay_mask)))
