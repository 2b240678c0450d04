"""SGD (or Adam) without a pipeline: the whole network as one stage, the reference of every gap."""

import dataclasses
from typing import Mapping

from pipejax.methods import method as method_lib
from pipejax.methods.hyperparameters import Hyperparameters, check_steps
from pipejax.methods.preset import QuadraticForm, Preset, Traits
from pipejax.methods.stage_rates import STAGE_RATES


@dataclasses.dataclass(frozen=True)
class SGDHyperparameters(Hyperparameters):
  """Attributes:
    stage_rates: '' (one rate), or a key of :data:`pipejax.methods.STAGE_RATES`: each layer takes
      the rate that method gives the stage holding it in a pipelined split (a control that
      separates that method's rescheduling from its pipeline); momentum SGD only.
    layer_delays: with ``stage_rates``, ``{layer name: delay of its stage}`` in that split; the
      trainer passes those of the config's ``model_kwargs``.
    anneal_steps: with ``stage_rates``, the annealing length K of the copied rates, in steps.
  """

  stage_rates: str = ""
  layer_delays: Mapping[str, int] | None = None
  anneal_steps: int = 1000

  def check(self) -> None:
    super().check()
    check_steps("anneal_steps", self.anneal_steps)
    if self.stage_rates not in ("", *STAGE_RATES):
      raise method_lib.MethodError(
          f"make_method: stage_rates must be '' (one rate) or one of {', '.join(STAGE_RATES)} "
          f"(each layer at that method's rate for its stage); got {self.stage_rates!r}.")
    if self.stage_rates and self.optimizer != "sgd":
      raise method_lib.MethodError(
          f"make_method: stage_rates={self.stage_rates!r} gives the layers of the one-stage "
          f"momentum-SGD baseline per-stage rates; it needs optimizer='sgd' (got "
          f"{self.optimizer!r}).")

  def unread(self) -> dict[str, str]:
    unread = super().unread()
    if not self.stage_rates:
      why = "reads no {} without stage_rates (one rate for every layer)"
      unread.update(anneal_steps=why.format("annealing length"),
                    layer_delays=why.format("layer delays"))
    return unread


def build(h: SGDHyperparameters) -> method_lib.Method:
  if not h.stage_rates:
    return dataclasses.replace(method_lib.sync(h.base, micro_batches=1), name="sgd")
  if h.layer_delays is None:
    raise method_lib.MethodError(
        f"make_method: stage_rates={h.stage_rates!r} needs layer_delays, the delay of each "
        "layer's stage in the pipelined split whose rates it copies.")
  return STAGE_RATES[h.stage_rates](dict(h.layer_delays), learning_rate=h.learning_rate,
                                    momentum=h.momentum, weight_decay=h.weight_decay,
                                    anneal_steps=h.anneal_steps)


PRESET = Preset("sgd", "SGD", SGDHyperparameters, build, Traits(one_stage=True, delay_free=True),
                quadratic=QuadraticForm(delayed=False), color="black")
