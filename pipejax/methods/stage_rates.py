"""The one-stage baseline with per-layer rates copied from a pipelined method: a control."""

from __future__ import annotations

import dataclasses

import optax

from pipejax import optim
from pipejax.methods import method as method_lib


def sgd_with_pipemare_rates(layer_delays: dict[str, int], *, learning_rate, momentum: float = 0.9,
                            weight_decay: float = 0.0, anneal_steps: int = 1000
                            ) -> method_lib.Method:
  """SGD without a pipeline in which each layer follows PipeMare's rate for its pipeline stage.

  The control that separates PipeMare's learning-rate rescheduling from its pipeline: the network
  trains as one stage, without delay, but layer ``l`` takes
  ``optim.pipemare_learning_rate(learning_rate, D, anneal_steps)`` where ``D`` is the delay of the
  stage that holds it in the pipelined run (``layer_delays[l]``). If PipeMare's lead over SGD
  comes from the rescheduling alone, this run shares it.

  Args:
    layer_delays: ``{layer name: delay of its stage}`` for every top-level parameter key of the
      one-stage model (``pipejax.models.sequential`` keys parameters by layer name).
    learning_rate, momentum, weight_decay, anneal_steps: as for PipeMare's hyperparameters.
  """
  if not layer_delays or any(not isinstance(d, int) or d < 0 for d in layer_delays.values()):
    raise method_lib.MethodError(f"layer_delays must map each layer name to its stage's delay "
                                 f"(an int >= 0); got {layer_delays!r}.")

  def rate_for(delay):
    tx = optax.sgd(optim.pipemare_learning_rate(learning_rate, delay, anneal_steps),
                   momentum=momentum)
    return optax.chain(optax.add_decayed_weights(weight_decay), tx) if weight_decay else tx

  def label(params):
    missing = sorted(set(params) - set(layer_delays))
    if missing:
      raise method_lib.MethodError(f"sgd_with_pipemare_rates has no delay for the layers "
                                   f"{missing}.")
    return {name: str(layer_delays[name]) for name in params}

  tx = optax.multi_transform({str(d): rate_for(d) for d in set(layer_delays.values())}, label)
  return dataclasses.replace(method_lib.sync(lambda delay: tx, micro_batches=1), name="sgd")


STAGE_RATES = {"pipemare": sgd_with_pipemare_rates}
"""The per-layer rate rules the one-stage baseline can take (its hyperparameter ``stage_rates``,
``config.method_kwargs.sgd.stage_rates``), by the method whose rates they copy."""
