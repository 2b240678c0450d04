"""What every figure of the project shares: a display-free pyplot and an atomic save.

A figure is written to a temporary file beside its destination and renamed over it, so a reader
(or a kill mid-write) never sees half a PNG.
"""

from __future__ import annotations

import os


def pyplot():
  """matplotlib.pyplot on the file-only Agg backend (no display is ever needed)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def save(fig, path: str, dpi: int = 110) -> None:
  """Writes ``fig`` to ``path`` atomically and closes it."""
  tmp = f"{path}.tmp{os.path.splitext(path)[1]}"
  try:
    fig.savefig(tmp, dpi=dpi, bbox_inches="tight")  # so that a long axis label is not cut off
    os.replace(tmp, path)
  finally:
    pyplot().close(fig)
    if os.path.exists(tmp):
      os.remove(tmp)
