"""The input side of training: data sets as random-access sources, and resumable chunk streams.

``train, test = load(name)`` gives two :class:`Source` splits; ``DataStream(train, b, seed,
augment=train.default_augment).next_chunk(ticks)`` gives ``(ticks, b, *example_shape)`` float32
inputs and ``(ticks, b)`` int32 labels for one ``lax.scan`` of the pipeline, and its
``get_state()``/``set_state()`` position goes into the checkpoint; ``eval_batches(test, b)`` walks
the test split in order.
"""

from pipejax.data import fingerprint
from pipejax.data.errors import DataError
from pipejax.data.registry import AUGMENTED_NAMES, NAMES, load
from pipejax.data.source import ArraySource, Augment, Normalization, Source, Subset
from pipejax.data.stream import DataStream, augment_rng, epoch_permutation, eval_batches

__all__ = [
    "AUGMENTED_NAMES", "ArraySource", "Augment", "DataError", "DataStream", "NAMES",
    "Normalization", "Source", "Subset", "augment_rng", "epoch_permutation", "eval_batches",
    "fingerprint", "load",
]
