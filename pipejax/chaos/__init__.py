"""Fault injection: kills and corrupted checkpoints never turn into a different result with exit 0.

``scripts/chaos.py`` runs these trials; its docstring says what each one does. A trial compares a
rerun with an uninterrupted reference and returns a verdict: exact, refused naming the damaged
step, or a failure starting with ``FAIL``.

* :mod:`~pipejax.chaos.trainer`: one trainer process killed (SIGTERM or SIGKILL) or its newest
  checkpoint damaged;
* :mod:`~pipejax.chaos.two_process`: a run of two processes, one started with a different config
  or killed;
* :mod:`~pipejax.chaos.study`: the study launcher killed, one of its trainers killed, or its
  results file cut;
* :mod:`~pipejax.chaos.lm`: the language model's set-ups for the trainer's and the two-process
  trials.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ReferenceFailed(RuntimeError):
  """The uninterrupted reference run failed: no trial can be judged against it."""


def child_env(**extra) -> dict:
  """The environment of a trainer or study process: unbuffered, importing this checkout."""
  return dict(os.environ, PYTHONUNBUFFERED="1",
              PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


def python(script: str) -> list[str]:
  """The command line that starts ``scripts/<script>`` with this interpreter."""
  return [sys.executable, os.path.join(ROOT, "scripts", script)]
