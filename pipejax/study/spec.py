"""Studies: a grid of training runs declared in a file.

A study file (``configs/studies/*.py``) defines ``get_study(arg)`` returning a :class:`Study`: the
training config every run starts from, the grid of overrides (method x depth x seed x ...), what
the report shows. This module holds that declaration and each run's identity and trainer flags;
``pipejax.study.launcher`` runs the grid as trainer processes, ``pipejax.study.records`` keeps one
record per run in ``results.jsonl``, ``pipejax.study.cells`` gathers the records into cells, and
``pipejax.study.report`` and ``pipejax.study.figures`` make the tables, statistics and figures
from the records alone, so a report can be regenerated, merged or published without the runs'
workdirs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import json
import os
import traceback
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Sequence

Overrides = dict[str, Any]


class StudyError(ValueError):
  """A study file or a study workdir is unusable; the message says how to fix it."""


# How reports name the grid keys most studies sweep.
KEY_NAMES = {"model_kwargs.depth": "stages", "reference.lr": "reference lr",
             "micro_batch_size": "micro-batch", "method": "method"}
TABLE_KINDS = ("mean", "gap", "stability", "cells", "tuned")
FIGURE_KINDS = ("mean", "gap", "staleness", "curves")
# What a 'curves' figure can draw: the metrics a record's ``test_curve`` rows hold.
CURVE_METRICS = ("test_accuracy", "test_loss")


def higher_is_better(metric: str) -> bool:
  """Whether a larger value of ``metric`` is the better result: accuracy is, while a loss and the
  samples taken to reach an accuracy are better smaller."""
  return not (metric.endswith("loss") or metric.startswith("samples_to:"))


@dataclasses.dataclass(frozen=True)
class Table:
  """A markdown table of one metric: ``rows`` x ``columns`` (two grid keys).

  kind: 'mean' (n, mean and 95% CI of ``metric`` over seeds), 'gap' (the gap to the study's
  baseline paired by seed, with its 95% CI and p-value), 'stability' (per column value, the
  interval of ``rows`` values between the largest that trains and the smallest that fails),
  'cells' (one line per grid point, whatever keys set it: its mean and its gap to the baseline;
  ``rows`` and ``columns`` are unused) or 'tuned' (per column value, the ``rows`` value with the
  best mean, and the gap there to the baseline at the baseline's own best value).

  ``metric`` is a record field (``test_accuracy``, ``test_loss``) or ``samples_to:A``: the
  training samples a run took to first reach test accuracy A (runs that never did are counted
  as 'not reached').
  """

  title: str
  rows: str
  columns: str
  kind: str = "mean"
  metric: str = "test_accuracy"
  # ((key, value), ...): only runs with these overrides (None: key not set; a tuple of values:
  # any of them; a tuple of keys: any of a tuple of their values' combinations, cells.select).
  where: tuple = ()
  scale: float = 100.0  # cells show metric * scale (accuracy in percent)
  decimals: int = 2
  unit: str = ""  # what the gap sentences call a cell's unit; default: 'points' at scale 100
  # How the gap sentences name the baseline, where the study's own name for it would mislead
  # (the sgd method under Adam is "Adam without a pipeline"); default: study.baseline_label().
  baseline_label: str = ""
  # ((key, value), ...): a 'gap' or 'cells' table's baseline where it is not the study's, e.g.
  # the best of another optimizer beside the best of all; default: study.baseline.
  baseline: tuple = ()

  @property
  def unit_name(self) -> str:
    return self.unit or ("points" if self.scale == 100 else "units")

  @property
  def higher_is_better(self) -> bool:
    """Whether a larger value of the metric is the better result: accuracy is, while a loss and
    the samples taken to reach an accuracy are better smaller. Margin verdicts and the 'tuned'
    table's best value follow it."""
    return higher_is_better(self.metric)


@dataclasses.dataclass(frozen=True)
class Figure:
  """A PNG of ``metric`` against grid key ``x``, one line per ``series`` value.

  kind 'mean' and 'gap' draw the cells' means with 95% CIs, diverged runs in a band of their own
  below the axis; 'curves' draws the mean of ``metric`` (``test_accuracy`` or ``test_loss``) over
  training samples (with its 95% CI) at the grid point ``where``; 'staleness' draws each series'
  per-stage weight discrepancy (the runs' diagnostics) at the grid point ``where``.

  A gap is the method's value minus the baseline's, whichever way the metric is better, as in the
  gap tables; the y axis says when smaller is better (a loss), since a gap above zero is then the
  worse one.
  """

  file: str
  x: str
  series: str
  kind: str = "mean"
  metric: str = "test_accuracy"
  log_x: bool = False
  where: tuple = ()  # ((key, value), ...): only runs with these overrides
  title: str = ""  # for a reader: never a config key
  x_label: str = ""
  x_unit: float = 1.0  # x is drawn as value / x_unit (a learning rate as a multiplier)
  threshold: float | None = None  # a horizontal line at this metric value, e.g. a stability bar
  scale: float = 100.0  # the metric is drawn times scale, as a Table shows it (accuracy in %)
  # The y axis's unit, e.g. 'bits per byte' for a loss in nats drawn at scale 1 / ln 2; default:
  # '%' for an accuracy's mean and 'points' for its gap at scale 100, none otherwise.
  unit: str = ""

  @property
  def higher_is_better(self) -> bool:
    """Whether a larger value of the metric is the better result (see :class:`Table`)."""
    return higher_is_better(self.metric)


@dataclasses.dataclass(frozen=True)
class Section:
  """A part of the report after its tables and figures, under ``## title``.

  ``body`` is markdown, or a function of the report's records and the study's workdir that
  returns it: for what the tables cannot say (a sample of generated text, a plot of a run's
  logs). A function that raises costs its own section only, which then says why it is missing.
  """

  title: str
  body: str | Callable[[Sequence[dict], str], str]


@dataclasses.dataclass(frozen=True)
class Study:
  """A grid of training runs and what to report about them.

  Attributes:
    name: Short name, used in titles.
    config: The training config file every run starts from (relative to the repository root),
      optionally with its argument, e.g. 'configs/deep_mlp.py:smoke'.
    grids: Each a mapping from a config key (dotted, e.g. 'model_kwargs.depth') to the values it
      takes; the study runs the union of the grids' cartesian products.
    fixed: Overrides applied to every run.
    baseline: Overrides that select the baseline of gaps, e.g. {'method': 'sgd'}.
    baseline_name: How the report names the baseline where its overrides' labels would not say
      what it is, e.g. 'Muon without a pipeline at 4e-3, the best baseline'; default: the labels
      of the baseline's values.
    tables, figures: What the report shows.
    sections: Parts of the report after the tables and figures, in order.
    min_accuracy: For 'stability' tables: a cell still trains when no seed diverged and its mean
      accuracy is at least this.
    margin: When set (in the metric's units: 0.005 is half a point of accuracy), each gap
      gets a non-inferiority and an equivalence verdict at this margin (one and two one-sided
      paired t-tests).
    labels: Readable names of grid values for the report's text and figures, e.g.
      {'pb_sc_lwp': 'PB + SC + LWP'}.
    skip_beyond_failure: A grid key along which failure is taken to persist (a learning rate):
      a run whose point, with a smaller value of this key and the same seed, already diverged or
      ended below ``min_accuracy`` is not run but recorded as skipped. Saves the costly runs of
      a stability sweep that cannot change its answer.
  """

  name: str
  config: str
  grids: Sequence[dict[str, Sequence[Any]]]
  fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
  baseline: dict[str, Any] = dataclasses.field(default_factory=dict)
  baseline_name: str = ""
  tables: Sequence[Table] = ()
  figures: Sequence[Figure] = ()
  min_accuracy: float = 0.0
  skip_beyond_failure: str | None = None
  margin: float | None = None
  labels: dict[str, str] = dataclasses.field(default_factory=dict)
  sections: Sequence[Section] = ()

  def __post_init__(self):
    for table in self.tables:
      if table.kind not in TABLE_KINDS:
        raise StudyError(f"Table {table.title!r}: kind {table.kind!r} is not one of "
                         f"{', '.join(TABLE_KINDS)}.")
    _check_figures(self)
    _check_sections(self)
    if self.margin is not None and not (isinstance(self.margin, (int, float)) and
                                        0 < self.margin < 1):
      raise StudyError(f"Study {self.name!r}: margin must be a fraction in (0, 1) of the metric "
                       f"(0.005 is half a point of accuracy); got {self.margin!r}.")
    _check_grids(self)
    _check_tables(self)
    self.runs()  # two grid points of one run id are refused here, before anything runs

  def label(self, value: Any) -> str:
    """How the report names a grid key or value: ``labels``, then a method's display name, else
    the value itself."""
    from pipejax.methods import DISPLAY_NAMES  # pylint: disable=import-outside-toplevel
    text = str(value)
    return self.labels.get(text, DISPLAY_NAMES.get(text, KEY_NAMES.get(text, text)))

  def baseline_label(self) -> str:
    """How the report names the baseline of gaps, e.g. 'SGD'."""
    return self.baseline_name or ", ".join(self.label(v) for v in self.baseline.values())

  def baseline_of(self, table: Table) -> dict[str, Any]:
    """The overrides that select ``table``'s baseline: its own, else the study's."""
    return dict(table.baseline) or self.baseline

  def baseline_label_of(self, table: Table) -> str:
    """How ``table``'s gaps name their baseline: its ``baseline_label``, else the labels of its
    own baseline's values, else the study's name for its baseline."""
    if table.baseline_label:
      return table.baseline_label
    if table.baseline:
      return ", ".join(self.label(value) for _, value in table.baseline)
    return self.baseline_label()

  def runs(self) -> list[Overrides]:
    """Every run's grid overrides, in a stable order (grids in order, products in order), each
    grid point once: one point listed twice, in any order of keys, runs once.

    Raises:
      StudyError: two different grid points would have one :func:`run_id` (a value holding ','
        or '=', or 0.1 beside '0.1'), so one of them would never run.
    """
    seen, runs = {}, []
    for grid in self.grids:
      keys = list(grid)
      for values in itertools.product(*(grid[k] for k in keys)):
        run = dict(zip(keys, values))
        rid, identity = run_id(run), key_of(run)
        if rid not in seen:
          seen[rid] = (identity, run)
          runs.append(run)
        elif seen[rid][0] != identity:
          raise StudyError(
              f"Study {self.name!r}: the grid points {seen[rid][1]!r} and {run!r} would have "
              f"one run id, {rid!r}, so one of them would never run and their records would be "
              "one. Give each value once, of one type, without ',' or '=' that reads as another "
              "key.")
    return runs

  def keys(self) -> list[str]:
    """The grid keys, in first-seen order."""
    return list(dict.fromkeys(k for grid in self.grids for k in grid))


def _check_figures(study: Study) -> None:
  """Refuses a figure of an unknown kind, or curves of a metric the records' curves lack."""
  for figure in study.figures:
    if figure.kind not in FIGURE_KINDS:
      raise StudyError(f"Figure {figure.file!r}: kind {figure.kind!r} is not one of "
                       f"{', '.join(FIGURE_KINDS)}.")
    if figure.kind == "curves" and figure.metric not in CURVE_METRICS:
      raise StudyError(f"Figure {figure.file!r}: curves are recorded of "
                       f"{' and '.join(CURVE_METRICS)} only; got metric {figure.metric!r}.")


def _is_list(value) -> bool:
  """A sequence of entries, not text or a mapping (whose iteration would give characters or
  keys)."""
  return isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping))


