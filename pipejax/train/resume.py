"""Resuming: what a checkpoint must have been written with, and the changes a resume records.

:func:`fingerprint` is what fixes the shapes of the pipeline state; :func:`check_resumable`
refuses a checkpoint of another model or layout, and an unannounced change of the recipe or of
the data; :func:`record_changes` logs and appends the changes a resume was allowed to make.
"""

from __future__ import annotations

import json
import os
import time

from absl import logging
import yaml

from pipejax import config as configlib
from pipejax import data as data_lib
from pipejax import files
from pipejax.data import fingerprint as data_fingerprint
from pipejax.train.checkpoint import CheckpointError
from pipejax.train.config_checks import ConfigError
from pipejax.train.plan import RunPlan

# Config keys that may differ on resume without changing what is trained: where the data lives, how
# often the run reports and saves, how the devices are laid out (checkpoints hold the logical
# state). Any other change is refused unless config.allow_changes_on_resume is set.
FREE_KEYS = ("data_dir", "download_data", "eval_every_samples", "checkpoint_every_samples",
             "keep_checkpoints", "eval_batch_size", "plot_curves", "mesh", "stack_stages",
             "allow_changes_on_resume")
# The same parts of a plan (:meth:`pipejax.train.plan.RunPlan.to_json`).
FREE_PARTS = ("data.data_dir", "data.download", "output", "mesh", "allow_changes_on_resume")

# Config keys that may differ between the processes of one run: each host reads its own copy of
# the data set, wherever it is mounted.
PER_HOST_KEYS = ("data_dir", "download_data")


def flat_plan(plan: RunPlan) -> dict:
  """``{dotted key: value}`` of every part of ``plan``, as JSON holds them."""
  return _flatten(plan.to_json())


def flat_given(plan: RunPlan) -> dict:
  """``{dotted key: value}`` of every field of the config ``plan`` was resolved from."""
  return _flatten(dict(plan.given))


def is_in(key: str, parts) -> bool:
  """Whether the dotted ``key`` is one of ``parts`` or lies inside one."""
  return any(key == part or key.startswith(part + ".") for part in parts)


def meta(plan: RunPlan) -> dict:
  """What a checkpoint records of the run's settings: its plan, the structural fingerprint
  and the config as given (which older checkpoints hold alone)."""
  return {"plan": plan.to_json(), "fingerprint": dict(plan.given_fingerprint),
          "config": dict(plan.given)}


def _flatten(tree, prefix: str = "") -> dict:
  if not isinstance(tree, dict):
    return {prefix[:-1]: tree}
  out = {}
  for key, value in tree.items():
    out.update(_flatten(value, f"{prefix}{key}."))
  return out


_NOT_SET = "(not set)"


def _changed_settings(plan: RunPlan, meta: dict) -> dict:
  """``{key: (value in the checkpoint, value now)}`` of every field that differs, free or not.

  A field only one side has is compared only inside ``method_kwargs``, whose keys are set one by
  one (a hyperparameter added or dropped on resume changes the recipe); elsewhere it is a field
  the code added or removed since. The saved config is read with today's names
  (:func:`pipejax.config.current_keys`).
  """
  old = _flatten(meta.get("config", {}))
  old = configlib.current_keys(old, method=old.get("method", plan.method))
  new = flat_given(plan)
  keys = old.keys() & new.keys() | {k for k in old.keys() ^ new.keys()
                                    if k.startswith("method_kwargs.")}
  return {k: (old.get(k, _NOT_SET), new.get(k, _NOT_SET)) for k in sorted(keys)
          if old.get(k, _NOT_SET) != new.get(k, _NOT_SET)}


def _is_free(key: str) -> bool:
  return key.split(".")[0] in FREE_KEYS


def recipe_changes(plan: RunPlan, trained_config: dict) -> str:
  """The fields other than :data:`FREE_KEYS` in which ``plan``'s config differs from
  ``trained_config`` (a run's config.json), described as ``key old -> new; ...``; empty when
  none does."""
  changes = {k: v for k, v in _changed_settings(plan, {"config": trained_config}).items()
             if not _is_free(k)}
  return _describe_changes(changes)


def _shown(value) -> str:
  """A fingerprint's value as a Python literal. A section (model_kwargs) is held in the
  fingerprint as the YAML text ml_collections prints for it (``hidden: !!python/tuple ...``)."""
  if isinstance(value, str) and "\n" in value:
    try:
      decoded = yaml.load(value, Loader=yaml.FullLoader)  # FullLoader: tuples, nothing runs
    except yaml.YAMLError:
      return repr(value)
    if isinstance(decoded, dict):
      return repr(decoded)
  return repr(value)


