"""The package's layers (docs/architecture.md §3): no import goes up a layer or round a circle.

Every import of every module of ``pipejax/`` is read with ``ast``: those at the top, inside
functions and under ``TYPE_CHECKING`` alike, since each of them ties the two modules together.
"""

import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "pipejax")


def module_names() -> dict[str, str]:
  """Every module of the package: its dotted name to its file."""
  names = {}
  for folder, _, files in os.walk(PACKAGE):
    for file in files:
      if file.endswith(".py"):
        path = os.path.join(folder, file)
        parts = os.path.relpath(path, ROOT)[:-len(".py")].split(os.sep)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return names


def imports_of(name: str, path: str, modules) -> set[str]:
  """The package's modules that ``name`` imports, wherever in the file the import stands."""
  is_package = path.endswith("__init__.py")
  found = set()
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.split(".")[0] == "pipejax")
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = name.split(".")[:len(name.split(".")) - node.level + is_package]
        source = ".".join(base + ([node.module] if node.module else []))
      else:
        source = node.module or ""
      if source.split(".")[0] != "pipejax":
        continue
      for alias in node.names:  # a submodule by name, or a name defined in `source`
        found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
  return found - {name}


def import_graph() -> dict[str, set[str]]:
  modules = module_names()
  return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layers() -> list[tuple[str, ...]]:
  """The units of each layer, lowest first, as docs/architecture.md §3 lists them."""
  with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
    text = f.read()
  start = text.index("## 3. The layers")
  rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", text[start:text.index("\n## ", start)], re.M)
  assert [int(number) for number, _ in rows] == list(range(1, len(rows) + 1))
  return [tuple(re.findall(r"`([\w.]+)`", units)) for _, units in rows]


def unit_of(module: str) -> str:
  """``pipejax.core.engine`` -> ``core``; the package's own ``__init__`` is ``__init__``."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def test_the_layers_name_every_unit_of_the_package_once():
  units = [unit for layer in layers() for unit in layer]
  assert len(units) == len(set(units)), f"a unit is in two layers: {units}"
  missing = {unit_of(module) for module in module_names()} - set(units)
  assert not missing, f"docs/architecture.md §3 gives no layer to {sorted(missing)}"


def test_no_module_imports_a_higher_layer_or_a_neighbour_of_its_own():
  rank = {unit: number for number, layer in enumerate(layers()) for unit in layer}
  wrong = []
  for module, imported in sorted(import_graph().items()):
    for target in sorted(imported):
      own, other = unit_of(module), unit_of(target)
      if own != other and rank[other] >= rank[own]:
        wrong.append(f"{module} (layer {rank[own] + 1}) imports {target} (layer {rank[other] + 1})")
  assert not wrong, "imports against the layers of docs/architecture.md §3:\n" + "\n".join(wrong)


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, on_stack, stack, circles = {}, {}, set(), [], []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for nxt in graph.get(node, ()):
      if nxt not in index:
        visit(nxt)
        low[node] = min(low[node], low[nxt])
      elif nxt in on_stack:
        low[node] = min(low[node], index[nxt])
    if low[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      if len(component) > 1:
        circles.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return circles


def test_no_import_circle():
  circles = import_circles(import_graph())
  assert not circles, f"modules that import each other, directly or through others: {circles}"


def test_an_import_circle_is_found():
  # The check itself: a type-only import back from the runner would close engine -> runner.
  graph = import_graph()
  assert "pipejax.core.runner" in graph["pipejax.core.engine"]
  graph["pipejax.core.runner"] = graph["pipejax.core.runner"] | {"pipejax.core.engine"}
  assert ["pipejax.core.engine", "pipejax.core.runner"] in import_circles(graph)


def test_an_import_inside_a_function_is_read(tmp_path):
  path = tmp_path / "late.py"
  path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                  "  from pipejax.core import engine\n"
                  "def f():\n  from pipejax.train.trainer import train\n")
  modules = module_names()
  assert imports_of("pipejax.core.late", str(path), modules) == {
      "pipejax.core.engine", "pipejax.train.trainer"}


@pytest.mark.parametrize("modules", [("pipejax.config",), ("pipejax.study",),
                                     ("pipejax",), ("pipejax.study.report",)])
def test_light_modules_load_without_jax(modules):
  # Every config file imports pipejax.config and every study file pipejax.study; scripts/study.py
  # loads dozens of them, and rewrites reports, without starting JAX.
  code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
          "import pipejax\npipejax.config\n"
          "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)\n")
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, check=False)
  assert result.returncode == 0, result.stderr


def test_every_name_of_the_public_face_resolves():
  import pipejax  # pylint: disable=import-outside-toplevel
  for name in pipejax.__all__:
    assert getattr(pipejax, name) is not None, name
  assert set(pipejax.__all__) <= set(dir(pipejax))
  with pytest.raises(AttributeError, match="no attribute 'engine'"):
    pipejax.engine  # pylint: disable=pointless-statement
