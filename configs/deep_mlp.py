r"""Fashion-MNIST through a deep residual MLP, one weight layer per stage: staleness at depth.

    python scripts/train.py --config=configs/deep_mlp.py --workdir=runs/deep32
    python scripts/train.py --config=configs/deep_mlp.py --config.model_kwargs.depth=8 \
        --config.method=pb --workdir=runs/deep8_pb
    python scripts/train.py --config=configs/deep_mlp.py:smoke --workdir=/tmp/deep_smoke

``--config.model_kwargs.depth`` is the number of pipeline stages (stem, depth - 2 pre-norm
residual blocks of width 128, head; delays up to 2(depth - 1)). The recipe is the default
config's (batch 128, lr 0.1, momentum 0.9, weight decay 5e-5) converted to micro-batch 1 by the
scaling rules, over one epoch of Fashion-MNIST with a cosine schedule: short enough that a study
can run every method at several depths on a 2-core CPU (docs/study.md), long enough to separate
the methods. The studies under configs/studies/ build on this config.
"""

from pipejax import config as configlib


def get_config(arg: str | None = None):
  config = configlib.base_config()
  config.dataset = "fashion_mnist_idx"
  config.model = "residual_mlp"
  config.model_kwargs = {"depth": 32, "width": 128, "expansion": 1, "normalization": "layer",
                         "layers_per_stage": 1}
  config.method = "pb_sc_lwp"
  config.micro_batch_size = 1
  config.reference.weight_decay = 5e-5
  config.epochs = 1.0
  config.warmup_epochs = 0.05
  config.ticks_per_chunk = 2000
  config.eval_every_samples = 20000
  config.checkpoint_every_samples = 20000
  if arg == "smoke":
    config.model_kwargs.depth = 6
  return configlib.apply_variant(config, arg)
