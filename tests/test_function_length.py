"""Every function of the package reads on one screen: at most 100 lines, docstring included."""

import ast
import pathlib

import pipejax

LIMIT = 100


def _functions(tree: ast.AST):
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      yield node


def test_no_function_is_longer_than_a_hundred_lines():
  root = pathlib.Path(pipejax.__file__).parent
  files = sorted(root.rglob("*.py"))
  assert len(files) > 30
  long = []
  for path in files:
    for function in _functions(ast.parse(path.read_text())):
      lines = function.end_lineno - function.lineno + 1
      if lines > LIMIT:
        long.append(f"{path.relative_to(root.parent)}:{function.lineno} {function.name}: "
                    f"{lines} lines")
  assert not long, "Split into helpers with one job each:\n" + "\n".join(long)


def test_the_measure_counts_a_function_from_its_def_to_its_last_line():
  source = "def f():\n" + "  x = 1\n" * (LIMIT - 1) + "\n\ndef g():\n  pass\n"
  lengths = {f.name: f.end_lineno - f.lineno + 1 for f in _functions(ast.parse(source))}
  assert lengths == {"f": LIMIT, "g": 2}
