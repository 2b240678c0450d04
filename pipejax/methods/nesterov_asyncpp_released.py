"""Nesterov AsyncPP as its authors released it: PyTorch's NAdam with a flat momentum, weight
stashing, and neither the delay-dependent momentum nor the learning-rate correction.

The released runs (PluralisResearch/AsyncPP, ``run.bash``) use b1 0.99 and b2 0.999 with decoupled
decay: set them with the config's ``reference.momentum`` and ``reference.b2``. PyTorch's NAdam
warms its momentum up (``momentum_decay`` 0.004): about 0.57 of b1 after 1,000 steps.
"""

from pipejax.methods.hyperparameters import Hyperparameters
from pipejax.methods.method import Method
from pipejax.methods.preset import Preset
from pipejax.optim import adam_family

TORCH_MOMENTUM_DECAY = 0.004


def build(h: Hyperparameters) -> Method:
  return Method("nesterov_asyncpp_released", lambda delay: adam_family.nesterov_asyncpp(
      h.learning_rate, delay, b1=h.momentum, b2=h.b2, eps=h.eps, weight_decay=h.weight_decay,
      mask=h.mask, adaptive_momentum=False, lr_correction=False,
      momentum_decay=TORCH_MOMENTUM_DECAY), stash_forward_weights=True)


PRESET = Preset("nesterov_asyncpp_released", "Nesterov AsyncPP (released)", Hyperparameters, build,
                optimizers=("adam",), color="slateblue")
