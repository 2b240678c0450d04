"""A run's identity: one id per grid point and one grid point per id, and a directory name that
fits the file system, while results.jsonl keeps the whole id."""

import glob
import json
import os
import sys

import pytest

from pipejax.study import launcher
from pipejax.study import records as study_records
from pipejax.study import spec as study_lib
from pipejax.study.spec import Study, StudyError, Table

from tests.helpers import ROOT
from tests.study.helpers import FAKE_TRAINER


def _study(values, key="data_dir"):
  return Study(name="ids", config="configs/default.py:smoke",
               grids=[{"method": ("sgd",), "seed": (0,), key: tuple(values)}],
               baseline={"method": "sgd"}, tables=[Table("runs", "", "", kind="cells")])


def _run(tmp_path, study):
  trainer = tmp_path / "fake_train.py"
  trainer.write_text(FAKE_TRAINER)
  workdir = tmp_path / "study"
  code = launcher.main(study, str(workdir), parallel=1, command="",
                       trainer=(sys.executable, str(trainer), "finish"))
  return code, workdir


@pytest.mark.parametrize("values", [("a/b", "a_b"), ("a b", "ab"), ("x/y z", "x_yz"),
                                    ("50%", "50%25")])
def test_values_that_differ_only_in_a_slash_a_space_or_an_escape_keep_two_runs(tmp_path, values):
  ids = [study_lib.run_id({"data_dir": v}) for v in values]
  assert len(set(ids)) == 2, ids
  code, workdir = _run(tmp_path, _study(values))
  assert code == 0
  runs = study_records.read_results(str(workdir))
  assert sorted(r.overrides["data_dir"] for r in runs) == sorted(values)
  assert len([n for n in os.listdir(workdir / "runs") if not n.startswith(".")]) == 2


def test_a_run_id_too_long_for_a_file_name_trains_in_a_directory_that_fits(tmp_path):
  long_values = ("d/" + "x" * 300, "d/" + "x" * 299 + "y")  # the same first 255 bytes
  rids = [study_lib.run_id({"data_dir": v, "method": "sgd", "seed": 0}) for v in long_values]
  assert all(len(rid.encode()) > study_lib.NAME_MAX for rid in rids)
  code, workdir = _run(tmp_path, _study(long_values))
  assert code == 0
  names = sorted(n for n in os.listdir(workdir / "runs") if not n.startswith("."))
  assert len(names) == 2 and all(len(n.encode()) <= study_lib.NAME_MAX for n in names)
  assert all(n.startswith("data_dir=d%2Fxxxx") for n in names)  # readable: the id's start
  # results.jsonl keeps each run's whole identity.
  lines = [json.loads(line) for line in (workdir / "results.jsonl").read_text().splitlines()]
  assert sorted(line["run"] for line in lines) == sorted(rids)
  assert sorted(line["overrides"]["data_dir"] for line in lines) == sorted(long_values)


def test_a_directory_name_is_the_id_itself_up_to_the_limit_and_never_another_ids():
  short = "a=" + "x" * (study_lib.NAME_MAX - 2)
  assert study_lib.directory_name(short) == short
  longer = short + "x"
  name = study_lib.directory_name(longer)
  assert len(name.encode()) <= study_lib.NAME_MAX and name != longer
  # Cut on whole UTF-8 characters: the name decodes, and is not an id of its own.
  wide = study_lib.run_id({"a": "é" * 200})
  assert study_lib.directory_name(wide).encode().decode() == study_lib.directory_name(wide)
  assert "%sha256=" not in study_lib.run_id({"a": "%sha256=" + "0" * 16})


@pytest.mark.parametrize("grids", [
    [{"reference.lr": (0.1, "0.1")}],  # one flag, two values: 'reference.lr=0.1' twice
    [{"data_dir": ("x,seed=1",)}, {"data_dir": ("x",), "seed": (1,)}],  # a ',' reads as a key
])
def test_grid_points_that_would_share_a_run_id_are_refused_when_the_study_is_made(grids):
  with pytest.raises(StudyError, match="would have one run id"):
    Study(name="clash", config="c.py", grids=grids)


def test_every_committed_record_still_matches_a_grid_point_of_its_study():
  """The escape changes no id of an ordinary value: each study's records (results.jsonl, the
  whole identity of each run) still find their grid points."""
  checked = 0
  for path in sorted(glob.glob(os.path.join(ROOT, "configs", "studies", "*.py"))):
    name = os.path.splitext(os.path.basename(path))[0]
    workdir = os.path.join(ROOT, "docs", "studies", name)
    if not os.path.exists(os.path.join(workdir, "results.jsonl")):
      continue
    ids = {study_lib.run_id(run) for run in study_lib.load_study(path).runs()}
    records = study_records.read_results(workdir)
    unmatched = [r.run for r in records if r.run not in ids]
    assert not unmatched, f"{name}: {unmatched[:3]}"
    # Written as the records hold them: no committed id is escaped.
    assert all("%" not in r.run for r in records)
    checked += len(records)
  assert checked > 500
