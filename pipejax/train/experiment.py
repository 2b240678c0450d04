"""What a run's plan builds: the data, the model, the method and the runner.

:func:`build` is the step between a :class:`~pipejax.train.plan.RunPlan` and the training loop
(``pipejax.train.trainer``): it loads the data splits, builds the model and the method at the
recipe the plan resolved (docs/design.md §4), its schedule in steps of the data's size, and
picks the runner: the local :class:`~pipejax.core.engine.Pipeline` (its identical stages stacked
unless the plan's ``stack_stages`` is off) or a mesh
(:class:`~pipejax.parallel.sharding.ShardedPipeline`). Shapes stay abstract: nothing is initialised
or compiled here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import logging
import jax
import numpy as np
import optax

from pipejax.core import accounting
from pipejax import data as data_lib
from pipejax import methods as methods_lib
from pipejax.methods import safe_ranges
from pipejax import models as models_lib
from pipejax import optim
from pipejax.train.config_checks import ConfigError
from pipejax.train.plan import RunPlan
from pipejax.core.engine import Pipeline
from pipejax.models import sequential
from pipejax.core.runner import Runner


def optimizer_steps(plan: RunPlan, train_size: int) -> tuple[int, int]:
  """``(steps, warmup_steps)``: each stage's optimizer steps over the run, and of warm-up.

  Schedules are kept in samples and converted to steps by one rule, at the recipe's batch.
  """
  batch = plan.recipe.batch_size
  steps = max(1, optim.steps_for_samples(plan.schedule.samples(train_size), batch))
  warmup = optim.steps_for_samples(plan.schedule.warmup_samples(train_size), batch)
  return steps, warmup


def learning_rate_schedule(plan: RunPlan, train_size: int):
  """The base rate by optimizer step: constant or cosine, after a linear warm-up from 0."""
  recipe, kind = plan.recipe, plan.schedule.kind
  if kind == "constant":
    _, warmup_steps = optimizer_steps(plan, train_size)
    if warmup_steps == 0:  # optax's warm-up over no steps would stay at its start, 0
      return optax.constant_schedule(recipe.learning_rate)
    return optax.schedules.warmup_constant_schedule(0.0, recipe.learning_rate, warmup_steps)
  if kind == "cosine":
    steps, warmup_steps = optimizer_steps(plan, train_size)
    warmup = max(warmup_steps, 1)  # optax needs at least one step of warm-up and of decay
    return optax.warmup_cosine_decay_schedule(0.0, recipe.learning_rate, warmup,
                                              max(steps, warmup + 1))
  raise ConfigError(f"config.schedule must be 'constant' or 'cosine'; got {kind!r}.")


@dataclasses.dataclass
class Setup:
  """What a plan builds: the data splits, the model, its recipe and the runner."""

  train_source: Any
  test_source: Any
  model: Any
  recipe: optim.Recipe  # the reference recipe at the batch each update sees
  runner: Runner  # what training calls: the local Pipeline, or a ShardedPipeline over a mesh
  # The pipeline whose initial weights this run starts from, merged into its own stages, when
  # the two split the network differently: the one-stage SGD baseline starts where the pipelined
  # runs of the same seed start, so a paired comparison pairs the weights as well as the data.
  initial_weights_from: Pipeline | None = None

  @property
  def pipeline(self) -> Pipeline:
    """The run's pipeline stage by stage on one device: the logical layout checkpoints hold."""
    local = self.runner if isinstance(self.runner, Pipeline) else self.runner.pipeline
    return local.restacked(False)

  @property
  def sharded(self) -> Runner | None:
    """The runner when it spans a device mesh, else None."""
    return None if isinstance(self.runner, Pipeline) else self.runner

  def init(self, rng):
    """The runner's initial state: the pipeline's, with the weights of ``initial_weights_from``
    where that is set. Every runner's init makes the pipeline's own init's bits."""
    if self.initial_weights_from is None:
      return self.runner.init(rng)
    source = self.initial_weights_from.to_logical(self.initial_weights_from.init(rng))
    weights = sequential.split_layer_params(
        self.model, sequential.merge_stage_params([st.params for st in source.stages]),
        self.pipeline.example_inputs)
    logical = self.pipeline.init(rng)
    logical = logical._replace(stages=tuple(
        st._replace(params=w, opt_state=self.pipeline.method.optimizer(delay).init(w))
        for st, w, delay in zip(logical.stages, weights, self.pipeline.delays)))
    return self.runner.from_logical(logical)


