"""PipeDream with Muon: ``pb_muon``'s update, and the backward on the weights the forward used.

Weight stashing removes the forward/backward mismatch that plain PB leaves (the gradient of a
function at the weights it was evaluated at), and keeps the delay of the gradient itself.

With ``micro_batches = M > 1`` each stage applies one update per M micro-batches, the mean of
their gradients, while the pipeline stays asynchronous and full (PipeDream-2BW's gradient
accumulation, Narayanan et al. 2021). A gradient is then stale by about D / M updates rather
than D, at the price of M samples per update. Its delay in samples is unchanged: where one
update of M samples makes the progress of M updates of one, the weights move as far during it.
"""

from pipejax.methods import method as method_lib
from pipejax.methods.hyperparameters import Accumulating
from pipejax.methods.pb_muon import muon
from pipejax.methods.preset import Preset


def build(h: Accumulating) -> method_lib.Method:
  # Muon's update does not depend on the stage's delay.
  return method_lib.Method("pipedream_muon", method_lib.accumulating(muon(h), h.micro_batches),
                           stash_forward_weights=True, micro_batches_per_update=h.micro_batches)


PRESET = Preset("pipedream_muon", "PipeDream + Muon", Accumulating, build,
                optimizers=("adam",), color="goldenrod")
