"""PipeDream with Muon: ``pb_muon``'s update, and the backward on the weights the forward used.

Weight stashing removes the forward/backward mismatch that plain PB leaves (the gradient of a
function at the weights it was evaluated at), and keeps the delay of the gradient itself.
"""

from pipejax.methods.hyperparameters import Hyperparameters
from pipejax.methods.method import Method
from pipejax.methods.pb_muon import muon
from pipejax.methods.record import Record


def build(h: Hyperparameters) -> Method:
  return Method("pipedream_muon", lambda delay: muon(h), stash_forward_weights=True)


RECORD = Record("pipedream_muon", "PipeDream + Muon", Hyperparameters, build,
                optimizers=("adam",), color="darkcyan")
