r"""The phase diagram over the depth studies' records (``pipejax.analysis.phase``); trains nothing.

    python scripts/phase_diagram.py
    python scripts/phase_diagram.py --studies=docs/studies/depth,docs/studies/lm_depth \
        --out=/tmp/phase
    python scripts/phase_diagram.py --safe_ranges=pipejax/methods/safe_ranges.json

Reads each study workdir's ``results.jsonl`` (and its ``limits.jsonl`` of curvature readings,
where there is one) and writes ``report.md`` (the baselines, one table per unit, the figure and
what it shows) and ``phase.png`` to ``--out``, each replaced atomically. A study's unit comes from
its study file, ``configs/studies/NAME.py`` for ``docs/studies/NAME``; give another as
``WORKDIR=STUDY_FILE``. A workdir that does not exist is skipped with a one-line note. Run from
the repository root. A 256-stage cell's prediction solves a Lyapunov equation of order about
1,000, up to a minute each on a CPU core, so the default studies take a few minutes.
``--safe_ranges=PATH`` also writes what the studies measured of each method's delay to PATH
(``pipejax/methods/safe_ranges.json`` is the file a run's start-up warning reads:
``pipejax.analysis.safe_range.write_ranges``).
"""

from __future__ import annotations

import os
import shlex
import sys

from absl import app, flags

from pipejax import cli, files
from pipejax.analysis import phase, safe_range

DEFAULT_STUDIES = phase.DEFAULT_STUDIES
FIGURE = "phase.png"

_STUDIES = flags.DEFINE_list("studies", list(DEFAULT_STUDIES),
                             "Study workdirs (WORKDIR or WORKDIR=STUDY_FILE), comma-separated.")
_OUT = flags.DEFINE_string("out", "docs/studies/phase", "Where report.md and phase.png go.")
_SAFE_RANGES = flags.DEFINE_string(
    "safe_ranges", "", "Also write each method's measured delay range here (the start-up "
    "warning reads pipejax/methods/safe_ranges.json); '' writes none.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments {argv[1:]}: give the studies with --studies.")
  # Before the records are read (a minute of CPU); nothing is made until they draw something.
  cli.check_output("out", _OUT.value, directory=True, make=False)
  if _SAFE_RANGES.value:
    cli.check_output("safe_ranges", _SAFE_RANGES.value, make=False)
  try:
    sources, notes = phase.read_studies(_STUDIES.value)
  except phase.StudyMismatchError as e:
    raise app.UsageError(str(e)) from None
  for note in notes:
    print(note, file=sys.stderr)
  rows = phase.phase_rows(sources)
  if not rows:
    raise app.UsageError(
        f"No finished or diverged run of a pipelined method in {', '.join(_STUDIES.value)}: "
        "nothing to draw. Give study workdirs that hold such runs with --studies.")
  cli.check_output("out", _OUT.value, directory=True)
  if _SAFE_RANGES.value:
    cli.check_output("safe_ranges", _SAFE_RANGES.value)
  if _SAFE_RANGES.value:
    print(f"Measured delay ranges to {safe_range.write_ranges(rows, _SAFE_RANGES.value)}")
  os.makedirs(_OUT.value, exist_ok=True)
  phase.draw(rows, os.path.join(_OUT.value, FIGURE))
  command = "python scripts/phase_diagram.py" + (
      "" if tuple(_STUDIES.value) == DEFAULT_STUDIES else
      f" --studies={shlex.quote(','.join(_STUDIES.value))}") + (
      "" if _OUT.value == _OUT.default else f" --out={shlex.quote(_OUT.value)}")
  files.write(os.path.join(_OUT.value, "report.md"), phase.report(rows, notes, FIGURE, command))
  print(f"{len(rows)} cells of {len(sources)} studies to {_OUT.value}/report.md and {FIGURE}")


if __name__ == "__main__":
  cli.run(main)