def _check_sections(study: Study) -> None:
  """Refuses sections that are not :class:`Section` instances with a title and a body."""
  where = f"Study {study.name!r}"
  if not _is_list(study.sections):
    raise StudyError(f"{where}: sections must be a list of Section(title, body); got "
                     f"{study.sections!r}.")
  for section in study.sections:
    if not isinstance(section, Section):
      raise StudyError(f"{where}: each section must be a pipejax.study.Section(title, body); got "
                       f"{section!r}.")
    if not isinstance(section.title, str) or not section.title.strip():
      raise StudyError(f"{where}: a section needs a title (the report's heading); got "
                       f"{section.title!r}.")
    if not (isinstance(section.body, str) or callable(section.body)):
      raise StudyError(f"{where}: the body of section {section.title!r} must be markdown text or "
                       f"a function (records, workdir) -> text; got {section.body!r}.")


def _check_where(where: tuple, what: str) -> None:
  """Refuses a ``where`` that is not (key, value) pairs, or a tuple of keys whose value is not a
  tuple of combinations of as many values (it would match no run, silently)."""
  for pair in where if isinstance(where, tuple) else (where,):
    if not (isinstance(pair, tuple) and len(pair) == 2):
      raise StudyError(f"{what}: where must be a tuple of (config key, value) pairs, e.g. "
                       f"(('method', 'sgd'),); got {where!r}.")
    key, value = pair
    if isinstance(key, tuple) and not (isinstance(value, tuple) and all(
        isinstance(v, tuple) and len(v) == len(key) for v in value)):
      raise StudyError(f"{what}: where's keys {key!r} take a tuple of combinations of "
                       f"{len(key)} values each, e.g. ({tuple('…' for _ in key)!r},); got "
                       f"{value!r}.")


