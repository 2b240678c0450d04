"""Checkpoints of the whole pipeline: weights, optimizer states, delay lines, registers, tick, RNG.

Each checkpoint is named by the training samples seen when it was saved (orbax's "step", a
directory named by that number). Saved with orbax (each is written to a temporary directory and
renamed, so a crash never leaves a half-written checkpoint that looks complete). Beside the state,
a JSON ``meta`` item keeps the data position and the run's plan, so a run resumes exactly where it
stopped (docs/design.md §7).

Each checkpoint carries two SHA-256 digests in its meta: one of the state's bytes together with the
data position, one of the rest of the meta. :meth:`Checkpointer.restore_newest` checks both, so a
flipped bit on disk is caught instead of trained on; a damaged checkpoint is moved aside (to
``<directory>.damaged/``) and the newest intact one is used, with a warning naming both. When none
is intact the run stops with a :class:`CheckpointError`, never with a silent fresh start.
A temporary directory left by a write that never finished (a kill, a full disk) is not a
checkpoint: it is removed, with a warning, when the directory is opened.

In a run of several processes every process calls every method (they are collectives). Given
``placement`` (:func:`pipejax.parallel.distributed.checkpoint_shardings`), each process writes the
parts of the state that live on its devices; the meta, with its digests, is written once, by
process 0. The digests are of whole arrays, so a checkpoint written by N processes verifies and
restores on M.
"""

from __future__ import annotations

import hashlib
import json
import logging as std_logging
import os
import shutil
import sys
from typing import Any, Callable, Sequence
import warnings

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp

from pipejax.parallel.mesh import to_global, to_host
from pipejax.train.workdir import first_line, storage_error

PyTree = Any

# orbax names the directory of a step it is still writing "<step>.orbax-checkpoint-tmp[-<time>]".
UNFINISHED_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(RuntimeError):
  """A checkpoint cannot be used; the message says why and what to do."""


def _abstract(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(
      a, "sharding", None)), tree)


def _plain_json(value) -> Any:
  """``value`` as it reads back from JSON (tuples become lists), so digests survive the trip."""
  return json.loads(json.dumps(value, default=str))


def state_digest(state: PyTree, data_position: Any) -> str:
  """SHA-256 of every leaf's dtype, shape and bytes (in tree order) and of the data position."""
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(state):
    a = np.ascontiguousarray(to_host(leaf))
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())
  h.update(json.dumps(_plain_json(data_position), sort_keys=True).encode())
  return h.hexdigest()


