"""PipeDream weight stashing: the backward uses the very weights the forward used."""

from pipejax.methods.hyperparameters import Hyperparameters
from pipejax.methods.method import Method
from pipejax.methods.record import Record


def build(h: Hyperparameters) -> Method:
  return Method("pipedream", h.base, stash_forward_weights=True)


RECORD = Record("pipedream", "PipeDream", Hyperparameters, build, color="tab:cyan")
