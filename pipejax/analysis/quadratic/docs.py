"""The convex-quadratic analysis as text: its stability tables, and docs/quadratic.md's numbers.

docs/quadratic.md carries its own prose. What the code computes sits between markers on the page,
and :func:`render_docs` rewrites only that: blocks between ``<!-- begin NAME -->`` and
``<!-- end NAME -->`` (tables), and numbers quoted in the text as
``<!-- lr METHOD m=M D=D -->VALUE<!-- /lr -->`` (the largest stable ``ηλ``).
``scripts/quadratic.py --write_docs`` writes the page, ``--check_docs`` checks it.
"""

from __future__ import annotations

import json
import math
import re

from pipejax import methods
from pipejax.analysis import quadratic
from pipejax.analysis.quadratic.figures import LOSS_SETTINGS, LOSS_STEPS

JSON_KEYS = ("method", "momentum", "delay", "max_stable_lr", "best_rate")


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


def tables(rows, methods, momenta, delays, markdown: bool) -> str:
  """The two tables (max stable ηλ, best ρ) of ``quadratic.stability_table``'s rows, one block
  per momentum, as aligned text or (``markdown``) Markdown."""
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
    vals = _grid(rows, "max_stable_lr", methods.PLAIN_PIPELINE, momentum, ds)
    out.append(f"| {momentum} | "
               + " | ".join(f"{v * d / (1 - momentum):.3f}" for v, d in zip(vals, ds)) + " |")
  return "\n".join(out)


# The markers of docs/quadratic.md's generated parts (see the module docstring).
_BLOCK = re.compile(r"(?P<open><!-- begin (?P<name>[\w-]+) -->\n)(?P<body>.*?)"
                    r"(?P<close>\n<!-- end (?P=name) -->)", re.S)
_INLINE_LR = re.compile(r"(?P<open><!-- lr (?P<method>\w+) m=(?P<momentum>[\d.]+) "
                        r"D=(?P<delay>\d+) -->)(?P<value>.*?)(?P<close><!-- /lr -->)")


def generated_blocks(rows, methods, momenta, delays) -> dict[str, str]:
  """The text of every generated block of docs/quadratic.md, by marker name."""
  return {
      "pb-anchor-table": _pb_anchor_table(rows, momenta, delays),
      "stability-tables": tables(rows, methods, momenta, delays, markdown=True).rstrip("\n"),
      "loss-settings": ("Settings of the loss panels (lr, m, D): "
                        + ", ".join(f"({a:g}, {b:g}, {c})" for a, b, c in LOSS_SETTINGS)
                        + f"; {LOSS_STEPS} steps."),
  }


def render_docs(page: str, rows, methods, momenta, delays) -> str:
  """``page`` with every generated block and quoted number rewritten from ``rows``.

  Raises:
    ValueError: a marker names a block this module does not generate, or the page has none.
  """
  blocks = generated_blocks(rows, methods, momenta, delays)
  found = [m.group("name") for m in _BLOCK.finditer(page)]
  unknown = sorted(set(found) - set(blocks))
  if unknown or not found:
    raise ValueError(f"The page has generated blocks {found}; the analysis writes "
                     f"{sorted(blocks)}. Fix the markers on the page (unknown: {unknown}).")
  page = _BLOCK.sub(lambda m: m["open"] + blocks[m["name"]] + m["close"], page)

  def quoted_lr(m):
    value = quadratic.max_stable_lr(m["method"], float(m["momentum"]), int(m["delay"]))
    return m["open"] + _fmt_lr(value) + m["close"]

  return _INLINE_LR.sub(quoted_lr, page)
