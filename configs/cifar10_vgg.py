r"""CIFAR-10 VGG-11 (GroupNorm), one conv per stage, b=1.

    python scripts/train.py --config=configs/cifar10_vgg.py --workdir=runs/vgg \
        --config.data_dir=~/tensorflow_datasets
    python scripts/train.py --config=configs/cifar10_vgg.py:smoke --workdir=/tmp/vgg

Data as in configs/cifar10_resnet20.py (tfds 'cifar10', array_record). Not run here (no data on
this machine); the 'tiny' variant runs in the tests on tfds mock data.
"""

from pipejax import config as configlib


def get_config(arg: str | None = None):
  config = configlib.base_config()
  config.dataset = "cifar10"
  config.augment = True
  config.model = "vgg"
  config.model_kwargs = {"config": "vgg11", "layers_per_stage": 1}
  config.method = "pb_sc_lwp"
  config.reference.lr = 0.05
  config.reference.weight_decay = 5e-4
  config.epochs = 160.0
  config.warmup_epochs = 1.0
  config.eval_every_samples = 50000
  config.checkpoint_every_samples = 50000
  return configlib.apply_variant(config, arg, tiny={
      "model_kwargs": {"config": (4, "M", 8, "M"), "layers_per_stage": 1},
      "ticks_per_chunk": 64, "eval_batch_size": 8})
