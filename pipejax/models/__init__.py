"""Flax (linen) models split into pipeline stages, one weight layer per stage by default.

A builder lists the network's weight layers (each dense or conv layer with its normalization,
activation and pooling) and groups ``layers_per_stage`` consecutive ones into a
:class:`pipejax.Stage`. Residual blocks split over stages pass ``(h, shortcut)`` between them.

Example:
  >>> import jax.numpy as jnp
  >>> from pipejax import models
  >>> model = models.build('cifar_resnet20')  # 20 stages, GroupNorm, sliced conv on CPU.
  >>> rows = models.describe(model, jnp.zeros((1, 32, 32, 3)))
  >>> rows[1]['name'], rows[1]['output_shape']
  ('res1_1_conv1', ((1, 32, 32, 16), (1, 32, 32, 16)))
"""

from pipejax.models.blocks import ConvLayer, DenseLayer, ResidualConvLayer
from pipejax.models.cnn import VGG_CONFIGS, small_cnn, vgg
from pipejax.models.layers import SlicedConv, max_pool, resolve_conv_impl
from pipejax.models.perceptron import mlp
from pipejax.models.registry import build, describe, names
from pipejax.models.resnet import cifar_resnet, resnet50
from pipejax.models.sequential import Chain, merge_stage_params, split_layer_params, stack_layers

__all__ = [
    "Chain", "ConvLayer", "DenseLayer", "ResidualConvLayer", "SlicedConv", "VGG_CONFIGS",
    "build", "cifar_resnet", "describe", "max_pool", "merge_stage_params", "mlp", "names",
    "resnet50", "resolve_conv_impl", "small_cnn", "split_layer_params", "stack_layers", "vgg",
]
