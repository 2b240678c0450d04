r"""A byte-level transformer language model on the fortunes corpus, one block per stage, Adam.

    python scripts/train.py --config=configs/char_lm.py --workdir=runs/char_lm
    python scripts/train.py --config=configs/char_lm.py --config.method=nesterov_asyncpp \
        --config.model_kwargs.blocks=30 --workdir=runs/char_lm_32
    python scripts/train.py --config=configs/char_lm.py:smoke --workdir=/tmp/lm   # < 1 minute

Data: the Debian package ``fortunes`` (``apt-get install fortunes``; docs/lm.md), bytes as tokens,
one fortune in ten held out for validation; one micro-batch is one sequence of
``data_kwargs.context`` = 64 bytes (b = 1).
Model: causal pre-norm transformer, width 128, 4 heads, ``model_kwargs.blocks`` = 6 blocks:
blocks + 2 stages (embedding, one block each, final norm + output projection), 8 stages in all.
Recipe: AdamW (b1 0.9, b2 0.99, lr 1e-3, decoupled decay 0.01 on matrices and embeddings only),
stated directly at one sequence per step (reference.batch_size = 1, so no scaling rule applies),
cosine schedule over two thirds of an epoch of the training split (23,924 of its 35,887
sequences) with a warm-up of 0.05 of an epoch (7.5% of the run). This is the 8-stage recipe of
configs/studies/lm_depth.py.
The test loss is the validation split's mean next-byte cross-entropy in nats; bits per byte are
test_loss / ln 2 (docs/lm.md).
"""

from pipejax import config as configlib


def get_config(arg: str | None = None):
  config = configlib.base_config()
  config.dataset = "fortunes"
  config.data_kwargs = {"context": 64}
  config.model = "transformer_lm"
  config.model_kwargs = {"width": 128, "blocks": 6, "heads": 4, "layers_per_stage": 1}
  config.method = "pb_sc"
  config.optimizer = "adam"
  config.decay_mask = True
  config.micro_batch_size = 1
  config.reference.batch_size = 1
  config.reference.lr = 1e-3
  config.reference.momentum = 0.9
  config.reference.b2 = 0.99
  config.reference.weight_decay = 0.01
  config.epochs = 2 / 3  # 23,924 sequences of 64 bytes
  config.warmup_epochs = 0.05
  # K of Nesterov AsyncPP's learning-rate correction.
  config.method_kwargs = {"nesterov_asyncpp": {"anneal_epochs": 0.25}}
  config.ticks_per_chunk = 500
  config.eval_every_samples = 4000
  config.checkpoint_every_samples = 4000
  config.eval_batch_size = 64
  if arg == "smoke":
    config.data_kwargs = {"context": 32}
    config.model_kwargs = {"width": 32, "blocks": 2, "heads": 2, "layers_per_stage": 1}
    config.reference.lr = 1e-3
  config = configlib.apply_variant(config, arg)
  if arg == "smoke":
    config.max_train_examples = 1500
  return config
