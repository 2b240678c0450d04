"""Stability of pipelined momentum methods on the convex quadratic ``L(w) = ½ λ w²``.

On a one-dimensional quadratic every method of docs/design.md §3 is a *linear* recurrence in the
current weight, the momentum buffer and the few past weights (or velocities) a gradient delay
needs. Its companion matrix ``A`` maps the state of step ``t`` to the state of step ``t + 1``; the
spectral radius ``ρ(A)`` is the asymptotic convergence rate per step and ``ρ < 1`` is stability.
This module builds the matrices and reads the stability limits and best rates off them;
:mod:`pipejax.analysis.quadratic.simulation` steps each update rule itself, the independent check.

Conventions (heavy-ball momentum, ``η`` the learning rate, ``x = ηλ``):

* ``v_{t+1} = m v_t + g_t`` and ``w_{t+1} = w_t − η u_t``, with ``u_t = v_{t+1}`` for plain
  momentum.
* A gradient of delay ``D``: the gradient applied at step ``t`` was computed from the weights of
  step ``t − D``, ``g_t = λ ŵ_{t−D}``, where ``ŵ_s`` is the weight the *forward* pass sees at step
  ``s``. With one scalar weight the forward and backward see the same tensor, so weight
  inconsistency cannot arise here; only staleness (and what a method does about it) is modelled.
* Only ``x = ηλ`` matters: with ``V = η v`` the recurrence is ``V_{t+1} = m V_t + x ŵ_{t−D}``,
  ``w_{t+1} = w_t − (η u_t)``.

Methods (``T = D`` is the prediction horizon):

* ``sgd``: undelayed heavy ball, the unpipelined reference. It accepts and *ignores* ``delay`` so a
  table row for ``sgd`` at any ``D`` shows the ``D = 0`` baseline.
* ``pb``: plain delayed momentum, ``ŵ_s = w_s``.
* ``pb_sc``: Spike Compensation, ``u = a v_{t+1} + b g_t`` with ``a = m^D``,
  ``b = (1 − m^D)/(1 − m)``.
* ``pb_lwp``: Linear Weight Prediction, update form ``ŵ_s = w_s + T (w_s − w_{s−1})``, with plain
  momentum.
* ``pb_sc_lwp``: SC together with the update-form prediction: ``w_s − w_{s−1}`` is the last applied
  update, spike included.
* ``spectrain``: velocity-form prediction ``ŵ_s = w_s − η T v_s`` with plain momentum. Under plain
  momentum ``w_s − w_{s−1} = −η v_s``, so it has the same spectrum as ``pb_lwp`` (its companion
  matrix is built independently, over a velocity history, and the tests check the two agree).
* ``pipemare``: PipeMare's learning-rate rescheduling ``α_k τ^{−(1 − min(k/K, 1))}`` with
  ``τ = max(D, 1)`` analysed at its *start* value ``k = 0``: the step is ``η / τ``, and ``x`` is the
  *base* ``ηλ``. Its discrepancy correction changes only the backward's weights, which on a scalar
  quadratic are the forward's weights, so it drops out: PipeMare here is ``pb`` with ``x / τ``
  (and after annealing, ``k ≥ K``, it is exactly ``pb``). Its stable ``x`` is therefore ``τ`` times
  ``pb``'s, bought with a ``τ``-times smaller step.

Example:
  >>> from pipejax.analysis import quadratic
  >>> round(quadratic.max_stable_lr("pb", 0.0, 0), 6)  # heavy ball: 2(1 + m)
  2.0
  >>> round(quadratic.spectral_radius("pb", 0.1, 0.0, 0), 6)  # plain gradient descent: 1 - ηλ
  0.9

Reference: Kosson et al., "Pipelined Backpropagation at Scale: Training Large Models without
Batches", MLSys 2021 (arXiv 2003.11666), whose convex-quadratic analysis this reproduces.
"""

from __future__ import annotations

import functools
import math
from typing import Iterable, Sequence

import numpy as np

from pipejax import methods as methods_lib
from pipejax import optim

# Every preset whose preset gives its form on the quadratic (pipejax.methods.QuadraticForm).
FORMS = {name: preset.quadratic for name, preset in methods_lib.PRESETS.items()
         if preset.quadratic is not None}
METHODS = tuple(FORMS)
PIPELINE_METHODS = tuple(name for name, form in FORMS.items() if form.delayed)
# The unpipelined reference, the one method outside PIPELINE_METHODS.
REFERENCE = next(name for name, form in FORMS.items() if not form.delayed)

