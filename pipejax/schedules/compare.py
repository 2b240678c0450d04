"""Schedules side by side: every schedule on one network, and LayerPipe's speed-up over PipeDream.

Each function simulates (:func:`pipejax.schedules.simulate`) and returns plain rows, ready for
JSON or a table.
"""

from __future__ import annotations

from typing import Sequence

from pipejax.schedules.costs import LayerCost
from pipejax.schedules.report import NAMES, simulate

# Every schedule, and LayerPipe with its inter-layer split as well.
ALL = (*NAMES, "layerpipe_inter")


def schedule_rows(layers: Sequence[LayerCost], num_devices: int, micro_batches: int,
                  layers_per_stage: int | None = None) -> list[dict]:
  """One row per schedule of :data:`ALL`: throughput (also over the ideal of perfectly balanced
  devices that never idle), bubble rate, peak activations, weight versions and delays.

  ``layers_per_stage`` applies to ``pb`` (the engine's fixed split), as in ``simulate``.
  """
  ideal = num_devices / sum(layer.total for layer in layers)
  rows = []
  for name in ALL:
    r = simulate(name, layers, num_devices, micro_batches,
                 layers_per_stage=layers_per_stage if name == "pb" else None)
    rows.append({"schedule": name, "throughput": r.throughput, "of_ideal": r.throughput / ideal,
                 "bubble_rate": r.bubble_rate, "peak_activations": r.peak_activations,
                 "weight_versions": r.weight_versions, "delays": r.delays})
  return rows


def layerpipe_rows(layers: Sequence[LayerCost], device_counts: Sequence[int],
                   micro_batches: int) -> list[dict]:
  """Per device count, the throughput over PipeDream's of LayerPipe (intra-layer, and intra +
  inter-layer) and of a perfect balance."""
  rows = []
  for p in device_counts:
    base = simulate("pipedream", layers, p, micro_batches).throughput
    rows.append({
        "devices": p,
        "layerpipe_intra": simulate("layerpipe", layers, p, micro_batches).throughput / base,
        "layerpipe_intra_inter": simulate("layerpipe_inter", layers, p,
                                          micro_batches).throughput / base,
        "perfect_balance": p / sum(layer.total for layer in layers) / base,
    })
  return rows
