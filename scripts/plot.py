r"""Compares training runs: the loss and accuracy curves of several workdirs in one PNG.

    python scripts/plot.py --workdirs=runs/default,runs/pb,runs/sgd --output=compare.png
    python scripts/plot.py --workdirs=runs/pb,runs/sgd --labels="PB,SGD" --output=compare.png
    python scripts/plot.py --workdirs=runs/pb,runs/sgd --x=samples --y=full --output=all.png

Each workdir's ``metrics.jsonl`` is read (train curves thin, test curves thick with dots). The x
axis is in epochs (samples over the training-set size, which the workdir's ``config.json`` and
``summary.json`` give). The y axes show where the runs differ: their limits are set by the part
of every run after ``--zoom_from`` of its length, so the steep start of training, where all
methods look alike, does not squash the end, where they differ. ``--y=full`` shows everything.
"""

import os
import sys

from absl import app, flags

from pipejax import cli, plotting
from pipejax.train import metrics

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Training workdirs to compare.")
_LABELS = flags.DEFINE_list("labels", None, "Legend labels (default: the workdirs' names).")
_OUTPUT = flags.DEFINE_string("output", "curves.png", "The figure to write, in the format its "
                              "name ends in (.png, .pdf, .svg, ...).")
_TITLE = flags.DEFINE_string("title", None, "Figure title.")
_X = flags.DEFINE_enum("x", "epochs", ["epochs", "samples"], "Unit of the x axis.")
_Y = flags.DEFINE_enum("y", "zoom", ["zoom", "full"],
                       "'zoom': y limits from the later part of the runs; 'full': everything.")
_ZOOM_FROM = flags.DEFINE_float("zoom_from", 0.3, "With --y=zoom, the fraction of each run's "
                                "length before which points do not set the y limits.")
flags.mark_flag_as_required("workdirs")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  cli.check_output("output", _OUTPUT.value, suffixes=plotting.figure_suffixes())
  labels = _LABELS.value or [os.path.basename(os.path.normpath(w)) for w in _WORKDIRS.value]
  if len(labels) != len(_WORKDIRS.value):
    raise app.UsageError(f"{len(labels)} labels for {len(_WORKDIRS.value)} workdirs.")
  if not 0 <= _ZOOM_FROM.value < 1:
    raise app.UsageError(f"--zoom_from must be in [0, 1); got {_ZOOM_FROM.value}.")
  runs = {}
  for label, workdir in zip(labels, _WORKDIRS.value):
    records = metrics.read_records(workdir)
    if not records:
      raise app.UsageError(f"{workdir} has no {metrics.METRICS_FILE}: is it a training workdir? "
                           "Train with scripts/train.py --workdir=... first.")
    runs[label] = records
  scales = dict.fromkeys(labels, 1)
  x_label = "training samples"
  if _X.value == "epochs":
    sizes = {label: metrics.samples_per_epoch(w) for label, w in zip(labels, _WORKDIRS.value)}
    unknown = [w for w, label in zip(_WORKDIRS.value, labels) if sizes[label] is None]
    if unknown:
      print(f"note: {', '.join(unknown)} do not say their training-set size (no summary.json "
            "yet: a run in progress?); plotting against samples.", file=sys.stderr)
    else:
      scales, x_label = sizes, "epochs"
  metrics.plot_runs(runs, _OUTPUT.value, title=_TITLE.value, scales=scales, x_label=x_label,
                    zoom_from=None if _Y.value == "full" else _ZOOM_FROM.value)
  print(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
  cli.run(main)
