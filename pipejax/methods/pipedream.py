"""PipeDream weight stashing: the backward uses the very weights the forward used."""

from pipejax.methods.hyperparameters import Hyperparameters
from pipejax.methods.method import Method
from pipejax.methods.record import Record


def build(h: Hyperparameters) -> Method:
  return Method("pipedream", h.base, stash_forward_weights=True)


# safe_delay_memory: docs/studies/depth/report.md (deep MLP, m = 0.99918) found it level with SGD
# (95% CI above −0.5 points) at 8 stages, D_max (1 − m) = 0.012, and behind from 16 (0.025) on.
RECORD = Record("pipedream", "PipeDream", Hyperparameters, build, color="tab:cyan",
                safe_delay_memory=0.012)
