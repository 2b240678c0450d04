"""Outside the module that resolves a run's plan, few functions take the raw config.

:func:`pipejax.train.plan.resolve` reads a training config once (with the field checks it calls,
``pipejax/train/config_checks.py``, and the fields themselves, ``pipejax/config.py``); everything
downstream takes the :class:`~pipejax.train.plan.RunPlan`. A function elsewhere that takes the
``ml_collections.ConfigDict`` reads it again, and each is one more place a setting can be read
differently: only the entries where a user hands in a config (which resolve it once) remain.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The module that resolves the plan, the field checks it calls, and the config's fields.
RESOLVING = {"pipejax/train/plan.py", "pipejax/train/config_checks.py", "pipejax/config.py"}
MOST = 5
# The entries where a user hands in a config; each resolves it once and passes the plan on.
ENTRIES = {"pipejax/train/trainer.py train_and_evaluate"}
# A parameter annotated as one of these is not a ConfigDict, whatever its name.
NOT_A_CONFIG = ("str", "Sequence", "int", "dict", "Mapping", "list", "tuple", "RunPlan")


def _uses_config(function: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> bool:
  """Whether ``function`` reads its parameter ``name`` as a config (``name.FIELD``,
  ``name.get(...)``, ``name[...]``) or hands it on to a call."""
  for node in ast.walk(function):
    if isinstance(node, (ast.Attribute, ast.Subscript)) and \
        isinstance(node.value, ast.Name) and node.value.id == name:
      return True
    if isinstance(node, ast.Call) and any(
        isinstance(a, ast.Name) and a.id == name
        for a in [*node.args, *(k.value for k in node.keywords)]):
      return True
  return False


def raw_config_functions(tree: ast.AST) -> list[tuple[int, str]]:
  """``(line, name)`` of each function with a parameter annotated ``ConfigDict``, or named
  ``config`` (unannotated, or annotated as a config) and read as one or handed on."""
  found = []
  for node in ast.walk(tree):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
    for argument in arguments:
      annotation = ast.unparse(argument.annotation) if argument.annotation else ""
      if "ConfigDict" in annotation or (
          argument.arg == "config" and not any(kind in annotation for kind in NOT_A_CONFIG)
          and _uses_config(node, argument.arg)):
        found.append((node.lineno, node.name))
        break
  return found


def test_the_scan_finds_a_config_read_and_passes_a_path_or_a_plan():
  tree = ast.parse("def a(config):\n  return config.method\n"
                   "def b(c: ml_collections.ConfigDict):\n  pass\n"
                   "def c(config: str):\n  return config.partition(':')\n"
                   "def d(config):\n  return 1\n"
                   "def e(plan: RunPlan):\n  return plan.method\n")
  assert [name for _, name in raw_config_functions(tree)] == ["a", "b"]


def test_at_most_five_functions_outside_the_plan_take_the_raw_config():
  found = []
  for path in sorted([*(ROOT / "pipejax").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]):
    where = path.relative_to(ROOT).as_posix()
    if where in RESOLVING:
      continue
    found += [(f"{where} {name}", line) for line, name in raw_config_functions(
        ast.parse(path.read_text()))]
  assert len(found) <= MOST, "\n".join(f"{name} (line {line})" for name, line in found)
  # A new one takes the plan instead (pipejax.train.plan.resolve, once, where the config enters).
  assert {name for name, _ in found} == ENTRIES, found
