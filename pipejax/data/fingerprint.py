"""What a checkpoint records of the data it was trained on, so that a resume notices changed data.

:func:`fingerprint` describes both splits: their names, example counts, a SHA-256 digest of their
contents and, for a corpus read from files (the fortunes), each file's name and size.
:func:`differences` says in words what changed between two fingerprints.

The digest covers every byte of a split held in memory (the arrays of an image data set, the bytes
of a text corpus: a fraction of a second even for CIFAR), and an evenly spaced sample of 64
examples of a split read by index from disk (ImageNet through tfds), where reading everything
would take as long as an epoch.
"""

from __future__ import annotations

import hashlib

import numpy as np

from pipejax.data.source import ArraySource, Source, Subset
from pipejax.data.text import TextSource

# Examples read for the digest of a split that is not held in memory.
SAMPLED_EXAMPLES = 64


def fingerprint(train: Source, test: Source) -> dict:
  """``{"train": ..., "test": ...}``, each split's name, size, digest and (a corpus's) files."""
  return {"train": describe(train), "test": describe(test)}


def describe(source: Source) -> dict:
  """One split's entry of :func:`fingerprint` (plain JSON values)."""
  base = source
  while isinstance(base, Subset):
    base = base.source
  entry = {"name": source.name, "examples": len(source), "digest": _digest(source, base)}
  files = getattr(base, "files", None)
  if files:
    entry["files"] = dict(files)
  return entry


def _digest(source: Source, base: Source) -> str:
  h = hashlib.sha256(f"{tuple(source.example_shape)}{tuple(source.label_shape)}".encode())
  n = len(source)  # a Subset keeps the first n examples of its base
  if isinstance(base, ArraySource):
    h.update(np.ascontiguousarray(base.images[:n]).tobytes())
    h.update(np.ascontiguousarray(base.labels[:n]).tobytes())
  elif isinstance(base, TextSource):
    h.update(base.tokens[:n * base.context + 1].tobytes())
  else:
    for index in np.unique(np.linspace(0, n - 1, min(n, SAMPLED_EXAMPLES)).astype(np.int64)):
      example, label = source.raw(int(index))
      h.update(np.ascontiguousarray(example).tobytes())
      h.update(np.asarray(label).tobytes())
  return h.hexdigest()


def differences(saved: dict, current: dict) -> list[str]:
  """What changed from ``saved`` to ``current`` (two :func:`fingerprint` results), in words."""
  changes = []
  for split, label in (("train", "training"), ("test", "test")):
    old, new = saved.get(split) or {}, current.get(split) or {}
    if old.get("digest") == new.get("digest") and old.get("examples") == new.get("examples"):
      continue
    parts = []
    if old.get("examples") != new.get("examples"):
      parts.append(f"{old.get('examples')} -> {new.get('examples')} examples")
    old_files, new_files = old.get("files") or {}, new.get("files") or {}
    added = sorted(new_files.keys() - old_files.keys())
    removed = sorted(old_files.keys() - new_files.keys())
    resized = sorted(k for k in old_files.keys() & new_files.keys()
                     if old_files[k] != new_files[k])
    for what, names in (("files added", added), ("files removed", removed),
                        ("files changed in size", resized)):
      if names:
        parts.append(f"{what}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
    if not parts:
      parts.append("the same size, other contents")
    changes.append(f"the {label} split ({new.get('name') or old.get('name')}): "
                   f"{'; '.join(parts)} (digest {str(old.get('digest'))[:12]} -> "
                   f"{str(new.get('digest'))[:12]})")
  return changes
