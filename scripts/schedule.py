r"""Pipeline schedules: the engine's tick grid, or any schedule's simulated cost.

The engine's own tick x stage grid (PB, or its synchronous mode with ``--micro_batches``):

    python scripts/schedule.py --num_stages=4
    python scripts/schedule.py --num_stages=6 --micro_batches=4 --output=/tmp/sync.png

Any schedule of :mod:`pipejax.schedules`, simulated event by event (a Gantt chart with
``--output``, a per-device table as text or JSON):

    python scripts/schedule.py --schedule=1f1b --num_stages=4 --micro_batches=8 --format=json
    python scripts/schedule.py --schedule=zb_h1 --num_stages=4 --micro_batches=8 --output=zb.png
    python scripts/schedule.py --schedule=pipedream --model=vgg --num_stages=4

Tables: every schedule on one network, LayerPipe's speed-up over PipeDream for 2-9 devices, and
the accuracy of training under each schedule's gradient delays (staleness only):

    python scripts/schedule.py --table=schedules --model=vgg --num_stages=4 --micro_batches=8
    python scripts/schedule.py --table=layerpipe --model=vgg
    python scripts/schedule.py --table=staleness --num_stages=8 --train_samples=4000

Layer costs are ``--num_layers`` identical layers (``--forward``, ``--input_grad``,
``--weight_grad``, ``--transfer``; F = B = W = 1 by default), your own
(``--layer_costs=1:0:1,2:2:2``: F:B:W per layer) or, with ``--model=NAME``, the FLOPs XLA counts
for each layer of that pipejax model at ``--micro_batch_size`` (FLOPs taken as time).
"""

import json
import math

from absl import app, flags

from pipejax import accounting, cli, schedules
from pipejax.schedules import drawing

_NUM_STAGES = flags.DEFINE_integer("num_stages", 4, "Number of pipeline stages (devices).")
_TICKS = flags.DEFINE_integer("ticks", None, "Tick grid: ticks to show (default 3 S, or two "
                              "synchronous steps).")
_MICRO_BATCHES = flags.DEFINE_integer(
    "micro_batches", None, "Micro-batches per iteration m (per update of 2bw). Tick grid: the "
    "engine's synchronous mode; unset: asynchronous Pipelined Backpropagation. Schedules: "
    "default 8.")
_MICRO_BATCH_SIZE = flags.DEFINE_integer("micro_batch_size", 1,
                                         "Samples per micro-batch b (also for --model costs).")
_ACTIVATION_SIZE = flags.DEFINE_integer("activation_size", 256,
                                        "Tick grid: numbers per sample in every stage's input.")
_DTYPE_BYTES = flags.DEFINE_integer("dtype_bytes", 4, "Tick grid: bytes per number.")
_FORMAT = flags.DEFINE_enum("format", "text", ["text", "json"], "Output format.")
_OUTPUT = flags.DEFINE_string("output", None, "Also draw the grid or Gantt chart into this PNG.")

_SCHEDULE = flags.DEFINE_enum("schedule", None, [*schedules.NAMES, "layerpipe_inter"],
                              "Simulate this schedule (unset: the engine's tick grid).")
_TABLE = flags.DEFINE_enum("table", None, ["schedules", "layerpipe", "staleness"],
                           "Print a comparison table instead of one schedule.")
_MODEL = flags.DEFINE_string("model", None, "Measure layer costs of this pipejax model "
                             "(pipejax.models.build name, one layer per stage).")
_INPUT_SHAPE = flags.DEFINE_list("input_shape", None, "Per-sample input shape for --model "
                                 "(default 32,32,3; 28,28,1 for mlp and small_cnn).")
_TRANSFER_FLOPS_PER_BYTE = flags.DEFINE_float(
    "transfer_flops_per_byte", 0.0, "--model: FLOPs a device could do in the time it sends one "
    "byte; a stage's output bytes times this is its transfer time (0: free communication).")
_LAYER_COSTS = flags.DEFINE_list(
    "layer_costs", None, "Your own per-layer costs F:B:W or F:B:W:transfer, one per layer in "
    "network order, e.g. 1:1:1,2:2:2,1:0:1 (instead of identical layers or --model).")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", None, "Identical layers (default num_stages).")
