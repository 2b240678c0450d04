"""Checkpoints of the whole pipeline: weights, optimizer states, delay lines, registers, tick, RNG.

Saved with orbax (each step is written to a temporary directory and renamed, so a crash never
leaves a half-written checkpoint that looks complete). Beside the state, a JSON ``meta`` item keeps
the data position and the config, so a run resumes exactly where it stopped (docs/design.md §7). A
checkpoint that cannot be read, or was written by a different model or method, is a
:class:`CheckpointError`; a directory that holds checkpoint-like entries but none that orbax can
read is an error too, never a silent fresh start.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

PyTree = Any


class CheckpointError(RuntimeError):
  """A checkpoint cannot be used; the message says why and what to do."""


def _abstract(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(
      a, "sharding", None)), tree)


class Checkpointer:
  """Saves and restores (state, meta) pairs under ``directory``, keeping the last ``max_to_keep``."""

  def __init__(self, directory: str, max_to_keep: int = 3):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=False),
        item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step; an error if only unreadable entries are present."""
    step = self._manager.latest_step()
    if step is None:
      leftovers = [e for e in os.listdir(self.directory) if not e.startswith(".")]
      if leftovers:
        raise CheckpointError(
            f"The checkpoint directory {self.directory} holds {sorted(leftovers)[:5]} but no "
            "complete checkpoint orbax can read (an interrupted copy, or files from another "
            "tool). Refusing to start from scratch over it: move or delete that directory to "
            "start a fresh run, or restore the missing files.")
    return step

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: PyTree, meta: dict) -> None:
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)))
    self._manager.wait_until_finished()

  def restore_meta(self, step: int) -> dict:
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      return dict(restored["meta"])
    except Exception as e:  # orbax/tensorstore raise many types; all mean "unreadable".
      raise self._damaged(step, e) from None

  def restore(self, step: int, like_state: PyTree) -> tuple[PyTree, dict]:
    """Restores step ``step`` into the structure, shapes and dtypes of ``like_state``."""
    meta = self.restore_meta(step)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(_abstract(like_state))))
    except Exception as e:
      raise self._damaged(step, e) from None
    return restored["state"], meta

  def _damaged(self, step, error) -> CheckpointError:
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    return CheckpointError(
        f"Checkpoint step {step} in {self.directory} cannot be restored ({first_line}). It is "
        "damaged (an interrupted copy, a full disk) or was written by a different model, method "
        "or pipeline layout, so its arrays do not fit this run. Resume with the config it was "
        "written with, delete that step's directory to fall back to an older checkpoint, or "
        "choose a new --workdir to start afresh.")

  def close(self):
    self._manager.close()
