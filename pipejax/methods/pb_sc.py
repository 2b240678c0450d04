"""PB with Spike Compensation (Kosson et al. 2021): the update ``a v + b g`` for each delay."""

from pipejax.methods.hyperparameters import Hyperparameters
from pipejax.methods.method import Method
from pipejax.methods.record import QuadraticForm, Record


def build(h: Hyperparameters) -> Method:
  return Method("pb_sc", h.spike_compensated)


# safe_delay_memory: docs/studies/depth/report.md (deep MLP, m = 0.99918) found it level with SGD
# (95% CI above −0.5 points) up to 32 stages, D_max (1 − m) = 0.052 (64 stages not run), and 6.2
# points behind at 128 (0.21).
RECORD = Record("pb_sc", "PB + SC", Hyperparameters, build,
                quadratic=QuadraticForm(spike_compensated=True), color="tab:blue",
                safe_delay_memory=0.052)