_FORWARD = flags.DEFINE_float("forward", 1.0, "Identical layers: forward cost F.")
_INPUT_GRAD = flags.DEFINE_float("input_grad", 1.0, "Identical layers: activation gradient B.")
_WEIGHT_GRAD = flags.DEFINE_float("weight_grad", 1.0, "Identical layers: weight gradient W.")
_TRANSFER = flags.DEFINE_float("transfer", 0.0, "Identical layers: transfer time per boundary.")
_LAYERS_PER_STAGE = flags.DEFINE_integer("layers_per_stage", None,
                                         "k layers per stage instead of a balanced split.")
_DEVICE_COUNTS = flags.DEFINE_list("device_counts", ["2", "3", "4", "5", "6", "7", "8", "9"],
                                   "--table=layerpipe: device counts.")
_SCHEDULES = flags.DEFINE_list("schedules", ["gpipe", "pipedream", "pb"],
                               "--table=staleness: schedules whose delays to train under.")
_TRAIN_SAMPLES = flags.DEFINE_integer("train_samples", 4000,
                                      "--table=staleness: Fashion-MNIST training examples.")
_EPOCHS = flags.DEFINE_integer("epochs", 2, "--table=staleness: epochs.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "--table=staleness: seeds.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 0.003,
                                    "--table=staleness: SGD learning rate per micro-batch.")
_MOMENTUM = flags.DEFINE_float("momentum", 0.9, "--table=staleness: heavy-ball momentum.")
_TRAIN_MICRO_BATCH = flags.DEFINE_integer("train_micro_batch", 4,
                                          "--table=staleness: examples per update.")

# --------------------------------------------------------------------------- the engine's grid


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
  """What each stage of the engine holds: its delay line, and what the mode keeps in it.

  PB keeps D_s + 1 inputs in flight and applies gradients D_s updates late. The synchronous mode
  allocates the same delay lines but holds at most min(M, D_s + 1) inputs at once, and its
  gradients are never stale (one update after the M micro-batches have all gone back).
  """
  slots = accounting.stash_slots(num_stages)
  if micro_batches is None:
    delays, in_flight = accounting.stage_delays(num_stages), slots
  else:
    delays, in_flight = [0] * num_stages, [min(micro_batches, n) for n in slots]
  per_stage_bytes = [n * micro_batch_size * activation_size * dtype_bytes for n in in_flight]
  return {
      "num_stages": num_stages,
      "mode": "pb" if micro_batches is None else f"sync(M={micro_batches})",
      "delays": delays,
      "stash_slots": in_flight,
      "buffer_slots": slots,
      "stash_bytes_per_stage": per_stage_bytes,
      "stash_bytes": sum(per_stage_bytes),
      "fill_ticks": accounting.fill_ticks(num_stages),
      "bubble_ticks_per_step": accounting.bubble_ticks(num_stages, micro_batches),
      "utilization": accounting.utilization(num_stages, micro_batches),
  }


def tick_grid_main(num_stages, m):
  default_ticks = 3 * num_stages if m is None else 2 * (m + 2 * (num_stages - 1))
  num_ticks = _TICKS.value or default_ticks
  grid = (accounting.schedule_grid(num_stages, num_ticks) if m is None
          else sync_grid(num_stages, m, num_ticks))
  info = summary(num_stages, m, _MICRO_BATCH_SIZE.value, _ACTIVATION_SIZE.value,
                 _DTYPE_BYTES.value)
  if _OUTPUT.value:
    drawing.draw_grid(grid, _OUTPUT.value, f"S = {num_stages}, {info['mode']}, "
                      f"utilization {info['utilization']:.2f}")
  if _FORMAT.value == "json":
    info["grid"] = [[{"forward": f, "backward": b} for f, b in row] for row in grid]
    print(json.dumps(info))
    return
  print(drawing.format_grid(grid))
  print()
  print("stage | delay D_s | inputs in flight | buffer slots | stashed bytes")
  for s in range(num_stages):
    print(f"{s:5d} | {info['delays'][s]:9d} | {info['stash_slots'][s]:16d} | "
          f"{info['buffer_slots'][s]:12d} | {info['stash_bytes_per_stage'][s]:13d}")
  print(f"total stashed activations: {info['stash_bytes']} bytes; mode {info['mode']}: "
        f"fill {info['fill_ticks']} ticks, {info['bubble_ticks_per_step']} bubble ticks per step, "
        f"utilization {info['utilization']:.3f}")
  if _OUTPUT.value:
    print(f"grid drawn to {_OUTPUT.value}")


# ----------------------------------------------------------------------- the schedule cost model


