"""PB with error feedback for delayed updates: the weights run ``D`` updates ahead of the undelayed
iterate, the gap estimated from the trend of the updates
(:func:`pipejax.optim.delayed_error_feedback`, after the error-feedback correction of Zmushko et al.
2026).
"""

import dataclasses

from pipejax import optim
from pipejax.methods.hyperparameters import Hyperparameters, check_number
from pipejax.methods.method import Method
from pipejax.methods.preset import Preset


@dataclasses.dataclass(frozen=True)
class ErrorFeedbackHyperparameters(Hyperparameters):
  """Attributes: smoothing: the EMA decay of the update trend the error is estimated from (0: the
  last update alone)."""

  smoothing: float = 0.0

  def check(self) -> None:
    super().check()
    check_number("smoothing", self.smoothing, 0.0, 1.0)


def build(h: ErrorFeedbackHyperparameters) -> Method:
  return Method("pb_error_feedback",
                lambda delay: optim.delayed_error_feedback(h.base(delay), delay, h.smoothing))


PRESET = Preset("pb_error_feedback", "PB + error feedback", ErrorFeedbackHyperparameters, build,
                color="darkgreen")
