"""A run's plan: its config resolved once, into what the build, the trainer and the records read.

:func:`resolve` is the one place a training config is read: it checks every field (a
:class:`~pipejax.train.config_checks.ConfigError` names the field and how to fix it), builds the
model once to learn its stages, converts the reference recipe to the batch each update sees, and
builds the preset's hyperparameters. What it returns, a :class:`RunPlan`, is frozen and typed;
everything downstream takes it, never the config. :meth:`RunPlan.to_json` is what ``summary.json``
and each checkpoint record, and what a resume compares: the settings the run reads, so a change of
a setting nothing reads (another method's section, an explicit default) is no change.

The schedule is kept in epochs of the training split; the build turns it into samples and steps
once the data's size is known (:meth:`Schedule.samples`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Mapping

from pipejax import config as config_lib
from pipejax import methods as methods_lib
from pipejax import optim
from pipejax.train import config_checks
from pipejax.train.config_checks import ANNEALING_KEYS, TRAINER_SET, ConfigError


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The learning rate's shape over the run, in epochs of the training split."""

  kind: str  # 'constant' or 'cosine'
  epochs: float
  warmup_epochs: float

  def samples(self, train_size: int) -> int:
    """The samples the run trains on a training split of ``train_size``."""
    return int(self.epochs * train_size)

  def warmup_samples(self, train_size: int) -> int:
    return int(self.warmup_epochs * train_size)


@dataclasses.dataclass(frozen=True)
class DataPlan:
  """Where the data comes from and how much of it a run uses."""

  dataset: str
  data_dir: str | None
  download: bool
  loader_kwargs: Mapping[str, Any]  # the loader's own keywords (image_size, data_kwargs)
  max_train_examples: int  # 0: all
  max_test_examples: int
  augment: bool


@dataclasses.dataclass(frozen=True)
class ModelPlan:
  """The model the run builds: its builder's keywords and its number of stages."""

  name: str
  kwargs: Mapping[str, Any]  # the builder's keywords (one stage: layers_per_stage None)
  # The split whose initial weights a one-stage run starts from (None: its own).
  split_kwargs: Mapping[str, Any] | None
  num_stages: int


@dataclasses.dataclass(frozen=True)
class MeshPlan:
  """The devices' layout; checkpoints hold the logical state, so it may change on resume."""

  stage: int
  data: int
  partition: tuple
  balance: str
  stack_stages: bool

  @property
  def devices(self) -> int:
    return self.stage * self.data


@dataclasses.dataclass(frozen=True)
class OutputPlan:
  """How often the run evaluates and saves, and what it keeps."""

  eval_every_samples: int
  checkpoint_every_samples: int
  keep_checkpoints: int
  eval_batch_size: int
  plot_curves: bool


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """A training run, resolved from its config (:func:`resolve`).

  Attributes:
    method: the preset's name (``pipejax.methods.METHODS``).
    hyperparameters: the preset's typed hyperparameters at the recipe's peak rate; the build
      gives those that need the data (the learning rate's schedule, ``anneal_steps``,
      ``layer_delays``).
    micro_batches_per_update: the micro-batches whose mean gradient one update applies.
    micro_batches_per_flush: a synchronous method's micro-batches between two flushes of the
      pipeline; None for an asynchronous one, which never drains.
    annealing: the section's ``anneal_epochs`` or ``anneal_fraction`` (``{key: value}``, empty:
      the default), for a preset with an annealing length.
    recipe: the reference recipe converted to the batch each update sees (docs/design.md §4).
    given: the config as given (``config.json``), for the records and for comparing with a
      checkpoint written before plans existed.
  """

  method: str
  hyperparameters: Any
  micro_batches_per_update: int
  micro_batches_per_flush: int | None
  annealing: Mapping[str, float]
  optimizer: str
  recipe: optim.Recipe
  model: ModelPlan
  schedule: Schedule
  micro_batch_size: int
  seed: int
  ticks_per_chunk: int
  diagnostics: bool
  data: DataPlan
  mesh: MeshPlan
  output: OutputPlan
  allow_changes_on_resume: bool
  given: Mapping[str, Any] = dataclasses.field(repr=False, compare=False)
  given_fingerprint: Mapping[str, Any] = dataclasses.field(repr=False, compare=False)

  @property
  def preset(self) -> methods_lib.Preset:
    return methods_lib.preset_of(self.method)

  @property
  def traits(self) -> methods_lib.Traits:
    return self.preset.traits

  @property
  def samples_per_update(self) -> int:
    return self.micro_batch_size * self.micro_batches_per_update

  def settings(self) -> dict[str, Any]:
    """The preset's hyperparameters a config sets (its section, defaults filled in): those
    the trainer does not set from the recipe and the run."""
    unread = self.hyperparameters.unread()
    return {f.name: getattr(self.hyperparameters, f.name)
            for f in dataclasses.fields(self.hyperparameters)
            if f.name not in TRAINER_SET and f.name not in unread}

  def to_json(self) -> dict:
    """The plan as JSON values: what the run reads, by the names it reads them under."""
    plain = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("hyperparameters", "given", "given_fingerprint")}
    plain = {**plain, "hyperparameters": self.settings()}
    return json.loads(json.dumps(_as_plain(plain), default=str))


