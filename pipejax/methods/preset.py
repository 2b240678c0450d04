"""One method's preset: what it is called, what it takes, what it is, and how it is built.

Each preset is one module of this package holding one :class:`Preset`; ``pipejax.methods`` finds
them. A caller learns what a method is from its preset (its :class:`Traits`, its
:class:`QuadraticForm`), never by comparing its name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable
import warnings

from pipejax.methods.method import Method

BASE_OPTIMIZERS = ("sgd", "adam")
"""The base optimizers a preset can be built on (its preset's ``optimizers`` name some of them)."""
PREDICTION_FORMS = (None, "update", "next_velocity")


@dataclasses.dataclass(frozen=True)
class Traits:
  """What a preset is, whatever its hyperparameters: answers a run's plan
  (:mod:`pipejax.train.plan`) and the reports read by its name. What depends on the
  hyperparameters (the micro-batches of one update) is theirs to say
  (``Hyperparameters.micro_batches_per_update``)."""

  # The reference without a pipeline: the whole network trains as one stage.
  one_stage: bool = False
  # No stage ever computes on stale weights, so there is no delay to compensate.
  delay_free: bool = False
  # Plain Pipelined Backpropagation, no mitigation of the delay: the other methods' yardstick.
  plain_pipeline: bool = False
  # The method to suggest when a delayed method diverges (spike compensation + prediction).
  recommended: bool = False
  # The preset's hyperparameters class, which its Preset sets: what the deprecated
  # micro_batches_per_step asks.
  _hyperparameters: type | None = dataclasses.field(default=None, init=False, repr=False,
                                                    compare=False)

  def micro_batches_per_step(self, micro_batches: int) -> int:
    """The micro-batches one update sees, given the method's ``micro_batches``; replaced by its
    hyperparameters' ``micro_batches_per_update`` (a DeprecationWarning)."""
    warnings.warn("Traits.micro_batches_per_step is replaced by the hyperparameters' "
                  "micro_batches_per_update (a run's: RunPlan.micro_batches_per_update).",
                  DeprecationWarning, stacklevel=2)
    fields = dataclasses.fields(self._hyperparameters) if self._hyperparameters else ()
    return micro_batches if any(f.name == "micro_batches" for f in fields) else 1


@dataclasses.dataclass(frozen=True)
class QuadraticForm:
  """The method on the convex quadratic ``L(w) = ½ λ w²`` (:mod:`pipejax.analysis.quadratic`).

  Attributes:
    delayed: the gradient of step ``t`` comes from the weights of step ``t − D`` (False: the
      undelayed reference, whatever delay it is asked about).
    spike_compensated: the update is ``a v + b g`` with the spike coefficients of ``D``.
    prediction: the forward's weights are extrapolated ``T = D`` steps: ``'update'`` along the
      last applied update, ``'next_velocity'`` along the next step's velocity (SpecTrain), or
      None.
    rate_over_delay: the step is ``η / max(D, 1)`` (PipeMare's rescheduling at its start).
  """

  delayed: bool = True
  spike_compensated: bool = False
  prediction: str | None = None
  rate_over_delay: bool = False

  def __post_init__(self):
    if self.prediction not in PREDICTION_FORMS:
      raise ValueError(f"QuadraticForm.prediction must be one of {PREDICTION_FORMS}; got "
                       f"{self.prediction!r}.")


@dataclasses.dataclass(frozen=True)
class Preset:
  """A preset: its name and display name, its hyperparameters and how it is built from them.

  Attributes:
    name: the preset's name (``config.method``, :func:`pipejax.methods.make_method`).
    display_name: how reports and figures name it.
    hyperparameters: the dataclass of what it is built from; its fields are the keyword
      arguments :func:`pipejax.methods.make_method` accepts for it.
    build: the method from its hyperparameters.
    traits: what it is, for callers that must know before building it.
    optimizers: the base updates (``'sgd'``, ``'adam'``) it is defined for.
    quadratic: its recurrence on the convex quadratic, where it has one.
    color: its colour in figures.

  What the studies measured of its delay is generated data, not part of the preset
  (:mod:`pipejax.methods.safe_ranges`).
  """

  name: str
  display_name: str
  hyperparameters: type
  build: Callable[[Any], Method]
  traits: Traits = Traits()
  optimizers: tuple[str, ...] = BASE_OPTIMIZERS
  quadratic: QuadraticForm | None = None
  color: str = "tab:gray"

  def __post_init__(self):
    # Its own copy: presets share the default Traits().
    traits = dataclasses.replace(self.traits)
    object.__setattr__(traits, "_hyperparameters", self.hyperparameters)
    object.__setattr__(self, "traits", traits)

  def fields(self) -> tuple[str, ...]:
    """The hyperparameters' names, ``learning_rate`` first."""
    return tuple(f.name for f in dataclasses.fields(self.hyperparameters))
