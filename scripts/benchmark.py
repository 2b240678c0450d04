r"""Benchmarks of the pipeline engine, measured side by side in one run; prints one JSON object.

    python scripts/benchmark.py                      # everything (a few minutes on 2 CPU cores)
    python scripts/benchmark.py --only=throughput --micro_batch_sizes=1
    python scripts/benchmark.py --output=benchmark.json

* ``throughput``: ``Pipeline.run`` (Pipelined Backpropagation, one layer per stage) against a plain
  optax training loop in ``lax.scan`` on the same MLP (8 layers of width 256), samples per second at
  each micro-batch size, and their ratio. The pipeline's backward recomputes each stage's forward
  (4 units of arithmetic instead of backprop's 3), so 0.75 is the honest ceiling of the ratio.
* ``compile``: seconds to trace and compile ``run`` for S = 4, 16, 64 stages.
* ``sharding``: ticks/s of ``ShardedPipeline.run`` on stage meshes of 1, 2, 4, 8 devices against
  ``Pipeline.run`` (same MLP, b = 1). Needs the devices: on a CPU run it with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (fake devices share the cores, so this
  measures the machinery's overhead, not a speed-up).
* ``methods``: ``Pipeline.run`` of each method preset at micro-batch 1 on the default config's
  model (Fashion-MNIST MLP 784-256-128-10, three stages), and its speed relative to plain PB:
  what each method's weight views and update rule cost.
"""

import json
import platform
import time

from absl import app, flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax
from pipejax import methods, models
from pipejax.engine import Pipeline

_ONLY = flags.DEFINE_multi_enum("only", ["throughput", "compile", "methods"],
                                ["throughput", "compile", "methods", "sharding"],
                                "Which benchmarks to run ('sharding' only when asked).")
_METHODS = flags.DEFINE_list("methods", ["pb", "pb_sc", "pb_lwp", "pb_sc_lwp", "pipedream",
                                         "spectrain", "pipemare"], "Presets for 'methods'.")
_MICRO_BATCH_SIZES = flags.DEFINE_list("micro_batch_sizes", ["1", "32"], "Micro-batch sizes b.")
_SAMPLES = flags.DEFINE_integer("samples", 8192, "Samples per timed repetition.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions (the best is reported).")
_COMPILE_STAGES = flags.DEFINE_list("compile_stages", ["4", "16", "64"], "S for compile times.")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the JSON here.")

WIDTH, LAYERS = 256, 8


def mlp_model(num_layers=LAYERS, width=WIDTH):
  """num_layers Dense(width) stages with ReLU; the last layer's outputs are the logits."""
  stages = [pipejax.from_flax(nn.Sequential([nn.Dense(width), nn.relu]), name=f"dense{i}")
            for i in range(num_layers - 1)]
  return pipejax.Model(stages + [pipejax.from_flax(nn.Dense(width), name="logits")])


def stream(num_ticks, b):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((num_ticks, b, WIDTH), dtype=np.float32)
  y = rng.integers(0, WIDTH, (num_ticks, b), dtype=np.int32)
  return x, y


