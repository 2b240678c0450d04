"""What every figure of the project shares: a display-free pyplot, text every glyph of which is
drawn, and an atomic save in the format its file name ends in (``.png``, ``.pdf``, ``.svg``...).

A figure is written to a temporary file of its own beside its destination and renamed over it
(``pipejax.files``), so a reader, a kill mid-write or a second writer of the same figure (a study
and ``--report_only`` beside it) never sees or leaves half a PNG.

Text a study's labels bring (``'β₁ − 0.9'``, a label in Japanese) is drawn in DejaVu Sans, which
matplotlib ships; a character DejaVu Sans lacks is drawn in an installed font that has it, and
where none has it, drawn as '?' and named once in the log, never as an empty box with one of
matplotlib's warnings for each character and each figure.
"""

from __future__ import annotations

import functools
import logging
import os

from pipejax import files

MISSING_GLYPH = "?"
_reported: set[str] = set()  # the characters the log has already named, once per process


def pyplot():
  """matplotlib.pyplot on the file-only Agg backend (no display is ever needed)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def figure_suffixes() -> tuple[str, ...]:
  """The endings of the file names :func:`save` writes, each in its own format (a name without
  one is a PNG). PGF is left out: matplotlib writes it through a LaTeX installation."""
  from matplotlib import backend_bases  # pylint: disable=import-outside-toplevel
  return tuple(sorted(f".{name}" for name in backend_bases.FigureCanvasBase
                      .get_supported_filetypes() if name != "pgf"))


def save(fig, path: str, dpi: int = 110, rect: tuple = (0.0, 0.0, 1.0, 1.0)) -> None:
  """Makes every text of ``fig`` drawable (:func:`drawable_text`), lays it out within ``rect``
  (``tight_layout``'s, in figure coordinates), writes it to ``path`` atomically, in the format
  its ending names (:func:`figure_suffixes`; PNG without one), and closes it. The layout comes
  after the text is made drawable: laying out draws the text."""
  suffix = os.path.splitext(path)[1].lower() or ".png"
  try:
    drawable_text(fig)
    fig.tight_layout(rect=rect)
    with files.replacing(path, suffix=suffix) as tmp:
      # bbox_inches: so that a long axis label is not cut off
      fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format=suffix[1:])
  finally:
    pyplot().close(fig)


def drawable_text(fig) -> None:
  """Gives every text of ``fig`` a font for each of its characters: its own font, then an
  installed font that has the characters it lacks; a character no installed font has becomes
  :data:`MISSING_GLYPH`, and the log names it once per process."""
  from matplotlib import font_manager, text as text_lib  # pylint: disable=import-outside-toplevel
  for artist in fig.findobj(text_lib.Text):
    content = artist.get_text()
    if not content or content.isascii():
      continue
    own = font_manager.findfont(artist.get_fontproperties(), fallback_to_default=True)
    missing = {c for c in content if not c.isspace() and ord(c) not in _charmap(own)}
    if not missing:
      continue
    extra = [_font_with(c) for c in sorted(missing)]
    drawn = {c for c, family in zip(sorted(missing), extra) if family}
    if drawn:
      families = list(dict.fromkeys([*artist.get_fontfamily(), *filter(None, extra)]))
      artist.set_fontfamily(families)
    lost = missing - drawn
    if lost:
      artist.set_text("".join(MISSING_GLYPH if c in lost else c for c in content))
      new = "".join(sorted(lost - _reported))
      if new:
        _reported.update(new)
        logging.warning("Figures draw %r as %r: no installed font has these characters. Install "
                        "a font that has them (matplotlib then uses it), or give the study "
                        "labels without them.", new, MISSING_GLYPH * len(new))


@functools.lru_cache(maxsize=None)
def _charmap(path: str) -> frozenset[int]:
  """The code points the font file at ``path`` has glyphs for."""
  from matplotlib import ft2font  # pylint: disable=import-outside-toplevel
  try:
    return frozenset(ft2font.FT2Font(path).get_charmap())
  except (OSError, RuntimeError, ValueError):  # a font file matplotlib cannot read
    return frozenset()


@functools.lru_cache(maxsize=None)
def _font_with(character: str) -> str | None:
  """The family of an installed font that has ``character``, None if none has it. Matplotlib's
  'Last Resort' font is no such font: its glyph of every character is a box naming the script."""
  from matplotlib import font_manager  # pylint: disable=import-outside-toplevel
  for entry in sorted(font_manager.fontManager.ttflist, key=lambda e: e.fname):
    if not entry.name.startswith("Last Resort") and ord(character) in _charmap(entry.fname):
      return entry.name
  return None
