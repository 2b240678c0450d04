r"""Benchmarks of the pipeline engine, measured side by side in one run; prints one JSON object.

    python scripts/benchmark.py                      # everything (about 15 minutes on 2 CPU cores)
    python scripts/benchmark.py --only=throughput --micro_batch_sizes=1
    python scripts/benchmark.py --only=conv --conv_impls=xla,sliced --conv_micro_batch_sizes=1
    python scripts/benchmark.py --output=benchmark.json
    python scripts/benchmark.py --only=normalization   # about 10 minutes: 10 compiled pipelines
    python scripts/benchmark.py --only=lm              # the transformer LM, about 2 minutes

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
  (``pipejax.stacking.StackedPipeline``), False (``Pipeline``) and None (the plain loop: the whole
  network as one optax step in ``lax.scan``): build and init seconds, trace and compile seconds of
  the full pipeline's ``run``, its ``operations_per_tick``, samples/s after the fill, and the
  delay lines' bytes held against the formula sum_s (D_s + 1)|x_s|. Only when asked.
* ``stacked_mesh``: the same residual MLP at ``--stacked_mesh_stages`` stages on a stage mesh of
  ``--stacked_mesh_devices`` devices, ``ShardedPipeline`` of the ``StackedPipeline`` (each
  device's piece of the group stacked) against that of the ``Pipeline``: build and compile
  seconds, the kernels of one loop iteration (two ticks), samples/s after the fill. Needs the
  devices, as ``sharding`` does. Only when asked.
* ``sharding``: ticks/s of ``ShardedPipeline.run`` on stage meshes of 1, 2, 4, 8 devices against
  ``Pipeline.run`` (same MLP, b = 1). Needs the devices: on a CPU run it with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (fake devices share the cores, so this
  measures the machinery's overhead, not a speed-up). ``two_halves``: the parallel speed-up, two
  balanced halves of an 8x512 MLP on 2 devices against 1 (b = 1, 2, 4), with both programs'
  passes. A mesh of several stage devices runs two ticks per loop iteration
  (``ShardedPipeline.ticks_per_iteration``); its passes are per tick all the same.
* ``lm``: tokens per second of ``Pipeline.run`` (PB + Adam) on configs/char_lm.py's transformer
  (byte vocabulary, width 128, 6 blocks: 8 stages, one sequence of 128 tokens per micro-batch,
  b = 1) against the plain loop (the whole model as one optax Adam step in ``lax.scan``), and
  their ratio. Only when asked.

Passes over the weights: XLA's ``cost_analysis`` of a compiled ``lax.scan`` counts its body once,
so the "bytes accessed" of a compiled chunk is that of one tick (plus the few bytes outside the
loop). Divided by the bytes of every stage's weights it is the number of weight-sized passes a
tick makes: at micro-batch 1 activations are a rounding error beside the weights. ``copies`` are
the bytes written by the unfused ``copy`` instructions XLA inserted (loop carries it could not
update in place), in the same unit; each also reads as much, inside ``bytes_accessed``.
``operations`` counts the kernels a tick launches (``operations_per_tick``): on a GPU at small
micro-batches they, not the passes, set the pace.
"""

import functools
import json
import os
import platform
import re
import time

from absl import flags, logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax
from pipejax import accounting, cli, engine, methods, models
from pipejax.engine import Pipeline

BENCHMARKS = ["throughput", "compile", "methods", "conv", "memory", "normalization", "sharding",
              "lm", "depth", "stacked_mesh"]
# Each adds minutes; 'sharding' and 'stacked_mesh' need fake devices.
OPT_IN = ("normalization", "sharding", "lm", "depth", "stacked_mesh")
_ONLY = flags.DEFINE_multi_enum("only", [b for b in BENCHMARKS if b not in OPT_IN], BENCHMARKS,
                                "Which benchmarks to run ('normalization' and 'sharding' only "
                                "when asked).")
_METHODS = flags.DEFINE_list("methods", ["pb", "pb_sc", "pb_lwp", "pb_sc_lwp", "pipedream",
                                         "spectrain", "pipemare", "dcasgd"],
                             "Presets for 'methods'.")
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
_OUTPUT = flags.DEFINE_string("output", None, "Also write the JSON here.")
_DEPTH_STAGES = flags.DEFINE_list("depth_stages", ["8", "32", "128", "256"],
                                  "Stage counts of the residual MLP for 'depth'.")
_DEPTH_TICKS = flags.DEFINE_integer("depth_ticks", 256, "Ticks per timed call of 'depth'.")
_DEPTH_UNSTACKED_MAX = flags.DEFINE_integer(
    "depth_unstacked_max", 256, "'depth' compiles the unstacked pipeline up to this many stages "
    "(its compile time grows with depth).")
_STACKED_MESH_STAGES = flags.DEFINE_integer("stacked_mesh_stages", 32,
                                            "Stages of the residual MLP for 'stacked_mesh'.")
_STACKED_MESH_DEVICES = flags.DEFINE_integer("stacked_mesh_devices", 4,
                                             "Stage-axis devices for 'stacked_mesh'.")

WIDTH, LAYERS = 256, 8
SHORTEST_TIMED_CALL_S = 0.05
RESNET_INPUT = (28, 28, 1)  # Fashion-MNIST


