"""A seeded fuzz of three boundaries, each against an oracle written here: a preset's
hyperparameters (also through ``optax.inject_hyperparams``), a config's annealing lengths and the
staleness table's settings, and a study's run identities. Every value is taken or refused by its
own error class, never a traceback of another kind and never a silent wrong run."""

import math
import random
import string

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipejax import methods
from pipejax.analysis import staleness
from pipejax.study import spec as study_lib
from pipejax.study.spec import Study, StudyError
from pipejax.train import config_checks

from tests.helpers import digits_config

SEED = 20260
# Each number-valued field every preset takes, and its interval: (low, high, high_open).
RANGES = {"learning_rate": (0.0, math.inf, True), "momentum": (0.0, 1.0, True),
          "weight_decay": (0.0, math.inf, True), "b2": (0.0, 1.0, True),
          "eps": (0.0, math.inf, True)}
NUMBERS = [0.0, 0.5, 0.9, 0.999, 1.0, 1.5, -0.1, -1e-9, 1e-12, 3.0, math.inf, -math.inf,
           math.nan, 0, 1, 2]


def _number_in_range(value, low, high, high_open):
  return math.isfinite(value) and low <= value and (value < high if high_open else value <= high)


def _as_form(rng, number):
  """``number`` as a Python float, a NumPy scalar or a 0-d jax array of float32."""
  form = rng.choice(["python", "numpy", "jax"])
  if form == "numpy":
    return np.float64(number)
  if form == "jax":
    return jnp.asarray(number, jnp.float32)
  return number


def _hyperparameter_case(rng):
  """A value for a random field, and whether the preset must take it (the oracle)."""
  field = rng.choice(sorted(RANGES))
  low, high, high_open = RANGES[field]
  kind = rng.choice(["number"] * 6 + ["schedule", "none", "text", "bool", "vector"])
  if kind == "number":
    number = rng.choice(NUMBERS)
    value = _as_form(rng, number)
    # float32 is what the array holds: 0.999 stays below 1, 1e-12 stays above 0.
    held = float(np.float32(number)) if isinstance(value, jax.Array) else number
    return field, value, _number_in_range(held, low, high, high_open)
  if kind == "schedule":
    return field, optax.constant_schedule(0.1), field == "learning_rate"
  return field, {"none": None, "text": "0.1", "bool": True, "vector": jnp.ones(2)}[kind], False


def _preset_kwargs(name):
  preset = methods.preset_of(name)
  return {"optimizer": preset.optimizers[-1]} | (
      {"num_stages": 2} if "num_stages" in preset.fields() else {})


def test_fuzz_every_preset_takes_or_refuses_each_hyperparameter_as_the_oracle_says():
  rng = random.Random(SEED)
  for case in range(600):
    name = rng.choice(methods.METHODS)
    field, value, valid = _hyperparameter_case(rng)
    kwargs = {"learning_rate": 0.1, **_preset_kwargs(name), field: value}
    if field == "b2" and kwargs["optimizer"] != "adam":
      continue
    try:
      methods.make_method(name, **kwargs)
      taken = True
    except methods.MethodError as error:
      assert field in str(error), (case, name, field, value, error)
      taken = False
    assert taken == valid, (case, name, field, value)


def test_fuzz_inject_hyperparams_checks_each_value_at_init():
  rng = random.Random(SEED + 1)
  params = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
  for case in range(24):
    name = rng.choice(methods.METHODS)
    momentum = rng.choice([0.0, 0.5, 0.9, 0.99, 1.0, 1.2, -0.5])
    learning_rate = rng.choice([0.0, 0.01, -0.01])

    def build(learning_rate, momentum, name=name):
      return methods.make_method(name, learning_rate=learning_rate, momentum=momentum,
                                 **_preset_kwargs(name)).optimizer(2)
    tx = optax.inject_hyperparams(build, hyperparam_dtype=jnp.float32)(
        learning_rate=learning_rate, momentum=momentum)
    valid = 0 <= momentum < 1 and learning_rate >= 0
    try:
      tx.init(params)
      taken = True
    except methods.MethodError:
      taken = False
    assert taken == valid, (case, name, learning_rate, momentum)


ANNEALING_VALUES = [0, 0.0, 0.25, 1, 1.0, 2.5, 1e6, -1, -0.5, math.inf, -math.inf, math.nan, None,
                    True, False, "1", "0.5", [1], {"a": 1}]


