"""Every check of a training config before anything is built, trained or resumed.

:func:`validate` checks each field (types, ranges, known names; the model's keywords by building
it once); :func:`check_resumable` compares the config, and the data's fingerprint, with those a
checkpoint was written with; :func:`check_pipeline_fills` refuses a run too short to train every
stage; :func:`check_memory` refuses a chunk, a state or an evaluation batch that cannot fit. Each
error is a :class:`ConfigError` (a :class:`~pipejax.data.DataError` for changed data) whose
message names the field and how to fix it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import time

from absl import logging
import numpy as np
import yaml

from pipejax import cli
from pipejax import files
from pipejax.core import accounting
from pipejax import data as data_lib
from pipejax import config as configlib
from pipejax import methods as methods_lib
from pipejax import models as models_lib
from pipejax.methods.hyperparameters import check_number
from pipejax.train.checkpoint import CheckpointError
from pipejax.data import fingerprint as data_fingerprint
from pipejax.core.stages import ModelError

class ConfigError(ValueError):
  """The config is inconsistent; the message names the field and how to fix it."""



def validate(config) -> None:
  """Checks every field of the config before anything is created, loaded or compiled."""
  unknown = configlib.unknown_fields(config)
  if unknown:  # the check a config file's loading makes, for a config built in code
    raise ConfigError(configlib.unknown_field_message(unknown[0], "the training config"))
  if config.method not in methods_lib.METHODS:
    raise ConfigError(f"config.method={config.method!r} is not a known method. Known methods: "
                      f"{', '.join(methods_lib.METHODS)}.")
  if config.model not in models_lib.names():
    raise ConfigError(f"config.model={config.model!r} is not a known model. Known models: "
                      f"{', '.join(models_lib.names())}.")
  _validate_values(config)
  _refuse_unread_fields(config)
  _check_method_kwargs(config)
  per_step = micro_batches_per_step(config)
  # A synchronous chunk holds whole steps with their flushes; an asynchronous stage carries its
  # partial sum of gradients from one chunk to the next in its optimizer state.
  synchronous = methods_lib.traits_of(config.method).delay_free
  if synchronous and config.ticks_per_chunk % per_step:
    raise ConfigError(f"config.ticks_per_chunk ({config.ticks_per_chunk}) must be a multiple of "
                      f"config.method_kwargs.{config.method}.micro_batches ({per_step}), so "
                      "that a chunk ends on an update.")
  if config.warmup_epochs > config.epochs:
    raise ConfigError(
        f"config.warmup_epochs ({config.warmup_epochs}) is longer than the run (config.epochs = "
        f"{config.epochs}): the learning rate would never reach its peak and never decay. Set "
        "--config.warmup_epochs to at most --config.epochs.")
  if config.dataset not in data_lib.NAMES:
    raise ConfigError(f"config.dataset={config.dataset!r} is not a known data set. Known data "
                      f"sets: {', '.join(data_lib.NAMES)}.")
  _check_augmentation(config)
  _check_model(config)


# Each method hyperparameter the trainer sets itself, and the config field a user sets it with
# ({name}: the method's).
TRAINER_SET = {"learning_rate": "reference.lr (or micro_batch.lr)",
               "momentum": "reference.momentum (or micro_batch.momentum)",
               "weight_decay": "reference.weight_decay (or micro_batch.weight_decay)",
               "optimizer": "optimizer", "b2": "reference.b2", "decay_mask": "decay_mask",
               "anneal_steps": "method_kwargs.{name}.anneal_epochs (or anneal_fraction)",
               "num_stages": "model_kwargs (the model's number of stages)",
               "layer_delays": "model_kwargs.layers_per_stage (the split whose stages it copies)"}


def method_setting(config, key: str):
  """Hyperparameter ``key`` of ``config.method`` as the run reads it: its section's value, else
  its hyperparameters' default."""
  section = method_section(config, config.method)
  if key in section:
    return section[key]
  fields = dataclasses.fields(methods_lib.record_of(config.method).hyperparameters)
  return next(f.default for f in fields if f.name == key)


def micro_batches_per_step(config) -> int:
  """The micro-batches one optimizer step of ``config``'s method sees: an accumulating method's
  ``micro_batches`` (M), else 1."""
  traits = methods_lib.traits_of(config.method)
  return traits.micro_batches_per_step(
      method_setting(config, "micro_batches") if traits.accumulates_micro_batches else 1)


