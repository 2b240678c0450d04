"""How :mod:`pipejax.chaos.trainer` judges a rerun against the uninterrupted run."""

import json

from pipejax.chaos import trainer


def _write_records(workdir, records):
  workdir.mkdir(exist_ok=True)
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_chaos_judges_runs_by_their_numbers_not_their_timing(tmp_path):
  """scripts/chaos.py's comparison: a rerun's records differ from the reference's in speed only."""
  records = [{"split": "train", "samples": 64, "loss": 2.25, "samples_per_second": 812.5},
             {"split": "test", "samples": 64, "loss": 2.5, "accuracy": 0.125}]
  _write_records(tmp_path / "reference", records)
  _write_records(tmp_path / "rerun", [{**records[0], "samples_per_second": 1.0}, records[1]])
  assert "samples_per_second" in trainer.TIMING_FIELDS
  assert trainer.comparable_records(tmp_path / "rerun") == \
      trainer.comparable_records(tmp_path / "reference")
  _write_records(tmp_path / "rerun", [records[0], {**records[1], "loss": 2.5 + 1e-6}])
  assert trainer.comparable_records(tmp_path / "rerun") != \
      trainer.comparable_records(tmp_path / "reference")
