r"""The embedded default: Fashion-MNIST, an MLP with one weight layer per stage, PB + SC + LWP at b=1.

    python scripts/train.py --config=configs/default.py --workdir=runs/default
    python scripts/train.py --config=configs/default.py:smoke --workdir=/tmp/smoke   # < 1 minute

Data: the Debian package dataset-fashion-mnist (/usr/share/datasets/fashion-mnist/).
Expected result and time: see the README's table of example runs (measured on a 2-core CPU).
The reference recipe (batch 128, lr 0.1, momentum 0.9) is converted to micro-batch 1 by the
scaling rules of DESIGN.md §3 (momentum 0.9^(1/128), the same displacement per sample).
"""

import ml_collections
from ml_collections import config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.dataset = "fashion_mnist_idx"
  config.data_dir = ""  # empty: the data set's default location
  config.image_size = 0  # 0: the data set's native size
  config.max_train_examples = 0  # 0: all
  config.max_test_examples = 0

  config.model = "mlp"
  config.model_kwargs = ml_collections.ConfigDict({"hidden": (256, 128), "layers_per_stage": 1})

  config.method = "pb_sc_lwp"
  config.micro_batch_size = 1
  config.micro_batches = 1  # M of the synchronous mode (method 'sync')

  # The recipe as it would be run with ordinary mini-batches; converted to micro_batch_size.
  config.reference = ml_collections.ConfigDict(
      {"batch_size": 128, "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-5})
  config.lr = config_dict.placeholder(float)  # set to override the converted value
  config.momentum = config_dict.placeholder(float)
  config.weight_decay = config_dict.placeholder(float)
  config.schedule = "cosine"
  config.epochs = 10.0
  config.warmup_epochs = 0.2
  config.pipemare_anneal_epochs = 1.0
  config.augment = False
  config.seed = 0

  config.ticks_per_chunk = 2000
  config.eval_every_samples = 60000
  config.checkpoint_every_samples = 60000
  config.keep_checkpoints = 3
  config.eval_batch_size = 1000
  config.mesh = ml_collections.ConfigDict({"stage": 1, "data": 1})

  if arg == "smoke":
    config.max_train_examples = 3000
    config.max_test_examples = 1000
    config.epochs = 1.0
    config.ticks_per_chunk = 250
    config.eval_every_samples = 1500
    config.checkpoint_every_samples = 1000
  elif arg:
    raise ValueError(f"Unknown config argument {arg!r}; the only one is 'smoke'.")
  return config