def unread_fields(config) -> list[tuple[str, str]]:
  """``(field, why)`` for each field set away from its default that this run would not read.

  The one place that decides it: ``reference.b2`` is read only by Adam, a mesh's partition and
  balance only by a mesh of several stage devices. (A method's own hyperparameters are in its
  section of ``method_kwargs``, which only that method reads.)
  """
  defaults = configlib.base_config()
  unread = []
  if config.optimizer != "adam":
    unread.append(("reference.b2", "only optimizer 'adam' has a second moment"))
  if _field(config, "mesh.stage") == 1:
    why = "only a mesh of several stage devices (mesh.stage > 1) splits the stages among them"
    unread += [("mesh.partition", why), ("mesh.balance", why)]
  # None is how a config file says a field does not apply (reference.b2 of an SGD recipe).
  return [(field, why) for field, why in unread
          if _field(config, field) not in (None, _field(defaults, field))]


def _refuse_unread_fields(config) -> None:
  unread = unread_fields(config)
  if unread:
    field, why = unread[0]
    default = _field(configlib.base_config(), field)
    raise ConfigError(f"config.{field}={_field(config, field)!r} would be ignored: {why}. The run "
                      f"would train exactly as with the default, while config.json and the "
                      f"HParams recorded your value. Set --config.{field}={default!r} (its "
                      f"default), or change what makes it unread.")


# Keys of a method's config section that the trainer turns into its ``anneal_steps``.
ANNEALING_KEYS = ("anneal_epochs", "anneal_fraction")


def method_section(config, name: str) -> dict:
  """``config.method_kwargs[name]``: what the config sets for method ``name`` ({} if nothing)."""
  sections = config.get("method_kwargs", None)
  section = sections.get(name, None) if sections is not None else None
  return dict(section) if section is not None else {}


def _check_method_kwargs(config) -> None:
  """``config.method_kwargs``: one section per method, each checked against its record."""
  sections = config.get("method_kwargs", None)
  for name in (sections.keys() if sections is not None else ()):
    if name not in methods_lib.RECORDS:
      check_method_key(name, "")
    if not hasattr(sections[name], "items"):
      raise ConfigError(f"config.method_kwargs.{name} must be a section of hyperparameters, e.g. "
                        f"--config.method_kwargs.{name}.KEY=VALUE; got {sections[name]!r}.")
    _check_method_section(config, name, method_section(config, name))


def check_method_key(name: str, key: str) -> None:
  """Refuses ``config.method_kwargs.{name}.{key}`` unless method ``name`` lets a config set
  ``key``: one of its hyperparameters that the trainer does not set, or an annealing key."""
  if name not in methods_lib.RECORDS:
    raise ConfigError(f"config.method_kwargs.{name}: there is no method {name!r}. Its keys are "
                      f"methods' names, each holding that method's hyperparameters, e.g. "
                      f"--config.method_kwargs.pb_sc_lwp.horizon=4. Known methods: "
                      f"{', '.join(methods_lib.METHODS)}.")
  record = methods_lib.record_of(name)
  annealing = ANNEALING_KEYS if "anneal_steps" in record.fields() else ()
  if key in annealing:
    return
  if key in TRAINER_SET:
    raise ConfigError(f"config.method_kwargs.{name}.{key} is set by the trainer: use "
                      f"--config.{TRAINER_SET[key].format(name=name)} instead.")
  if key not in record.fields():
    settable = [f for f in record.fields() if f not in TRAINER_SET] + list(annealing)
    raise ConfigError(f"config.method_kwargs.{name}.{key}: method {name!r} has no "
                      f"hyperparameter {key!r}, so nothing would read it. Its settable "
                      f"hyperparameters are: {', '.join(settable) or 'none'}.")


def _check_method_section(config, name: str, kwargs: dict) -> None:
  record = methods_lib.record_of(name)
  annealing = ANNEALING_KEYS if "anneal_steps" in record.fields() else ()
  for key in kwargs:
    check_method_key(name, key)
    if key in annealing:
      try:
        check_number(key, kwargs[key], high=1 if key == "anneal_fraction" else math.inf,
                     high_open=False, owner=f"config.method_kwargs.{name}")
      except methods_lib.MethodError as e:
        raise ConfigError(str(e)) from None
  if annealing and set(annealing) <= set(kwargs):
    raise ConfigError(f"config.method_kwargs.{name} sets both anneal_epochs and anneal_fraction; "
                      "set one.")
  hyperparameters = {k: v for k, v in kwargs.items() if k not in annealing}
  optimizer = config.optimizer if config.optimizer in record.optimizers else record.optimizers[0]
  try:
    methods_lib.hyperparameters_of(name, 1.0, optimizer=optimizer, **hyperparameters)
  except methods_lib.MethodError as e:
    raise ConfigError(f"config.method_kwargs.{name}: {e}") from None


