"""Plain Pipelined Backpropagation: the forward with w_t, the backward with the current weights."""

from pipejax.methods.hyperparameters import Hyperparameters
from pipejax.methods.method import Method
from pipejax.methods.preset import QuadraticForm, Preset, Traits


def build(h: Hyperparameters) -> Method:
  return Method("pb", h.base)


PRESET = Preset("pb", "PB", Hyperparameters, build, Traits(plain_pipeline=True),
                quadratic=QuadraticForm(), color="tab:red")
