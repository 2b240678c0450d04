"""``train_and_evaluate(config, workdir)``: train a model with any method, stop anywhere, resume.

The loop feeds the pipeline in chunks of ``config.ticks_per_chunk`` ticks (one ``lax.scan`` each),
and does everything else between chunks: progress lines, metrics, test evaluation with the current
weights, checkpoints, and the finite check. Checkpoints are taken only between chunks and the chunk
length is fixed by the config, so a resumed run replays exactly the computation of a run that never
stopped (bit-identical on CPU).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import json
import math
import os
import signal
import threading
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from pipejax import accounting
from pipejax import cli
from pipejax import data as data_lib
from pipejax import methods as methods_lib
from pipejax import metrics as metrics_lib
from pipejax import models as models_lib
from pipejax import optim
from pipejax import workdir as workdir_lib
from pipejax.models import sequential
from pipejax.checkpoint import Checkpointer, CheckpointError, storage_error, weights_digest
from pipejax.engine import Pipeline
from pipejax.stages import ModelError
from pipejax.config import apply_variant, base_config  # noqa: F401  (re-exported)

# Config keys that may differ on resume without changing what is trained: where the data lives, how
# often the run reports and saves, how the devices are laid out (checkpoints hold the logical
# state). Any other change is refused unless config.allow_changes_on_resume is set.
FREE_KEYS = ("data_dir", "download_data", "eval_every_samples", "checkpoint_every_samples",
             "keep_checkpoints", "eval_batch_size", "mesh", "stack_stages",
             "allow_changes_on_resume")

# Config keys that fix the shapes of the pipeline state: a checkpoint written with other values
# cannot be resumed.
STRUCTURAL_KEYS = ("dataset", "model", "model_kwargs", "method", "optimizer", "micro_batch_size",
                   "micro_batches", "image_size", "seed", "ticks_per_chunk", "diagnostics")


class ConfigError(ValueError):
  """The config is inconsistent; the message names the field and how to fix it."""


class TrainingDiverged(RuntimeError):
  """A stage produced a non-finite value; the message names the stage and the tick."""


def resolve_recipe(config) -> optim.Recipe:
  """The config's reference recipe converted to the batch each update sees (docs/design.md §4).

  ``config.micro_batch.lr`` / ``.momentum`` / ``.weight_decay``, when set, override the converted
  values. The batch is the micro-batch, or the ``micro_batches`` of one synchronous step.
  """
  group = config.micro_batch_size * (config.micro_batches if config.method == "sync" else 1)
  ref = config.reference
  recipe = optim.scale_recipe(
      optim.Recipe(batch_size=ref.batch_size, learning_rate=ref.lr, momentum=ref.momentum,
                   weight_decay=ref.weight_decay, b2=ref.get("b2", 0.999),
                   form="ema" if config.optimizer == "adam" else "heavy_ball"), group)
  return dataclasses.replace(
      recipe, learning_rate=_override(config.micro_batch.lr, recipe.learning_rate),
      momentum=_override(config.micro_batch.momentum, recipe.momentum),
      weight_decay=_override(config.micro_batch.weight_decay, recipe.weight_decay))


def _override(value, converted):
  return converted if value is None else value


def schedule_steps(config, recipe: optim.Recipe, train_size: int) -> tuple[int, int]:
  """``(steps, warmup_steps)``: each stage's optimizer steps over the run, and of warm-up.

  Schedules are kept in samples and converted to steps by one rule, at the recipe's batch.
  """
  steps = max(1, optim.steps_for_samples(int(config.epochs * train_size), recipe.batch_size))
  warmup = optim.steps_for_samples(int(config.warmup_epochs * train_size), recipe.batch_size)
  return steps, warmup


def learning_rate_schedule(config, recipe: optim.Recipe, train_size: int):
  if config.schedule == "constant":
    return optax.constant_schedule(recipe.learning_rate)
  if config.schedule == "cosine":
    steps, warmup_steps = schedule_steps(config, recipe, train_size)
    warmup = max(warmup_steps, 1)  # optax needs at least one step of warm-up and of decay
    return optax.warmup_cosine_decay_schedule(0.0, recipe.learning_rate, warmup,
                                              max(steps, warmup + 1))
  raise ConfigError(f"config.schedule must be 'constant' or 'cosine'; got {config.schedule!r}.")


def validate(config) -> None:
  """Checks every field of the config before anything is created, loaded or compiled."""
  if config.method not in methods_lib.METHODS:
    raise ConfigError(f"config.method={config.method!r} is not a known method. Known methods: "
                      f"{', '.join(methods_lib.METHODS)}.")
  if config.model not in models_lib.names():
    raise ConfigError(f"config.model={config.model!r} is not a known model. Known models: "
                      f"{', '.join(models_lib.names())}.")
  _validate_values(config)
  if config.sgd_stage_rates and (config.method != "sgd" or config.optimizer != "sgd"):
    raise ConfigError(f"config.sgd_stage_rates={config.sgd_stage_rates!r} gives the layers of "
                      "the one-stage momentum-SGD baseline per-stage rates; it needs "
                      f"--config.method=sgd and --config.optimizer=sgd (got method "
                      f"{config.method!r}, optimizer {config.optimizer!r}).")
  if not 0 <= config.pipemare_anneal_fraction <= 1:
    raise ConfigError(f"config.pipemare_anneal_fraction must be in [0, 1] (a fraction of the "
                      f"run's steps); got {config.pipemare_anneal_fraction!r}.")
  if config.method == "sync" and config.ticks_per_chunk % config.micro_batches:
    raise ConfigError(f"config.ticks_per_chunk ({config.ticks_per_chunk}) must be a multiple of "
                      f"config.micro_batches ({config.micro_batches}) in the synchronous mode.")
  if config.schedule == "cosine" and config.warmup_epochs > config.epochs:
    raise ConfigError(
        f"config.warmup_epochs ({config.warmup_epochs}) is longer than the run (config.epochs = "
        f"{config.epochs}): the learning rate would never reach its peak and never decay. Set "
        "--config.warmup_epochs to at most --config.epochs.")
  if config.dataset not in data_lib.NAMES:
    raise ConfigError(f"config.dataset={config.dataset!r} is not a known data set. Known data "
                      f"sets: {', '.join(data_lib.NAMES)}.")
  _check_model(config)


def _model_kwargs(config) -> dict:
  kwargs = dict(config.model_kwargs)
  if config.method == "sgd":
    # The reference without a pipeline: the whole network as one stage, where the engine is
    # exactly plain optax training (tests/test_engine.py proves the identity). It starts from the
    # weights of the split the config names (Setup.initial_weights_from).
    kwargs["layers_per_stage"] = None
  return kwargs


def _check_model(config) -> None:
  """Builds the model once with placeholder classes: its keywords' names, types and values.

  Building only creates the stage objects (no weights), so a misspelt keyword or an impossible
  value is refused before the workdir exists.
  """
  kwargs = _model_kwargs(config)
  defaults = {k: p.default for k, p in
              inspect.signature(models_lib.registry._BUILDERS[config.model]).parameters.items()}  # pylint: disable=protected-access
  for name, value in kwargs.items():
    default = defaults.get(name, inspect.Parameter.empty)
    wanted = _same_kind(default, value)
    if wanted:
      raise ConfigError(
          f"config.model_kwargs.{name} must be {wanted} (model {config.model!r} takes {name}="
          f"{default!r} by default); got {value!r}. Set it with "
          f"--config.model_kwargs.{name}=VALUE.")
  try:
    models_lib.build(config.model, **kwargs)
  except ModelError:
    raise
  except (TypeError, ValueError) as e:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise ConfigError(f"config.model_kwargs {kwargs} cannot build model {config.model!r}: "
                      f"{first}. Check the values given with --config.model_kwargs.*.") from None


def _same_kind(default, value) -> str | None:
  """What ``value`` must be to stand where the builder's ``default`` stands, or None if it may."""
  is_int = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool)
  if default is inspect.Parameter.empty or default is None or value is None:
    return None
  if isinstance(default, bool):
    return None if isinstance(value, bool) else "True or False"
  if is_int(default):
    return None if is_int(value) else "an integer"
  if isinstance(default, float):
    return None if is_int(value) or isinstance(value, float) else "a number"
  if isinstance(default, str) and not isinstance(value, (str, tuple, list)):
    return "a string"
  if isinstance(default, (tuple, list)) and not isinstance(value, (tuple, list)):
    return "a tuple, e.g. (256, 128)"
  return None