# The stability scan covers ηλ from _SCAN_MIN up; the smallest stable limit in the default table
# (pb at m = 0.999, D = 64) is ~1.6e-5, so 1e-8 leaves three decades of margin.
_SCAN_MIN = 1e-8
_SCAN_MAX = 16.0
_SCAN_CAP = 1e4
_POINTS_PER_DECADE = 24


# ----------------------------------------------------------------------------------------------
# Argument checks (the simulation's too).


def _check_method(method: str) -> None:
  if method not in METHODS:
    raise ValueError(f"Unknown method {method!r}; known methods: {', '.join(METHODS)}.")


def _check_momentum(momentum: float) -> None:
  if not (isinstance(momentum, (int, float, np.floating, np.integer))
          and 0.0 <= float(momentum) < 1.0):
    raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}.")


def _check_delay(delay: int) -> None:
  if isinstance(delay, bool) or not isinstance(delay, (int, np.integer)) or delay < 0:
    raise ValueError(f"delay must be a non-negative integer, got {delay!r}.")


def check_lr(lr_lambda: float, name: str = "lr_lambda") -> None:
  """Refuses an ``ηλ`` (or an ``η``, named ``name``) that is not a finite number > 0."""
  if not (isinstance(lr_lambda, (int, float, np.floating, np.integer))
          and math.isfinite(float(lr_lambda)) and float(lr_lambda) > 0.0):
    raise ValueError(f"{name} must be a finite number > 0, got {lr_lambda!r}.")


def check_arguments(method: str, momentum: float, delay: int) -> None:
  """Refuses an unknown method, a momentum outside ``[0, 1)`` or a delay that is not an int ≥ 0."""
  _check_method(method)
  _check_momentum(momentum)
  _check_delay(delay)


# ----------------------------------------------------------------------------------------------
# Per-method coefficients shared by the matrix and the simulation.


def effective_delay(method: str, delay: int) -> int:
  """The delay the method runs with: ``sgd`` is the unpipelined reference at every ``delay``."""
  return int(delay) if FORMS[method].delayed else 0


def lr_scale(method: str, delay: int) -> float:
  """Factor on the base ``ηλ``: PipeMare's ``τ^{-1}`` with ``τ = max(D, 1)``, else 1."""
  return 1.0 / max(delay, 1) if FORMS[method].rate_over_delay else 1.0


def _update_coefficients(method: str, momentum: float, delay: int) -> tuple[float, float]:
  """Returns ``(c_v, c_g)`` with ``u_t = c_v m v_t + c_g g_t`` (``u = a v_{t+1} + b g``)."""
  if FORMS[method].spike_compensated:
    a, b = optim.spike_coefficients(delay, float(momentum))
    return a, a + b
  return 1.0, 1.0


# ----------------------------------------------------------------------------------------------
# Companion matrices.


def _frozen(array: np.ndarray) -> np.ndarray:
  array.setflags(write=False)  # Cached and shared: a caller's in-place edit must fail loudly.
  return array


@functools.lru_cache(maxsize=512)
def _affine_parts(method: str, momentum: float, delay: int) -> tuple[np.ndarray, np.ndarray]:
  """Returns ``(A0, A1)`` with ``A(x) = A0 + x A1`` for the effective ``x`` (after lr scaling).

  Every method is affine in ``x = ηλ``, so a batch of matrices over a grid of ``x`` is one
  broadcast, and a batch of eigenvalue problems one LAPACK call.
  """
  d = delay
  t_horizon = d
  m = float(momentum)
  c_v, c_g = _update_coefficients(method, m, d)
  if FORMS[method].prediction == "next_velocity":
    # State: w_t … w_{t−D} (indices 0 … D), V_t … V_{t−D} (indices D+1 … 2D+1), V = ηv.
    n = 2 * d + 2
    a0 = np.zeros((n, n))
    a1 = np.zeros((n, n))
    v0 = d + 1
    # V_{t+1} = m V_t + x (w_{t−D} − T V_{t−D});  w_{t+1} = w_t − V_{t+1}.
    a0[v0, v0] += m
    a1[v0, d] += 1.0
    a1[v0, v0 + d] += -t_horizon
    a0[0, 0] += 1.0
    a0[0, v0] += -m
    a1[0, d] += -1.0
    a1[0, v0 + d] += t_horizon
    for k in range(1, d + 1):
      a0[k, k - 1] = 1.0
      a0[v0 + k, v0 + k - 1] = 1.0
    return _frozen(a0), _frozen(a1)

  predicts = FORMS[method].prediction == "update"
  # State: w_t … w_{t−D} (plus w_{t−D−1} when predicting from the last update), then V_t.
  n_w = d + 2 if predicts else d + 1
  n = n_w + 1
  iv = n_w
  a0 = np.zeros((n, n))
  a1 = np.zeros((n, n))
  # Forward-view weight of step t−D as a row over the state: ŵ = (1+T) w_{t−D} − T w_{t−D−1}.
  w_hat = np.zeros(n)
  if predicts:
    w_hat[d] += 1.0 + t_horizon
    w_hat[d + 1] += -t_horizon
  else:
    w_hat[d] += 1.0
  # V_{t+1} = m V_t + x ŵ.
  a0[iv, iv] = m
  a1[iv] += w_hat
  # w_{t+1} = w_t − (c_v m V_t + c_g x ŵ).
  a0[0, 0] += 1.0
  a0[0, iv] += -c_v * m
  a1[0] += -c_g * w_hat
  for k in range(1, n_w):
    a0[k, k - 1] = 1.0
  return _frozen(a0), _frozen(a1)


