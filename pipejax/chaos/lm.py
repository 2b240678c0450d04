"""The language model's path under the same trials: the char LM's smoke config, in one process
and over two.

The trials are those of :mod:`~pipejax.chaos.trainer` and :mod:`~pipejax.chaos.two_process`,
with the transformer LM on the fortunes corpus (configs/char_lm.py) in place of the image model:
its embedding, attention blocks and AdamW states go through the same kills and damaged
checkpoints, and a rerun must end bit-exact or with a message naming the damaged step.
"""

import os

from pipejax.chaos import ROOT
from pipejax.chaos.trainer import TrainerCase
from pipejax.chaos.two_process import TwoProcessCase

# 300 sequences of 32 bytes at b = 1 in chunks of 50 ticks: a checkpoint every 100, an
# evaluation every 150 (on 64 validation sequences), so a kill falls between and during saves.
LM = TrainerCase(
    "lm", f"{os.path.join(ROOT, 'configs', 'char_lm.py')}:smoke",
    ("--config.max_train_examples=300", "--config.max_test_examples=64",
     "--config.ticks_per_chunk=50", "--config.checkpoint_every_samples=100",
     "--config.eval_every_samples=150"),
    half_way="[150/300 samples")

# Fields a process of the LM may be started with by mistake: each process validates its own config
# first, so the wrong values stay valid ones (another method could be refused by Adam alone).
LM_MISMATCHES = (("seed", "1"), ("reference.lr", "0.002"), ("epochs", "2.0"))

# The LM over two processes, data parallel: one CPU device each, a micro-batch of 2 sequences
# split between them.
LM_DATA = TwoProcessCase(
    "two processes, lm data", LM,
    ("--config.mesh.data=2", "--config.mesh.stage=1", "--config.micro_batch_size=2",
     "--config.max_train_examples=200", "--config.max_test_examples=32",
     "--config.ticks_per_chunk=25", "--config.checkpoint_every_samples=100",
     "--config.eval_every_samples=200"),
    devices_per_process=1, mismatches=LM_MISMATCHES)

# Its stages over the two processes (one device each): the pipeline's registers then cross
# processes. Not in scripts/chaos.py's default round; --cases=lm_stages runs it.
LM_STAGES = TwoProcessCase(
    "two processes, lm stages", LM,
    ("--config.mesh.data=1", "--config.mesh.stage=2", "--config.max_train_examples=200",
     "--config.max_test_examples=32", "--config.ticks_per_chunk=25",
     "--config.checkpoint_every_samples=100", "--config.eval_every_samples=200"),
    devices_per_process=1, mismatches=LM_MISMATCHES)