# Field groups of _validate_values; optional fields (None: use the converted recipe) are checked
# only when set.
_POSITIVE_INTS = ("micro_batch_size", "micro_batches", "ticks_per_chunk", "eval_every_samples",
                  "checkpoint_every_samples", "keep_checkpoints", "eval_batch_size",
                  "reference.batch_size", "mesh.stage", "mesh.data")
_NON_NEGATIVE_INTS = ("max_train_examples", "max_test_examples", "image_size", "seed")
_POSITIVE_REALS = ("reference.lr", "micro_batch.lr")  # an optim.Recipe's learning rate
_NON_NEGATIVE_REALS = ("reference.weight_decay", "micro_batch.weight_decay",
                       "warmup_epochs", "pipemare_anneal_epochs", "pipemare_anneal_fraction")
_MOMENTA = ("reference.momentum", "micro_batch.momentum", "reference.b2")
_CHOICES = {"schedule": ("constant", "cosine"), "mesh.balance": ("params", "measured"),
            "optimizer": ("sgd", "adam"), "sgd_stage_rates": ("", "pipemare")}


def _field(config, key: str):
  value = config
  for part in key.split("."):
    value = value.get(part) if hasattr(value, "get") else None
  return value


def _validate_values(config) -> None:
  """Types and ranges of the numeric and choice fields, each named with its bad value."""
  def require(ok, key, what):
    if not ok:
      raise ConfigError(f"config.{key} must be {what}; got {_field(config, key)!r}. Set it with "
                        f"--config.{key}=VALUE.")

  is_int = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool)
  is_real = lambda v: is_int(v) or (isinstance(v, (float, np.floating)) and math.isfinite(v))
  for key in _POSITIVE_INTS:
    v = _field(config, key)
    require(is_int(v) and v >= 1, key, "a positive integer")
  for key in _NON_NEGATIVE_INTS:
    v = _field(config, key)
    require(is_int(v) and v >= 0, key, "a non-negative integer")
  require(config.seed < 2**32, "seed", "below 2**32")
  v = config.epochs
  require(is_real(v) and v > 0, "epochs", "a positive finite number")
  for key in _POSITIVE_REALS:
    v = _field(config, key)
    require(v is None or (is_real(v) and v > 0), key, "a finite number > 0")
  for key in _NON_NEGATIVE_REALS:
    v = _field(config, key)
    require(v is None or (is_real(v) and v >= 0), key, "a finite number >= 0")
  for key in _MOMENTA:
    v = _field(config, key)
    require(v is None or (is_real(v) and 0 <= v < 1), key, "a momentum in [0, 1)")
  for key, choices in _CHOICES.items():
    require(_field(config, key) in choices, key, " or ".join(repr(c) for c in choices))
  for name, value in dict(config.model_kwargs).items():
    # Every integer a model builder takes is a width, a count or layers per stage.
    ints = [x for x in (value if isinstance(value, (tuple, list)) else (value,)) if is_int(x)]
    require(all(x >= 1 for x in ints), f"model_kwargs.{name}",
            "made of positive integers (widths, counts)")


