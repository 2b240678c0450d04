"""PB with Spike Compensation (Kosson et al. 2021): the update ``a v + b g`` for each delay."""

from pipejax.methods.hyperparameters import Hyperparameters
from pipejax.methods.method import Method
from pipejax.methods.preset import QuadraticForm, Preset


def build(h: Hyperparameters) -> Method:
  return Method("pb_sc", h.spike_compensated)


PRESET = Preset("pb_sc", "PB + SC", Hyperparameters, build,
                quadratic=QuadraticForm(spike_compensated=True), color="tab:blue")