def _check_augmentation(config) -> None:
  """``config.augment`` on a data set without a standard augmentation would train unaugmented
  while config.json and TensorBoard say otherwise."""
  if config.augment and config.dataset not in data_lib.AUGMENTED_NAMES:
    raise ConfigError(
        f"config.augment=True, but data set {config.dataset!r} has no standard augmentation "
        f"(only {', '.join(data_lib.AUGMENTED_NAMES)} have one), so the run would train exactly as "
        "without it. Set --config.augment=False.")


def model_kwargs(config) -> dict:
  """The model builder's keywords: ``config.model_kwargs``, one stage for method 'sgd'."""
  kwargs = dict(config.model_kwargs)
  if methods_lib.traits_of(config.method).one_stage:
    # The reference without a pipeline: the whole network as one stage, where the engine is
    # exactly plain optax training (tests/core/test_engine.py proves the identity). It starts from
    # the weights of the split the config names
    # (pipejax.train.experiment.Setup.initial_weights_from).
    kwargs["layers_per_stage"] = None
  return kwargs


def _check_model(config) -> None:
  """Builds the model once with placeholder classes: its keywords' names, types and values.

  Building only creates the stage objects (no weights), so a misspelt keyword or an impossible
  value is refused before the workdir exists.
  """
  kwargs = model_kwargs(config)
  builder = models_lib.registry._BUILDERS[config.model]  # pylint: disable=protected-access
  defaults = {k: p.default for k, p in inspect.signature(builder).parameters.items()}
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
  if isinstance(default, (tuple, list)):
    if not isinstance(value, (tuple, list)):
      return "a tuple, e.g. (256, 128)"
    # A default of integers (widths, counts) wants integers: a float width would fail only when
    # the stages are traced, as stages that do not chain.
    if all(is_int(d) for d in default) and not all(is_int(v) for v in value):
      return "a tuple of integers, e.g. (256, 128)"
  return None


# The fields _validate_values checks, by kind; optional fields (None: use the converted recipe) are
# checked only when set.
_POSITIVE_INTS = ("micro_batch_size", "ticks_per_chunk", "eval_every_samples",
                  "checkpoint_every_samples", "keep_checkpoints", "eval_batch_size",
                  "reference.batch_size", "mesh.stage", "mesh.data")
_NON_NEGATIVE_INTS = ("max_train_examples", "max_test_examples", "image_size", "seed")
_POSITIVE_REALS = ("reference.lr", "micro_batch.lr")  # an optim.Recipe's learning rate
_NON_NEGATIVE_REALS = ("reference.weight_decay", "micro_batch.weight_decay", "warmup_epochs")
_MOMENTA = ("reference.momentum", "micro_batch.momentum", "reference.b2")
_CHOICES = {"schedule": ("constant", "cosine"), "mesh.balance": ("params", "measured"),
            "optimizer": ("sgd", "adam")}


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


