"""One device: samples per second of ``Pipeline.run`` against the plain loop, side by side.

Every comparison warms up each candidate first and then interleaves the timed calls
(:func:`~pipejax.profiling.timing.best_times`), so a machine whose load drifts slows every
candidate alike. Speeds are after the fill, when ``run`` runs the full pipeline's program.
"""

from __future__ import annotations

import functools
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipejax import methods, models
from pipejax.core import accounting, stages
from pipejax.core.engine import Pipeline
from pipejax.profiling import hlo, timing, workloads
from pipejax.profiling.timing import TimedRunner, best_times
from pipejax.profiling.workloads import RESNET_INPUT, stream
from pipejax.core.runner import jit as pipeline_jit


def versus_plain(model, tx, x, y, repeats, with_jit_step=False, with_in_place_scan=False,
                 runner=None, compile_time=False):
  """Samples/s of Pipeline.run (PB) and of the plain optax step, side by side on one stream.

  ``runner`` lays the pipeline out anew (``Pipeline.restacked``: its stacked layout).
  Returns the row, the pipeline (or its runner), and its initial weights; with ``compile_time``
  also the full pipeline's compiled ``run``, and the seconds to trace and compile it in the row
  (``pipeline_compile_s``).
  """
  ticks, b = x.shape[:2]
  pipe = Pipeline(model, methods.pb(tx), x[0], y[0])
  if runner is not None:
    pipe = runner(pipe)
  run_pipeline = TimedRunner(pipe, x, y)
  params = [st.params for st in pipe.to_logical(run_pipeline.state).stages]
  if compile_time:
    start = time.perf_counter()
    compiled = pipe.lower(run_pipeline.state, x, y).compile()
    compile_s = time.perf_counter() - start
  plain = {"carry": (jax.tree.map(jnp.copy, params), tx.init(params))}

  def run_scan(scan=workloads.plain_scan(model, tx)):
    plain["carry"], losses = scan(plain["carry"], (x, y))
    return losses

  jitted_step = jax.jit(stages.plain_step(model, tx), donate_argnums=0)

  def run_steps():
    for t in range(ticks):
      plain["carry"], loss = jitted_step(plain["carry"], (x[t], y[t]))
    return loss

  run_pipeline.warm_up()
  timed = {"pipeline": run_pipeline, "plain_scan": run_scan}
  if with_in_place_scan:  # the same loop compiled with the pipeline's options (weights in place)
    timed["plain_scan_compiled_as_the_pipeline"] = functools.partial(
        run_scan, workloads.plain_scan(model, tx, jit=pipeline_jit))
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
  if compile_time:
    row["pipeline_compile_s"] = compile_s
    return row, pipe, params, compiled
  return row, pipe, params


