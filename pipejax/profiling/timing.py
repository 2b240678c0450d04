"""Timing on a shared machine: interleaved best-of-N calls, and a runner kept warm for them."""

from __future__ import annotations

import time
from typing import Callable, Hashable, Mapping

from absl import logging
import jax

SHORTEST_TIMED_CALL_S = 0.05


def best_times(fns: Mapping[Hashable, Callable], repeats: int) -> dict:
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


class TimedRunner:
  """Calls ``runner.run`` on one stream, keeping the donated state; warms up what it will time.

  ``runner`` is any pipeline runner (``Pipeline``, ``StackedPipeline``, ``ShardedPipeline``).
  """

  def __init__(self, runner, x, y, rng=None):
    self.runner, self.x, self.y = runner, x, y
    self.state = runner.init(jax.random.PRNGKey(0) if rng is None else rng)

  def __call__(self):
    self.state, metrics = self.runner.run(self.state, self.x, self.y)
    return metrics["loss"]

  def warm_up(self) -> None:
    """Compiles every program the timed calls run, and runs each once.

    ``run`` runs one compiled program while the pipeline fills and another once every slot holds
    a real micro-batch; timed calls (after the fill) run the second. So this runs until the
    pipeline is full, then once more.
    """
    self()
    while not self.runner.every_slot_full(self.state):
      self()
    self()
