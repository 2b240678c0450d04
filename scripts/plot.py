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

import json
import math
import os
import sys

from absl import app, flags

from pipejax import cli, metrics, plotting

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Training workdirs to compare.")
_LABELS = flags.DEFINE_list("labels", None, "Legend labels (default: the workdirs' names).")
_OUTPUT = flags.DEFINE_string("output", "curves.png", "The PNG to write.")
_TITLE = flags.DEFINE_string("title", None, "Figure title.")
_X = flags.DEFINE_enum("x", "epochs", ["epochs", "samples"], "Unit of the x axis.")
_Y = flags.DEFINE_enum("y", "zoom", ["zoom", "full"],
                       "'zoom': y limits from the later part of the runs; 'full': everything.")
_ZOOM_FROM = flags.DEFINE_float("zoom_from", 0.3, "With --y=zoom, the fraction of each run's "
                                "length before which points do not set the y limits.")
flags.mark_flag_as_required("workdirs")

METRIC_KEYS = ("loss", "accuracy")


def _read_json(path):
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def samples_per_epoch(workdir: str) -> int | None:
  """The training-set size of the run in ``workdir``, or None when the workdir does not say.

  A run limited to ``max_train_examples`` trains on that many; otherwise the summary's planned
  sample count over the configured epochs (exact up to one chunk of ticks over the whole run).
  """
  config = _read_json(os.path.join(workdir, "config.json")) or {}
  if config.get("max_train_examples"):
    return int(config["max_train_examples"])
  summary = _read_json(os.path.join(workdir, "summary.json")) or {}
  if summary.get("total_samples") and config.get("epochs"):
    return max(1, round(summary["total_samples"] / config["epochs"]))
  return None


def curves(records, key: str, split: str, scale: float) -> tuple[list[float], list[float]]:
  """(x, y) of one metric of one split, x in samples divided by ``scale``."""
  points = [(r["samples"] / scale, r[key]) for r in records
            if r.get("split") == split and key in r and r[key] is not None
            and math.isfinite(r[key])]
  return tuple(map(list, zip(*points))) if points else ([], [])


def zoomed_limits(series, zoom_from: float, log: bool) -> tuple[float, float] | None:
  """y limits covering every series' points after ``zoom_from`` of its own x range, padded.

  ``series`` is a list of (x, y) pairs; None when no point qualifies.
  """
  values = []
  for xs, ys in series:
    if xs:
      start = xs[0] + zoom_from * (xs[-1] - xs[0])
      values += [y for x, y in zip(xs, ys) if x >= start and (y > 0 or not log)]
  if not values:
    return None
  lo, hi = min(values), max(values)
  if log:
    pad = max((math.log10(hi) - math.log10(lo)) * 0.1, 0.02)
    return 10 ** (math.log10(lo) - pad), 10 ** (math.log10(hi) + pad)
  pad = max((hi - lo) * 0.1, 0.005)
  return lo - pad, hi + pad


def plot(runs: dict[str, list[dict]], scales: dict[str, float], path: str, x_label: str,
         zoom_from: float | None, title: str | None = None) -> None:
  """One panel per metric; ``zoom_from`` None shows every point, else zooms as the flag says."""
  plt = plotting.pyplot()
  fig, axes = plt.subplots(1, len(METRIC_KEYS), figsize=(5.5 * len(METRIC_KEYS), 4),
                           squeeze=False)
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax, key in zip(axes[0], METRIC_KEYS):
    log = key == "loss"
    drawn = []
    for (label, records), colour in zip(runs.items(), colours * 10):
      for split, style in (("train", dict(lw=0.8, alpha=0.6)),
                           ("test", dict(lw=2, marker="o", ms=3))):
        xs, ys = curves(records, key, split, scales[label])
        if xs:
          ax.plot(xs, ys, color=colour, label=f"{label} ({split})", **style)
          drawn.append((xs, ys))
    ax.set_xlabel(x_label)
    ax.set_xlim(left=0)
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    if log:
      ax.set_yscale("log")
    limits = None if zoom_from is None else zoomed_limits(drawn, zoom_from, log)
    if limits:
      ax.set_ylim(*limits)
  axes[0][-1].legend(fontsize=8)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  plotting.save(fig, path, dpi=110)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
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
    sizes = {label: samples_per_epoch(w) for label, w in zip(labels, _WORKDIRS.value)}
    unknown = [w for w, label in zip(_WORKDIRS.value, labels) if sizes[label] is None]
    if unknown:
      print(f"note: {', '.join(unknown)} do not say their training-set size (no summary.json "
            "yet: a run in progress?); plotting against samples.", file=sys.stderr)
    else:
      scales, x_label = sizes, "epochs"
  plot(runs, scales, _OUTPUT.value, x_label,
       None if _Y.value == "full" else _ZOOM_FROM.value, title=_TITLE.value)
  print(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
  cli.run(main)
