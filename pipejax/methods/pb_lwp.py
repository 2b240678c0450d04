"""PB with Linear Weight Prediction: the forward runs T steps ahead along the last update."""

from pipejax.methods.hyperparameters import Hyperparameters, Predicting, predicted_weights
from pipejax.methods.method import Method
from pipejax.methods.record import QuadraticForm, Record


def build(h: Predicting) -> Method:
  return Method("pb_lwp", h.predicting(Hyperparameters.base), forward_weights=predicted_weights)


# safe_delay_memory: docs/studies/depth/report.md (deep MLP, m = 0.99918) found it level with SGD
# (95% CI above −0.5 points) up to 32 stages, D_max (1 − m) = 0.052; deeper was not run.
RECORD = Record("pb_lwp", "PB + LWP", Predicting, build,
                quadratic=QuadraticForm(prediction="update"), color="tab:green",
                safe_delay_memory=0.052)