def gradient_column(method: str, momentum: float, delay: int) -> np.ndarray:
  """How an error in the gradient enters :func:`companion_matrix`'s state.

  An error ``ε`` added to the gradient of step ``t`` moves the state of step ``t + 1`` by
  ``η ε`` times this column: it enters where ``x ŵ`` does (the velocity with 1, the weight with
  minus the update's gradient coefficient, ``a + b`` under Spike Compensation), so that
  ``A(x) = A0 + x c rᵀ`` with ``c`` this column and ``rᵀ s`` the forward view ``ŵ``.
  ``delay`` is the effective one (:func:`effective_delay`).
  """
  a0, _ = _affine_parts(method, float(momentum), delay)
  column = np.zeros(a0.shape[0])
  if FORMS[method].prediction == "next_velocity":
    column[delay + 1], column[0] = 1.0, -1.0
  else:
    column[-1], column[0] = 1.0, -_update_coefficients(method, float(momentum), delay)[1]
  return column


def companion_matrix(method: str, lr_lambda: float, momentum: float, delay: int) -> np.ndarray:
  """Returns the matrix that maps a method's state at step ``t`` to step ``t + 1``.

  Args:
    method: one of :data:`METHODS`.
    lr_lambda: ``ηλ`` (> 0); for ``pipemare`` the *base* ``ηλ`` before its ``1/τ`` rescheduling.
    momentum: heavy-ball ``m`` in ``[0, 1)``.
    delay: gradient delay ``D`` (≥ 0); the prediction horizon is ``T = D``.

  Returns:
    A square float64 array. Its size is ``D + 2`` (``pb``, ``pb_sc``, ``pipemare``; state
    ``w_t … w_{t−D}, ηv_t``), ``D + 3`` for the update-form predictions (they also need
    ``w_{t−D−1}``), ``2D + 2`` for ``spectrain`` (weight and velocity histories) and 2 for ``sgd``.

  Raises:
    ValueError: on an unknown method or an argument out of range.
  """
  check_arguments(method, momentum, delay)
  check_lr(lr_lambda)
  d = effective_delay(method, delay)
  a0, a1 = _affine_parts(method, float(momentum), d)
  return a0 + float(lr_lambda) * lr_scale(method, d) * a1


def _spectral_radii(method: str, lr_lambdas: np.ndarray, momentum: float,
                    delay: int) -> np.ndarray:
  """Spectral radii over an array of ``ηλ`` (no argument checks; ``delay`` already effective)."""
  a0, a1 = _affine_parts(method, float(momentum), delay)
  x = np.asarray(lr_lambdas, dtype=np.float64) * lr_scale(method, delay)
  mats = a0[None] + x[:, None, None] * a1[None]
  return np.abs(np.linalg.eigvals(mats)).max(axis=-1)


def spectral_radius(method: str, lr_lambda: float, momentum: float, delay: int) -> float:
  """Returns ``ρ`` of :func:`companion_matrix`: the asymptotic per-step convergence factor."""
  check_arguments(method, momentum, delay)
  check_lr(lr_lambda)
  return float(spectral_radii(method, np.array([float(lr_lambda)]), momentum, delay)[0])


