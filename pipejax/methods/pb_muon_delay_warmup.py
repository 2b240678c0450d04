"""PB with Muon and a warm-up as long as the delay is: ``pb_muon``'s update at PipeMare's per-stage
rate, which starts a stage of delay ``D`` at ``η / D`` and anneals it to ``η`` over ``K`` steps
(:func:`pipejax.optim.pipemare_learning_rate`).

On the quadratic a delayed heavy ball is stable while ``η D`` stays below a bound set by the
curvature (docs/quadratic.md), and the curvature is highest early in training; so the stages with
the longest delays take the smallest steps while it is.
"""

import dataclasses

from pipejax import optim
from pipejax.methods.hyperparameters import Hyperparameters, check_steps
from pipejax.methods.method import Method
from pipejax.methods.pb_muon import muon
from pipejax.methods.preset import Preset


@dataclasses.dataclass(frozen=True)
class DelayWarmupHyperparameters(Hyperparameters):
  """Attributes:
    anneal_steps: K, the steps over which a stage's rate anneals from ``η / D`` to ``η``.
  """

  anneal_steps: int = 1000

  def check(self) -> None:
    super().check()
    check_steps("anneal_steps", self.anneal_steps)


def build(h: DelayWarmupHyperparameters) -> Method:
  def update(delay):
    rate = optim.pipemare_learning_rate(h.learning_rate, delay, h.anneal_steps)
    return muon(dataclasses.replace(h, learning_rate=rate))
  return Method("pb_muon_delay_warmup", update)


PRESET = Preset("pb_muon_delay_warmup", "PB + Muon + delay warm-up", DelayWarmupHyperparameters,
                build, optimizers=("adam",), color="olive")
