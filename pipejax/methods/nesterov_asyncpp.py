"""Nesterov AsyncPP: weight stashing with a delay-dependent Nesterov momentum and rate correction.

Each stage's momentum follows from its delay and the pipeline's largest delay
``2(S − 1)`` (docs/design.md §2: ``D_s = 2(S − 1 − s)``), so it needs the pipeline's S.
"""

import dataclasses

from pipejax.methods.hyperparameters import Hyperparameters, check_positive_int, check_steps
from pipejax.methods.method import Method, MethodError
from pipejax.methods.preset import Preset
from pipejax.optim import adam_family


@dataclasses.dataclass(frozen=True)
class NesterovAsyncPPHyperparameters(Hyperparameters):
  """Attributes:
    num_stages: the pipeline's number of stages S (its momentum rule divides by the largest
      delay + 1); the trainer passes its model's.
    anneal_steps: K of its learning-rate correction, in steps.
  """

  num_stages: int | None = None
  anneal_steps: int = 1000

  def check(self) -> None:
    super().check()
    check_steps("anneal_steps", self.anneal_steps)
    if self.num_stages is not None:
      check_positive_int("num_stages", self.num_stages, "the pipeline's S")


def build(h: NesterovAsyncPPHyperparameters) -> Method:
  if h.num_stages is None:
    raise MethodError("Method 'nesterov_asyncpp' sets each stage's momentum from its delay and "
                      "the pipeline's largest delay: pass make_method(..., num_stages=S).")
  max_delay = 2 * (h.num_stages - 1)
  return Method("nesterov_asyncpp", lambda delay: adam_family.nesterov_asyncpp(
      h.learning_rate, delay, max_delay, h.anneal_steps, b1=h.momentum, b2=h.b2, eps=h.eps,
      weight_decay=h.weight_decay, mask=h.mask), stash_forward_weights=True)


PRESET = Preset("nesterov_asyncpp", "Nesterov AsyncPP", NesterovAsyncPPHyperparameters, build,
                optimizers=("adam",), color="navy")