def check_resumable(plan: RunPlan, checkpointer, samples: int, meta: dict,
                    data: dict | None = None) -> None:
  """Refuses a checkpoint of another model or layout, and unannounced changes of what the run
  reads or, given this run's ``data`` fingerprint (:mod:`pipejax.data.fingerprint`), of the data.

  A checkpoint that holds its plan is compared with this run's plan: a setting nothing reads (a
  section of another method, a default given explicitly) changes nothing. An older one is
  compared field by field with the config it was written with.
  """
  _check_same_data(plan, checkpointer, samples, meta, data)
  saved, wanted = meta.get("fingerprint", {}), plan.given_fingerprint
  differing = sorted(k for k in wanted if saved.get(k) != wanted[k])
  if differing:
    raise CheckpointError(
        f"The checkpoint at {samples} samples in {checkpointer.directory} was written with a "
        f"different {', '.join(differing)} "
        f"({', '.join(f'{k}={_shown(saved.get(k))}' for k in differing)}; "
        f"this run: {', '.join(f'{k}={_shown(wanted[k])}' for k in differing)}). Resume with the "
        "same settings, or use a new --workdir for the new ones.")
  changes = read_changes(plan, meta)
  if changes and not plan.allow_changes_on_resume:
    workdir = os.path.dirname(checkpointer.directory)
    raise ConfigError(
        f"This run would resume the checkpoint at {samples} samples in {workdir} with other "
        f"settings than it was trained with: {_describe_changes(changes)}. Continuing silently "
        "would mix two experiments in one run. Rerun with the original values, use a new "
        "--workdir for the new ones, or pass --config.allow_changes_on_resume=True to continue "
        f"with them (the change is then logged and recorded in "
        f"{os.path.join(workdir, CHANGES_FILE)}).")


def read_changes(plan: RunPlan, meta: dict) -> dict:
  """``{key: (value in the checkpoint, value now)}`` of the changes that alter what the run
  reads, other than where it reads the data and how it reports and saves: the config's fields
  that differ, named as a user sets them, when the plans differ (the plans' own parts when the
  config's fields are the same); with an older checkpoint, which holds no plan, every field."""
  given = {k: v for k, v in _changed_settings(plan, meta).items() if not _is_free(k)}
  if "plan" not in meta:
    return given
  saved, now = _flatten(meta["plan"]), flat_plan(plan)
  planned = {k: (saved.get(k, _NOT_SET), now.get(k, _NOT_SET))
             for k in sorted(saved.keys() | now.keys())
             if saved.get(k, _NOT_SET) != now.get(k, _NOT_SET) and not is_in(k, FREE_PARTS)}
  if not planned:
    return {}
  return given or planned


def _check_same_data(plan: RunPlan, checkpointer, samples: int, meta: dict, data: dict | None
                     ) -> None:
  # A checkpoint that records no data fingerprint predates them: nothing to compare.
  if data is None or "data" not in meta:
    return
  changes = data_fingerprint.differences(meta["data"], data)
  if changes and not plan.allow_changes_on_resume:
    workdir = os.path.dirname(checkpointer.directory)
    raise data_lib.DataError(
        f"The data changed since the checkpoint at {samples} samples in {workdir} was written: "
        f"{'; '.join(changes)}. Continuing would train one run on two data sets. Point "
        "--config.data_dir at the data it was trained on, use a new --workdir, or pass "
        "--config.allow_changes_on_resume=True to continue on the new data (the change is then "
        f"logged and recorded in {os.path.join(workdir, CHANGES_FILE)}).")


CHANGES_FILE = "config_changes.jsonl"


def _describe_changes(changes: dict) -> str:
  shown = lambda value: value if value == _NOT_SET else repr(value)
  return "; ".join(f"{k} {shown(old)} -> {shown(new)}" for k, (old, new) in changes.items())


def record_changes(plan: RunPlan, workdir: str, meta: dict, samples: int,
                   data: dict | None = None) -> None:
  """Logs the fields this session changes and appends them to ``workdir/config_changes.jsonl``;
  given this run's ``data`` fingerprint, a change of the data too."""
  _record_data_change(workdir, meta, samples, data)
  changes = _changed_settings(plan, meta)
  if not changes:
    return
  recipe = read_changes(plan, meta)
  if recipe:
    logging.warning("Resuming at %d samples with changed settings (allowed by "
                    "config.allow_changes_on_resume): %s.", samples, _describe_changes(recipe))
  logging.info("Resuming at %d samples with changed settings: %s.", samples,
               _describe_changes(changes))
  files.append(os.path.join(workdir, CHANGES_FILE), json.dumps(
      {"samples": samples, "time": time.time(),
       "changes": {k: list(v) for k, v in changes.items()}}) + "\n")


def _record_data_change(workdir: str, meta: dict, samples: int, data: dict | None) -> None:
  changes = data_fingerprint.differences(meta["data"], data) if data and "data" in meta else []
  if not changes:
    return
  logging.warning("Resuming at %d samples on changed data (allowed by "
                  "config.allow_changes_on_resume): %s.", samples, "; ".join(changes))
  files.append(os.path.join(workdir, CHANGES_FILE),
               json.dumps({"samples": samples, "time": time.time(), "data": changes}) + "\n")