def weights_digest(stage_params: Sequence[PyTree]) -> str:
  """SHA-256 of a network's weights, the same however the network is split into stages.

  Stages whose parameters are dicts keyed by layer name (every model of ``pipejax.models``) are
  merged into one ``{layer: params}`` dict first, so a one-stage run and an S-stage run that start
  from the same weights have the same digest: a reader of a study's records can check that paired
  runs started alike. Other stage trees are hashed in stage order. Each leaf contributes its path,
  dtype, shape and bytes.
  """
  names = [k for params in stage_params if isinstance(params, dict) for k in params]
  mergeable = all(isinstance(p, dict) for p in stage_params) and len(names) == len(set(names))
  tree = {k: v for params in stage_params for k, v in params.items()} if mergeable else \
      tuple(stage_params)
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    a = np.ascontiguousarray(to_host(leaf))
    h.update(f"{jax.tree_util.keystr(path)}{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def _meta_digest(meta: dict) -> str:
  body = {k: v for k, v in meta.items() if k not in ("state_digest", "meta_digest")}
  return hashlib.sha256(json.dumps(_plain_json(body), sort_keys=True).encode()).hexdigest()


def _renamed(old: str, new: str) -> None:
  warnings.warn(f"Checkpointer.{old} is renamed {new}: a checkpoint is named by the training "
                "samples seen when it was saved.", DeprecationWarning, stacklevel=3)


class Checkpointer:
  """Saves and restores (state, meta) pairs under ``directory``, keeping the last
  ``max_to_keep``."""

  def __init__(self, directory: str, max_to_keep: int = 3, primary: bool = True,
               placement: Callable[[PyTree], PyTree] | None = None):
    """``placement(state)``: the shardings of a multi-process run's state (None on one process)."""
    self.directory = os.path.abspath(directory)
    self.primary = primary
    self._placement = placement
    if primary:
      self._remove_unfinished()
    try:
      self._manager = ocp.CheckpointManager(
          self.directory,
          options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=False),
          item_names=("state", "meta"))
    except Exception as e:  # orbax creates the directory: a read-only workdir fails here
      problem = storage_error("Creating the checkpoint directory", self.directory, e)
      if problem is None:
        raise
      raise problem from None

  def _remove_unfinished(self):
    if not os.path.isdir(self.directory):
      return
    for name in sorted(os.listdir(self.directory)):
      if UNFINISHED_MARK in name:
        logging.warning("Removing %s: a checkpoint whose writing never finished (the run was "
                        "killed or the disk was full while saving it); it holds nothing usable.",
                        os.path.join(self.directory, name))
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def latest_samples(self) -> int | None:
    """The samples of the newest complete checkpoint; an error if only unreadable entries are
    present."""
    samples = self._manager.latest_step()
    if samples is None:
      leftovers = [e for e in os.listdir(self.directory) if not e.startswith(".")]
      if leftovers:
        raise CheckpointError(
            f"The checkpoint directory {self.directory} holds {sorted(leftovers)[:5]} but no "
            "complete checkpoint orbax can read (an interrupted copy, or files from another "
            "tool). Refusing to start from scratch over it: move or delete that directory to "
            "start a fresh run, or restore the missing files.")
    return samples

  def all_samples(self) -> list[int]:
    """The samples of every complete checkpoint, in increasing order."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The old name of :meth:`latest_samples` (a DeprecationWarning)."""
    _renamed("latest_step", "latest_samples")
    return self.latest_samples()

  def all_steps(self) -> list[int]:
    """The old name of :meth:`all_samples` (a DeprecationWarning)."""
    _renamed("all_steps", "all_samples")
    return self.all_samples()

  def save(self, samples: int, state: PyTree, meta: dict) -> None:
    """Saves ``state`` and ``meta`` as the checkpoint at ``samples``; ``meta['data_position']``
    goes into the digest."""
    meta = dict(meta)
    meta["state_digest"] = state_digest(state, meta.get("data_position"))
    meta["meta_digest"] = _meta_digest(meta)
    if self._placement is not None:
      state = jax.tree.map(to_global, state, self._placement(state))
    problem = None
    with _LibraryReportsHeld() as held:
      try:
        self._manager.save(samples, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)))
        self._manager.wait_until_finished()
      except Exception as e:
        problem = storage_error(f"Writing the checkpoint at {samples} samples", self.directory,
                                e)
        if problem is None:
          raise
        held.drop()  # each of orbax's writer threads logged the full disk with its traceback
    if problem is not None:
      # After the held block has put the hooks back: the abandoned writers go on reporting
      # after the save has returned, on a loaded machine long after.
      _quiet_abandoned_writers()
      raise problem

  def restore_meta(self, samples: int) -> dict:
    """The meta of the checkpoint at ``samples`` as saved, its digest checked (a
    :class:`CheckpointError` if damaged).

    The digests themselves are kept under ``meta['digests']``.
    """
    try:
      restored = self._manager.restore(samples,
                                       args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      meta = dict(restored["meta"])
    except Exception as e:  # orbax/tensorstore raise many types; all mean "unreadable".
      raise self._damaged(samples, first_line(e)) from None
    if "meta_digest" in meta and meta["meta_digest"] != _meta_digest(meta):
      raise self._damaged(samples, "its meta does not match its digest")
    digests = {k: meta.pop(k) for k in ("state_digest", "meta_digest") if k in meta}
    if digests:
      meta["digests"] = digests
    return meta

  def restore(self, samples: int, like_state: PyTree) -> tuple[PyTree, dict]:
    """Restores the checkpoint at ``samples`` into the structure, shapes and dtypes of
    ``like_state``.

    Both digests are verified; a mismatch is a :class:`CheckpointError` naming the checkpoint.
    """
    meta = self.restore_meta(samples)
    target = _abstract(like_state)
    if self._placement is not None:
      target = jax.tree.map(lambda a, where: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where),
                            target, self._placement(like_state))
    try:
      restored = self._manager.restore(samples, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target)))
    except Exception as e:
      raise self._damaged(samples, first_line(e)) from None
    state = restored["state"]
    if self._placement is not None:  # every process gets the whole logical state, as on one
      state = jax.tree.map(lambda a: jax.numpy.asarray(to_host(a)), state)
    digests = meta.pop("digests", {})
    if "state_digest" in digests and \
        digests["state_digest"] != state_digest(state, meta.get("data_position")):
      raise self._damaged(samples, "its arrays do not match the digest saved with them")
    return state, meta

  def restore_newest(self, like_state: PyTree, check_meta: Callable[[int, dict], None]
                     ) -> tuple[int, PyTree, dict] | None:
    """The newest intact checkpoint as ``(samples, state, meta)``; None when there is none.

    ``check_meta(samples, meta)`` runs on each candidate's (verified) meta before its arrays are
    read; it raises to refuse a checkpoint the run cannot use at all (a different model, say).
    Damaged checkpoints newer than the one returned are moved to ``<directory>.damaged/`` with a
    warning, so the run can write them again. If every one is damaged, nothing is moved and a
    :class:`CheckpointError` names them all.
    """
    saved = sorted(self.all_samples(), reverse=True)
    if not saved:
      self.latest_samples()  # raises on leftovers that are not checkpoints
      return None
    damaged = []
    for samples in saved:
      try:
        meta = self.restore_meta(samples)
        check_meta(samples, meta)
        state, meta = self.restore(samples, like_state)
      except _DamagedCheckpoint as e:
        logging.warning("%s", e)
        damaged.append((samples, e))
        continue
      for bad, _ in damaged:
        self._set_aside(bad)
      if damaged:
        logging.warning(
            "Resuming from the checkpoint at %d samples, the newest intact one; the damaged "
            "checkpoint(s) at %s samples were moved to %s.damaged/.", samples,
            ", ".join(str(s) for s, _ in damaged), self.directory)
      return samples, state, meta
    if len(damaged) == 1:
      raise damaged[0][1]
    raise CheckpointError(
        f"Every checkpoint in {self.directory} is damaged (at "
        f"{', '.join(str(s) for s, _ in damaged)} samples): " + " ".join(
            f"at {s} samples: {e.reason}." for s, e in damaged)
        + " Refusing to start from scratch over them: restore the files from a copy, resume with "
        "the config they were written "
        "with, or choose a new --workdir to start afresh.")

  def _set_aside(self, samples: int) -> None:
    if jax.process_count() > 1:  # every process found the same damage; one moves it
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      if self.primary:
        self._move_aside(samples)
      multihost_utils.sync_global_devices(f"pipejax checkpoint {samples} set aside")
      self._manager.reload()
      return
    self._move_aside(samples)
    self._manager.reload()

  def _move_aside(self, samples: int) -> None:
    aside = self.directory + ".damaged"
    os.makedirs(aside, exist_ok=True)
    target, n = os.path.join(aside, str(samples)), 1
    while os.path.exists(target):
      target, n = os.path.join(aside, f"{samples}.{n}"), n + 1
    shutil.move(os.path.join(self.directory, str(samples)), target)

  def _damaged(self, samples: int, reason: str) -> CheckpointError:
    return _DamagedCheckpoint(samples, reason, self.directory)

  def close(self):
    self._manager.close()


