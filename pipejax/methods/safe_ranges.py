"""What the studies measured of each pipelined preset's delay, for the warning at a run's start.

``safe_ranges.json`` beside this module is generated from the studies' records
(:mod:`pipejax.analysis.safe_range`, ``python scripts/phase_diagram.py --safe_ranges=...``) and
committed: per preset, the momenta its cells were measured at and, per unit of the studies (points,
bits per byte), the largest ``x = D_max (1 − β)`` up to which it held level with the best baseline
and each ``x`` at which it was measured behind or diverged, with that cell's gap. A preset no study
has measured has no entry. Nothing here is written by hand: a study that adds records changes the
file when it is generated again, and a test checks the committed file against the records.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "safe_ranges.json")
UNMEASURED = "unmeasured"
HOLDS = "holds"
BEHIND = "behind"


@dataclasses.dataclass(frozen=True)
class Finding:
  """What the studies say of a preset at one ``x``: ``kind`` is :data:`HOLDS`, :data:`BEHIND`
  (measured behind or diverged at or below this ``x``) or :data:`UNMEASURED`; ``text`` says it
  in one sentence."""

  kind: str
  text: str


@functools.lru_cache(maxsize=None)
def load(path: str = PATH) -> dict:
  """The generated file's per-preset entries (empty when the file is absent)."""
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)["methods"]


def _at_three_figures(x: float) -> float:
  # The phase report groups and states cells at three figures; a run is compared the same way.
  return float(f"{x:.3g}")


def _behind_text(cell: dict) -> str:
  where = f"x = {cell['x']:g} ({cell['study']}, {cell['stages']} stages)"
  if cell["verdict"] == "diverged":
    return f"the studies measured it diverge at {where}: {cell['diverged']} of {cell['runs']} runs"
  interval = f" [{cell['low']:+.3g}, {cell['high']:+.3g}]" if cell.get("low") is not None else ""
  return (f"the studies measured it behind its best baseline at {where}, by "
          f"{cell['gap']:+.3g}{interval} {cell['unit']} (95% CI over seeds): expect a gap")


def finding(method: str, x: float, momentum: float, ranges: dict | None = None) -> Finding:
  """What the studies measured of ``method`` at ``x = D_max (1 − β)`` and momentum ``β``.

  At a momentum outside those its cells were measured at, the delay is unmeasured. Else it holds
  where a study found it level at this ``x`` or a larger one; where not, the largest ``x`` at or
  below this one at which it was measured behind (or diverged) gives the gap to expect; where
  there is none, or no study measured the method, the delay is unmeasured, and no gap is
  claimed.
  """
  entry = (load() if ranges is None else ranges).get(method)
  if entry is None:
    return Finding(UNMEASURED, "no study has measured this method in a pipeline: its cost at this "
                   "delay is unmeasured")
  units = entry["units"].values()
  x = _at_three_figures(x)
  low, high = entry["momenta"]
  if not low - 1e-9 <= momentum <= high + 1e-9:
    return Finding(UNMEASURED, f"no study has measured it at momentum {momentum:.6g} (its cells "
                   f"span {low:.6g} to {high:.6g}): its cost at this delay is unmeasured")
  if any(u["holds_up_to"] is not None and x <= u["holds_up_to"] for u in units):
    return Finding(HOLDS, "within the range where a study found it level with its baseline")
  behind = [cell for u in units for cell in u["behind"] if cell["x"] <= x]
  if behind:
    return Finding(BEHIND, _behind_text(max(behind, key=lambda cell: cell["x"])))
  held = [u["holds_up_to"] for u in units if u["holds_up_to"] is not None]
  beyond = f"beyond x = {max(held):g}, the largest at which a study found it level, and " \
      if held else ""
  return Finding(UNMEASURED, f"{beyond}no study measured it behind at or below this x: its "
                 "cost here is unmeasured")