def build(plan: RunPlan) -> Setup:
  """Data, model, method and pipeline of ``plan`` (no training; cheap: shapes are abstract)."""
  train_source, test_source = _load_data(plan)
  b = plan.micro_batch_size
  split_model = None
  if plan.model.split_kwargs is not None:
    # The one-stage baseline starts from the weights of the split the config names.
    split_model = models_lib.build(plan.model.name, num_classes=train_source.num_classes,
                                   **dict(plan.model.split_kwargs))
  model = models_lib.build(plan.model.name, num_classes=train_source.num_classes,
                           **dict(plan.model.kwargs))
  layer_delays = _layer_delays(plan, split_model, (b,) + tuple(train_source.example_shape))
  method = make_method(plan, len(train_source), layer_delays)
  example_x = np.zeros((b,) + tuple(train_source.example_shape), np.float32)
  example_y = np.zeros((b,) + train_source.label_shape, np.int32)
  stack = plan.mesh.stack_stages
  pipe = Pipeline(model, method, example_x, example_y, track_weight_discrepancy=plan.diagnostics,
                  stack=stack)
  if stack:
    logging.info("Parts as (start, stop) stages, those of two or more stacked: %s.",
                 pipe.part_spans)
  initial_weights_from = None
  if split_model is not None and split_model.num_stages > 1:
    # Stacked, its state initialises in a program per stack, not one per stage.
    initial_weights_from = Pipeline(split_model, method, example_x, example_y, stack=stack)
  runner: Runner = _sharded(plan, pipe) if plan.mesh.devices > 1 else pipe
  return Setup(train_source, test_source, model, plan.recipe, runner,
               initial_weights_from=initial_weights_from)


def _load_data(plan: RunPlan):
  """The training and test splits, each cut to its maximum, neither empty."""
  data = plan.data
  train_source, test_source = data_lib.load(data.dataset, data_dir=data.data_dir,
                                            download=data.download, **dict(data.loader_kwargs))
  if data.max_train_examples:
    train_source = data_lib.Subset(train_source, data.max_train_examples)
  if data.max_test_examples:
    test_source = data_lib.Subset(test_source, data.max_test_examples)
  for split, source in (("training", train_source), ("test", test_source)):
    if len(source) == 0:
      raise ConfigError(
          f"The {split} split of data set {data.dataset!r} is empty"
          f"{f' in {data.data_dir}' if data.data_dir else ''}: there is nothing to "
          f"{'train on' if split == 'training' else 'evaluate'}. Check the data files (or "
          "--config.data_dir).")
  return train_source, test_source


def _sharded(plan: RunPlan, pipe: Pipeline):
  """``pipe`` (stacked or not) over the plan's mesh."""
  # Single-device runs never touch meshes.
  from pipejax.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from pipejax.parallel import partition as partition_lib  # pylint: disable=g-import-not-at-top
  from pipejax.parallel import sharding  # pylint: disable=g-import-not-at-top
  layout = plan.mesh
  mesh = mesh_lib.make_mesh(layout.stage, layout.data)
  costs = (partition_lib.measure_stage_costs(pipe) if layout.balance == "measured"
           else partition_lib.param_counts(pipe))
  # Each device stacks its share of each stacked part (pipejax.parallel.stacking.advance_shard).
  sharded = sharding.ShardedPipeline(pipe, mesh, partition=layout.partition or None,
                                     costs=costs)
  logging.info("Mesh data=%d x stage=%d; stages per device: %s (imbalance %.2f by %s); "
               "%d bytes cross devices per tick; bytes allocated per device: %s.",
               layout.data, layout.stage, sharded.partition,
               partition_lib.imbalance(costs, sharded.partition), layout.balance,
               sharded.packing.boundary_bytes_per_tick()["total"],
               [device["allocated"] for device in sharded.packing.device_memory()])
  return sharded


def make_method(plan: RunPlan, train_size: int, layer_delays: dict[str, int] | None = None
                ) -> methods_lib.Method:
  """The plan's method, its hyperparameters completed with what needs the data: the learning
  rate's schedule, the annealing length and the layers' delays."""
  late = {"learning_rate": learning_rate_schedule(plan, train_size),
          "anneal_steps": annealing_steps(plan, train_size), "layer_delays": layer_delays}
  fields = plan.preset.fields()
  hyperparameters = {f: getattr(plan.hyperparameters, f) for f in fields}
  hyperparameters.update({k: v for k, v in late.items() if k in fields})
  return methods_lib.make_method(plan.method, **hyperparameters)


