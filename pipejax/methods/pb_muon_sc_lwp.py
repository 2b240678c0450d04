"""PB with Muon, Spike Compensation on Muon's momenta and prediction along the applied Muon step.

Muon's Nesterov momentum (and its NAdamW's, on the non-matrix leaves) is compensated for each
stage's delay as the Adam form of Spike Compensation compensates Adam's first moment
(:func:`pipejax.optim.muon_sc`); the forward's weights are the current ones plus the horizon times
the last applied update (Linear Weight Prediction, update form).
"""

from pipejax import optim
from pipejax.methods.hyperparameters import Predicting, predicted_weights
from pipejax.methods.method import Method
from pipejax.methods.pb_muon import MUON_CONSISTENT_RMS
from pipejax.methods.preset import Preset


def build(h: Predicting) -> Method:
  def update(delay):
    muon = optim.muon_sc(h.learning_rate, delay, beta=h.momentum, eps=h.eps,
                         weight_decay=h.weight_decay, adam_b1=h.momentum, adam_b2=h.b2,
                         adam_weight_decay=0.0 if h.decay_mask else h.weight_decay,
                         consistent_rms=MUON_CONSISTENT_RMS)
    return optim.linear_weight_prediction(muon, h.horizon_for(delay), outermost=True)
  return Method("pb_muon_sc_lwp", update, forward_weights=predicted_weights)


PRESET = Preset("pb_muon_sc_lwp", "PB + Muon + SC + LWP", Predicting, build, optimizers=("adam",),
                color="darkcyan")
