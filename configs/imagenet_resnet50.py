r"""ImageNet ResNet-50 (v1.5, GroupNorm), one conv per stage, micro-batch 1 on a pipeline of 54
stages.

    python scripts/train.py --config=configs/imagenet_resnet50.py --workdir=runs/r50 \
        --config.data_dir=/data/tensorflow_datasets --config.mesh.stage=8
    python scripts/train.py --config=configs/imagenet_resnet50.py:tiny --workdir=/tmp/r50

Data: tfds 'imagenet2012' prepared in array_record format (manual download of the ILSVRC tars;
see pipejax/data/tfds_source.py). Not run here (no data, no accelerator); Kosson et al. report
PB + SC + LWP at batch 1 within a few tenths of a percent of SGD's ~76% top-1. The 'tiny'
variant (width 4, one block per group, 32x32 images) runs in the tests on tfds mock data.
"""

from pipejax import config as configlib


def get_config(arg: str | None = None):
  config = configlib.base_config()
  config.dataset = "imagenet2012"
  config.image_size = 224
  config.augment = True
  config.model = "resnet50"
  config.model_kwargs = {"layers_per_stage": 1, "width": 64}
  config.method = "pb_sc_lwp"
  config.reference = {"batch_size": 256, "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}
  config.epochs = 90.0
  config.warmup_epochs = 5.0
  config.eval_every_samples = 1281167
  config.checkpoint_every_samples = 100000
  config.eval_batch_size = 250
  return configlib.apply_variant(config, arg, tiny={
      "image_size": 32, "ticks_per_chunk": 64, "eval_batch_size": 4,
      "model_kwargs": {"layers_per_stage": 4, "width": 4, "blocks_per_group": (1, 1, 1, 1),
                       "norm_groups": 2}})
