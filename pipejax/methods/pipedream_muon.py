"""PipeDream with Muon: ``pb_muon``'s update, and the backward on the weights the forward used.

Weight stashing removes the forward/backward mismatch that plain PB leaves (the gradient of a
function at the weights it was evaluated at), and keeps the delay of the gradient itself.

With ``micro_batches = M > 1`` each stage applies one update per M micro-batches, the mean of
their gradients, while the pipeline stays asynchronous and full (PipeDream-2BW's gradient
accumulation, Narayanan et al. 2021). A gradient is then stale by about D / M updates rather
than D, at the price of M samples per update. Its delay in samples is unchanged: where one
update of M samples makes the progress of M updates of one, the weights move as far during it.
"""

import dataclasses

import optax

from pipejax.methods import method as method_lib
from pipejax.methods.hyperparameters import Hyperparameters
from pipejax.methods.pb_muon import muon
from pipejax.methods.record import Record, Traits


@dataclasses.dataclass(frozen=True)
class AccumulatingHyperparameters(Hyperparameters):
  """Attributes: micro_batches: M, the micro-batches whose mean gradient one update applies."""

  micro_batches: int = 1

  def check(self) -> None:
    super().check()
    method_lib.check_micro_batches(self.micro_batches)


def build(h: AccumulatingHyperparameters) -> method_lib.Method:
  def stage_optimizer(delay):
    del delay  # Muon's update does not depend on it
    if h.micro_batches == 1:
      return muon(h)
    return optax.MultiSteps(muon(h), every_k_schedule=h.micro_batches).gradient_transformation()

  return method_lib.Method("pipedream_muon", stage_optimizer, stash_forward_weights=True,
                           micro_batches_per_update=h.micro_batches)


RECORD = Record("pipedream_muon", "PipeDream + Muon", AccumulatingHyperparameters, build,
                Traits(accumulates_micro_batches=True), optimizers=("adam",), color="darkcyan")
