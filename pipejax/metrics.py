"""Training metrics: JSONL (the record of truth), TensorBoard event files, and PNG plots."""

from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

from pipejax import plotting

METRICS_FILE = "metrics.jsonl"


def read_records(workdir: str) -> list[dict]:
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  records = []
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        try:
          records.append(json.loads(line))
        except json.JSONDecodeError:
          continue  # a line cut short by a kill; everything before it is intact
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
    self._file = open(self.path, "a")
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
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      for r in records:
        f.write(json.dumps(r) + "\n")
    os.replace(tmp, self.path)

  def has_record(self, split: str, samples: int) -> bool:
    """Whether a ``split`` record at ``samples`` was kept from before a resume."""
    return self.enabled and (split, samples) in self._kept

  def write(self, split: str, samples: int, **scalars) -> None:
    if not self.enabled:
      return
    record = {"split": split, "samples": int(samples), **{k: _plain(v) for k, v in scalars.items()}}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
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
      self._tensorboard.flush()

  def close(self) -> None:
    if not self.enabled:
      return
    self._file.close()
    self._tensorboard.close()


HPARAMS_RUN = "hparams"  # the sub-directory of workdir/tensorboard with the settings and results


def _plain(value):
  if isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) > 0:
    return [_plain(v) for v in value]
  try:
    return float(value) if not isinstance(value, (int, str, bool)) else value
  except TypeError:
    return str(value)


def plot_runs(runs: dict[str, Sequence[dict]], path: str, title: str | None = None,
              keys: Iterable[str] = ("loss", "accuracy")) -> None:
  """One PNG with a panel per metric: train (thin) and test (thick, dots) curves of every run."""
  plt = plotting.pyplot()
  keys = list(keys)
  fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False)
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for (label, records), colour in zip(runs.items(), colours * 10):
    for ax, key in zip(axes[0], keys):
      for split, style in (("train", dict(lw=0.8, alpha=0.6)), ("test", dict(lw=2, marker="o",
                                                                             ms=3))):
        points = [(r["samples"], r[key]) for r in records if r.get("split") == split and key in r]
        if points:
          xs, ys = zip(*points)
          ax.plot(xs, ys, color=colour, label=f"{label} ({split})", **style)
  for ax, key in zip(axes[0], keys):
    ax.set_xlabel("training samples")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    if key == "loss":
      ax.set_yscale("log")
  axes[0][-1].legend(fontsize=8)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  plotting.save(fig, path, dpi=110)