def _check_axes(study: Study, table: Table) -> None:
  """Refuses a table whose rows and columns are one key (each cell would be looked up by that key
  alone, and values would land in the wrong cells) or that puts the seed on an axis (a cell is the
  mean over every seed, so each would be empty)."""
  if table.kind == "cells":  # a list of cells: its rows and columns are unused
    return
  axes = [axis for axis in (table.rows, table.columns) if axis]
  where = f"Study {study.name!r}: table {table.title!r}"
  if len(axes) == 2 and axes[0] == axes[1]:
    raise StudyError(f"{where} has {axes[0]!r} as both its rows and its columns: a table crosses "
                     "two keys. Give one of them another grid key (e.g. rows='model_kwargs.depth', "
                     "columns='method'), or use kind='cells' to list the cells.")
  if "seed" in axes:
    raise StudyError(f"{where} puts 'seed' on an axis, but each cell is the mean over every seed "
                     "(with its 95% CI and n), so no cell would have a value. Choose other grid "
                     "keys for rows and columns; the seeds of a cell are its n.")


def _check_tables(study: Study) -> None:
  """Refuses a malformed ``where`` of a table or figure, a table baseline that is not (config
  key, value) pairs, and a baseline on a table whose kind takes the study's."""
  for table in study.tables:
    _check_where(table.where, f"Study {study.name!r}, table {table.title!r}")
  for figure in study.figures:
    _check_where(figure.where, f"Study {study.name!r}, figure {figure.file!r}")
  for table in study.tables:
    _check_axes(study, table)
    pairs = table.baseline
    if not isinstance(pairs, tuple) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
      # Pairs, not a mapping as the study's baseline is: a Table is frozen and hashable.
      raise StudyError(f"Study {study.name!r}: table {table.title!r}'s baseline must be a tuple "
                       f"of (config key, value) pairs, e.g. (('method', 'sgd'),), not a mapping "
                       f"as the study's baseline is; got {pairs!r}.")
    if pairs and table.kind not in ("gap", "cells"):
      raise StudyError(f"Study {study.name!r}: table {table.title!r} of kind {table.kind!r} takes "
                       "the study's baseline; only a 'gap' or 'cells' table sets its own.")


