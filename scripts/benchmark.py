r"""Benchmarks of the pipeline engine, measured side by side in one run; prints one JSON object.

    python scripts/benchmark.py                      # everything (about 15 minutes on 2 CPU cores)
    python scripts/benchmark.py --only=throughput --micro_batch_sizes=1
    python scripts/benchmark.py --only=conv --conv_impls=xla,sliced --conv_micro_batch_sizes=1
    python scripts/benchmark.py --output=benchmark.json
    python scripts/benchmark.py --only=normalization   # about 10 minutes: 10 compiled pipelines
    python scripts/benchmark.py --only=lm              # the transformer LM at 8, 16, 32 stages

A JSON kept as ``docs/benchmarks/NAME.json`` (``--output``) is a record:
``python scripts/benchmark_report.py`` renders every such record into docs/benchmarks/README.md.

* ``throughput``: ``Pipeline.run`` (Pipelined Backpropagation, one layer per stage) against a plain
  optax training loop in ``lax.scan`` on the same MLP (8 layers of width 256), samples per second at
  each micro-batch size, and their ratio. The pipeline's backward recomputes each stage's forward
  (4 units of arithmetic instead of backprop's 3), so 0.75 is the honest ceiling of the ratio
  where arithmetic dominates. Also the passes over the weights per tick of both compiled programs.
* ``compile``: seconds to trace and compile ``run`` for S = 4, 16, 64 stages.
* ``methods``: ``Pipeline.run`` of each method preset at micro-batch 1 on the default config's
  model (Fashion-MNIST MLP 784-256-128-10, three stages), its speed relative to plain PB, and the
  passes over the weights per tick of its compiled tick (``passes``, see below).
* ``conv``: ResNet-20 (GroupNorm) on 28x28x1 inputs, one conv per stage, PB + momentum SGD:
  ``Pipeline.run`` against a plain jitted optax step on the same network, called from Python
  (``plain_jit_step``) and inside ``lax.scan`` (``plain_scan``), for each ``--conv_impls``.
* ``memory``: the compiled memory of a training chunk (``memory_analysis`` of the full-pipeline
  ``run``) against the formula weights + optimizer state + sum_s (D_s+1)|x_s| + registers, for
  the default model and ResNet-20 with the default method (pb_sc_lwp).
* ``normalization``: the speed cost of each normalizer per tick, PB + SC + LWP at micro-batch 1
  after the fill: ``Pipeline.run`` of the default MLP, a deeper MLP (seven hidden layers of 128)
  and ResNet-20 at width 8, with no normalization, LayerNorm, GroupNorm (ResNet only) and Online
  Norm, each relative to the same model without normalization. Only when asked.
* ``depth``: configs/deep_mlp.py's residual MLP (width 128, LayerNorm) at b = 1 and
  ``--depth_stages`` stages, PB + momentum SGD: per depth a record with ``stacked`` True
  (``pipejax.parallel.stacking.StackedPipeline``), False (``Pipeline``) and None (the plain
  loop: the whole network as one optax step in ``lax.scan``): build and init seconds, trace and
  compile seconds of the full pipeline's ``run``, its ``operations_per_tick``, samples/s after the
  fill, and the delay lines' bytes held against the formula sum_s (D_s + 1)|x_s|. Only when
  asked.
  Beside them, one record per method of ``--depth_methods`` stacked at each depth, timed side
  by side with ``pb``: ``cpu_relative_to_pb`` (its samples per CPU second over ``pb``'s),
  ``weight_passes_per_tick`` (the passes its definition needs, ``speed.weight_passes_per_tick``),
  ``pass_ratio`` (``pb``'s over them), what its compiled tick makes, and its delay lines' bytes.
* ``delay_lines``: per method of ``--depth_methods`` and depth of ``--delay_line_stages`` (128,
  256), the stacked residual MLP's delay lines' bytes (from its state's shapes, nothing allocated)
  against sum_s (D_s + 1)|x_s| for the inputs and sum_s (D_s + 1)|w_s| for a weight stash, and the
  seconds to build it. Only when asked.
* ``trainer``: configs/deep_mlp.py (PB + SC + LWP, stacked) at ``--trainer_stages`` stages: the
  trainer's chunk (the host's data stream, scheduling, ``run``, the metrics fetched, the finite
  check) timed side by side with ``run`` on a stream already on the device, their ratio
  (``cpu_trainer_over_benchmark``), and the seconds to build the experiment and init its state
  (``setup_s``); each depth twice, its blocks named one by one and as one module repeated
  (``declared_stack``, a declared stack that set-up traces once). Needs the Fashion-MNIST files.
  Only when asked.
* ``stacked_mesh``: the same residual MLP at ``--stacked_mesh_stages`` stages on a stage mesh of
  ``--stacked_mesh_devices`` devices, ``ShardedPipeline`` of the ``StackedPipeline`` (each
  device's piece of the stack stacked) against that of the ``Pipeline``: build and compile
  seconds, the kernels of one loop iteration (two ticks), samples/s after the fill. Needs the
  devices, as ``sharding`` does. Only when asked.
* ``sharding``: ticks/s of ``ShardedPipeline.run`` on stage meshes of 1, 2, 4, 8 devices against
  ``Pipeline.run`` (same MLP, b = 1). Needs the devices: on a CPU run it with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (fake devices share the cores, so this
  measures the machinery's overhead, not a speed-up). ``two_halves``: the parallel speed-up, two
  balanced halves of an 8x512 MLP on 2 devices against 1 (b = 1, 2, 4), with both programs'
  passes. A mesh of several stage devices runs two ticks per loop iteration
  (``ShardedPipeline.ticks_per_iteration``); its passes are per tick all the same.
* ``lm``: per depth, tokens per second of the stacked pipeline (``StackedPipeline``, PB + Adam)
  on configs/char_lm.py's transformer (byte vocabulary, context 64, one block per stage,
  ``--lm_blocks`` = 6, 14, 30 blocks: 8, 16 and 32 stages, at configs/studies/lm_depth.py's widths
  128, 96 and 64, one sequence per micro-batch, b = 1) against the plain loop (the whole model as
  one optax Adam step in ``lax.scan``), their ratio, and the seconds to trace and compile the
  pipeline's ``run`` (``pipeline_compile_s``). The ratio in CPU seconds is measured twice: with
  every core of this process (``cpu_ratio_pipeline_over_plain``), and, with ``--lm_one_core``
  (the default), in a process of its own held to one core (``one_core_ratio_pipeline_over_plain``),
  where the CPU seconds are the programs' work without the time XLA's worker threads spend
  waiting (on a CPU backend only); ``flops_ratio_plain_over_pipeline`` is XLA's count of both
  ticks' arithmetic (docs/performance.md §9). Only when asked.

Passes over the weights (``passes_per_tick``: ``bytes_accessed``, ``copies``, ``operations``)
are read from each compiled program's HLO: ``pipejax/profiling/hlo.py`` says how. The
measurements themselves are ``pipejax.profiling``'s; this binary only composes them.
"""