def mlp_model(num_layers=LAYERS, width=WIDTH):
  """num_layers Dense(width) stages with ReLU; the last layer's outputs are the logits."""
  stages = [pipejax.from_flax(nn.Sequential([nn.Dense(width), nn.relu]), name=f"dense{i}")
            for i in range(num_layers - 1)]
  return pipejax.Model(stages + [pipejax.from_flax(nn.Dense(width), name="logits")])


def default_model():
  """configs/default.py's model: the 784-256-128-10 MLP, one layer per stage."""
  return models.build("mlp", hidden=(256, 128), num_classes=10)


def resnet20(conv_impl="auto"):
  return models.build("cifar_resnet20", layers_per_stage=1, normalization="group",
                      conv_impl=conv_impl)


def stream(num_ticks, b, shape=(WIDTH,), classes=WIDTH):
  """Random inputs and labels for ``num_ticks`` micro-batches of ``b``, on the default device.

  Placed there once, so that no timed call copies the stream from the host (on a GPU that copy
  would cost more than the ticks themselves at small micro-batches).
  """
  rng = np.random.default_rng(0)
  x = rng.standard_normal((num_ticks, b) + shape, dtype=np.float32)
  y = rng.integers(0, classes, (num_ticks, b), dtype=np.int32)
  return jax.device_put(x), jax.device_put(y)


def best_times(fns, repeats):
  """Best wall and best CPU seconds of each of ``fns`` (a dict of calls), the calls interleaved.

  Round-robin repetitions put every candidate under the same load: on a shared machine a load
  that drifts between two sequential measurements would otherwise show up as a ratio. The CPU
  seconds (of every thread of this process) leave out the time spent waiting for a core, so on
  a loaded machine their ratios are the steadier ones; on an idle one the wall time is the figure
  (it includes the parallel work of both cores).
  """
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      wall, cpu = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn())
      times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
  best = {name: (min(w for w, _ in t), min(c for _, c in t)) for name, t in times.items()}
  too_short = [str(name) for name, (wall, _) in best.items() if wall < SHORTEST_TIMED_CALL_S]
  if too_short:  # a fast accelerator at the CPU's default sample counts
    logging.warning(
        "Timed calls of %s took under %.0f ms each, too short for a steady figure (the call's "
        "fixed cost weighs in). Give more samples: --samples, or --conv_samples for 'conv'.",
        ", ".join(too_short), 1000 * SHORTEST_TIMED_CALL_S)
  return best


class Runner:
  """Calls ``runner.run`` on a stream, keeping the donated state; warms up what it will time."""

  def __init__(self, runner, x, y, rng=jax.random.PRNGKey(0)):
    self.runner, self.x, self.y = runner, x, y
    self.state = runner.init(rng)

  def __call__(self):
    self.state, metrics = self.runner.run(self.state, self.x, self.y)
    return metrics["loss"]

  def pipeline_state(self):
    unpack = getattr(self.runner, "unpack", None)
    return unpack(self.state) if unpack else self.state

  def warm_up(self):
    """Compiles every program the timed calls run, and runs each once.

    ``Pipeline.run`` runs one compiled program while the pipeline fills and another once every
    slot holds a real micro-batch; timed calls (after the fill) run the second. So this runs until
    the pipeline is full, then once more.
    """
    self()
    while not self.runner.every_slot_full(self.state):
      self()
    self()


def plain_step(model, tx):
  """One optax step of the whole network, unpipelined: ``(params, opt_state), batch -> loss``."""
  def loss_fn(ps, xb, yb):
    h = xb
    for stage, p in zip(model.stages, ps):
      h = stage.apply(p, h, None)
    return model.loss(h, yb)[0]

  def step(carry, batch):
    p, opt = carry
    loss, g = jax.value_and_grad(loss_fn)(p, *batch)
    u, opt = tx.update(g, opt, p)
    return (optax.apply_updates(p, u), opt), loss

  return step


def weight_bytes(pipe):
  return sum(accounting.tree_bytes(p) for p in pipe.stage_param_shapes)


def copy_bytes(hlo_text):
  """Bytes written by the ``copy`` instructions of an optimized HLO module that are passes.

  A copy inside a fused computation (a transpose fused into its consumer) costs no pass of its
  own; only copies in the other computations (the loop body, the entry) are counted. Of the
  branches of a conditional only one runs: each conditional counts its costliest branch, as
  ``cost_analysis`` does.
  """
  per_computation, branch_sets, name, fused = {}, [], None, False
  for line in hlo_text.splitlines():
    if line and not line[0].isspace():  # a computation's header, or its closing brace
      name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
      fused = name.lstrip("%").startswith("fused_")
      continue
    branches = re.search(r"branch_computations=\{([^}]*)\}", line)
    if branches:
      branch_sets.append([b.strip() for b in branches.group(1).split(",")])
    match = re.search(r"= (\w+)\[([\d,]*)\](?:\{[^}]*\})? copy\(", line)
    if match and not fused:
      dtype, dims = match.groups()
      size = 1 if dtype == "pred" else int(re.sub(r"\D", "", dtype)) // 8  # f32, bf16, s8, ...
      count = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
      per_computation[name] = per_computation.get(name, 0) + size * count
  in_branches = {b for branch_set in branch_sets for b in branch_set}
  return (sum(v for k, v in per_computation.items() if k not in in_branches)
          + sum(max(per_computation.get(b, 0) for b in branch_set) for branch_set in branch_sets))


