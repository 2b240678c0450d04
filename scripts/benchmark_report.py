r"""Renders the recorded benchmark JSON files into one markdown report.

``docs/benchmarks/*.json`` are written by ``scripts/benchmark.py --output=...``; this writes
``docs/benchmarks/README.md`` from them, byte for byte the same each time
(``pipejax/profiling/report.py``):

    python scripts/benchmark_report.py                 # rewrite docs/benchmarks/README.md
    python scripts/benchmark_report.py --check         # exit 1 if the report is stale
    python scripts/benchmark_report.py --folder=/tmp/b # the report of another folder of JSON files
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from absl import app
from absl import flags

from pipejax import cli
from pipejax.profiling import report

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FOLDER = flags.DEFINE_string("folder", os.path.join(_ROOT, "docs", "benchmarks"),
                              "Folder of benchmark JSON files; the report is written beside them.")
_CHECK = flags.DEFINE_bool("check", False, "Write nothing; exit with status 1 if the folder's "
                           f"{report.REPORT_NAME} differs from what its JSON files render to.")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  path = report.report_path(_FOLDER.value)
  if not _CHECK.value:
    cli.check_output("folder", _FOLDER.value, directory=True)
  try:
    current = report.is_current(_FOLDER.value) if _CHECK.value else None
    if _CHECK.value and not current:
      print(f"{path} is out of date: run `python scripts/benchmark_report.py`.", file=sys.stderr)
      sys.exit(1)
    if _CHECK.value:
      print(f"{path} is up to date.", file=sys.stderr)
      return
    print(f"wrote {report.write(_FOLDER.value)}", file=sys.stderr)
  except ValueError as e:
    raise app.UsageError(str(e)) from e


if __name__ == "__main__":
  cli.run(main)
