"""Online Normalization (Chiley et al., "Online Normalization for Training Neural Networks",
NeurIPS 2019): a batch-independent normalizer that trains at micro-batch size 1.

Per feature (per channel for convolutions, over the spatial mean), one sample after another in
stream order, starting from mu = 0, sigma^2 = 1, u = v = 0:

* forward: ``y_t = (x_t - mu) / sqrt(sigma^2 + eps)`` with the statistics from *before* the
  sample; then ``sigma^2 <- a_f sigma^2 + (1 - a_f) var(x_t) + a_f (1 - a_f) (mean(x_t) - mu)^2``
  and ``mu <- mu + (1 - a_f) (mean(x_t) - mu)`` (mean and var over the spatial positions of the
  sample; var is 0 and mean(x_t) = x_t for dense features).
* backward: two control processes with decay ``a_b`` keep the gradient orthogonal to the output
  and to the constant, what the gradient through batch statistics would do over a batch:
  ``g = dy_t - (1 - a_b) v y_t``, ``v <- v + mean(g y_t)``, ``g <- g / sqrt(sigma^2_{t-1} + eps)``,
  ``dx_t = g - (1 - a_b) u``, ``u <- u + mean(dx_t)``.
* then a learned affine (gamma, beta) and an error-checking step: activation clamping to
  ``[-5, 5]`` (the default) or layer scaling ``y / sqrt(mean(y^2) + eps)`` over each sample.

Defaults as the paper's reference implementation gives them (public repository
Cerebras/online-normalization, ``online-norm/numpy/online-norm-1d.py`` and ``-2d.py`` and the
PyTorch module): ``alpha_fwd = 0.999``, ``alpha_bkw = 0.99``, ``eps = 1e-5``, clamping at 5. This
is an independent implementation in JAX from those equations.

**In a pipeline.** The running mean and variance are *forward* variables (collection
``online_stats``) and the control processes *backward* variables (collection
:data:`pipejax.core.stages.BACKWARD_COLLECTION`): the backward returns the control processes'
increments as the cotangent of ``u`` and ``v`` (see :mod:`pipejax.core.stages`). A micro-batch of b
samples is streamed in order, sample by sample, in both passes, as in the reference. Called with its
collections immutable (evaluation), the module normalizes with the running statistics and changes
nothing.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from pipejax.core.stages import BACKWARD_COLLECTION, ModelError

STATS_COLLECTION = "online_stats"
ERROR_CHECKS = ("clamp", "layer_scaling", None)


def _spatial_axes(x: jax.Array) -> tuple[int, ...]:
  """Axes between the sample axis and the feature axis (none for dense features)."""
  return tuple(range(1, x.ndim - 1))


def stream_statistics(x: jax.Array, mean: jax.Array, var: jax.Array, alpha: float):
  """The forward's statistics over a stream of samples ``x`` (axis 0), one sample at a time.

  Returns ``(centers, variances, mean, var)``: ``centers[t]`` and ``variances[t]`` are the
  statistics sample t is normalized with (those from before it), ``mean``/``var`` the ones after
  the last sample.
  """
  axes = _spatial_axes(x)
  sample_mean = jnp.mean(x, axis=axes) if axes else x
  sample_var = jnp.var(x, axis=axes) if axes else jnp.zeros_like(x)

  def step(carry, sample):
    mu, sigma2 = carry
    m, v = sample
    delta = m - mu
    sigma2_next = alpha * sigma2 + (1 - alpha) * v + alpha * (1 - alpha) * delta ** 2
    return (mu + (1 - alpha) * delta, sigma2_next), (mu, sigma2)

  (mean, var), (centers, variances) = jax.lax.scan(step, (mean, var), (sample_mean, sample_var))
  return centers, variances, mean, var


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def controlled_normalize(x, center, scale, u, v, alpha_bkw):
  """``(x - center) / scale`` per sample, whose backward runs the control processes.

  ``center`` and ``scale`` have shape (b, features), one row per sample of ``x``. The cotangents
  returned for ``u`` and ``v`` are the processes' increments over the micro-batch (the engine adds
  them); ``center`` and ``scale`` get none (they are statistics, not a function to differentiate).
  """
  del u, v, alpha_bkw
  return (x - _expand(center, x)) / _expand(scale, x)


def _expand(per_sample: jax.Array, x: jax.Array) -> jax.Array:
  return per_sample.reshape(per_sample.shape[:1] + (1,) * len(_spatial_axes(x))
                            + per_sample.shape[1:])


def _normalize_fwd(x, center, scale, u, v, alpha_bkw):
  y = controlled_normalize(x, center, scale, u, v, alpha_bkw)
  return y, (y, center, scale, u, v)


def _normalize_bwd(alpha_bkw, residuals, dy):
  y, center, scale, u0, v0 = residuals
  axes = tuple(a - 1 for a in _spatial_axes(y))  # spatial axes of one sample
  spatial_mean = (lambda a: jnp.mean(a, axis=axes)) if axes else (lambda a: a)
  leak = 1 - alpha_bkw

  def step(carry, sample):
    u, v = carry
    dy_t, y_t, scale_t = sample
    g = dy_t - leak * v * y_t  # v, u broadcast over spatial positions (feature axis last)
    v = v + spatial_mean(g * y_t)
    g = g / scale_t
    dx_t = g - leak * u
    u = u + spatial_mean(dx_t)
    return (u, v), dx_t

  (u, v), dx = jax.lax.scan(step, (u0, v0), (dy, y, _expand(scale, y)))
  zeros = jnp.zeros_like
  return dx, zeros(center), zeros(scale), u - u0, v - v0


controlled_normalize.defvjp(_normalize_fwd, _normalize_bwd)


def clamp(y: jax.Array, value: float) -> jax.Array:
  """Clips to ``[-value, value]``; the gradient is zero wherever the output sits on a bound."""
  return jnp.where(jnp.abs(y) < value, y, jax.lax.stop_gradient(jnp.clip(y, -value, value)))


def layer_scaling(y: jax.Array, eps: float) -> jax.Array:
  """Divides each sample by the root of its mean square over all its features and positions."""
  axes = tuple(range(1, y.ndim))
  return y / jnp.sqrt(jnp.mean(y * y, axis=axes, keepdims=True) + eps)


class OnlineNorm(nn.Module):
  """Online Normalization over the last (feature/channel) axis of (b, ..., features) inputs.

  Attributes:
    alpha_fwd: Decay of the running mean and variance.
    alpha_bkw: Decay of the backward control processes.
    epsilon: Added to the variance.
    affine: Learn a per-feature scale (init 1) and bias (init 0).
    error_check: 'clamp' (activation clamping, the reference default), 'layer_scaling' or None.
    clamp_value: Bound of the activation clamping.
    layer_scaling_epsilon: Added to the mean square in layer scaling.
  """

  alpha_fwd: float = 0.999
  alpha_bkw: float = 0.99
  epsilon: float = 1e-5
  affine: bool = True
  error_check: str | None = "clamp"
  clamp_value: float = 5.0
  layer_scaling_epsilon: float = 1e-5

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    if self.error_check not in ERROR_CHECKS:
      raise ModelError(f"OnlineNorm: error_check={self.error_check!r} is not one of "
                       f"{ERROR_CHECKS}.")
    features = x.shape[-1]
    shape = (features,)
    mean = self.variable(STATS_COLLECTION, "mean", jnp.zeros, shape, jnp.float32)
    var = self.variable(STATS_COLLECTION, "var", jnp.ones, shape, jnp.float32)
    u = self.variable(BACKWARD_COLLECTION, "u", jnp.zeros, shape, jnp.float32)
    v = self.variable(BACKWARD_COLLECTION, "v", jnp.zeros, shape, jnp.float32)
    x32 = x.astype(jnp.float32)
    if self.is_mutable_collection(STATS_COLLECTION) and not self.is_initializing():
      centers, variances, mean.value, var.value = stream_statistics(
          jax.lax.stop_gradient(x32), mean.value, var.value, self.alpha_fwd)
      y = controlled_normalize(x32, centers, jnp.sqrt(variances + self.epsilon), u.value,
                               v.value, self.alpha_bkw)
    else:  # initialization and evaluation: the running statistics, unchanged
      y = (x32 - mean.value) / jnp.sqrt(var.value + self.epsilon)
    if self.affine:
      y = y * self.param("scale", nn.initializers.ones, shape, jnp.float32)
      y = y + self.param("bias", nn.initializers.zeros, shape, jnp.float32)
    if self.error_check == "clamp":
      y = clamp(y, self.clamp_value)
    elif self.error_check == "layer_scaling":
      y = layer_scaling(y, self.layer_scaling_epsilon)
    return y.astype(x.dtype)
