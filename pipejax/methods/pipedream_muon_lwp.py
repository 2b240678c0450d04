"""PipeDream with Muon and Linear Weight Prediction along Muon's applied step.

The forward of a stage of delay ``D`` runs on the weights extrapolated ``D`` updates along the
last applied (orthogonalised) step, and the backward on those same weights, stashed: the gradient
is the exact gradient of the function the forward evaluated, taken at a point that is meant to lie
near the weights its update will land on.
"""

from pipejax.methods.hyperparameters import Predicting, predicted_weights
from pipejax.methods.method import Method
from pipejax.methods.pb_muon import muon
from pipejax.methods.preset import Preset


def build(h: Predicting) -> Method:
  return Method("pipedream_muon_lwp", h.predicting(lambda h, delay: muon(h)),
                forward_weights=predicted_weights, stash_forward_weights=True)


PRESET = Preset("pipedream_muon_lwp", "PipeDream + Muon + LWP", Predicting, build,
                optimizers=("adam",), color="darkkhaki")
