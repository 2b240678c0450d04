r"""Speed of each normalizer per tick: samples/s of the default config's pipeline at micro-batch 1.

    python scripts/normalization_speed.py            # the table of docs/normalization.md
    python scripts/normalization_speed.py --ticks=500 --rounds=1   # quick

For configs/default.py's MLP (784-256-128-10) and the deeper one of the normalization study
(seven hidden layers of 128), each normalization: ``Pipeline.run`` over ``--ticks`` ticks of a
full pipeline (the steady state of training, no data loading, no evaluation). Every case is
compiled and filled first; then ``--rounds`` rounds time each case once, in turn, so that a busy
machine slows every case alike; the best round of each case is reported.
"""

import importlib.util
import os
import time

from absl import app, flags
import jax
import numpy as np

from pipejax import training

_TICKS = flags.DEFINE_integer("ticks", 4000, "Ticks per timed run.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed runs per case (the best is reported).")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"default MLP (256, 128)": (256, 128), "deep MLP (128 x 7)": (128,) * 7}
NORMALIZATIONS = (None, "layer", "online")


def filled_pipeline(hidden, normalization, ticks: int):
  """(pipeline, full state, inputs, labels), the full-pipeline program compiled for ``ticks``."""
  spec = importlib.util.spec_from_file_location("default", os.path.join(ROOT, "configs",
                                                                        "default.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.model_kwargs = {"hidden": hidden, "layers_per_stage": 1, "normalization": normalization}
  pipe = training.build(config).pipeline
  rng = np.random.default_rng(0)
  x = rng.random((ticks,) + pipe.example_inputs.shape, np.float32)
  y = rng.integers(0, 10, (ticks, 1)).astype(np.int32)
  state, _ = pipe.run(pipe.init(jax.random.PRNGKey(0)), x, y)  # the fill (and its program)
  state, metrics = pipe.run(state, x, y)  # compiles the full-pipeline program for this length
  jax.block_until_ready(metrics)
  return pipe, state, x, y


def main(argv):
  del argv
  cases = {(label, norm): filled_pipeline(hidden, norm, _TICKS.value)
           for label, hidden in MODELS.items() for norm in NORMALIZATIONS}
  best = dict.fromkeys(cases, float("inf"))
  for _ in range(_ROUNDS.value):
    for case, (pipe, state, x, y) in cases.items():
      start = time.perf_counter()
      state, metrics = pipe.run(state, x, y)
      jax.block_until_ready(metrics)
      best[case] = min(best[case], time.perf_counter() - start)
      cases[case] = (pipe, state, x, y)
  print(f"{'model':<24} {'normalization':<14} samples/s  relative to none")
  for label, norm in cases:
    rate, base = _TICKS.value / best[label, norm], _TICKS.value / best[label, None]
    print(f"{label:<24} {str(norm):<14} {rate:9.0f}  {rate / base:6.2f}")


if __name__ == "__main__":
  app.run(main)
