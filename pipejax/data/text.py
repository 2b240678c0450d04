"""A byte-level text corpus for language models: the fortune files of Debian's ``fortunes``.

``apt-get install fortunes`` puts about 2.6 MB of plain-text fortunes (quotations, jokes, poems,
definitions: written by people, collected since 4.2BSD) in ``/usr/share/games/fortunes/``, one
file per topic, the fortunes of a file separated by lines holding only ``%`` (docs/lm.md records
the origin and licence).

Tokens are bytes (vocabulary 256). The split is fixed by the corpus alone: the files are read in
sorted order, and every ``validation_every``-th fortune (counting across files) goes to the
validation split, so both splits cover every topic. Files with identical bytes are read once,
and a validation fortune whose text is also a training fortune is left out, so the splits share
no text. Each split is its fortunes joined with their
``%`` separator lines, cut into non-overlapping windows of ``context + 1`` bytes that overlap by
one: window ``i`` is the example ``tokens[i T : i T + T]`` with the per-token labels
``tokens[i T + 1 : i T + T + 1]`` (the next byte of each position). A window is the unit the
:class:`pipejax.data.DataStream` shuffles, so the stream stays seeded and exactly resumable as the
image streams are.
"""

from __future__ import annotations

import hashlib
import os

from absl import logging
import numpy as np

from pipejax.data.errors import DataError
from pipejax.data.source import Normalization, Source

DEFAULT_DIR = "/usr/share/games/fortunes"
VOCAB_SIZE = 256  # bytes
SEPARATOR = b"\n%\n"
DEFAULT_CONTEXT = 256
MIN_CORPUS_BYTES = 1_000_000  # the Debian package holds about 2.6 MB; less means a partial copy


class TextSource(Source):
  """Next-byte prediction windows over one byte string (a split of a corpus).

  Examples are ``(context,)`` byte values (the stream hands them out as float32, and the model's
  embedding reads them back as integers); labels are the ``(context,)`` next bytes, int32.

  Args:
    tokens: the split's bytes, a ``bytes`` object or a uint8 array.
    context: tokens per example ``T``.
    name: data set and split, for messages.
  """

  num_classes = VOCAB_SIZE

  def __init__(self, tokens, context: int, name: str):
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context < 1:
      raise DataError(f"{name}: context must be a positive number of tokens; got {context!r}.")
    self.tokens = np.frombuffer(tokens, np.uint8) if isinstance(tokens, bytes) else \
        np.asarray(tokens, np.uint8)
    self.context = int(context)
    if len(self.tokens) < self.context + 1:
      raise DataError(f"{name}: {len(self.tokens)} bytes cannot fill one example of context "
                      f"{self.context} (it needs {self.context + 1}); use a smaller context.")
    self.name = name
    self.example_shape = (self.context,)
    self.label_shape = (self.context,)
    self.normalization = Normalization.identity(self.context)
    self._offsets = np.arange(self.context)

  def __len__(self) -> int:
    return (len(self.tokens) - 1) // self.context

  def raw(self, index: int) -> tuple[np.ndarray, np.ndarray]:
    examples, labels = self.take([index])
    return examples[0], labels[0]

  def take(self, indices) -> tuple[np.ndarray, np.ndarray]:
    indices = np.asarray(indices, np.int64).reshape(-1)
    if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
      raise IndexError(f"index out of range for {self.name} ({len(self)} windows)")
    positions = indices[:, None] * self.context + self._offsets
    return self.tokens[positions], self.tokens[positions + 1].astype(np.int32)

  def decode(self, tokens) -> str:
    """The text of a sequence of byte tokens (invalid UTF-8 shown as replacement characters)."""
    return bytes(np.asarray(tokens, np.uint8).tolist()).decode("utf-8", errors="replace")


def _missing_message(data_dir: str, what: str) -> str:
  return (f"The fortunes text corpus is not installed ({what}): install the Debian package with "
          f"`apt-get install fortunes` (it puts the fortune files in {DEFAULT_DIR}/), or point "
          "data_dir (--config.data_dir) at a directory of fortune files.")


