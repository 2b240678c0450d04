"""PB with Spike Compensation and Linear Weight Prediction: the paper's method (Kosson et al. 2021).

The prediction extrapolates the last applied update, spike included.
"""

from pipejax.methods.hyperparameters import Hyperparameters, Predicting, predicted_weights
from pipejax.methods.method import Method
from pipejax.methods.preset import QuadraticForm, Preset, Traits


def build(h: Predicting) -> Method:
  return Method("pb_sc_lwp", h.predicting(Hyperparameters.spike_compensated),
                forward_weights=predicted_weights)


PRESET = Preset("pb_sc_lwp", "PB + SC + LWP", Predicting, build, Traits(recommended=True),
                quadratic=QuadraticForm(spike_compensated=True, prediction="update"),
                color="tab:purple")
