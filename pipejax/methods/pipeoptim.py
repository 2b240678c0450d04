"""PipeOptim: PB whose forward runs on Adam's predicted weights ``w − lr s m̂ / (√v̂ + ε)``."""

from pipejax.methods.hyperparameters import Predicting
from pipejax.methods.method import Method
from pipejax.methods.preset import Preset
from pipejax.optim import adam_family


def build(h: Predicting) -> Method:
  def update(delay):
    return adam_family.adam_weight_prediction(
        h.learning_rate, h.horizon_for(delay), b1=h.momentum, b2=h.b2, eps=h.eps,
        weight_decay=h.weight_decay, mask=h.mask)

  def forward_weights(params, opt_state, delay):
    del delay  # the horizon is in the state's step size
    return adam_family.adam_predicted_params(params, opt_state, h.momentum, h.b2, h.eps)

  return Method("pipeoptim", update, forward_weights=forward_weights)


PRESET = Preset("pipeoptim", "PipeOptim", Predicting, build, optimizers=("adam",),
                color="tab:gray")
