"""What the trainer's test files share: one finished run per module, to copy and damage."""

import pytest

from pipejax.train import trainer
from tests.helpers import digits_config


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished digits run: 240 samples, checkpoints every 40 (those at 160, 200 and 240 samples
  are kept)."""
  workdir = str(tmp_path_factory.mktemp("finished") / "run")
  summary = trainer.train_and_evaluate(digits_config(), workdir)
  return workdir, summary
