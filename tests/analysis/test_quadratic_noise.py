"""Gradient noise on the quadratic: the simulation's noise, its closed forms and the gap figure."""

import math
import os

import numpy as np
import pytest

from pipejax.analysis import quadratic
from pipejax.analysis.quadratic import figures as quadratic_figures
from pipejax.analysis.quadratic import noise as quadratic_noise
from pipejax.analysis.quadratic import simulation as quadratic_simulation


def test_zero_noise_leaves_the_losses_bit_identical_whatever_the_seed():
  args = ("pb_sc_lwp", np.logspace(-3, 0, 8), 5e-3, 0.99, 16, 300)
  plain = quadratic_simulation.multi_dim_losses(*args)
  for seed in (0, 7):
    assert np.array_equal(quadratic_simulation.multi_dim_losses(*args, noise=0.0, seed=seed),
                          plain)
  noisy = quadratic_simulation.multi_dim_losses(*args, noise=1e-2, seed=1)
  assert not np.array_equal(noisy, plain) and np.all(np.isfinite(noisy))
  assert np.array_equal(noisy, quadratic_simulation.multi_dim_losses(*args, noise=1e-2, seed=1))


@pytest.mark.parametrize("lr_lambda,momentum", [(0.3, 0.0), (0.05, 0.9), (0.01, 0.99)])
def test_noisy_heavy_ball_keeps_the_excess_loss_of_its_closed_form(lr_lambda, momentum):
  # Heavy ball, w_{t+1} = (1 + m − x) w_t − m w_{t−1} − η ε_t, is an AR(2) process of variance
  # (1 + m) η² σ² / ((1 − m) x (2(1 + m) − x)); at λ = 1 (η = x) the excess loss ½ E[w²] is
  # ½ x (1 + m) σ² / ((1 − m)(2(1 + m) − x)).
  noise = 2.0
  closed = 0.5 * lr_lambda * (1 + momentum) * noise / (
      (1 - momentum) * (2 * (1 + momentum) - lr_lambda))
  mean, error = quadratic_simulation.simulated_excess_loss(
      quadratic.REFERENCE, lr_lambda, momentum, 0, noise, steps=6000, chains=256)
  assert abs(mean - closed) < 4 * error and error < 0.03 * closed
  assert quadratic_noise.heavy_ball_excess_loss(lr_lambda, momentum, noise) == pytest.approx(
      closed, rel=1e-12)
  assert quadratic_noise.stationary_excess_loss(
      quadratic.REFERENCE, lr_lambda, momentum, 7, noise) == pytest.approx(closed, rel=1e-9)


@pytest.mark.parametrize("method", quadratic.PIPELINE_METHODS)
def test_each_delayed_methods_lyapunov_excess_loss_is_what_its_rule_keeps(method):
  lr_lambda, momentum, delay, noise = 0.002, 0.99, 10, 1.0
  predicted = quadratic_noise.stationary_excess_loss(method, lr_lambda, momentum, delay, noise)
  mean, error = quadratic_simulation.simulated_excess_loss(method, lr_lambda, momentum, delay,
                                                           noise, steps=4000, chains=256)
  if math.isinf(predicted):  # beyond its edge: the rule diverges too
    assert math.isinf(mean)
  else:
    assert abs(mean - predicted) < 4 * error, (method, mean, error, predicted)


def test_the_predicted_gap_is_zero_for_the_reference_and_infinite_past_the_edge():
  assert quadratic_noise.predicted_gap(quadratic.REFERENCE, 30, 0.9, 0.01, 1.0) == pytest.approx(
      0.0, abs=1e-12)
  assert quadratic_noise.predicted_gap("pb", 1, 0.9, 0.01, 1.0) > 0  # one step late costs loss
  assert math.isinf(quadratic_noise.predicted_gap("pb", 60, 0.9, 0.01, 1.0))  # ρ ≥ 1 there
  assert quadratic.spectral_radius("pb", 0.01, 0.9, 60) >= 1


def test_the_gap_figure_draws_the_predicted_gaps_over_the_delays_memory(tmp_path):
  curves = quadratic_figures.predicted_gap_curves(["pb", "pb_sc_lwp"], 0.9, 1e-2, 1.0,
                                                  [0.05, 0.1, 1.0, 6.0])
  products, gaps = curves["pb"]
  np.testing.assert_allclose(products, [0.1, 1.0, 6.0])  # D = 1, 10, 60; 0.05 rounds to D = 1
  assert gaps[0] == pytest.approx(quadratic_noise.predicted_gap("pb", 1, 0.9, 1e-2, 1.0))
  assert math.isnan(gaps[-1])  # diverged: not drawn
  path = quadratic_figures.plot_predicted_gap(str(tmp_path / "gap.png"), ["pb", "pb_sc_lwp"],
                                              0.9, 1e-2, 1.0, [0.1, 1.0, 6.0])
  assert os.path.getsize(path) > 1000


@pytest.mark.parametrize("noise", [-1.0, math.nan, True])
def test_a_bad_noise_is_refused_with_what_it_must_be(noise):
  with pytest.raises(ValueError, match="noise must be a finite number >= 0"):
    quadratic_noise.stationary_excess_loss("pb", 0.01, 0.9, 2, noise)
  with pytest.raises(ValueError, match="noise must be a finite number >= 0"):
    quadratic_simulation.multi_dim_losses("pb", [1.0], 0.01, 0.9, 2, 5, noise=noise)