def spectral_radii(method: str, lr_lambdas: Sequence[float] | np.ndarray, momentum: float,
                   delay: int) -> np.ndarray:
  """:func:`spectral_radius` over a one-dimensional array of ``ηλ`` (one batched eigensolve).

  Raises:
    ValueError: on an unknown method, an argument out of range, or an ``ηλ`` that is not a
      finite number > 0.
  """
  check_arguments(method, momentum, delay)
  xs = np.asarray(lr_lambdas, dtype=np.float64)
  if xs.ndim != 1 or not np.all(np.isfinite(xs)) or np.any(xs <= 0):
    raise ValueError("lr_lambdas must be a one-dimensional sequence of finite numbers > 0, got "
                     f"shape {xs.shape}.")
  return _spectral_radii(method, xs, momentum, effective_delay(method, delay))


# ----------------------------------------------------------------------------------------------
# Stability limits and best rates.


@functools.lru_cache(maxsize=256)
def _scan(method: str, momentum: float, delay: int) -> tuple[np.ndarray, np.ndarray]:
  """``ρ`` on a log grid of ``ηλ`` reaching past the first unstable point (cached)."""
  lo, hi = _SCAN_MIN, _SCAN_MAX
  while True:
    num = int(round(math.log10(hi / lo) * _POINTS_PER_DECADE)) + 1
    xs = np.logspace(math.log10(lo), math.log10(hi), num)
    rhos = _spectral_radii(method, xs, momentum, delay)
    if rhos[0] >= 1.0 and lo > 1e-30:
      lo *= 1e-3  # Extreme delay or momentum: the stable interval lies below the default grid.
    elif np.all(rhos < 1.0) and hi < _SCAN_CAP:
      hi *= 8.0
    else:
      return xs, rhos


@functools.lru_cache(maxsize=256)
def _stability_edge(method: str, momentum: float, delay: int) -> tuple[float, bool]:
  """Returns (edge, stable_again): the end of the stable interval (0, edge), and whether the grid
  found another stable ηλ above it."""
  xs, rhos = _scan(method, momentum, delay)
  unstable = np.nonzero(rhos >= 1.0)[0]
  if unstable.size == 0:
    return math.inf, False
  i = int(unstable[0])
  if i == 0:
    return 0.0, bool(np.any(rhos < 1.0))
  stable_again = bool(np.any(rhos[i:] < 1.0))
  lo, hi = math.log(xs[i - 1]), math.log(xs[i])
  # Bisection on log ηλ: the predicate ρ < 1 is all that is trusted, not ρ's smoothness.
  while hi - lo > 1e-12:
    mid = 0.5 * (lo + hi)
    if _spectral_radii(method, np.array([math.exp(mid)]), momentum, delay)[0] < 1.0:
      lo = mid
    else:
      hi = mid
  return math.exp(lo), stable_again


def max_stable_lr(method: str, momentum: float, delay: int) -> float:
  """Returns the largest ``ηλ`` of the stable interval that starts at 0 (``ρ < 1`` below it).

  A log grid (24 points per decade from 1e-8 to 16, extended when needed) finds the first
  unstable ``ηλ``; bisection on ``log ηλ`` then pins the crossing to 1e-12 relative. Should ``ρ``
  dip below 1 again above that edge (a stable island), it is not counted: see
  ``stable_beyond_edge`` in :func:`stability_table` (never seen in the default table). For
  ``pipemare`` the value is the *base* ``ηλ``. Cost grows as ``D³`` per grid point: about 0.3 s
  at ``D = 64``, 25 s at ``D = 200``.
  """
  check_arguments(method, momentum, delay)
  return _stability_edge(method, float(momentum), effective_delay(method, delay))[0]


