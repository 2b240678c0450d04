"""Every file a run or a study writes: whole files replaced atomically, under names of their own."""

import ast
import errno
import json
import os

import pytest

from pipejax import files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The folders whose modules write a run's or a study's workdir, and the figures' save.
WRITERS = ("pipejax/train", "pipejax/study", "pipejax/plotting.py")
# Writes that are neither a whole file nor a record: the stream a trainer's output goes to.
STREAMS = {("pipejax/study/launcher.py", "_start_trainer")}


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
  path = tmp_path / "summary.json"
  files.write_json(str(path), {"samples": 240}, indent=2)
  with pytest.raises(TypeError):  # a value json cannot write: nothing written
    files.write_json(str(path), {"samples": object()})

  def full(fd):
    raise OSError(errno.ENOSPC, "No space left on device")
  with monkeypatch.context() as patch:
    patch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
      files.write_json(str(path), {"samples": 480})
  assert json.loads(path.read_text()) == {"samples": 240}
  assert os.listdir(tmp_path) == ["summary.json"]


def test_two_writers_of_one_file_use_temporary_files_of_their_own(tmp_path):
  path = str(tmp_path / "report.md")
  with files.replacing(path) as first, files.replacing(path, suffix=".png") as second:
    assert first != second and os.path.dirname(first) == os.path.dirname(second) == str(tmp_path)
    assert second.endswith(".png")  # savefig picks the format by the name's end
    open(first, "w").write("first")
    open(second, "w").write("second")
  assert open(path).read() == "first" and os.listdir(tmp_path) == ["report.md"]  # renamed last
  files.write(path, "third")
  assert oct(os.stat(path).st_mode & 0o777) == oct(0o666 & ~_umask())  # not mkstemp's 0600


def _umask():
  mask = os.umask(0)
  os.umask(mask)
  return mask


def _write_calls(tree):
  """Each call in ``tree`` that writes a file, with the function it stands in: ``open`` in a
  writing mode, ``json.dump`` and ``os.replace`` / ``os.rename`` of a file."""
  found = []

  def visit(node, function):
    for child in ast.iter_child_nodes(node):
      name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
      if isinstance(child, ast.Call):
        func = ast.unparse(child.func)
        mode = child.args[1] if len(child.args) > 1 else next(
            (k.value for k in child.keywords if k.arg == "mode"), None)
        writing = isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax+")
        if (func == "open" and writing) or func in ("json.dump", "os.replace"):
          found.append((child, name))
      visit(child, name)
  visit(tree, None)
  return found


def test_every_workdir_write_goes_through_pipejax_files():
  """An ``open`` for writing is allowed on a temporary path that ``files.replacing`` gave, never
  on a workdir's file itself."""
  offending = []
  for entry in WRITERS:
    path = os.path.join(ROOT, entry)
    paths = [path] if path.endswith(".py") else [
        os.path.join(path, name) for name in sorted(os.listdir(path)) if name.endswith(".py")]
    for module in paths:
      tree = ast.parse(open(module).read())
      temporary = {item.optional_vars.id for node in ast.walk(tree) if isinstance(node, ast.With)
                   for item in node.items if isinstance(item.optional_vars, ast.Name)
                   and ast.unparse(item.context_expr.func if isinstance(item.context_expr,
                                                                         ast.Call) else
                                   item.context_expr) == "files.replacing"}
      relative = os.path.relpath(module, ROOT)
      for call, function in _write_calls(tree):
        first = call.args[0] if call.args else None
        if isinstance(first, ast.Name) and first.id in temporary:
          continue
        if (relative, function) in STREAMS:
          continue
        offending.append(f"{relative}:{call.lineno} ({function}): {ast.unparse(call)[:80]}")
  assert not offending, "write these through pipejax.files:\n" + "\n".join(offending)
