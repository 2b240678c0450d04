"""SpecTrain (Chen et al. 2018): the forward predicts along the next step's velocity ``m v + g``.

The reference code predicts with the next velocity (see ``linear_weight_prediction``); defined
for momentum SGD only.
"""

from pipejax.methods.hyperparameters import Hyperparameters, Predicting, predicted_weights
from pipejax.methods.method import Method
from pipejax.methods.preset import QuadraticForm, Preset


def build(h: Predicting) -> Method:
  return Method("spectrain", h.predicting(Hyperparameters.base, form="next_velocity"),
                forward_weights=predicted_weights)


PRESET = Preset("spectrain", "SpecTrain", Predicting, build, optimizers=("sgd",),
                quadratic=QuadraticForm(prediction="next_velocity"), color="tab:olive")
