"""DC-ASGD (Zheng et al. 2017): the stashed weights' gradient, moved to the current weights.

The gradient is computed on the forward's (stashed) weights, as an asynchronous worker's is, then
the delay compensation ``g + λ g ⊙ g ⊙ (w − w_grad)`` moves it to the current weights.
"""

import dataclasses

import optax

from pipejax import optim
from pipejax.methods.hyperparameters import Hyperparameters, check_number
from pipejax.methods.method import Method
from pipejax.methods.preset import Preset


@dataclasses.dataclass(frozen=True)
class DcAsgdHyperparameters(Hyperparameters):
  """Attributes: dc_strength: DC-ASGD's lambda."""

  dc_strength: float = 0.04

  def check(self) -> None:
    super().check()
    check_number("dc_strength", self.dc_strength)


def build(h: DcAsgdHyperparameters) -> Method:
  return Method("dcasgd", lambda delay: optax.chain(optim.delay_compensation(h.dc_strength),
                                                    h.base(delay)),
                stash_forward_weights=True, pass_gradient_weights=True)


PRESET = Preset("dcasgd", "DC-ASGD", DcAsgdHyperparameters, build, color="tab:pink")
