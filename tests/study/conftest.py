"""The study tests' fixtures."""

import sys

import pytest

from tests.study.helpers import FAKE_TRAINER


@pytest.fixture
def fake_trainer(tmp_path):
  path = tmp_path / "fake_train.py"
  path.write_text(FAKE_TRAINER)
  return lambda mode: (sys.executable, str(path), mode)
