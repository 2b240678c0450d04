"""PB with Muon: Muon on every matrix, its NAdamW on the other leaves (optax.contrib.muon's split).

``consistent_rms = 0.2`` gives a Muon step an AdamW step's RMS (Liu et al. 2025, Moonlight), so
one learning rate serves both parts.
"""

import optax

from pipejax.methods.hyperparameters import Hyperparameters
from pipejax.methods.method import Method
from pipejax.methods.preset import Preset

MUON_CONSISTENT_RMS = 0.2


def muon(h: Hyperparameters) -> optax.GradientTransformation:
  """Muon with ``h``'s rate, momentum and decay (``h.b2`` for the non-matrix leaves' NAdamW)."""
  return optax.contrib.muon(
      h.learning_rate, beta=h.momentum, eps=h.eps, weight_decay=h.weight_decay,
      adam_b1=h.momentum, adam_b2=h.b2, adam_weight_decay=0.0 if h.decay_mask else h.weight_decay,
      consistent_rms=MUON_CONSISTENT_RMS)


def build(h: Hyperparameters) -> Method:
  return Method("pb_muon", lambda delay: muon(h))


PRESET = Preset("pb_muon", "PB + Muon", Hyperparameters, build, optimizers=("adam",),
                color="teal")
