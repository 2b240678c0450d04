"""Timing on a shared machine: interleaved best-of-N calls, a runner kept warm for them, and a
measurement run in a process of its own on one core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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

  ``runner`` is any pipeline runner (``Pipeline``, stacked or not, or ``ShardedPipeline``).
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


_RESULT_MARK = "ONE_CORE_RESULT "


def on_one_core(module: str, function: str, timeout_s: float = 3600, **kwargs):
  """``module.function(**kwargs)`` in a fresh Python process held to one core; its JSON result.

  On a CPU the CPU seconds of a process with several cores are not its work alone: XLA's runtime
  runs independent operations on a pool of worker threads, one a core, and the time its threads
  spend handing work over and waiting for it counts too, in a share that depends on how much of
  the program can run side by side and on the machine. Held to one core (the pool is sized when
  the backend starts, hence the new process) the CPU seconds are the program's work. ``kwargs``
  and the result travel as JSON.
  """
  if not hasattr(os, "sched_setaffinity"):
    raise RuntimeError(f"Running {module}.{function} on one core needs a system that can hold a "
                       f"process to a core (Linux's sched_setaffinity); this one cannot. Measure "
                       f"without it (scripts/benchmark.py: --lm_one_core=false), or hold the whole "
                       f"process to one core yourself.")
  core = min(os.sched_getaffinity(0))
  code = (f"import json, sys, importlib\n"
          f"result = getattr(importlib.import_module({module!r}), {function!r})("
          f"**json.loads(sys.argv[1]))\n"
          f"print({_RESULT_MARK!r} + json.dumps(result))\n")
  done = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True,
                        text=True, timeout=timeout_s, check=False,
                        preexec_fn=lambda: os.sched_setaffinity(0, {core}))
  lines = [l for l in done.stdout.splitlines() if l.startswith(_RESULT_MARK)]
  if done.returncode or not lines:
    raise RuntimeError(f"{module}.{function} on one core (a child process) failed with exit code "
                       f"{done.returncode}; the end of its output:\n{done.stderr[-3000:]}")
  return json.loads(lines[-1][len(_RESULT_MARK):])