import json
import os
import platform
import time

from absl import app, flags, logging
import jax
import numpy as np

from pipejax import cli, files, methods
from pipejax.profiling import memory, meshes, speed, trainer, workloads

BENCHMARKS = ["throughput", "compile", "methods", "conv", "memory", "normalization", "sharding",
              "lm", "depth", "delay_lines", "trainer", "stacked_mesh"]
# Each adds minutes; 'sharding' and 'stacked_mesh' need fake devices.
OPT_IN = ("normalization", "sharding", "lm", "depth", "delay_lines", "trainer", "stacked_mesh")
_ONLY = flags.DEFINE_multi_enum("only", [b for b in BENCHMARKS if b not in OPT_IN], BENCHMARKS,
                                "Which benchmarks to run ('normalization' and 'sharding' only "
                                "when asked).")
# Every asynchronous preset of momentum SGD.
ASYNC_SGD_METHODS = [name for name, preset in methods.PRESETS.items()
                     if "sgd" in preset.optimizers and not preset.traits.delay_free]
PLAIN_PIPELINE = next(name for name, preset in methods.PRESETS.items()
                      if preset.traits.plain_pipeline)
_METHODS = flags.DEFINE_list("methods", ASYNC_SGD_METHODS, "Presets for 'methods'.")
_MICRO_BATCH_SIZES = flags.DEFINE_list("micro_batch_sizes", ["1", "32"], "Micro-batch sizes b.")
_SAMPLES = flags.DEFINE_integer("samples", 8192, "Samples per timed repetition.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions (the best is reported).")
_COMPILE_STAGES = flags.DEFINE_list("compile_stages", ["4", "16", "64"], "S for compile times.")
_CONV_IMPLS = flags.DEFINE_list("conv_impls", ["auto"],
                                "Convolutions for 'conv': 'auto', 'xla' and/or 'sliced'.")
_CONV_MICRO_BATCH_SIZES = flags.DEFINE_list("conv_micro_batch_sizes", ["1", "32"],
                                            "Micro-batch sizes b for 'conv'.")
