"""SGD (or Adam) without a pipeline: the whole network as one stage, the reference of every gap."""

import dataclasses

from pipejax.methods import method as method_lib
from pipejax.methods.hyperparameters import Hyperparameters
from pipejax.methods.record import QuadraticForm, Record, Traits


def build(h: Hyperparameters) -> method_lib.Method:
  return dataclasses.replace(method_lib.sync(h.base, micro_batches=1), name="sgd")


RECORD = Record("sgd", "SGD", Hyperparameters, build, Traits(one_stage=True, delay_free=True),
                quadratic=QuadraticForm(delayed=False), color="black",
                config_fields=("sgd_stage_rates",))
