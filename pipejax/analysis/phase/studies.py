"""Reading the studies: each workdir's records, its study file's unit, and the runs of that study.

"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from pipejax.analysis import depth_limits
from pipejax.study.records import RunRecord, load_results
from pipejax.study.spec import Study, StudyError, higher_is_better, load_study, run_id


# Config fields that change what a run logs, not what it trains: a run that sets one is the same
# run as its twin without it (the depth study's 8-stage runs with ``diagnostics`` repeat seed 0
# of each method to the last digit), and is counted once.
MEASUREMENT_ONLY = ("diagnostics",)


CURVATURE_FILE = "limits.jsonl"  # scripts/depth_limits.py's records, beside results.jsonl


# start-up warning's ranges are generated from (pipejax/methods/safe_ranges.json).
DEFAULT_STUDIES = ("docs/studies/depth", "docs/studies/lm_depth", "docs/studies/lm_regime",
                   "docs/studies/mlp_regime")


class PhaseError(ValueError):
  """A study the phase diagram cannot read; the message says why and what to do."""


class StudyMismatchError(PhaseError):
  """A workdir's records are not runs of the study file paired with it: a user's error that no
  note may hide, since the diagram would read them in another study's unit."""


@dataclasses.dataclass(frozen=True)
class Unit:
  """How a study reports its metric: ``metric`` (a record field) times ``scale`` is in ``name``;
  ``margin`` (in ``name``) is its non-inferiority margin, None where it declares none."""

  metric: str
  scale: float
  name: str
  # Not part of a unit's identity: studies in one unit share its tables and its figure's panel,
  # and each row's verdict takes its own study's margin.
  margin: float | None = dataclasses.field(default=None, compare=False)

  @property
  def higher_is_better(self) -> bool:
    return higher_is_better(self.metric)

  def gap(self, value: float, reference: float) -> float:
    """``value``'s distance behind ``reference`` in this unit: positive when it is worse."""
    worse = reference - value if self.higher_is_better else value - reference
    return worse * self.scale


def unit_of(study: Study) -> Unit:
  """The unit of ``study``'s gaps: its first gap table's metric, scale and unit (points for an
  accuracy at scale 100), else its first table's, an accuracy in points without tables; and the
  study's margin in that unit."""
  tables = [t for t in study.tables if t.kind == "gap"] or list(study.tables)
  metric, scale, name = ((tables[0].metric, tables[0].scale, tables[0].unit_name) if tables
                         else ("test_accuracy", 100.0, "points"))
  # Rounded: a margin declared in nats comes out of the conversion to bits a float error away
  # from the one it states.
  margin = None if study.margin is None else round(study.margin * scale, 9)
  return Unit(metric, scale, name, margin)


@dataclasses.dataclass
class Source:
  """One study's records, its name and unit, and its curvature readings (may be empty)."""

  workdir: str
  name: str
  unit: Unit
  records: list[RunRecord]
  curvature: list[dict]
  problems: list[str] = dataclasses.field(default_factory=list)


def study_file_of(workdir: str) -> str:
  """Where a study workdir's study file is by the project's convention: ``docs/studies/NAME`` is
  ``configs/studies/NAME.py``'s."""
  return os.path.join("configs", "studies", os.path.basename(os.path.normpath(workdir)) + ".py")


def read_study(workdir: str, study_file: str | None = None, unit: Unit | None = None) -> Source:
  """The records of the study in ``workdir``; its name and unit from ``study_file`` (default
  :func:`study_file_of`) unless ``unit`` is given.

  Records that are not runs of the study file (not its grid points, or of another config) are
  left out with a note; when none is, the pairing is refused.

  Raises:
    PhaseError: no such workdir, no ``results.jsonl`` in it, or a study file that cannot be read.
    StudyMismatchError: none of the records is a run of the study file.
  """
  path = os.path.join(workdir, "results.jsonl")
  if not os.path.isdir(workdir):
    raise PhaseError(f"No study workdir {workdir!r}: the phase diagram reads its results.jsonl. "
                     "Give the directory a study was run in (scripts/study.py --workdir), or "
                     "leave it out of --studies.")
  if not os.path.isfile(path):
    raise PhaseError(f"{workdir!r} holds no results.jsonl: no run of a study has finished there "
                     "yet. Run the study first (scripts/study.py --workdir=" f"{workdir}), or "
                     "leave it out of --studies.")
  name = os.path.basename(os.path.normpath(workdir))
  records, problems = load_results(workdir)
  if unit is None:
    spec = study_file or study_file_of(workdir)
    try:
      study = load_study(spec)
    except StudyError as e:
      raise PhaseError(f"The unit of the study in {workdir!r} comes from its study file, and "
                       f"{e} Give the file as WORKDIR=STUDY_FILE in --studies.") from None
    name, unit = study.name, unit_of(study)
    records, foreign = runs_of_study(records, study, spec, workdir)
    problems += foreign
  curvature = depth_limits.read_records(os.path.join(workdir, CURVATURE_FILE))
  return Source(workdir, name, unit, records, curvature, problems)


def runs_of_study(records: Sequence[RunRecord], study: Study, spec: str,
                  workdir: str) -> tuple[list[RunRecord], list[str]]:
  """The records that are runs of ``study`` (its grid points, of its config), and a note on those
  left out.

  Raises:
    StudyMismatchError: there are records and none is a run of ``study``.
  """
  grid = {run_id(o) for o in study.runs()}
  kept = [r for r in records if r.run in grid and r.config == study.config]
  if records and not kept:
    configs = ", ".join(sorted({str(r.config) for r in records}))
    raise StudyMismatchError(
        f"None of the {len(records)} records in {workdir!r} is a run of the study file {spec!r} "
        f"(its config {study.config!r} and its grid; the records' config: {configs}): the phase "
        "diagram would read them in that study's unit. Pair each workdir with the study file it "
        "was run from (WORKDIR=STUDY_FILE in --studies).")
  left = len(records) - len(kept)
  notes = [f"{left} of its {len(records)} records are not runs of {spec} (not a grid point of it, "
           "or of another config): left out."] if left else []
  return kept, notes