def _check_grids(study: Study) -> None:
  """Refuses grids that are not a list of ``{key: values}`` mappings, in one line each."""
  where = f"Study {study.name!r}"
  if not _is_list(study.grids):
    raise StudyError(f"{where}: grids must be a list of mappings, e.g. "
                     f"[{{'method': ('sgd', 'pb'), 'seed': (0, 1)}}]; got {study.grids!r}.")
  for grid in study.grids:
    if not isinstance(grid, Mapping):
      raise StudyError(f"{where}: each grid must be a mapping from a config key to its values; "
                       f"got {grid!r}.")
    for key, values in grid.items():
      if not isinstance(key, str) or not key:
        raise StudyError(f"{where}: grid keys are config keys (text such as 'method'); got "
                         f"{key!r}.")
      if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise StudyError(f"{where}: the values of grid key {key!r} must be a list or tuple, "
                         f"e.g. ({values!r},); got {values!r}.")
  for name in ("fixed", "baseline"):
    if not isinstance(getattr(study, name), Mapping):
      raise StudyError(f"{where}: {name} must be a mapping from config keys to values; got "
                       f"{getattr(study, name)!r}.")


def load_study(spec: str) -> Study:
  """Loads ``path[:arg]``: the file's ``get_study(arg)``."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise StudyError(f"No study file {path!r}. Give the path of a file under configs/studies/, "
                     "e.g. --study=configs/studies/depth.py (append :smoke for the quick variant).")
  module = _run_study_file(path)
  if not hasattr(module, "get_study"):
    raise StudyError(f"{path} defines no get_study(arg); a study file returns a "
                     "pipejax.study.Study from get_study (see configs/studies/depth.py).")
  try:
    study = module.get_study(arg or None)
  except ValueError as e:  # the study files' way of refusing an unknown variant
    raise StudyError(f"{path}: {e}") from None
  except Exception as e:  # noqa: BLE001 - a mistake in the file, said in one line
    raise StudyError(_broken_file_message(spec, path, e)) from None
  if not isinstance(study, Study):
    raise StudyError(f"{path}: get_study returned {type(study).__name__}, not a Study.")
  for run in study.runs():
    if "seed" in run and not isinstance(run["seed"], int):
      raise StudyError(f"{path}: seeds must be integers; got {run['seed']!r}.")
  return study


def _run_study_file(path: str):
  """The study file run as a module; a file that raises (a typo, a syntax error) is a
  :class:`StudyError` of one line, as ``scripts/train.py`` says it of a config file."""
  module_spec = importlib.util.spec_from_file_location("pipejax_study_file", path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except Exception as e:  # noqa: BLE001 - whatever the file raises, say it in one line
    raise StudyError(_broken_file_message(path, path, e)) from None
  return module


def _broken_file_message(spec: str, path: str, error: Exception) -> str:
  """``The study file 'X' could not be loaded: NameError: ... (line 12)``."""
  detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
  line = getattr(error, "lineno", None) if isinstance(error, SyntaxError) else None
  if line is None:  # the deepest frame of the study file itself
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if os.path.abspath(f.filename) == os.path.abspath(path)]
    line = frames[-1].lineno if frames else None
  where = f" (line {line})" if line and f"line {line}" not in detail else ""
  return (f"The study file {spec!r} could not be loaded: {type(error).__name__}: {detail}{where}. "
          "Fix the file, or give another --study.")


# ----------------------------------------------------------------------- a run's identity and flags


def key_of(overrides: Overrides) -> tuple:
  """The identity of a set of overrides, whatever the order of its keys: its ``(key, value as
  JSON text)`` pairs, sorted. A tuple and the list results.jsonl gives back are one value."""
  return tuple(sorted((k, json.dumps(v, sort_keys=True, default=str))
                      for k, v in overrides.items()))


def run_id(overrides: Overrides) -> str:
  """A run's identity as a file-name-safe name, e.g. 'method=pb,model_kwargs.depth=32,seed=0':
  its overrides in the order of their keys, so that one grid point has one id whichever order a
  grid lists its keys in. The launcher names runs and their records by it (their directories by
  :func:`directory_name`), and the report counts runs by it
  (``pipejax.study.records.load_results``).

  A character a file name cannot hold or a shell would split ('/', white space, control
  characters) is written as ``%XX``, and '%' itself as ``%25``, so that two values that differ
  only there ('a/b' and 'a_b', 'a b' and 'ab') keep two ids. A value or key that holds ',' or
  '=' could still make two grid points one id: :meth:`Study.runs` refuses such a grid.
  """
  return ",".join(f"{_escape(k)}={_escape(format_value(overrides[k]))}"
                  for k in sorted(overrides))


def _escape(text: str) -> str:
  """``text`` with each character of :data:`_ESCAPED`, control character or white space as the
  ``%XX`` of each of its UTF-8 bytes (a URL's percent-encoding, which decodes one way only)."""
  return "".join("".join(f"%{b:02X}" for b in c.encode())
                 if c in _ESCAPED or ord(c) < 0x20 or c.isspace() else c for c in text)


_ESCAPED = frozenset("%/\x7f")
NAME_MAX = 255
"""The longest file name, in bytes, that the common file systems take (ext4, XFS, APFS; NTFS
counts 255 UTF-16 units): the longest run directory name."""
_DIGEST_MARK = "%sha256="  # '%' followed by no hex digits: in no escaped id
_DIGEST_CHARS = 16


def directory_name(rid: str) -> str:
  """The name of run ``rid``'s directory: the id itself, or, for an id over :data:`NAME_MAX`
  bytes, its readable start and a digest of the whole id (``results.jsonl`` keeps the whole id).
  The two forms never meet: a digest's mark is in no escaped id."""
  if len(rid.encode()) <= NAME_MAX:
    return rid
  digest = hashlib.sha256(rid.encode()).hexdigest()[:_DIGEST_CHARS]
  room = NAME_MAX - len(_DIGEST_MARK) - _DIGEST_CHARS
  prefix = rid.encode()[:room].decode(errors="ignore")  # whole characters only
  return f"{prefix}{_DIGEST_MARK}{digest}"


def format_value(value: Any) -> str:
  """A value as the trainer's ``--config.KEY=VALUE`` flag takes it."""
  if isinstance(value, (tuple, list)):
    return "(" + ",".join(format_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  return str(value)


def trainer_flags(study: Study, overrides: Overrides) -> list[str]:
  """The trainer's ``--config.KEY=VALUE`` flags of one run: the study's fixed ones, then the
  grid's; a fixed key of another method's ``method_kwargs`` section than the run's is left out
  (the trainer refuses a flag that nothing reads)."""
  merged = {**study.fixed, **overrides}
  method = merged.get("method")
  unread = lambda k: (k in study.fixed and k.startswith("method_kwargs.") and method is not None
                      and k.split(".")[1] != method)
  return [f"--config.{k}={format_value(v)}" for k, v in merged.items() if not unread(k)]