# Config keys that may differ between the processes of one run: each host reads its own copy of
# the data set, wherever it is mounted.
PER_HOST_KEYS = ("data_dir", "download_data")


def flat_config(config) -> dict:
  """``{dotted key: value}`` of every field of ``config``, as JSON would hold them."""
  return _flatten(_to_plain(config))


def _config_fingerprint(config) -> dict:
  return {k: json.loads(json.dumps(config.get(k), default=str)) for k in STRUCTURAL_KEYS}


def _to_plain(config) -> dict:
  return json.loads(config.to_json_best_effort()) if hasattr(config, "to_json_best_effort") else \
      dict(config)


class StoppedDuringSetup(Exception):
  """A signal asked a run of several processes to stop before its first chunk; all of them stop."""

  def __init__(self, signal_name: str, phase: str):
    super().__init__(f"STOPPED by {signal_name} during set-up ({phase}), before this session "
                     "trained or saved anything; rerun the same commands to continue.")


class _StopRequest:
  """Turns SIGTERM/SIGINT into a flag the loop checks between chunks (then saves and exits).

  In a binary that started a :class:`pipejax.cli.SignalWatch`, the watch takes the signals: it
  ends the process at once until the first chunk has trained (there is nothing to save), and
  from then on only raises the flag. Without one (library use), signal handlers raise it.
  """

  def __init__(self):
    self._watch = cli.signal_watch()
    self._signal_name = None
    self._previous = {}

  @property
  def signal_name(self) -> str | None:
    return self._watch.signal_name if self._watch else self._signal_name

  def training_started(self) -> None:
    if self._watch:
      self._watch.hold()

  def __enter__(self):
    if self._watch:
      return self
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. inside some test runners): no handler.
        pass
    return self

  def _handle(self, signum, frame):
    del frame
    self._signal_name = signal.Signals(signum).name

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


# Seconds between the set-up's "still ..." lines: a deep model builds and compiles for minutes.
SETUP_REPORT_EVERY = 30.0


class _SetupPhases:
  """Says in the log what the set-up is doing (again every :data:`SETUP_REPORT_EVERY` seconds
  while a phase lasts), and tells the signal watch.

  With several processes, an immediate exit of one would leave the others to fail in their next
  collective, so the watch holds signals from the start and the processes agree at every phase
  whether one of them was asked to stop (:class:`StoppedDuringSetup` on all of them).
  """

  def __init__(self):
    self._watch = cli.signal_watch()
    self._start = time.perf_counter()
    self._several = jax.process_count() > 1
    self._phase = None
    self._done = threading.Event()
    if self._watch and self._several:
      self._watch.hold()

  def __enter__(self):
    threading.Thread(target=self._report, name="pipejax-setup-progress", daemon=True).start()
    return self

  def __exit__(self, *exc):
    self.done()

  def _report(self):
    while not self._done.wait(SETUP_REPORT_EVERY):
      if self._phase:
        logging.info("Set-up (%.0f s): still %s.", time.perf_counter() - self._start, self._phase)

  def enter(self, phase: str) -> None:
    self._phase = phase
    logging.info("Set-up (%.0f s): %s.", time.perf_counter() - self._start, phase)
    if self._watch is None:
      return
    self._watch.set_phase(phase)
    if self._several and _agree_to_stop(self._watch.signal_name is not None):
      raise StoppedDuringSetup(self._watch.signal_name or "a signal to another process", phase)

  def done(self) -> None:
    """The first chunk has trained: the set-up is over."""
    self._done.set()


def make_evaluator(model, batch_size: int):
  """A function (stage params, test source, stage variables) -> {loss, accuracy} over the split."""
  @jax.jit
  def batch_sums(params, variables, x, y, mask):
    h = x
    for stage, p, v in zip(model.stages, params, variables):
      h = stage.infer(p, h, v)
    loss, _ = jax.vmap(lambda logits, label: model.loss(logits[None], label[None]))(h, y)
    # One accuracy per example: the fraction of its labels hit (per-token labels of an LM too).
    correct = jnp.mean((jnp.argmax(h, -1) == y).reshape(y.shape[0], -1), axis=1)
    return jnp.sum(loss * mask), jnp.sum(correct * mask)

  def evaluate(stage_params, test_source, stage_variables=None) -> dict:
    loss_sum, correct_sum, count = 0.0, 0.0, 0
    stage_variables = stage_variables or [None] * len(stage_params)
    for x, y, mask in data_lib.eval_batches(test_source, batch_size):
      loss, correct = batch_sums(stage_params, stage_variables, x, y, mask.astype(np.float32))
      loss_sum += float(loss)
      correct_sum += float(correct)
      count += int(mask.sum())
    return {"loss": loss_sum / count, "accuracy": correct_sum / count}

  return evaluate


def _mean_over_backwards(per_tick: np.ndarray, delays: list[int], first_tick: int) -> list[float]:
  """Per stage, the mean of a (ticks, stages) metric over the ticks where the stage backwarded.

  Stage s backwards its first sample at tick D_s; before that its metric is a placeholder 0.
  """
  ticks = first_tick + np.arange(per_tick.shape[0])
  means = []
  for s, delay in enumerate(delays):
    active = ticks >= delay
    means.append(float(per_tick[active, s].mean()) if active.any() else 0.0)
  return means


