r"""Fashion-MNIST through ResNet-20 (GroupNorm), one conv per stage: the paper's CIFAR-10 setting.

    python scripts/train.py --config=configs/fashion_resnet20.py --workdir=runs/fresnet20
    python scripts/train.py --config=configs/fashion_resnet20.py:smoke --workdir=/tmp/fr20

ResNet-20 at 28x28x1 is 20 stages at ``layers_per_stage=1`` (stem, 18 convs, head; delays up to
38), micro-batch 1, He et al.'s recipe (batch 128, lr 0.1, momentum 0.9, weight decay 5e-4)
converted by the scaling rules. On a 2-core CPU the convolutions make it the slowest config of
the project: 20000 samples (a third of an epoch) by default, so that the depth study's ResNet
rows (configs/studies/resnet.py) fit in a session.
"""

from pipejax import config as configlib


def get_config(arg: str | None = None):
  config = configlib.base_config()
  config.dataset = "fashion_mnist_idx"
  config.model = "cifar_resnet20"
  config.model_kwargs = {"layers_per_stage": 1, "width": 16, "normalization": "group"}
  config.method = "pb_sc_lwp"
  config.micro_batch_size = 1
  config.reference.weight_decay = 5e-4
  config.max_train_examples = 20000
  config.epochs = 1.0
  config.warmup_epochs = 0.05
  config.ticks_per_chunk = 1000
  config.eval_every_samples = 10000
  config.checkpoint_every_samples = 10000
  if arg == "smoke":
    config.model_kwargs = {"layers_per_stage": 1, "width": 4, "normalization": "group"}
  return configlib.apply_variant(config, arg)
