"""What the trainer adds to a tick, and what its set-up costs, measured side by side in one process.

``scripts/train.py`` feeds the runner chunk by chunk: it draws the chunk from the data stream on
the host, schedules it, runs it, fetches the metrics and checks the weights are finite. Timed
interleaved with the runner's ``run`` on a stream already on the device (what the ``depth``
benchmark times), the ratio of the two rates is what the trainer costs per tick; the machine's
load slows both alike.
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import logging
import jax
import numpy as np

from pipejax import config as configlib
from pipejax import data as data_lib
from pipejax.core import initial, stackable
from pipejax.train import divergence, experiment
from pipejax.train import plan as plan_lib
from pipejax.profiling.timing import best_times

DEEP_MLP = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "deep_mlp.py")


def deep_mlp_plan(num_stages: int, method: str | None = None, declared_stack: bool = False
                  ) -> plan_lib.RunPlan:
  """The plan of configs/deep_mlp.py at ``num_stages`` stages (its own method unless
  ``method``), its blocks one module repeated where ``declared_stack`` (a declared stack,
  :class:`pipejax.Model`)."""
  config = configlib.load_config(os.path.abspath(DEEP_MLP))
  config.model_kwargs.depth = num_stages
  if declared_stack:
    config.model_kwargs.declared_stack = True
  if method:
    config.method = method
  return plan_lib.resolve(config)


def trainer_rate(plan: plan_lib.RunPlan, ticks: int, repeats: int) -> dict:
  """Samples/s of the trainer's chunk (host stream, schedule, run, metrics, finite check) over
  those of the runner's ``run`` on a device stream, side by side; and the set-up's seconds.

  ``setup_s`` is ``experiment.build``, the runner's init and its logical state (which the trainer
  reads for the initial weights' digest): the part of the trainer's set-up that depends on the
  depth (data loading aside, which is the same at every depth).

  The build's parts that trace every stage are timed again on the built pipeline:
  ``model_trace_s``, each stage's initialization and forward (``Model.trace``);
  ``init_trace_s``, each stage's state initialization with its delay as an input
  (``StateInit.stage_program`` of a fresh ``StateInit``: the state's shapes, and the stacked
  init's program);
  ``update_trace_s``, the method's update of each stage between the first and the last
  (``stackable.update_program``); and ``find_stacks_s``, those update traces with the programs
  compared.
  """
  start = time.perf_counter()
  setup = experiment.build(plan)
  build_s = time.perf_counter() - start
  pipe = setup.pipeline
  start = time.perf_counter()
  # A copy of the model: the model keeps its traces, and the build has traced this one.
  dataclasses.replace(pipe.model).trace(jax.random.PRNGKey(0), pipe.example_inputs)
  model_trace_s = time.perf_counter() - start
  fresh = initial.StateInit(pipe.spec)  # nothing traced yet: the timing traces every stage
  start = time.perf_counter()
  for s in range(pipe.num_stages):
    fresh.stage_program(s)
  init_trace_s = time.perf_counter() - start
  spec = pipe.state_spec
  start = time.perf_counter()
  for s in range(1, pipe.num_stages - 1):
    stackable.update_program(pipe.initial, s, spec)
  update_trace_s = time.perf_counter() - start
  start = time.perf_counter()
  stackable.find_parts(pipe.initial)
  find_stacks_s = time.perf_counter() - start
  runner, b = setup.runner, plan.micro_batch_size
  start = time.perf_counter()
  holder = {"state": jax.block_until_ready(setup.init(jax.random.PRNGKey(plan.seed)))}
  runner.host_params(holder["state"])  # the initial weights' digest reads them
  init_s = time.perf_counter() - start
  stream = data_lib.DataStream(setup.train_source, b, plan.seed)
  x_device, y_device = (jax.device_put(a) for a in stream.next_chunk(ticks))

  def benchmark_chunk():
    holder["state"], metrics = runner.run(holder["state"], x_device, y_device)
    return metrics["loss"]

  def trainer_chunk():
    x, y = stream.next_chunk(ticks)
    x, y, valid = runner.to_ticks(x, y)
    first_tick = int(holder["state"].tick)
    holder["state"], metrics = runner.run(holder["state"], x, y, valid)
    metrics = jax.device_get(metrics)
    try:
      divergence.raise_if_diverged(plan, setup.model, runner.weights_finite(holder["state"]),
                                   metrics["finite"], valid, first_tick, 0, None)
    except divergence.TrainingDiverged:
      # The check costs the same either way; the row says its numbers are a diverged run's.
      holder["diverged"] = True
    seen = np.asarray(metrics["valid"])
    return float(np.mean(metrics["loss"][seen])) if seen.any() else 0.0

  while not runner.every_slot_full(holder["state"]):
    benchmark_chunk()
  for fn in (benchmark_chunk, trainer_chunk):
    fn()  # both programs compiled and run once on a full pipeline
  seconds = best_times({"benchmark": benchmark_chunk, "trainer": trainer_chunk}, repeats)
  row = {"num_stages": setup.pipeline.num_stages, "method": plan.method, "ticks": ticks,
         "build_s": build_s, "init_s": init_s, "setup_s": build_s + init_s,
         "model_trace_s": model_trace_s, "init_trace_s": init_trace_s,
         "update_trace_s": update_trace_s, "find_stacks_s": find_stacks_s,
         "diverged": holder.get("diverged", False)}
  for name, (wall, cpu) in seconds.items():
    row[f"{name}_samples_per_s"] = ticks * b / wall
    row[f"{name}_samples_per_cpu_s"] = ticks * b / cpu
  row["trainer_over_benchmark"] = row["trainer_samples_per_s"] / row["benchmark_samples_per_s"]
  row["cpu_trainer_over_benchmark"] = (row["trainer_samples_per_cpu_s"]
                                       / row["benchmark_samples_per_cpu_s"])
  logging.info("trainer: %s", row)
  return row
