"""Per-layer costs and their assignment to devices (pure Python, no JAX).

A layer costs ``forward`` (F), ``input_grad`` (B: the gradient with respect to its input) and
``weight_grad`` (W: the gradient with respect to its weights), in any one time unit (seconds,
FLOPs, ...). ``transfer`` is the time to send its output (or, backwards, the gradient of its output)
to another device; ``activation_bytes`` the size of its input per micro-batch, which a device keeps
until the sample's backward has used it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence


class ScheduleError(ValueError):
  """A schedule's inputs do not fit together; the message says how to fix them."""


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """What one layer costs per micro-batch. Times in any unit, shared by all layers."""

  forward: float
  input_grad: float
  weight_grad: float
  transfer: float = 0.0
  activation_bytes: int = 0
  name: str = ""

  @property
  def total(self) -> float:
    return self.forward + self.input_grad + self.weight_grad


def uniform(num_layers: int, forward: float = 1.0, input_grad: float = 1.0,
            weight_grad: float = 1.0, transfer: float = 0.0) -> list[LayerCost]:
  """``num_layers`` identical layers (F = B = W = 1 by default: the closed forms' setting)."""
  if num_layers < 1:
    raise ScheduleError(f"Need at least one layer; got num_layers={num_layers}.")
  return [LayerCost(forward, input_grad, weight_grad, transfer, name=f"layer{i}")
          for i in range(num_layers)]


@dataclasses.dataclass(frozen=True)
class DeviceWork:
  """What one device does per micro-batch: its F, B and W totals and the layers behind them.

  ``forward_layers`` are the layers whose forward (and so whose input activation) lives here;
  ``weight_layers`` those whose weight gradient is computed (and weights updated) here. They
  differ only for LayerPipe, which may move a layer's weight gradient to a neighbour.
  """

  forward: float
  input_grad: float
  weight_grad: float
  transfer: float
  activation_bytes: int
  forward_layers: tuple[int, ...]
  weight_layers: tuple[int, ...]

  @property
  def total(self) -> float:
    return self.forward + self.input_grad + self.weight_grad


def check_costs(layers: Sequence[LayerCost], num_devices: int):
  if not layers:
    raise ScheduleError("No layer costs given: pass one LayerCost per layer.")
  bad = [i for i, c in enumerate(layers)
         if not all(math.isfinite(t) and t >= 0
                    for t in (c.forward, c.input_grad, c.weight_grad, c.transfer))]
  if bad:
    raise ScheduleError(f"Layer costs must be finite and >= 0; layers {bad} have a negative, "
                        "infinite or NaN cost.")
  if num_devices < 1:
    raise ScheduleError(f"Need at least one device; got num_devices={num_devices}.")
  if num_devices > len(layers):
    raise ScheduleError(
        f"{num_devices} devices but only {len(layers)} layers: a device needs at least one layer. "
        "Use fewer devices, or more (finer) layers.")


def contiguous_split(costs: Sequence[float], num_parts: int) -> list[tuple[int, int]]:
  """Contiguous ``(start, stop)`` parts of ``costs``, none empty, minimizing the largest sum.

  An exact dynamic programme over split points (O(G S^2)), the usual PipeDream / GPipe stage
  assignment. Among splits with the same largest sum it takes the one whose costliest parts are
  shortest, so items that cost nothing are spread rather than piled onto one part. The caller
  checks its inputs: finite costs >= 0 and 1 <= num_parts <= len(costs).
  """
  num_items = len(costs)
  prefix = [0.0] + list(itertools.accumulate(float(c) for c in costs))
  worst = (math.inf, math.inf)
  # best[g][i]: the best (largest part sum, that part's length) for the first i items in g parts.
  best = [[worst] * (num_items + 1) for _ in range(num_parts + 1)]
  split = [[0] * (num_items + 1) for _ in range(num_parts + 1)]
  best[0][0] = (0.0, 0)
  for g in range(1, num_parts + 1):
    for i in range(g, num_items - (num_parts - g) + 1):
      for j in range(g - 1, i):
        if best[g - 1][j] == worst:
          continue
        candidate = max(best[g - 1][j], (prefix[i] - prefix[j], i - j))
        if candidate < best[g][i]:
          best[g][i], split[g][i] = candidate, j
  bounds, stop = [], num_items
  for g in range(num_parts, 0, -1):
    start = split[g][stop]
    bounds.append((start, stop))
    stop = start
  return bounds[::-1]


def balanced_split(layers: Sequence[LayerCost], num_devices: int) -> list[tuple[int, int]]:
  """Contiguous ``[begin, end)`` layer ranges, one per device, minimizing the largest F + B + W."""
  check_costs(layers, num_devices)
  return contiguous_split([c.total for c in layers], num_devices)


