"""What the benchmarks run: the networks, their input streams, and the plain optax loop.

The plain loop is the baseline every pipeline is timed against: one optax step of the whole
network (:func:`pipejax.core.stages.plain_step`), unpipelined, usually inside ``lax.scan``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax

from pipejax import models
from pipejax.core import stages
from pipejax.core.flax_bridge import from_flax
from pipejax.core.stages import Model

WIDTH, LAYERS = 256, 8  # the MLP of 'throughput' and the mesh benchmarks
RESNET_INPUT = (28, 28, 1)  # Fashion-MNIST
LM_CONTEXT = 64  # configs/char_lm.py's
LM_BLOCKS = (6, 14, 30)  # 8, 16 and 32 stages
LM_WIDTHS = {6: 128, 14: 96, 30: 64}  # configs/studies/lm_depth.py's: about 1.5 M parameters


def lm_model_kwargs(blocks: int) -> dict:
  """configs/char_lm.py's transformer at ``blocks`` blocks, one a stage, at the width
  configs/studies/lm_depth.py gives that depth (128 where it gives none)."""
  return {"width": LM_WIDTHS.get(blocks, 128), "blocks": blocks, "heads": 4,
          "layers_per_stage": 1}


def mlp_model(num_layers: int = LAYERS, width: int = WIDTH) -> Model:
  """num_layers Dense(width) stages with ReLU; the last layer's outputs are the logits."""
  stages = [from_flax(nn.Sequential([nn.Dense(width), nn.relu]), name=f"dense{i}")
            for i in range(num_layers - 1)]
  return Model(stages + [from_flax(nn.Dense(width), name="logits")])


def default_model() -> Model:
  """configs/default.py's model: the 784-256-128-10 MLP, one layer per stage."""
  return models.build("mlp", hidden=(256, 128), num_classes=10)


def resnet20(conv_impl: str = "auto") -> Model:
  """ResNet-20 with GroupNorm, one conv per stage."""
  return models.build("cifar_resnet20", layers_per_stage=1, normalization="group",
                      conv_impl=conv_impl)


def depth_model(num_stages: int) -> Model:
  """configs/deep_mlp.py's residual MLP (width 128, LayerNorm), one block per stage."""
  return models.build("residual_mlp", num_classes=10, depth=num_stages, width=128, expansion=1,
                      normalization="layer", layers_per_stage=1)

def stream(num_ticks: int, b: int, shape=(WIDTH,), classes: int = WIDTH):
  """Random inputs and labels for ``num_ticks`` micro-batches of ``b``, on the default device.

  Placed there once, so that no timed call copies the stream from the host (on a GPU that copy
  would cost more than the ticks themselves at small micro-batches).
  """
  rng = np.random.default_rng(0)
  x = rng.standard_normal((num_ticks, b) + tuple(shape), dtype=np.float32)
  y = rng.integers(0, classes, (num_ticks, b), dtype=np.int32)
  return jax.device_put(x), jax.device_put(y)


def plain_scan(model: Model, tx: optax.GradientTransformation, jit=jax.jit):
  """The plain loop over a stream, ``(carry, (x, y)) -> (carry, losses)``, jitted by ``jit``
  (``pipejax.core.runner.jit``: compiled as the pipeline is) with the carry donated."""
  step = stages.plain_step(model, tx)
  return jit(lambda carry, xs: jax.lax.scan(step, carry, xs), donate_argnums=0)
