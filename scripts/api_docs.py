r"""Builds the API reference from the docstrings (pdoc) and checks that every public name has one.

    python scripts/api_docs.py                   # writes api/ (not committed): api/index.html
    python scripts/api_docs.py --output_dir=/tmp/api

The reference covers the public face, ``pipejax``, and the packages under it. A name is public when
its package lists it in ``__all__``; each must have a docstring of its own: a module's or a
class's or function's ``__doc__`` (not the one ``dataclasses`` or ``NamedTuple`` make up), and for a
constant the string right after its assignment. The script fails (exit 1) on a public name without
one and on any warning pdoc gives while rendering, so that ``tests/test_api.py`` keeps the
reference whole.
"""

import ast
import importlib
import inspect
import os
import pathlib
import re
import sys
import warnings

from absl import app, flags

from pipejax import cli

PACKAGES = ("pipejax", "pipejax.config", "pipejax.core", "pipejax.methods", "pipejax.optim",
            "pipejax.parallel", "pipejax.train", "pipejax.study", "pipejax.data",
            "pipejax.models")
# pdoc evaluates every annotation and warns where it cannot, then shows the annotation as written.
# It evaluates a NamedTuple's generated ``__init__`` outside the module that wrote the annotations
# (``from __future__ import annotations`` keeps them as text), and third-party aliases (optax's
# ``Params``, flax's initializers) in their own modules, so that these warnings say nothing about
# the docstrings; every other warning fails the build.
_UNEVALUATED_ANNOTATION = re.compile(r"^Error parsing type annotation ")

_OUTPUT_DIR = flags.DEFINE_string("output_dir", "api", "Where to write the HTML reference.")
_MODULES = flags.DEFINE_list("modules", list(PACKAGES), "The modules to document and check.")


def _own_docstring(obj) -> str:
  """``obj``'s docstring, or '' when it has none of its own."""
  if inspect.isclass(obj):
    doc = obj.__dict__.get("__doc__") or ""
    # dataclasses and NamedTuple write the signature where a class has no docstring.
    return "" if doc.startswith(f"{obj.__name__}(") else doc
  return getattr(obj, "__doc__", None) or ""


def _variable_docstring(module_name: str, name: str, depth: int = 0) -> str:
  """The string after ``name``'s assignment, in ``module_name`` or where it imports it from."""
  module = importlib.import_module(module_name)
  path = getattr(module, "__file__", None)
  if path is None or depth > 5:
    return ""
  with open(path) as f:
    body = ast.parse(f.read(), path).body
  for statement, following in zip(body, body[1:] + [None]):
    targets = (statement.targets if isinstance(statement, ast.Assign) else
               [statement.target] if isinstance(statement, ast.AnnAssign) else [])
    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
      if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) and
          isinstance(following.value.value, str)):
        return following.value.value
      return ""
    if isinstance(statement, ast.ImportFrom) and statement.module and not statement.level and \
        any((alias.asname or alias.name) == name for alias in statement.names):
      return _variable_docstring(statement.module, name, depth + 1)
  return ""


def undocumented(module_name: str) -> list[str]:
  """The names of ``module_name.__all__`` without a docstring of their own."""
  module = importlib.import_module(module_name)
  missing = []
  for name in getattr(module, "__all__", ()):
    value = getattr(module, name)
    if inspect.ismodule(value) or inspect.isclass(value) or callable(value):
      doc = _own_docstring(value)
    else:
      doc = _variable_docstring(module_name, name)
    if not doc.strip():
      missing.append(f"{module_name}.{name}")
  return missing


def build(modules, output_dir: str) -> list[str]:
  """Renders ``modules`` into ``output_dir``; returns pdoc's warnings."""
  import pdoc  # pylint: disable=import-outside-toplevel
  import pdoc.render  # pylint: disable=import-outside-toplevel
  exported = set()
  for module_name in modules:  # the face's names are imported when first used: use each once
    module = importlib.import_module(module_name)
    for name in getattr(module, "__all__", ()):
      if inspect.ismodule(getattr(module, name)):
        exported.add(f"{module_name}.{name}")
  # A package that its parent's ``__all__`` names is rendered with the parent, and only once.
  roots = [name for name in modules if name not in exported]
  pdoc.render.configure(docformat="google", math=True)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pdoc.pdoc(*roots, output_directory=pathlib.Path(output_dir))
  return sorted({str(w.message) for w in caught
                 if not _UNEVALUATED_ANNOTATION.search(str(w.message))})


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  cli.check_output("output_dir", _OUTPUT_DIR.value, directory=True)
  for module_name in _MODULES.value:
    try:
      importlib.import_module(module_name)
    except ImportError as e:
      raise app.UsageError(f"--modules names {module_name!r}, which cannot be imported ({e}); "
                           f"give modules of pipejax, e.g. {','.join(PACKAGES[:2])}.") from None
  problems = [f"no docstring: {name}" for module_name in _MODULES.value
              for name in undocumented(module_name)]
  problems += [f"pdoc: {message}" for message in build(_MODULES.value, _OUTPUT_DIR.value)]
  for problem in problems:
    print(problem, file=sys.stderr)
  if problems:
    sys.exit(1)
  print(f"wrote {os.path.join(_OUTPUT_DIR.value, 'index.html')}")


if __name__ == "__main__":
  cli.run(main)
