"""A study's declaration: its grids, its runs' identities and its study file."""

import dataclasses
import os

import pytest

from pipejax.study import spec as study_lib
from pipejax.study.spec import Study

from tests.helpers import ROOT
from tests.study.helpers import STUDY


def test_grids_are_the_union_of_products_without_duplicates():
  study = Study(name="t", config="c.py", grids=[{"a": (1, 2), "b": ("x",)},
                                                {"a": (2, 3), "b": ("x",)}])
  assert [r["a"] for r in study.runs()] == [1, 2, 3]
  assert study_lib.run_id({"a": 1, "b": (1, 2)}) == "a=1,b=(1,2)"
  assert study_lib.trainer_flags(Study(name="t", config="c", grids=[], fixed={"epochs": 2.0}),
                                 {"model_kwargs.hidden": (64,)}) == [
                                     "--config.epochs=2.0", "--config.model_kwargs.hidden=(64,)"]


def test_a_missing_study_file_is_a_clear_error():
  with pytest.raises(study_lib.StudyError, match="No study file"):
    study_lib.load_study("configs/studies/nope.py")
  with pytest.raises(study_lib.StudyError, match=r"depth.py: Unknown study argument 'smok'"):
    study_lib.load_study(os.path.join(ROOT, "configs", "studies", "depth.py:smok"))


def test_every_study_file_loads_with_its_smoke_variant():
  folder = os.path.join(ROOT, "configs", "studies")
  files = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
  assert len(files) >= 2
  for name in files:
    for arg in ("", ":smoke"):
      study = study_lib.load_study(os.path.join(folder, name) + arg)
      assert study.runs() and os.path.isfile(os.path.join(ROOT, study.config.partition(":")[0]))


def test_a_section_that_is_not_one_is_refused_in_one_line():
  from pipejax.study import Section  # pylint: disable=import-outside-toplevel
  for sections, message in [((("Notes", "text"),), "each section must be a pipejax.study.Section"),
                            ((Section("  ", "text"),), "a section needs a title"),
                            ((Section(None, "text"),), "a section needs a title"),
                            ((Section("Notes", 3),), "must be markdown text or a function"),
                            (Section("Notes", "text"), "sections must be a list")]:
    with pytest.raises(study_lib.StudyError, match=message) as error:
      dataclasses.replace(STUDY, sections=sections)
    assert "\n" not in str(error.value)