# Instructions that launch nothing: they name, group or reinterpret buffers other work produced.
_FREE_OPERATIONS = frozenset({"parameter", "get-tuple-element", "tuple", "constant", "bitcast",
                              "opt-barrier", "after-all", "partition-id", "replica-id"})


# An instruction's called computations: ``body=%b``, ``branch_computations={%x, %y}``, ...
_CALLED_COMPUTATIONS = re.compile(r"\b(body|condition|calls|to_apply|branch_computations|"
                                  r"true_computation|false_computation)=(\{[^}]*\}|%[\w.-]+)")


def operations_per_tick(hlo_text):
  """Operations of the loop body of a compiled chunk: one tick's kernel launches on a GPU.

  A fusion is one kernel and a library call (a cuBLAS product) is one; a loop inside the tick
  counts its body and condition, and a conditional itself and its costliest branch (one runs).
  At small micro-batches a GPU spends its tick launching kernels rather than computing, so this
  count, not the passes over the weights, sets the pace there. Of several loops the costliest
  body is the tick.
  """
  computations, name, entry = {}, None, None  # computation -> [(opcode, {role: [callees]})]
  for line in hlo_text.splitlines():
    if line.startswith(("%", "ENTRY ")):
      name = line.split()[1] if line.startswith("ENTRY ") else line.split()[0]
      computations[name] = []
      if line.startswith("ENTRY "):
        entry = name
    elif name and re.match(r"\s+(ROOT )?%", line):
      opcode = re.search(r" = .*?\s([a-z][a-z0-9-]*)\(", line)
      callees = {role: re.findall(r"%[\w.-]+", targets)
                 for role, targets in re.findall(_CALLED_COMPUTATIONS, line)}
      computations[name].append((opcode.group(1) if opcode else "", callees))

  def count(computation):
    total = 0
    for opcode, callees in computations.get(computation, []):
      called = [c for targets in callees.values() for c in targets]
      if opcode in _FREE_OPERATIONS:
        continue
      if opcode in ("while", "call"):
        total += sum(count(c) for c in called)
      elif opcode == "conditional":
        total += 1 + max((count(c) for c in called), default=0)
      else:
        total += 1
    return total

  def loop_bodies(computation):
    for opcode, callees in computations.get(computation, []):
      if opcode == "while":
        yield from callees.get("body", [])
      elif opcode in ("call", "conditional"):
        for targets in callees.values():
          for c in targets:
            yield from loop_bodies(c)

  return max((count(body) for body in loop_bodies(entry)), default=count(entry))


