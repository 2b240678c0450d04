"""PipeMare (Yang et al. 2021): per-stage learning-rate rescheduling and discrepancy correction.

Defined for momentum SGD only. The backward runs on the weights PipeMare extrapolates back to the
forward's step.
"""

import dataclasses

import optax

from pipejax import optim
from pipejax.methods.hyperparameters import Hyperparameters, check_number, check_steps
from pipejax.methods.method import Method
from pipejax.methods.preset import QuadraticForm, Preset


@dataclasses.dataclass(frozen=True)
class PipeMareHyperparameters(Hyperparameters):
  """Attributes:
    anneal_steps: K, the steps over which the rate anneals from ``η / D`` to ``η`` (0: none).
    gamma: the discrepancy correction's EMA decay.
  """

  anneal_steps: int = 1000
  gamma: float = optim.DEFAULT_GAMMA

  def check(self) -> None:
    super().check()
    check_steps("anneal_steps", self.anneal_steps)
    check_number("gamma", self.gamma, 0.0, 1.0)


def _past_weights(params, opt_state, delay):
  return optim.pipemare_backward_params(opt_state, params, delay)


def build(h: PipeMareHyperparameters) -> Method:
  def update(delay):
    tx = optim.pipemare(h.learning_rate, delay, h.momentum, h.anneal_steps, h.gamma)
    return optax.chain(optax.add_decayed_weights(h.weight_decay), tx) if h.weight_decay else tx
  return Method("pipemare", update, backward_weights=_past_weights)


PRESET = Preset("pipemare", "PipeMare", PipeMareHyperparameters, build, optimizers=("sgd",),
                quadratic=QuadraticForm(rate_over_delay=True), color="tab:orange")