_CONV_SAMPLES = flags.DEFINE_integer("conv_samples", 128,
                                     "Samples per timed repetition of 'conv'.")
_LM_SEQUENCES = flags.DEFINE_integer("lm_sequences", 256,
                                     "Sequences (micro-batches of b = 1) per timed call of 'lm'.")
_LM_BLOCKS = flags.DEFINE_list("lm_blocks", ["6", "14", "30"],
                               "Transformer blocks for 'lm' (blocks + 2 stages).")
_LM_ONE_CORE = flags.DEFINE_boolean("lm_one_core", True,
                                    "'lm' also measures each depth on one core, in a process of "
                                    "its own (about doubles its time).")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the JSON here.")
_DEPTH_STAGES = flags.DEFINE_list("depth_stages", ["8", "32", "128", "256"],
                                  "Stage counts of the residual MLP for 'depth'.")
_DEPTH_TICKS = flags.DEFINE_integer("depth_ticks", 256, "Ticks per timed call of 'depth'.")
_DEPTH_METHODS = flags.DEFINE_list(
    "depth_methods", ASYNC_SGD_METHODS,
    "Presets 'depth' times stacked at each depth, side by side with pb (none: '').")
_DELAY_LINE_STAGES = flags.DEFINE_list("delay_line_stages", ["128", "256"],
                                       "Stage counts of the residual MLP for 'delay_lines'.")
_TRAINER_STAGES = flags.DEFINE_list("trainer_stages", ["32", "128", "256"],
                                    "Stage counts of configs/deep_mlp.py for 'trainer'.")
_DEPTH_UNSTACKED_MAX = flags.DEFINE_integer(
    "depth_unstacked_max", 256, "'depth' compiles the unstacked pipeline up to this many stages "
    "(its compile time grows with depth).")
_STACKED_MESH_STAGES = flags.DEFINE_integer("stacked_mesh_stages", 32,
                                            "Stages of the residual MLP for 'stacked_mesh'.")
_STACKED_MESH_DEVICES = flags.DEFINE_integer("stacked_mesh_devices", 4,
                                             "Stage-axis devices for 'stacked_mesh'.")


_INTEGER_LISTS = (_MICRO_BATCH_SIZES, _COMPILE_STAGES, _CONV_MICRO_BATCH_SIZES, _LM_BLOCKS,
                  _DEPTH_STAGES, _DELAY_LINE_STAGES, _TRAINER_STAGES)
CONV_IMPLS = ("auto", "xla", "sliced")


