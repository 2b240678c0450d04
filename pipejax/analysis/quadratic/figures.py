"""The figures of the convex-quadratic analysis (docs/quadratic.md), drawn from its numbers.

:mod:`pipejax.analysis.quadratic` computes; this module only draws what it computes. Every figure
computes all of its curves before it opens a figure, so a bad argument raises that module's
``ValueError`` and leaves no figure behind.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np

from pipejax import methods as methods_lib
from pipejax import plotting
from pipejax.analysis import quadratic
from pipejax.analysis.quadratic import noise as quadratic_noise
from pipejax.analysis.quadratic import simulation as quadratic_simulation



def _color(method: str) -> str:
  return methods_lib.preset_of(method).color


def _label(method: str) -> str:
  """The display name, with what the quadratic makes of it: no delay, or PipeMare's ``η / τ``."""
  form = quadratic.FORMS[method]
  name = methods_lib.preset_of(method).display_name
  if not form.delayed:
    return f"{name} (no delay)"
  return f"{name} (lr/τ)" if form.rate_over_delay else name


def _linestyle(method):
  # The next-velocity prediction has the update-form prediction's spectrum: dashed over it.
  return (0, (4, 3)) if quadratic.FORMS[method].prediction == "next_velocity" else "-"


# The multi-dimensional runs: (lr, momentum, delay) per panel, on 32 curvatures log-spaced over
# [1e-3, 1]. The first is stable for every method; at the second, plain PB is past its limit
# (6.4e-4 at m = 0.99, D = 16) while SC and LWP are still inside theirs.
LOSS_SETTINGS = ((5e-4, 0.99, 16), (2e-3, 0.99, 16))
LOSS_STEPS = 4000


def _with_sgd_first(methods: Sequence[str]) -> list[str]:
  """The reference ``sgd`` first (drawn underneath), then the other methods in order."""
  return [quadratic.REFERENCE] + [m for m in methods if m != quadratic.REFERENCE]


def _lr_grid(num: int) -> np.ndarray:
  return np.logspace(-5, math.log10(5.0), num)


def _style_rho_axes(ax):
  """ρ − 1 on a symmetric log axis: the stable side (ρ ≈ √m, just below 1 at high momentum) and
  the unstable side (up to ρ ≈ 2) are both legible; the ρ = 1 line is the zero line."""
  ax.axhline(0.0, color="black", lw=1.0, ls="--")
  ax.axhspan(-1.0, 0.0, color="tab:green", alpha=0.06, lw=0)
  ax.set_xscale("log")
  ax.set_yscale("symlog", linthresh=1e-4, linscale=0.5)
  ax.set_ylim(-1.0, 1.0)
  ax.set_yticks([-1.0, -0.1, -1e-2, -1e-3, -1e-4, 0.0, 1e-4, 1e-3, 1e-2, 0.1, 1.0])
  ax.grid(True, which="major", alpha=0.3)


def _rho_figure(panels: int, cols: int, panel_size: tuple[float, float], sharex: bool = False):
  """A grid of ``panels`` panels sharing the ρ axis; returns ``(pyplot, fig, axes)``."""
  plt = plotting.pyplot()
  rows = math.ceil(panels / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(panel_size[0] * cols, panel_size[1] * rows),
                           sharex=sharex, sharey=True, squeeze=False)
  return plt, fig, axes


