"""Plain convolutional nets: a small Fashion-MNIST CNN and VGG-style nets for CIFAR."""

from __future__ import annotations

from typing import Sequence

from pipejax.models import blocks, layers, sequential
from pipejax.core.stages import LossFn, Model, ModelError, softmax_cross_entropy

VGG_CONFIGS = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg13": (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"),
    "vgg19": (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
              512, 512, 512, 512, "M"),
}
"""Each VGG net's conv layers by name: a number is a 3x3 conv layer's output channels, and 'M' a
2x2 max pooling after the preceding conv layer (part of that layer's stage)."""
_CONV_NORMALIZATIONS = (None, "group", "layer", "online")


def conv_net_layers(config: Sequence[int | str], dense: Sequence[int], num_classes: int,
                    normalization: str | None, norm_groups: int, conv_impl: str) -> list:
  """Named weight layers of a plain conv net: 3x3 convs ('M': 2x2 max pool), then dense layers.

  Conv layers are 'conv1', 'conv2', ...; hidden dense layers 'fc1', ...; the logits 'head'.
  Dense layers use LayerNorm when ``normalization`` is 'group' or 'layer', Online Norm with
  'online'.
  """
  layers.check_normalization(normalization, allowed=_CONV_NORMALIZATIONS)
  layers.resolve_conv_impl(conv_impl)  # Fail early on a misspelt conv_impl.
  config = list(config)
  if not config or config[0] == "M":
    raise ModelError(f"A conv config must start with a width, got {config}.")
  named = []
  for i, item in enumerate(config):
    if item == "M":
      continue
    if not isinstance(item, int) or item < 1:
      raise ModelError(f"Conv config entries are positive widths or 'M', got {item!r}.")
    pool = 2 if i + 1 < len(config) and config[i + 1] == "M" else 0
    named.append((f"conv{len(named) + 1}", blocks.ConvLayer(
        item, normalization=normalization, norm_groups=norm_groups, conv_impl=conv_impl,
        pool_window=pool, pool_stride=2)))
  dense_norm = "layer" if normalization in ("group", "layer") else normalization
  named += [(f"fc{i + 1}", blocks.DenseLayer(width, normalization=dense_norm))
            for i, width in enumerate(dense)]
  named.append(("head", blocks.DenseLayer(num_classes, activation=None)))
  return named


def small_cnn(widths: Sequence[int] = (32, 64), dense: Sequence[int] = (128,),
              num_classes: int = 10, layers_per_stage: int | None = 1,
              normalization: str | None = "group", norm_groups: int = 8,
              conv_impl: str = "auto", loss: LossFn = softmax_cross_entropy) -> Model:
  """A small CNN for 28x28 images (Fashion-MNIST class, 91-93% test accuracy).

  Each conv is 3x3 'SAME' + GroupNorm + ReLU + 2x2 max pool; then the flattened features go
  through the dense layers. Defaults: conv32-conv64-fc128-head, 4 weight layers.

  Args:
    widths: Output channels of the conv layers (two or three for the usual net).
    dense: Widths of the hidden dense layers (with LayerNorm unless ``normalization`` is None).
    num_classes: Number of logits.
    layers_per_stage: Consecutive weight layers per stage (None: one stage, no pipeline).
    normalization: 'group' (default), 'layer' (GroupNorm with one group), 'online' or None. 'batch'
      raises :class:`pipejax.ModelError`.
    norm_groups: GroupNorm groups; ``gcd(norm_groups, channels)`` are used.
    conv_impl: 'auto' (sliced on CPU, XLA elsewhere), 'xla' or 'sliced'.
    loss: Loss on the logits.
  """
  config = []
  for width in widths:
    config += [width, "M"]
  return sequential.stack_layers(
      conv_net_layers(config, dense, num_classes, normalization, norm_groups, conv_impl),
      layers_per_stage, loss)


def vgg(config: str | Sequence[int | str] = "vgg11", dense: Sequence[int] = (),
        num_classes: int = 10, width_multiplier: float = 1.0, layers_per_stage: int | None = 1,
        normalization: str | None = "group", norm_groups: int = 8, conv_impl: str = "auto",
        loss: LossFn = softmax_cross_entropy) -> Model:
  """A VGG-style net for 32x32 images (CIFAR): 3x3 conv layers with max pools, then dense.

  As usual for CIFAR, after five pools the 1x1x512 features go straight to the logits
  (``dense=()``); VGG-11 is 8 conv layers + 1 dense = 9 weight layers.

  Args:
    config: A name in ``VGG_CONFIGS`` ('vgg11', 'vgg13', 'vgg16', 'vgg19') or a sequence of
      widths and 'M' (2x2 max pool after the preceding conv), e.g. ``(8, 'M', 16, 'M')`` for a
      tiny test variant.
    dense: Widths of hidden dense layers before the logits.
    num_classes: Number of logits.
    width_multiplier: Scales every conv width (rounded, at least 1), e.g. 1/8 for tests.
    layers_per_stage: Consecutive weight layers per stage (None: one stage, no pipeline).
    normalization: 'group' (default), 'layer', 'online' or None; 'batch' raises
      :class:`pipejax.ModelError`.
    norm_groups: GroupNorm groups; ``gcd(norm_groups, channels)`` are used.
    conv_impl: 'auto' (sliced on CPU, XLA elsewhere), 'xla' or 'sliced'.
    loss: Loss on the logits.
  """
  if isinstance(config, str):
    if config not in VGG_CONFIGS:
      raise ModelError(f"Unknown VGG config {config!r}; known: {sorted(VGG_CONFIGS)}.")
    config = VGG_CONFIGS[config]
  config = [max(1, round(item * width_multiplier)) if isinstance(item, int) else item
            for item in config]
  return sequential.stack_layers(
      conv_net_layers(config, dense, num_classes, normalization, norm_groups, conv_impl),
      layers_per_stage, loss)