def largest_stable_delay(method: str, lr_lambda: float, momentum: float,
                         max_delay: int = 1024) -> int | None:
  """The largest delay ``D ≤ max_delay`` at which ``ηλ = lr_lambda`` is still stable (``ρ < 1``).

  What the quadratic says is a stage's limit at a given step size and curvature. The search
  doubles ``D`` until the first unstable one, then bisects between it and the last stable one:
  it assumes that a delay's stability implies every shorter delay's, which holds for the
  methods whose step does not shrink with the delay (checked on a grid in the tests); PipeMare's
  step is ``ηλ / D`` and its stable set need not be an interval, so it is refused here.

  Returns:
    The largest stable delay; ``-1`` when even ``D = 0`` is unstable; None when ``max_delay`` is
    stable too (no limit within it).

  Raises:
    ValueError: an unknown method, ``pipemare``, or an argument out of range.
  """
  check_arguments(method, momentum, max_delay)
  check_lr(lr_lambda)
  if FORMS[method].rate_over_delay:
    raise ValueError(f"largest_stable_delay assumes stability falls with the delay, which "
                     f"{method!r}'s step (divided by the delay) does not; ask spectral_radius at "
                     "each delay instead.")

  def stable(delay: int) -> bool:
    return spectral_radius(method, lr_lambda, momentum, delay) < 1.0

  if not stable(0):
    return -1
  good, bad = 0, 1
  while stable(bad):
    if bad >= max_delay:
      return None
    good, bad = bad, min(2 * bad, max_delay)
  while bad - good > 1:
    mid = (good + bad) // 2
    good, bad = (mid, bad) if stable(mid) else (good, mid)
  return good


def _golden_min(f, lo: float, hi: float, tol: float = 1e-9) -> tuple[float, float]:
  """Minimizes ``f`` on ``[lo, hi]`` by golden-section search; returns ``(x, f(x))``."""
  inv_phi = (math.sqrt(5.0) - 1.0) / 2.0
  a, b = lo, hi
  c = b - inv_phi * (b - a)
  d = a + inv_phi * (b - a)
  fc, fd = f(c), f(d)
  while b - a > tol:
    if fc <= fd:
      b, d, fd = d, c, fc
      c = b - inv_phi * (b - a)
      fc = f(c)
    else:
      a, c, fc = c, d, fd
      d = a + inv_phi * (b - a)
      fd = f(d)
  return (c, fc) if fc <= fd else (d, fd)


@functools.lru_cache(maxsize=256)
def _best_rate(method: str, momentum: float, delay: int) -> tuple[float, float]:
  xs, rhos = _scan(method, momentum, delay)
  i = int(np.argmin(rhos))
  lo = math.log(xs[max(i - 1, 0)])
  hi = math.log(xs[min(i + 1, xs.size - 1)])

  def rho_at(log_x):
    return float(_spectral_radii(method, np.array([math.exp(log_x)]), momentum, delay)[0])

  log_x, rho = _golden_min(rho_at, lo, hi)
  if rhos[i] < rho:  # ρ need not be unimodal between grid points; never report worse than seen.
    return float(rhos[i]), float(xs[i])
  return rho, math.exp(log_x)


def best_rate(method: str, momentum: float, delay: int) -> tuple[float, float]:
  """Returns ``(best_rho, argmin_lr_lambda)``: the fastest asymptotic rate over ``ηλ``.

  The minimum of ``ρ`` on the scan grid is refined by golden-section search on ``log ηλ`` between
  its grid neighbours. ``ρ`` can be flat at its minimum (heavy ball: ``ρ = √m`` for every
  ``ηλ ∈ [(1−√m)², (1+√m)²]``), so ``argmin`` is then one point of a set.
  """
  check_arguments(method, momentum, delay)
  return _best_rate(method, float(momentum), effective_delay(method, delay))


def stability_table(methods: Iterable[str] = PIPELINE_METHODS,
                    momenta: Sequence[float] = (0.9, 0.99, 0.999),
                    delays: Sequence[int] = (0, 1, 4, 16, 64)) -> list[dict]:
  """Returns one row per (method, momentum, delay).

  Each row has keys ``method, momentum, delay, max_stable_lr, best_rate`` and also ``best_lr``
  (the ``ηλ`` that attains ``best_rate``) and ``stable_beyond_edge`` (whether the scan found
  ``ρ < 1`` again above ``max_stable_lr``).
  """
  methods = list(methods)
  for method in methods:
    _check_method(method)
  for momentum in momenta:
    _check_momentum(momentum)
  for delay in delays:
    _check_delay(delay)
  rows = []
  for method in methods:
    for momentum in momenta:
      for delay in delays:
        d = effective_delay(method, delay)
        edge, again = _stability_edge(method, float(momentum), d)
        rho, x_best = _best_rate(method, float(momentum), d)
        rows.append({
            "method": method,
            "momentum": float(momentum),
            "delay": int(delay),
            "max_stable_lr": float(edge),
            "best_rate": float(rho),
            "best_lr": float(x_best),
            "stable_beyond_edge": again,
        })
  return rows
