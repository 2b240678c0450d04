"""The synchronous pipeline (GPipe / 1F1B-flush): M micro-batches a step, then fill and drain."""

import dataclasses

from pipejax.methods import method as method_lib
from pipejax.methods.hyperparameters import Hyperparameters
from pipejax.methods.record import Record, Traits


@dataclasses.dataclass(frozen=True)
class SyncHyperparameters(Hyperparameters):
  """Attributes: micro_batches: M, the micro-batches one step accumulates (GPipe's M)."""

  micro_batches: int = 1

  def check(self) -> None:
    super().check()
    method_lib.check_micro_batches(self.micro_batches)


def build(h: SyncHyperparameters) -> method_lib.Method:
  return method_lib.sync(h.base, micro_batches=h.micro_batches)


RECORD = Record("sync", "GPipe (sync)", SyncHyperparameters, build,
                Traits(accumulates_micro_batches=True, delay_free=True), color="tab:brown")
