"""One process of the two-process test of tests/parallel/test_sharding.py (run as ``python -m``).

Connects through ``pipejax.parallel.distributed`` on localhost (two processes of two CPU devices
each), runs the same few ticks as the test's single-process reference on a mesh whose every exchange
crosses the processes, and writes the unpacked state and the metrics to ``--out`` (an ``.npz``). The
problem itself (:func:`make_problem`) is imported by the test, so both sides build exactly the
same pipeline and stream.
"""

import argparse

import numpy as np

IN_DIM, NUM_CLASSES, MICRO_BATCH = 6, 4, 4
WIDTHS = (5, 7, 3)
# One mesh in which every exchange crosses the processes: with process 0's devices a0, a1 and
# process 1's b0, b1 laid out as (data, stage) = [[a0, b0], [b1, a1]], both pipeline replicas send
# their packets and cotangents from one process to the other and both stages' gradient
# all-reduces pair a device of each process.
MESH_NAME = "data2_stage2_crossed"


def make_problem(method_name="pb_sc_lwp"):
  """(pipeline, inputs, labels) of a tiny uneven MLP; import jax only after initialize."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import pipejax  # pylint: disable=g-import-not-at-top
  from pipejax import methods  # pylint: disable=g-import-not-at-top
  from pipejax.core.engine import Pipeline  # pylint: disable=g-import-not-at-top

  stages = [pipejax.from_flax(nn.Sequential([nn.Dense(w), nn.tanh]), name=f"dense{w}")
            for w in WIDTHS]
  model = pipejax.Model(stages + [pipejax.from_flax(nn.Dense(NUM_CLASSES), name="head")])
  rng = np.random.default_rng(7)
  num_ticks = 3 * model.num_stages + 1
  x = rng.standard_normal((num_ticks, MICRO_BATCH, IN_DIM)).astype(np.float32)
  y = rng.integers(0, NUM_CLASSES, (num_ticks, MICRO_BATCH)).astype(np.int32)
  method = methods.make_method(method_name, learning_rate=0.05, momentum=0.9)
  return Pipeline(model, method, x[0], y[0]), x, y


def flatten_result(state, metrics) -> dict:
  """Named host arrays of a logical state and run metrics (for an .npz)."""
  import jax  # pylint: disable=g-import-not-at-top
  out = {f"state/{i}": np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(state))}
  out.update({f"metrics/{k}": np.asarray(v) for k, v in metrics.items()})
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--coordinator_address", required=True)
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()

  from pipejax.parallel import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize(args.coordinator_address, num_processes=2, process_id=args.process_id,
                         num_cpu_devices=2)
  import jax  # pylint: disable=g-import-not-at-top
  from pipejax.parallel import mesh as mesh_lib, sharding  # pylint: disable=g-import-not-at-top

  assert jax.process_count() == 2, jax.process_count()
  pipe, x, y = make_problem()
  assert mesh_lib.make_mesh(stage=4, data=1).devices.size == 4  # the global device count
  a, b = ([d for d in jax.devices() if d.process_index == p] for p in range(2))
  mesh = jax.sharding.Mesh(np.array([[a[0], b[0]], [b[1], a[1]]]), ("data", "stage"))
  sharded = sharding.ShardedPipeline(pipe, mesh)
  packed, metrics = sharded.run(sharded.init(jax.random.PRNGKey(3)), x, y)
  results = flatten_result(sharded.to_logical(packed), metrics)
  np.savez(args.out, **results)
  distributed.shutdown()


if __name__ == "__main__":
  main()