def throughput(b: int, samples: int, repeats: int) -> dict:
  """The MLP of ``workloads.mlp_model``, PB + momentum SGD, against the plain loop at ``b``.

  At b = 1 (where weight passes, not products, set the pace) also both programs' passes.
  """
  tx = optax.sgd(0.01, momentum=0.9)
  x, y = stream(max(samples // b, 1), b)
  row, pipe, params = versus_plain(workloads.mlp_model(), tx, x, y, repeats,
                                   with_in_place_scan=True)
  row["ratio_pipeline_over_plain"] = row.pop("ratio_pipeline_over_plain_scan")
  row["cpu_ratio_pipeline_over_plain"] = row.pop("cpu_ratio_pipeline_over_plain_scan")
  if b == 1:
    plain = lambda jit: hlo.plain_passes(workloads.plain_scan(pipe.model, tx, jit=jit), params,
                                         tx.init(params), x, y)
    row["passes_per_tick"] = {"pipeline": hlo.pipeline_passes(pipe, x, y)["full"],
                              "plain_scan": plain(jax.jit),
                              "plain_scan_compiled_as_the_pipeline": plain(pipeline_jit)}
  return row


def conv_speeds(b: int, conv_impl: str, samples: int, repeats: int) -> dict:
  """ResNet-20 (GroupNorm, 28x28x1, one conv per stage): Pipeline.run against plain optax,
  called from Python (``plain_jit_step``) and inside ``lax.scan`` (``plain_scan``)."""
  logging.info("conv: %s convolutions at micro-batch %d", conv_impl, b)
  x, y = stream(max(samples // b, 1), b, RESNET_INPUT, classes=10)
  row, _, _ = versus_plain(workloads.resnet20(conv_impl), optax.sgd(0.01, momentum=0.9), x, y,
                           repeats, with_jit_step=True)
  return {"conv_impl": conv_impl, "resolved_conv_impl": models.resolve_conv_impl(conv_impl),
          **row}


def relative_to(rows: list[dict], is_base, prefix: str) -> None:
  """Adds ``relative_to_{prefix}`` and ``cpu_relative_to_{prefix}`` to each row: its speed over
  that of the row ``is_base`` picks among those of its model (None where there is none)."""
  for row in rows:
    base = next((r for r in rows if r.get("model") == row.get("model") and is_base(r)), None)
    for key, speed in ((f"relative_to_{prefix}", "samples_per_s"),
                       (f"cpu_relative_to_{prefix}", "samples_per_cpu_s")):
      row[key] = row[speed] / base[speed] if base else None


def method_speeds(names, samples: int, repeats: int) -> list[dict]:
  """Samples/s and weight passes of Pipeline.run for each method preset at b = 1, after the fill,
  on the default config's model; each relative to ``pb``."""
  model = workloads.default_model()
  x, y = stream(samples, 1, (28, 28, 1), classes=10)
  runners, rows = {}, []
  for name in names:
    pipe = Pipeline(model, methods.make_method(name, learning_rate=1e-3, momentum=0.9), x[0], y[0])
    runners[name] = TimedRunner(pipe, x, y)
    runners[name].warm_up()
    rows.append({"method": name, "passes_per_tick": hlo.pipeline_passes(pipe, x, y)})
  seconds = best_times(runners, repeats)
  for row in rows:
    wall, cpu = seconds[row["method"]]
    row["samples_per_s"], row["samples_per_cpu_s"] = samples / wall, samples / cpu
  relative_to(rows, lambda r: methods.traits_of(r["method"]).plain_pipeline,
              methods.PLAIN_PIPELINE)
  return rows


def lm_speeds(sequences: int, repeats: int, blocks=workloads.LM_BLOCKS,
              one_core: bool = True) -> list[dict]:
  """Per depth, tokens/s of the stacked pipeline (PB + Adam) on the transformer LM against the
  plain Adam loop, side by side, the seconds to trace and compile the pipeline's ``run``, and
  the arithmetic of both programs' ticks.

  ``blocks`` are the transformer's block counts (``blocks + 2`` stages); each gets the width
  configs/studies/lm_depth.py gives it (:data:`pipejax.profiling.workloads.LM_WIDTHS`). The
  ``cpu_ratio`` is measured with every core this process has; with ``one_core``, on a CPU
  backend, again on one core (:func:`~pipejax.profiling.timing.on_one_core` says why):
  ``one_core_ratio``. ``flops_ratio_plain_over_pipeline`` is the work ratio if both programs'
  kernels ran equally fast (the pipeline's backward recomputes each stage's forward).
  """
  one_core = one_core and jax.default_backend() == "cpu"
  rows = []
  for n in blocks:
    row = lm_row(n, sequences, repeats)
    if one_core:
      alone = timing.on_one_core(__name__, "lm_row", blocks=n, sequences=sequences,
                                 repeats=repeats, count_flops=False)
      row["one_core_pipeline_tokens_per_s"] = alone["pipeline_tokens_per_cpu_s"]
      row["one_core_plain_tokens_per_s"] = alone["plain_scan_tokens_per_cpu_s"]
      row["one_core_ratio_pipeline_over_plain"] = alone["cpu_ratio_pipeline_over_plain"]
    logging.info("lm: %s", row)
    rows.append(row)
  return rows


def lm_row(blocks: int, sequences: int, repeats: int, count_flops: bool = True,
           width: int | None = None) -> dict:
  """One depth of :func:`lm_speeds`, measured in this process with the cores it has; ``width``
  replaces the study's width for that depth."""
  context = workloads.LM_CONTEXT
  kwargs = workloads.lm_model_kwargs(blocks)
  if width is not None:
    kwargs["width"] = width
  model = models.build("transformer_lm", **kwargs)
  tokens = np.random.default_rng(0).integers(0, 256, (sequences, 1, context + 1))
  x = jax.device_put(tokens[..., :-1].astype(np.float32))
  y = jax.device_put(tokens[..., 1:].astype(np.int32))
  tx = optax.adam(3e-4)
  row, runner, params, compiled = versus_plain(model, tx, x, y, repeats,
                                               runner=Pipeline.restacked, compile_time=True)
  result = {"num_stages": runner.num_stages, "model": f"transformer_lm {kwargs}",
            "stacked_runs": [list(r) for r in runner.part_spans],
            "context": context, "micro_batch_size": 1, "sequences": sequences,
            "pipeline_compile_s": row["pipeline_compile_s"]}
  for name in ("pipeline", "plain_scan"):
    result[f"{name}_tokens_per_s"] = row[f"{name}_samples_per_s"] * context
    result[f"{name}_tokens_per_cpu_s"] = row[f"{name}_samples_per_cpu_s"] * context
  result["ratio_pipeline_over_plain"] = row["ratio_pipeline_over_plain_scan"]
  result["cpu_ratio_pipeline_over_plain"] = row["cpu_ratio_pipeline_over_plain_scan"]
  if count_flops:  # a compiled scan's cost is its body's: one tick, one step
    plain = workloads.plain_scan(model, tx).lower((params, tx.init(params)), (x, y)).compile()
    result["pipeline_flops_per_tick"] = hlo.cost(compiled)["flops"]
    result["plain_flops_per_tick"] = hlo.cost(plain)["flops"]
    result["flops_ratio_plain_over_pipeline"] = (result["plain_flops_per_tick"]
                                                 / result["pipeline_flops_per_tick"])
  return result


def tick_time_fit(rows: list[dict], target: float = 0.85) -> dict:
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
  pb = next((p for r, p in zip(rows, passes) if methods.traits_of(r["method"]).plain_pipeline),
            None)
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


def normalization_speeds(samples: int, conv_samples: int, repeats: int,
                         cases=NORMALIZED_MODELS) -> list[dict]:
  """Samples/s of Pipeline.run (PB + SC + LWP, b = 1) per model and normalizer, after the fill,
  each relative to the same model without normalization."""
  rows, runners = [], {}
  for label, (builder, kwargs, shape, normalizations) in cases.items():
    ticks = conv_samples if builder == "cifar_resnet20" else samples
    x, y = stream(ticks, 1, shape, classes=10)
    for normalization in normalizations:
      model = models.build(builder, layers_per_stage=1, normalization=normalization,
                           num_classes=10, **kwargs)
      method = methods.make_method(methods.RECOMMENDED, learning_rate=1e-3, momentum=0.9)
      pipe = Pipeline(model, method, x[0], y[0])
      runners[label, normalization] = TimedRunner(pipe, x, y)
      runners[label, normalization].warm_up()
      rows.append({"model": label, "normalization": normalization, "samples": ticks})
  seconds = best_times(runners, repeats)
  for row in rows:
    wall, cpu = seconds[row["model"], row["normalization"]]
    row["samples_per_s"], row["samples_per_cpu_s"] = row["samples"] / wall, row["samples"] / cpu
  relative_to(rows, lambda r: r["normalization"] is None, "none")
  return rows


def compile_time(num_stages: int) -> dict:
  """Seconds to build and init an S-stage MLP pipeline, and to trace and compile its ``run``."""
  model = workloads.mlp_model(num_layers=num_stages)
  x, y = stream(4, 1)
  start = time.perf_counter()
  pipe = Pipeline(model, methods.pb(optax.sgd(0.01, momentum=0.9)), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0))
  build_s = time.perf_counter() - start
  start = time.perf_counter()
  pipe.lower(state, x, y, every_slot_full=False).compile()
  return {"num_stages": num_stages, "build_and_init_s": build_s,
          "trace_and_compile_s": time.perf_counter() - start}


def weight_passes_per_tick(method: methods.Method) -> int:
  """The weight-sized passes a stage's tick must make under ``method`` at b = 1, from its
  definition (docs/performance.md §1 and §7), with every product fused into as few passes as it
  can be.

  Every method reads w in the forward and again in the recompute (whose input gradient comes
  with it), and reads and writes w and the momentum in the update: 6. A forward on other weights
  than w (weight prediction) writes them at the update: +1. A weight stash writes the forward's
  weights into its slot: +1 (the recompute reads the slot instead of w). A gradient moved to
  the current weights (DC-ASGD) reads the stashed weights once more: +1. A backward on other
  weights than w or the stash (PipeMare's w - D delta) reads delta in the recompute and reads and
  writes it in the update: +3.
  """
  passes = 6
  if method.forward_weights is not methods.current_weights:
    passes += 1
  if method.stash_forward_weights:
    passes += 1
  if method.pass_gradient_weights:
    passes += 1
  if method.backward_weights is not methods.current_weights and not method.stash_forward_weights:
    passes += 3
  return passes


def depth_method_records(num_stages: int, names, ticks: int, repeats: int) -> list[dict]:
  """Each method preset of ``names`` on configs/deep_mlp.py's residual MLP at one depth, stacked
  (``Pipeline.restacked``), timed side by side with ``pb`` after the fill.

  Per record: the method's samples per CPU second over ``pb``'s (``cpu_relative_to_pb``) and
  per wall second (``relative_to_pb``), the passes its definition needs
  (:func:`weight_passes_per_tick`) and ``pb``'s over them (``pass_ratio``), and what its compiled
  tick makes: weight-sized passes and copies (:func:`pipejax.profiling.hlo.passes`), operations.
  """
  names = list(dict.fromkeys([methods.PLAIN_PIPELINE, *names]))
  model = workloads.depth_model(num_stages)
  x, y = stream(ticks, 1, shape=RESNET_INPUT, classes=10)
  runners, rows = {}, []
  for name in names:
    method = methods.make_method(name, learning_rate=1e-3, momentum=0.9)
    start = time.perf_counter()
    pipe = Pipeline(model, method, x[0], y[0])
    stacked = pipe.restacked()
    runners[name] = TimedRunner(stacked, x, y)
    jax.block_until_ready(runners[name].state)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = stacked.lower(runners[name].state, x, y).compile()
    compile_s = time.perf_counter() - start
    runners[name].warm_up()
    rows.append({"num_stages": num_stages, "method": name, "stacked": True,
                 "weight_passes_per_tick": weight_passes_per_tick(method),
                 "compiled_passes_per_tick": hlo.passes(compiled, hlo.weight_bytes(pipe)),
                 "build_and_init_s": build_s, "trace_and_compile_s": compile_s,
                 **delay_line_bytes(stacked, pipe)})
    logging.info("depth methods: %s built", rows[-1])
  seconds = best_times(runners, repeats)
  for row in rows:
    wall, cpu = seconds[row["method"]]
    row["samples_per_s"], row["samples_per_cpu_s"] = ticks / wall, ticks / cpu
  relative_to(rows, lambda r: methods.traits_of(r["method"]).plain_pipeline,
              methods.PLAIN_PIPELINE)
  pb_passes = weight_passes_per_tick(
      methods.make_method(methods.PLAIN_PIPELINE, learning_rate=1e-3))
  for row in rows:
    row["pass_ratio"] = pb_passes / row["weight_passes_per_tick"]
    row["meets_pass_ratio"] = row["cpu_relative_to_pb"] >= 0.9 * row["pass_ratio"]
    logging.info("depth methods: %s", row)
  return rows


def delay_line_bytes(runner, pipe) -> dict:
  """The bytes ``runner``'s delay lines hold (read off its state's shapes, nothing allocated)
  beside their formulas: sum_s (D_s + 1)|x_s| for the stashed inputs, and for a method that
  stashes the forward's weights sum_s (D_s + 1)|w_s| for the weight copies (0 otherwise)."""
  state = jax.eval_shape(lambda: runner.init(jax.random.PRNGKey(0)))
  parts = state.parts if hasattr(state, "parts") else state.stages
  return {"delay_line_bytes": accounting.held_stash_bytes(parts),
          "delay_line_formula_bytes": pipe.spec.stash_bytes(),
          "weight_stash_bytes": accounting.held_weight_stash_bytes(parts),
          "weight_stash_formula_bytes": (accounting.weight_stash_bytes(pipe.spec.stage_param_shapes)
                                         if pipe.spec.stashes_weights else 0)}


def delay_line_records(num_stages: int, names) -> list[dict]:
  """Each method preset of ``names`` stacked on configs/deep_mlp.py's residual MLP at one depth:
  its delay lines' bytes against their formulas (:func:`delay_line_bytes`), and the seconds to
  build the pipeline and its stacked layout (no state is allocated)."""
  model = workloads.depth_model(num_stages)
  x, y = stream(1, 1, shape=RESNET_INPUT, classes=10)
  rows = []
  for name in names:
    start = time.perf_counter()
    pipe = Pipeline(model, methods.make_method(name, learning_rate=1e-3, momentum=0.9), x[0],
                    y[0])
    stacked = pipe.restacked()
    build_s = time.perf_counter() - start
    rows.append({"num_stages": num_stages, "method": name, "stacked": True, "build_s": build_s,
                 **delay_line_bytes(stacked, pipe)})
    logging.info("delay lines: %s", rows[-1])
  return rows


def depth_records(num_stages: int, ticks: int, repeats: int, unstacked_max: int) -> list[dict]:
  """configs/deep_mlp.py's residual MLP at one depth: stacked, per stage (up to
  ``unstacked_max`` stages) and the plain loop, timed side by side.

  Per record: build and init seconds, trace and compile seconds of the full pipeline's ``run``,
  its operations per tick, samples/s after the fill, and the delay lines' bytes held against
  the formula sum_s (D_s + 1)|x_s|.
  """
  model = workloads.depth_model(num_stages)
  x, y = stream(ticks, 1, shape=RESNET_INPUT, classes=10)
  tx = optax.sgd(0.01, momentum=0.9)
  records, timed = {}, {}
  for stacked in (True, False):
    if not stacked and num_stages > unstacked_max:
      continue
    start = time.perf_counter()
    pipe = Pipeline(model, methods.pb(tx), x[0], y[0])
    runner = pipe.restacked() if stacked else pipe
    run = TimedRunner(runner, x, y)
    jax.block_until_ready(run.state)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = runner.lower(run.state, x, y).compile()
    records[stacked] = {
        "num_stages": num_stages, "stacked": stacked, "build_and_init_s": build_s,
        "trace_and_compile_s": time.perf_counter() - start,
        "operations_per_tick": hlo.operations_per_tick(compiled.as_text()),
        "delay_line_bytes": runner.held_stash_bytes(run.state) if stacked
                            else pipe.held_stash_bytes(run.state),
        "delay_line_formula_bytes": pipe.spec.stash_bytes()}
    if stacked:  # the plain loop starts from these weights (the stacked init: no per-stage init)
      params = [st.params for st in runner.to_logical(run.state).stages]
    run.warm_up()
    timed[stacked] = run
  plain = {"carry": (params, tx.init(params))}
  start = time.perf_counter()
  compiled = workloads.plain_scan(model, tx).lower(plain["carry"], (x, y)).compile()
  records[None] = {"num_stages": num_stages, "stacked": None, "build_and_init_s": None,
                   "trace_and_compile_s": time.perf_counter() - start,
                   "operations_per_tick": hlo.operations_per_tick(compiled.as_text()),
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
