"""Residual networks whose blocks are split over stages: CIFAR ResNets and ResNet-50.

Every convolution is one weight layer, so at ``layers_per_stage=1`` a residual block spans two
(basic) or three (bottleneck) stages and the shortcut crosses stage boundaries as the second half
of an ``(h, shortcut)`` pytree (see :mod:`pipejax.models.blocks`). Layer names:
'stem', 'res{group}_{block}_conv{k}' (groups and blocks count from 1), 'head'.
"""

from __future__ import annotations

from typing import Sequence

from pipejax.models import blocks, layers, sequential
from pipejax.core.stages import LossFn, Model, ModelError, softmax_cross_entropy

_CONV_NORMALIZATIONS = (None, "group", "layer", "online")
RESNET50_BLOCKS = (3, 4, 6, 3)


def _check_common(normalization: str | None, conv_impl: str, shortcut: str) -> None:
  layers.check_normalization(normalization, allowed=_CONV_NORMALIZATIONS)
  layers.resolve_conv_impl(conv_impl)  # Fail early on a misspelt conv_impl.
  if shortcut not in blocks.SHORTCUTS:
    raise ModelError(f"shortcut={shortcut!r} is not one of {blocks.SHORTCUTS}.")


def cifar_resnet_layers(depth: int = 20, width: int = 16, num_classes: int = 10,
                        normalization: str | None = "group", norm_groups: int = 8,
                        shortcut: str = "projection", conv_impl: str = "auto") -> list:
  """The named weight layers of :func:`cifar_resnet` (see there), before grouping."""
  _check_common(normalization, conv_impl, shortcut)
  if not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
    raise ModelError(f"A CIFAR ResNet has depth 6n + 2 (20, 32, 44, 56, 110; 8 for tests), "
                     f"got {depth!r}.")
  blocks_per_group = (depth - 2) // 6
  common = dict(normalization=normalization, norm_groups=norm_groups, conv_impl=conv_impl)
  named = [("stem", blocks.ConvLayer(width, **common))]
  for group in range(1, 4):
    features = width * 2 ** (group - 1)
    for block in range(1, blocks_per_group + 1):
      stride = 2 if group > 1 and block == 1 else 1
      named.append((f"res{group}_{block}_conv1", blocks.ResidualConvLayer(
          "first", features, strides=stride, **common)))
      named.append((f"res{group}_{block}_conv2", blocks.ResidualConvLayer(
          "last", features, block_strides=stride, shortcut=shortcut, **common)))
  named.append(("head", blocks.DenseLayer(num_classes, activation=None, global_pool=True)))
  return named


def cifar_resnet(depth: int = 20, width: int = 16, num_classes: int = 10,
                 layers_per_stage: int | None = 1, normalization: str | None = "group",
                 norm_groups: int = 8, shortcut: str = "projection", conv_impl: str = "auto",
                 loss: LossFn = softmax_cross_entropy) -> Model:
  """He et al.'s CIFAR ResNet (depth 6n + 2) with GroupNorm, one conv per stage by default.

  A 3x3 stem conv, three groups of n basic blocks (two 3x3 convs; widths w, 2w, 4w; the first
  block of groups 2 and 3 has stride 2), global average pooling and a dense head. Weight
  layers: depth (1 stem + 6n convs + 1 dense), so ResNet-20 is 20 stages at
  ``layers_per_stage=1``.

  Args:
    depth: 20, 32, 44, 56 or 110 (any 6n + 2 >= 8; 8 is a one-block-per-group test variant).
    width: Channels of the first group (16 in the paper; e.g. 4 for tests).
    num_classes: Number of logits.
    layers_per_stage: Consecutive weight layers per stage (None: one stage); blocks may straddle
      stages.
    normalization: 'group' (default), 'layer', 'online' or None; 'batch' raises
      :class:`pipejax.ModelError`.
    norm_groups: GroupNorm groups; ``gcd(norm_groups, channels)`` are used.
    shortcut: 'projection' (1x1 conv + norm where the shape changes; option B) or 'pad'
      (subsample and zero-pad channels; option A, the original CIFAR ResNet's choice).
    conv_impl: 'auto' (sliced on CPU, XLA elsewhere), 'xla' or 'sliced'.
    loss: Loss on the logits.
  """
  return sequential.stack_layers(
      cifar_resnet_layers(depth, width, num_classes, normalization, norm_groups, shortcut,
                          conv_impl), layers_per_stage, loss)


