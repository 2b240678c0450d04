"""What a config builds: the data, the model, the resolved recipe and the runner.

:func:`build` is the step between a config and the training loop (``pipejax.train.trainer``): it
loads the data splits, builds the model and the method at the micro-batch actually trained (the
scaling rules of docs/design.md §4 turn the config's reference recipe into it), and picks the
runner: the local :class:`~pipejax.core.engine.Pipeline` (its identical stages stacked unless
``config.stack_stages`` is off) or a mesh (:class:`~pipejax.parallel.sharding.ShardedPipeline`).
Shapes stay abstract: nothing is initialised or compiled here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import logging
import jax
import ml_collections
import numpy as np
import optax

from pipejax.core import accounting
from pipejax import data as data_lib
from pipejax import methods as methods_lib
from pipejax.methods import safe_ranges
from pipejax import models as models_lib
from pipejax import optim
from pipejax.train.config_checks import (ANNEALING_KEYS, ConfigError, method_section,
                                         method_setting, micro_batches_per_step, model_kwargs,
                                         validate)
from pipejax.core.engine import Pipeline
from pipejax.models import sequential
from pipejax.core.runner import Runner


def resolve_recipe(config) -> optim.Recipe:
  """The config's reference recipe converted to the batch each update sees (docs/design.md §4).

  ``config.micro_batch.lr`` / ``.momentum`` / ``.weight_decay``, when set, override the converted
  values. The batch is the micro-batch, or the ``micro_batches`` of one synchronous step.
  """
  step_samples = config.micro_batch_size * micro_batches_per_step(config)
  ref = config.reference
  recipe = optim.scale_recipe(
      optim.Recipe(batch_size=ref.batch_size, learning_rate=ref.lr, momentum=ref.momentum,
                   weight_decay=ref.weight_decay, b2=ref.get("b2", 0.999),
                   form="ema" if config.optimizer == "adam" else "heavy_ball"), step_samples)
  return dataclasses.replace(
      recipe, learning_rate=_override(config.micro_batch.lr, recipe.learning_rate),
      momentum=_override(config.micro_batch.momentum, recipe.momentum),
      weight_decay=_override(config.micro_batch.weight_decay, recipe.weight_decay))


def _override(value, converted):
  return converted if value is None else value


def optimizer_steps(config, recipe: optim.Recipe, train_size: int) -> tuple[int, int]:
  """``(steps, warmup_steps)``: each stage's optimizer steps over the run, and of warm-up.

  Schedules are kept in samples and converted to steps by one rule, at the recipe's batch.
  """
  steps = max(1, optim.steps_for_samples(int(config.epochs * train_size), recipe.batch_size))
  warmup = optim.steps_for_samples(int(config.warmup_epochs * train_size), recipe.batch_size)
  return steps, warmup


def learning_rate_schedule(config, recipe: optim.Recipe, train_size: int):
  if config.schedule == "constant":
    _, warmup_steps = optimizer_steps(config, recipe, train_size)
    if warmup_steps == 0:  # optax's warm-up over no steps would stay at its start, 0
      return optax.constant_schedule(recipe.learning_rate)
    return optax.schedules.warmup_constant_schedule(0.0, recipe.learning_rate, warmup_steps)
  if config.schedule == "cosine":
    steps, warmup_steps = optimizer_steps(config, recipe, train_size)
    warmup = max(warmup_steps, 1)  # optax needs at least one step of warm-up and of decay
    return optax.warmup_cosine_decay_schedule(0.0, recipe.learning_rate, warmup,
                                              max(steps, warmup + 1))
  raise ConfigError(f"config.schedule must be 'constant' or 'cosine'; got {config.schedule!r}.")


@dataclasses.dataclass
class Setup:
  """What a config builds: the data splits, the model, its recipe and the runner."""

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
    source = self.initial_weights_from.init(rng)
    weights = sequential.split_layer_params(
        self.model, sequential.merge_stage_params([st.params for st in source.stages]),
        self.pipeline.example_inputs)
    logical = self.pipeline.init(rng)
    logical = logical._replace(stages=tuple(
        st._replace(params=w, opt_state=self.pipeline.method.optimizer(delay).init(w))
        for st, w, delay in zip(logical.stages, weights, self.pipeline.delays)))
    return self.runner.from_logical(logical)


def build(config: ml_collections.ConfigDict) -> Setup:
  """Data, model, method and pipeline of ``config`` (no training; cheap: shapes are abstract)."""
  validate(config)
  train_source, test_source = data_lib.load(config.dataset, data_dir=config.data_dir or None,
                                            download=config.get("download_data", True),
                                            **({"image_size": config.image_size}
                                               if config.image_size else {}),
                                            **dict(config.get("data_kwargs", {})))
  if config.max_train_examples:
    train_source = data_lib.Subset(train_source, config.max_train_examples)
  if config.max_test_examples:
    test_source = data_lib.Subset(test_source, config.max_test_examples)

  for split, source in (("training", train_source), ("test", test_source)):
    if len(source) == 0:
      raise ConfigError(
          f"The {split} split of data set {config.dataset!r} is empty"
          f"{f' in {config.data_dir}' if config.data_dir else ''}: there is nothing to "
          f"{'train on' if split == 'training' else 'evaluate'}. Check the data files (or "
          "--config.data_dir).")

  b = config.micro_batch_size
  split_model = None
  if methods_lib.traits_of(config.method).one_stage and \
      config.model_kwargs.get("layers_per_stage", 1) is not None:
    # The one-stage baseline starts from the weights of the split the config names.
    split_model = models_lib.build(config.model, num_classes=train_source.num_classes,
                                   **dict(config.model_kwargs))
  model = models_lib.build(config.model, num_classes=train_source.num_classes,
                           **model_kwargs(config))
  recipe = resolve_recipe(config)
  learning_rate = learning_rate_schedule(config, recipe, len(train_source))
  anneal_steps = annealing_steps(config, recipe, len(train_source))
  layer_delays = _layer_delays(config, split_model, (b,) + tuple(train_source.example_shape))
  method = methods_lib.make_method(
      config.method, **method_hyperparameters(config, recipe, learning_rate, anneal_steps,
                                              model.num_stages, layer_delays))
  example_x = np.zeros((b,) + tuple(train_source.example_shape), np.float32)
  pipe = Pipeline(model, method, example_x, np.zeros((b,) + train_source.label_shape, np.int32),
                  track_weight_discrepancy=bool(config.diagnostics),
                  stack=bool(config.stack_stages))
  if config.stack_stages:
    logging.info("Parts as (start, stop) stages, those of two or more stacked: %s.",
                 pipe.part_spans)
  initial_weights_from = None
  if split_model is not None and split_model.num_stages > 1:
    initial_weights_from = Pipeline(split_model, method, example_x,
                                    np.zeros((b,) + train_source.label_shape, np.int32))
  runner: Runner = pipe
  if config.mesh.stage * config.mesh.data > 1:
    if config.diagnostics:
      raise ConfigError("config.diagnostics is measured on one device only; set "
                        "--config.diagnostics=False on a mesh, or train on one device.")
    # Single-device runs never touch meshes.
    from pipejax.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    from pipejax.parallel import partition as partition_lib  # pylint: disable=g-import-not-at-top
    from pipejax.parallel import sharding  # pylint: disable=g-import-not-at-top
    mesh = mesh_lib.make_mesh(config.mesh.stage, config.mesh.data)
    balance = config.mesh.get("balance", "params")
    costs = (partition_lib.measure_stage_costs(pipe) if balance == "measured"
             else partition_lib.param_counts(pipe))
    # Each device stacks its share of each stacked part (pipejax.parallel.stacking.advance_shard).
    sharded = sharding.ShardedPipeline(pipe, mesh, partition=config.mesh.get("partition") or None,
                                       costs=costs)
    runner = sharded
    logging.info("Mesh data=%d x stage=%d; stages per device: %s (imbalance %.2f by %s); "
                 "%d bytes cross devices per tick; bytes allocated per device: %s.",
                 config.mesh.data, config.mesh.stage, sharded.partition,
                 partition_lib.imbalance(costs, sharded.partition), balance,
                 sharded.packing.boundary_bytes_per_tick()["total"],
                 [device["allocated"] for device in sharded.packing.device_memory()])
  return Setup(train_source, test_source, model, recipe, runner,
               initial_weights_from=initial_weights_from)


def resolved_optimizer(config, recipe: optim.Recipe) -> dict:
  """The base update a run applies, after the scaling rules and overrides: its peak learning
  rate, Adam's b1 and b2 (None under SGD, whose momentum is ``momentum``), the momentum and the
  weight decay. What ``summary.json`` and the HParams record."""
  adam = config.optimizer == "adam"
  return {"learning_rate": recipe.learning_rate, "momentum": recipe.momentum,
          "b1": recipe.momentum if adam else None, "b2": recipe.b2 if adam else None,
          "weight_decay": recipe.weight_decay}


def delay_memory(config, recipe: optim.Recipe, delays) -> float | None:
  """``(D_max / M) (1 − β)`` of a run whose stages have ``delays``: the stem's delay in updates
  (M micro-batches per update, 1 unless the method accumulates) over the momentum's memory (β
  the momentum, or Adam's b1); None for a method with no delay."""
  if methods_lib.traits_of(config.method).delay_free:
    return None
  return max(delays) / micro_batches_per_step(config) * (1.0 - recipe.momentum)


