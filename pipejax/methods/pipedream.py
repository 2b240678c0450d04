"""PipeDream weight stashing: the backward uses the very weights the forward used."""

from pipejax.methods.hyperparameters import Hyperparameters
from pipejax.methods.method import Method
from pipejax.methods.preset import Preset


def build(h: Hyperparameters) -> Method:
  return Method("pipedream", h.base, stash_forward_weights=True)


PRESET = Preset("pipedream", "PipeDream", Hyperparameters, build, color="tab:cyan")
