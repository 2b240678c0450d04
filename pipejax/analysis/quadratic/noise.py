"""The excess loss gradient noise keeps each method at on the convex quadratic, in closed form.

A step's gradient is one sample's: the mean gradient ``λ ŵ`` plus an error of variance ``σ²``.
On ``L(w) = ½ λ w²`` every method of :mod:`pipejax.analysis.quadratic` is then a linear
recurrence ``s_{t+1} = A s_t + η ε_t c`` (``c``:
:func:`~pipejax.analysis.quadratic.gradient_column`), whose stationary covariance solves the
discrete Lyapunov equation ``Σ = A Σ Aᵀ + c cᵀ`` (per unit of ``η² σ²``). The excess loss is
``½ λ E[w²] = ½ x² (σ²/λ) Σ₀₀`` with ``x = ηλ``: only ``x`` and ``σ²/λ`` matter.
:func:`pipejax.analysis.quadratic.simulation.simulated_excess_loss` measures the same number by
stepping the rules, the independent check.

This is the suspected mechanism of the long-delay failures (issue 51): where ``D (1 − β)`` is
not small, Spike Compensation keeps ``β^D`` of the moment, so the applied step is close to one
sample's gradient, and linear prediction extrapolates that noisy step ``D`` times.
:func:`predicted_gap` is the quadratic's excess loss over the undelayed reference's, the curve a
phase diagram sets beside the studies' gaps against ``D_max (1 − β)``
(:func:`pipejax.analysis.quadratic.figures.plot_predicted_gap`).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import linalg

from pipejax.analysis import quadratic


def check_noise(noise: float) -> None:
  """Refuses a gradient noise's variance that is not a finite number ``>= 0``."""
  if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not (
      math.isfinite(noise) and noise >= 0):
    raise ValueError(f"noise must be a finite number >= 0 (the variance of the gradient's "
                     f"error), got {noise!r}.")


def stationary_excess_loss(method: str, lr_lambda: float, momentum: float, delay: int,
                           noise: float) -> float:
  """``½ λ E[w²]`` once the run has forgotten its start, under gradient noise.

  Args:
    method: one of :data:`~pipejax.analysis.quadratic.METHODS`.
    lr_lambda: ``ηλ`` (> 0); PipeMare's base, before its ``1/τ``.
    momentum: ``m`` in ``[0, 1)`` (Adam's ``b1`` at the rate :func:`~pipejax.analysis.
      depth_limits.step_curvature` gives).
    delay: ``D`` (≥ 0).
    noise: ``σ² / λ`` (≥ 0).

  Returns:
    The excess loss; ``inf`` where the method is unstable at ``lr_lambda`` (``ρ ≥ 1``).
  """
  check_noise(noise)
  a = quadratic.companion_matrix(method, lr_lambda, momentum, delay)
  if np.abs(np.linalg.eigvals(a)).max() >= 1.0:
    return math.inf
  d = quadratic.effective_delay(method, delay)
  c = quadratic.gradient_column(method, momentum, d)
  sigma = linalg.solve_discrete_lyapunov(a, np.outer(c, c))
  x = float(lr_lambda) * quadratic.lr_scale(method, d)
  return 0.5 * x * x * noise * float(sigma[0, 0])


def heavy_ball_excess_loss(lr_lambda: float, momentum: float, noise: float) -> float:
  """The undelayed reference's closed form: ``½ x (1 + m) (σ²/λ) / ((1 − m)(2(1 + m) − x))``.

  Heavy ball under noise is the AR(2) process ``w_{t+1} = (1 + m − x) w_t − m w_{t−1} − η ε_t``,
  whose variance is ``(1 − a₂) s² / ((1 + a₂)((1 − a₂)² − a₁²))`` with ``a₁ = 1 + m − x``,
  ``a₂ = −m``, ``s² = η² σ²``; and ``(1 + m)² − (1 + m − x)² = x (2(1 + m) − x)``. At ``m = 0``
  it is SGD's ``½ η σ² / (2 − ηλ)``. ``inf`` beyond the edge ``x ≥ 2(1 + m)``.
  """
  check_noise(noise)
  quadratic.check_arguments(quadratic.REFERENCE, momentum, 0)
  quadratic.check_lr(lr_lambda)
  x, m = float(lr_lambda), float(momentum)
  if x >= 2 * (1 + m):
    return math.inf
  return 0.5 * x * (1 + m) * noise / ((1 - m) * (2 * (1 + m) - x))


def predicted_gap(method: str, delay: int, momentum: float, lr_lambda: float,
                  noise: float) -> float:
  """The quadratic's prediction of a method's gap: its stationary excess loss under noise minus
  the undelayed reference's, at the same ``ηλ``, momentum and noise.

  Set beside a study's gaps against ``D_max (1 − β)`` (``delay`` the stem's ``D_max``): positive
  where the delay costs loss, ``inf`` where the method diverges.
  """
  own = stationary_excess_loss(method, lr_lambda, momentum, delay, noise)
  return own - heavy_ball_excess_loss(lr_lambda, momentum, noise)
