r"""The mechanism grid's report (``pipejax.analysis.mechanism_report``); trains nothing.

    python scripts/mechanism_report.py
    python scripts/mechanism_report.py --dir=docs/studies/mechanism \
        --results=docs/studies/lm_regime/results.jsonl,docs/studies/lm_depth/results.jsonl

Reads every ``mechanism.jsonl`` one level under ``--dir`` (each written by ``scripts/mechanism.py
--output_dir=DIR/NAME``, one method at one β1) and the study records ``--results`` that give each
method's final loss at the same depth and rate, and writes ``report.md`` and ``mechanism.png`` to
``--dir``. The grid the default directory holds is 12 runs: ``--config.method`` in pb, pb_sc,
pb_sc_lwp and pipeoptim, each at (b1, b2) = (0.9, 0.99), (0.99, 0.999) and (0.999, 0.9999), 32
stages, 2,000 sequences at rate 1e-3, each written to ``docs/studies/mechanism/METHOD_b1_B1``
(7 to 8 minutes a run on a 2-core CPU beside one trainer, 22 at load 8; about 1.5 hours for the
12 there). The first of them:

    python scripts/mechanism.py --config=configs/char_lm.py \
        --config.model_kwargs.blocks=30 --config.model_kwargs.width=64 \
        --config.method=pb --config.reference.momentum=0.9 --config.reference.b2=0.99 \
        --config.reference.lr=0.001 --sequences=2000 --points=10 \
        --output_dir=docs/studies/mechanism/pb_b1_0.9
"""

from __future__ import annotations

import os

from absl import app, flags

from pipejax import cli
from pipejax.analysis import mechanism_report

_DIR = flags.DEFINE_string("dir", "docs/studies/mechanism", "The runs' parent directory.")
_RESULTS = flags.DEFINE_list(
    "results", ["docs/studies/lm_regime/results.jsonl", "docs/studies/lm_depth/results.jsonl"],
    "Study records with the methods' final losses, in order of preference: a method's losses at "
    "a b1 come from the first that has it; those that do not exist are skipped.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments {argv[1:]}: give the directory with --dir.")
  if os.path.isdir(_DIR.value):  # one without runs is refused naming the command that makes them
    cli.check_output("dir", _DIR.value, directory=True)
  results = [path for path in _RESULTS.value if os.path.exists(path)]
  try:
    text = mechanism_report.report(_DIR.value, results)
  except mechanism_report.MechanismReportError as e:
    raise app.UsageError(str(e)) from None
  print(text)


if __name__ == "__main__":
  cli.run(main)