def delay_memory_warning(config, recipe: optim.Recipe, delays) -> str | None:
  """One line when the run's ``D_max (1 − β)`` is beyond where the studies found its method level
  with its baseline: the gap they measured at or below it, or that its cost there is unmeasured
  (:func:`pipejax.methods.safe_ranges.finding`); None within that range or without a delay."""
  product = delay_memory(config, recipe, delays)
  if product is None:
    return None
  found = safe_ranges.finding(config.method, product, recipe.momentum)
  if found.kind == safe_ranges.HOLDS:
    return None
  beta = "b1" if config.optimizer == "adam" else "momentum"
  per_update = micro_batches_per_step(config)
  over = f" / {per_update}" if per_update > 1 else ""
  return (f"{methods_lib.DISPLAY_NAMES[config.method]} at D_max{over} (1 - {beta}) = "
          f"{max(delays)}{over} x (1 - {recipe.momentum:.6g}) = {product:.3g} (D_max = 2(S - 1), "
          f"S = {len(delays)} stages{f', {per_update} micro-batches per update' if over else ''}"
          f"): {found.text}. See docs/lm.md, \"How to choose β and the rate for a pipeline of S "
          "stages\".")


def _layer_delays(config, split_model, input_shape) -> dict[str, int] | None:
  """``{layer name: delay of its stage}`` in the config's split, for a method that copies the
  per-stage rates of a pipelined run onto one stage (its ``stage_rates``); else None."""
  if "stage_rates" not in methods_lib.record_of(config.method).fields() or \
      not method_setting(config, "stage_rates"):
    return None
  if split_model is None:
    raise ConfigError(
        f"config.method_kwargs.{config.method}.stage_rates copies the rate of each stage of the "
        "config's split onto its layers, but config.model_kwargs.layers_per_stage is None (no "
        "split). Set --config.model_kwargs.layers_per_stage to the split to copy.")
  layer_delays = {}
  shapes, _ = split_model.trace_shapes(jax.random.PRNGKey(0), np.zeros(input_shape, np.float32))
  for delay, stage_params in zip(accounting.stage_delays(split_model.num_stages), shapes):
    layer_delays.update({name: delay for name in stage_params})
  return layer_delays


