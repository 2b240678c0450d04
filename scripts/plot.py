r"""Overlays the loss and accuracy curves of several training workdirs in one PNG.

    python scripts/plot.py --workdirs=runs/pb,runs/pb_sc_lwp,runs/sgd --output=compare.png
    python scripts/plot.py --workdirs=runs/pb,runs/sgd --labels="PB,SGD" --output=compare.png

Each workdir's ``metrics.jsonl`` is read (train curves thin, test curves thick with dots).
"""

import os

from absl import app, flags

from pipejax import metrics

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Training workdirs to compare.")
_LABELS = flags.DEFINE_list("labels", None, "Legend labels (default: the workdirs' names).")
_OUTPUT = flags.DEFINE_string("output", "curves.png", "The PNG to write.")
_TITLE = flags.DEFINE_string("title", None, "Figure title.")
flags.mark_flag_as_required("workdirs")


def main(argv):
  del argv
  labels = _LABELS.value or [os.path.basename(os.path.normpath(w)) for w in _WORKDIRS.value]
  if len(labels) != len(_WORKDIRS.value):
    raise app.UsageError(f"{len(labels)} labels for {len(_WORKDIRS.value)} workdirs.")
  runs = {}
  for label, workdir in zip(labels, _WORKDIRS.value):
    records = metrics.read_records(workdir)
    if not records:
      raise app.UsageError(f"{workdir} has no {metrics.METRICS_FILE}: is it a training workdir? "
                           "Train with scripts/train.py --workdir=... first.")
    runs[label] = records
  metrics.plot_runs(runs, _OUTPUT.value, title=_TITLE.value)
  print(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
  app.run(main)