def plot_rho_vs_lr(path: str, methods: Sequence[str] = quadratic.PIPELINE_METHODS,
                   momentum: float = 0.9, delays: Sequence[int] = (0, 1, 4, 16, 64),
                   num: int = 400) -> str:
  """Writes a PNG with one panel per method: ``ρ`` against ``ηλ`` (log axis), one curve per ``D``.

  Returns:
    ``path``.
  """
  xs = _lr_grid(num)
  curves = {(method, delay): quadratic.spectral_radii(method, xs, momentum, delay)
            for method in methods for delay in delays}
  plt, fig, axes = _rho_figure(len(methods), cols=3, panel_size=(4.2, 3.3), sharex=True)
  cmap = plt.get_cmap("viridis")
  for ax, method in zip(axes.flat, methods):
    for j, delay in enumerate(delays):
      color = cmap(j / max(len(delays) - 1, 1))
      ax.plot(xs, curves[method, delay] - 1.0, color=color, lw=1.6, label=f"D={delay}")
    _style_rho_axes(ax)
    ax.set_title(_label(method))
  for ax in axes.flat[len(methods):]:
    ax.set_visible(False)
  for ax in axes[-1]:
    ax.set_xlabel("ηλ")
  for ax in axes[:, 0]:
    ax.set_ylabel("ρ − 1  (symlog; < 0: stable)")
  axes.flat[0].legend(loc="upper left", fontsize=8)
  fig.suptitle(f"Spectral radius ρ on ½λw², momentum m = {momentum}: shaded (ρ < 1) is stable, "
               f"heavy ball's best is ρ − 1 = √m − 1 = {math.sqrt(momentum) - 1:.3g}")
  plotting.save(fig, path, dpi=110)
  return path


def plot_rho_by_delay(path: str, methods: Sequence[str] = quadratic.PIPELINE_METHODS,
                      momentum: float = 0.9, delays: Sequence[int] = (1, 4, 16, 64),
                      num: int = 400) -> str:
  """Writes a PNG with one panel per ``D``: ``ρ`` against ``ηλ`` for every method, plus ``sgd``.

  Returns:
    ``path``.
  """
  xs = _lr_grid(num)
  drawn = _with_sgd_first(methods)
  curves = {(method, delay): quadratic.spectral_radii(method, xs, momentum, delay)
            for delay in delays for method in drawn}
  _, fig, axes = _rho_figure(len(delays), cols=2, panel_size=(6.0, 3.6))
  for ax, delay in zip(axes.flat, delays):
    for method in drawn:
      ax.plot(xs, curves[method, delay] - 1.0, color=_color(method),
              ls=_linestyle(method), lw=1.6, label=_label(method))
    _style_rho_axes(ax)
    ax.set_title(f"D = {delay}")
    ax.set_xlabel("ηλ (PipeMare: base ηλ, step ηλ/τ)")
  for ax in axes.flat[len(delays):]:
    ax.set_visible(False)
  for ax in axes[:, 0]:
    ax.set_ylabel("ρ − 1  (symlog; < 0: stable)")
  axes.flat[0].legend(loc="upper left", fontsize=8)
  fig.suptitle(f"Spectral radius per delay, momentum m = {momentum}: shaded (ρ < 1) is stable")
  plotting.save(fig, path, dpi=110)
  return path