def method_hyperparameters(config, recipe, learning_rate, anneal_steps: int, num_stages: int,
                           layer_delays: dict[str, int] | None = None) -> dict:
  """``make_method``'s keywords for ``config.method``: the fields its record takes, from the
  recipe, the run and the method's section of ``config.method_kwargs``."""
  known = {"learning_rate": learning_rate, "momentum": recipe.momentum,
           "weight_decay": recipe.weight_decay, "optimizer": config.optimizer, "b2": recipe.b2,
           "decay_mask": config.get("decay_mask", False), "anneal_steps": anneal_steps,
           "num_stages": num_stages, "layer_delays": layer_delays}
  fields = methods_lib.record_of(config.method).fields()
  section = method_section(config, config.method)
  return {**{key: value for key, value in known.items() if key in fields},
          **{key: value for key, value in section.items() if key not in ANNEALING_KEYS}}


# A method's annealing length when its section sets none: one epoch, from η / D to η.
DEFAULT_ANNEAL_EPOCHS = 1.0


def annealing_steps(config, recipe, train_size: int) -> int:
  """The method's annealing length K in steps: its section's anneal_fraction of the run's steps,
  or its anneal_epochs (:data:`DEFAULT_ANNEAL_EPOCHS` when it sets neither; 0: no annealing)."""
  section = method_section(config, config.method)
  fraction = section.get("anneal_fraction", 0.0)
  epochs = section.get("anneal_epochs", DEFAULT_ANNEAL_EPOCHS)
  if fraction > 0:
    return max(1, round(fraction * optimizer_steps(config, recipe, train_size)[0]))
  if epochs == 0:
    return 0  # no rescheduling: every stage at the base rate from the start
  return max(1, optim.steps_for_samples(int(epochs * train_size), config.micro_batch_size))


def run_ticks(config, train_size: int) -> int:
  """Ticks the run trains: ``config.epochs`` of the training split, whatever the chunk length.

  Whole micro-batches (whole steps of the synchronous method's ``micro_batches``), at least one.
  """
  per_step = micro_batches_per_step(config)
  ticks = int(config.epochs * train_size) // config.micro_batch_size
  return max(per_step, ticks - ticks % per_step)