def _as_plain(value):
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: _as_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, Mapping):
    return {str(k): _as_plain(v) for k, v in value.items()}
  if isinstance(value, (tuple, list)):
    return [_as_plain(v) for v in value]
  return value


def resolve(config, overridden: Iterable[str] = ()) -> RunPlan:
  """The plan of ``config``, every field checked; ``overridden`` are the dotted keys the
  command line set (a section of ``method_kwargs`` for another method is refused among them)."""
  config_checks.check_fields(config, overridden)
  num_stages = config_checks.check_model(config)
  section = config_checks.method_section(config, config.method)
  annealing = {k: v for k, v in section.items() if k in ANNEALING_KEYS}
  recipe = _recipe(config, _micro_batches_per_update(config, section))
  hyperparameters = _hyperparameters(config, recipe, num_stages, section)
  per_update = hyperparameters.micro_batches_per_update
  per_flush = per_update if methods_lib.traits_of(config.method).delay_free else None
  _check_layout(config, per_flush)
  one_stage = methods_lib.traits_of(config.method).one_stage
  split = dict(config.model_kwargs) if one_stage and \
      config.model_kwargs.get("layers_per_stage", 1) is not None else None
  _check_stage_rates(config, hyperparameters, split)
  mesh = config.mesh
  return RunPlan(
      method=config.method, hyperparameters=hyperparameters, micro_batches_per_update=per_update,
      micro_batches_per_flush=per_flush, annealing=annealing, optimizer=config.optimizer,
      recipe=recipe,
      model=ModelPlan(config.model, config_checks.model_kwargs(config), split, num_stages),
      schedule=Schedule(config.schedule, config.epochs, config.warmup_epochs),
      micro_batch_size=config.micro_batch_size, seed=config.seed,
      ticks_per_chunk=config.ticks_per_chunk, diagnostics=bool(config.diagnostics),
      data=DataPlan(config.dataset, config.data_dir or None, config.get("download_data", True),
                    {**({"image_size": config.image_size} if config.image_size else {}),
                     **dict(config.get("data_kwargs", {}))},
                    config.max_train_examples, config.max_test_examples, bool(config.augment)),
      mesh=MeshPlan(mesh.stage, mesh.data, tuple(mesh.get("partition") or ()),
                    mesh.get("balance", "params"), bool(config.stack_stages)),
      output=OutputPlan(config.eval_every_samples, config.checkpoint_every_samples,
                        config.keep_checkpoints, config.eval_batch_size,
                        bool(config.plot_curves)),
      allow_changes_on_resume=bool(config.get("allow_changes_on_resume", False)),
      given=to_plain(config),
      given_fingerprint=_given_fingerprint(config, _micro_batches_per_update(config, section)))


def resolve_file(config_file: str, settings: Mapping[str, Any]) -> RunPlan:
  """The plan of the config file ``config_file`` (``PATH[:ARG]``) with ``settings`` set
  (``{dotted key: value}``: a study's ``fixed`` and a run's overrides), as its trainer resolved it.

  Raises:
    ConfigFileError: the file cannot be loaded.
    ConfigError, ValueError: the settings are not a config that trains.
  """
  config = config_lib.with_settings(config_lib.load_config(config_file), dict(settings))
  return resolve(config, settings)