class _LibraryReportsHeld:
  """Holds back, while its block runs, orbax's log records of warning level and above and the
  exceptions that tensorstore's callbacks raise in orbax's threads (printed, with a traceback,
  through ``sys.unraisablehook`` or ``sys.excepthook``).

  When a save fails for want of space, every writer thread of orbax logs the failure with a
  traceback (up to 16 of them), before the save raises the one error the trainer turns into its
  message; :meth:`drop` discards them then. Otherwise they are passed on when the block ends.
  """

  def __init__(self):
    self._records, self._printed, self._unraisable = [], [], []
    self._logger = std_logging.getLogger("absl")
    self._excepthook = self._unraisablehook = None

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno >= std_logging.WARNING and f"{os.sep}orbax{os.sep}" in record.pathname:
      self._records.append(record)
      return False
    return True

  def __enter__(self):
    self._logger.addFilter(self)
    self._excepthook, sys.excepthook = sys.excepthook, self._hold_printed
    self._unraisablehook, sys.unraisablehook = sys.unraisablehook, self._unraisable.append
    return self

  def _hold_printed(self, *exc_info):
    self._printed.append(exc_info)

  def drop(self) -> None:
    self._records, self._printed, self._unraisable = [], [], []

  def __exit__(self, *exc):
    self._logger.removeFilter(self)
    sys.excepthook, sys.unraisablehook = self._excepthook, self._unraisablehook
    for record in self._records:
      self._logger.handle(record)
    for exc_info in self._printed:
      self._excepthook(*exc_info)
    for unraisable in self._unraisable:
      self._unraisablehook(unraisable)


def _quiet_abandoned_writers() -> None:
  """After a save failed for want of space, for the rest of the process (which ends with the
  trainer's message): drops what orbax's abandoned writer threads still report, each with a
  traceback: their log records, tensorstore's "Event loop is closed" from callbacks that outlive
  the save's event loop, and asyncio's "exception was never retrieved" for their futures."""
  std_logging.getLogger("absl").addFilter(
      lambda record: f"{os.sep}orbax{os.sep}" not in record.pathname)
  std_logging.getLogger("asyncio").addFilter(
      lambda record: "exception was never retrieved" not in record.getMessage())
  closed_loop = lambda error: isinstance(error, RuntimeError) and "Event loop is closed" in str(
      error)
  previous_excepthook, previous_unraisablehook = sys.excepthook, sys.unraisablehook

  def excepthook(kind, value, traceback):
    if not closed_loop(value):
      previous_excepthook(kind, value, traceback)

  def unraisablehook(unraisable):
    if not closed_loop(unraisable.exc_value):
      previous_unraisablehook(unraisable)

  sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


class _DamagedCheckpoint(CheckpointError):
  """One checkpoint cannot be used (unreadable, or its digest does not match); others may
  still be."""

  def __init__(self, samples: int, reason: str, directory: str):
    self.samples, self.reason = samples, reason
    super().__init__(
        f"The checkpoint at {samples} samples in {directory} cannot be restored ({reason}). It "
        "is damaged (a flipped bit, an interrupted copy, a full disk) or was written by a "
        "different model, method or pipejax version, so its arrays do not fit this run. Resume "
        f"with the config it was written with, delete its directory ({samples}/) to fall back "
        "to an older checkpoint, or choose a new --workdir to start afresh.")
