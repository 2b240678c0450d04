"""A study's checks before any trainer starts: the selection, the workdir, the config's keys.

Each trainer of a study would refuse a key it cannot read, one after the other; these refuse it
once, as a :class:`pipejax.study.StudyError`, before anything runs.
"""

from __future__ import annotations

import difflib
import os

from pipejax.study import records as study_records
from pipejax.study import spec as study_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def selected(study: study_lib.Study, where: dict[str, str] | None) -> list[dict]:
  """The runs whose value of each key in ``where`` is one of its ``|``-separated values."""
  where = where or {}
  return [o for o in study.runs()
          if all(study_lib.format_value(o.get(k)) in v.split("|") for k, v in where.items())]


def check_selection(study: study_lib.Study, where: dict[str, str] | None) -> None:
  """Refuses (:class:`pipejax.study.StudyError`) a ``where`` that selects no run of the grid,
  naming the key whose values match nothing and the values it takes."""
  if not where or selected(study, where):
    return
  runs = study.runs()
  for key, wanted in where.items():
    known = list(dict.fromkeys(study_lib.format_value(o.get(key)) for o in runs))
    if not set(wanted.split("|")) & set(known):
      raise study_lib.StudyError(
          f"--where={key}={wanted} matches no run of study {study.name!r}: {key} takes "
          f"{'|'.join(known)}. Nothing was run.")
  items = ",".join(f"{k}={v}" for k, v in where.items())
  raise study_lib.StudyError(f"--where={items} matches no run of study {study.name!r}: each "
                             "value is in the grid, but no grid point has them together. "
                             "Nothing was run.")


def check_report_workdir(workdir: str) -> None:
  """Refuses a ``--report_only`` workdir that holds no study records, before creating anything:
  a mistyped path would otherwise get a report of zero runs."""
  if any(os.path.exists(os.path.join(workdir, name)) for name in (study_records.RESULTS_FILE,
                                                                  "runs")):
    return
  what = "does not exist" if not os.path.exists(workdir) else \
      f"holds no study (neither {study_records.RESULTS_FILE} nor runs/)"
  raise study_lib.StudyError(f"--report_only: the workdir {workdir} {what}, so there is nothing "
                             "to report. Give the --workdir the study ran in.")


def _check_method_kwarg(study: study_lib.Study, key: str) -> None:
  """Refuses a ``method_kwargs.METHOD.KEY`` grid key that the method's record does not let a
  config set, as its trainers would."""
  from pipejax.train import config_checks  # pylint: disable=import-outside-toplevel
  section, _, rest = key.partition(".")
  name, _, field = rest.partition(".")
  if section != "method_kwargs" or not field or "." in field:
    return
  try:
    config_checks.check_method_key(name, field)
  except config_checks.ConfigError as e:
    raise study_lib.StudyError(f"Study {study.name!r}: {e} Every trainer would refuse it; "
                               "nothing was run.") from None


def check_config_keys(study: study_lib.Study) -> None:
  """Refuses a study whose config file cannot be loaded or whose grid or ``fixed`` keys are not
  fields of it, before any trainer starts: each trainer would otherwise fail alike, one by one.
  ``model_kwargs.*``, ``data_kwargs.*`` and ``method_kwargs.*`` keys are their readers' to check
  (the trainer adds them); an old field name is refused with its new key."""
  from pipejax import config as config_lib  # pylint: disable=import-outside-toplevel
  if not os.path.isfile(os.path.join(ROOT, study.config.partition(":")[0])):
    raise study_lib.StudyError(
        f"Study {study.name!r}: its config file {study.config.partition(':')[0]!r} does not "
        f"exist under {ROOT} (a study names its config relative to the repository root, e.g. "
        "'configs/default.py:smoke').")
  try:
    config = config_lib.load_config(os.path.join(ROOT, study.config))
  except config_lib.ConfigFileError as e:
    raise study_lib.StudyError(f"Study {study.name!r}: config {study.config!r}: {e}") from None
  known = set(config_lib.dotted_keys(config))
  for key in dict.fromkeys([*study.keys(), *study.fixed]):
    _check_method_kwarg(study, key)
    if key in config_lib.RENAMED_FIELDS:
      raise study_lib.StudyError(f"Study {study.name!r}: " + config_lib.renamed_field_message(
          key, study.config))
    # The keywords of a model's builder, a data set's loader, a method's record: the trainer
    # checks them against their reader.
    if key not in known and key.partition(".")[0] not in config_lib.FREE_FORM_FIELDS:
      close = difflib.get_close_matches(key, sorted(known), n=1)
      hint = f" Did you mean {close[0]!r}?" if close else ""
      raise study_lib.StudyError(
          f"Study {study.name!r}: {key!r} is not a field of {study.config}.{hint} Every trainer "
          "would refuse it; nothing was run.")
  check_method_sections(study, config.method)


def check_method_sections(study: study_lib.Study, config_method: str) -> None:
  """Refuses a grid point that sets a key of ``method_kwargs.NAME`` for a run of another
  method (``config_method`` where the study sets none): nothing reads it, so that method would
  be trained once per value of the key, the same run each time, and the report would show the
  key as an axis."""
  for run in study.runs():
    method = run.get("method", study.fixed.get("method", config_method))
    for key, value in run.items():
      section, _, rest = key.partition(".")
      name = rest.partition(".")[0]
      if section == "method_kwargs" and name and name != method:
        raise study_lib.StudyError(
            f"Study {study.name!r}: its grid point {study_lib.run_id(run)} trains method "
            f"{method!r} and sets {key}={study_lib.format_value(value)}, which only method "
            f"{name!r} reads: {method!r} would be trained once per value of {key}, the same "
            f"run each time. Give {key} a grid of its own whose method is {name!r} (a study's "
            "grids are a list); nothing was run.")