def fixed_split(num_layers: int, layers_per_stage: int) -> list[tuple[int, int]]:
  """``layers_per_stage`` consecutive layers per device (the last device takes the rest)."""
  if layers_per_stage < 1:
    raise ScheduleError(f"layers_per_stage must be >= 1; got {layers_per_stage}.")
  return [(begin, min(begin + layers_per_stage, num_layers))
          for begin in range(0, num_layers, layers_per_stage)]


def stage_work(layers: Sequence[LayerCost], ranges: Sequence[tuple[int, int]]) -> list[DeviceWork]:
  """Each device runs all three tasks of the layers in its range."""
  work = []
  for begin, end in ranges:
    chunk = layers[begin:end]
    work.append(DeviceWork(
        forward=sum(c.forward for c in chunk), input_grad=sum(c.input_grad for c in chunk),
        weight_grad=sum(c.weight_grad for c in chunk), transfer=chunk[-1].transfer,
        activation_bytes=sum(c.activation_bytes for c in chunk),
        forward_layers=tuple(range(begin, end)), weight_layers=tuple(range(begin, end))))
  return work


def layerpipe_work(layers: Sequence[LayerCost], num_devices: int,
                   inter_layer: bool) -> list[DeviceWork]:
  """LayerPipe's assignment: tasks, not layers, are spread over the devices.

  The network becomes the task chain F+B of layer 0, W of layer 0, F+B of layer 1, W of layer 1,
  ... cut into ``num_devices`` contiguous pieces of the smallest possible largest load. A layer's
  weight gradient W is a task of its own (intra-layer): it may run on the device that computes the
  layer's F and B, or on the next one (which computed the gradient W needs and receives the
  layer's input with the forward). With ``inter_layer`` the activation gradient B is also
  divisible: a cut may fall inside it and hand the rest to the next device (LayerPipe splits the
  activation gradient between two consecutive layers so that every stage takes the same time).
  """
  check_costs(layers, num_devices)
  tasks = []  # (layer, kind, cost, divisible)
  for i, c in enumerate(layers):
    tasks.append((i, "FB", c.forward + c.input_grad, inter_layer))
    tasks.append((i, "W", c.weight_grad, False))

  def fill(capacity):
    """Greedy fill up to ``capacity``: per device, the (layer, kind, amount) pieces."""
    devices, load = [[]], 0.0
    for layer, kind, cost, divisible in tasks:
      if kind == "FB" and divisible:
        # The forward (and at least nothing of B) must stay whole with the layer's activation.
        forward = layers[layer].forward
        if load + forward > capacity + 1e-9 and devices[-1]:
          devices.append([])
          load = 0.0
        remaining = cost
        while remaining > 1e-12:
          room = capacity - load
          if room <= 1e-12:
            devices.append([])
            load, room = 0.0, capacity
          piece = min(room, remaining)
          devices[-1].append((layer, kind, piece, remaining == cost))
          load += piece
          remaining -= piece
        continue
      if load + cost > capacity + 1e-9 and devices[-1]:
        devices.append([])
        load = 0.0
      devices[-1].append((layer, kind, cost, True))
      load += cost
    return devices

  low = max(max(c.forward for c in layers), max(c.weight_grad for c in layers),
            sum(c.total for c in layers) / num_devices)
  if not inter_layer:
    low = max(low, max(c.forward + c.input_grad for c in layers))
  high = sum(c.total for c in layers)
  for _ in range(100):
    mid = (low + high) / 2
    if len(fill(mid)) <= num_devices:
      high = mid
    else:
      low = mid
  pieces = fill(high)
  pieces += [[] for _ in range(num_devices - len(pieces))]
  work = []
  for device in pieces:
    forward = input_grad = weight_grad = 0.0
    forward_layers, weight_layers = [], []
    for layer, kind, amount, holds_forward in device:
      if kind == "W":
        weight_grad += amount
        weight_layers.append(layer)
      elif holds_forward:
        forward += layers[layer].forward
        input_grad += amount - layers[layer].forward
        forward_layers.append(layer)
      else:
        input_grad += amount
    last = forward_layers[-1] if forward_layers else None
    work.append(DeviceWork(
        forward=forward, input_grad=input_grad, weight_grad=weight_grad,
        transfer=layers[last].transfer if last is not None else 0.0,
        activation_bytes=sum(layers[i].activation_bytes for i in forward_layers),
        forward_layers=tuple(forward_layers), weight_layers=tuple(weight_layers)))
  return work