def check_flags(argv) -> None:
  """Refuses, before anything is measured, a command line that would fail after it: an output
  that cannot be written, a method no preset has, a list of whole numbers that holds other text."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _OUTPUT.value is not None:
    cli.check_output("output", _OUTPUT.value)
  for holder in (_METHODS, _DEPTH_METHODS):
    unknown = [name for name in holder.value if name not in methods.PRESETS]
    if unknown:
      raise app.UsageError(f"--{holder.name} names {', '.join(unknown)}, which no method preset "
                           f"is; the presets: {', '.join(methods.PRESETS)}.")
  for holder in _INTEGER_LISTS:
    if not all(value.isdigit() and int(value) > 0 for value in holder.value):
      raise app.UsageError(f"--{holder.name} takes positive whole numbers, comma-separated; got "
                           f"{','.join(holder.value)!r}.")
  unknown = [impl for impl in _CONV_IMPLS.value if impl not in CONV_IMPLS]
  if unknown:
    raise app.UsageError(f"--conv_impls takes {', '.join(CONV_IMPLS)}; got {', '.join(unknown)}.")


def main(argv):
  check_flags(argv)
  result = {
      "device": str(jax.devices()[0].device_kind),
      "backend": jax.default_backend(),
      "device_count": jax.device_count(),
      "cpu_count": os.cpu_count(),
      "cores_available": (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                          else os.cpu_count()),  # what taskset leaves this process
      "load_average_at_start": os.getloadavg(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),  # fake devices, threading options
      "jax": jax.__version__,
      "python": platform.python_version(),
  }
  samples, repeats = _SAMPLES.value, _REPEATS.value
  two_devices = jax.device_count() >= 2
  sections = {
      "throughput": lambda: [speed.throughput(int(b), samples, repeats)
                             for b in _MICRO_BATCH_SIZES.value],
      "methods": lambda: speed.method_speeds(_METHODS.value, samples // 2, repeats),
      "memory": lambda: [
          memory.memory("default MLP 784-256-128-10", workloads.default_model(),
                        np.zeros((1, 28, 28, 1)), 10),
          memory.memory("ResNet-20 (GroupNorm), 28x28x1", workloads.resnet20(),
                        np.zeros((1,) + workloads.RESNET_INPUT), 10)],
      "normalization": lambda: speed.normalization_speeds(samples // 2, _CONV_SAMPLES.value,
                                                          repeats),
      "conv": lambda: [speed.conv_speeds(b, impl, _CONV_SAMPLES.value, repeats)
                       for impl in _CONV_IMPLS.value
                       for b in map(int, _CONV_MICRO_BATCH_SIZES.value)],
      "sharding": lambda: {
          "stage_meshes": meshes.sharding_speeds(samples // 8, repeats),
          "two_halves": [meshes.two_halves_speedup(b, samples // 16, repeats)
                         for b in (1, 2, 4) if two_devices],
          "two_halves_by_depth": [meshes.two_halves_speedup(1, samples // 16, repeats,
                                                            layers=layers)
                                  for layers in (4, 16) if two_devices],
          "fake_device_control": meshes.fake_device_speedup(3000, repeats) if two_devices else [],
          "method_passes": meshes.sharded_method_passes(
              (PLAIN_PIPELINE, methods.RECOMMENDED, "pipedream"))},
      "compile": lambda: [speed.compile_time(int(s)) for s in _COMPILE_STAGES.value],
      "lm": lambda: speed.lm_speeds(_LM_SEQUENCES.value, repeats,
                                    [int(n) for n in _LM_BLOCKS.value], _LM_ONE_CORE.value),
      "depth": lambda: [record for s in _DEPTH_STAGES.value
                        for record in speed.depth_records(int(s), _DEPTH_TICKS.value, repeats,
                                                          _DEPTH_UNSTACKED_MAX.value)
                        + (speed.depth_method_records(int(s), _DEPTH_METHODS.value,
                                                      _DEPTH_TICKS.value, repeats)
                           if _DEPTH_METHODS.value else [])],
      "delay_lines": lambda: [record for s in _DELAY_LINE_STAGES.value
                              for record in speed.delay_line_records(int(s), _DEPTH_METHODS.value)],
      "trainer": lambda: [{"declared_stack": declared, **trainer.trainer_rate(
          trainer.deep_mlp_plan(int(s), declared_stack=declared), _DEPTH_TICKS.value, repeats)}
                          for declared in (False, True) for s in _TRAINER_STAGES.value],
      "stacked_mesh": lambda: meshes.stacked_mesh_records(
          _STACKED_MESH_STAGES.value, _STACKED_MESH_DEVICES.value, _DEPTH_TICKS.value, repeats),
  }
  mlp = f"MLP, {workloads.LAYERS} layers of width {workloads.WIDTH}, one layer per stage"
  residual = "configs/deep_mlp.py's residual MLP (width 128, LayerNorm), one block per stage"
  workload = {
      "throughput": f"{mlp}, PB + momentum SGD, against the plain loop",
      "methods": f"{mlp}, every method preset",
      "memory": "the default MLP 784-256-128-10 and ResNet-20 (GroupNorm)",
      "normalization": "each model of speed.NORMALIZED_MODELS, PB + SC + LWP, per normalizer",
      "conv": "ResNet-20 per convolution implementation and micro-batch",
      "sharding": f"{mlp}, PB + momentum SGD, on stage meshes",
      "compile": "an MLP of one layer per stage at each depth, PB + momentum SGD",
      "lm": "configs/char_lm.py's byte-level transformer, one block per stage, against the plain "
            "Adam loop",
      "depth": f"{residual}, each method preset, stacked and stage by stage",
      "delay_lines": f"{residual}, each method preset, stacked (shapes only)",
      "trainer": "configs/deep_mlp.py itself (PB + SC + LWP, weight decay), stacked",
      "stacked_mesh": f"{residual}, PB + momentum SGD, stacked on a stage mesh",
  }
  result["workloads"] = {name: workload[name] for name in sections if name in _ONLY.value}
  for name, measure in sections.items():
    if name in _ONLY.value:
      start = time.perf_counter()
      logging.info("benchmark %r: started", name)
      result[name] = measure()
      if name == "methods" and len(result[name]) >= 2:
        result["methods_tick_fit"] = speed.tick_time_fit(result[name])
      logging.info("benchmark %r: done in %.0f s", name, time.perf_counter() - start)
      result["load_average_at_end"] = os.getloadavg()
      if _OUTPUT.value:  # after every section, so that a long run keeps what it measured
        files.write(_OUTPUT.value, json.dumps(result, indent=2) + "\n")
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  cli.run(main)