def test_fuzz_annealing_lengths_in_method_kwargs():
  rng = random.Random(SEED + 2)
  for case in range(30):
    key = rng.choice(["anneal_epochs", "anneal_fraction"])
    method = rng.choice(["pipemare", "nesterov_asyncpp", "pb_muon_delay_warmup"])
    value = rng.choice(ANNEALING_VALUES)
    config = digits_config(method=method)
    if methods.preset_of(method).optimizers == ("adam",):
      config.optimizer = "adam"
    config.method_kwargs = {method: {key: value}}
    high = 1.0 if key == "anneal_fraction" else math.inf
    valid = (isinstance(value, (int, float)) and not isinstance(value, bool) and
             math.isfinite(value) and 0 <= value <= high)
    try:
      config_checks.check_fields(config)
      taken = True
    except config_checks.ConfigError as error:
      assert key in str(error) and "\n" not in str(error), (case, error)
      taken = False
    assert taken == valid, (case, method, key, value)


def test_fuzz_staleness_settings():
  rng = random.Random(SEED + 3)
  integers = [-1, 0, 1, 2, 3, 4, 7, 64, 4000, 2**31, 2**31 + 1]
  for case in range(500):
    settings = {"train_samples": rng.choice(integers), "micro_batch": rng.choice(integers),
                "epochs": rng.choice(integers), "seeds": rng.choice([[], [0], [0, 1], [-1],
                                                                     [2**32]]),
                "learning_rate": rng.choice([0.0, 0.003, -1.0, math.nan, math.inf]),
                "momentum": rng.choice([0.0, 0.9, 1.0, -0.1])}
    stages = rng.choice(integers)
    positive = all(settings[k] >= 1 for k in ("micro_batch", "epochs")) and stages >= 1
    updates = settings["epochs"] * (settings["train_samples"] // settings["micro_batch"]) \
        if positive else 0
    valid = (positive and 1 <= updates and stages <= updates and
             bool(settings["seeds"]) and all(0 <= s < 2**32 for s in settings["seeds"]) and
             math.isfinite(settings["learning_rate"]) and settings["learning_rate"] >= 0 and
             0 <= settings["momentum"] < 1)
    try:
      assert staleness.check_settings(stages, **settings) == updates
      taken = True
    except staleness.StalenessError:
      taken = False
    assert taken == valid, (case, stages, settings)


ALPHABET = string.ascii_letters[:4] + string.digits[:3] + "/_ %,=.()-\t\u00e9\u2028"


def _random_value(rng):
  kind = rng.choice(["text", "text", "int", "float", "tuple", "long"])
  if kind == "int":
    return rng.randint(-3, 3)
  if kind == "float":
    return rng.choice([0.1, 1.0, 1e-3, 2.5])
  if kind == "tuple":
    return tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 3)))
  length = rng.randint(150, 400) if kind == "long" else rng.randint(0, 6)
  return "".join(rng.choice(ALPHABET) for _ in range(length))


def _old_run_id(overrides):
  """The id before escaping, which ordinary values must keep."""
  parts = [f"{k}={study_lib.format_value(overrides[k])}" for k in sorted(overrides)]
  return ",".join(parts).replace("/", "_").replace(" ", "")


def test_fuzz_run_identities_are_injective_fit_the_file_system_or_are_refused():
  rng = random.Random(SEED + 4)
  keys = ["data_dir", "seed", "reference.lr", "model_kwargs.hidden"]
  by_id, names = {}, {}
  for case in range(1500):
    overrides = {k: _random_value(rng) for k in rng.sample(keys, rng.randint(1, 3))}
    rid = study_lib.run_id(overrides)
    identity = study_lib.key_of(overrides)
    name = study_lib.directory_name(rid)
    assert len(name.encode()) <= study_lib.NAME_MAX and "/" not in name and name not in (".", "..")
    assert names.setdefault(name, rid) == rid, (case, name)  # one directory per id
    text = _old_run_id(overrides)
    if not any(c in text for c in "%\t\u2028") and text == ",".join(
        f"{k}={study_lib.format_value(overrides[k])}" for k in sorted(overrides)):
      assert rid == text, (case, overrides)  # an ordinary value keeps its id
    if by_id.setdefault(rid, (identity, overrides))[0] != identity:
      # A collision the escape cannot undo (a ',' or '=' inside a value, 1 beside '1'):
      # the study refuses to be made with both points.
      other = by_id[rid][1]
      with pytest.raises(StudyError, match="would have one run id"):
        Study(name="fuzz", config="c.py", grids=[{k: (v,) for k, v in other.items()},
                                                 {k: (v,) for k, v in overrides.items()}])
