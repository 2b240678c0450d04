"""A byte-level text corpus for language models: the fortune files of Debian's ``fortunes``.

``apt-get install fortunes`` puts about 2.6 MB of plain-text fortunes (quotations, jokes, poems,
definitions: written by people, collected since 4.2BSD) in ``/usr/share/games/fortunes/``, one
file per topic, the fortunes of a file separated by lines holding only ``%`` (docs/lm.md records
the origin and licence).

Tokens are bytes (vocabulary 256). :func:`read_fortunes` is the one place that reads the corpus:
it skips hidden files, refuses binary ones by name, follows links (reading identical files once)
and makes every line end ``\\n``. The split is fixed by each fortune's text alone
(:func:`held_out`): one in ``validation_every`` validates, by the SHA-256 of its text, so a file
added or removed moves no other fortune between the splits, and a text found in two files lands
in one split. A topic (a file) with two fortunes of its own or more is in both splits
(:func:`split_corpus`). Each split is its distinct fortunes joined with their
``%`` separator lines, cut into non-overlapping windows of ``context + 1`` bytes that overlap by
one: window ``i`` is the example ``tokens[i T : i T + T]`` with the per-token labels
``tokens[i T + 1 : i T + T + 1]`` (the next byte of each position). A window is the unit the
:class:`pipejax.data.DataStream` shuffles, so the stream stays seeded and exactly resumable as the
image streams are.
"""

from __future__ import annotations

