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

from pipejax.core import accounting
from pipejax import cli, plotting, schedules
from pipejax.schedules import compare, drawing

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
_OUTPUT = flags.DEFINE_string("output", None, "Also draw the grid or Gantt chart into this "
                              "figure, in the format its name ends in (.png, .pdf, .svg, ...).")

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
_NUM_LAYERS = flags.DEFINE_integer("num_layers", None, "Identical layers (default num_stages).",
                                   lower_bound=1)
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


def tick_grid_main(num_stages, m):
  default_ticks = 3 * num_stages if m is None else 2 * (m + 2 * (num_stages - 1))
  grid = accounting.schedule_grid(num_stages, _TICKS.value or default_ticks, m)
  info = accounting.mode_summary(num_stages, m, _MICRO_BATCH_SIZE.value, _ACTIVATION_SIZE.value,
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
  print(drawing.format_mode_summary(info))
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
  shape = tuple(_integers(_INPUT_SHAPE)) if _INPUT_SHAPE.value else default_shape
  kwargs = {} if _MODEL.value == "mlp" else {"conv_impl": "xla"}
  model = models.build(_MODEL.value, **kwargs)
  example = jnp.zeros((_MICRO_BATCH_SIZE.value, *shape), jnp.float32)
  return measure.layer_costs(model, example, _TRANSFER_FLOPS_PER_BYTE.value), "FLOP"


def _finite(x):
  return None if isinstance(x, float) and math.isinf(x) else x


def schedule_main():
  layers, unit = layer_costs()
  report = _usage_errors(schedules.simulate, _SCHEDULE.value, layers, _NUM_STAGES.value,
                         _MICRO_BATCHES.value or 8, layers_per_stage=_LAYERS_PER_STAGE.value
                         if _SCHEDULE.value == "pb" else None)
  if _OUTPUT.value:
    drawing.draw_gantt(report, _OUTPUT.value)
  if _FORMAT.value == "json":
    info = report.as_dict()
    info["bubble_rate_per_device"] = [_finite(x) for x in info["bubble_rate_per_device"]]
    info["unit"] = unit
    print(json.dumps(info))
    return
  print(drawing.format_report(report, unit))
  if _OUTPUT.value:
    print(f"Gantt chart drawn to {_OUTPUT.value}")


def _usage_errors(fn, *args, **kwargs):
  """``fn(*args, **kwargs)``, a schedule that cannot run on these layers a usage error."""
  try:
    return fn(*args, **kwargs)
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
  rows = _usage_errors(compare.schedule_rows, layers, _NUM_STAGES.value,
                       _MICRO_BATCHES.value or 8, _LAYERS_PER_STAGE.value)
  scale, per = (1e9, f"1e9 {unit}") if unit == "FLOP" else (1.0, unit)
  print_table(rows, ["schedule", f"samples per {per}", "of ideal", "bubble rate",
                     "peak activations per device", "weight versions", "delays"],
              lambda row: [row["schedule"], f"{row['throughput'] * scale:.4g}",
                           f"{row['of_ideal']:.3f}", f"{row['bubble_rate']:.3f}",
                           row["peak_activations"], row["weight_versions"], row["delays"]])


def layerpipe_table():
  layers, _ = layer_costs()
  rows = _usage_errors(compare.layerpipe_rows, layers, _integers(_DEVICE_COUNTS),
                       _MICRO_BATCHES.value or 8)
  print_table(rows, ["devices", "LayerPipe intra-layer", "LayerPipe intra + inter-layer",
                     "perfect balance"],
              lambda row: [row["devices"], f"{row['layerpipe_intra']:.2f}",
                           f"{row['layerpipe_intra_inter']:.2f}", f"{row['perfect_balance']:.2f}"])
  if _FORMAT.value == "text":
    for key in ("layerpipe_intra", "layerpipe_intra_inter", "perfect_balance"):
      print(f"mean {key}: {sum(row[key] for row in rows) / len(rows):.3f}")


def staleness_table():
  from pipejax.analysis import staleness  # pylint: disable=import-outside-toplevel
  try:
    seeds = [int(s) for s in _SEEDS.value]
  except ValueError:
    raise app.UsageError(f"--seeds must be integers; got {','.join(_SEEDS.value)}.") from None
  try:
    rows = _usage_errors(
        staleness.schedule_accuracies, _SCHEDULES.value, _NUM_STAGES.value,
        _MICRO_BATCHES.value or 8, train_samples=_TRAIN_SAMPLES.value, seeds=seeds,
        learning_rate=_LEARNING_RATE.value, momentum=_MOMENTUM.value,
        micro_batch=_TRAIN_MICRO_BATCH.value, epochs=_EPOCHS.value)
  except staleness.StalenessError as e:
    raise app.UsageError(str(e)) from None
  print_table(rows, ["schedule", "delays D_s", "test accuracy per seed", "mean"],
              lambda row: [row["schedule"], row["delays"],
                           ", ".join(f"{a:.3f}" for a in row["test_accuracy"]),
                           f"{sum(row['test_accuracy']) / len(row['test_accuracy']):.3f}"])


# ------------------------------------------------------------ the flags each mode reads

# How the layer costs are given, and the flags each way reads.
_LAYER_SOURCES = {
    "--layer_costs": (_LAYER_COSTS,),
    "--model": (_MODEL, _INPUT_SHAPE, _TRANSFER_FLOPS_PER_BYTE, _MICRO_BATCH_SIZE),
    "identical layers (no --model or --layer_costs)": (_NUM_LAYERS, _FORWARD, _INPUT_GRAD,
                                                       _WEIGHT_GRAD, _TRANSFER),
}
_LAYERS = "the layer costs"  # stands for the flags of whichever way gives them
_TICK_GRID = "the tick grid (no --schedule or --table)"
# Each mode, and the flags it reads besides --num_stages, --micro_batches and --format.
_MODES = {
    _TICK_GRID: (_TICKS, _MICRO_BATCH_SIZE, _ACTIVATION_SIZE, _DTYPE_BYTES, _OUTPUT),
    "--schedule": (_SCHEDULE, _OUTPUT, _LAYERS, _LAYERS_PER_STAGE),
    "--table=schedules": (_TABLE, _LAYERS, _LAYERS_PER_STAGE),
    "--table=layerpipe": (_TABLE, _LAYERS, _DEVICE_COUNTS),
    "--table=staleness": (_TABLE, _SCHEDULES, _TRAIN_SAMPLES, _EPOCHS, _SEEDS, _LEARNING_RATE,
                          _MOMENTUM, _TRAIN_MICRO_BATCH),
}


def _mode() -> str:
  """The mode the command line chose (a table wins over a schedule: --schedule is then unread)."""
  if _TABLE.value is not None:
    return f"--table={_TABLE.value}"
  return "--schedule" if _SCHEDULE.value is not None else _TICK_GRID


def _layer_source() -> str:
  names = list(_LAYER_SOURCES)
  if _LAYER_COSTS.value:
    return names[0]
  return names[1] if _MODEL.value is not None else names[2]


def _name(holder) -> str:
  return holder if isinstance(holder, str) else holder.name


def _read_flags(mode: str) -> set[str]:
  """The names of the flags ``mode`` reads on this command line."""
  read = {_name(h) for h in (_NUM_STAGES, _MICRO_BATCHES, _FORMAT, *_MODES[mode])}
  if _LAYERS in read:
    read |= {h.name for h in _LAYER_SOURCES[_layer_source()]}
  if mode == "--schedule" and _SCHEDULE.value != "pb":
    read.discard(_LAYERS_PER_STAGE.name)  # only PB's own split takes k layers per stage
  return read - {_LAYERS}


def _where_read(name: str) -> str:
  """Where the flag ``name`` is read, as the rest of a sentence that begins with it."""
  if name == _LAYERS_PER_STAGE.name:
    return "is read by --schedule=pb and --table=schedules"
  modes = [mode.split(" (")[0] for mode, holders in _MODES.items()
           if name in map(_name, holders)]
  places = [f"is read by {' and '.join(modes)}"] if modes else []
  places += [f"sets the layer costs of {source}, which --schedule, --table=schedules and "
             "--table=layerpipe read" for source, holders in _LAYER_SOURCES.items()
             if name in map(_name, holders)]
  return ", and ".join(places)


def check_unread_flags() -> None:
  """Refuses a flag given on the command line that the chosen mode would not read (``--model``
  beside the tick grid, ``--num_layers`` beside ``--layer_costs``), so that no setting given is
  silently dropped."""
  mode = _mode()
  read = _read_flags(mode)
  given = [name for name in dict.fromkeys(
      _name(h) for holders in [*_MODES.values(), *_LAYER_SOURCES.values()] for h in holders)
           if name != _LAYERS and name not in read and flags.FLAGS[name].present]
  if given:
    reads_layers = _LAYERS in map(_name, _MODES[mode])
    layers = f" with the layer costs of {_layer_source()}" if reads_layers else ""
    raise app.UsageError(
        f"{', '.join(f'--{name}' for name in given)} {'is' if len(given) == 1 else 'are'} not "
        f"read by {mode}{layers}: " + "; ".join(f"--{name} {_where_read(name)}"
                                                 for name in given)
        + ". Drop what this command does not read, or choose the mode that reads it.")


def _integers(holder) -> list[int]:
  """A list flag's whole numbers; anything else is a usage error."""
  try:
    return [int(n) for n in holder.value]
  except ValueError:
    raise app.UsageError(f"--{holder.name} takes whole numbers, comma-separated; got "
                         f"{','.join(holder.value)!r}.") from None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  check_unread_flags()
  if _OUTPUT.value is not None:
    cli.check_output("output", _OUTPUT.value, suffixes=plotting.figure_suffixes())
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
