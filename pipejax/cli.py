"""What the absl binaries of ``scripts/`` share: how a usage error reaches the user."""

from __future__ import annotations

import sys
from typing import Callable

from absl import app

EXIT_USAGE = 2  # a bad command line, as the shell's own builtins and scripts/train.py use it


def run(main: Callable[[list[str]], None], **kwargs) -> None:
  """``absl.app.run(main)``, with a usage error said in one line.

  absl prints the binary's whole help (its docstring and every flag: a hundred lines for
  scripts/schedule.py) above an ``app.UsageError``'s message, which then scrolls out of sight.
  Here the message comes alone, with the way to the help.
  """
  def main_with_usage_errors(argv):
    try:
      return main(argv)
    except app.UsageError as e:
      print(f"error: {e} (--help lists the flags.)", file=sys.stderr)
      sys.exit(EXIT_USAGE)

  app.run(main_with_usage_errors, **kwargs)
