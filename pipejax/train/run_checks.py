"""Checks of a run against its data and its machine, once the model is built.

:func:`check_pipeline_fills` refuses a run too short to train every stage; :func:`check_memory`
refuses a chunk, a state or an evaluation batch that cannot fit.
"""

from __future__ import annotations

import math

from absl import logging

from pipejax import cli
from pipejax.core import accounting
from pipejax.train.config_checks import ConfigError
from pipejax.train.plan import RunPlan

def check_pipeline_fills(plan: RunPlan, pipeline, run_ticks: int) -> None:
  """Refuses a run too short for every stage to apply an update that moves its weights.

  Asynchronously, stage 0 backwards its first micro-batch only once the pipeline is full, at
  tick 2(S-1); a synchronous step takes M micro-batches. A cosine schedule's first update has a
  rate of 0 (its warm-up starts there), so it needs a second one.
  """
  updates = 2 if plan.schedule.kind == "cosine" or plan.schedule.warmup_epochs > 0 else 1
  m = plan.micro_batches_per_flush
  per_update = pipeline.method.micro_batches_per_update
  stages = pipeline.num_stages
  needed = updates * m if m is not None else 2 * (stages - 1) + updates * per_update
  if run_ticks >= needed:
    return
  b = plan.micro_batch_size
  why = (f"a synchronous step takes config.method_kwargs.{plan.method}.micro_batches = {m} "
         "micro-batches" if m is not None else
         f"the first of its {stages} stages applies its first update only once the pipeline is "
         f"full, at micro-batch {2 * (stages - 1) + per_update}")
  raise ConfigError(
      f"This run is too short to train every stage: it trains {run_ticks} micro-batch"
      f"{'es' if run_ticks != 1 else ''} of {b} ({run_ticks * b} samples: config.epochs times "
      f"the training split), but {why}"
      f"{', and a warm-up starts at a rate of 0' if updates == 2 else ''}. "
      f"It needs at least {needed * b} training samples ({needed} micro-batches of {b}). Raise "
      "--config.epochs or --config.max_train_examples, or lower --config.micro_batch_size.")


# The share of the machine's memory a chunk's inputs and metrics may take (host and device copy).
CHUNK_MEMORY_SHARE = 0.25


def chunk_bytes(setup, ticks: int) -> int:
  """Bytes of one chunk of ``ticks`` ticks: its inputs and labels on the host and on the devices,
  and its per-tick metrics."""
  pipe = setup.pipeline
  b, m = pipe.micro_batch_size, pipe.method.micro_batches_per_flush
  scheduled = ticks if m is None else ticks // m * (m + accounting.bubble_ticks(pipe.num_stages, m))
  example = math.prod(setup.train_source.example_shape) * 4 + 4  # float32 inputs, int32 label
  metrics = 4 * (4 + 5 * pipe.num_stages)  # loss, accuracy; per stage valid, sample, finite, ...
  return scheduled * (2 * b * example + metrics)


def _memory_available() -> tuple[int, str]:
  """The memory a chunk and the state compete for: the first device's, or the host's on CPU;
  under a study that runs N trainers at once (``cli.TRAINERS_AT_ONCE``), an Nth of it, since
  each trainer checks only its own run."""
  total, where = accounting.memory_available()
  shared = cli.trainers_at_once()
  if shared == 1:
    return total, where
  return total // shared, (f"its share of {where} (1/{shared}: the study runs {shared} trainers "
                           "at once; a lower --parallel gives each more)")


def state_bytes(setup) -> int:
  """Bytes of the pipeline state on one device (the largest share on a mesh), from shapes alone:
  the logical state's leaves on one device, the packed buffers each device holds on a mesh."""
  if setup.sharded is not None:
    return setup.sharded.packing.allocated_bytes()
  return accounting.tree_bytes(setup.pipeline.state_spec)


_gib = accounting.gib


def check_memory(plan: RunPlan, setup, chunk_ticks: int) -> None:
  """Refuses, before anything is compiled, a chunk or a state that cannot fit in memory."""
  available, where = _memory_available()
  chunk = chunk_bytes(setup, chunk_ticks)
  if chunk > CHUNK_MEMORY_SHARE * available:
    per_tick = max(chunk // chunk_ticks, 1)
    fitting = max(1, int(CHUNK_MEMORY_SHARE * available) // per_tick)
    raise ConfigError(
        f"A chunk of {chunk_ticks} ticks (config.ticks_per_chunk={plan.ticks_per_chunk}, at "
        f"most the run's length) needs about {_gib(chunk)} for its inputs and metrics, more than "
        f"{CHUNK_MEMORY_SHARE:.0%} of {where} ({_gib(available)}). Lower "
        f"--config.ticks_per_chunk to {fitting} or less (it changes no result, only how often "
        "the run reports and can save).")
  state = state_bytes(setup)
  logging.info("Pipeline state: %s per device (weights, optimizer states, delay lines of %d "
               "stages); a chunk of %d ticks: %s.", _gib(state), setup.pipeline.num_stages,
               chunk_ticks, _gib(chunk))
  if state + chunk > available:
    raise ConfigError(
        f"The pipeline state of this config needs about {_gib(state)} per device (weights, "
        f"optimizer states and the delay lines of {setup.pipeline.num_stages} stages, which grow "
        f"with the square of the stage count), more than {where} ({_gib(available)}). Use fewer "
        "stages (--config.model_kwargs.layers_per_stage, or a smaller depth), narrower layers, "
        "or a mesh over more devices (--config.mesh.stage).")
  _check_evaluation_memory(plan, setup, state, available, where)


def eval_batch_size(plan: RunPlan, test_size: int) -> int:
  """The batch evaluation runs: ``config.eval_batch_size``, at most the test split (a larger
  batch would only be padding)."""
  return max(1, min(plan.output.eval_batch_size, test_size))


def eval_bytes(setup, batch: int) -> int:
  """Bytes of one evaluation batch, from shapes alone: every stage's input and the logits, at
  ``batch`` examples (a lower bound: the layers' intermediate values come on top)."""
  pipe = setup.pipeline
  per_micro_batch = accounting.tree_bytes(pipe.spec.stage_input_shapes) + \
      accounting.tree_bytes(pipe.spec.last_stage_output())
  labels = 4 * math.prod(setup.test_source.label_shape)
  return batch * (math.ceil(per_micro_batch / pipe.micro_batch_size) + labels)


def _check_evaluation_memory(plan: RunPlan, setup, state: int, available: int, where: str
                             ) -> None:
  batch = eval_batch_size(plan, len(setup.test_source))
  needed = eval_bytes(setup, batch)
  if state + needed <= available:
    return
  fitting = max(1, (available - state) * batch // max(needed, 1) // 2)
  raise ConfigError(
      f"Evaluation in batches of {batch} (config.eval_batch_size="
      f"{plan.output.eval_batch_size}, at "
      f"most the test split) needs about {_gib(needed)} for its activations alone; beside the "
      f"pipeline state ({_gib(state)}) that is more than {where} ({_gib(available)}). Lower "
      f"--config.eval_batch_size to {fitting} or less (it changes no result).")
