"""A residual MLP whose depth is one knob: the deep, fine-grained pipelines where staleness hurts.

``residual_mlp(depth=32)`` is 32 weight layers, so 32 pipeline stages at ``layers_per_stage=1``
(delays up to 62): a stem (flatten + dense), ``depth - 2`` pre-norm residual blocks
``x + W2 relu(W1 norm(x))`` of one stage each, and a head (norm + dense to logits). Pre-norm
residual blocks keep every depth trainable by plain SGD at batch 1, so a gap between a pipelined
method and SGD measures the method, not the network's trainability.
"""

from __future__ import annotations

import flax.linen as nn
import jax


from pipejax.models import layers, online_norm, sequential
from pipejax.core.stages import LossFn, Model, ModelError, softmax_cross_entropy


def _norm(normalization: str | None, name: str):
  if normalization is None:
    return lambda x: x
  if normalization == "online":
    return online_norm.OnlineNorm(name=name)
  return nn.LayerNorm(name=name)


class Stem(nn.Module):
  """Flatten and project to the residual width."""

  width: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(self.width, name="dense")(x.reshape(x.shape[0], -1))


class ResidualDenseBlock(nn.Module):
  """``x + W2 relu(W1 norm(x))`` with a hidden width of ``expansion * width``.

  The second layer starts at 1/sqrt(depth) of its usual scale, so that the sum over depth blocks
  starts with the variance of one (a common rule for deep residual stacks, e.g. GPT-2's).
  """

  expansion: int = 1
  normalization: str | None = "layer"
  residual_scale: float = 1.0

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    width = x.shape[-1]
    h = _norm(self.normalization, "norm")(x)
    h = nn.relu(nn.Dense(self.expansion * width, name="dense1")(h))
    init = nn.initializers.variance_scaling(self.residual_scale ** 2, "fan_in", "truncated_normal")
    return x + nn.Dense(width, kernel_init=init, name="dense2")(h)


class Head(nn.Module):
  """Normalize and map to logits."""

  num_classes: int
  normalization: str | None = "layer"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(self.num_classes, name="dense")(_norm(self.normalization, "norm")(x))


def residual_mlp(depth: int = 8, width: int = 128, expansion: int = 1, num_classes: int = 10,
                 layers_per_stage: int | None = 1, normalization: str | None = "layer",
                 loss: LossFn = softmax_cross_entropy, declared_stack: bool = False) -> Model:
  """A residual MLP of ``depth`` weight layers (stages at ``layers_per_stage=1``).

  Args:
    depth: Weight layers, at least 3: stem, ``depth - 2`` residual blocks, head.
    width: Width of the residual stream.
    expansion: Hidden width of each block, as a multiple of ``width``.
    num_classes: Logits of the head.
    layers_per_stage: Consecutive weight layers per stage (None: one stage, no pipeline).
    normalization: 'layer' (pre-norm LayerNorm in each block and before the head), 'online'
      (Online Normalization there instead) or None.
    loss: Loss on the logits.
    declared_stack: the blocks as one module repeated, one stage each (a declared stack,
      :class:`pipejax.Model`): built in about the time of a shallow network. Each block's weights
      are drawn from its stage's key alone, so they differ from the named blocks' (``block1``,
      ``block2``, ...) of the default, which fold their names into it.

  Example:
    >>> residual_mlp(depth=32).num_stages
    32
  """
  layers.check_normalization(normalization, allowed=(None, "layer", "online"))
  if isinstance(depth, bool) or not isinstance(depth, int) or depth < 3:
    raise ModelError(f"residual_mlp needs depth >= 3 (stem, at least one block, head); got "
                     f"{depth!r}. Set --config.model_kwargs.depth to the number of stages wanted.")
  blocks = depth - 2
  if declared_stack:
    if layers_per_stage != 1:
      raise ModelError(f"residual_mlp's declared_stack repeats one block per stage, so it needs "
                       f"layers_per_stage=1; got {layers_per_stage!r}. Drop "
                       "--config.model_kwargs.declared_stack or set layers_per_stage to 1.")
    block = sequential.layers_stage(
        [("block", ResidualDenseBlock(expansion, normalization, blocks ** -0.5))])
    return Model((sequential.layers_stage([("stem", Stem(width))]),) + (block,) * blocks
                 + (sequential.layers_stage([("head", Head(num_classes, normalization))]),),
                 loss=loss)
  named = [("stem", Stem(width))]
  named += [(f"block{i + 1}", ResidualDenseBlock(expansion, normalization, blocks ** -0.5))
            for i in range(blocks)]
  named.append(("head", Head(num_classes, normalization)))
  return sequential.stack_layers(named, layers_per_stage, loss)