def passes(compiled, per_pass_bytes):
  """Weight-sized passes of a compiled tick: bytes accessed and copied over the weights' bytes."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  hlo_text = compiled.as_text()
  return {"bytes_accessed": cost["bytes accessed"] / per_pass_bytes,
          "copies": copy_bytes(hlo_text) / per_pass_bytes,
          "operations": operations_per_tick(hlo_text)}


def pipeline_passes(pipe, x, y):
  """Passes per tick of both programs of ``Pipeline.run``: after the fill, and while filling."""
  state = jax.eval_shape(pipe.init, jax.random.PRNGKey(0))
  per_pass = weight_bytes(pipe)
  full, filling = (passes(pipe.lower(state, x[:4], y[:4], every_slot_full=full).compile(),
                          per_pass) for full in (True, False))
  return {"full": full, "filling": filling}


def plain_passes(model, tx, params, x, y, jit=jax.jit):
  """Passes per tick of the plain loop (``jit=engine.jit``: compiled as the pipeline is)."""
  scan = jit(lambda carry, xs: jax.lax.scan(plain_step(model, tx), carry, xs), donate_argnums=0)
  compiled = scan.lower((params, tx.init(params)), (x[:4], y[:4])).compile()
  return passes(compiled, accounting.tree_bytes(params))


def versus_plain(model, tx, x, y, repeats, with_jit_step=False, with_in_place_scan=False):
  """Samples/s of Pipeline.run (PB) and of the plain optax step, side by side on one stream."""
  ticks, b = x.shape[:2]
  pipe = Pipeline(model, methods.pb(tx), x[0], y[0])
  run_pipeline = Runner(pipe, x, y)
  params = [st.params for st in run_pipeline.state.stages]
  step = plain_step(model, tx)
  scan = jax.jit(lambda carry, xs: jax.lax.scan(step, carry, xs), donate_argnums=0)
  plain = {"carry": (jax.tree.map(jnp.copy, params), tx.init(params))}

  def run_scan(scan=scan):
    plain["carry"], losses = scan(plain["carry"], (x, y))
    return losses

  # The same loop compiled with the pipeline's compiler options (no copy of the weight carries).
  scan_in_place = engine.jit(lambda carry, xs: jax.lax.scan(step, carry, xs), donate_argnums=0)

  jitted_step = jax.jit(step, donate_argnums=0)

  def run_steps():
    for t in range(ticks):
      plain["carry"], loss = jitted_step(plain["carry"], (x[t], y[t]))
    return loss

  run_pipeline.warm_up()
  timed = {"pipeline": run_pipeline, "plain_scan": run_scan}
  if with_in_place_scan:
    timed["plain_scan_compiled_as_the_pipeline"] = functools.partial(run_scan, scan_in_place)
  if with_jit_step:
    timed["plain_jit_step"] = run_steps
  for fn in timed.values():
    fn()  # compile and warm up (the pipeline: once more)
  row = {"micro_batch_size": b, "ticks": ticks}
  for name, (wall, cpu) in best_times(timed, repeats).items():
    row[f"{name}_samples_per_s"] = ticks * b / wall
    row[f"{name}_samples_per_cpu_s"] = ticks * b / cpu
  for name in timed:
    if name != "pipeline":
      row[f"ratio_pipeline_over_{name}"] = (row["pipeline_samples_per_s"]
                                            / row[f"{name}_samples_per_s"])
      row[f"cpu_ratio_pipeline_over_{name}"] = (row["pipeline_samples_per_cpu_s"]
                                                / row[f"{name}_samples_per_cpu_s"])
  return row, pipe, params


def throughput(b, samples, repeats):
  tx = optax.sgd(0.01, momentum=0.9)
  x, y = stream(max(samples // b, 1), b)
  row, pipe, params = versus_plain(mlp_model(), tx, x, y, repeats, with_in_place_scan=True)
  row["ratio_pipeline_over_plain"] = row.pop("ratio_pipeline_over_plain_scan")
  row["cpu_ratio_pipeline_over_plain"] = row.pop("cpu_ratio_pipeline_over_plain_scan")
  if b == 1:  # where weight passes, not products, set the pace
    row["passes_per_tick"] = {"pipeline": pipeline_passes(pipe, x, y)["full"],
                              "plain_scan": plain_passes(pipe.model, tx, params, x, y),
                              "plain_scan_compiled_as_the_pipeline": plain_passes(
                                  pipe.model, tx, params, x, y, jit=engine.jit)}
  return row


def conv_speeds(b, conv_impl, samples, repeats):
  """ResNet-20 (GroupNorm, 28x28x1, one conv per stage): Pipeline.run against plain optax."""
  logging.info("conv: %s convolutions at micro-batch %d", conv_impl, b)
  x, y = stream(max(samples // b, 1), b, RESNET_INPUT, classes=10)
  row, _, _ = versus_plain(resnet20(conv_impl), optax.sgd(0.01, momentum=0.9), x, y, repeats,
                           with_jit_step=True)
  return {"conv_impl": conv_impl, "resolved_conv_impl": models.resolve_conv_impl(conv_impl),
          **row}


def method_speeds(names, samples, repeats):
  """Samples/s and weight passes of Pipeline.run for each method preset at b = 1, after the fill."""
  model = default_model()
  x, y = stream(samples, 1, (28, 28, 1), classes=10)
  runners, rows = {}, []
  for name in names:
    pipe = Pipeline(model, methods.make_method(name, learning_rate=1e-3, momentum=0.9), x[0], y[0])
    runners[name] = Runner(pipe, x, y)
    runners[name].warm_up()
    rows.append({"method": name, "passes_per_tick": pipeline_passes(pipe, x, y)})
  seconds = best_times(runners, repeats)
  for row in rows:
    wall, cpu = seconds[row["method"]]
    row["samples_per_s"], row["samples_per_cpu_s"] = samples / wall, samples / cpu
  reference = next((r for r in rows if r["method"] == "pb"), None)
  for row in rows:
    row["relative_to_pb"] = row["samples_per_s"] / reference["samples_per_s"] if reference \
        else None
    row["cpu_relative_to_pb"] = (row["samples_per_cpu_s"] / reference["samples_per_cpu_s"]
                                 if reference else None)
  return rows


LM_CONTEXT = 128
LM_MODEL = {"width": 128, "blocks": 6, "heads": 4}  # configs/char_lm.py's


def lm_speeds(sequences, repeats):
  """Tokens/s of Pipeline.run (PB + Adam) on the transformer LM against the plain Adam loop."""
  model = models.build("transformer_lm", **LM_MODEL)
  tokens = np.random.default_rng(0).integers(0, 256, (sequences, 1, LM_CONTEXT + 1))
  x = jax.device_put(tokens[..., :-1].astype(np.float32))
  y = jax.device_put(tokens[..., 1:].astype(np.int32))
  row, pipe, _ = versus_plain(model, optax.adam(3e-4), x, y, repeats)
  result = {"model": f"transformer_lm {LM_MODEL}, {pipe.num_stages} stages",
            "context": LM_CONTEXT, "micro_batch_size": 1, "sequences": sequences}
  for name in ("pipeline", "plain_scan"):
    result[f"{name}_tokens_per_s"] = row[f"{name}_samples_per_s"] * LM_CONTEXT
    result[f"{name}_tokens_per_cpu_s"] = row[f"{name}_samples_per_cpu_s"] * LM_CONTEXT
  result["ratio_pipeline_over_plain"] = row["ratio_pipeline_over_plain_scan"]
  result["cpu_ratio_pipeline_over_plain"] = row["cpu_ratio_pipeline_over_plain_scan"]
  return result


def tick_time_fit(rows, target=0.85):
  """A line through the methods' tick times (b = 1) against their compiled passes per tick.

  ``fixed_us`` is what a tick costs whatever its weight traffic, ``us_per_pass`` what one more
  pass over the weights costs; ``extra_passes_at_target`` is how many passes more than ``pb``
  a method may make and still run at ``target`` of its speed (docs/performance.md §3).
  """
  passes = np.array([r["passes_per_tick"]["full"]["bytes_accessed"] for r in rows])
  micros = np.array([1e6 / r["samples_per_s"] for r in rows])  # one sample a tick at b = 1
  us_per_pass, fixed_us = np.polyfit(passes, micros, 1)
  fit = {"fixed_us": float(fixed_us), "us_per_pass": float(us_per_pass),
         "largest_residual_us": float(np.abs(micros - (fixed_us + us_per_pass * passes)).max())}
  pb = next((p for r, p in zip(rows, passes) if r["method"] == "pb"), None)
  if pb is not None:
    allowed = (fixed_us + us_per_pass * pb) / target
    fit["extra_passes_at_target"] = float((allowed - fixed_us) / us_per_pass - pb)
    fit["target"] = target
  return fit


NORMALIZED_MODELS = {  # name -> (builder, its kwargs, input shape, normalizations)
    "default MLP 784-256-128-10": ("mlp", {"hidden": (256, 128)}, (28, 28, 1),
                                   (None, "layer", "online")),
    "deep MLP, 7 x 128": ("mlp", {"hidden": (128,) * 7}, (28, 28, 1), (None, "layer", "online")),
    "ResNet-20, width 8": ("cifar_resnet20", {"width": 8}, RESNET_INPUT,
                           (None, "group", "layer", "online")),
}


def normalization_speeds(samples, conv_samples, repeats):
  """Samples/s of Pipeline.run (PB + SC + LWP, b = 1) per model and normalizer, after the fill.

  Every case is warmed up first, then the timed calls are interleaved (``best_times``), so a
  machine whose load drifts slows every case alike.
  """
  rows, runners = [], {}
  for label, (builder, kwargs, shape, normalizations) in NORMALIZED_MODELS.items():
    ticks = conv_samples if builder == "cifar_resnet20" else samples
    x, y = stream(ticks, 1, shape, classes=10)
    for normalization in normalizations:
      model = models.build(builder, layers_per_stage=1, normalization=normalization,
                           num_classes=10, **kwargs)
      pipe = Pipeline(model, methods.make_method("pb_sc_lwp", learning_rate=1e-3, momentum=0.9),
                      x[0], y[0])
      runners[label, normalization] = Runner(pipe, x, y)
      runners[label, normalization].warm_up()
      rows.append({"model": label, "normalization": normalization, "samples": ticks})
  seconds = best_times(runners, repeats)
  for row in rows:
    wall, cpu = seconds[row["model"], row["normalization"]]
    row["samples_per_s"], row["samples_per_cpu_s"] = row["samples"] / wall, row["samples"] / cpu
  for row in rows:
    base = next(r for r in rows if r["model"] == row["model"] and r["normalization"] is None)
    row["relative_to_none"] = row["samples_per_s"] / base["samples_per_s"]
    row["cpu_relative_to_none"] = row["samples_per_cpu_s"] / base["samples_per_cpu_s"]
  return rows


def memory(name, model, example_input, num_classes, ticks=64):
  """Compiled memory of a training chunk of ``ticks`` ticks against the formula, in bytes.

  The formula: weights + optimizer state + stashed inputs sum_s (D_s+1)|x_s| + the registers
  (each stage's forward and backward outputs of the last tick). The chunk's own input stream and
  metrics are arguments and outputs of the program too; they are reported, not counted.
  """
  x, y = stream(ticks, example_input.shape[0], example_input.shape[1:], classes=num_classes)
  pipe = Pipeline(model, methods.make_method("pb_sc_lwp", learning_rate=1e-3, momentum=0.9),
                  x[0], y[0])
  state = jax.eval_shape(pipe.init, jax.random.PRNGKey(0))
  batch = pipe.checked_batch(x, y, None, ticks=True)
  compiled = pipe.lower(state, x, y).compile()
  stats = compiled.memory_analysis()
  parts = {
      "weights": sum(accounting.tree_bytes(st.params) for st in state.stages),
      "optimizer_state": sum(accounting.tree_bytes(st.opt_state) for st in state.stages),
      "stash": pipe.stash_bytes(),
      "registers": sum(accounting.tree_bytes((st.forward_out, st.backward_out))
                       for st in state.stages),
  }
  formula = sum(parts.values())
  stream_bytes = accounting.tree_bytes(batch)
  metrics_bytes = accounting.tree_bytes(jax.eval_shape(pipe._run, state, batch)[1])
  # Arguments (state + stream) and outputs (state + metrics) share the donated state's buffers.
  live = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
          + stats.temp_size_in_bytes)
  compiled_state = live - stream_bytes - metrics_bytes
  return {
      "model": name, "method": "pb_sc_lwp", "ticks": ticks, "formula_bytes": formula,
      "formula_parts": parts, "compiled_bytes": compiled_state,
      "ratio_compiled_over_formula": compiled_state / formula,
      "memory_analysis": {k: getattr(stats, k) for k in (
          "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "peak_memory_in_bytes") if hasattr(stats, k)},
      "stream_bytes": stream_bytes, "metrics_bytes": metrics_bytes,
      "temp_over_weights": stats.temp_size_in_bytes / parts["weights"],
  }


def sharded_passes(sharded, x, y):
  """Passes per tick of a ShardedPipeline's full-pipeline program, over all stages' weights."""
  packed = sharded.init(jax.random.PRNGKey(0))
  batch = sharded.placed_batch(x[:4], y[:4])
  compiled = sharded.programs[1].lower(packed, batch).compile()
  # One loop iteration runs ticks_per_iteration ticks (two over several devices).
  return passes(compiled, weight_bytes(sharded.pipeline) * sharded.ticks_per_iteration)


def sharding_speeds(ticks, repeats):
  """Ticks/s of Pipeline.run and of ShardedPipeline.run on 1, 2, 4, 8-device stage meshes."""
  from pipejax import mesh, sharding  # only this benchmark needs meshes
  x, y = stream(ticks, 1)
  pipe = Pipeline(mlp_model(), methods.pb(optax.sgd(0.01, momentum=0.9)), x[0], y[0])
  runners, sharded = {}, {}
  for devices in [None] + [n for n in (1, 2, 4, 8) if n <= jax.device_count()]:
    runner = pipe if devices is None else sharding.ShardedPipeline(
        pipe, mesh.make_mesh(devices, 1, jax.devices()[:devices]))
    if devices is not None:
      sharded[devices] = runner
    runners[devices or "Pipeline.run"] = Runner(runner, x, y)
    runners[devices or "Pipeline.run"].warm_up()
  rows = [{"stage_devices": name, "ticks_per_s": ticks / wall, "ticks_per_cpu_s": ticks / cpu}
          for name, (wall, cpu) in best_times(runners, repeats).items()]
  for row in rows:
    row["relative_to_pipeline_run"] = row["ticks_per_s"] / rows[0]["ticks_per_s"]
    row["cpu_relative_to_pipeline_run"] = row["ticks_per_cpu_s"] / rows[0]["ticks_per_cpu_s"]
    if row["stage_devices"] in sharded:
      row["passes_per_tick"] = sharded_passes(sharded[row["stage_devices"]], x, y)
    else:
      row["passes_per_tick"] = pipeline_passes(pipe, x, y)["full"]
  return rows


def sharded_method_passes(names, device_counts=(1, 2, 8)):
  """Passes per tick of each method's mesh program (the 8x256 MLP, b = 1), over all weights.

  A delay line that a tick rewrote whole, PipeDream's weight stash above all, shows here as
  passes the 1-device program does not make.
  """
  from pipejax import mesh as mesh_lib, sharding  # only this benchmark needs meshes
  x, y = stream(4, 1)
  rows = []
  for name in names:
    pipe = Pipeline(mlp_model(), methods.make_method(name, learning_rate=1e-3, momentum=0.9),
                    x[0], y[0])
    row = {"method": name, "pipeline_run": pipeline_passes(pipe, x, y)["full"]}
    for devices in (n for n in device_counts if n <= jax.device_count()):
      mesh = mesh_lib.make_mesh(devices, 1, jax.devices()[:devices])
      row[f"{devices}_devices"] = sharded_passes(sharding.ShardedPipeline(pipe, mesh), x, y)
    rows.append(row)
  return rows


def fake_device_speedup(steps, repeats, width=512, layers=8, b=4):
  """A chain of ``layers`` products per step in a ``shard_map`` scan: 1 device against 2.

  The control for ``two_halves``: it shows whether this machine's fake devices run their
  programs in parallel at all. Each step's products depend on one another, so one device has no
  independent work to overlap; two devices take half the chain each. Variants add the two
  ``ppermute``s a pipeline tick makes, and a ``lax.switch`` on the device's index around the
  products, as the mesh's tick has.
  """
  from jax.sharding import Mesh, PartitionSpec as P

  def program(devices, exchange, switch):
    per_device = layers // devices
    mesh = Mesh(np.array(jax.devices()[:devices]), ("stage",))

    def on_device(w, x):
      w, x = w[0], x[0]

      def chain(x):
        for layer in range(per_device):
          x = jnp.tanh(x @ w[layer])
        return x

      def step(x, _):
        x = jax.lax.switch(jax.lax.axis_index("stage"), [chain] * devices, x) if switch \
            else chain(x)
        if exchange and devices > 1:
          ring = [(d, (d + 1) % devices) for d in range(devices)]
          x = x + jax.lax.ppermute(x, "stage", ring)
          x = x + jax.lax.ppermute(x, "stage", [(dst, src) for src, dst in ring])
        return x, ()

      return jax.lax.scan(step, x, None, length=steps)[0][None]

    run = jax.jit(jax.shard_map(on_device, mesh=mesh, in_specs=(P("stage"), P("stage")),
                                out_specs=P("stage"), check_vma=False))
    w = jnp.full((devices, per_device, width, width), 1e-3, jnp.float32)
    x = jnp.ones((devices, b, width), jnp.float32)
    run(w, x).block_until_ready()
    return lambda: run(w, x)

  rows = []
  for exchange, switch in ((False, False), (True, False), (True, True)):
    seconds = best_times({1: program(1, exchange, switch), 2: program(2, exchange, switch)},
                         repeats)
    rows.append({"exchange": exchange, "switch": switch, "steps": steps,
                 **{f"{n}_device_ms_per_step": 1e3 * seconds[n][0] / steps for n in (1, 2)},
                 **{f"{n}_device_cores_busy": seconds[n][1] / seconds[n][0] for n in (1, 2)},
                 "speedup_2_over_1_device": seconds[1][0] / seconds[2][0]})
  return rows


def two_halves_speedup(b, ticks, repeats, width=512, layers=8):
  """ShardedPipeline of two balanced halves (layers/2 layers each) on 2 devices against 1 device.

  One dense layer per stage; the partition puts the first half on device 0 and the second on
  device 1, so with two devices each one's products run on its own core.
  """
  from pipejax import mesh, sharding  # only this benchmark needs meshes
  x, y = stream(ticks, b, (width,), classes=width)
  pipe = Pipeline(mlp_model(layers, width), methods.pb(optax.sgd(0.01, momentum=0.9)), x[0], y[0])
  half = layers // 2
  runners = {"Pipeline.run": Runner(pipe, x, y)}
  for devices, partition in ((1, None), (2, [(0, half), (half, layers)])):
    runners[devices] = Runner(sharding.ShardedPipeline(
        pipe, mesh.make_mesh(devices, 1, jax.devices()[:devices]), partition=partition), x, y)
  for runner in runners.values():
    runner.warm_up()
  seconds = best_times(runners, repeats)
  row = {"micro_batch_size": b, "ticks": ticks, "width": width, "layers": layers}
  for name, (wall, cpu) in seconds.items():
    row[f"{name}_ticks_per_s"] = ticks / wall
    row[f"{name}_ticks_per_cpu_s"] = ticks / cpu
  # Over all weights; a device of the two holds half of them, so it makes twice as many passes
  # over its own.
  row["passes_per_tick"] = {devices: sharded_passes(runners[devices].runner, x, y)
                            for devices in (1, 2)}
  row["speedup_2_over_1_device"] = row["2_ticks_per_s"] / row["1_ticks_per_s"]
  row["one_device_mesh_over_pipeline_run"] = row["1_ticks_per_s"] / row["Pipeline.run_ticks_per_s"]
  return row


def compile_time(num_stages):
  model = mlp_model(num_layers=num_stages)
  x, y = stream(4, 1)
  start = time.perf_counter()
  pipe = Pipeline(model, methods.pb(optax.sgd(0.01, momentum=0.9)), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0))
  build_s = time.perf_counter() - start
  batch = pipe.checked_batch(x, y, None, ticks=True)
  start = time.perf_counter()
  pipe.programs[0].lower(state, batch).compile()
  return {"num_stages": num_stages, "build_and_init_s": build_s,
          "trace_and_compile_s": time.perf_counter() - start}


def depth_model(num_stages):
  """configs/deep_mlp.py's residual MLP (width 128, LayerNorm), one block per stage."""
  return models.build("residual_mlp", num_classes=10, depth=num_stages, width=128, expansion=1,
                      normalization="layer", layers_per_stage=1)


def stacked_mesh_records(num_stages, devices, ticks, repeats):
  """The ``stacked_mesh`` section: the depth MLP on a stage mesh, stacked pieces and not."""
  from pipejax import sharding, stacking  # pylint: disable=import-outside-toplevel
  x, y = stream(ticks, 1, shape=RESNET_INPUT, classes=10)
  pipe = Pipeline(depth_model(num_stages), methods.pb(optax.sgd(0.01, momentum=0.9)), x[0], y[0])
  mesh = sharding.make_mesh(devices, 1, jax.devices()[:devices])
  records, timed = {}, {}
  for stacked in (True, False):
    start = time.perf_counter()
    sharded = sharding.ShardedPipeline(stacking.StackedPipeline(pipe) if stacked else pipe, mesh)
    run = Runner(sharded, x, y)
    compiled = sharded.programs[1].lower(run.state, sharded.placed_batch(x, y)).compile()
    records[stacked] = {"num_stages": num_stages, "stage_devices": devices, "stacked": stacked,
                        "partition": sharded.partition,
                        "build_and_compile_s": time.perf_counter() - start,
                        "operations_per_iteration": operations_per_tick(compiled.as_text())}
    run.warm_up()
    timed[stacked] = run
  for stacked, (wall, cpu) in best_times(timed, repeats).items():
    records[stacked].update(samples_per_s=ticks / wall, samples_per_cpu_s=ticks / cpu)
  return list(records.values())


def depth_records(num_stages, ticks, repeats, unstacked_max):
  """The ``depth`` section's records at one depth: stacked, per stage (up to ``unstacked_max``
  stages) and the plain loop, timed side by side (interleaved, as :func:`best_times` does)."""
  from pipejax import stacking  # pylint: disable=import-outside-toplevel
  model = depth_model(num_stages)
  x, y = stream(ticks, 1, shape=RESNET_INPUT, classes=10)
  tx = optax.sgd(0.01, momentum=0.9)
  records, timed = {}, {}
  for stacked in (True, False):
    if not stacked and num_stages > unstacked_max:
      continue
    start = time.perf_counter()
    pipe = Pipeline(model, methods.pb(tx), x[0], y[0])
    runner = stacking.StackedPipeline(pipe) if stacked else pipe
    run = Runner(runner, x, y)
    jax.block_until_ready(run.state)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = runner.lower(run.state, x, y).compile()
    records[stacked] = {
        "num_stages": num_stages, "stacked": stacked, "build_and_init_s": build_s,
        "trace_and_compile_s": time.perf_counter() - start,
        "operations_per_tick": operations_per_tick(compiled.as_text()),
        "delay_line_bytes": runner.held_stash_bytes(run.state) if stacked
                            else pipe.held_stash_bytes(run.state),
        "delay_line_formula_bytes": pipe.stash_bytes()}
    run.warm_up()
    timed[stacked] = run
  params = [st.params for st in pipe.init(jax.random.PRNGKey(0)).stages]
  scan = jax.jit(lambda carry, xs: jax.lax.scan(plain_step(model, tx), carry, xs),
                 donate_argnums=0)
  plain = {"carry": (params, tx.init(params))}
  start = time.perf_counter()
  compiled = scan.lower(plain["carry"], (x, y)).compile()
  records[None] = {"num_stages": num_stages, "stacked": None, "build_and_init_s": None,
                   "trace_and_compile_s": time.perf_counter() - start,
                   "operations_per_tick": operations_per_tick(compiled.as_text()),
                   "delay_line_bytes": 0, "delay_line_formula_bytes": 0}

  def run_scan():
    plain["carry"], losses = compiled(plain["carry"], (x, y))
    return losses

  run_scan()
  timed[None] = run_scan
  for stacked, (wall, cpu) in best_times(timed, repeats).items():
    records[stacked].update(samples_per_s=ticks / wall, samples_per_cpu_s=ticks / cpu)
    logging.info("depth: %s", records[stacked])
  return list(records.values())


def main(argv):
  del argv
  result = {
      "device": str(jax.devices()[0].device_kind),
      "backend": jax.default_backend(),
      "device_count": jax.device_count(),
      "cpu_count": os.cpu_count(),
      "load_average_at_start": os.getloadavg(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),  # fake devices, threading options
      "jax": jax.__version__,
      "python": platform.python_version(),
      "model": f"MLP, {LAYERS} layers of width {WIDTH}, one layer per stage, PB + momentum SGD",
  }
  sections = {
      "throughput": lambda: [throughput(int(b), _SAMPLES.value, _REPEATS.value)
                             for b in _MICRO_BATCH_SIZES.value],
      "methods": lambda: method_speeds(_METHODS.value, _SAMPLES.value // 2, _REPEATS.value),
      "memory": lambda: [
          memory("default MLP 784-256-128-10", default_model(), np.zeros((1, 28, 28, 1)), 10),
          memory("ResNet-20 (GroupNorm), 28x28x1", resnet20(), np.zeros((1,) + RESNET_INPUT), 10)],
      "normalization": lambda: normalization_speeds(_SAMPLES.value // 2, _CONV_SAMPLES.value,
                                                    _REPEATS.value),
      "conv": lambda: [conv_speeds(b, impl, _CONV_SAMPLES.value, _REPEATS.value)
                       for impl in _CONV_IMPLS.value
                       for b in map(int, _CONV_MICRO_BATCH_SIZES.value)],
      "sharding": lambda: {
          "stage_meshes": sharding_speeds(_SAMPLES.value // 8, _REPEATS.value),
          "two_halves": [two_halves_speedup(b, _SAMPLES.value // 16, _REPEATS.value)
                         for b in (1, 2, 4) if jax.device_count() >= 2],
          "two_halves_by_depth": [two_halves_speedup(1, _SAMPLES.value // 16, _REPEATS.value,
                                                     layers=layers)
                                  for layers in (4, 16) if jax.device_count() >= 2],
          "fake_device_control": (fake_device_speedup(3000, _REPEATS.value)
                                  if jax.device_count() >= 2 else []),
          "method_passes": sharded_method_passes(("pb", "pb_sc_lwp", "pipedream"))},
      "compile": lambda: [compile_time(int(s)) for s in _COMPILE_STAGES.value],
      "lm": lambda: lm_speeds(_LM_SEQUENCES.value, _REPEATS.value),
      "depth": lambda: [record for s in _DEPTH_STAGES.value
                        for record in depth_records(int(s), _DEPTH_TICKS.value, _REPEATS.value,
                                                    _DEPTH_UNSTACKED_MAX.value)],
      "stacked_mesh": lambda: stacked_mesh_records(
          _STACKED_MESH_STAGES.value, _STACKED_MESH_DEVICES.value, _DEPTH_TICKS.value,
          _REPEATS.value),
  }
  for name, measure in sections.items():
    if name in _ONLY.value:
      start = time.perf_counter()
      logging.info("benchmark %r: started", name)
      result[name] = measure()
      if name == "methods" and len(result[name]) >= 2:
        result["methods_tick_fit"] = tick_time_fit(result[name])
      logging.info("benchmark %r: done in %.0f s", name, time.perf_counter() - start)
      result["load_average_at_end"] = os.getloadavg()
      if _OUTPUT.value:  # after every section, so that a long run keeps what it measured
        with open(_OUTPUT.value, "w") as f:
          f.write(json.dumps(result, indent=2) + "\n")
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  cli.run(main)
