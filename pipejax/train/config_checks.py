"""The checks of a training config's fields, before anything is built: the half of
:func:`pipejax.train.plan.resolve` that reads the raw config.

:func:`check_fields` checks each field (types, ranges, known names, the method's section against
what its form reads); :func:`check_model` the model's keywords, by building it once. Each error is
a :class:`ConfigError` whose message names the field and how to fix it. The checks against a
checkpoint are :mod:`pipejax.train.resume`'s, those against the data and the machine
:mod:`pipejax.train.run_checks`'.
"""

from __future__ import annotations

import inspect
import math
from typing import Iterable

import numpy as np

from pipejax import config as configlib
from pipejax import data as data_lib
from pipejax import methods as methods_lib
from pipejax import models as models_lib
from pipejax.methods.hyperparameters import check_number
from pipejax.core.stages import ModelError


class ConfigError(ValueError):
  """The config is inconsistent; the message names the field and how to fix it."""



def check_fields(config, overridden: Iterable[str] = ()) -> None:
  """Checks every field of the config but the model's keywords (:func:`check_model`), before
  anything is created, loaded or compiled; ``overridden``: the dotted keys the command line
  set."""
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
  _refuse_other_methods_sections(config, overridden)
  if config.warmup_epochs > config.epochs:
    raise ConfigError(
        f"config.warmup_epochs ({config.warmup_epochs}) is longer than the run (config.epochs = "
        f"{config.epochs}): the learning rate would never reach its peak and never decay. Set "
        "--config.warmup_epochs to at most --config.epochs.")
  if config.dataset not in data_lib.NAMES:
    raise ConfigError(f"config.dataset={config.dataset!r} is not a known data set. Known data "
                      f"sets: {', '.join(data_lib.NAMES)}.")
  _check_augmentation(config)


def _refuse_other_methods_sections(config, overridden: Iterable[str]) -> None:
  """A command line that sets a hyperparameter of a method other than ``config.method``: the
  run would train as without it (a config file may hold several methods' sections: a study
  switches between them)."""
  for key in overridden:
    parts = key.split(".")
    if len(parts) >= 2 and parts[0] == "method_kwargs" and parts[1] != config.method:
      raise ConfigError(
          f"--config.{key} sets a hyperparameter of method {parts[1]!r}, but this run trains "
          f"method {config.method!r}, which reads only config.method_kwargs.{config.method}: "
          f"nothing would read it, and the run would train exactly as without it. Set "
          f"--config.method={parts[1]} to train that method, or drop the flag.")


# Each method hyperparameter the trainer sets itself, and the config field a user sets it with
# ({name}: the method's).
TRAINER_SET = {"learning_rate": "reference.lr (or micro_batch.lr)",
               "momentum": "reference.momentum (or micro_batch.momentum)",
               "weight_decay": "reference.weight_decay (or micro_batch.weight_decay)",
               "optimizer": "optimizer", "b2": "reference.b2", "decay_mask": "decay_mask",
               "anneal_steps": "method_kwargs.{name}.anneal_epochs (or anneal_fraction)",
               "num_stages": "model_kwargs (the model's number of stages)",
               "layer_delays": "model_kwargs.layers_per_stage (the split whose stages it copies)"}


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
  """``config.method_kwargs``: one section per method, each checked against its preset."""
  sections = config.get("method_kwargs", None)
  for name in (sections.keys() if sections is not None else ()):
    if name not in methods_lib.PRESETS:
      check_method_key(name, "")
    if not hasattr(sections[name], "items"):
      raise ConfigError(f"config.method_kwargs.{name} must be a section of hyperparameters, e.g. "
                        f"--config.method_kwargs.{name}.KEY=VALUE; got {sections[name]!r}.")
    _check_method_section(config, name, method_section(config, name))


def check_method_key(name: str, key: str, optimizer: str | None = None) -> None:
  """Refuses ``config.method_kwargs.{name}.{key}`` unless method ``name`` lets a config set
  ``key``: one of its hyperparameters that the trainer does not set, or an annealing key. The
  error lists those a run on ``optimizer`` (default: the method's first) reads."""
  if name not in methods_lib.PRESETS:
    raise ConfigError(f"config.method_kwargs.{name}: there is no method {name!r}. Its keys are "
                      f"methods' names, each holding that method's hyperparameters, e.g. "
                      f"--config.method_kwargs.pb_sc_lwp.horizon=4. Known methods: "
                      f"{', '.join(methods_lib.METHODS)}.")
  preset = methods_lib.preset_of(name)
  annealing = ANNEALING_KEYS if "anneal_steps" in preset.fields() else ()
  if key in annealing:
    return
  if key in TRAINER_SET:
    raise ConfigError(f"config.method_kwargs.{name}.{key} is set by the trainer: use "
                      f"--config.{TRAINER_SET[key].format(name=name)} instead.")
  if key not in preset.fields():
    optimizer = optimizer if optimizer in preset.optimizers else preset.optimizers[0]
    unread = methods_lib.hyperparameters_of(name, 1.0, optimizer=optimizer).unread()
    settable = [f for f in preset.fields() if f not in TRAINER_SET and f not in unread]
    raise ConfigError(f"config.method_kwargs.{name}.{key}: method {name!r} has no "
                      f"hyperparameter {key!r}, so nothing would read it. Its settable "
                      f"hyperparameters are: {', '.join(settable + list(annealing)) or 'none'}.")


def _check_method_section(config, name: str, kwargs: dict) -> None:
  preset = methods_lib.preset_of(name)
  annealing = ANNEALING_KEYS if "anneal_steps" in preset.fields() else ()
  for key in kwargs:
    check_method_key(name, key, config.optimizer)
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
  optimizer = config.optimizer if config.optimizer in preset.optimizers else preset.optimizers[0]
  try:
    unread = methods_lib.hyperparameters_of(name, 1.0, optimizer=optimizer,
                                            **hyperparameters).unread()
  except methods_lib.MethodError as e:
    raise ConfigError(f"config.method_kwargs.{name}: {e}") from None
  for key in kwargs:
    field = "anneal_steps" if key in annealing else key
    if field in unread:
      raise ConfigError(
          f"config.method_kwargs.{name}.{key}={kwargs[key]!r}: method {name!r} {unread[field]}, "
          "so nothing would read it: the run would train exactly as without it, while "
          f"config.json recorded your value. Remove config.method_kwargs.{name}.{key}.")


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


def check_model(config) -> int:
  """Builds the model once with placeholder classes: its keywords' names, types and values;
  returns its number of stages.

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
    return models_lib.build(config.model, **kwargs).num_stages
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
