"""PipeDream with Muon, each stage's momentum and rate set by its delay.

The momentum of a stage of delay ``D`` is Nesterov AsyncPP's per-stage rule, ``b1 + D (0.99 -
b1) / (D_max + 1)`` (:func:`pipejax.optim.asyncpp_momentum`): a longer delay averages over more
steps, so a gradient that arrives late moves the weights by a smaller share of the step. Its
rate is PipeMare's, ``η / D`` annealed to ``η`` over ``K`` steps
(:func:`pipejax.optim.pipemare_learning_rate`). Weights are stashed, as PipeDream + Muon's, the
best asynchronous method of the 32-stage language model without either rule.
"""

import dataclasses

from pipejax import optim
from pipejax.methods.method import Method, MethodError
from pipejax.methods.nesterov_asyncpp import NesterovAsyncPPHyperparameters
from pipejax.methods.pb_muon import muon
from pipejax.methods.preset import Preset


# Nesterov AsyncPP's fields: the pipeline's S for the momentum rule, and K for the rate's.
def build(h: NesterovAsyncPPHyperparameters) -> Method:
  if h.num_stages is None:
    raise MethodError("Method 'pipedream_muon_delay_adaptive' sets each stage's momentum from its "
                      "delay and the pipeline's largest delay: pass make_method(..., "
                      "num_stages=S).")
  max_delay = 2 * (h.num_stages - 1)

  def update(delay):
    return muon(dataclasses.replace(
        h, momentum=optim.asyncpp_momentum(h.momentum, delay, max_delay),
        learning_rate=optim.pipemare_learning_rate(h.learning_rate, delay, h.anneal_steps)))
  return Method("pipedream_muon_delay_adaptive", update, stash_forward_weights=True)


PRESET = Preset("pipedream_muon_delay_adaptive",
                "PipeDream + Muon + delay-adaptive momentum and rate",
                NesterovAsyncPPHyperparameters, build, optimizers=("adam",), color="sienna")
