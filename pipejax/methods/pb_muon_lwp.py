"""PB with Muon and Linear Weight Prediction along Muon's applied step, without compensation.

The forward of a stage of delay ``D`` runs on ``w + D (w - w_prev)``: the weights extrapolated
along the last update actually applied, which for Muon is the orthogonalised step times the rate,
not the raw momentum that Muon orthogonalises. ``pb_muon_sc_lwp`` predicts along the same applied
step and also compensates the momenta; this preset isolates the prediction.
"""

from pipejax.methods.hyperparameters import Predicting, predicted_weights
from pipejax.methods.method import Method
from pipejax.methods.pb_muon import muon
from pipejax.methods.preset import Preset


def build(h: Predicting) -> Method:
  return Method("pb_muon_lwp", h.predicting(lambda h, delay: muon(h)),
                forward_weights=predicted_weights)


PRESET = Preset("pb_muon_lwp", "PB + Muon + LWP", Predicting, build, optimizers=("adam",),
                color="darkturquoise")