def layer_costs():
  """The layer costs the flags describe, and their unit for printing."""
  if _LAYER_COSTS.value:
    layers = []
    for i, text in enumerate(_LAYER_COSTS.value):
      try:
        numbers = [float(x) for x in text.split(":")]
        layers.append(schedules.LayerCost(*numbers, name=f"layer{i}"))
        if len(numbers) not in (3, 4):
          raise ValueError
      except (TypeError, ValueError):
        raise app.UsageError(f"--layer_costs entry {i} is {text!r}; write each layer as F:B:W or "
                             "F:B:W:transfer, e.g. --layer_costs=1:1:1,2:2:2:0.5.") from None
    return layers, "time unit"
  if _MODEL.value is None:
    layers = schedules.uniform(_NUM_LAYERS.value or _NUM_STAGES.value, _FORWARD.value,
                               _INPUT_GRAD.value, _WEIGHT_GRAD.value, _TRANSFER.value)
    return layers, "time unit"
  import jax.numpy as jnp
  from pipejax import models
  from pipejax.schedules import measure

  if _MODEL.value not in models.names():
    raise app.UsageError(f"--model={_MODEL.value} is not a pipejax model; known: "
                         f"{', '.join(models.names())}.")
  default_shape = (28, 28, 1) if _MODEL.value in ("mlp", "small_cnn") else (32, 32, 3)
  shape = tuple(int(n) for n in _INPUT_SHAPE.value) if _INPUT_SHAPE.value else default_shape
  kwargs = {} if _MODEL.value == "mlp" else {"conv_impl": "xla"}
  model = models.build(_MODEL.value, **kwargs)
  example = jnp.zeros((_MICRO_BATCH_SIZE.value, *shape), jnp.float32)
  return measure.layer_costs(model, example, _TRANSFER_FLOPS_PER_BYTE.value), "FLOP"


def _finite(x):
  return None if isinstance(x, float) and math.isinf(x) else x


def print_report(report, unit):
  print(f"{report.title}: {report.num_devices} devices, m = {report.micro_batches}")
  print(f"throughput {report.throughput:.6g} samples per {unit}; bubble rate "
        f"{report.bubble_rate:.4f} (idle / busy), bubble fraction {report.bubble_fraction:.4f}, "
        f"utilization {report.utilization:.4f}")
  print("device | layers | F | B | W | bubble rate | peak activations | weight versions | delay")
  for d in range(report.num_devices):
    c, layers = report.device_costs[d], report.device_layers[d]
    span = f"{layers[0]}-{layers[-1]}" if layers else "-"
    print(f"{d:6d} | {span:>6} | {c['forward']:.4g} | {c['input_grad']:.4g} | "
          f"{c['weight_grad']:.4g} | {report.bubble_rate_per_device[d]:11.4f} | "
          f"{report.peak_activations[d]:16d} | {report.weight_versions[d]:15d} | "
          f"{report.delays[d]:5d}")


def schedule_main():
  layers, unit = layer_costs()
  report = _simulate(_SCHEDULE.value, layers, _NUM_STAGES.value)
  if _OUTPUT.value:
    drawing.draw_gantt(report, _OUTPUT.value)
  if _FORMAT.value == "json":
    info = report.as_dict()
    info["bubble_rate_per_device"] = [_finite(x) for x in info["bubble_rate_per_device"]]
    info["unit"] = unit
    print(json.dumps(info))
    return
  print_report(report, unit)
  if _OUTPUT.value:
    print(f"Gantt chart drawn to {_OUTPUT.value}")


def _simulate(name, layers, num_devices):
  try:
    return schedules.simulate(name, layers, num_devices, _MICRO_BATCHES.value or 8,
                              layers_per_stage=_LAYERS_PER_STAGE.value if name == "pb" else None)
  except schedules.ScheduleError as e:
    raise app.UsageError(str(e)) from None


def print_table(rows, header, cells):
  """The rows as JSON, or as a markdown table with ``header`` and ``cells(row)`` per row."""
  if _FORMAT.value == "json":
    print(json.dumps(rows))
    return
  print("| " + " | ".join(header) + " |")
  print("|" + "|".join("---" for _ in header) + "|")
  for row in rows:
    print("| " + " | ".join(str(cell) for cell in cells(row)) + " |")