import collections
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A directory of fortune files as :func:`read_fortunes` read it.

  Attributes:
    topics: each topic file's name (sorted) and its fortunes in file order, each fortune its
      normalised text: ``\\n`` line ends, no newline at either end, no ``%`` line.
    files: each file read and its size in bytes (a data fingerprint names them on a resume).
  """
  topics: dict[str, list[bytes]]
  files: dict[str, int]


# Control characters that text holds: tab, the line ends, form feed, backspace and bell (both in
# Debian's fortunes, for overstrikes and beeps) and escape.
_TEXT_CONTROLS = b"\t\n\v\f\r\x07\x08\x1b"
_OTHER_CONTROLS = bytes(c for c in range(32) if c not in _TEXT_CONTROLS) + b"\x7f"


_BOM = b"\xef\xbb\xbf"  # the UTF-8 byte order mark that Windows editors write first


def _not_text(raw: bytes) -> str | None:
  """Why ``raw`` is not a text file (a NUL byte, or one byte in ten another control), or None."""
  nul = raw.find(b"\0")
  if nul >= 0:
    return f"a NUL byte at offset {nul}"
  controls = len(raw) - len(raw.translate(None, _OTHER_CONTROLS))
  if controls * 10 > len(raw):
    return f"{controls} of its {len(raw)} bytes are control characters"
  return None


def read_fortunes(data_dir: str) -> Corpus:
  """Every fortune of the directory ``data_dir``: the one place the corpus is read.

  A file's name is its topic. Hidden files (``.DS_Store``, editor swap files) are skipped with a
  warning; directories (Debian's ``off/``) and other entries that are not files, and the ``.dat``
  indexes of ``strfile``, are skipped without one. Symbolic links are followed, and a file whose
  bytes equal an earlier one's (Debian's ``NAME.u8`` links, or a copy in which they became files)
  is read once, under the first name in sorted order. Line ends ``\\r\\n`` and ``\\r`` become
  ``\\n``, and a UTF-8 byte order mark is dropped. A file that is not valid UTF-8 is read as
  bytes with a warning naming its first bad byte; a file with no ``%`` line, one fortune, with a
  warning.

  Raises:
    DataError: naming the entry, for a directory or file that cannot be read, a binary file, or
      a link to nothing; or saying how to install the corpus, for a directory with no fortune
      files.
  """
  if not os.path.isdir(data_dir):
    raise DataError(_missing_message(data_dir, f"{data_dir} is a file, not a directory" if
                                     os.path.exists(data_dir) else f"no directory {data_dir}"))
  try:
    names = sorted(os.listdir(data_dir))
  except OSError as e:
    raise DataError(f"The fortunes directory {data_dir} cannot be listed ({e}): make it readable "
                    "for this user, or point data_dir at another copy of the corpus.") from None
  topics, files, first_with, hidden, skipped = {}, {}, {}, [], []
  for name in names:
    path = os.path.join(data_dir, name)
    if name.startswith("."):
      hidden.append(name)
      continue
    if name.endswith(".dat"):
      continue
    if os.path.islink(path) and not os.path.exists(path):
      raise DataError(
          f"The fortune file {path} is a symbolic link to {os.readlink(path)}, which does not "
          "exist (or is a loop of links): remove the link, or point it at a fortune file, or "
          "point data_dir at a complete copy of the corpus.")
    if not os.path.isfile(path):
      skipped.append(name)
      continue
    raw = _read_text(path, data_dir)
    digest = hashlib.sha256(raw).digest()
    if digest in first_with:
      if os.path.realpath(path) != os.path.realpath(first_with[digest]):
        logging.warning("Fortune file %s holds the same bytes as %s (a copy that followed a "
                        "link, such as NAME.u8 -> NAME); reading them once.", path,
                        first_with[digest])
      continue
    first_with[digest] = path
    topics[name], files[name] = _fortunes_of(raw, path), len(raw)
  if hidden:
    logging.warning("Skipping the hidden files of %s: %s (fortune files are not hidden).",
                    data_dir, ", ".join(hidden))
  if skipped:  # such as Debian's off/ (fortunes-off)
    logging.info("Skipping the entries of %s that are not files: %s.", data_dir,
                 ", ".join(skipped))
  if not topics:
    only = f", only hidden files: {', '.join(hidden)}" if hidden else ""
    raise DataError(_missing_message(data_dir, f"no fortune files in {data_dir}{only}"))
  return Corpus(topics, files)


def _read_text(path: str, data_dir: str) -> bytes:
  """The bytes of the fortune file ``path``; a :class:`DataError` naming it if it cannot be read
  or is not text, a warning if it is not UTF-8."""
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise DataError(
        f"The fortune file {path} cannot be read ({e}): make it readable for this user, or "
        f"move it out of {data_dir}.") from None
  reason = _not_text(raw)
  if reason is not None:
    raise DataError(
        f"The fortune file {path} is not a text file ({reason}): a fortune file is plain text, "
        f"its fortunes separated by lines holding only '%'. Move it out of {data_dir} (or "
        "remove it), or point data_dir at a directory that holds only fortune files.")
  try:
    raw.decode("utf-8")
  except UnicodeDecodeError as e:
    logging.warning("Fortune file %s is not UTF-8 (byte %d): it is read as bytes, and a model "
                    "learns its encoding beside UTF-8.", path, e.start)
  return raw


def _fortunes_of(raw: bytes, path: str) -> list[bytes]:
  """The fortunes of the bytes of file ``path``, each without the newlines at either end; lines
  holding only ``%`` separate them."""
  text = raw.removeprefix(_BOM).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
  if not text.endswith(b"\n"):
    text += b"\n"
  # A file may start with a separator and ends with one (or with its last fortune).
  pieces = (b"\n" + text).split(SEPARATOR)
  fortunes = [piece.strip(b"\n") for piece in pieces if piece.strip()]
  if not fortunes:
    logging.warning("Fortune file %s holds no fortune.", path)
  elif len(pieces) == 1:
    logging.warning("Fortune file %s has no line holding only '%%': its %d bytes are one "
                    "fortune, in one split.", path, len(raw))
  return fortunes


def held_out(fortune: bytes, validation_every: int) -> bool:
  """Whether the hash of ``fortune`` sends it to validation: one fortune in ``validation_every``.

  The SHA-256 of its normalised text (as :class:`Corpus` holds it), read as a big-endian
  integer, is divisible by ``validation_every``. The rule looks at the fortune alone, so files
  added to the corpus or removed from it move no other fortune between the splits.
  """
  return int.from_bytes(hashlib.sha256(fortune).digest(), "big") % validation_every == 0


def split_corpus(corpus: Corpus, validation_every: int = 10) -> tuple[bytes, bytes]:
  """The corpus's (train, validation) bytes, each distinct fortune once in one split.

  A fortune validates when :func:`held_out` says so, with one exception that keeps every topic in
  both splits: a topic with at least two fortunes of its own (found in no other file) whose
  fortunes would all land in one split moves one of its own to the other, the one whose SHA-256
  is smallest (to validation) or largest (to training). A topic moves only its own fortunes, so
  topics do not depend on each other, and text found in two files lands in one split.
  """
  if isinstance(validation_every, bool) or not isinstance(validation_every, int) or \
      validation_every < 2:
    raise DataError(f"validation_every must be an int >= 2 (one fortune in that many "
                    f"validates); got {validation_every!r}.")
  owners = collections.Counter(f for fortunes in corpus.topics.values() for f in set(fortunes))
  validates = {f: held_out(f, validation_every) for f in owners}
  for fortunes in corpus.topics.values():
    own = sorted({f for f in fortunes if owners[f] == 1},
                 key=lambda f: hashlib.sha256(f).digest())
    if len(own) >= 2:
      if not any(validates[f] for f in fortunes):
        validates[own[0]] = True
      elif all(validates[f] for f in fortunes):
        validates[own[-1]] = False
  splits, seen = ([], []), set()
  for fortunes in corpus.topics.values():
    for fortune in fortunes:
      if fortune not in seen:
        seen.add(fortune)
        splits[validates[fortune]].append(fortune + SEPARATOR)
  return b"".join(splits[0]), b"".join(splits[1])


def split_fortunes(data_dir: str, validation_every: int = 10) -> tuple[bytes, bytes]:
  """The (train, validation) bytes of the fortunes in ``data_dir`` (:func:`split_corpus`)."""
  return _checked_split(data_dir, read_fortunes(data_dir), validation_every)


def _checked_split(data_dir: str, corpus: Corpus, validation_every: int) -> tuple[bytes, bytes]:
  train, validation = split_corpus(corpus, validation_every)
  total = len(train) + len(validation)
  if total < MIN_CORPUS_BYTES:
    raise DataError(_missing_message(
        data_dir, f"only {total} bytes of fortunes in {data_dir}, expected about 2.6 MB"))
  for split, name in ((train, "training"), (validation, "validation")):
    if not split:
      count = sum(len(set(fortunes)) for fortunes in corpus.topics.values())
      raise DataError(
          f"The {count} fortunes in {data_dir} leave no {name} fortune (one in "
          f"{validation_every} validates): a fortune file holds many fortunes, separated by "
          "lines holding only '%'. Point data_dir at a directory of such files.")
  return train, validation


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
  corpus = read_fortunes(data_dir)
  train, validation = _checked_split(data_dir, corpus, validation_every)
  sources = (TextSource(train, context, "fortunes:train"),
             TextSource(validation, context, "fortunes:validation"))
  # Named in a checkpoint's data fingerprint (pipejax.data.fingerprint): a resume on another copy
  # of the corpus says which files differ.
  for source in sources:
    source.files = dict(corpus.files)
  return sources
