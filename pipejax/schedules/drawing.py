"""Pictures of schedules: the engine's tick x stage grid (text or PNG), a simulated Gantt chart,
and the figures of each as text tables.

A *grid* is one row per tick, one ``(forward sample, backward sample)`` pair per stage, None where
the stage idles (``pipejax.core.accounting.schedule_grid``). A Gantt chart draws the timeline of a
:class:`pipejax.schedules.Report`. The PNGs are written with :func:`pipejax.plotting.save`.
"""

from __future__ import annotations

from typing import Optional, Sequence

from pipejax import plotting
from pipejax.schedules.plans import SCHEDULES
from pipejax.schedules.report import Report

Grid = Sequence[Sequence[tuple[Optional[int], Optional[int]]]]

_COLOURS = {"F": "#9ecae1", "B": "#fdae6b", "W": "#a1d99b"}


def format_grid(grid: Grid) -> str:
  """The grid as a text table: one line per tick, ``F<sample> B<sample>`` per stage."""
  def cell(fb):
    f, b = ("  ." if sample is None else f"{kind}{sample}" for kind, sample in zip("FB", fb))
    return f"{f:>4} {b:>4}"

  num_stages = len(grid[0])
  lines = ["tick | " + " | ".join(f"stage {s:<4}" for s in range(num_stages))]
  lines += [f"{t:4d} | " + " | ".join(cell(c) for c in row) for t, row in enumerate(grid)]
  return "\n".join(lines)


def format_mode_summary(info: dict) -> str:
  """:func:`pipejax.core.accounting.mode_summary` as a table, one line per stage, and its totals."""
  lines = ["stage | delay D_s | inputs in flight | buffer slots | stashed bytes"]
  lines += [f"{s:5d} | {info['delays'][s]:9d} | {info['stash_slots'][s]:16d} | "
            f"{info['buffer_slots'][s]:12d} | {info['stash_bytes_per_stage'][s]:13d}"
            for s in range(info["num_stages"])]
  lines.append(f"total stashed activations: {info['stash_bytes']} bytes; mode {info['mode']}: "
               f"fill {info['fill_ticks']} ticks, {info['bubble_ticks_per_step']} bubble ticks "
               f"per step, utilization {info['utilization']:.3f}")
  return "\n".join(lines)


def format_report(report: Report, unit: str) -> str:
  """A simulated schedule's figures as text: its totals, then one line per device."""
  lines = [f"{report.title}: {report.num_devices} devices, m = {report.micro_batches}",
           f"throughput {report.throughput:.6g} samples per {unit}; bubble rate "
           f"{report.bubble_rate:.4f} (idle / busy), bubble fraction {report.bubble_fraction:.4f}, "
           f"utilization {report.utilization:.4f}",
           "device | layers | F | B | W | bubble rate | peak activations | weight versions | delay"]
  for d in range(report.num_devices):
    c, layers = report.device_costs[d], report.device_layers[d]
    span = f"{layers[0]}-{layers[-1]}" if layers else "-"
    lines.append(f"{d:6d} | {span:>6} | {c['forward']:.4g} | {c['input_grad']:.4g} | "
                 f"{c['weight_grad']:.4g} | {report.bubble_rate_per_device[d]:11.4f} | "
                 f"{report.peak_activations[d]:16d} | {report.weight_versions[d]:15d} | "
                 f"{report.delays[d]:5d}")
  return "\n".join(lines)


def draw_grid(grid: Grid, path: str, title: str) -> None:
  """Writes the grid as a PNG: ticks across, stages down, each cell's forward above its backward."""
  plt = plotting.pyplot()
  num_ticks, num_stages = len(grid), len(grid[0])
  fig, ax = plt.subplots(figsize=(max(6, 0.45 * num_ticks), 1 + 0.6 * num_stages))
  for t, row in enumerate(grid):
    for s, (f, b) in enumerate(row):
      # Upper half: forward, lower half: backward; every busy cell is labelled with its sample.
      for sample, y0, label in ((f, s, "F"), (b, s + 0.5, "B")):
        colour = _COLOURS[label] if sample is not None else (0.95, 0.95, 0.95, 1)
        ax.add_patch(plt.Rectangle((t, y0), 1, 0.5, facecolor=colour, edgecolor="white"))
        if sample is not None:
          ax.text(t + 0.5, y0 + 0.25, f"{label}{sample}", ha="center", va="center", fontsize=7)
  ax.set_xlim(0, num_ticks)
  ax.set_ylim(num_stages, 0)
  ax.set_yticks([s + 0.5 for s in range(num_stages)], [f"stage {s}" for s in range(num_stages)])
  ax.set_xlabel("tick (upper half: forward F<sample>, lower half: backward B<sample>)")
  ax.set_title(title)
  plotting.save(fig, path, dpi=120)


def draw_gantt(report: Report, path: str) -> None:
  """Writes a PNG of devices x time; every operation a cell labelled with its kind and sample.

  It shows two iterations of a synchronous schedule, and an asynchronous one until device 0 has
  finished the backward of sample ``3 D`` (D devices).
  """
  plt = plotting.pyplot()
  ops = report.timeline
  num_devices = report.num_devices
  spec = SCHEDULES[report.schedule.replace("_inter", "")]
  if spec.synchronous:
    # Two iterations: the second starts where device 0 forwards sample m.
    horizon = next(op.start for op in ops if op.key == ("F", 2 * report.micro_batches, 0))
  else:
    horizon = next(op.end for op in ops if op.key.kind in "BW" and op.key.device == 0
                   and op.key.sample == 3 * num_devices)
  shown = [op for op in ops if op.start < horizon]
  per_device = max(sum(1 for op in shown if op.key.device == d) for d in range(num_devices))
  fig, ax = plt.subplots(figsize=(min(40, max(8, 0.32 * per_device)), 1.2 + 0.55 * num_devices))
  for op in shown:
    d, width = op.key.device, min(op.end, horizon) - op.start
    ax.add_patch(plt.Rectangle((op.start, d), width, 1, facecolor=_COLOURS[op.key.kind],
                               edgecolor="white", linewidth=0.6))
    if width > 0:
      ax.text(op.start + width / 2, d + 0.5, f"{op.key.kind}{op.key.sample}", ha="center",
              va="center", fontsize=6 if op.key.sample < 100 else 5)
  ax.set_xlim(0, horizon)
  ax.set_ylim(num_devices, 0)
  ax.set_yticks([d + 0.5 for d in range(num_devices)], [f"device {d}" for d in range(num_devices)])
  ax.set_xlabel("time (F forward, B activation gradient or whole backward, W weight gradient; "
                "number: sample)")
  uses_m = spec.synchronous or not spec.updates_per_micro_batch
  ax.set_title(f"{report.title}: D = {num_devices}"
               + (f", m = {report.micro_batches}" if uses_m else "")
               + f", bubble rate {report.bubble_rate:.3f}, delays {report.delays}", fontsize=9)
  plotting.save(fig, path, dpi=110)
