r"""Stability tables and figures of pipelined momentum methods on a convex quadratic.

Prints, for each method, momentum and delay, the largest stable ``ηλ`` and the best asymptotic
rate ``ρ`` of the recurrence on ``L(w) = ½ λ w²`` (see ``pipejax/analysis/quadratic.py``), draws
the figures, and regenerates ``docs/quadratic.md``.

Usage (from the repository root):

  .venv/bin/python scripts/quadratic.py                      # readable tables
  .venv/bin/python scripts/quadratic.py --format=json        # {"stability": [...]}
  .venv/bin/python scripts/quadratic.py --output_dir=/tmp/q  # also the PNG figures
  .venv/bin/python scripts/quadratic.py --write_docs         # docs/quadratic.md + docs/figures/

Without ``pip install -e .`` prefix the commands with ``PYTHONPATH=.``. The full default table
(6 methods × 3 momenta × 5 delays) takes about 10 s on one CPU core.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Sequence

from absl import app
from absl import flags

# Lets the script run from a checkout without `pip install -e .`: the repository root is the
# parent of this file's folder.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
  sys.path.insert(0, _REPO_ROOT)

from pipejax.analysis import quadratic  # pylint: disable=g-import-not-at-top,wrong-import-position

_FORMAT = flags.DEFINE_enum("format", "text", ["text", "json", "markdown"],
                            "How to print the stability table.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None,
                                  "If set, write the PNG figures into this folder.")
_WRITE_DOCS = flags.DEFINE_bool("write_docs", False,
                                "Regenerate docs/quadratic.md and its figures in docs/figures/.")
_METHODS = flags.DEFINE_list("methods", list(quadratic.PIPELINE_METHODS),
                             f"Methods to tabulate, from {', '.join(quadratic.METHODS)}.")
_MOMENTA = flags.DEFINE_list("momenta", ["0.9", "0.99", "0.999"], "Heavy-ball momenta m.")
_DELAYS = flags.DEFINE_list("delays", ["0", "1", "4", "16", "64"], "Gradient delays D.")

JSON_KEYS = ("method", "momentum", "delay", "max_stable_lr", "best_rate")
DOCS_PATH = os.path.join("docs", "quadratic.md")
FIGURES_DIR = os.path.join("docs", "figures")
REGENERATE_COMMAND = "PYTHONPATH=. .venv/bin/python scripts/quadratic.py --write_docs"

# The multi-dimensional runs: (lr, momentum, delay) per panel, on 32 curvatures log-spaced over
# [1e-3, 1]. The first is stable for every method; at the second, plain PB is past its limit
# (6.4e-4 at m = 0.99, D = 16) while SC and LWP are still inside theirs.
LOSS_SETTINGS = ((5e-4, 0.99, 16), (2e-3, 0.99, 16))
LOSS_STEPS = 4000


def _parse_floats(values: Sequence[str], name: str) -> list[float]:
  try:
    return [float(v) for v in values]
  except ValueError as e:
    raise app.UsageError(f"--{name} takes numbers, got {list(values)}") from e


def _parse_ints(values: Sequence[str], name: str) -> list[int]:
  try:
    return [int(v) for v in values]
  except ValueError as e:
    raise app.UsageError(f"--{name} takes integers, got {list(values)}") from e


def json_report(rows: list[dict]) -> str:
  """The ``--format=json`` output: one object, ``{"stability": [rows with JSON_KEYS]}``."""
  return json.dumps({"stability": [{k: row[k] for k in JSON_KEYS} for row in rows]})


def _grid(rows, key, method, momentum, delays):
  by_delay = {r["delay"]: r[key] for r in rows if r["method"] == method
              and r["momentum"] == momentum}
  return [by_delay[d] for d in delays]


def _fmt_lr(x: float) -> str:
  return "inf" if math.isinf(x) else f"{x:.3g}"


def _fmt_rho(x: float) -> str:
  return f"{x:.5f}"


def _tables(rows, methods, momenta, delays, markdown: bool) -> str:
  """The two tables (max stable ηλ, best ρ), one block per momentum."""
  out = []
  for title, key, fmt in (("Largest stable ηλ", "max_stable_lr", _fmt_lr),
                          ("Best rate ρ (min over ηλ)", "best_rate", _fmt_rho)):
    for momentum in momenta:
      header = ["method"] + [f"D={d}" for d in delays]
      body = [[m] + [fmt(v) for v in _grid(rows, key, m, momentum, delays)] for m in methods]
      if markdown:
        out.append(f"**{title}, m = {momentum}** (heavy ball at D = 0: "
                   + (f"2(1+m) = {2 * (1 + momentum):.4g})" if key == "max_stable_lr"
                      else f"√m = {math.sqrt(momentum):.5f})"))
        out.append("")
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join(["---"] + ["--:"] * len(delays)) + "|")
        out.extend("| " + " | ".join(r) + " |" for r in body)
      else:
        out.append(f"{title}, m = {momentum}")
        widths = [max(len(str(r[i])) for r in [header] + body) for i in range(len(header))]
        out.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                             for i, (h, w) in enumerate(zip(header, widths))))
        out.extend("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths))) for r in body)
      out.append("")
  return "\n".join(out)


def _pb_anchor_table(rows, momenta, delays) -> str:
  """Markdown table of D·ηλ_max/(1 − m) for plain PB: the ≈ 1 anchor."""
  ds = [d for d in delays if d > 0]
  out = ["| m | " + " | ".join(f"D={d}" for d in ds) + " |",
         "|---|" + "|".join(["--:"] * len(ds)) + "|"]
  for momentum in momenta:
    vals = _grid(rows, "max_stable_lr", "pb", momentum, ds)
    out.append(f"| {momentum} | "
               + " | ".join(f"{v * d / (1 - momentum):.3f}" for v, d in zip(vals, ds)) + " |")
  return "\n".join(out)


def write_figures(output_dir: str, methods: Sequence[str]) -> dict[str, str]:
  """Draws every figure into ``output_dir``; returns {name: path}."""
  os.makedirs(output_dir, exist_ok=True)
  paths = {}
  for momentum in (0.9, 0.99):
    name = f"rho_vs_lr_m{momentum}"
    paths[name] = quadratic.plot_rho_vs_lr(
        os.path.join(output_dir, f"quadratic_{name}.png"), methods, momentum)
  name = "rho_by_delay_m0.99"
  paths[name] = quadratic.plot_rho_by_delay(
      os.path.join(output_dir, f"quadratic_{name}.png"), methods, 0.99)
  paths["losses"] = quadratic.plot_multi_dim_losses(
      os.path.join(output_dir, "quadratic_losses.png"), methods, settings=LOSS_SETTINGS,
      steps=LOSS_STEPS)
  return paths


def render_docs(rows, methods, momenta, delays, figures: dict[str, str]) -> str:
  """The text of docs/quadratic.md (figure paths are made relative to docs/)."""
  def fig(name):
    return os.path.relpath(figures[name], "docs").replace(os.sep, "/")

  def lr(method, momentum, delay):
    return _fmt_lr(_grid(rows, "max_stable_lr", method, momentum, [delay])[0])

  sections = [
      "# Pipelined momentum on a convex quadratic",
      "",
      "<!-- Generated by scripts/quadratic.py --write_docs; edit the script, not this page. -->",
      "",
      "Regenerate this page and its figures from the repository root with",
      "",
      "```sh",
      REGENERATE_COMMAND,
      "```",
      "",
      "(about 45 s on two CPU cores; `.venv/bin/python scripts/quadratic.py --format=json` "
      "prints the same numbers as JSON, and `PYTHONPATH=.` is unneeded once the package is "
      "installed with `pip install -e .`).",
      "",
      "## The model",
      "",
      "On `L(w) = ½ λ w²` with heavy-ball momentum (`v ← m v + g`, `w ← w − η u`) and a gradient "
      "computed from the weights of `D` steps ago, every method of DESIGN.md §3 is a linear "
      "recurrence in `w`, `v` and the last `D + 1` (or `D + 2`) weights. The spectral radius `ρ` "
      "of its companion matrix is the asymptotic convergence factor per step; `ρ < 1` is "
      "stability. Only `ηλ` matters. `pipejax.analysis.quadratic` builds the matrices "
      "(`companion_matrix`, `spectral_radius`) and, independently, steps each update rule with "
      "explicit weight histories (`simulated_rate`); the tests check that the two agree to 1e-3 "
      "relative (in practice to ~1e-4). A scalar weight has no forward/backward inconsistency, so "
      "this analysis isolates *staleness*.",
      "",
      "| method | gradient applied at step t | update |",
      "|---|---|---|",
      "| `pb` | `λ w_{t−D}` | plain momentum |",
      "| `pb_sc` | `λ w_{t−D}` | Spike Compensation `u = m^D v + (1 − m^D)/(1 − m) g` |",
      "| `pb_lwp` | `λ ŵ_{t−D}`, `ŵ_s = w_s + D (w_s − w_{s−1})` | plain momentum |",
      "| `pb_sc_lwp` | same prediction, from the applied (spiked) update | Spike Compensation |",
      "| `spectrain` | `λ ŵ_{t−D}`, `ŵ_s = w_s − η D v_s` | plain momentum |",
      "| `pipemare` | `λ w_{t−D}` | plain momentum with step `η / D` |",
      "",
      "Two rows are equal by construction, and the tables show it:",
      "",
      "- **`spectrain` = `pb_lwp`.** Under plain momentum `w_s − w_{s−1} = −η v_s`, so the "
      "velocity-form prediction is the update-form one. The code builds the two matrices "
      "independently (SpecTrain's carries a velocity history and has size `2D + 2`) and the "
      "tests check that their spectral radii agree. The forms differ only under SC.",
      "- **`pipemare` = `pb` with `ηλ/D`.** PipeMare's rescheduled rate is "
      "`α_k τ^{−(1 − min(k/K, 1))}`, `τ = max(D, 1)`; this page analyses its *start*, `k = 0`, "
      "where the step is `α/τ`, and tabulates the *base* `ηλ`. Its discrepancy correction moves "
      "only the backward's weights, which on a scalar quadratic are the forward's, so it drops "
      "out. PipeMare's stable base `ηλ` is therefore `D` times PB's, and its best `ρ` equals "
      "PB's: it buys stability by taking a `D`-times smaller step, not by removing the delay. "
      "After annealing (`k ≥ K`) it is exactly `pb`.",
      "",
      "## Anchors",
      "",
      "**No delay.** With `D = 0` every method is heavy ball: stable for `ηλ < 2(1 + m)`, best "
      "`ρ = √m` (reached on the whole range `(1 − √m)² ≤ ηλ ≤ (1 + √m)²`). The `D = 0` columns "
      "below match both to 1e-12; the tests hold them to 1e-3.",
      "",
      "**Plain delayed momentum is stable only for `ηλ/(1 − m) ≲ 1/D`.** With `D = 1` the limit "
      "is exactly `1 − m` (the characteristic polynomial is `z² − (1 + m) z + m + ηλ`). For "
      "larger `D`, `D·ηλ_max/(1 − m)` for `pb` is:",
      "",
      _pb_anchor_table(rows, momenta, delays),
      "",
      "The ratio is close to 1 while the delay is short compared with the momentum's memory "
      "`1/(1 − m)`: the weights then drift slowly over `D` steps, `w_{t−D} ≈ w_t − D ẇ`, and in "
      "`ẅ + (1 − m) ẇ + ηλ w(t − D) ≈ 0` the delay acts as a negative damping `ηλ D` that must "
      "stay below the momentum's damping `1 − m`. The ratio grows when `D` approaches or exceeds "
      "`1/(1 − m)` (m = 0.9: 10 steps).",
      "",
      "## Tables",
      "",
      _tables(rows, methods, momenta, delays, markdown=True),
      "## What the numbers say",
      "",
      f"- **Spike Compensation** enlarges the stable range at every `D > 0`, and more so the "
      f"higher the momentum: at `D = 16` from {lr('pb', 0.9, 16)} to {lr('pb_sc', 0.9, 16)} "
      f"(m = 0.9), from {lr('pb', 0.99, 16)} to {lr('pb_sc', 0.99, 16)} (m = 0.99) and from "
      f"{lr('pb', 0.999, 16)} to {lr('pb_sc', 0.999, 16)} (m = 0.999). Momentum spreads each "
      "gradient's effect over about `1/(1 − m)` steps and a delay shifts all of it by `D`. SC "
      "applies, on arrival, the part the gradient would have contributed while in flight; from "
      "then on the weights follow the undelayed trajectory. Only the first `(1 − m^D)/(1 − m)` "
      "of the gradient's total weight `1/(1 − m)` is still applied late (all at once, on "
      "arrival), a fraction `1 − m^D` that vanishes as `m → 1` at fixed `D`: hence the gain "
      "grows with momentum.",
      f"- **Linear Weight Prediction** (and SpecTrain, identical here) evaluates the gradient "
      "at an extrapolation of where the weights will be when it is applied, which cancels the "
      "first-order effect of the delay: at `D = 16` it takes the limit from "
      f"{lr('pb', 0.99, 16)} to {lr('pb_lwp', 0.99, 16)} (m = 0.99) and from "
      f"{lr('pb', 0.999, 16)} to {lr('pb_lwp', 0.999, 16)} (m = 0.999).",
      f"- **SC + LWP** is the best combination at high momentum (the regime of batch-size-one "
      f"pipelines, where the batch-size scaling rule gives `m` close to 1): at m = 0.999 its "
      f"limit is {lr('pb_sc_lwp', 0.999, 16)} at `D = 16` and {lr('pb_sc_lwp', 0.999, 64)} at "
      f"`D = 64`, against {lr('pb', 0.999, 16)} and {lr('pb', 0.999, 64)} for PB, "
      f"{lr('pb_sc', 0.999, 64)} for SC and {lr('pb_lwp', 0.999, 64)} for LWP alone at `D = 64`.",
      f"- **Prediction overshoots when the delay outlasts the momentum's memory.** Extrapolating "
      "the last update `T = D` steps ahead assumes updates stay steady for `D` steps, which "
      "momentum guarantees only for `D ≲ 1/(1 − m)`. At m = 0.9 (memory 10 steps), LWP's limit "
      f"at `D = 64` falls below PB's ({lr('pb_lwp', 0.9, 64)} against {lr('pb', 0.9, 64)}), and "
      f"SC + LWP's already at `D = 16` ({lr('pb_sc_lwp', 0.9, 16)} against "
      f"{lr('pb', 0.9, 16)}): under SC the update-form prediction extrapolates the spike too, and "
      "with little momentum the spike is most of the update (at m = 0.9, D = 16: "
      "`b g ≈ 8.1 g` against `a v ≈ 1.9 g` in steady state).",
      "- **Best `ρ` on one curvature is not the figure of merit.** At high momentum the best "
      "`ηλ` is about `(1 − √m)²`, far below every limit, so all methods reach `ρ ≈ √m`. Methods "
      "with prediction can even beat `√m` (SC + LWP at `D = 1` reaches about 0.68 at m = 0.9): "
      "on a single curvature, extra terms in the recurrence can cancel the momentum, as plain GD "
      "at `ηλ = 1` converges in one step. What matters on a real problem is the *stable range*: "
      "with curvatures spread over `[λ_min, λ_max]` the step is capped by `λ_max` and the "
      "slowest direction contracts by about `1 − ηλ_min/(1 − m)` per step, so the attainable "
      "speed is proportional to the largest stable `ηλ`.",
      "",
      "## Figures",
      "",
      "ρ against ηλ, one panel per method, one curve per delay (m = 0.9, then m = 0.99). The "
      "y axis is `ρ − 1` on a symmetric log scale, so the stable side (just below 1 at high "
      "momentum: `√m − 1 = −0.005` at m = 0.99) and the unstable side are both legible; the "
      "dashed zero line is `ρ = 1` and the shaded half is stable. Each curve leaves the shaded "
      "half at that method's `max_stable_lr`:",
      "",
      f"![rho vs lr, m=0.9]({fig('rho_vs_lr_m0.9')})",
      "",
      f"![rho vs lr, m=0.99]({fig('rho_vs_lr_m0.99')})",
      "",
      "The same curves grouped by delay, all methods in each panel (m = 0.99); the black curve "
      "is undelayed heavy ball, SpecTrain (dashed) lies on PB + LWP, and at `D = 1` PipeMare "
      "lies on PB:",
      "",
      f"![rho by delay]({fig('rho_by_delay_m0.99')})",
      "",
      "Loss against step on `½ Σ λ_i w_i²` with 32 curvatures log-spaced over `[1e-3, 1]`, all "
      "weights starting at 1; during the fill (`t < D`) no gradient has arrived and the weights "
      "do not move. Left: a step every method tolerates. Right: a step 3× past PB's limit, "
      "inside SC's and LWP's; PipeMare stays stable because its step is 16× smaller, and is "
      "correspondingly slow:",
      "",
      f"![losses]({fig('losses')})",
      "",
      "Settings of the loss panels (lr, m, D): "
      + ", ".join(f"({a:g}, {b:g}, {c})" for a, b, c in LOSS_SETTINGS) + f"; {LOSS_STEPS} steps.",
      "",
  ]
  return "\n".join(sections)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  methods = list(_METHODS.value)
  momenta = _parse_floats(_MOMENTA.value, "momenta")
  delays = _parse_ints(_DELAYS.value, "delays")
  try:
    rows = quadratic.stability_table(methods, momenta, delays)
  except ValueError as e:
    raise app.UsageError(str(e)) from e

  if _FORMAT.value == "json":
    print(json_report(rows))
  else:
    print(_tables(rows, methods, momenta, delays, markdown=_FORMAT.value == "markdown"))

  if _OUTPUT_DIR.value:
    for path in write_figures(_OUTPUT_DIR.value, methods).values():
      print(f"wrote {path}", file=sys.stderr)
  if _WRITE_DOCS.value:
    figures = write_figures(FIGURES_DIR, methods)
    with open(DOCS_PATH, "w", encoding="utf-8") as f:
      f.write(render_docs(rows, methods, momenta, delays, figures))
    print(f"wrote {DOCS_PATH} and {len(figures)} figures in {FIGURES_DIR}", file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
