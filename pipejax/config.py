"""The training config's fields and defaults, importable without JAX.

Config files (``configs/*.py``) build on :func:`base_config`; this module needs only
ml_collections, so reading a config (``scripts/study.py`` reads dozens) never imports JAX or orbax.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import re
import shlex
import sys
from typing import Any, NoReturn

import ml_collections
from ml_collections import config_dict


def base_config() -> ml_collections.ConfigDict:
  """Every field ``train_and_evaluate`` reads, with defaults; config files change what they need."""
  config = ml_collections.ConfigDict()
  config.dataset = "fashion_mnist_idx"  # a name of pipejax.data.load
  config.data_dir = ""  # empty: the data set's default location
  # tfds data sets missing from data_dir are downloaded and built there (needs internet, and
  # TensorFlow for most); False fails at once with how to build them on another machine.
  config.download_data = True
  config.image_size = 0  # 0: the data set's native size (ImageNet: resize to this)
  config.max_train_examples = 0  # 0: all; else the first N (quick runs)
  config.max_test_examples = 0
  config.augment = False  # the data set's standard train-time augmentation
  # The data set's own keywords (pipejax.data.load), e.g. {"context": 64} for a character corpus.
  config.data_kwargs = ml_collections.ConfigDict({})

  config.model = "mlp"  # a name of pipejax.models.build
  config.model_kwargs = ml_collections.ConfigDict({"layers_per_stage": 1})

  config.method = "pb_sc_lwp"  # a name of pipejax.methods.METHODS
  # Per method, its hyperparameters that no other field sets, by their names in its preset
  # (pipejax.methods.preset_of(NAME).hyperparameters), e.g. {"pb_sc_lwp": {"horizon": 4}} or
  # {"sync": {"micro_batches": 8}}, and for a method with an annealing length (anneal_steps),
  # anneal_epochs (default 1.0; 0 turns the rescheduling off) or anneal_fraction (of the run's
  # steps, so that it scales with the run's length). A run reads the section of config.method;
  # every section is checked, so a config file can hold the recipes of several methods (a study
  # switches between them) and a misspelt key is still refused.
  config.method_kwargs = ml_collections.ConfigDict({})
  config.optimizer = "sgd"  # the base update: 'sgd' (heavy-ball momentum) or 'adam'
  config.micro_batch_size = 1
  # Weight decay on the kernels only (leaves of 2+ axes), not on biases and norm scales.
  config.decay_mask = False

  # Two sets of optimizer settings, so that a number is never read at the wrong batch size:
  # reference.* is the recipe as it would run with ordinary mini-batches (batch 128, lr 0.1: the
  # numbers a paper or another framework gives); micro_batch.* is what actually trains at
  # micro_batch_size, converted from the reference by the scaling rules (docs/design.md §4).
  # Leave micro_batch.* unset to use the conversion; set one to override it (e.g. a per-sample
  # rate found by a sweep). `--config.micro_batch.lr=0.1` at b = 1 is about 15000 times the
  # converted rate and diverges: the batch-128 lr is --config.reference.lr.
  config.reference = ml_collections.ConfigDict(
      {"batch_size": 128, "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4,
       "b2": 0.999})  # b2: Adam's second-moment decay (optimizer='adam' only)
  config.micro_batch = ml_collections.ConfigDict({
      "lr": config_dict.placeholder(float), "momentum": config_dict.placeholder(float),
      "weight_decay": config_dict.placeholder(float)})
  config.schedule = "cosine"  # or "constant"; kept in samples, converted to steps
  config.epochs = 10.0
  config.warmup_epochs = 0.2
  config.seed = 0
  # Per-stage |w_fwd - w_bwd| / |w_bwd| in the metrics (split 'diagnostics') and TensorBoard: the
  # staleness a method leaves. Keeps a weight copy per stashed input: memory and time, same numbers.
  config.diagnostics = False

  config.ticks_per_chunk = 2000  # ticks per lax.scan call; checkpoints fall between chunks
  config.eval_every_samples = 60000
  config.checkpoint_every_samples = 60000
  config.keep_checkpoints = 3
  # A workdir resumes only with the recipe it was trained with; True accepts changed fields (e.g.
  # a lower lr after a divergence) and records them in workdir/config_changes.jsonl.
  config.allow_changes_on_resume = False
  config.eval_batch_size = 1000
  # False: no curves.png when the run ends (scripts/plot.py draws it from metrics.jsonl at any
  # time). Drawing it takes 1 to 2 s of CPU, most of it importing matplotlib.
  config.plot_curves = True
  # Devices: `stage` devices each own a contiguous shard of stages; `data` replicas average
  # gradients. Checkpoints hold the logical state, so a run can resume on another mesh.
  # balance: 'params' (parameter counts) or 'measured' (timed stage work); an explicit partition,
  # ((start, stop), ...) per stage device, overrides both.
  config.mesh = ml_collections.ConfigDict({"stage": 1, "data": 1, "partition": (),
                                           "balance": "params"})
  # Runs of identical stages (a residual MLP's blocks) tick as one stack under vmap: fewer
  # kernels and a compile time that does not grow with depth; the same numbers
  # (pipejax.parallel.stacking).
  config.stack_stages = True
  return config


def apply_variant(config: ml_collections.ConfigDict, arg: str | None,
                  tiny: dict | None = None) -> ml_collections.ConfigDict:
  """Applies a config file's argument (``--config=configs/NAME.py:ARG``).

  ``smoke``: every part of a run (train, evaluate, checkpoint, plots) in under a minute.
  ``tiny`` (only where the config file gives ``tiny`` overrides): the smoke run with a tiny
  network over the whole (mock) data set, for tests on ``tfds.testing.mock_data``.
  """
  known = ("smoke", "tiny") if tiny else ("smoke",)
  if not arg:
    return config
  if arg not in known:
    raise ValueError(f"Unknown config argument {arg!r}; known: {', '.join(known)}.")
  config.max_train_examples = 2000
  config.max_test_examples = 500
  config.epochs = 1.0
  config.warmup_epochs = min(config.warmup_epochs, config.epochs)  # a warm-up fits in the run
  config.ticks_per_chunk = max(1, 250 // config.micro_batch_size)
  config.eval_every_samples = 1000
  config.checkpoint_every_samples = 1000
  if arg == "tiny":
    config.max_train_examples = 0
    config.max_test_examples = 0
    for key, value in tiny.items():  # replace whole fields (model_kwargs), do not merge them
      config[key] = value
  return config


# ----------------------------------------------------------------------------- command line

# Keyword dicts whose keys another part decides (the model's builder, the data set's loader, the
# method's preset), not base_config: the command line may add a key the config file did not list.
FREE_FORM_FIELDS = ("model_kwargs", "data_kwargs", "method_kwargs")
_KWARGS_FIELDS = FREE_FORM_FIELDS


def unknown_fields(config) -> list[str]:
  """The dotted names of ``config``'s fields that :func:`base_config` does not have.

  Nothing reads such a field: ``config.learning_rate = 0.5`` (meant: ``reference.lr``) would
  train at the default rate. The keys inside :data:`FREE_FORM_FIELDS` are their readers' to check.
  """
  known = set(dotted_keys(base_config()))
  unknown = []

  def walk(section, prefix):
    for key, value in section.items():
      name = prefix + key
      if name not in known:
        unknown.append(name)
      elif name not in FREE_FORM_FIELDS and isinstance(value, (ml_collections.ConfigDict, dict)):
        walk(value, name + ".")

  walk(config, "")
  return unknown


# Other names of the optimizer's fields: make_method's and optax's keywords, and common
# abbreviations.
_SYNONYMS = {"learning_rate": "lr", "wd": "weight_decay", "b1": "momentum", "beta1": "momentum",
             "beta2": "b2", "batch": "batch_size"}


def closest_fields(key: str, known: list[str]) -> list[str]:
  """The known fields a misspelt ``key`` most likely meant: those of the same last name or one
  of its synonyms (``lr`` and ``learning_rate``: ``reference.lr`` and ``micro_batch.lr``), else
  the closest spelling."""
  last = key.rpartition(".")[2]
  return [k for k in known if k.rpartition(".")[2] in (last, _SYNONYMS.get(last))] or \
      difflib.get_close_matches(key, known, n=1)


def unknown_field_message(key: str, where: str, known: list[str] | None = None,
                          flag: bool = False) -> str:
  """The one paragraph for a field ``key`` that ``where`` sets and no part of a run reads.

  Args:
    key: the field's dotted name.
    where: what set it (``"configs/x.py"``, ``"the command line"``).
    known: the fields it may have meant; base_config's by default.
    flag: name the fields as command-line flags (``--config.KEY``), else as ``config.KEY``.
  """
  name = (lambda k: f"--config.{k}") if flag else (lambda k: f"config.{k}")
  if key in RENAMED_FIELDS:
    return renamed_field_message(key, where, flag)
  known = dotted_keys(base_config()) if known is None else known
  close = closest_fields(key, known)
  hint = f" Did you mean {' or '.join(name(k) for k in close)}?" if close else ""
  return (f"{name(key)} is not a field of {where}: nothing would read it, and the run would "
          f"train as if it were not set.{hint} The fields are listed in pipejax/config.py "
          "(base_config).")


# ----------------------------------------------------------------------------- renamed fields

# Fields that one method alone read, now hyperparameters in its section of method_kwargs: the old
# name, its new key, and the default it had (a saved config lists every field, set or not).
RENAMED_FIELDS = {
    "micro_batches": ("method_kwargs.sync.micro_batches", 1),
    "pipemare_anneal_epochs": ("method_kwargs.pipemare.anneal_epochs", 1.0),
    "pipemare_anneal_fraction": ("method_kwargs.pipemare.anneal_fraction", 0.0),
    "sgd_stage_rates": ("method_kwargs.sgd.stage_rates", ""),
}


def renamed_field_message(key: str, where: str, flag: bool = False) -> str:
  """The refusal of an old field name (:data:`RENAMED_FIELDS`) that ``where`` sets: its new key."""
  new = RENAMED_FIELDS[key][0]
  name = (lambda k: f"--config.{k}") if flag else (lambda k: f"config.{k}")
  return (f"{name(key)} is no longer a field of {where}: it is a hyperparameter of its method "
          f"now, set as {name(new)}, in the method's section of config.method_kwargs like its "
          "other hyperparameters (pipejax/config.py, base_config). Workdirs and study records "
          "saved with the old name still resume and report; a new config uses the new key.")


def current_keys(flat: dict, method: str | None = None) -> dict:
  """``flat`` (``{dotted key: value}``, saved before :data:`RENAMED_FIELDS` were renamed) with
  each old key replaced by its new one, in place in the order; a key ``flat`` also holds under
  its new name keeps that value. Every reader of a saved config or a study record calls this.

  Args:
    flat: a study record's ``overrides`` or ``fixed``, or a saved config (flattened).
    method: the run's method, for a whole saved config: each old field goes to that method's
      section (PipeMare's annealing was read by every method with an annealing length), and one
      still at its old default is dropped, since a saved config lists every field, set or not.
  """
  out = {}
  for key, value in flat.items():
    if key not in RENAMED_FIELDS:
      out[key] = value
      continue
    new, default = RENAMED_FIELDS[key]
    if method is not None:
      if value == default:
        continue
      new = f"method_kwargs.{method}.{new.rpartition('.')[2]}"
    if new not in flat:
      out[new] = value
  return out


# model_kwargs.KEY, data_kwargs.KEY, and method_kwargs.METHOD.KEY (one section per method).
_ADDED_KWARG = re.compile(
    r"^--config\.(model_kwargs|data_kwargs|method_kwargs)\.([A-Za-z_][\w.]*)=(.*)$", re.S)
_CONFIG_KEY = re.compile(r"^--config\.([\w.]+)=")


def _literal(text: str) -> Any:
  """A flag value as Python would read it (numbers, tuples, None, booleans), else the string."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def dotted_keys(config, prefix: str = "") -> list[str]:
  """Every field of ``config`` by its dotted key (``mesh``, ``mesh.stage``, ...), in order."""
  keys = []
  for key, value in config.items():
    keys.append(prefix + key)
    if isinstance(value, ml_collections.ConfigDict):
      keys.extend(dotted_keys(value, f"{prefix}{key}."))
  return keys


def parse_flags(argv: list[str]) -> list[str]:
  """absl ``flags_parser`` for binaries with a ``--config`` file flag
  (``app.run(main, flags_parser=...)``).

  * ``--config.model_kwargs.KEY=VALUE`` may add a keyword the config file did not list (any
    keyword of the model's builder, e.g. ``normalization``); the model builder checks the names.
  * A misspelt config key or a config file that cannot be loaded is one line naming the key and
    the closest known one, not a traceback.
  """
  from absl import flags  # the binaries' dependency, not the config files'

  _COMMAND_LINE[:] = argv[1:]
  added, kept = {field: {} for field in _KWARGS_FIELDS}, []
  for arg in argv:
    match = _ADDED_KWARG.match(arg)
    if match:
      added[match.group(1)][match.group(2)] = _literal(match.group(3))
    else:
      kept.append(arg)
  # config_flags finds its override flags by scanning sys.argv itself: hide the added keywords.
  sys.argv[:] = [a for a in sys.argv if not _ADDED_KWARG.match(a)]
  config_arg = next((a.split("=", 1)[1] for a in kept if a.startswith("--config=")), None)
  if config_arg:
    # Loaded here first: config_flags would wrap the file's own error (an unknown variant, a
    # syntax error) in a traceback of its parser.
    try:
      load_config(config_arg)
    except ConfigFileError as e:
      _exit(str(e))
  try:
    rest = flags.FLAGS(kept)
    config = flags.FLAGS.config
  except flags.Error as e:
    _exit(f"{str(e).rstrip('.')}. Run with --helpfull for the flags.")
  except (AttributeError, KeyError, OSError, TypeError, ValueError) as e:
    _exit(describe_config_error(e, kept))
  for field, kwargs in added.items():
    try:
      _add_keywords(config, field, kwargs)
    except ValueError as e:
      _exit(str(e))
  return rest


def _add_keywords(config, field: str, kwargs: dict) -> None:
  """Sets ``kwargs`` (``{key: value}``, a key of a section dotted) in the free-form ``field``."""
  if not kwargs:
    return
  with config.unlocked():
    merged = config[field].to_dict() if field in config else {}
    for key, value in kwargs.items():
      *sections, name = key.split(".")
      target = merged
      for section in sections:
        target = target.setdefault(section, {})
        if not isinstance(target, dict):
          raise ValueError(f"--config.{field}.{key}: config.{field}.{section} is not a section.")
      if isinstance(target.get(name), str) and value is not None and not isinstance(value, str):
        value = str(value)  # e.g. a string-valued keyword given as a number-like word
      target[name] = value
    # A new field, not one typed by the config file's value: the model's builder (the method's
    # preset) decides what a keyword may be, and the trainer's validation says so in one line.
    config[field] = ml_collections.ConfigDict(merged)


def with_settings(config: ml_collections.ConfigDict,
                  settings: dict[str, Any]) -> ml_collections.ConfigDict:
  """A copy of ``config`` with ``settings`` (``{dotted key: value}``, a study's ``fixed`` and
  overrides) set as the trainer's ``--config.KEY=VALUE`` flags would set them: a keyword of
  ``model_kwargs``, ``data_kwargs`` or ``method_kwargs`` may be new, and a list stands for a
  tuple.

  Raises:
    ValueError: a key that is not a field, or a value of the wrong type for its field.
  """
  config = ml_collections.ConfigDict(config.to_dict())
  added = {field: {} for field in _KWARGS_FIELDS}
  for key, value in settings.items():
    field, _, rest = key.partition(".")
    if field in added and rest:
      added[field][rest] = value
      continue
    *sections, name = key.split(".")
    target = config
    try:
      for section in sections:
        target = target[section]
      target[name]  # pylint: disable=pointless-statement
    except (KeyError, TypeError):
      raise ValueError(f"{key!r} is not a field of the config.") from None
    if isinstance(target[name], tuple) and isinstance(value, list):
      value = tuple(value)
    target[name] = value
  for field, kwargs in added.items():
    _add_keywords(config, field, kwargs)
  return config


_COMMAND_LINE: list[str] = []


def command_line() -> str:
  """The arguments :func:`parse_flags` was given, ``--config.model_kwargs.*`` included: the
  line that reproduces the run (quoted for a shell)."""
  return shlex.join(_COMMAND_LINE)


def overridden_keys() -> list[str]:
  """The dotted keys the arguments :func:`parse_flags` was given set (``--config.KEY=VALUE``)."""
  return [m.group(1) for a in _COMMAND_LINE if (m := _CONFIG_KEY.match(a))]


def describe_config_error(error: Exception, argv: list[str]) -> str:
  """The one-paragraph message for a command line whose config could not be built.

  Args:
    error: what applying ``--config`` and its ``--config.*`` overrides raised.
    argv: the command line's arguments.

  Returns:
    For a config file that does not exist, how to name one; for an override of a field the config
    does not have, the field's closest names (``--config.lr``: ``--config.reference.lr`` or
    ``--config.micro_batch.lr``); otherwise the error's first line.
  """
  config_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  path = config_arg.partition(":")[0] if config_arg else None
  if path and not os.path.isfile(path):
    return _missing_file_message(path)
  overrides = [m.group(1) for a in argv if (m := _CONFIG_KEY.match(a))]
  if path:
    try:
      known = dotted_keys(load_config(config_arg))
    except ConfigFileError:  # the file itself is broken; say so below
      known = None
    if known is not None:
      for key in overrides:
        if key not in known:
          return unknown_field_message(key, path, known, flag=True)
  first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  return (f"The config {config_arg!r} or one of its --config.* overrides could not be applied: "
          f"{first_line}")


class ConfigFileError(ValueError):
  """A config file that does not exist or cannot be loaded; the message says which and why."""


def load_config(config_arg: str) -> ml_collections.ConfigDict:
  """The config a ``--config=PATH[:ARG]`` flag gives: ``PATH``'s ``get_config(ARG)``.

  Args:
    config_arg: a config file's path, optionally followed by ``:`` and its argument
      (``configs/default.py:smoke``).

  Returns:
    The config file's config, before any ``--config.*`` override.

  Raises:
    ConfigFileError: the file does not exist, loading it raised or exited (an unknown argument,
      a syntax error, ``sys.exit``), it returned no ``ConfigDict``, or it sets a field that
      :func:`base_config` does not have; one paragraph, the trainer's own message.
  """
  path, _, arg = config_arg.partition(":")
  if not os.path.isfile(path):
    raise ConfigFileError(_missing_file_message(path))
  try:
    spec = importlib.util.spec_from_file_location("pipejax_config_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg or None)
  except KeyboardInterrupt:
    raise
  # A SystemExit too: a file that calls sys.exit(0) would otherwise end the trainer with 0, the
  # code of a finished run, having run nothing.
  except BaseException as e:  # noqa: BLE001 - whatever the file raises, say it in one line
    detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
    kind = "" if isinstance(e, ValueError) else f"{type(e).__name__}: "
    if isinstance(e, SystemExit):
      kind, detail = "it called sys.exit", f"({e.code!r}) while loading"
    raise ConfigFileError(f"The config {config_arg!r} could not be loaded: {kind}{detail}") from e
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigFileError(
        f"The config {config_arg!r} could not be loaded: its get_config returned "
        f"{type(config).__name__}, not an ml_collections.ConfigDict. Build it on "
        "pipejax.config.base_config() (config = base_config(); config.FIELD = VALUE; return "
        "config), which gives every field its default and type.")
  unknown = unknown_fields(config)
  if unknown:
    raise ConfigFileError(unknown_field_message(unknown[0], path))
  return config


def _missing_file_message(path: str) -> str:
  return (f"The config file {path!r} does not exist. Give a path such as "
          "--config=configs/default.py (relative to the directory you run from); append :smoke "
          "for the quick variant.")


def _exit(message: str) -> NoReturn:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)