def best_time(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return min(times)


def throughput(b, samples, repeats):
  model = mlp_model()
  tx = optax.sgd(0.01, momentum=0.9)
  ticks = max(samples // b, 1)
  x, y = stream(ticks, b)

  pipe = Pipeline(model, methods.pb(tx), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0))
  holder = {"state": state}

  def run_pipeline():
    holder["state"], metrics = pipe.run(holder["state"], x, y)
    return metrics["loss"]

  params = [st.params for st in state.stages]

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

  plain_run = jax.jit(lambda carry, xs: jax.lax.scan(step, carry, xs), donate_argnums=0)
  plain = {"carry": (jax.tree.map(jnp.copy, params), tx.init(params))}

  def run_plain():
    plain["carry"], losses = plain_run(plain["carry"], (x, y))
    return losses

  run_pipeline(), run_plain()  # compile and warm up
  t_pipe, t_plain = best_time(run_pipeline, repeats), best_time(run_plain, repeats)
  return {
      "micro_batch_size": b,
      "ticks": ticks,
      "pipeline_samples_per_s": ticks * b / t_pipe,
      "plain_samples_per_s": ticks * b / t_plain,
      "ratio_pipeline_over_plain": t_plain / t_pipe,
  }


def method_speeds(names, samples, repeats):
  """Samples/s of Pipeline.run for each method preset at micro-batch 1, after the fill."""
  model = models.build("mlp", hidden=(256, 128), num_classes=10)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((samples, 1, 28, 28, 1), dtype=np.float32)
  y = rng.integers(0, 10, (samples, 1), dtype=np.int32)
  rows = []
  for name in names:
    pipe = Pipeline(model, methods.make_method(name, learning_rate=1e-3, momentum=0.9), x[0], y[0])
    holder = {"state": pipe.run(pipe.init(jax.random.PRNGKey(0)), x, y)[0]}  # compile, fill

    def run_once():
      holder["state"], metrics = pipe.run(holder["state"], x, y)
      return metrics["loss"]

    run_once()  # compiles the full-pipeline version
    rows.append({"method": name, "samples_per_s": samples / best_time(run_once, repeats)})
  reference = next((r["samples_per_s"] for r in rows if r["method"] == "pb"), None)
  for row in rows:
    row["relative_to_pb"] = row["samples_per_s"] / reference if reference else None
  return rows


def sharding_speeds(ticks, repeats):
  """Ticks/s of Pipeline.run and of ShardedPipeline.run on 1, 2, 4, 8-device stage meshes."""
  from pipejax import sharding  # only this benchmark needs meshes
  model = mlp_model()
  x, y = stream(ticks, 1)
  pipe = Pipeline(model, methods.pb(optax.sgd(0.01, momentum=0.9)), x[0], y[0])
  rows = []
  for devices in [None] + [n for n in (1, 2, 4, 8) if n <= jax.device_count()]:
    runner = pipe if devices is None else sharding.ShardedPipeline(
        pipe, sharding.make_mesh(devices, 1, jax.devices()[:devices]))
    holder = {"state": runner.init(jax.random.PRNGKey(0))}

    def run_once():
      holder["state"], metrics = runner.run(holder["state"], x, y)
      return metrics["loss"]

    run_once(), run_once()  # compile both versions (filling, then full)
    rows.append({"stage_devices": devices or "Pipeline.run",
                 "ticks_per_s": ticks / best_time(run_once, repeats)})
  return rows


def compile_time(num_stages):
  model = mlp_model(num_layers=num_stages)
  x, y = stream(4, 1)
  start = time.perf_counter()
  pipe = Pipeline(model, methods.pb(optax.sgd(0.01, momentum=0.9)), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0))
  build_s = time.perf_counter() - start
  batch = pipe.checked_batch(x, y, None, ticks=True)
  start = time.perf_counter()
  jax.jit(pipe._run, donate_argnums=0).lower(state, batch).compile()
  return {"num_stages": num_stages, "build_and_init_s": build_s,
          "trace_and_compile_s": time.perf_counter() - start}


def main(argv):
  del argv
  result = {
      "device": str(jax.devices()[0].device_kind),
      "backend": jax.default_backend(),
      "cpu_count": __import__("os").cpu_count(),
      "jax": jax.__version__,
      "python": platform.python_version(),
      "model": f"MLP, {LAYERS} layers of width {WIDTH}, one layer per stage, PB + momentum SGD",
  }
  if "throughput" in _ONLY.value:
    result["throughput"] = [throughput(int(b), _SAMPLES.value, _REPEATS.value)
                            for b in _MICRO_BATCH_SIZES.value]
  if "compile" in _ONLY.value:
    result["compile"] = [compile_time(int(s)) for s in _COMPILE_STAGES.value]
  if "sharding" in _ONLY.value:
    result["sharding"] = sharding_speeds(_SAMPLES.value // 8, _REPEATS.value)
  if "methods" in _ONLY.value:
    result["methods"] = method_speeds(_METHODS.value, _SAMPLES.value // 2, _REPEATS.value)
  text = json.dumps(result, indent=2)
  print(text)
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  app.run(main)
