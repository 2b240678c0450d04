"""The training config's fields and defaults, importable without JAX.

Config files (``configs/*.py``) build on :func:`base_config`; this module needs only
ml_collections, so reading a config (``scripts/study.py`` reads dozens) never imports JAX or orbax.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict


def base_config() -> ml_collections.ConfigDict:
  """Every field ``train_and_evaluate`` reads, with defaults; config files change what they need."""
  config = ml_collections.ConfigDict()
  config.dataset = "fashion_mnist_idx"  # a name of pipejax.data.load
  config.data_dir = ""  # empty: the data set's default location
  config.image_size = 0  # 0: the data set's native size (ImageNet: resize to this)
  config.max_train_examples = 0  # 0: all; else the first N (quick runs)
  config.max_test_examples = 0
  config.augment = False  # the data set's standard train-time augmentation

  config.model = "mlp"  # a name of pipejax.models.build
  config.model_kwargs = ml_collections.ConfigDict({"layers_per_stage": 1})

  config.method = "pb_sc_lwp"  # a name of pipejax.methods.METHODS
  config.micro_batch_size = 1
  config.micro_batches = 1  # M of the synchronous mode (method 'sync')

  # The recipe as it would run with ordinary mini-batches; converted to the micro-batch trained.
  config.reference = ml_collections.ConfigDict(
      {"batch_size": 128, "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4})
  config.lr = config_dict.placeholder(float)  # set any of these three to override the conversion
  config.momentum = config_dict.placeholder(float)
  config.weight_decay = config_dict.placeholder(float)
  config.schedule = "cosine"  # or "constant"; kept in samples, converted to steps
  config.epochs = 10.0
  config.warmup_epochs = 0.2
  config.pipemare_anneal_epochs = 1.0
  config.seed = 0

  config.ticks_per_chunk = 2000  # ticks per lax.scan call; checkpoints fall between chunks
  config.eval_every_samples = 60000
  config.checkpoint_every_samples = 60000
  config.keep_checkpoints = 3
  # A workdir resumes only with the recipe it was trained with; True accepts changed fields (e.g.
  # a lower lr after a divergence) and records them in workdir/config_changes.jsonl.
  config.allow_changes_on_resume = False
  config.eval_batch_size = 1000
  # Devices: `stage` devices each own a contiguous group of stages; `data` replicas average
  # gradients. Checkpoints hold the logical state, so a run can resume on another mesh.
  # balance: 'params' (parameter counts) or 'measured' (timed stage work); an explicit partition,
  # ((start, stop), ...) per stage device, overrides both.
  config.mesh = ml_collections.ConfigDict({"stage": 1, "data": 1, "partition": (),
                                           "balance": "params"})
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
  config.ticks_per_chunk = max(1, 250 // config.micro_batch_size)
  config.eval_every_samples = 1000
  config.checkpoint_every_samples = 1000
  if arg == "tiny":
    config.max_train_examples = 0
    config.max_test_examples = 0
    for key, value in tiny.items():  # replace whole fields (model_kwargs), do not merge them
      config[key] = value
  return config
