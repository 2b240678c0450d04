"""Training metrics: JSONL (the record of truth), TensorBoard event files, and PNG plots."""

from __future__ import annotations

import json
import math
import os
from typing import Iterable, Sequence

from pipejax import files
from pipejax import plotting

METRICS_FILE = "metrics.jsonl"


def format_duration(seconds: float) -> str:
  """``1h02m03s`` or ``2m03s`` for a progress line; ``?`` when no rate is known yet."""
  if not math.isfinite(seconds):
    return "?"
  seconds = max(0, int(seconds))
  return (f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s" if seconds >= 3600
          else f"{seconds // 60}m{seconds % 60:02d}s")


def read_records(workdir: str) -> list[dict]:
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  records = []
  with open(path, errors="replace") as f:  # bytes a crash left are no text: skipped below
    for line in f:
      line = line.strip()
      if line:
        try:
          record = json.loads(line)
        except json.JSONDecodeError:
          continue  # a line cut short by a kill; everything before it is intact
        if isinstance(record, dict):  # else a damaged line that happens to parse
          records.append(record)
  return records


class MetricsWriter:
  """Appends records to ``workdir/metrics.jsonl`` and TensorBoard event files.

  On resume, records past the checkpoint's sample count (written by the run that was stopped
  after its last checkpoint) are dropped, so the curves have no duplicates. TensorBoard's files are
  then rebuilt from ``metrics.jsonl`` (the record of truth): a killed process may have left its
  event file short, empty or ahead of the checkpoint. :meth:`flush` (called at every checkpoint)
  puts everything written so far on disk.
  """

  def __init__(self, workdir: str, resume_samples: int | None = None, enabled: bool = True):
    self.path = os.path.join(workdir, METRICS_FILE)
    self.enabled = enabled
    if not enabled:  # another process writes
      return
    kept = []
    if resume_samples is not None:
      kept = [r for r in read_records(workdir) if r.get("samples", 0) <= resume_samples]
      self._rewrite(kept)
    elif os.path.exists(self.path):
      self._rewrite([])
    self._kept = {(r.get("split"), r.get("samples")) for r in kept}
    from tensorboardX import SummaryWriter  # imported here: only the trainer needs it
    tensorboard_dir = os.path.join(workdir, "tensorboard")
    if os.path.isdir(tensorboard_dir):
      for name in os.listdir(tensorboard_dir):
        if name.startswith("events."):
          os.remove(os.path.join(tensorboard_dir, name))
    self._tensorboard = SummaryWriter(tensorboard_dir)
    for record in kept:
      self._add_scalars(record)
    self._tensorboard.flush()

  def _rewrite(self, records):
    files.write(self.path, "".join(json.dumps(r) + "\n" for r in records))

  def has_record(self, split: str, samples: int) -> bool:
    """Whether a ``split`` record at ``samples`` was kept from before a resume."""
    return self.enabled and (split, samples) in self._kept

  def write(self, split: str, samples: int, **scalars) -> None:
    if not self.enabled:
      return
    record = {"split": split, "samples": int(samples), **{k: _plain(v) for k, v in scalars.items()}}
    files.append(self.path, json.dumps(record) + "\n", sync=False)
    self._add_scalars(record)

  def _add_scalars(self, record: dict) -> None:
    for key, value in record.items():
      if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "samples":
        self._tensorboard.add_scalar(f"{record['split']}/{key}", value, int(record["samples"]))
      elif isinstance(value, list):  # one value per stage
        for s, v in enumerate(value):
          self._tensorboard.add_scalar(f"{record['split']}/{key}/stage_{s:02d}", v,
                                       int(record["samples"]))

  def write_hparams(self, hparams: dict, results: dict) -> None:
    """The run's settings beside its final results, for TensorBoard's HParams tab.

    Written once, when a run finishes (a rerun of a finished run writes it again, in place), so
    that the runs of a sweep or a study can be compared side by side by their settings.
    """
    if not self.enabled:
      return
    hparams_dir = os.path.join(self._tensorboard.logdir, HPARAMS_RUN)
    if os.path.isdir(hparams_dir):
      for name in os.listdir(hparams_dir):
        if name.startswith("events."):
          os.remove(os.path.join(hparams_dir, name))
    # TensorBoard takes numbers, strings and booleans; tuples (e.g. hidden widths) become text.
    plain = {k: v if isinstance(v, (bool, int, float, str)) else str(v)
             for k, v in hparams.items()}
    self._tensorboard.add_hparams(plain, {f"hparam/{k}": float(v) for k, v in results.items()},
                                  name=HPARAMS_RUN)

  def flush(self) -> None:
    """Puts every record written so far on disk (TensorBoard buffers its events)."""
    if self.enabled:
      if os.path.exists(self.path):
        files.sync(self.path)
      self._tensorboard.flush()

  def close(self) -> None:
    if not self.enabled:
      return
    if os.path.exists(self.path):
      files.sync(self.path)
    self._tensorboard.close()


HPARAMS_RUN = "hparams"  # the sub-directory of workdir/tensorboard with the settings and results


def _plain(value):
  if isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) > 0:
    return [_plain(v) for v in value]
  try:
    return float(value) if not isinstance(value, (int, str, bool)) else value
  except TypeError:
    return str(value)


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


def _read_json(path):
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def curve(records, key: str, split: str, scale: float = 1) -> tuple[list[float], list[float]]:
  """(x, y) of one metric of one split, x in samples divided by ``scale``; no missing or
  non-finite points."""
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


def plot_runs(runs: dict[str, Sequence[dict]], path: str, title: str | None = None,
              keys: Iterable[str] = ("loss", "accuracy"), scales: dict[str, float] | None = None,
              x_label: str = "training samples", zoom_from: float | None = None) -> None:
  """One PNG with a panel per metric: train (thin) and test (thick, dots) curves of every run.

  Args:
    runs: each run's metrics records, by label.
    path: the PNG to write (atomically).
    title: the figure's title.
    keys: the metrics, one panel each; ``loss`` on a log axis.
    scales: per label, what the x axis divides samples by (a training-set size: epochs);
      default 1.
    x_label: the x axis's label.
    zoom_from: None shows every point; else the y limits cover only each run's points after
      this fraction of its length (:func:`zoomed_limits`), where runs differ.
  """
  plt = plotting.pyplot()
  keys = list(keys)
  fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False)
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax, key in zip(axes[0], keys):
    log = key == "loss"
    drawn = []
    for (label, records), colour in zip(runs.items(), colours * 10):
      for split, style in (("train", dict(lw=0.8, alpha=0.6)),
                           ("test", dict(lw=2, marker="o", ms=3))):
        xs, ys = curve(records, key, split, (scales or {}).get(label, 1))
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
  plotting.save(fig, path, dpi=110)
