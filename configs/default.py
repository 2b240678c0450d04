r"""The embedded default: Fashion-MNIST, an MLP with one weight layer per stage, PB + SC + LWP at
b=1.

    python scripts/train.py --config=configs/default.py --workdir=runs/default
    python scripts/train.py --config=configs/default.py:smoke --workdir=/tmp/smoke   # < 1 minute

Data: the Debian package dataset-fashion-mnist (/usr/share/datasets/fashion-mnist/).
Model: 784-256-128-10 MLP, three stages (one Dense + ReLU each), micro-batch 1.
Recipe: batch 128, lr 0.1, momentum 0.9, weight decay 5e-5, converted to micro-batch 1 by the
scaling rules of docs/design.md §4 (momentum 0.9^(1/128), the same displacement per sample); cosine
schedule over 10 epochs.
Learning rates: --config.reference.lr is the batch-128 recipe's (0.1); --config.micro_batch.lr is
the rate that trains at micro-batch 1 (unset: converted from the recipe, 6.4e-6 here). Change the
first to retune the recipe; set the second only to override the conversion.
Measured (2-core CPU, no accelerator, other work paused; this config as is): test accuracy
89.4% after 10 epochs, 200 s of training (about 3000 samples/s; about half that time on other
machines of this kind). The README's table compares plain PB and SGD.
"""

from pipejax import config as configlib


def get_config(arg: str | None = None):
  config = configlib.base_config()
  config.dataset = "fashion_mnist_idx"
  config.model = "mlp"
  config.model_kwargs = {"hidden": (256, 128), "layers_per_stage": 1}
  config.method = "pb_sc_lwp"
  config.micro_batch_size = 1
  config.reference.weight_decay = 5e-5
  config.epochs = 10.0
  return configlib.apply_variant(config, arg)
