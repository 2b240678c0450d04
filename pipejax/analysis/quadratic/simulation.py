"""The update rules of :mod:`pipejax.analysis.quadratic`, stepped directly: its independent check.

Each method's rule (docs/design.md §3, in the conventions of :mod:`pipejax.analysis.quadratic`) is
stepped with explicit histories of weights and velocities, never through the companion matrix, so
the rate it measures (:func:`simulated_rate`) is a second route to the spectral radius. The same
rule on a vector of independent coordinates gives the loss curve of a run on a spectrum of
curvatures (:func:`multi_dim_losses`). Only the argument checks and the per-method constants
(which methods compensate, predict or rescale, and the delay they run with) come from
:mod:`pipejax.analysis.quadratic`.

Example:
  >>> from pipejax.analysis import quadratic
  >>> from pipejax.analysis.quadratic import simulation
  >>> rho = quadratic.spectral_radius("pb_sc", 0.05, 0.9, 4)
  >>> abs(simulation.simulated_rate("pb_sc", 0.05, 0.9, 4) - rho) < 1e-3
  True
"""

from __future__ import annotations

import collections
import math
from typing import Sequence

import numpy as np

from pipejax import optim
from pipejax.analysis import quadratic
from pipejax.analysis.quadratic import noise as quadratic_noise


class _Recurrence:
  """The method's update rule, stepped directly with explicit histories.

  Works on scalars or on numpy arrays of independent coordinates (one per curvature). Nothing here
  uses the companion matrix: it is the second, independent route to the same rate.
  """

  def __init__(self, method, curvature, lr, momentum, delay, weight_history, velocity_history):
    self.method = method
    self.delay = quadratic.effective_delay(method, delay)
    self.horizon = self.delay
    self.curvature = curvature
    self.lr = lr * quadratic.lr_scale(method, self.delay)
    self.momentum = float(momentum)
    self.sc_a, self.sc_b = (optim.spike_coefficients(self.delay, float(momentum))
                            if quadratic.FORMS[method].spike_compensated else (1.0, 0.0))
    # weights[-1] is w_t, weights[-1 - k] is w_{t−k}; D + 2 entries cover w_{t−D−1}.
    self.weights = collections.deque(weight_history, maxlen=self.delay + 2)
    # velocities[-1] is v_t (the velocity that produced w_t); spectrain needs v_{t−D}.
    self.velocities = collections.deque(velocity_history, maxlen=self.delay + 1)

  def forward_view(self):
    """The weights the forward pass of step ``t − D`` saw (its gradient arrives now)."""
    d = self.delay
    w_old = self.weights[-1 - d]
    prediction = quadratic.FORMS[self.method].prediction
    if prediction == "update":
      # T times the last applied update (spike included under SC).
      return w_old + self.horizon * (w_old - self.weights[-2 - d])
    if prediction == "next_velocity":
      return w_old - self.lr * self.horizon * self.velocities[-1 - d]
    return w_old

  def step(self, gradient_available=True, noise=None):
    gradient = self.curvature * self.forward_view()
    if noise is not None:  # one sample's gradient: the mean's plus its own error
      gradient = gradient + noise
    if not gradient_available:
      gradient = 0.0 * gradient
    velocity = self.momentum * self.velocities[-1] + gradient
    if quadratic.FORMS[self.method].spike_compensated:
      update = self.sc_a * velocity + self.sc_b * gradient
    else:
      update = velocity
    self.weights.append(self.weights[-1] - self.lr * update)
    self.velocities.append(velocity)

  def state_sq_norm(self):
    if np.ndim(self.curvature) == 0:  # Plain floats: ~20x faster than numpy on scalars.
      return (sum(w * w for w in self.weights)
              + self.lr * self.lr * sum(v * v for v in self.velocities))
    total = 0.0
    for w in self.weights:
      total += float(np.sum(np.square(w)))
    for v in self.velocities:
      total += float(np.sum(np.square(self.lr * v)))
    return total

  def rescale(self, factor):
    # The recurrence is linear, so scaling every stored value keeps the trajectory's shape.
    self.weights = collections.deque((w * factor for w in self.weights), maxlen=self.weights.maxlen)
    self.velocities = collections.deque((v * factor for v in self.velocities),
                                        maxlen=self.velocities.maxlen)