def _first_non_finite(finite: np.ndarray, first_tick: int, model) -> str | None:
  bad = np.argwhere(~finite)
  if not len(bad):
    return None
  tick_offset = bad[:, 0].min()
  stages = sorted(int(s) for t, s in bad if t == tick_offset)
  names = ", ".join(f"stage {s} ('{model.stages[s].name}')" for s in stages)
  return f"{names} at tick {first_tick + int(tick_offset)}"


@dataclasses.dataclass
class Setup:
  """What a config builds: the data splits, the model, its recipe and the pipeline."""

  train_source: Any
  test_source: Any
  model: Any
  recipe: optim.Recipe  # the reference recipe at the batch each update sees
  pipeline: Pipeline
  sharded: Any = None  # a pipejax.sharding.ShardedPipeline when config.mesh spans devices
  # A pipejax.stacking.StackedPipeline when the model has identical runs (on a mesh, `sharded`
  # runs it, each device stacking its piece of every group).
  stacked: Any = None
  # The pipeline whose initial weights this run starts from, merged into its own stages, when
  # the two split the network differently: the one-stage SGD baseline starts where the pipelined
  # runs of the same seed start, so a paired comparison pairs the weights as well as the data.
  initial_weights_from: Pipeline | None = None

  @property
  def runner(self):
    """The pipeline training runs, on one device or over the mesh: one interface
    (:class:`pipejax.engine.PipelineRunner`)."""
    return self.sharded or self.stacked or self.pipeline

  def init(self, rng):
    # One compiled program: run op by op, each initializer of each new weight shape compiles a
    # program of its own, which on a CPU takes longer than compiling the whole init once. The
    # numbers are the same. A mesh's init is jitted already; a stacked runner starts from the
    # per-stage init, restacked, so that both layouts start from the same bits.
    if self.sharded is not None:
      state = self.runner.init(rng)
      if self.initial_weights_from is None:
        return state
      logical = self.runner.to_logical(state)
    else:
      logical = jax.jit(self.pipeline.init)(rng)
    if self.initial_weights_from is not None:
      source = jax.jit(self.initial_weights_from.init)(rng)
      weights = sequential.split_layer_params(
          self.model, sequential.merge_stage_params([st.params for st in source.stages]),
          self.pipeline.example_inputs)
      logical = logical._replace(stages=tuple(
          st._replace(params=w, opt_state=self.pipeline.method.optimizer(delay).init(w))
          for st, w, delay in zip(logical.stages, weights, self.pipeline.delays)))
    return logical if self.runner is self.pipeline else self.runner.from_logical(logical)

  def run(self, state, inputs, labels, valid):
    return self.runner.run(state, inputs, labels, valid)

  def logical(self, state):
    """The device-independent PipelineState (what checkpoints hold: any mesh can resume it)."""
    return self.runner.to_logical(state)

  def placed(self, logical_state):
    return self.runner.from_logical(logical_state)


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
  if config.method == "sgd" and config.model_kwargs.get("layers_per_stage", 1) is not None:
    # The one-stage baseline starts from the weights of the split the config names.
    split_model = models_lib.build(config.model, num_classes=train_source.num_classes,
                                   **dict(config.model_kwargs))
  model = models_lib.build(config.model, num_classes=train_source.num_classes,
                           **_model_kwargs(config))
  recipe = resolve_recipe(config)
  schedule = learning_rate_schedule(config, recipe, len(train_source))
  if config.pipemare_anneal_fraction > 0:
    anneal_steps = max(1, round(config.pipemare_anneal_fraction *
                                 schedule_steps(config, recipe, len(train_source))[0]))
  elif config.pipemare_anneal_epochs == 0:
    anneal_steps = 0  # no rescheduling: every stage at the base rate from the start
  else:
    anneal_steps = max(1, optim.steps_for_samples(
        int(config.pipemare_anneal_epochs * len(train_source)), b))
  method = methods_lib.make_method(
      config.method, learning_rate=schedule, momentum=recipe.momentum,
      weight_decay=recipe.weight_decay, micro_batches=config.micro_batches,
      anneal_steps=anneal_steps, optimizer=config.optimizer, b2=recipe.b2,
      num_stages=model.num_stages, decay_mask=config.get("decay_mask", False))
  if config.sgd_stage_rates == "pipemare" and split_model is not None:
    layer_delays = {}
    shapes, _ = split_model.trace_shapes(
        jax.random.PRNGKey(0), np.zeros((b,) + tuple(train_source.example_shape), np.float32))
    for delay, stage_params in zip(accounting.stage_delays(split_model.num_stages), shapes):
      layer_delays.update({name: delay for name in stage_params})
    method = methods_lib.sgd_with_pipemare_rates(
        layer_delays, learning_rate=schedule, momentum=recipe.momentum,
        weight_decay=recipe.weight_decay, anneal_steps=anneal_steps)
  example_x = np.zeros((b,) + tuple(train_source.example_shape), np.float32)
  pipe = Pipeline(model, method, example_x, np.zeros((b,) + train_source.label_shape, np.int32),
                  track_weight_discrepancy=bool(config.diagnostics))
  initial_weights_from = None
  if split_model is not None and split_model.num_stages > 1:
    initial_weights_from = Pipeline(split_model, method, example_x,
                                    np.zeros((b,) + train_source.label_shape, np.int32))
  stacked = None
  if config.stack_stages:
    from pipejax import stacking  # pylint: disable=import-outside-toplevel
    stacked = stacking.StackedPipeline(pipe)
    logging.info("Stages as runs (start, stop), those of two or more stacked: %s.", stacked.runs)
    stacked = stacked if stacked.stacked else None
  sharded = None
  if config.mesh.stage * config.mesh.data > 1:
    if config.diagnostics:
      raise ConfigError("config.diagnostics is measured on one device only; set "
                        "--config.diagnostics=False on a mesh, or train on one device.")
    from pipejax import sharding  # single-device runs never touch meshes
    mesh = sharding.make_mesh(config.mesh.stage, config.mesh.data)
    balance = config.mesh.get("balance", "params")
    costs = (sharding.measure_stage_costs(pipe) if balance == "measured"
             else sharding.param_counts(pipe))
    # With stacked groups each device stacks its piece of them (pipejax.stacking.advance_stages).
    sharded = sharding.ShardedPipeline(stacked or pipe, mesh,
                                       partition=config.mesh.get("partition") or None, costs=costs)
    logging.info("Mesh data=%d x stage=%d; stages per device: %s (imbalance %.2f by %s); "
                 "%d bytes cross devices per tick; bytes allocated per device: %s.",
                 config.mesh.data, config.mesh.stage, sharded.partition,
                 sharding.imbalance(costs, sharded.partition), balance,
                 sharding.boundary_bytes_per_tick(sharded)["total"],
                 [device["allocated"] for device in sharding.device_memory(sharded)])
  return Setup(train_source, test_source, model, recipe, pipe, sharded, stacked,
               initial_weights_from=initial_weights_from)


