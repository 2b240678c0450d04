"""The public face as tools read it: the names a static reader sees, and the API reference.

``pipejax/__init__.py`` imports its names when first used; a type checker, an IDE or pdoc does not
run it and reads the same names from its ``TYPE_CHECKING`` block instead. ``scripts/api_docs.py``
renders the reference and fails on a public name without a docstring or on a warning of pdoc's.
"""

import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest

import pipejax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _type_checking_imports() -> dict[str, tuple[str, str]]:
  """The names the face's ``if TYPE_CHECKING:`` block imports: name -> (module, its name there)."""
  with open(os.path.join(ROOT, "pipejax", "__init__.py")) as f:
    tree = ast.parse(f.read())
  (block,) = [node for node in tree.body if isinstance(node, ast.If) and
              ast.unparse(node.test) == "TYPE_CHECKING"]
  names = {}
  for node in block.body:
    assert isinstance(node, ast.ImportFrom) and not node.level, ast.unparse(node)
    for alias in node.names:
      # `import X as X` is how a type checker knows the name is re-exported, not used.
      assert alias.asname == alias.name, ast.unparse(node)
      names[alias.name] = (node.module, alias.name)
  return names


def test_static_readers_see_every_name_of_the_face_as_it_is_at_run_time():
  imports = _type_checking_imports()
  assert sorted(imports) == sorted(pipejax.__all__)
  for name, (module, original) in imports.items():
    assert getattr(pipejax, name) is getattr(importlib.import_module(module), original), name


def test_a_type_checker_sees_the_face(tmp_path):
  if importlib.util.find_spec("pyright") is None:
    pytest.skip("pyright is not installed (pip install -e '.[test]')")
  probe = tmp_path / "probe.py"
  probe.write_text("import pipejax\n" + "".join(f"reveal_type(pipejax.{name})\n"
                                                for name in pipejax.__all__))
  (tmp_path / "pyrightconfig.json").write_text(json.dumps({"extraPaths": [ROOT],
                                                           "include": ["probe.py"]}))
  result = subprocess.run([sys.executable, "-m", "pyright", "--outputjson", "--pythonpath",
                           sys.executable, "-p", str(tmp_path)], capture_output=True, text=True,
                          check=False, cwd=tmp_path, timeout=300)
  try:
    report = json.loads(result.stdout)
  except json.JSONDecodeError:  # pyright fetches its node package on first use
    pytest.skip(f"pyright did not start: {result.stdout[-500:]} {result.stderr[-500:]}")
  revealed = [d["message"] for d in report["generalDiagnostics"] if d["severity"] == "information"]
  assert len(revealed) == len(pipejax.__all__), report
  # Through the module's __getattr__ alone every name would be `Any` (or `Any | ModuleType`).
  unseen = [message for message in revealed if 'is "Any' in message]
  assert not unseen, unseen


def _api_docs(*args, path=()):
  pythonpath = os.pathsep.join([ROOT, *path, os.environ.get("PYTHONPATH", "")])
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "api_docs.py"), *args],
                        capture_output=True, text=True, check=False, cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": pythonpath})


def test_the_api_reference_builds_without_warnings_and_documents_every_public_name(tmp_path):
  result = _api_docs(f"--output_dir={tmp_path}")
  assert result.returncode == 0, result.stderr[-5000:]
  for package in ("core", "methods", "optim", "parallel", "train", "study", "data", "models"):
    assert (tmp_path / "pipejax" / f"{package}.html").is_file(), package
  face = (tmp_path / "pipejax.html").read_text()
  assert "StackedPipeline" in face and "make_method" in face


def test_the_api_reference_refuses_a_public_name_without_a_docstring(tmp_path):
  package = tmp_path / "plain"
  package.mkdir()
  (package / "__init__.py").write_text(
      '"""A package."""\nimport dataclasses\nfrom typing import NamedTuple\n'
      '__all__ = ["LIMIT", "NOTED", "Point", "State", "f", "g"]\n'
      'LIMIT = 3\nNOTED = 4\n"""A constant with its docstring."""\n'
      '@dataclasses.dataclass\nclass Point:\n  x: int\n'
      'class State(NamedTuple):\n  count: int\n'
      'def f():\n  pass\ndef g():\n  """Documented."""\n')
  result = _api_docs(f"--output_dir={tmp_path / 'api'}", "--modules=plain",
                     path=(str(tmp_path),))
  assert result.returncode == 1
  assert sorted(line for line in result.stderr.splitlines() if line.startswith("no docstring")) \
      == [f"no docstring: plain.{name}" for name in ("LIMIT", "Point", "State", "f")]