def to_plain(config) -> dict:
  """``config`` as JSON would hold it (what ``config.json`` holds)."""
  return json.loads(config.to_json_best_effort()) if hasattr(config, "to_json_best_effort") else \
      dict(config)


# The config keys that fixed the shapes of the pipeline state in a checkpoint's fingerprint
# before checkpoints recorded their plan.
_GIVEN_STRUCTURAL_KEYS = ("dataset", "model", "model_kwargs", "method", "optimizer",
                          "micro_batch_size", "image_size", "seed", "ticks_per_chunk",
                          "diagnostics")


def _given_fingerprint(config, per_update: int) -> dict:
  """The fingerprint a checkpoint written before plans recorded: those keys as ml_collections
  prints them, and ``micro_batches``, the micro-batches of one update."""
  keys = {k: json.loads(json.dumps(config.get(k), default=str)) for k in _GIVEN_STRUCTURAL_KEYS}
  return {**keys, "micro_batches": per_update}


def _micro_batches_per_update(config, section: dict) -> int:
  fields = methods_lib.preset_of(config.method).fields()
  return section.get("micro_batches", 1) if "micro_batches" in fields else 1


def _recipe(config, per_update: int) -> optim.Recipe:
  """The config's reference recipe converted to the batch each update sees (docs/design.md §4).

  ``config.micro_batch.lr`` / ``.momentum`` / ``.weight_decay``, when set, override the converted
  values.
  """
  ref = config.reference
  recipe = optim.scale_recipe(
      optim.Recipe(batch_size=ref.batch_size, learning_rate=ref.lr, momentum=ref.momentum,
                   weight_decay=ref.weight_decay, b2=ref.get("b2", 0.999),
                   form="ema" if config.optimizer == "adam" else "heavy_ball"),
      config.micro_batch_size * per_update)
  given = config.micro_batch
  override = lambda value, converted: converted if value is None else value
  return dataclasses.replace(
      recipe, learning_rate=override(given.lr, recipe.learning_rate),
      momentum=override(given.momentum, recipe.momentum),
      weight_decay=override(given.weight_decay, recipe.weight_decay))


def _hyperparameters(config, recipe: optim.Recipe, num_stages: int, section: dict):
  """The preset's hyperparameters at the recipe's peak rate: the fields its preset takes, from
  the recipe, the run and its section of ``config.method_kwargs``."""
  known = {"momentum": recipe.momentum, "weight_decay": recipe.weight_decay,
           "optimizer": config.optimizer, "b2": recipe.b2,
           "decay_mask": config.get("decay_mask", False), "num_stages": num_stages}
  fields = methods_lib.preset_of(config.method).fields()
  given = {k: v for k, v in section.items() if k not in ANNEALING_KEYS}
  try:
    return methods_lib.hyperparameters_of(
        config.method, recipe.learning_rate,
        **{**{k: v for k, v in known.items() if k in fields}, **given})
  except methods_lib.MethodError as e:
    raise ConfigError(f"config.method={config.method!r} with this recipe: {e}") from None


def _check_layout(config, per_flush: int | None) -> None:
  # A synchronous chunk holds whole steps with their flushes; an asynchronous stage carries its
  # partial sum of gradients from one chunk to the next in its optimizer state.
  if per_flush is not None and config.ticks_per_chunk % per_flush:
    raise ConfigError(f"config.ticks_per_chunk ({config.ticks_per_chunk}) must be a multiple of "
                      f"config.method_kwargs.{config.method}.micro_batches ({per_flush}), so "
                      "that a chunk ends on an update.")
  if config.mesh.stage * config.mesh.data > 1 and config.diagnostics:
    raise ConfigError("config.diagnostics is measured on one device only; set "
                      "--config.diagnostics=False on a mesh, or train on one device.")


def _check_stage_rates(config, hyperparameters, split: dict | None) -> None:
  if getattr(hyperparameters, "stage_rates", "") and split is None:
    raise ConfigError(
        f"config.method_kwargs.{config.method}.stage_rates copies the rate of each stage of the "
        "config's split onto its layers, but config.model_kwargs.layers_per_stage is None (no "
        "split). Set --config.model_kwargs.layers_per_stage to the split to copy.")
