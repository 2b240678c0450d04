"""Each package of pipejax imports on its own, in a fresh interpreter, whatever was or was not
imported before it, by an import statement or as an attribute of ``pipejax``."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def _fresh(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": ROOT}, check=False, timeout=300)


@pytest.mark.parametrize("code", [
    "import pipejax.methods\nassert pipejax.methods.make_method('pb', learning_rate=0.1)",
    "import pipejax\nassert pipejax.methods.make_method('pb', learning_rate=0.1)\n"
    "assert pipejax.study.Study",
])
def test_pipejax_methods_imports_alone_in_a_fresh_interpreter(code):
  result = _fresh(code)
  assert result.returncode == 0, result.stderr[-3000:]


def test_a_name_that_is_no_package_of_pipejax_is_still_an_attribute_error():
  result = _fresh("import pipejax\ntry:\n  pipejax.engine\nexcept AttributeError as e:\n"
                  "  print(e)\n")
  assert result.stdout.strip() == "module 'pipejax' has no attribute 'engine'", result.stderr
