"""The README's Python examples run as written, and its commands agree with CI."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks(path):
  return re.findall(r"```python\n(.*?)```", open(path).read(), flags=re.S)


def test_readme_python_examples_run():
  blocks = python_blocks(os.path.join(ROOT, "README.md"))
  assert len(blocks) >= 2
  for block in blocks:
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - our own docs
  assert "forward_params" in namespace


def test_ci_runs_exactly_the_readme_test_command():
  readme = open(os.path.join(ROOT, "README.md")).read()
  ci = open(os.path.join(ROOT, ".ci", "run")).read()
  assert "bash scripts/test.sh" in readme
  commands = [l.strip() for l in ci.splitlines() if l.strip() and not l.startswith("#")]
  assert commands[-1] == "bash scripts/test.sh"
