r"""Stability tables and figures of pipelined momentum methods on a convex quadratic.

Prints, for each method, momentum and delay, the largest stable ``ηλ`` and the best asymptotic
rate ``ρ`` of the recurrence on ``L(w) = ½ λ w²`` (see ``pipejax/analysis/quadratic/``), draws the
figures, and keeps the numbers of ``docs/quadratic.md`` current:

    python scripts/quadratic.py                      # readable tables
    python scripts/quadratic.py --format=json        # {"stability": [...]}
    python scripts/quadratic.py --output_dir=/tmp/q  # also the PNG figures
    python scripts/quadratic.py --write_docs         # docs/quadratic.md's numbers, docs/figures/
    python scripts/quadratic.py --check_docs         # exit 1 if the page's numbers are stale

The page carries its own prose; ``--write_docs`` rewrites only the parts between its markers
(``pipejax/analysis/quadratic/docs.py``). The full default table (6 methods × 3 momenta × 5
delays) takes about 15 s on one CPU core, the figures about 30 s more.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from absl import app
from absl import flags

from pipejax import cli
from pipejax.analysis import quadratic
from pipejax.analysis.quadratic import docs as quadratic_docs
from pipejax.analysis.quadratic import figures as quadratic_figures

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

_DOCS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
DOCS_PATH = os.path.join(_DOCS_DIR, "quadratic.md")
FIGURES_DIR = os.path.join(_DOCS_DIR, "figures")


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


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _OUTPUT_DIR.value is not None:
    cli.check_output("output_dir", _OUTPUT_DIR.value, directory=True)
  if _WRITE_DOCS.value:
    cli.check_output("write_docs", DOCS_PATH)
    cli.check_output("write_docs", FIGURES_DIR, directory=True)
  methods = list(_METHODS.value)
  momenta = _parse_floats(_MOMENTA.value, "momenta")
  delays = _parse_ints(_DELAYS.value, "delays")
  try:
    rows = quadratic.stability_table(methods, momenta, delays)
  except ValueError as e:
    raise app.UsageError(str(e)) from e

  if _FORMAT.value == "json":
    print(quadratic_docs.json_report(rows))
  else:
    print(quadratic_docs.tables(rows, methods, momenta, delays,
                                markdown=_FORMAT.value == "markdown"))

  if _OUTPUT_DIR.value:
    for path in quadratic_figures.write_figures(_OUTPUT_DIR.value, methods).values():
      print(f"wrote {path}", file=sys.stderr)
  if _WRITE_DOCS.value or _CHECK_DOCS.value:
    with open(DOCS_PATH, encoding="utf-8") as f:
      page = f.read()
    try:
      current = quadratic_docs.render_docs(page, rows, methods, momenta, delays)
    except ValueError as e:
      raise app.UsageError(f"{DOCS_PATH}: {e}") from e
    if _CHECK_DOCS.value and current != page:
      print(f"{DOCS_PATH} is out of date: run `python scripts/quadratic.py --write_docs`.",
            file=sys.stderr)
      sys.exit(1)
    if _CHECK_DOCS.value:
      print(f"{DOCS_PATH} is up to date.", file=sys.stderr)
    if _WRITE_DOCS.value:
      figures = quadratic_figures.write_figures(FIGURES_DIR, methods)
      with open(DOCS_PATH, "w", encoding="utf-8") as f:
        f.write(current)
      print(f"wrote {DOCS_PATH} and {len(figures)} figures in {FIGURES_DIR}", file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)
