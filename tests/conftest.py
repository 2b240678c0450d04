"""The order in which the suite's files are handed to pytest-xdist's workers.

scripts/test.sh gives each worker whole files (``--dist loadfile``), the next file to whichever
worker is free. Handed out longest first, the last files to finish are short ones and the workers
end together; pytest-xdist's own order (most tests first) left a 140-second file of ten tests near
the end. The list is a scheduling hint only: a file missing from it, or a stale order, changes
when a test runs, never what it checks.
"""

import os

# The longest files of a `bash scripts/test.sh --durations=0` run on a 2-core CPU, longest first
# (test seconds there: 218 to 32). The rest follow in collection order.
LONGEST_FIRST = (
    "parallel/test_sharding.py",
    "train/test_training.py",
    "parallel/test_stacking.py",
    "parallel/test_multihost.py",
    "core/test_engine.py",
    "models/test_models.py",
    "test_docs.py",
    "study/test_launcher.py",
    "study/test_report.py",
    "models/test_lm.py",
    "methods/test_presets.py",
    "train/test_reliability_data.py",
    "study/test_faults.py",
    "train/test_reliability.py",
    "optim/test_transforms.py",
    "analysis/test_quadratic.py",
    "profiling/test_profiling.py",
    "models/test_online_norm.py",
    "optim/test_delayed_updates.py",
)
TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  file_of = lambda item: os.path.relpath(str(item.path), TESTS).replace(os.sep, "/")
  items.sort(key=lambda item: rank.get(file_of(item), len(rank)))  # stable: in-file order kept
