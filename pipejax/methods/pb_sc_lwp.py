"""PB with Spike Compensation and Linear Weight Prediction: the paper's method (Kosson et al. 2021).

The prediction extrapolates the last applied update, spike included.
"""

from pipejax.methods.hyperparameters import Hyperparameters, Predicting, predicted_weights
from pipejax.methods.method import Method
from pipejax.methods.record import QuadraticForm, Record, Traits


def build(h: Predicting) -> Method:
  return Method("pb_sc_lwp", h.predicting(Hyperparameters.spike_compensated),
                forward_weights=predicted_weights)


# safe_delay_memory: docs/studies/depth/report.md (deep MLP, m = 0.99918) found it level with SGD
# (95% CI above −0.5 points) up to 64 stages, D_max (1 − m) = 0.104, and 3.1 points behind at 128
# (0.21); docs/studies/lm_depth/report.md (AdamW, b1 0.9) found it behind at 8 stages (1.4) on.
RECORD = Record("pb_sc_lwp", "PB + SC + LWP", Predicting, build, Traits(recommended=True),
                quadratic=QuadraticForm(spike_compensated=True, prediction="update"),
                color="tab:purple",
                safe_delay_memory=0.104)