def fortune_files(data_dir: str) -> list[str]:
  """The corpus files in ``data_dir``: regular files, not the ``.dat`` indexes or links."""
  if not os.path.isdir(data_dir):
    raise DataError(_missing_message(data_dir, f"no directory {data_dir}"))
  files = sorted(
      os.path.join(data_dir, name) for name in os.listdir(data_dir)
      if not name.endswith(".dat") and not os.path.islink(os.path.join(data_dir, name))
      and os.path.isfile(os.path.join(data_dir, name)))
  if not files:
    raise DataError(_missing_message(data_dir, f"no fortune files in {data_dir}"))
  return files


def split_fortunes(data_dir: str, validation_every: int = 10) -> tuple[bytes, bytes]:
  """The corpus's (train, validation) bytes: every ``validation_every``-th fortune validates."""
  if isinstance(validation_every, bool) or not isinstance(validation_every, int) or \
      validation_every < 2:
    raise DataError(f"validation_every must be an int >= 2 (one fortune in that many "
                    f"validates); got {validation_every!r}.")
  fortunes = []
  for text in _distinct_files(fortune_files(data_dir)):
    # A file ends with its last separator; an empty piece is no fortune.
    fortunes.extend(piece for piece in (b"\n" + text).split(SEPARATOR) if piece.strip())
  total = sum(len(piece) + len(SEPARATOR) for piece in fortunes)
  if total < MIN_CORPUS_BYTES:
    raise DataError(_missing_message(
        data_dir, f"only {total} bytes of fortunes in {data_dir}, expected about 2.6 MB"))
  splits = ([], [])
  for k, piece in enumerate(fortunes):
    splits[k % validation_every == validation_every - 1].append(piece.lstrip(b"\n") + SEPARATOR)
  return b"".join(splits[0]), b"".join(_not_in(splits[1], splits[0]))


def _distinct_files(paths: list[str]):
  """The bytes of each file, once per content: a copy whose ``NAME.u8`` links became files holds
  every fortune twice, and its second copies would land in the validation split too."""
  first_with = {}
  for path in paths:
    with open(path, "rb") as f:
      text = f.read()
    digest = hashlib.sha256(text).digest()
    if digest in first_with:
      logging.warning("Fortune file %s holds the same bytes as %s (a copy that followed a link, "
                      "such as NAME.u8 -> NAME); reading them once.", path, first_with[digest])
      continue
    first_with[digest] = path
    yield text


def _not_in(held_out: list[bytes], trained: list[bytes]) -> list[bytes]:
  """The held-out fortunes that are not also training fortunes (some appear in two files): a
  validation split shares no text with training."""
  training = set(trained)
  kept = [piece for piece in held_out if piece not in training]
  if len(kept) < len(held_out):
    logging.info("%d of %d validation fortunes also appear among the training fortunes (in "
                 "another file); they are left out of validation.", len(held_out) - len(kept),
                 len(held_out))
  return kept


def load_fortunes(data_dir: str | os.PathLike | None = None, context: int = DEFAULT_CONTEXT,
                  validation_every: int = 10) -> tuple[TextSource, TextSource]:
  """The fortunes corpus as ``(train, validation)`` :class:`TextSource` splits.

  Args:
    data_dir: directory of the fortune files; default ``/usr/share/games/fortunes``.
    context: bytes per example (the model's sequence length).
    validation_every: one fortune in this many goes to the validation split (default 10%).

  Raises:
    DataError: if the corpus is missing or incomplete (the message says how to install it).
  """
  data_dir = os.fspath(data_dir) if data_dir is not None else DEFAULT_DIR
  train, validation = split_fortunes(data_dir, validation_every)
  sources = (TextSource(train, context, "fortunes:train"),
             TextSource(validation, context, "fortunes:validation"))
  # Named in a checkpoint's data fingerprint (pipejax.data.fingerprint): a resume on another copy
  # of the corpus says which files differ.
  files = {os.path.basename(path): os.path.getsize(path) for path in fortune_files(data_dir)}
  for source in sources:
    source.files = files
  return sources
