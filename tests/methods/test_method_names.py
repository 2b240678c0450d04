"""Only the preset modules name the presets: every other module asks a preset what a method is."""

import ast
import pathlib

import pipejax
from pipejax import methods
from pipejax import schedules

ROOT = pathlib.Path(pipejax.__file__).parent
# Where a method's name is the name of something else. pipejax/config.py is the default config,
# a config like those of configs/.
OTHER_MEANINGS = {
    "pipejax/config.py": "the default config's choice of method and base update",
    "pipejax/schedules": "the timetables 'pb' and 'pipedream' of pipejax.schedules",
    "pipejax/optim": "a transformation named for the paper that defines it, in its messages",
    "pipejax/core/accounting.py": "the asynchronous timetable's name, as in pipejax.schedules",
}


def _names_compared(tree: ast.AST):
  """``(line, what, method name)`` of each comparison with a method's name, and of each tuple,
  list, set or dict that collects two or more method names (a classification by name); a
  module's ``__all__`` lists names of its own (``optim.nesterov_asyncpp``), not methods."""
  exported = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)}
  for node in ast.walk(tree):
    if id(node) in exported:
      continue
    if isinstance(node, ast.Compare):
      operands = [node.left, *node.comparators]
      for operand in operands:
        for const in ast.walk(operand):
          if isinstance(const, ast.Constant) and const.value in methods.METHODS:
            others = " ".join(ast.unparse(o) for o in operands if o is not operand)
            yield node.lineno, others, const.value
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
      items = node.keys if isinstance(node, ast.Dict) else node.elts
      names = [item.value for item in items
               if isinstance(item, ast.Constant) and item.value in methods.METHODS]
      if len(names) >= 2:
        yield node.lineno, f"a {type(node).__name__.lower()} of method names", names[0]


def test_no_module_compares_or_collects_methods_by_name_outside_their_records():
  # Callers ask methods.preset_of (or the Method) what a method is; only the presets name them.
  root = ROOT
  presets = pathlib.Path(methods.__file__).parent
  files = [f for f in [*root.rglob("*.py"), *(root.parent / "scripts").glob("*.py")]
           if presets not in f.parents]
  assert len(files) > 30
  found = []
  for path in files:
    for line, other, name in _names_compared(ast.parse(path.read_text())):
      if name in methods.BASE_OPTIMIZERS and "optimizer" in other:
        continue  # 'sgd' the base optimizer, not the method
      if name in schedules.NAMES and "schedule" in str(path):
        continue  # 'pb' the timetable of pipejax.schedules, not the method
      found.append(f"{path.relative_to(root.parent)}:{line}: {other} vs {name!r}")
  assert not found, "\n".join(found)


def test_the_name_test_catches_a_tuple_and_a_set_of_method_names():
  tree = ast.parse("A = ('pb', 'pb_sc')\nB = {'sgd', 'pipedream'}\nC = ('pb', 'x')\n")
  assert [line for line, _, _ in _names_compared(tree)] == [1, 2]


def _single_names(tree: ast.AST):
  """``(line, statement, method name)`` of each string constant that is a method's name; a
  module's ``__all__`` lists names of its own, not methods."""
  exported = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)}
  for statement in ast.walk(tree):
    if not isinstance(statement, ast.stmt) or id(getattr(statement, "value", None)) in exported:
      continue
    inner = {id(n) for child in ast.iter_child_nodes(statement) if isinstance(child, ast.stmt)
             for n in ast.walk(child)}
    for node in ast.walk(statement):
      if id(node) not in inner and isinstance(node, ast.Constant) and \
          node.value in methods.METHODS:
        yield node.lineno, ast.unparse(statement).split("\n")[0], node.value


def test_no_module_of_the_package_names_a_method_outside_the_presets():
  # A name in a module is a classification by name waiting to go stale: a caller takes it from
  # the presets (methods.PLAIN_PIPELINE, methods.RECOMMENDED, a trait), or from its config.
  presets = pathlib.Path(methods.__file__).parent
  found = []
  for path in ROOT.rglob("*.py"):
    where = str(path.relative_to(ROOT.parent))
    if presets in path.parents or any(where.startswith(p) for p in OTHER_MEANINGS):
      continue
    for line, statement, name in _single_names(ast.parse(path.read_text())):
      if name in methods.BASE_OPTIMIZERS and "optimizer" in statement:
        continue  # 'sgd' the base update, not the method
      found.append(f"{where}:{line}: {name!r} in {statement}")
  assert not found, "\n".join(found)


def test_the_name_test_catches_a_single_name_in_a_call_an_assignment_and_a_default():
  tree = ast.parse("make('pb', 1)\nMETHOD = 'pb_sc_lwp'\ndef f(m='sgd'):\n  return m\n"
                   "__all__ = ['pipemare']\nx = 'pbx'\n")
  assert [(line, name) for line, _, name in _single_names(tree)] == [
      (1, "pb"), (2, "pb_sc_lwp"), (3, "sgd")]
