"""Muon without a pipeline: the whole network as one stage, the Muon family's synchronous baseline.

The same update as :mod:`pipejax.methods.pb_muon` (Muon on every matrix, its NAdamW on the other
leaves, an AdamW step's RMS), trained without delay.
"""

import dataclasses

from pipejax.methods import method as method_lib
from pipejax.methods.hyperparameters import Hyperparameters
from pipejax.methods.pb_muon import muon
from pipejax.methods.preset import Preset, Traits


def build(h: Hyperparameters) -> method_lib.Method:
  return dataclasses.replace(method_lib.sync(lambda delay: muon(h), micro_batches=1), name="muon")


PRESET = Preset("muon", "Muon", Hyperparameters, build, Traits(one_stage=True, delay_free=True),
                optimizers=("adam",), color="dimgray")
