r"""Trains a network with pipelined backpropagation (or a rival method) and evaluates it.

    python scripts/train.py --config=configs/default.py --workdir=runs/default
    python scripts/train.py --config=configs/default.py --config.method=pb --workdir=runs/pb
    python scripts/train.py --config=configs/default.py:smoke --workdir=/tmp/smoke

A workdir that holds a checkpoint is resumed. SIGTERM or Ctrl-C saves a checkpoint and exits;
rerunning the same command continues bit-exactly where it stopped.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from pipejax import training

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")
flags.mark_flags_as_required(["config", "workdir"])


class _HideOrbaxChatter:
  """orbax logs every file it renames at INFO; keep its warnings, drop the rest."""

  def filter(self, record):
    return record.levelno >= 30 or "/orbax/" not in record.pathname


def main(argv):
  logging.get_absl_handler().addFilter(_HideOrbaxChatter())
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    summary = training.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except training.USER_ERRORS as e:
    logging.error("%s: %s", type(e).__name__, e)
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  if summary["stopped_by"]:
    print(f"STOPPED by {summary['stopped_by']} after {summary['samples']} samples; rerun to resume.")
  else:
    print(f"FINAL test_accuracy={summary['test_accuracy']:.4f} test_loss={summary['test_loss']:.4f} "
          f"method={summary['method']} samples={summary['samples']} "
          f"seconds={summary['train_seconds']:.0f}")


if __name__ == "__main__":
  app.run(main)
