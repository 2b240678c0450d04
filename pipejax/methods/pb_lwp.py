"""PB with Linear Weight Prediction: the forward runs T steps ahead along the last update."""

from pipejax.methods.hyperparameters import Hyperparameters, Predicting, predicted_weights
from pipejax.methods.method import Method
from pipejax.methods.preset import QuadraticForm, Preset


def build(h: Predicting) -> Method:
  return Method("pb_lwp", h.predicting(Hyperparameters.base), forward_weights=predicted_weights)


PRESET = Preset("pb_lwp", "PB + LWP", Predicting, build,
                quadratic=QuadraticForm(prediction="update"), color="tab:green")
