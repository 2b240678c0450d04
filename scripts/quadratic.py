r"""Stability tables and figures of pipelined momentum methods on a convex quadratic.

Prints, for each method, momentum and delay, the largest stable ``ηλ`` and the best asymptotic
rate ``ρ`` of the recurrence on ``L(w) = ½ λ w²`` (see ``pipejax/analysis/quadratic.py``), draws
the figures, and keeps the numbers of ``docs/quadratic.md`` current:

    python scripts/quadratic.py                      # readable tables
    python scripts/quadratic.py --format=json        # {"stability": [...]}
    python scripts/quadratic.py --output_dir=/tmp/q  # also the PNG figures
    python scripts/quadratic.py --write_docs         # docs/quadratic.md's numbers, docs/figures/
    python scripts/quadratic.py --check_docs         # exit 1 if the page's numbers are stale

The page carries its own prose. What the script computes sits between markers on the page, and
``--write_docs`` rewrites only that: blocks between ``<!-- begin NAME -->`` and
``<!-- end NAME -->`` (tables), and numbers quoted in the text as
``<!-- lr METHOD m=M D=D -->VALUE<!-- /lr -->`` (the largest stable ``ηλ``). The full default
table (6 methods × 3 momenta × 5 delays) takes about 15 s on one CPU core, the figures about 30 s
more.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from typing import Sequence

from absl import app
from absl import flags

from pipejax import cli
from pipejax.analysis import quadratic, quadratic_figures

_FORMAT = flags.DEFINE_enum("format", "text", ["text", "json", "markdown"],
                            "How to print the stability table.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None,
                                  "If set, write the PNG figures into this folder.")
_WRITE_DOCS = flags.DEFINE_bool("write_docs", False, "Rewrite the generated parts of "
                                "docs/quadratic.md and its figures in docs/figures/.")
_CHECK_DOCS = flags.DEFINE_bool("check_docs", False, "Exit with status 1 if the generated parts "
                                "of docs/quadratic.md differ from what the code computes now.")
_METHODS = flags.DEFINE_list("methods", list(quadratic.PIPELINE_METHODS),
                             f"Methods to tabulate, from {', '.join(quadratic.METHODS)}.")
_MOMENTA = flags.DEFINE_list("momenta", ["0.9", "0.99", "0.999"], "Heavy-ball momenta m.")
_DELAYS = flags.DEFINE_list("delays", ["0", "1", "4", "16", "64"], "Gradient delays D.")

JSON_KEYS = ("method", "momentum", "delay", "max_stable_lr", "best_rate")
_DOCS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
DOCS_PATH = os.path.join(_DOCS_DIR, "quadratic.md")
FIGURES_DIR = os.path.join(_DOCS_DIR, "figures")

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
    paths[name] = quadratic_figures.plot_rho_vs_lr(
        os.path.join(output_dir, f"quadratic_{name}.png"), methods, momentum)
  name = "rho_by_delay_m0.99"
  paths[name] = quadratic_figures.plot_rho_by_delay(
      os.path.join(output_dir, f"quadratic_{name}.png"), methods, 0.99)
  paths["losses"] = quadratic_figures.plot_multi_dim_losses(
      os.path.join(output_dir, "quadratic_losses.png"), methods, settings=LOSS_SETTINGS,
      steps=LOSS_STEPS)
  return paths


# The markers of docs/quadratic.md's generated parts (see the module docstring).
_BLOCK = re.compile(r"(?P<open><!-- begin (?P<name>[\w-]+) -->\n)(?P<body>.*?)"
                    r"(?P<close>\n<!-- end (?P=name) -->)", re.S)
_INLINE_LR = re.compile(r"(?P<open><!-- lr (?P<method>\w+) m=(?P<momentum>[\d.]+) "
                        r"D=(?P<delay>\d+) -->)(?P<value>.*?)(?P<close><!-- /lr -->)")


def generated_blocks(rows, methods, momenta, delays) -> dict[str, str]:
  """The text of every generated block of docs/quadratic.md, by marker name."""
  return {
      "pb-anchor-table": _pb_anchor_table(rows, momenta, delays),
      "stability-tables": _tables(rows, methods, momenta, delays, markdown=True).rstrip("\n"),
      "loss-settings": ("Settings of the loss panels (lr, m, D): "
                        + ", ".join(f"({a:g}, {b:g}, {c})" for a, b, c in LOSS_SETTINGS)
                        + f"; {LOSS_STEPS} steps."),
  }


def render_docs(page: str, rows, methods, momenta, delays) -> str:
  """``page`` with every generated block and quoted number rewritten from ``rows``.

  Raises:
    ValueError: a marker names a block this script does not generate, or the page has none.
  """
  blocks = generated_blocks(rows, methods, momenta, delays)
  found = [m.group("name") for m in _BLOCK.finditer(page)]
  unknown = sorted(set(found) - set(blocks))
  if unknown or not found:
    raise ValueError(f"{DOCS_PATH} has generated blocks {found}; this script writes "
                     f"{sorted(blocks)}. Fix the markers on the page (unknown: {unknown}).")
  page = _BLOCK.sub(lambda m: m["open"] + blocks[m["name"]] + m["close"], page)

  def quoted_lr(m):
    value = quadratic.max_stable_lr(m["method"], float(m["momentum"]), int(m["delay"]))
    return m["open"] + _fmt_lr(value) + m["close"]

  return _INLINE_LR.sub(quoted_lr, page)


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
  if _WRITE_DOCS.value or _CHECK_DOCS.value:
    with open(DOCS_PATH, encoding="utf-8") as f:
      page = f.read()
    try:
      current = render_docs(page, rows, methods, momenta, delays)
    except ValueError as e:
      raise app.UsageError(str(e)) from e
    if _CHECK_DOCS.value and current != page:
      print(f"{DOCS_PATH} is out of date: run `python scripts/quadratic.py --write_docs`.",
            file=sys.stderr)
      sys.exit(1)
    if _CHECK_DOCS.value:
      print(f"{DOCS_PATH} is up to date.", file=sys.stderr)
    if _WRITE_DOCS.value:
      figures = write_figures(FIGURES_DIR, methods)
      with open(DOCS_PATH, "w", encoding="utf-8") as f:
        f.write(current)
      print(f"wrote {DOCS_PATH} and {len(figures)} figures in {FIGURES_DIR}", file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)
