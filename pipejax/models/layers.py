"""Layers the model builders share: a CPU-fast convolution, pooling and normalization choices.

Why a second convolution: on XLA:CPU the backward pass of ``lax.conv_general_dilated`` inside a
``lax.scan`` (where the pipeline's tick loop lives) runs 20-40x slower than the same computation
outside a loop (jax-ml/jax#12868, docs/design.md §9). :class:`SlicedConv` computes the same
convolution as shifted slices of the padded input concatenated along channels (im2col) followed
by one matmul, which XLA:CPU runs fast everywhere. It keeps ``flax.linen.Conv``'s parameter layout
(``kernel`` of shape (kh, kw, cin, cout), ``bias`` of shape (cout,)), so the two are
interchangeable and parameters move between them unchanged.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from jax import lax

from pipejax.models import online_norm
from pipejax.core.stages import ModelError

CONV_IMPLS = ("auto", "xla", "sliced")
_BATCH_NORM_MESSAGE = (
    "normalization='batch' (BatchNorm) cannot be used in a pipelined model. pipejax trains at "
    "micro-batch size 1 (the fine-grained setting of Kosson et al.), and BatchNorm statistics "
    "over a batch of one sample are degenerate: a dense layer's normalized output is identically "
    "zero, a conv layer's turns into instance normalization and no longer matches evaluation. "
    "Use normalization='online' (Online Normalization, Chiley et al. 2019: BatchNorm's "
    "statistics kept as running averages over the stream of samples, with a backward that keeps "
    "the gradient orthogonal to them; made for batch 1), or 'group' (GroupNorm) or 'layer' "
    "(LayerNorm), which normalize each sample on its own.")


def resolve_conv_impl(conv_impl: str) -> str:
  """Returns 'sliced' or 'xla' for ``conv_impl`` in ('auto', 'xla', 'sliced').

  'auto' picks 'sliced' on the CPU backend (fast conv backprop inside ``lax.scan``) and XLA's
  built-in convolution elsewhere (GPU/TPU run it fast and im2col would only cost memory).
  """
  if conv_impl not in CONV_IMPLS:
    raise ModelError(f"conv_impl={conv_impl!r} is not one of {CONV_IMPLS}.")
  if conv_impl == "auto":
    return "sliced" if jax.default_backend() == "cpu" else "xla"
  return conv_impl


def conv_class(conv_impl: str) -> type[nn.Module]:
  """The convolution module for ``conv_impl``: :class:`SlicedConv` or ``flax.linen.Conv``."""
  return SlicedConv if resolve_conv_impl(conv_impl) == "sliced" else nn.Conv


def check_normalization(normalization: str | None, allowed: Sequence[str | None]) -> None:
  """Raises :class:`ModelError` for an unknown normalization or for BatchNorm.

  The check lives in the builders so that the error names the real reason before anything is
  initialized.
  """
  if normalization == "batch":
    raise ModelError(_BATCH_NORM_MESSAGE)
  if normalization not in allowed:
    raise ModelError(f"normalization={normalization!r} is not one of {tuple(allowed)}.")


def conv_norm(normalization: str | None, channels: int, groups: int, name: str) -> nn.Module | None:
  """The normalization after a conv layer with ``channels`` outputs (None for no normalization).

  'group' uses ``gcd(groups, channels)`` groups, so narrow test variants stay valid; 'layer' is
  GroupNorm with one group, i.e. LayerNorm over (H, W, C) of each sample (Wu & He, 2018);
  'online' is Online Normalization per channel (a stage with state).
  """
  if normalization is None:
    return None
  if normalization == "online":
    return online_norm.OnlineNorm(name=name)
  if normalization == "group":
    return nn.GroupNorm(num_groups=math.gcd(groups, channels), name=name)
  if normalization == "layer":
    return nn.GroupNorm(num_groups=1, name=name)
  raise ModelError(f"normalization={normalization!r} is not available for conv layers.")


def max_pool(x: jax.Array, window: int, stride: int, padding: str = "VALID") -> jax.Array:
  """Max pooling over H and W of an NHWC array, as an elementwise max of shifted slices.

  Equal to ``flax.linen.max_pool`` in value. Gradients equal too, except at ties inside a
  window, which ``jnp.maximum`` splits evenly where ``reduce_window`` gives all to one input;
  after a ReLU the common tie (zeros) gets no gradient either way. It avoids ``reduce_window``,
  whose gradient (select-and-scatter) is also slower inside ``lax.scan`` on XLA:CPU.
  """
  patches = _shifted_slices(x, (window, window), (stride, stride), padding, pad_value=-jnp.inf)
  out = patches[0]
  for patch in patches[1:]:
    out = jnp.maximum(out, patch)
  return out


def _shifted_slices(x: jax.Array, kernel_size: tuple[int, int], strides: tuple[int, int],
                    padding: Any, pad_value: float = 0.0) -> list[jax.Array]:
  """Pads NHWC ``x`` and returns the kh*kw strided windows' views, in (i, j) row-major order.

  Slice (i, j) holds, at output position (p, q), the input at (p*sh + i, q*sw + j) of the padded
  input: the term that kernel tap (i, j) multiplies. Concatenating them along channels gives the
  im2col matrix whose channel order (i, j, c) matches a row-major reshape of an HWIO kernel.
  """
  kh, kw = kernel_size
  sh, sw = strides
  if isinstance(padding, str):
    pads = lax.padtype_to_pads(x.shape[1:3], (kh, kw), (sh, sw), padding)
  elif isinstance(padding, int):
    pads = ((padding, padding),) * 2
  else:
    pads = tuple((p, p) if isinstance(p, int) else tuple(p) for p in padding)
  (top, bottom), (left, right) = pads
  # lax.pad (unlike jnp.pad) accepts negative padding, as lax.conv_general_dilated does.
  x = lax.pad(x, jnp.asarray(pad_value, x.dtype),
              ((0, 0, 0), (top, bottom, 0), (left, right, 0), (0, 0, 0)))
  batch, height, width, channels = x.shape
  out_h = (height - kh) // sh + 1
  out_w = (width - kw) // sw + 1
  if out_h <= 0 or out_w <= 0:
    raise ModelError(f"A {kh}x{kw} window does not fit the padded input {height}x{width}.")
  return [
      lax.slice(x, (0, i, j, 0), (batch, i + (out_h - 1) * sh + 1, j + (out_w - 1) * sw + 1,
                                  channels), (1, sh, sw, 1))
      for i in range(kh) for j in range(kw)
  ]


class SlicedConv(nn.Module):
  """2-D convolution as im2col by shifted slices plus one matmul; a drop-in for ``nn.Conv``.

  Same parameters (names, shapes, default initializers) and the same results as
  ``flax.linen.Conv`` for 2-D convolutions without dilation or feature groups, for 'SAME',
  'VALID' and explicit padding and any strides. Inputs are (*batch, H, W, C).

  Attributes:
    features: Number of output channels.
    kernel_size: (kh, kw), or one int for a square kernel.
    strides: (sh, sw), or one int.
    padding: 'SAME', 'VALID', an int, or ((top, bottom), (left, right)).
    use_bias: Whether to add a bias.
    dtype: Computation dtype (None: inferred from inputs and parameters, as in ``nn.Conv``).
    param_dtype: Parameter dtype.
    precision: Matmul precision.
    kernel_init: Kernel initializer (``nn.Conv``'s default).
    bias_init: Bias initializer (``nn.Conv``'s default).
  """

  features: int
  kernel_size: int | Sequence[int] = 3
  strides: int | Sequence[int] = 1
  padding: Any = "SAME"
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Callable[..., jax.Array] = nn.initializers.lecun_normal()
  bias_init: Callable[..., jax.Array] = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    kernel_size = _pair(self.kernel_size)
    strides = _pair(self.strides)
    if inputs.ndim < 4:
      raise ModelError(f"SlicedConv needs inputs of shape (*batch, H, W, C), got {inputs.shape}.")
    batch_shape = inputs.shape[:-3]
    x = inputs.reshape((-1,) + inputs.shape[-3:])
    in_features = x.shape[-1]
    kernel = self.param("kernel", self.kernel_init, kernel_size + (in_features, self.features),
                        self.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias else None)
    x, kernel, bias = promote_dtype(x, kernel, bias, dtype=self.dtype)
    patches = _shifted_slices(x, kernel_size, strides, self.padding)
    columns = patches[0] if len(patches) == 1 else jnp.concatenate(patches, axis=-1)
    y = jnp.matmul(columns, kernel.reshape(-1, self.features), precision=self.precision)
    if bias is not None:
      y = y + bias
    return y.reshape(batch_shape + y.shape[1:])


def _pair(value: int | Sequence[int]) -> tuple[int, int]:
  if isinstance(value, int):
    return (value, value)
  value = tuple(value)
  if len(value) != 2:
    raise ModelError(f"Expected one int or a pair for a 2-D convolution, got {value}.")
  return value