def check_pipeline_fills(config, pipeline, run_ticks: int) -> None:
  """Refuses a run too short for every stage to apply an update that moves its weights.

  Asynchronously, stage 0 backwards its first micro-batch only once the pipeline is full, at
  tick 2(S-1); a synchronous step takes M micro-batches. A cosine schedule's first update has a
  rate of 0 (its warm-up starts there), so it needs a second one.
  """
  updates = 2 if config.schedule == "cosine" or config.warmup_epochs > 0 else 1
  m = pipeline.method.micro_batches_per_step
  per_update = pipeline.method.micro_batches_per_update
  stages = pipeline.num_stages
  needed = updates * m if m is not None else 2 * (stages - 1) + updates * per_update
  if run_ticks >= needed:
    return
  b = config.micro_batch_size
  why = (f"a synchronous step takes config.method_kwargs.{config.method}.micro_batches = {m} "
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


# Config keys that may differ on resume without changing what is trained: where the data lives, how
# often the run reports and saves, how the devices are laid out (checkpoints hold the logical
# state). Any other change is refused unless config.allow_changes_on_resume is set.
FREE_KEYS = ("data_dir", "download_data", "eval_every_samples", "checkpoint_every_samples",
             "keep_checkpoints", "eval_batch_size", "plot_curves", "mesh", "stack_stages",
             "allow_changes_on_resume")

# Config keys that fix the shapes of the pipeline state: a checkpoint written with other values
# cannot be resumed. The fingerprint adds ``micro_batches``, the micro-batches one step sees.
STRUCTURAL_KEYS = ("dataset", "model", "model_kwargs", "method", "optimizer", "micro_batch_size",
                   "image_size", "seed", "ticks_per_chunk", "diagnostics")



# Config keys that may differ between the processes of one run: each host reads its own copy of
# the data set, wherever it is mounted.
PER_HOST_KEYS = ("data_dir", "download_data")


def flat_config(config) -> dict:
  """``{dotted key: value}`` of every field of ``config``, as JSON would hold them."""
  return _flatten(to_plain(config))


def fingerprint(config) -> dict:
  """What a checkpoint must have been written with to be resumed: :data:`STRUCTURAL_KEYS`, and
  the micro-batches of one step under ``micro_batches`` (its name when it was a field: every
  checkpoint records it so)."""
  keys = {k: json.loads(json.dumps(config.get(k), default=str)) for k in STRUCTURAL_KEYS}
  return {**keys, "micro_batches": micro_batches_per_step(config)}


def to_plain(config) -> dict:
  return json.loads(config.to_json_best_effort()) if hasattr(config, "to_json_best_effort") else \
      dict(config)


def _flatten(tree, prefix: str = "") -> dict:
  if not isinstance(tree, dict):
    return {prefix[:-1]: tree}
  out = {}
  for key, value in tree.items():
    out.update(_flatten(value, f"{prefix}{key}."))
  return out


_NOT_SET = "(not set)"


def _changed_settings(config, meta: dict) -> dict:
  """``{key: (value in the checkpoint, value now)}`` of every field that differs, free or not.

  A field only one side has is compared only inside ``method_kwargs``, whose keys are set one by
  one (a hyperparameter added or dropped on resume changes the recipe); elsewhere it is a field
  the code added or removed since. The saved config is read with today's names
  (:func:`pipejax.config.current_keys`).
  """
  old = _flatten(meta.get("config", {}))
  old = configlib.current_keys(old, method=old.get("method", config.method))
  new = flat_config(config)
  keys = old.keys() & new.keys() | {k for k in old.keys() ^ new.keys()
                                    if k.startswith("method_kwargs.")}
  return {k: (old.get(k, _NOT_SET), new.get(k, _NOT_SET)) for k in sorted(keys)
          if old.get(k, _NOT_SET) != new.get(k, _NOT_SET)}


def _is_free(key: str) -> bool:
  return key.split(".")[0] in FREE_KEYS


def recipe_changes(config, trained_config: dict) -> str:
  """The fields other than :data:`FREE_KEYS` in which ``config`` differs from ``trained_config``
  (a run's config.json), described as ``key old -> new; ...``; empty when none does."""
  changes = {k: v for k, v in _changed_settings(config, {"config": trained_config}).items()
             if not _is_free(k)}
  return _describe_changes(changes)


def _shown(value) -> str:
  """A fingerprint's value as a Python literal. A section (model_kwargs) is held in the
  fingerprint as the YAML text ml_collections prints for it (``hidden: !!python/tuple ...``)."""
  if isinstance(value, str) and "\n" in value:
    try:
      decoded = yaml.load(value, Loader=yaml.FullLoader)  # FullLoader: tuples, nothing runs
    except yaml.YAMLError:
      return repr(value)
    if isinstance(decoded, dict):
      return repr(decoded)
  return repr(value)


def check_resumable(config, checkpointer, step: int, meta: dict, data: dict | None = None
                    ) -> None:
  """Refuses a checkpoint of another model or layout, and unannounced changes of the recipe or,
  given this run's ``data`` fingerprint (:mod:`pipejax.data.fingerprint`), of the data."""
  _check_same_data(config, checkpointer, step, meta, data)
  saved, wanted = meta.get("fingerprint", {}), fingerprint(config)
  differing = sorted(k for k in wanted if saved.get(k) != wanted[k])
  if differing:
    raise CheckpointError(
        f"Checkpoint step {step} in {checkpointer.directory} was written with a different "
        f"{', '.join(differing)} ({', '.join(f'{k}={_shown(saved.get(k))}' for k in differing)}; "
        f"this run: {', '.join(f'{k}={_shown(wanted[k])}' for k in differing)}). Resume with the "
        "same settings, or use a new --workdir for the new ones.")
  changes = {k: v for k, v in _changed_settings(config, meta).items() if not _is_free(k)}
  if changes and not config.get("allow_changes_on_resume", False):
    workdir = os.path.dirname(checkpointer.directory)
    raise ConfigError(
        f"This run would resume checkpoint step {step} in {workdir} with other settings than it "
        f"was trained with: {_describe_changes(changes)}. Continuing silently would mix two "
        "experiments in one run. Rerun with the original values, use a new --workdir for the new "
        "ones, or pass --config.allow_changes_on_resume=True to continue with them (the change "
        f"is then logged and recorded in {os.path.join(workdir, CHANGES_FILE)}).")


def _check_same_data(config, checkpointer, step: int, meta: dict, data: dict | None) -> None:
  # A checkpoint that records no data fingerprint predates them: nothing to compare.
  if data is None or "data" not in meta:
    return
  changes = data_fingerprint.differences(meta["data"], data)
  if changes and not config.get("allow_changes_on_resume", False):
    workdir = os.path.dirname(checkpointer.directory)
    raise data_lib.DataError(
        f"The data changed since checkpoint step {step} in {workdir} was written: "
        f"{'; '.join(changes)}. Continuing would train one run on two data sets. Point "
        "--config.data_dir at the data it was trained on, use a new --workdir, or pass "
        "--config.allow_changes_on_resume=True to continue on the new data (the change is then "
        f"logged and recorded in {os.path.join(workdir, CHANGES_FILE)}).")


CHANGES_FILE = "config_changes.jsonl"


def _describe_changes(changes: dict) -> str:
  shown = lambda value: value if value == _NOT_SET else repr(value)
  return "; ".join(f"{k} {shown(old)} -> {shown(new)}" for k, (old, new) in changes.items())


def record_changes(config, workdir: str, meta: dict, samples: int, data: dict | None = None
                   ) -> None:
  """Logs the fields this session changes and appends them to ``workdir/config_changes.jsonl``;
  given this run's ``data`` fingerprint, a change of the data too."""
  _record_data_change(workdir, meta, samples, data)
  changes = _changed_settings(config, meta)
  if not changes:
    return
  recipe = {k: v for k, v in changes.items() if not _is_free(k)}
  if recipe:
    logging.warning("Resuming at %d samples with changed settings (allowed by "
                    "config.allow_changes_on_resume): %s.", samples, _describe_changes(recipe))
  logging.info("Resuming at %d samples with changed settings: %s.", samples,
               _describe_changes(changes))
  files.append(os.path.join(workdir, CHANGES_FILE), json.dumps(
      {"samples": samples, "time": time.time(),
       "changes": {k: list(v) for k, v in changes.items()}}) + "\n")


def _record_data_change(workdir: str, meta: dict, samples: int, data: dict | None) -> None:
  changes = data_fingerprint.differences(meta["data"], data) if data and "data" in meta else []
  if not changes:
    return
  logging.warning("Resuming at %d samples on changed data (allowed by "
                  "config.allow_changes_on_resume): %s.", samples, "; ".join(changes))
  files.append(os.path.join(workdir, CHANGES_FILE),
               json.dumps({"samples": samples, "time": time.time(), "data": changes}) + "\n")


# The share of the machine's memory a chunk's inputs and metrics may take (host and device copy).
CHUNK_MEMORY_SHARE = 0.25


def chunk_bytes(setup, ticks: int) -> int:
  """Bytes of one chunk of ``ticks`` ticks: its inputs and labels on the host and on the devices,
  and its per-tick metrics."""
  pipe = setup.pipeline
  b, m = pipe.micro_batch_size, pipe.method.micro_batches_per_step
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


def check_memory(config, setup, chunk_ticks: int) -> None:
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
  _check_evaluation_memory(config, setup, state, available, where)


def eval_batch_size(config, test_size: int) -> int:
  """The batch evaluation runs: ``config.eval_batch_size``, at most the test split (a larger
  batch would only be padding)."""
  return max(1, min(config.eval_batch_size, test_size))


def eval_bytes(setup, batch: int) -> int:
  """Bytes of one evaluation batch, from shapes alone: every stage's input and the logits, at
  ``batch`` examples (a lower bound: the layers' intermediate values come on top)."""
  pipe = setup.pipeline
  per_micro_batch = accounting.tree_bytes(pipe.spec.stage_input_shapes) + \
      accounting.tree_bytes(pipe.spec.last_stage_output())
  labels = 4 * math.prod(setup.test_source.label_shape)
  return batch * (math.ceil(per_micro_batch / pipe.micro_batch_size) + labels)


def _check_evaluation_memory(config, setup, state: int, available: int, where: str) -> None:
  batch = eval_batch_size(config, len(setup.test_source))
  needed = eval_bytes(setup, batch)
  if state + needed <= available:
    return
  fitting = max(1, (available - state) * batch // max(needed, 1) // 2)
  raise ConfigError(
      f"Evaluation in batches of {batch} (config.eval_batch_size={config.eval_batch_size}, at "
      f"most the test split) needs about {_gib(needed)} for its activations alone; beside the "
      f"pipeline state ({_gib(state)}) that is more than {where} ({_gib(available)}). Lower "
      f"--config.eval_batch_size to {fitting} or less (it changes no result).")