def schedules_table():
  layers, unit = layer_costs()
  ideal = _NUM_STAGES.value / sum(layer.total for layer in layers)
  rows = []
  for name in [*schedules.NAMES, "layerpipe_inter"]:
    r = _simulate(name, layers, _NUM_STAGES.value)
    rows.append({"schedule": name, "throughput": r.throughput, "of_ideal": r.throughput / ideal,
                 "bubble_rate": r.bubble_rate, "peak_activations": r.peak_activations,
                 "weight_versions": r.weight_versions, "delays": r.delays})
  scale, per = (1e9, f"1e9 {unit}") if unit == "FLOP" else (1.0, unit)
  print_table(rows, ["schedule", f"samples per {per}", "of ideal", "bubble rate",
                     "peak activations per device", "weight versions", "delays"],
              lambda row: [row["schedule"], f"{row['throughput'] * scale:.4g}",
                           f"{row['of_ideal']:.3f}", f"{row['bubble_rate']:.3f}",
                           row["peak_activations"], row["weight_versions"], row["delays"]])


def layerpipe_table():
  layers, _ = layer_costs()
  rows = []
  for p in (int(n) for n in _DEVICE_COUNTS.value):
    base = _simulate("pipedream", layers, p).throughput
    rows.append({
        "devices": p,
        "layerpipe_intra": _simulate("layerpipe", layers, p).throughput / base,
        "layerpipe_intra_inter": _simulate("layerpipe_inter", layers, p).throughput / base,
        "perfect_balance": p / sum(layer.total for layer in layers) / base,
    })
  print_table(rows, ["devices", "LayerPipe intra-layer", "LayerPipe intra + inter-layer",
                     "perfect balance"],
              lambda row: [row["devices"], f"{row['layerpipe_intra']:.2f}",
                           f"{row['layerpipe_intra_inter']:.2f}", f"{row['perfect_balance']:.2f}"])
  if _FORMAT.value == "text":
    for key in ("layerpipe_intra", "layerpipe_intra_inter", "perfect_balance"):
      print(f"mean {key}: {sum(row[key] for row in rows) / len(rows):.3f}")


def staleness_table():
  import numpy as np
  from pipejax import models
  from pipejax.data import fashion_mnist
  from pipejax.analysis import staleness

  train, test = fashion_mnist.load_fashion_mnist_idx()
  mean, std = fashion_mnist.NORMALIZATION.mean[0], fashion_mnist.NORMALIZATION.std[0]

  def prepare(source, n):
    images, labels = source.take(np.arange(min(n, len(source))))
    return (images.astype(np.float32) - mean) / std, labels

  train_data, test_data = prepare(train, _TRAIN_SAMPLES.value), prepare(test, len(test))
  num_stages = _NUM_STAGES.value
  rows = []
  for name in _SCHEDULES.value:
    delays = schedules.delay_profile(name, num_stages, _MICRO_BATCHES.value or 8)
    accuracies = []
    for seed in (int(s) for s in _SEEDS.value):
      # One dense layer (+ LayerNorm, ReLU) per stage.
      model = models.build("mlp", hidden=(128,) * (num_stages - 1), normalization="layer")
      accuracies.append(staleness.train(
          model, delays, train_data, test_data, learning_rate=_LEARNING_RATE.value,
          momentum=_MOMENTUM.value, micro_batch=_TRAIN_MICRO_BATCH.value,
          epochs=_EPOCHS.value, seed=seed))
    rows.append({"schedule": name, "delays": delays, "test_accuracy": accuracies})
  print_table(rows, ["schedule", "delays D_s", "test accuracy per seed", "mean"],
              lambda row: [row["schedule"], row["delays"],
                           ", ".join(f"{a:.3f}" for a in row["test_accuracy"]),
                           f"{sum(row['test_accuracy']) / len(row['test_accuracy']):.3f}"])


def main(argv):
  del argv
  num_stages, m = _NUM_STAGES.value, _MICRO_BATCHES.value
  if num_stages < 1:
    raise app.UsageError(f"--num_stages must be at least 1; got {num_stages}.")
  if m is not None and m < 1:
    raise app.UsageError(f"--micro_batches must be at least 1; got {m}.")
  if _TABLE.value == "schedules":
    schedules_table()
  elif _TABLE.value == "layerpipe":
    layerpipe_table()
  elif _TABLE.value == "staleness":
    staleness_table()
  elif _SCHEDULE.value is not None:
    schedule_main()
  else:
    tick_grid_main(num_stages, m)


if __name__ == "__main__":
  cli.run(main)
