r"""Prints (or draws) the pipeline's tick x stage schedule and the per-stage accounting table.

    python scripts/schedule.py --num_stages=4
    python scripts/schedule.py --num_stages=4 --format=json
    python scripts/schedule.py --num_stages=6 --micro_batches=4 --output=/tmp/sync.png

Each grid cell shows the sample a stage forwards (F) and the sample it backwards (B) in that tick.
``--micro_batches=M`` shows the synchronous mode (GPipe / 1F1B-flush): groups of M micro-batches
separated by 2(S-1) empty ticks. Stashed bytes assume every stage's input is ``--activation_size``
numbers of ``--dtype_bytes`` bytes per sample, times ``--micro_batch_size``.
"""

import json

from absl import app, flags

from pipejax import accounting

_NUM_STAGES = flags.DEFINE_integer("num_stages", 4, "Number of pipeline stages S.")
_TICKS = flags.DEFINE_integer("ticks", None, "Ticks to show (default 3 S, or two sync steps).")
_MICRO_BATCHES = flags.DEFINE_integer("micro_batches", None,
                                      "Synchronous mode with M micro-batches per step; "
                                      "unset: asynchronous Pipelined Backpropagation.")
_MICRO_BATCH_SIZE = flags.DEFINE_integer("micro_batch_size", 1, "Samples per micro-batch b.")
_ACTIVATION_SIZE = flags.DEFINE_integer("activation_size", 256,
                                        "Numbers per sample in every stage's input.")
_DTYPE_BYTES = flags.DEFINE_integer("dtype_bytes", 4, "Bytes per number (4: float32).")
_FORMAT = flags.DEFINE_enum("format", "text", ["text", "json"], "Output format.")
_OUTPUT = flags.DEFINE_string("output", None, "Also draw the grid into this PNG file.")


def sync_grid(num_stages, micro_batches, num_ticks):
  """Like accounting.schedule_grid, with the bubbles of the synchronous mode left empty."""
  cycle = micro_batches + accounting.bubble_ticks(num_stages, micro_batches)
  grid = accounting.schedule_grid(num_stages, num_ticks)

  def sample(entered_at):
    if entered_at is None or entered_at % cycle >= micro_batches:
      return None
    return (entered_at // cycle) * micro_batches + entered_at % cycle

  return [[(sample(f), sample(b)) for f, b in row] for row in grid]


def summary(num_stages, micro_batches, micro_batch_size, activation_size, dtype_bytes):
  delays = accounting.stage_delays(num_stages)
  slots = accounting.stash_slots(num_stages)
  per_stage_bytes = [n * micro_batch_size * activation_size * dtype_bytes for n in slots]
  return {
      "num_stages": num_stages,
      "mode": "pb" if micro_batches is None else f"sync(M={micro_batches})",
      "delays": delays,
      "stash_slots": slots,
      "stash_bytes_per_stage": per_stage_bytes,
      "stash_bytes": sum(per_stage_bytes),
      "fill_ticks": accounting.fill_ticks(num_stages),
      "bubble_ticks_per_step": accounting.bubble_ticks(num_stages, micro_batches),
      "utilization": accounting.utilization(num_stages, micro_batches),
  }


def format_grid(grid):
  def cell(fb):
    f, b = fb
    return f"{'F' + str(f) if f is not None else '  .':>4} {'B' + str(b) if b is not None else '  .':>4}"

  num_stages = len(grid[0])
  lines = ["tick | " + " | ".join(f"stage {s:<4}" for s in range(num_stages))]
  lines += [f"{t:4d} | " + " | ".join(cell(c) for c in row) for t, row in enumerate(grid)]
  return "\n".join(lines)


def draw_grid(grid, path, title):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  num_ticks, num_stages = len(grid), len(grid[0])
  fig, ax = plt.subplots(figsize=(max(6, 0.45 * num_ticks), 1 + 0.6 * num_stages))
  for t, row in enumerate(grid):
    for s, (f, b) in enumerate(row):
      # Upper half: forward, lower half: backward; colour by sample so a sample can be followed.
      for sample, y0, label in ((f, s, "F"), (b, s + 0.5, "B")):
        colour = plt.cm.tab20(sample % 20) if sample is not None else (0.93, 0.93, 0.93, 1)
        ax.add_patch(plt.Rectangle((t, y0), 1, 0.5, facecolor=colour, edgecolor="white"))
        if sample is not None:
          ax.text(t + 0.5, y0 + 0.25, f"{label}{sample}", ha="center", va="center", fontsize=7)
  ax.set_xlim(0, num_ticks)
  ax.set_ylim(num_stages, 0)
  ax.set_yticks(np.arange(num_stages) + 0.5, [f"stage {s}" for s in range(num_stages)])
  ax.set_xlabel("tick (upper half: forward, lower half: backward; colour: sample)")
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  num_stages, m = _NUM_STAGES.value, _MICRO_BATCHES.value
  if num_stages < 1:
    raise app.UsageError(f"--num_stages must be at least 1; got {num_stages}.")
  if m is not None and m < 1:
    raise app.UsageError(f"--micro_batches must be at least 1; got {m}.")
  default_ticks = 3 * num_stages if m is None else 2 * (m + 2 * (num_stages - 1))
  num_ticks = _TICKS.value or default_ticks
  grid = (accounting.schedule_grid(num_stages, num_ticks) if m is None
          else sync_grid(num_stages, m, num_ticks))
  info = summary(num_stages, m, _MICRO_BATCH_SIZE.value, _ACTIVATION_SIZE.value,
                 _DTYPE_BYTES.value)
  if _OUTPUT.value:
    draw_grid(grid, _OUTPUT.value, f"S = {num_stages}, {info['mode']}, "
              f"utilization {info['utilization']:.2f}")
  if _FORMAT.value == "json":
    info["grid"] = [[{"forward": f, "backward": b} for f, b in row] for row in grid]
    print(json.dumps(info))
    return
  print(format_grid(grid))
  print()
  print("stage | delay D_s | stash slots | stash bytes")
  for s in range(num_stages):
    print(f"{s:5d} | {info['delays'][s]:9d} | {info['stash_slots'][s]:11d} | "
          f"{info['stash_bytes_per_stage'][s]:11d}")
  print(f"total stashed activations: {info['stash_bytes']} bytes; mode {info['mode']}: "
        f"fill {info['fill_ticks']} ticks, {info['bubble_ticks_per_step']} bubble ticks per step, "
        f"utilization {info['utilization']:.3f}")
  if _OUTPUT.value:
    print(f"grid drawn to {_OUTPUT.value}")


if __name__ == "__main__":
  app.run(main)
