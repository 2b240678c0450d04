"""The docs hold: every cited page and section exists, and every documented command runs as written.

Commands are collected from the README, CONTRIBUTING, docs/*.md and the docstrings of configs/ and
scripts/. They are written for the virtualenv the README's set-up creates, activated (``source
.venv/bin/activate``), so ``python`` is the interpreter that has pipejax: here, the one running the
tests.
"""

import ast
import glob
import importlib
import importlib.util
import json
import os
import re
import runpy
import shlex
import subprocess
import sys

from absl import flags

from pipejax.train import plan as plan_lib
from pipejax import config as configlib
from pipejax.train import metrics
import pytest

from tests.helpers import ROOT
# The developers' brief the project grew from; the project says things in its own pages instead.
BRIEF = "DESIGN" + ".md"
SKIP_DIRS = {".git", ".venv", "runs", "workdirs", "build", "__pycache__", ".pytest_cache"}
DOC_PAGES = ["README.md", "CONTRIBUTING.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# "docs/design.md §2, §3": a page, then the sections cited in it.
CITATION = re.compile(r"(docs/[\w-]+\.md)((?:(?:\s*,\s*|\s+and\s+|\s+)§\d+(?:\.\d+)*)*)")
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")


def read(path):
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    return f.read()


def project_text_files():
  """Relative paths of the repository's text files (what a clone holds, without build output)."""
  for folder, dirs, files in os.walk(ROOT):
    dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
    for name in files:
      path = os.path.relpath(os.path.join(folder, name), ROOT)
      try:
        read(path)
      except UnicodeDecodeError:
        continue  # figures and other binaries
      yield path


def headings(path):
  """Section numbers of a page: '## 2. Title' gives '2', '### 2.1 Title' gives '2.1'."""
  return set(re.findall(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", read(path), flags=re.M))


# ----------------------------------------------------------------------------- citations


def test_design_page_has_numbered_sections():
  sections = headings("docs/design.md")
  assert {str(n) for n in range(1, 11)} <= sections
  assert {"2.1", "2.3", "2.5", "3.3", "3.4", "3.7"} <= sections


def test_every_cited_page_and_section_exists():
  cited = 0
  for path in project_text_files():
    text = read(path)
    covered = set()
    for match in CITATION.finditer(text):
      page = match.group(1)
      assert os.path.exists(os.path.join(ROOT, page)), f"{path} cites {page}, which is missing"
      for section in SECTION.findall(match.group(2)):
        assert section in headings(page), f"{path} cites {page} §{section}, which is missing"
        cited += 1
      covered.update(range(*match.span(2)))
    for match in SECTION.finditer(text):
      if path == os.path.join("docs", "design.md"):  # the page's references to itself
        assert match.group(1) in headings(path), f"{path} cites its own §{match.group(1)}"
      else:
        assert match.start() in covered, (
            f"{path} cites §{match.group(1)} without naming the page: write "
            f"'docs/design.md §{match.group(1)}'")
  assert cited >= 20


def test_relative_links_of_the_pages_exist():
  for page in DOC_PAGES:
    for target in re.findall(r"\]\(([^)\s]+)\)", read(page)):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      path = os.path.join(ROOT, os.path.dirname(page), target.split("#")[0])
      assert os.path.exists(path), f"{page} links to {target}, which is missing"


def test_nothing_cites_the_developers_brief():
  offenders = [path for path in project_text_files()
               if os.path.basename(path) != BRIEF and BRIEF in read(path)]
  assert not offenders, f"{offenders} mention {BRIEF}; cite docs/design.md's sections instead"
  root = os.path.realpath(ROOT)
  leaves = lambda base, ref: not os.path.realpath(os.path.join(base, ref)).startswith(root + os.sep)
  # A path is read from the page's folder, or from the repository's root when it names nothing
  # there.
  outside = [(page, ref) for page in DOC_PAGES
             for ref in re.findall(r"(?:\.\./)+[\w./-]+", read(page))
             if leaves(os.path.join(root, os.path.dirname(page)), ref) or (
                 not os.path.exists(os.path.join(root, os.path.dirname(page), ref))
                 and leaves(root, ref))]
  assert not outside, f"{outside}: paths outside the repository, which a clone does not hold"


def test_the_module_map_names_every_module_of_the_package():
  text = read("docs/architecture.md")
  start = text.index("## 2. The module map")
  named = set(re.findall(r"`([\w.]+)`", text[start:text.index("\n## ", start)]))
  modules = set()
  for path in glob.glob(os.path.join(ROOT, "pipejax", "**", "*.py"), recursive=True):
    parts = os.path.relpath(path, os.path.join(ROOT, "pipejax"))[:-len(".py")].split(os.sep)
    modules.add(".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else
                ".".join(parts))
  from pipejax import methods  # pylint: disable=import-outside-toplevel
  presets = {f"methods.{name}" for name in methods.METHODS}  # the row `methods.NAME` names them
  missing = sorted(modules - named - presets)
  assert not missing, f"docs/architecture.md §2 does not name {missing}: give each its one job"
  # And every row names a module that exists: the map never keeps one that was moved or removed.
  rows = set(re.findall(r"^\| `([\w.]+)` \|", text[start:text.index("\n## ", start)], re.M))
  stale = sorted(rows - modules - {"methods.NAME"})
  assert not stale, f"docs/architecture.md §2 has rows for modules that do not exist: {stale}"


# ----------------------------------------------------------------------------- commands


def documented_command_lines():
  """(where, line) of every command the pages and docstrings show, continuation lines joined."""
  sources = []
  for page in DOC_PAGES:
    text = read(page)
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)
    sources += [(page, block) for block in blocks]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    sources += [(page, span) for span in re.findall(r"`([^`\n]+)`", prose)
                if re.match(r"(\w+=\S+ )*(python|bash) ", span)]
  for path in sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.py"), recursive=True)
                     + glob.glob(os.path.join(ROOT, "scripts", "*.py"))):
    docstring = ast.get_docstring(ast.parse(read(path))) or ""
    lines = [l.strip() for l in docstring.splitlines()]
    sources += [(os.path.relpath(path, ROOT), "\n".join(
        l for l in lines if re.match(r"(\w+=\S+ )*(python|bash) ", l) or l.startswith("--")))]
  for where, text in sources:
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
      if line.strip():
        yield where, line.strip()


def simple_commands(line):
  """The commands of a shell line as token lists (split at && and ;), env assignments dropped."""
  try:
    tokens = shlex.split(line, comments=True)
  except ValueError:  # a line that opens a quote closed on another (a remote ssh command)
    tokens = shlex.split(line.replace('"', ""), comments=True)
  command = []
  for token in tokens + ["&&"]:
    if token in ("&&", ";"):
      while command and re.match(r"\w+=", command[0]):
        command = command[1:]
      if command:
        yield command
      command = []
    else:
      command.append(token)


def documented_commands():
  """(where, tokens) of every documented python or bash command."""
  for where, line in documented_command_lines():
    for tokens in simple_commands(line):
      if tokens[0] in ("python", "bash") or "python" in tokens[0]:
        yield where, tokens


def train_default_args():
  """What scripts/train_default.sh passes to scripts/train.py before the user's arguments."""
  exec_line = [l for l in read("scripts/train_default.sh").splitlines() if l.startswith("exec ")]
  tokens = shlex.split(exec_line[0])
  assert tokens[2] == "scripts/train.py" and tokens[-1] == "$@", exec_line
  return tokens[3:-1]


def as_script_call(tokens):
  """(script, args) of a documented command, with train_default.sh as the train.py it runs."""
  if tokens[:2] == ["bash", "scripts/train_default.sh"]:
    return "scripts/train.py", train_default_args() + tokens[2:]
  if tokens[0] == "python" and tokens[1].startswith("scripts/"):
    return tokens[1], tokens[2:]
  return None, None


def reads_a_config_file(script):
  """Whether ``script`` takes a ``--config`` file (``config_flags.DEFINE_config_file``)."""
  with open(os.path.join(ROOT, script), encoding="utf-8") as f:
    return "DEFINE_config_file" in f.read()


def test_every_binary_with_a_config_file_parses_its_flags_through_the_config_parser():
  # Only pipejax.config.parse_flags lets --config.method_kwargs.METHOD.KEY add a key the config
  # file does not list; without it the key is a KeyError from deep inside ml_collections.
  scripts = [f"scripts/{name}" for name in sorted(os.listdir(os.path.join(ROOT, "scripts")))
             if name.endswith(".py") and reads_a_config_file(f"scripts/{name}")]
  assert "scripts/train.py" in scripts and len(scripts) >= 3
  for script in scripts:
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
      assert "flags_parser=configlib.parse_flags" in f.read(), script


def parse_flags(script, args):
  """Defines ``script``'s absl flags, parses ``args`` as the script would; returns the values.

  The script's own flags are removed again afterwards, so that scripts whose flags share names
  can be checked one after the other in this process.
  """
  module = "documented_command"
  before, was_parsed = set(flags.FLAGS), flags.FLAGS.is_parsed()
  cwd, argv = os.getcwd(), sys.argv
  os.chdir(ROOT)  # commands are run from the repository root
  sys.argv = [script] + args  # ml_collections reads the --config.* overrides from here
  try:
    runpy.run_path(os.path.join(ROOT, script), run_name=module)
    # A binary with a config file parses through pipejax.config.parse_flags (new model keywords).
    uses_config_parser = reads_a_config_file(script)
    (configlib.parse_flags if uses_config_parser else flags.FLAGS)(list(sys.argv))
    return {name: flags.FLAGS[name].value for name in set(flags.FLAGS) - before}
  finally:
    os.chdir(cwd)
    sys.argv = argv
    for name in set(flags.FLAGS) - before:
      if flags.FLAGS.find_module_defining_flag(name) == module or name.startswith("config."):
        delattr(flags.FLAGS, name)
    if not was_parsed:
      flags.FLAGS.unparse_flags()


def test_commands_are_found_everywhere_they_are_documented():
  where = {w for w, _ in documented_commands()}
  assert {"README.md", "CONTRIBUTING.md", "docs/distributed.md", "docs/quadratic.md",
          "configs/default.py", "configs/mnist1d.py", "scripts/train.py", "scripts/plot.py",
          "scripts/quadratic.py", "scripts/schedule.py", "scripts/benchmark.py"} <= where


def test_documented_commands_are_written_for_the_activated_virtualenv():
  for path in DOC_PAGES + [os.path.relpath(p, ROOT) for p in
                           glob.glob(os.path.join(ROOT, "configs", "**", "*.py"), recursive=True)
                           + glob.glob(os.path.join(ROOT, "scripts", "*.py"))]:
    text = read(path)
    if path.endswith(".py"):  # the docstring documents; the code may set PYTHONPATH for children
      text = ast.get_docstring(ast.parse(text)) or ""
    assert ".venv/bin/python" not in text and "PYTHONPATH" not in text, (
        f"{path}: write commands as `python ...`, for the activated virtualenv")
  for where, tokens in documented_commands():
    assert tokens[0] in ("python", "bash"), f"{where}: {' '.join(tokens)}"
  readme = read("README.md")
  assert "source .venv/bin/activate" in readme
  # The set-up is introduced before the first command that needs the virtualenv.
  assert readme.index("source .venv/bin/activate") < readme.index("python scripts/")


def test_documented_commands_name_real_scripts_configs_and_flags():
  from pipejax.train import config_checks  # pylint: disable=import-outside-toplevel
  checked = 0
  for where, tokens in documented_commands():
    if tokens[0] == "python" and tokens[1] == "-m":
      assert importlib.util.find_spec(tokens[2]), f"{where}: no module {tokens[2]}"
      continue
    script = tokens[1]
    assert os.path.exists(os.path.join(ROOT, script)), f"{where}: no {script}"
    script, args = as_script_call(tokens)
    if script is None:  # scripts/test.sh (pytest's arguments), scripts/setup_env.sh
      continue
    try:
      values = parse_flags(script, args)
    except flags.Error as e:
      pytest.fail(f"{where}: `{' '.join(tokens)}` does not parse: {e}")
    if script == "scripts/train.py":
      plan_lib.resolve(values["config"])
    checked += 1
  assert checked >= 25


def readme_training_commands():
  """The distinct training commands of the README, in order."""
  commands = []
  for where, tokens in documented_commands():
    if where == "README.md" and as_script_call(tokens)[0] == "scripts/train.py" and \
        tokens not in commands:
      commands.append(tokens)
  assert len(commands) >= 4
  return commands


def test_readme_training_runs_each_have_their_own_workdir():
  workdirs = []
  for tokens in readme_training_commands():
    _, args = as_script_call(tokens)
    workdirs.append([a.split("=", 1)[1] for a in args if a.startswith("--workdir=")][-1])
  assert len(set(workdirs)) == len(workdirs), workdirs


# ----------------------------------------------------------------------------- smoke runs


def smoke_variant(args, tmp_path):
  """The arguments of a documented run as a smoke run writing under ``tmp_path``."""
  out = []
  for arg in args:
    name, _, value = arg.partition("=")
    if name == "--config" and ":" not in value:
      value += ":smoke"
    elif name in ("--workdir", "--output"):
      value = str(tmp_path / value)
    elif name == "--workdirs":
      value = ",".join(str(tmp_path / v) for v in value.split(","))
    out.append(f"{name}={value}" if value else name)
  return out


def activated_env():
  """The environment of a shell with the virtualenv activated: ``python`` is this Python."""
  env = dict(os.environ)
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
  env["VIRTUAL_ENV"] = os.path.dirname(os.path.dirname(sys.executable))
  return env


@pytest.mark.slow
def test_readme_training_and_plot_commands_run_as_smoke_runs(tmp_path):
  from pipejax.train import trainer  # pylint: disable=import-outside-toplevel
  commands = readme_training_commands()
  # One through a real shell as a user types it: the default config's, the quickest smoke run. The
  # others in this process, through the binary's own flag parsing and its train_and_evaluate, and
  # shorter still than the smoke runs (one chunk): they differ from the first in their config,
  # which is what they check.
  shell_tokens = next(t for t in commands
                      if t[0] == "python" and "--config=configs/default.py" in t)
  script, args = as_script_call(shell_tokens)
  line = shlex.join(["python", script] + smoke_variant(args, tmp_path))
  result = subprocess.run(["bash", "-c", line], cwd=ROOT, env=activated_env(),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "FINAL test_accuracy=" in result.stdout
  for tokens in commands:
    if tokens is shell_tokens:
      continue
    script, args = as_script_call(tokens)
    values = parse_flags(script, smoke_variant(args, tmp_path) + [
        "--config.max_train_examples=250", "--config.max_test_examples=100",
        "--config.plot_curves=False"])  # the plot commands below draw from metrics.jsonl
    summary = trainer.train_and_evaluate(values["config"], values["workdir"])
    assert summary["stopped_by"] is None and 0 <= summary["test_accuracy"] <= 1
  # The README's plot commands, over the runs just made.
  plots = [tokens for where, tokens in documented_commands()
           if where == "README.md" and tokens[1:2] == ["scripts/plot.py"]]
  assert plots
  for tokens in plots:
    args = smoke_variant(tokens[2:], tmp_path)
    result = subprocess.run(["bash", "-c", shlex.join(["python", tokens[1]] + args)], cwd=ROOT,
                            env=activated_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    output = [a.split("=", 1)[1] for a in args if a.startswith("--output=")][0]
    with open(output, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  summary = json.loads((tmp_path / "runs" / "pb" / "summary.json").read_text())
  assert summary["method"] == "pb"


def test_plot_defaults_to_epochs_and_to_axes_that_show_the_end_of_training(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(json.dumps({"max_train_examples": 0, "epochs": 10.0}))
  assert metrics.samples_per_epoch(str(workdir)) is None  # running: no summary yet
  (workdir / "summary.json").write_text(json.dumps({"total_samples": 600000}))
  assert metrics.samples_per_epoch(str(workdir)) == 60000
  (workdir / "config.json").write_text(json.dumps({"max_train_examples": 2000, "epochs": 1.0}))
  assert metrics.samples_per_epoch(str(workdir)) == 2000
  # Accuracy climbs from 0.1 to about 0.88: the axis shows the last 70% of each run, where two
  # runs 0.01 apart differ, not the climb.
  epochs = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
  first = (epochs, [0.1, 0.7, 0.8, 0.84, 0.86, 0.87, 0.875, 0.878, 0.88, 0.881, 0.882])
  second = (epochs, [0.1, 0.6, 0.75, 0.82, 0.85, 0.86, 0.865, 0.868, 0.87, 0.871, 0.872])
  low, high = metrics.zoomed_limits([first, second], 0.3, log=False)
  assert 0.8 < low < 0.82 and 0.882 < high < 0.89
  low, high = metrics.zoomed_limits([first], 0.0, log=False)
  assert low < 0.1 and high > 0.882
  assert metrics.zoomed_limits([([], [])], 0.3, log=True) is None


# ----------------------------------------------------------------------------- examples


def python_blocks(path):
  return re.findall(r"```python\n(.*?)```", read(path), flags=re.S)


def test_readme_python_examples_run():
  blocks = python_blocks("README.md")
  assert blocks
  for block in blocks:
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - our own docs
  assert "forward_params" in namespace


def test_readme_python_examples_use_only_the_public_face():
  # `import pipejax` is the user's whole surface: the examples name nothing behind it.
  import pipejax  # pylint: disable=import-outside-toplevel
  for block in python_blocks("README.md"):
    for node in ast.walk(ast.parse(block)):
      if isinstance(node, ast.Import):
        assert all(a.name.split(".")[0] != "pipejax" or a.name == "pipejax" for a in node.names), \
            ast.unparse(node)
      elif isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == "pipejax":
        assert node.module == "pipejax", ast.unparse(node)
        assert {a.name for a in node.names} <= set(pipejax.__all__), ast.unparse(node)
      elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
          node.value.id == "pipejax":
        assert node.attr in pipejax.__all__, ast.unparse(node)


@pytest.mark.parametrize("index", range(5))
def test_optax_guide_examples_run(index):
  # Each block of docs/optax.md is a complete program: a user copies one, not the page.
  blocks = python_blocks("docs/optax.md")
  assert len(blocks) == 5
  exec(compile(blocks[index], f"docs/optax.md, example {index + 1}", "exec"), {})  # noqa: S102


def _modules_with_examples(skip_packages=("pipejax.optim", "pipejax.schedules")):
  """Every pipejax module whose docstrings hold doctest examples (the skipped packages run
  theirs in tests/optim/test_transforms.py and tests/schedules/test_schedules.py)."""
  names = []
  for path in sorted(glob.glob(os.path.join(ROOT, "pipejax", "**", "*.py"), recursive=True)):
    with open(path) as f:
      if ">>> " not in f.read():
        continue
    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
    if not module.startswith(skip_packages):
      names.append(module)
  return names


@pytest.mark.parametrize("module_name", _modules_with_examples())
def test_docstring_examples_run(module_name):
  import doctest  # pylint: disable=import-outside-toplevel
  result = doctest.testmod(importlib.import_module(module_name),
                           optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0


def test_readme_is_an_entry_page_not_a_logbook():
  # What it is, the two commands, one example, one table of results, where to go next.
  lines = read("README.md").splitlines()
  assert len(lines) <= 150, f"README.md has {len(lines)} lines: move reference into docs/"
  assert len(python_blocks("README.md")) == 1
  assert sum(1 for line in lines if line.startswith("|---")) == 1


def test_no_reference_page_is_over_five_hundred_lines():
  # Reference pages stay readable; what grows with measurements lives in generated reports
  # (docs/studies/*/report.md, docs/benchmarks/README.md), which this leaves out.
  long = {os.path.basename(path): n for path in glob.glob(os.path.join(ROOT, "docs", "*.md"))
          if (n := len(read(os.path.relpath(path, ROOT)).splitlines())) > 500}
  assert not long, f"Split or trim these pages to at most 500 lines: {long}"


def test_ci_runs_exactly_the_readme_test_command():
  readme = read("README.md")
  ci = read(os.path.join(".ci", "run"))
  assert "bash scripts/test.sh" in readme
  commands = [l.strip() for l in ci.splitlines() if l.strip() and not l.startswith("#")]
  assert commands[-1] == "bash scripts/test.sh"


def test_the_suites_longest_first_order_names_files_that_exist():
  """tests/conftest.py's scheduling hint: a renamed or moved file would fall to the back. Read from
  the file's text: pytest loads conftest files itself, and they are not for importing."""
  (order,) = [ast.literal_eval(node.value)
              for node in ast.parse(read(os.path.join("tests", "conftest.py"))).body
              if isinstance(node, ast.Assign) and node.targets[0].id == "LONGEST_FIRST"]
  assert len(set(order)) == len(order) >= 10
  missing = [name for name in order if not os.path.isfile(os.path.join(ROOT, "tests", name))]
  assert not missing, f"tests/conftest.py's LONGEST_FIRST names files that are gone: {missing}"
  assert "--no-loadscope-reorder" in read(os.path.join("scripts", "test.sh"))
