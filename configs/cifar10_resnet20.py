r"""CIFAR-10 ResNet-20 (GroupNorm), one conv per stage (the paper's fine-grained setting), b=1.

    python scripts/train.py --config=configs/cifar10_resnet20.py --workdir=runs/r20 \
        --config.data_dir=~/tensorflow_datasets
    python scripts/train.py --config=configs/cifar10_resnet20.py:smoke --workdir=/tmp/r20

Data: tfds 'cifar10' in array_record format. A machine with internet and TensorFlow downloads and
builds it into --config.data_dir on the first run; elsewhere build it with `tfds build cifar10
--file_format=array_record --data_dir=DIR` on a machine that can, and copy DIR here
(pipejax/data/tfds_source.py). Not run here (no data on this machine); the 'tiny' variant (ResNet-8
of width 4, one conv per stage) is what the tests run on tfds mock data. The recipe is
He et al.'s (batch 128, lr 0.1, momentum 0.9, weight decay 5e-4) converted to micro-batch 1.
Kosson et al. report ResNet-20 with PB + SC + LWP at batch 1 matching SGD (about 91-92%). On a GPU
the run takes hours; on this 2-core CPU it is impractical (the 'smoke' variant runs in < 1 minute).
"""

from pipejax import config as configlib


def get_config(arg: str | None = None):
  config = configlib.base_config()
  config.dataset = "cifar10"
  config.augment = True
  config.model = "cifar_resnet20"
  config.model_kwargs = {"layers_per_stage": 1, "width": 16}
  config.method = "pb_sc_lwp"
  config.reference.weight_decay = 5e-4
  config.epochs = 160.0
  config.warmup_epochs = 1.0
  config.eval_every_samples = 50000
  config.checkpoint_every_samples = 50000
  # tiny: the same network code with one block per group (ResNet-8), one conv per stage.
  return configlib.apply_variant(config, arg, tiny={
      "model_kwargs": {"depth": 8, "layers_per_stage": 1, "width": 4},
      "ticks_per_chunk": 64, "eval_batch_size": 8})
