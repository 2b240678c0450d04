"""PB with Muon and error feedback for delayed updates: ``pb_muon``'s update, with the weights run
``D`` updates ahead of the undelayed iterate (:func:`pipejax.optim.delayed_error_feedback`), the
pairing Zmushko et al. (2026) found most robust to a one-step delay.
"""

from pipejax import optim
from pipejax.methods.method import Method
from pipejax.methods.pb_error_feedback import ErrorFeedbackHyperparameters
from pipejax.methods.pb_muon import muon
from pipejax.methods.preset import Preset


def build(h: ErrorFeedbackHyperparameters) -> Method:
  return Method("pb_muon_error_feedback",
                lambda delay: optim.delayed_error_feedback(muon(h), delay, h.smoothing))


PRESET = Preset("pb_muon_error_feedback", "PB + Muon + error feedback",
                ErrorFeedbackHyperparameters, build, optimizers=("adam",), color="seagreen")
