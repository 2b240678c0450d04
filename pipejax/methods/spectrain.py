"""SpecTrain (Chen et al. 2018): the forward predicts along the next step's velocity ``m v + g``.

The reference code predicts with the next velocity (see ``linear_weight_prediction``); defined
for momentum SGD only.
"""

from pipejax.methods.hyperparameters import Hyperparameters, Predicting, predicted_weights
from pipejax.methods.method import Method
from pipejax.methods.record import QuadraticForm, Record


def build(h: Predicting) -> Method:
  return Method("spectrain", h.predicting(Hyperparameters.base, form="next_velocity"),
                forward_weights=predicted_weights)


# safe_delay_memory: docs/studies/depth/report.md (deep MLP, m = 0.99918) found it level with SGD
# (95% CI above −0.5 points) up to 32 stages, D_max (1 − m) = 0.052, and 1.0 point behind at 64.
RECORD = Record("spectrain", "SpecTrain", Predicting, build, optimizers=("sgd",),
                quadratic=QuadraticForm(prediction="next_velocity"), color="tab:olive",
                safe_delay_memory=0.052)