def plot_multi_dim_losses(path: str, methods: Sequence[str] = quadratic.PIPELINE_METHODS,
                          curvatures: Sequence[float] | None = None,
                          settings: Sequence[tuple[float, float, int]] = ((0.005, 0.9, 16),
                                                                          (0.02, 0.9, 16)),
                          steps: int = 2000) -> str:
  """Writes a PNG of loss against step on a multi-dimensional quadratic, one panel per setting.

  Args:
    path: PNG file to write.
    methods: methods to draw; ``sgd`` (no delay) is always added as the reference.
    curvatures: the ``λ_i``; default 32 values log-spaced over ``[1e-3, 1]``.
    settings: ``(lr, momentum, delay)`` per panel.
    steps: steps per run.

  Returns:
    ``path``.
  """
  lam = np.logspace(-3, 0, 32) if curvatures is None else np.asarray(curvatures, np.float64)
  drawn = _with_sgd_first(methods)
  losses = {(setting, method): quadratic_simulation.multi_dim_losses(method, lam, *setting, steps)
            for setting in settings for method in drawn}
  plt = plotting.pyplot()
  fig, axes = plt.subplots(1, len(settings), figsize=(6.0 * len(settings), 4.2), squeeze=False)
  for ax, setting in zip(axes.flat, settings):
    for method in drawn:
      curve = losses[setting, method]
      ax.plot(np.arange(curve.size), curve, color=_color(method),
              ls=_linestyle(method), lw=1.5, label=_label(method))
    loss0 = losses[setting, drawn[-1]][0]
    lr, momentum, delay = setting
    ax.set_yscale("log")
    ax.set_ylim(loss0 * 1e-4, loss0 * 1e3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss ½ Σ λᵢ wᵢ²")
    ax.set_title(f"η = {lr}, m = {momentum}, D = {delay}  (λ ∈ [{lam.min():g}, {lam.max():g}])")
    ax.grid(True, which="major", alpha=0.3)
  # One legend below the panels, so that no curve hides behind it.
  handles, labels = axes.flat[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
  plotting.save(fig, path, dpi=110, rect=(0.0, 0.07, 1.0, 1.0))
  return path


def predicted_gap_curves(methods: Sequence[str], momentum: float, lr_lambda: float,
                         noise: float, delay_memories: Sequence[float]
                         ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Per method, ``(D (1 − β), gap)`` at the delays ``D = max(1, round(p / (1 − β)))`` of each
  ``p`` of ``delay_memories`` (repeats dropped): the quadratic's
  :func:`~pipejax.analysis.quadratic.noise.predicted_gap`, NaN where the method diverges."""
  delays = sorted({max(1, round(p / (1.0 - momentum))) for p in delay_memories})
  products = np.asarray(delays, np.float64) * (1.0 - momentum)
  curves = {}
  for method in methods:
    gaps = np.asarray([quadratic_noise.predicted_gap(method, d, momentum, lr_lambda, noise)
                       for d in delays])
    curves[method] = products, np.where(np.isfinite(gaps), gaps, np.nan)
  return curves


def plot_predicted_gap(path: str, methods: Sequence[str] = quadratic.PIPELINE_METHODS,
                       momentum: float = 0.9, lr_lambda: float = 1e-3, noise: float = 1.0,
                       delay_memories: Sequence[float] = tuple(np.logspace(-2, 1, 31))) -> str:
  """Writes a PNG: the quadratic's gap (excess loss under gradient noise over the undelayed
  reference's, in units of ``σ²/λ``) against ``D (1 − β)`` on a log axis, one series per method,
  for the phase diagram to set the studies' gaps beside. A series ends where its method
  diverges.

  Returns:
    ``path``.
  """
  curves = predicted_gap_curves(methods, momentum, lr_lambda, noise, delay_memories)
  plt = plotting.pyplot()
  fig, ax = plt.subplots(figsize=(7.0, 4.2))
  for method, (products, gaps) in curves.items():
    ax.plot(products, gaps, color=_color(method), ls=_linestyle(method), lw=1.6, marker=".",
            label=_label(method))
  ax.set_xscale("log")
  ax.set_yscale("symlog", linthresh=1e-3 * max(noise, 1e-12))
  ax.axhline(0.0, color="black", lw=1.0, ls="--")
  ax.set_xlabel("D (1 − β): the delay over the momentum's memory")
  ax.set_ylabel("predicted gap (excess loss − reference's)")
  ax.set_title(f"Quadratic under gradient noise: β = {momentum}, ηλ = {lr_lambda:g}, "
               f"σ²/λ = {noise:g}", fontsize=10)
  ax.legend(loc="upper left", fontsize=8)
  plotting.save(fig, path, dpi=110)
  return path


def write_figures(output_dir: str, methods: Sequence[str]) -> dict[str, str]:
  """Draws every figure into ``output_dir``; returns {name: path}."""
  os.makedirs(output_dir, exist_ok=True)
  paths = {}
  for momentum in (0.9, 0.99):
    name = f"rho_vs_lr_m{momentum}"
    paths[name] = plot_rho_vs_lr(
        os.path.join(output_dir, f"quadratic_{name}.png"), methods, momentum)
  name = "rho_by_delay_m0.99"
  paths[name] = plot_rho_by_delay(
      os.path.join(output_dir, f"quadratic_{name}.png"), methods, 0.99)
  paths["losses"] = plot_multi_dim_losses(
      os.path.join(output_dir, "quadratic_losses.png"), methods, settings=LOSS_SETTINGS,
      steps=LOSS_STEPS)
  return paths
