"""Weight layers: the units that pipeline stages are made of.

A **weight layer** is one dense or convolution layer together with its normalization, activation
and (optional) pooling; at ``layers_per_stage=1`` each is one pipeline stage, the fine-grained
setting of Kosson et al. A residual block of n convolutions is n weight layers whose stage
boundaries the shortcut crosses as part of a pytree:

- the block's first layer maps ``x`` to ``(h, x)``, carrying the block input forward;
- a middle layer (bottleneck blocks) maps ``(h, shortcut)`` to ``(h', shortcut)``;
- the last layer maps ``(h, shortcut)`` to ``act(norm(conv(h)) + project(shortcut))``. The
  projection (1x1 conv + norm, or option-A subsampling with zero channels) lives in this layer,
  the one that adds it, so it is not a weight layer of its own.

Each layer's parameters are a dict with fixed keys ('conv', 'norm', 'dense', 'proj_conv',
'proj_norm'); a stage's parameters are ``{layer_name: layer_params}``.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from pipejax.models import layers, online_norm
from pipejax.core.stages import ModelError

Activation = Callable[[jax.Array], jax.Array] | None
SHORTCUTS = ("projection", "pad")
ROLES = ("first", "middle", "last")


class DenseLayer(nn.Module):
  """Dense layer (+ LayerNorm + activation). Flattens all but the batch axis first.

  Attributes:
    features: Output width.
    normalization: None, 'layer' (LayerNorm over features) or 'online' (Online Normalization
      per feature). The builders map a conv net's 'group' to 'layer' for its dense layers.
    activation: Applied last; None for logits.
    global_pool: Average over H and W before the dense layer (ResNet heads).
  """

  features: int
  normalization: str | None = None
  activation: Activation = nn.relu
  global_pool: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    _expect_array(self, x)
    if self.global_pool:
      x = jnp.mean(x, axis=(1, 2))
    x = x.reshape(x.shape[0], -1)
    # A bias before a normalization is cancelled by its mean subtraction; the norm has its own.
    x = nn.Dense(self.features, use_bias=self.normalization is None, name="dense")(x)
    if self.normalization == "online":
      x = online_norm.OnlineNorm(name="norm")(x)
    elif self.normalization is not None:
      x = nn.LayerNorm(name="norm")(x)
    if self.activation is not None:
      x = self.activation(x)
    return x


class ConvLayer(nn.Module):
  """Conv (+ norm + activation + max pooling) on NHWC inputs.

  Attributes:
    features: Output channels.
    kernel_size: Square kernel size.
    strides: Convolution stride.
    normalization: None, 'group', 'layer' or 'online' (see :func:`layers.conv_norm`).
    norm_groups: GroupNorm groups (``gcd(norm_groups, features)`` are used).
    conv_impl: 'auto', 'xla' or 'sliced' (see :func:`layers.resolve_conv_impl`).
    activation: Applied after the normalization; None for none.
    pool_window: Max-pool window after the activation (0: no pooling).
    pool_stride: Max-pool stride.
    pool_padding: Max-pool padding ('VALID' or 'SAME').
  """

  features: int
  kernel_size: int = 3
  strides: int = 1
  normalization: str | None = "group"
  norm_groups: int = 8
  conv_impl: str = "auto"
  activation: Activation = nn.relu
  pool_window: int = 0
  pool_stride: int = 2
  pool_padding: str = "VALID"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    _expect_array(self, x)
    x = _conv_norm(self, x, self.features, self.kernel_size, self.strides, "")
    if self.activation is not None:
      x = self.activation(x)
    if self.pool_window:
      x = _max_pool(x, self.pool_window, self.pool_stride, self.pool_padding, self.conv_impl)
    return x


class ResidualConvLayer(nn.Module):
  """One conv layer of a residual block that may be split over several stages.

  Attributes:
    role: 'first' (x -> (h, x)), 'middle' ((h, s) -> (h', s)) or 'last'
      ((h, s) -> act(norm(conv(h)) + shortcut(s))).
    features: Output channels of this conv (for 'last': of the block).
    kernel_size: Square kernel size.
    strides: This conv's stride.
    block_strides: (role 'last') The block's total stride, which the shortcut must match.
    shortcut: (role 'last') How a shortcut whose shape differs from the output is matched:
      'projection' (1x1 conv with stride + norm; He et al.'s option B) or 'pad' (subsample
      and pad channels with zeros; option A, no parameters). Same shapes: identity.
    normalization: None, 'group', 'layer' or 'online'.
    norm_groups: GroupNorm groups (``gcd(norm_groups, features)`` are used).
    conv_impl: 'auto', 'xla' or 'sliced'.
    activation: Applied after the normalization ('last': after the addition).
  """

  role: str
  features: int
  kernel_size: int = 3
  strides: int = 1
  block_strides: int = 1
  shortcut: str = "projection"
  normalization: str | None = "group"
  norm_groups: int = 8
  conv_impl: str = "auto"
  activation: Activation = nn.relu

  @nn.compact
  def __call__(self, x: Any) -> Any:
    if self.role not in ROLES:
      raise ModelError(f"{self.name}: role={self.role!r} is not one of {ROLES}.")
    if self.role == "first":
      _expect_array(self, x)
      h, carried = x, x
    else:
      if not (isinstance(x, (tuple, list)) and len(x) == 2):
        raise ModelError(f"Layer '{self.name}' continues a residual block and takes (h, shortcut) "
                         f"from the previous layer, but got {jax.tree.map(jnp.shape, x)}.")
      h, carried = x
    h = _conv_norm(self, h, self.features, self.kernel_size, self.strides, "")
    if self.role != "last":
      if self.activation is not None:
        h = self.activation(h)
      return (h, carried)
    h = h + self._match_shortcut(carried, h.shape)
    return self.activation(h) if self.activation is not None else h

  def _match_shortcut(self, shortcut: jax.Array, out_shape: tuple[int, ...]) -> jax.Array:
    stride = self.block_strides
    if shortcut.shape == out_shape and stride == 1:
      return shortcut
    if self.shortcut == "projection":
      return _conv_norm(self, shortcut, out_shape[-1], 1, stride, "proj_")
    if self.shortcut == "pad":
      shortcut = shortcut[:, ::stride, ::stride, :]
      extra = out_shape[-1] - shortcut.shape[-1]
      if extra < 0:
        raise ModelError(f"{self.name}: shortcut='pad' cannot reduce channels "
                         f"({shortcut.shape[-1]} -> {out_shape[-1]}); use 'projection'.")
      return jnp.pad(shortcut, ((0, 0), (0, 0), (0, 0), (extra // 2, extra - extra // 2)))
    raise ModelError(f"{self.name}: shortcut={self.shortcut!r} is not one of {SHORTCUTS}.")


def _conv_norm(module: nn.Module, x: jax.Array, features: int, kernel_size: int, strides: int,
               prefix: str) -> jax.Array:
  """conv -> norm inside ``module``'s compact scope, parameters named '{prefix}conv/norm'."""
  conv = layers.conv_class(module.conv_impl)
  norm = layers.conv_norm(module.normalization, features, module.norm_groups, f"{prefix}norm")
  # A bias before a normalization is cancelled by its mean subtraction; the norm has its own.
  x = conv(features, (kernel_size, kernel_size), strides=strides, padding="SAME",
           use_bias=norm is None, name=f"{prefix}conv")(x)
  return norm(x) if norm is not None else x


def _max_pool(x: jax.Array, window: int, stride: int, padding: str, conv_impl: str) -> jax.Array:
  # reduce_window's gradient is slow inside lax.scan on XLA:CPU too, so pooling follows the conv
  # choice: the sliced form where convs are sliced, XLA's built-in elsewhere.
  if layers.resolve_conv_impl(conv_impl) == "sliced":
    return layers.max_pool(x, window, stride, padding)
  return nn.max_pool(x, (window, window), strides=(stride, stride), padding=padding)


def _expect_array(module: nn.Module, x: Any) -> None:
  if not hasattr(x, "shape"):
    raise ModelError(f"Layer '{module.name}' takes one array, but got "
                     f"{jax.tree.map(jnp.shape, x)}: a residual block was left unfinished "
                     "before it (its last layer must have role='last').")
