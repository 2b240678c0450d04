"""Plain Pipelined Backpropagation: the forward with w_t, the backward with the current weights."""

from pipejax.methods.hyperparameters import Hyperparameters
from pipejax.methods.method import Method
from pipejax.methods.record import QuadraticForm, Record, Traits


def build(h: Hyperparameters) -> Method:
  return Method("pb", h.base)


# safe_delay_memory: docs/studies/depth/report.md (deep MLP, m = 0.99918) found it level with SGD
# (95% CI above −0.5 points) at 8 stages, D_max (1 − m) = 0.012, and behind from 16 (0.025) on;
# docs/studies/lm_depth/report.md (AdamW, b1 0.9) found it behind at 8 stages (1.4) on.
RECORD = Record("pb", "PB", Hyperparameters, build, Traits(plain_pipeline=True),
                quadratic=QuadraticForm(), color="tab:red",
                safe_delay_memory=0.012)