def run_ticks(config, train_size: int) -> int:
  """Ticks the run trains: ``config.epochs`` of the training split, whatever the chunk length.

  Whole micro-batches (whole groups of ``config.micro_batches`` in the synchronous mode), at
  least one.
  """
  group = config.micro_batches if config.method == "sync" else 1
  ticks = int(config.epochs * train_size) // config.micro_batch_size
  return max(group, ticks - ticks % group)


# The share of the machine's memory a chunk's inputs and metrics may take (host and device copy).
CHUNK_MEMORY_SHARE = 0.25


def chunk_bytes(setup: Setup, ticks: int) -> int:
  """Bytes of one chunk of ``ticks`` ticks: its inputs and labels on the host and on the devices,
  and its per-tick metrics."""
  pipe = setup.pipeline
  b, m = pipe.micro_batch_size, pipe.method.micro_batches_per_step
  scheduled = ticks if m is None else ticks // m * (m + accounting.bubble_ticks(pipe.num_stages, m))
  example = math.prod(setup.train_source.example_shape) * 4 + 4  # float32 inputs, int32 label
  metrics = 4 * (4 + 5 * pipe.num_stages)  # loss, accuracy; per stage valid, sample, finite, ...
  return scheduled * (2 * b * example + metrics)


def _memory_available() -> tuple[int, str]:
  """The memory a chunk and the state compete for: the first device's, or the host's on CPU."""
  device = jax.local_devices()[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{device.device_kind}'s memory"
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"


def _state_bytes(setup: Setup) -> int:
  """Bytes of the pipeline state on one device (the largest share on a mesh), from shapes alone:
  weights, optimizer states, delay lines (and stashed weights where the method keeps them)."""
  if setup.sharded is not None:
    from pipejax import sharding  # pylint: disable=g-import-not-at-top
    return max(device["allocated"] for device in sharding.device_memory(setup.sharded))
  pipe = setup.pipeline
  params = pipe.stage_param_shapes
  total = accounting.tree_bytes(params) + pipe.stash_bytes()
  optimizers = {}  # by delay: stages with one delay share the optimizer's per-weight layout
  for delay, stage_params in zip(pipe.delays, params):
    tx = optimizers.setdefault(delay, pipe.method.optimizer(delay))
    total += accounting.tree_bytes(jax.eval_shape(tx.init, stage_params))
  if pipe.stashes_weights:
    total += sum((d + 1) * accounting.tree_bytes(p) for d, p in zip(pipe.delays, params))
  return total


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _check_memory(config, setup: Setup, chunk_ticks: int) -> None:
  """Refuses, before anything is compiled, a chunk or a state that cannot fit in memory."""
  available, where = _memory_available()
  chunk = chunk_bytes(setup, chunk_ticks)
  if chunk > CHUNK_MEMORY_SHARE * available:
    per_tick = max(chunk // chunk_ticks, 1)
    fitting = max(1, int(CHUNK_MEMORY_SHARE * available) // per_tick)
    raise ConfigError(
        f"A chunk of {chunk_ticks} ticks (config.ticks_per_chunk={config.ticks_per_chunk}, at "
        f"most the run's length) needs about {_gib(chunk)} for its inputs and metrics, more than "
        f"{CHUNK_MEMORY_SHARE:.0%} of {where} ({_gib(available)}). Lower "
        f"--config.ticks_per_chunk to {fitting} or less (it changes no result, only how often "
        "the run reports and can save).")
  state = _state_bytes(setup)
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


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains ``config`` in ``workdir`` (resuming from its latest checkpoint) and evaluates it.

  The config is validated, then the workdir is checked writable and locked (one run at a time),
  before anything is built. Returns the final summary (also written to ``workdir/summary.json``);
  a run stopped by SIGTERM/SIGINT returns early with ``summary['stopped_by']`` set, after saving a
  checkpoint. A finished workdir is reported again, not retrained or re-evaluated.
  """
  validate(config)
  # In a multi-host run every process computes the same metrics; one writes them.
  primary = jax.process_index() == 0
  with workdir_lib.claim(workdir, lock=primary):
    try:
      with _SetupPhases() as phases:
        return _train(config, workdir, primary, phases)
    except OSError as e:  # metrics, plots, summary: a disk that filled up or turned read-only
      problem = storage_error("Writing to the workdir", os.path.abspath(workdir), e)
      if problem is None:
        raise
      raise problem from None


def _train(config: ml_collections.ConfigDict, workdir: str, primary: bool,
           phases: _SetupPhases) -> dict:
  phases.enter("loading the data and building the model")
  setup = build(config)

  train_source, test_source = setup.train_source, setup.test_source
  model, recipe, pipe = setup.model, setup.recipe, setup.pipeline
  b = config.micro_batch_size
  augment = train_source.default_augment if config.augment else None
  stream = data_lib.DataStream(train_source, b, config.seed, augment=augment)

  total_ticks = run_ticks(config, len(train_source))
  total_samples = total_ticks * b
  _check_memory(config, setup, min(config.ticks_per_chunk, total_ticks))

  feed = placement = None
  if jax.process_count() > 1:  # each process feeds and saves its own devices' part
    from pipejax import distributed  # pylint: disable=g-import-not-at-top
    feed, placement = distributed.trainer_parts(setup.sharded)
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), config.keep_checkpoints,
                              primary=primary, placement=placement)
  phases.enter(f"initialising the pipeline state ({pipe.num_stages} stages)")
  state = setup.init(jax.random.PRNGKey(config.seed))
  init_digest = weights_digest([st.params for st in setup.logical(state).stages])
  samples, seconds_before = 0, 0.0
  phases.enter("looking for a checkpoint to resume")
  restored = checkpointer.restore_newest(
      setup.logical(state), lambda step, meta: _check_resumable(config, checkpointer, step, meta))
  if restored is not None:
    step, logical_state, meta = restored
    state = setup.placed(logical_state)
    stream.set_state(meta["data_position"])
    samples = int(meta["samples"])
    seconds_before = float(meta.get("train_seconds", 0.0))
    logging.info("Resumed from %s step %d (%d samples seen).", checkpointer.directory, step,
                 samples)
    finished = _finished_summary(workdir, samples, total_samples)
    if finished is not None:
      checkpointer.close()
      return finished
    if primary:
      _record_config_changes(config, workdir, meta, samples)

  writer = metrics_lib.MetricsWriter(workdir, resume_samples=samples if restored else None,
                                     enabled=primary)
  if primary:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(_to_plain(config), f, indent=2, default=str)
  logging.info("Initial weights: sha256 %s (the same for every method at this seed and split).",
               init_digest)
  logging.info("Model: %d stage%s; method %s; micro-batch %d; lr %.3g, momentum %.5f, weight decay "
               "%.3g; %d optimizer steps per stage (%d of warm-up); delays %s; %d training "
               "samples.", pipe.num_stages, "" if pipe.num_stages == 1 else "s", config.method, b,
               recipe.learning_rate, recipe.momentum, recipe.weight_decay,
               *schedule_steps(config, recipe, len(train_source)),
               pipe.delays, total_samples)

  start_time = time.perf_counter()

  def save(current_state):
    checkpointer.save(samples, setup.logical(current_state), {
        "samples": samples, "data_position": stream.get_state(),
        "fingerprint": _config_fingerprint(config), "config": _to_plain(config),
        "train_seconds": seconds_before + time.perf_counter() - start_time})
    writer.flush()

  evaluate = make_evaluator(model, config.eval_batch_size)
  # The base rate, logged beside the loss.
  schedule = learning_rate_schedule(config, recipe, len(train_source))
  group_size = recipe.batch_size  # samples per optimizer step

  def evaluate_now():
    stages = setup.logical(state).stages
    result = evaluate([st.params for st in stages], test_source, [st.variables for st in stages])
    # A rerun of a run killed after its final evaluation (and before summary.json) evaluates the
    # same state again: its record is already there, kept by the resume.
    if not writer.has_record("test", samples):
      writer.write("test", samples, **result)
    logging.info("[%d samples] test loss %.4f, test accuracy %.4f", samples, result["loss"],
                 result["accuracy"])
    return result

  # The test loss at the initial weights: a study counts a run whose final loss is above it as
  # diverged, however finite its numbers.
  if samples == 0 and not writer.has_record("test", 0):
    evaluate_now()
  interval_start = (time.perf_counter(), samples)
  stopped_by = None
  test_result = None
  phases.enter(f"compiling the chunk (a scan over ticks of {pipe.num_stages} stages) and "
               "running the first one")
  with _StopRequest() as stop:
    while samples < total_samples:
      # The last chunk is shorter when the run is not a whole number of chunks: the run's length
      # and its schedule follow from the config alone.
      ticks = min(config.ticks_per_chunk, (total_samples - samples) // b)
      if feed is None:
        x, y = stream.next_chunk(ticks)
        x, y, valid = pipe.schedule(x, y)
      else:
        x, y, valid = feed.next_chunk(stream, ticks)
      first_tick = int(state.tick)
      state, chunk_metrics = setup.run(state, x, y, valid)
      chunk_metrics = jax.device_get(chunk_metrics)
      stop.training_started()
      phases.done()
      _raise_if_diverged(config, setup, state, chunk_metrics, first_tick, samples, valid,
                         checkpointer)
      previous, samples = samples, samples + ticks * b
      # The rate of this interval alone: a running average would count compile time forever.
      now = time.perf_counter()
      rate = (samples - interval_start[1]) / max(now - interval_start[0], 1e-9)
      interval_start = (now, samples)
      seen = np.asarray(chunk_metrics["valid"])
      if seen.any():
        writer.write("train", samples, loss=float(np.mean(chunk_metrics["loss"][seen])),
                     accuracy=float(np.mean(chunk_metrics["accuracy"][seen])),
                     learning_rate=float(schedule(samples // group_size)),
                     samples_per_second=rate)
      if "weight_discrepancy" in chunk_metrics:
        writer.write("diagnostics", samples, weight_discrepancy=_mean_over_backwards(
            np.asarray(chunk_metrics["weight_discrepancy"]), pipe.delays, first_tick))
      # Every process computes the same numbers; the others' lines are for --verbosity=1.
      logging.log(logging.INFO if primary else logging.DEBUG,
                  "[%d/%d samples, epoch %.2f] loss %.4f, accuracy %.3f, %.0f samples/s, ETA %s",
                  samples, total_samples, samples / len(train_source),
                  float(np.mean(chunk_metrics["loss"][seen])) if seen.any() else float("nan"),
                  float(np.mean(chunk_metrics["accuracy"][seen])) if seen.any() else float("nan"),
                  rate, _duration((total_samples - samples) / max(rate, 1e-9)))
      crossed = lambda every: samples // every != previous // every
      if crossed(config.eval_every_samples) and samples < total_samples:
        test_result = evaluate_now()
      if _agree_to_stop(stop.signal_name is not None):
        stopped_by = stop.signal_name or "a signal to another process"
        logging.warning("Stop requested by %s after %d samples: saving a checkpoint.", stopped_by,
                        samples)
      if crossed(config.checkpoint_every_samples) or stopped_by:
        save(state)
      if stopped_by:
        logging.warning("Stopped by %s after %d samples; checkpoint saved in %s. Rerun the same "
                        "command to resume.", stopped_by, samples, checkpointer.directory)
        break

    if stopped_by is None:
      if checkpointer.latest_step() != samples:
        save(state)
      test_result = evaluate_now()
      writer.write_hparams(
          {**flat_config(config), "num_stages": pipe.num_stages,
           "resolved.lr": recipe.learning_rate, "resolved.momentum": recipe.momentum,
           "resolved.weight_decay": recipe.weight_decay},
          {"test_accuracy": test_result["accuracy"], "test_loss": test_result["loss"]})
    # Still under the stop request: a SIGTERM while the run writes its last files must not kill
    # it between its final checkpoint and summary.json (the run has finished; it exits 0).
    writer.close()
    if primary and stopped_by is None:
      # Once, at the end: TensorBoard and scripts/plot.py show a run in progress.
      metrics_lib.plot_runs({config.method: metrics_lib.read_records(workdir)},
                            os.path.join(workdir, "curves.png"),
                            title=f"{config.model} on {config.dataset}, {config.method}, b={b}")
    checkpointer.close()
    summary = {
        "samples": samples, "total_samples": total_samples, "stopped_by": stopped_by,
        "method": config.method, "model": config.model, "dataset": config.dataset,
        "micro_batch_size": b, "num_stages": pipe.num_stages,
        "mesh": {"data": config.mesh.data, "stage": config.mesh.stage},
        "learning_rate": recipe.learning_rate, "momentum": recipe.momentum,
        "train_seconds": seconds_before + time.perf_counter() - start_time,
        "test_accuracy": None if test_result is None else test_result["accuracy"],
        "test_loss": None if test_result is None else test_result["loss"],
        "init_digest": init_digest,
        **_run_facts(workdir),
    }
    if primary:
      with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
  return summary


def _flatten(tree, prefix: str = "") -> dict:
  if not isinstance(tree, dict):
    return {prefix[:-1]: tree}
  out = {}
  for key, value in tree.items():
    out.update(_flatten(value, f"{prefix}{key}."))
  return out


def _changed_settings(config, meta: dict) -> dict:
  """``{key: (value in the checkpoint, value now)}`` of every field that differs, free or not."""
  old, new = _flatten(meta.get("config", {})), flat_config(config)
  return {k: (old[k], new[k]) for k in sorted(old.keys() & new.keys()) if old[k] != new[k]}


def _is_free(key: str) -> bool:
  return key.split(".")[0] in FREE_KEYS


def _check_resumable(config, checkpointer, step: int, meta: dict) -> None:
  """Refuses a checkpoint of another model or layout, and unannounced changes of the recipe."""
  saved, wanted = meta.get("fingerprint", {}), _config_fingerprint(config)
  differing = sorted(k for k in wanted if saved.get(k) != wanted[k])
  if differing:
    raise CheckpointError(
        f"Checkpoint step {step} in {checkpointer.directory} was written with a different "
        f"{', '.join(differing)} ({', '.join(f'{k}={saved.get(k)!r}' for k in differing)}; "
        f"this run: {', '.join(f'{k}={wanted[k]!r}' for k in differing)}). Resume with the same "
        "settings, or use a new --workdir for the new ones.")
  changes = {k: v for k, v in _changed_settings(config, meta).items() if not _is_free(k)}
  if changes and not config.get("allow_changes_on_resume", False):
    workdir = os.path.dirname(checkpointer.directory)
    raise ConfigError(
        f"This run would resume checkpoint step {step} in {workdir} with other settings than it "
        f"was trained with: {_describe_changes(changes)}. Continuing silently would mix two "
        "experiments in one run. Rerun with the original values, use a new --workdir for the new "
        "ones, or pass --config.allow_changes_on_resume=True to continue with them (the change "
        f"is then logged and recorded in {os.path.join(workdir, CHANGES_FILE)}).")


CHANGES_FILE = "config_changes.jsonl"


def _describe_changes(changes: dict) -> str:
  return "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())


def _record_config_changes(config, workdir: str, meta: dict, samples: int) -> None:
  """Logs the fields this session changes and appends them to ``workdir/config_changes.jsonl``."""
  changes = _changed_settings(config, meta)
  if not changes:
    return
  recipe = {k: v for k, v in changes.items() if not _is_free(k)}
  if recipe:
    logging.warning("Resuming at %d samples with changed settings (allowed by "
                    "config.allow_changes_on_resume): %s.", samples, _describe_changes(recipe))
  logging.info("Resuming at %d samples with changed settings: %s.", samples,
               _describe_changes(changes))
  with open(os.path.join(workdir, CHANGES_FILE), "a") as f:
    f.write(json.dumps({"samples": samples, "time": time.time(),
                        "changes": {k: list(v) for k, v in changes.items()}}) + "\n")


def _finished_summary(workdir: str, samples: int, total_samples: int) -> dict | None:
  """The summary of a run that already finished at ``samples``, or None."""
  try:
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
  except (OSError, ValueError):
    return None
  if (samples >= total_samples and summary.get("stopped_by") is None
      and summary.get("samples") == samples and summary.get("test_accuracy") is not None):
    logging.info("This run finished before (%d samples); reporting its summary, nothing is "
                 "retrained or re-evaluated.", samples)
    return summary
  return None


def _run_facts(workdir: str) -> dict:
  """The summary's record of the run's best test accuracy and of what it ran on."""
  import jaxlib  # pylint: disable=g-import-not-at-top
  tests = [r for r in metrics_lib.read_records(workdir) if r.get("split") == "test"]
  accuracies = [r["accuracy"] for r in tests if "accuracy" in r]
  initial = [r["loss"] for r in tests if r.get("samples") == 0 and "loss" in r]
  try:
    version = importlib.metadata.version("pipejax")
  except importlib.metadata.PackageNotFoundError:
    version = "unknown (not installed)"
  device = jax.devices()[0]
  return {"best_test_accuracy": max(accuracies) if accuracies else None,
          "initial_test_loss": initial[0] if initial else None,
          "versions": {"pipejax": version, "jax": jax.__version__, "jaxlib": jaxlib.__version__},
          "device": f"{jax.device_count()} x {device.platform} ({device.device_kind})",
          "processes": jax.process_count()}


def _agree_to_stop(requested: bool) -> bool:
  """Whether any process was asked to stop; all processes then stop at the same chunk."""
  if jax.process_count() == 1:
    return requested
  from pipejax import distributed  # pylint: disable=g-import-not-at-top
  return distributed.any_process(requested)


@jax.jit
def _finite_weights(stages) -> jax.Array:
  """One flag per stage: are its weights and optimizer state finite (one reduction per chunk)."""
  def finite(tree):
    flags = [jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(tree)
             if jnp.issubdtype(a.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)
  return jnp.stack([finite((st.params, st.opt_state)) for st in stages])


def _raise_if_diverged(config, setup, state, chunk_metrics, first_tick: int, samples: int,
                       valid, checkpointer) -> None:
  """A :class:`TrainingDiverged` if the chunk saw a non-finite activation or left bad weights.

  Activations flag a NaN within a tick of its birth; the weights are checked too, once per chunk,
  because an inf weight can be written in the chunk's last tick and must never be checkpointed.
  """
  model = setup.model
  finite = np.asarray(chunk_metrics["finite"])
  bad_weights = [s for s, ok in enumerate(np.asarray(_finite_weights(setup.logical(state).stages)))
                 if not ok]
  if finite.all() and not bad_weights:
    return
  if not finite.all():
    where = _first_non_finite(finite, first_tick, model)
    offset = int(np.argwhere(~finite)[:, 0].min())
  else:
    where = (", ".join(model.stage_label(s) for s in bad_weights)
             + f" (its weights) in ticks {first_tick}..{first_tick + len(finite) - 1}")
    offset = len(finite)
  seen = samples + config.micro_batch_size * int(np.sum(np.asarray(valid)[:offset]))
  steps = checkpointer.all_steps()
  advice = "Lower the learning rate (--config.reference.lr or --config.micro_batch.lr) or add warm-up " \
           "(--config.warmup_epochs)"
  if config.method not in ("pb_sc_lwp", "sgd", "sync"):
    advice += ", or try a method with delay compensation (--config.method=pb_sc_lwp)"
  raise TrainingDiverged(
      f"Training diverged: {where} produced a non-finite value (NaN or inf), after {seen} "
      "training samples. "
      + (f"The last good checkpoint (step {max(steps)}, with finite weights) is kept in "
         f"{checkpointer.directory}; a rerun resumes from it (to resume with other settings, add "
         "--config.allow_changes_on_resume=True). "
         if steps else "No checkpoint had been written yet, so a rerun starts from the "
         "beginning. ")
      + advice + ".")


def _duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(seconds)
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s" if seconds >= 3600 \
      else f"{seconds // 60}m{seconds % 60:02d}s"



def _user_errors():
  from pipejax.checkpoint import CheckpointError as _CheckpointError
  from pipejax.data import DataError
  from pipejax.engine import PipelineError
  from pipejax.methods import MethodError
  from pipejax.stages import ModelError
  from pipejax.checkpoint import StorageError
  return (ConfigError, TrainingDiverged, _CheckpointError, DataError, PipelineError, MethodError,
          ModelError, StorageError, workdir_lib.WorkdirBusy)


# Every error a user can cause; the binary prints these as one paragraph, without a traceback.
USER_ERRORS = _user_errors()