def simulated_rate(method: str, lr_lambda: float, momentum: float, delay: int,
                   steps: int | None = None, seed: int = 0) -> float:
  """Estimates the asymptotic decay rate by running the update rule itself.

  Starts from a random (generic) history of weights and velocities, steps the recurrence with
  ``λ = 1``, ``η = lr_lambda``, and fits the slope of ``log ‖state‖`` over the second half of the
  run (a geometric mean of the per-step factors, which averages out the oscillation of complex
  eigenvalue pairs). The state is rescaled whenever it grows or shrinks by 1e100, so unstable and
  fast-converging cases stay finite.

  Args:
    method: one of :data:`~pipejax.analysis.quadratic.METHODS`.
    lr_lambda: ``ηλ`` (> 0).
    momentum: ``m`` in ``[0, 1)``.
    delay: ``D`` (≥ 0).
    steps: number of steps; by default ``max(4000, 100 (D + 2))``. Near-degenerate cases (two
      eigenvalues of almost equal modulus, or a double root) converge slowly and need more.
    seed: seed of the random start.

  Returns:
    The estimated ``ρ``; it agrees with :func:`~pipejax.analysis.quadratic.spectral_radius`.
  """
  quadratic.check_arguments(method, momentum, delay)
  quadratic.check_lr(lr_lambda)
  d = quadratic.effective_delay(method, delay)
  if steps is None:
    steps = max(4000, 100 * (d + 2))
  if steps < 10:
    raise ValueError(f"steps must be at least 10, got {steps}.")
  rng = np.random.default_rng(seed)
  lr = float(lr_lambda)
  rec = _Recurrence(method, 1.0, lr, momentum, d,
                    weight_history=rng.standard_normal(d + 2).tolist(),
                    velocity_history=(rng.standard_normal(d + 1) / lr).tolist())
  log_norms = np.empty(steps)
  log_scale = 0.0
  for t in range(steps):
    rec.step()
    sq = rec.state_sq_norm()
    if sq == 0.0:
      return 0.0  # Nilpotent case (finite-time convergence): ρ = 0.
    log_norms[t] = 0.5 * math.log(sq) + log_scale
    if not 1e-100 < sq < 1e100:
      factor = 1.0 / math.sqrt(sq)
      rec.rescale(factor)
      log_scale -= math.log(factor)
  tail = np.arange(steps // 2, steps)
  slope = np.polyfit(tail, log_norms[tail], 1)[0]
  return float(math.exp(slope))


def multi_dim_losses(method: str, curvatures: Sequence[float] | np.ndarray, lr: float,
                     momentum: float, delay: int, steps: int, noise: float = 0.0,
                     seed: int = 0) -> np.ndarray:
  """Loss against step on ``L(w) = ½ Σ_i λ_i w_i²`` (a spectrum of curvatures).

  Coordinates decouple, so this steps the same update rule as :func:`simulated_rate` on a vector.
  The run starts as a pipeline does: all weights 1, zero momentum, and during the fill (steps
  ``t < D``) no gradient has come back yet, so the update is zero (docs/design.md §2.5).

  With ``noise`` > 0 each gradient is one sample's: the mean gradient ``λ_i ŵ_i`` plus
  independent Gaussian errors of variance ``noise`` a coordinate and step, drawn from ``seed``.
  At 0 nothing is drawn, and the losses are those of the noiseless rule.

  Args:
    method: one of :data:`~pipejax.analysis.quadratic.METHODS`.
    curvatures: the ``λ_i`` (> 0), e.g. ``np.logspace(-3, 0, 32)``.
    lr: ``η`` (> 0); ``ηλ_i`` is each coordinate's ``lr_lambda``.
    momentum: ``m`` in ``[0, 1)``.
    delay: ``D`` (≥ 0).
    steps: number of steps.
    noise: the variance ``σ²`` of the gradient's error (≥ 0).
    seed: seeds the errors.

  Returns:
    Array of ``steps + 1`` losses (index 0 is the start); ``inf`` from the first overflow on.
  """
  quadratic.check_arguments(method, momentum, delay)
  quadratic.check_lr(lr, "lr")
  quadratic_noise.check_noise(noise)
  lam = np.asarray(curvatures, dtype=np.float64).reshape(-1)
  if lam.size == 0 or not np.all(np.isfinite(lam)) or np.any(lam <= 0):
    raise ValueError("curvatures must be a non-empty sequence of finite numbers > 0.")
  if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
    raise ValueError(f"steps must be a non-negative integer, got {steps!r}.")
  d = quadratic.effective_delay(method, delay)
  ones = np.ones_like(lam)
  rec = _Recurrence(method, lam, float(lr), momentum, d,
                    weight_history=[ones] * (d + 2),
                    velocity_history=[np.zeros_like(lam)] * (d + 1))
  losses = np.full(steps + 1, np.inf)
  losses[0] = 0.5 * float(np.sum(lam))
  rng, sigma = np.random.default_rng(seed), math.sqrt(noise)
  with np.errstate(over="ignore", invalid="ignore"):
    for t in range(steps):
      rec.step(gradient_available=t >= d,
               noise=sigma * rng.standard_normal(lam.shape) if noise else None)
      loss = 0.5 * float(np.sum(lam * np.square(rec.weights[-1])))
      if not math.isfinite(loss) or loss > 1e150:
        break
      losses[t + 1] = loss
  return losses


def simulated_excess_loss(method: str, lr_lambda: float, momentum: float, delay: int,
                          noise: float, steps: int = 4000, chains: int = 256,
                          seed: int = 0) -> tuple[float, float]:
  """The stationary excess loss under gradient noise, measured by stepping the rule.

  ``chains`` independent runs on ``L(w) = ½ w²`` (``λ = 1``, so ``η = lr_lambda``) start at the
  minimum with zero momentum; each gradient carries a Gaussian error of variance ``noise``
  (:func:`multi_dim_losses`). The mean loss over the chains and the second half of the steps is
  the excess loss ``½ E[w²]`` the noise keeps the run at; with ``λ ≠ 1`` the same number is the
  excess loss for a noise variance of ``noise · λ`` (only ``ηλ`` and ``σ²/λ`` matter).

  Args:
    method: one of :data:`~pipejax.analysis.quadratic.METHODS`.
    lr_lambda: ``ηλ`` (> 0).
    momentum: ``m`` in ``[0, 1)``.
    delay: ``D`` (≥ 0).
    noise: ``σ² / λ``, the error's variance over the curvature (≥ 0).
    steps: steps a chain; the first half is the burn-in.
    chains: independent runs.
    seed: seeds the errors.

  Returns:
    ``(mean, standard error)``; the error is over the chains, whose time averages are
    independent. ``(inf, inf)`` when the rule is unstable at ``lr_lambda``.
  """
  quadratic.check_arguments(method, momentum, delay)
  quadratic.check_lr(lr_lambda)
  quadratic_noise.check_noise(noise)
  if steps < 4 or chains < 2:
    raise ValueError(f"steps must be at least 4 and chains at least 2, got {steps} and {chains}.")
  d = quadratic.effective_delay(method, delay)
  zeros = np.zeros(chains)
  rec = _Recurrence(method, np.ones(chains), float(lr_lambda), momentum, d,
                    weight_history=[zeros] * (d + 2), velocity_history=[zeros] * (d + 1))
  rng, sigma = np.random.default_rng(seed), math.sqrt(noise)
  totals = np.zeros(chains)
  with np.errstate(over="ignore", invalid="ignore"):
    for t in range(steps):
      rec.step(noise=sigma * rng.standard_normal(chains))
      if t >= steps // 2:
        totals += 0.5 * np.square(rec.weights[-1])
  per_chain = totals / (steps - steps // 2)
  if not np.all(np.isfinite(per_chain)) or quadratic.spectral_radius(
      method, lr_lambda, momentum, delay) >= 1.0:
    return math.inf, math.inf
  return float(per_chain.mean()), float(per_chain.std(ddof=1) / math.sqrt(chains))