def resnet50_layers(num_classes: int = 1000, width: int = 64,
                    blocks_per_group: Sequence[int] = RESNET50_BLOCKS,
                    normalization: str | None = "group", norm_groups: int = 32,
                    shortcut: str = "projection", conv_impl: str = "auto") -> list:
  """The named weight layers of :func:`resnet50` (see there), before grouping."""
  _check_common(normalization, conv_impl, shortcut)
  if not blocks_per_group or any(not isinstance(n, int) or n < 1 for n in blocks_per_group):
    raise ModelError(f"blocks_per_group must be positive ints, got {blocks_per_group!r}.")
  common = dict(normalization=normalization, norm_groups=norm_groups, conv_impl=conv_impl)
  named = [("stem", blocks.ConvLayer(width, kernel_size=7, strides=2, pool_window=3,
                                     pool_stride=2, pool_padding="SAME", **common))]
  for group, num_blocks in enumerate(blocks_per_group, start=1):
    features = width * 2 ** (group - 1)
    for block in range(1, num_blocks + 1):
      # ResNet v1.5: the stride sits in the 3x3 conv, not in the first 1x1.
      stride = 2 if group > 1 and block == 1 else 1
      prefix = f"res{group}_{block}"
      named.append((f"{prefix}_conv1", blocks.ResidualConvLayer(
          "first", features, kernel_size=1, **common)))
      named.append((f"{prefix}_conv2", blocks.ResidualConvLayer(
          "middle", features, kernel_size=3, strides=stride, **common)))
      named.append((f"{prefix}_conv3", blocks.ResidualConvLayer(
          "last", 4 * features, kernel_size=1, block_strides=stride, shortcut=shortcut,
          **common)))
  named.append(("head", blocks.DenseLayer(num_classes, activation=None, global_pool=True)))
  return named


def resnet50(num_classes: int = 1000, width: int = 64,
             blocks_per_group: Sequence[int] = RESNET50_BLOCKS, layers_per_stage: int | None = 1,
             normalization: str | None = "group", norm_groups: int = 32,
             shortcut: str = "projection", conv_impl: str = "auto",
             loss: LossFn = softmax_cross_entropy) -> Model:
  """ResNet-50 (v1.5, bottleneck blocks) with GroupNorm, one conv per stage by default.

  7x7/2 stem conv with 3x3/2 max pool, four groups of bottleneck blocks (1x1, 3x3, 1x1 x4;
  widths w, 2w, 4w, 8w), global average pooling and a dense head: 50 weight layers, so 50
  stages at ``layers_per_stage=1``. The projection shortcuts (first block of each group) live
  in the block's last stage.

  Args:
    num_classes: Number of logits.
    width: Bottleneck width of the first group (64; e.g. 4 for tests).
    blocks_per_group: Blocks per group ((3, 4, 6, 3); e.g. (1, 1) for tests).
    layers_per_stage: Consecutive weight layers per stage (None: one stage); blocks may straddle
      stages.
    normalization: 'group' (default), 'layer', 'online' or None; 'batch' raises
      :class:`pipejax.ModelError`.
    norm_groups: GroupNorm groups (32, Wu & He); ``gcd(norm_groups, channels)`` are used.
    shortcut: 'projection' (default) or 'pad' (see :func:`cifar_resnet`).
    conv_impl: 'auto' (sliced on CPU, XLA elsewhere), 'xla' or 'sliced'.
    loss: Loss on the logits.
  """
  return sequential.stack_layers(
      resnet50_layers(num_classes, width, blocks_per_group, normalization, norm_groups,
                      shortcut, conv_impl), layers_per_stage, loss)
