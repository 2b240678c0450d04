"""``ShardedPipeline`` on stage meshes against ``Pipeline.run``, and the fake-device control.

On a CPU the devices are fake (``XLA_FLAGS=--xla_force_host_platform_device_count=8``) and share
the cores: the stage meshes then measure the machinery's overhead, not a speed-up, and
:func:`fake_device_speedup` shows whether two fake devices run in parallel at all.
"""

from __future__ import annotations

import time

import jax
from jax.sharding import Mesh, PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import optax

from pipejax import methods
from pipejax.core.engine import Pipeline
from pipejax.parallel.mesh import make_mesh
from pipejax.profiling import hlo
from pipejax.profiling.timing import TimedRunner, best_times
from pipejax.profiling.workloads import RESNET_INPUT, depth_model, mlp_model, stream


def _sharded(runner, devices, partition=None):
  from pipejax.parallel import sharding  # pylint: disable=import-outside-toplevel
  return sharding.ShardedPipeline(runner, make_mesh(devices, 1, jax.devices()[:devices]),
                                  partition=partition)


def sharding_speeds(ticks: int, repeats: int) -> list[dict]:
  """Ticks/s of Pipeline.run and of ShardedPipeline.run on 1, 2, 4, 8-device stage meshes
  (the 8x256 MLP, b = 1), and each one's passes per tick."""
  x, y = stream(ticks, 1)
  pipe = Pipeline(mlp_model(), methods.pb(optax.sgd(0.01, momentum=0.9)), x[0], y[0])
  runners = {"Pipeline.run": TimedRunner(pipe, x, y)}
  for devices in (n for n in (1, 2, 4, 8) if n <= jax.device_count()):
    runners[devices] = TimedRunner(_sharded(pipe, devices), x, y)
  for runner in runners.values():
    runner.warm_up()
  rows = [{"stage_devices": name, "ticks_per_s": ticks / wall, "ticks_per_cpu_s": ticks / cpu}
          for name, (wall, cpu) in best_times(runners, repeats).items()]
  for row in rows:
    row["relative_to_pipeline_run"] = row["ticks_per_s"] / rows[0]["ticks_per_s"]
    row["cpu_relative_to_pipeline_run"] = row["ticks_per_cpu_s"] / rows[0]["ticks_per_cpu_s"]
    runner = runners[row["stage_devices"]].runner
    row["passes_per_tick"] = (hlo.pipeline_passes(pipe, x, y)["full"] if runner is pipe
                              else hlo.sharded_passes(runner, x, y))
  return rows


def sharded_method_passes(names, device_counts=(1, 2, 8)) -> list[dict]:
  """Passes per tick of each method's mesh program (the 8x256 MLP, b = 1), over all weights.

  A delay line that a tick rewrote whole, PipeDream's weight stash above all, shows here as
  passes the 1-device program does not make.
  """
  x, y = stream(4, 1)
  rows = []
  for name in names:
    pipe = Pipeline(mlp_model(), methods.make_method(name, learning_rate=1e-3, momentum=0.9),
                    x[0], y[0])
    row = {"method": name, "pipeline_run": hlo.pipeline_passes(pipe, x, y)["full"]}
    for devices in (n for n in device_counts if n <= jax.device_count()):
      row[f"{devices}_devices"] = hlo.sharded_passes(_sharded(pipe, devices), x, y)
    rows.append(row)
  return rows


def fake_device_speedup(steps: int, repeats: int, width=512, layers=8, b=4) -> list[dict]:
  """A chain of ``layers`` products per step in a ``shard_map`` scan: 1 device against 2.

  The control for :func:`two_halves_speedup`: it shows whether this machine's fake devices run
  their programs in parallel at all. Each step's products depend on one another, so one device
  has no independent work to overlap; two devices take half the chain each. Variants add the two
  ``ppermute``s a pipeline tick makes, and a ``lax.switch`` on the device's index around the
  products, as the mesh's tick has.
  """
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


def two_halves_speedup(b: int, ticks: int, repeats: int, width=512, layers=8) -> dict:
  """ShardedPipeline of two balanced halves (layers/2 layers each) on 2 devices against 1 device.

  One dense layer per stage; the partition puts the first half on device 0 and the second on
  device 1, so with two devices each one's products run on its own core.
  """
  x, y = stream(ticks, b, (width,), classes=width)
  pipe = Pipeline(mlp_model(layers, width), methods.pb(optax.sgd(0.01, momentum=0.9)), x[0], y[0])
  half = layers // 2
  runners = {"Pipeline.run": TimedRunner(pipe, x, y)}
  for devices, partition in ((1, None), (2, [(0, half), (half, layers)])):
    runners[devices] = TimedRunner(_sharded(pipe, devices, partition), x, y)
  for runner in runners.values():
    runner.warm_up()
  seconds = best_times(runners, repeats)
  row = {"micro_batch_size": b, "ticks": ticks, "width": width, "layers": layers}
  for name, (wall, cpu) in seconds.items():
    row[f"{name}_ticks_per_s"] = ticks / wall
    row[f"{name}_ticks_per_cpu_s"] = ticks / cpu
  # Over all weights; a device of the two holds half of them, so it makes twice as many passes
  # over its own.
  row["passes_per_tick"] = {devices: hlo.sharded_passes(runners[devices].runner, x, y)
                            for devices in (1, 2)}
  row["speedup_2_over_1_device"] = row["2_ticks_per_s"] / row["1_ticks_per_s"]
  row["one_device_mesh_over_pipeline_run"] = row["1_ticks_per_s"] / row["Pipeline.run_ticks_per_s"]
  return row


def stacked_mesh_records(num_stages: int, devices: int, ticks: int, repeats: int) -> list[dict]:
  """The depth MLP on a stage mesh, ``ShardedPipeline`` of the stacked ``Pipeline`` (each device's
  piece of the stack stacked) against that of the ``Pipeline``: build and compile seconds, the
  kernels of one loop iteration (two ticks), samples/s after the fill."""
  x, y = stream(ticks, 1, shape=RESNET_INPUT, classes=10)
  pipe = Pipeline(depth_model(num_stages), methods.pb(optax.sgd(0.01, momentum=0.9)), x[0], y[0])
  records, timed = {}, {}
  for stacked in (True, False):
    start = time.perf_counter()
    sharded = _sharded(pipe.restacked() if stacked else pipe, devices)
    run = TimedRunner(sharded, x, y)
    compiled = sharded.programs[1].lower(run.state, sharded.placed_batch(x, y)).compile()
    records[stacked] = {"num_stages": num_stages, "stage_devices": devices, "stacked": stacked,
                        "partition": sharded.partition,
                        "build_and_compile_s": time.perf_counter() - start,
                        "operations_per_iteration": hlo.operations_per_tick(compiled.as_text())}
    run.warm_up()
    timed[stacked] = run
  for stacked, (wall, cpu) in best_times(timed, repeats).items():
    records[stacked].update(samples_per_s=ticks / wall, samples_per_cpu_s=ticks / cpu)
  return list(records.values())
