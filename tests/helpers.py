"""What several test files share: the repository root and the small dense test model.

A plain module rather than ``conftest.py``: pytest loads conftest files itself and advises against
importing from them, and these are functions and constants, not fixtures.
"""

import os

import flax.linen as nn

import pipejax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IN_DIM, NUM_CLASSES = 6, 4  # inputs of IN_DIM features, NUM_CLASSES logits


def dense_model(widths) -> pipejax.Model:
  """One ``Dense(w) + tanh`` stage per width, then a dense head: uneven widths give every stage
  its own input and weight shapes."""
  stages = [pipejax.from_flax(nn.Sequential([nn.Dense(w), nn.tanh]), name=f"dense{w}")
            for w in widths]
  return pipejax.Model(stages + [pipejax.from_flax(nn.Dense(NUM_CLASSES), name="head")])
