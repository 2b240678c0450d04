"""The synchronous pipeline (GPipe / 1F1B-flush): M micro-batches a step, then fill and drain."""

from pipejax.methods import method as method_lib
from pipejax.methods.hyperparameters import Accumulating
from pipejax.methods.preset import Preset, Traits


def build(h: Accumulating) -> method_lib.Method:
  return method_lib.sync(h.base, micro_batches=h.micro_batches)


PRESET = Preset("sync", "GPipe (sync)", Accumulating, build,
                Traits(delay_free=True), color="tab:brown")