def resolved_optimizer(plan: RunPlan) -> dict:
  """The base update a run applies, after the scaling rules and overrides: its peak learning
  rate, Adam's b1 and b2 (None under SGD, whose momentum is ``momentum``), the momentum and the
  weight decay. What ``summary.json`` and the HParams record."""
  adam, recipe = plan.optimizer == "adam", plan.recipe
  return {"learning_rate": recipe.learning_rate, "momentum": recipe.momentum,
          "b1": recipe.momentum if adam else None, "b2": recipe.b2 if adam else None,
          "weight_decay": recipe.weight_decay}


def delay_memory(plan: RunPlan, delays) -> float | None:
  """``(D_max / M) (1 − β)`` of a run whose stages have ``delays``: the stem's delay in updates
  (M micro-batches per update) over the momentum's memory (β the momentum, or Adam's b1); None
  for a method with no delay."""
  if plan.traits.delay_free:
    return None
  return max(delays) / plan.micro_batches_per_update * (1.0 - plan.recipe.momentum)


def delay_memory_warning(plan: RunPlan, delays) -> str | None:
  """One line when the run's ``D_max (1 − β)`` is beyond where the studies found its method level
  with its baseline: the gap they measured at or below it, or that its cost there is unmeasured
  (:func:`pipejax.methods.safe_ranges.finding`), and the token tax a budget study measured at
  its depth (:func:`pipejax.methods.safe_ranges.token_tax`); None within that range with no tax
  measured, or without a delay."""
  product = delay_memory(plan, delays)
  if product is None:
    return None
  found = safe_ranges.finding(plan.method, product, plan.recipe.momentum)
  per_update = plan.micro_batches_per_update
  tax = safe_ranges.token_tax(plan.method, len(delays), per_update)
  if found.kind == safe_ranges.HOLDS and tax is None:
    return None
  beta = "b1" if plan.optimizer == "adam" else "momentum"
  over = f" / {per_update}" if per_update > 1 else ""
  said = "; ".join(text for text in (
      None if found.kind == safe_ranges.HOLDS else found.text, tax) if text)
  return (f"{plan.preset.display_name} at D_max{over} (1 - {beta}) = "
          f"{max(delays)}{over} x (1 - {plan.recipe.momentum:.6g}) = {product:.3g} (D_max = "
          f"2(S - 1), S = {len(delays)} stages"
          f"{f', {per_update} micro-batches per update' if over else ''}"
          f"): {said}. See docs/lm.md, \"How to choose β and the rate for a pipeline of S "
          "stages\" and \"When the pipeline pays\".")


def _layer_delays(plan: RunPlan, split_model, input_shape) -> dict[str, int] | None:
  """``{layer name: delay of its stage}`` in the config's split, for a method that copies the
  per-stage rates of a pipelined run onto one stage (its ``stage_rates``); else None."""
  if not getattr(plan.hyperparameters, "stage_rates", ""):
    return None
  layer_delays = {}
  shapes, _ = split_model.trace_shapes(jax.random.PRNGKey(0), np.zeros(input_shape, np.float32))
  for delay, stage_params in zip(accounting.stage_delays(split_model.num_stages), shapes):
    layer_delays.update({name: delay for name in stage_params})
  return layer_delays


# A method's annealing length when its section sets none: one epoch, from η / D to η.
DEFAULT_ANNEAL_EPOCHS = 1.0


def annealing_steps(plan: RunPlan, train_size: int) -> int:
  """The method's annealing length K in steps: its section's anneal_fraction of the run's steps,
  or its anneal_epochs (:data:`DEFAULT_ANNEAL_EPOCHS` when it sets neither; 0: no annealing)."""
  fraction = plan.annealing.get("anneal_fraction", 0.0)
  epochs = plan.annealing.get("anneal_epochs", DEFAULT_ANNEAL_EPOCHS)
  if fraction > 0:
    return max(1, round(fraction * optimizer_steps(plan, train_size)[0]))
  if epochs == 0:
    return 0  # no rescheduling: every stage at the base rate from the start
  return max(1, optim.steps_for_samples(int(epochs * train_size), plan.micro_batch_size))


def run_ticks(plan: RunPlan, train_size: int) -> int:
  """Ticks the run trains: its schedule's epochs of the training split, whatever the chunk
  length. Whole updates of ``micro_batches_per_update`` micro-batches, at least one."""
  per_update = plan.micro_batches_per_update
  ticks = plan.schedule.samples(train_size) // plan.micro_batch_size
  return max(per_update, ticks - ticks % per_update)
