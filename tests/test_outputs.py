"""Every binary of scripts/ checks its outputs before its work and ends a bad command line with
exit 2 in one paragraph (pipejax.files.unwritable, pipejax.cli.check_output, pipejax.cli.run);
a figure is written in the format its name ends in."""

import ast
import contextlib
import os
import random
import string
import subprocess
import sys

import pytest

from pipejax import cli, files, plotting
from tests.helpers import ROOT

SCRIPTS = sorted(name for name in os.listdir(os.path.join(ROOT, "scripts"))
                 if name.endswith(".py"))


def run_script(name, *args, timeout=300):
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args],
                        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})


def tree(path) -> list[str]:
  """Every path under ``path``, to see that a check made nothing."""
  return sorted(os.path.join(folder, name) for folder, dirs, names in os.walk(path)
                for name in dirs + names)


@contextlib.contextmanager
def read_only_directory(path):
  """``path`` made a directory nothing can be created in: a read-only tmpfs for root (who writes
  past permissions), its permissions for anyone else; skipped where neither works."""
  os.makedirs(path)
  if os.geteuid() != 0:
    os.chmod(path, 0o500)
    yield str(path)
    os.chmod(path, 0o700)
    return
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                    capture_output=True, check=False).returncode:
    pytest.skip("a read-only directory needs a tmpfs mount, which failed here")
  try:
    yield str(path)
  finally:
    subprocess.run(["umount", str(path)], check=False)


# --------------------------------------------------------------------------- the check itself


def test_an_output_that_cannot_be_written_is_named_and_the_check_makes_nothing(tmp_path):
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  existing = tmp_path / "a-directory"
  existing.mkdir()
  before = tree(tmp_path)
  assert "not a directory" in files.unwritable(str(blocker / "out.json"))
  assert "not a directory" in files.unwritable(str(blocker / "deeper" / "out"), directory=True)
  assert "is a directory" in files.unwritable(str(existing))
  assert "is a directory" in files.unwritable(str(tmp_path / "new") + os.sep)
  assert "is a file" in files.unwritable(str(blocker), directory=True)
  assert "empty" in files.unwritable("")
  assert "longer than" in files.unwritable(str(tmp_path / ("x" * 252 + ".json")))
  assert "longer than" in files.unwritable(str(tmp_path / ("d" * 300) / "out"), directory=True)
  assert "'.txt'" in files.unwritable(str(tmp_path / "curves.txt"), suffixes=(".png", ".pdf"))
  assert "not a directory" in files.unwritable(str(tmp_path / "new" / ".." / "a-file" / "x"))
  assert "longer than" in files.unwritable(str(tmp_path / ("d" * 300) / ".." / "out.json"))
  assert files.unwritable(str(tmp_path / "new" / "deeper" / "out.json")) is None
  assert files.unwritable(str(tmp_path / "new" / "deeper"), directory=True) is None
  assert files.unwritable(str(tmp_path / "curves.PDF"), suffixes=(".png", ".pdf")) is None
  assert tree(tmp_path) == before  # nothing made, nothing left behind by the probe
  with read_only_directory(tmp_path / "read-only") as read_only:
    assert "cannot be written" in files.unwritable(os.path.join(read_only, "out.json"))
    assert "cannot be written" in files.unwritable(os.path.join(read_only, "a", "b"),
                                                   directory=True)


def _random_path(rng, root, blocker, existing, read_only):
  """A path of random parts, some of which stand in the way of a write."""
  parts = [rng.choice([root, root, blocker, existing] + ([read_only] if read_only else []))]
  for _ in range(rng.randint(0, 3)):
    parts.append(rng.choice([
        "".join(rng.choices(string.ascii_letters + "-_. é", k=rng.randint(1, 12))),
        "x" * rng.choice([200, 240, 256, 300]), "a-directory", "a-file", "..", "."]))
  path = os.path.join(*parts)
  return path + (os.sep if rng.random() < 0.1 else "")


def _writes(path: str, directory: bool) -> bool:
  """Whether a real write of ``path`` works: its directories made, then the file written as the
  scripts write it (``files.write``, a temporary file beside it), or a file written into it."""
  try:
    if directory:
      os.makedirs(path, exist_ok=True)
      files.write(os.path.join(path, "report.md"), "x")
    else:
      if os.path.basename(path) in ("", ".", "..") or os.path.isdir(path):
        return False
      os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
      files.write(path, "x")
  except OSError:
    return False
  return True


@pytest.mark.parametrize("seed", range(3))
def test_fuzz_the_check_of_an_output_agrees_with_a_real_write(tmp_path, seed):
  """Random paths through files, directories, long names and a read-only directory: the check
  says a path can be written exactly when a real write of it then works, and the check itself
  makes nothing."""
  rng = random.Random(seed)
  root = tmp_path / "root"
  root.mkdir()
  (root / "a-file").write_text("")
  (root / "a-directory").mkdir()
  with contextlib.ExitStack() as stack:
    try:
      read_only = stack.enter_context(read_only_directory(tmp_path / "read-only"))
    except pytest.skip.Exception:
      read_only = None
    for trial in range(60):
      path = _random_path(rng, str(root), str(root / "a-file"), str(root / "a-directory"),
                          read_only)
      directory = rng.random() < 0.5
      before = tree(tmp_path)
      verdict = files.unwritable(path, directory=directory)
      assert tree(tmp_path) == before, (trial, path)
      assert (verdict is None) == _writes(path, directory), (trial, path, directory, verdict)


def test_check_output_makes_the_directories_and_says_what_to_do(tmp_path):
  cli.check_output("output", str(tmp_path / "a" / "b" / "out.json"))
  assert (tmp_path / "a" / "b").is_dir() and not (tmp_path / "a" / "b" / "out.json").exists()
  (tmp_path / "f").write_text("")
  with pytest.raises(cli.app.UsageError, match=r"^--out=.*/f/x cannot be written: .* Nothing was "
                     r"run; give a directory path that can be written\.$"):
    cli.check_output("out", str(tmp_path / "f" / "x"), directory=True)


@pytest.mark.parametrize("suffix,magic", [(".pdf", b"%PDF"), (".svg", b"<?xml"),
                                          (".png", b"\x89PNG"), ("", b"\x89PNG")])
def test_a_figure_is_written_in_the_format_its_name_ends_in(tmp_path, suffix, magic):
  fig, ax = plotting.pyplot().subplots()
  ax.plot([0, 1], [1, 0])
  path = tmp_path / f"curves{suffix}"
  plotting.save(fig, str(path))
  assert path.read_bytes().startswith(magic)
  assert os.listdir(tmp_path) == [path.name]
  assert {".png", ".pdf", ".svg"} <= set(plotting.figure_suffixes())


# ------------------------------------------------------------------------- one exit code


def test_every_script_runs_its_main_through_cli_run():
  """cli.run is what turns a flag absl cannot parse into exit 2; app.run would exit 1."""
  for name in SCRIPTS:
    tree_ = ast.parse(open(os.path.join(ROOT, "scripts", name)).read())
    calls = {ast.unparse(node.func) for node in ast.walk(tree_) if isinstance(node, ast.Call)}
    assert "cli.run" in calls and "app.run" not in calls, name


def test_a_flag_absl_cannot_parse_is_exit_2_in_one_line(tmp_path):
  script = tmp_path / "tool.py"
  script.write_text(
      "from absl import flags\nfrom pipejax import cli\n"
      "_N = flags.DEFINE_integer('parallel', 1, 'How many.')\n"
      "_R = flags.DEFINE_string('study', None, 'Which.')\n"
      "flags.mark_flag_as_required('study')\n"
      "def main(argv):\n  print('ran', _N.value)\n"
      "cli.run(main)\n")
  def run(*args):
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=60, check=False)
  for args in (["--study=a", "--paralel=2"], ["--study=a", "--parallel=two"], ["--parallel=2"]):
    result = run(*args)
    assert result.returncode == 2, (args, result.stderr)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and line.endswith("(--help lists the flags.)"), line
    assert "ran" not in result.stdout
  assert run("--study=a", "--parallel=3").stdout == "ran 3\n"
  for asked in ("--help", "--helpfull", "-?"):  # absl's help exits 1, as a failure would
    result = run(asked)
    assert result.returncode == 0 and "--parallel" in result.stdout, (asked, result.stderr)


# A flag of each script, and for those that take a typed value a value of another type: a
# malformed flag. A misspelling of a flag's name is an unknown one.
TYPED_FLAG = {"api_docs.py": "output_dir", "benchmark.py": "samples",
              "benchmark_report.py": "check", "chaos.py": "trials", "depth_limits.py": "batch",
              "mechanism.py": "points", "mechanism_report.py": "dir", "phase_diagram.py": "out",
              "plot.py": "x", "price.py": "blocks", "quadratic.py": "format",
              "schedule.py": "num_stages", "study.py": "parallel", "train.py": "workdir"}
MALFORMED = {"samples": "two", "check": "maybe", "trials": "ten", "batch": "1.5", "points": "x",
             "x": "minutes", "format": "yaml", "num_stages": "four", "parallel": "two",
             "blocks": "thirty"}
FAST_SCRIPTS = ("study.py", "schedule.py", "mechanism_report.py")  # the others: slow


def _bad_command_line(rng, name):
  flag = TYPED_FLAG[name]
  if flag in MALFORMED and rng.random() < 0.5:
    return [f"--{flag}={MALFORMED[flag]}"]
  cut = rng.randrange(len(flag))
  return [f"--{flag[:cut] + flag[cut + 1:] + rng.choice(['', 'l', 's'])}=2"]


@pytest.mark.parametrize("name", [name if name in FAST_SCRIPTS else
                                  pytest.param(name, marks=pytest.mark.slow) for name in SCRIPTS])
def test_fuzz_a_mistyped_or_malformed_flag_is_exit_2_in_one_line(name):
  """A seeded draw of a misspelt flag name or a value of the wrong type, for each script."""
  assert set(TYPED_FLAG) == set(SCRIPTS), "give the new script a flag here"
  rng = random.Random(name)
  args = _bad_command_line(rng, name)
  result = run_script(name, *args, timeout=120)
  assert result.returncode == 2, (args, result.stderr[-2000:])
  assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr, args
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# ------------------------------------------------------------------ outputs before the work


# Each script's output flag ("figure": --output, a figure), whether it names a directory, and
# what else its command line needs.
OUTPUTS = {
    "benchmark.py": ("output", False, ["--only=compile", "--compile_stages=4"]),
    "mechanism.py": ("output_dir", True, ["--config=configs/char_lm.py:smoke", "--sequences=16",
                                          "--points=2"]),
    "plot.py": ("figure", False, ["--workdirs=/nonexistent"]),
    "phase_diagram.py": ("out", True, []),
    "schedule.py": ("figure", False, ["--schedule=pb"]),
    "api_docs.py": ("output_dir", True, ["--modules=pipejax.files"]),
    "depth_limits.py": ("output", False, ["--config=configs/deep_mlp.py:smoke"]),
    "quadratic.py": ("output_dir", True, ["--methods=sgd", "--momenta=0.9", "--delays=0"]),
    "benchmark_report.py": ("folder", True, []),
    "chaos.py": ("workdir", True, ["--cases=trainer", "--trials=1"]),
    "price.py": ("output", False, ["--blocks=2"]),
}
DATA_LOSS = ("benchmark.py", "mechanism.py")  # they measured for hours before looking


def _bad_output(rng, tmp_path, directory: bool, figure: bool) -> str:
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  (tmp_path / "a-directory").mkdir()
  kinds = ["under a file", "too long", "file for directory" if directory else "a directory"]
  kind = rng.choice(kinds + ["an ending no figure has"] * (2 * figure))
  if kind == "an ending no figure has":
    return str(tmp_path / rng.choice(["curves.txt", "curves", "curves.png.bak"]))
  if kind == "under a file":
    return str(blocker / "out" / ("x" if directory else "x.json"))
  if kind == "too long":
    return str(tmp_path / ("n" * 300) / ("" if directory else "x.json"))
  return str(blocker if directory else tmp_path / "a-directory")


@pytest.mark.parametrize("name", [name if name in DATA_LOSS else
                                  pytest.param(name, marks=pytest.mark.slow) for name in OUTPUTS])
def test_fuzz_an_output_that_cannot_be_written_is_exit_2_before_any_work(tmp_path, name):
  """A seeded draw of an output in the way of a write, for each script that writes one: exit 2
  naming the flag, before anything is measured or read, and nothing made."""
  flag, directory, rest = OUTPUTS[name]
  figure = flag == "figure"
  flag = "output" if figure else flag
  path = _bad_output(random.Random(name), tmp_path, directory, figure)
  before = tree(tmp_path)
  result = run_script(name, f"--{flag}={path}", *rest, timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  assert f"--{flag}=" in result.stderr and "Nothing was run" in result.stderr, result.stderr
  assert "Traceback" not in result.stderr
  assert tree(tmp_path) == before


@pytest.mark.parametrize("name,args,says", [
    ("benchmark.py", ["--only=methods", "--methods=pb,pb_nope"], "--methods names pb_nope"),
    ("benchmark.py", ["--only=throughput", "--micro_batch_sizes=1,one"],
     "--micro_batch_sizes takes positive whole numbers"),
    ("api_docs.py", ["--modules=pipejax.no_such_module"], "--modules names "
                                                          "'pipejax.no_such_module'")])
def test_a_name_a_script_does_not_know_is_exit_2_before_any_work(tmp_path, name, args, says):
  result = run_script(name, *args, f"--output_dir={tmp_path / 'api'}" if name == "api_docs.py"
                      else f"--output={tmp_path / 'out.json'}", timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.startswith("error: ") and says in result.stderr, result.stderr
  assert "Traceback" not in result.stderr and not (tmp_path / "out.json").exists()


def test_phase_diagram_refuses_an_unwritable_safe_ranges_file_before_reading_and_makes_nothing(
    tmp_path):
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  result = run_script("phase_diagram.py", f"--out={tmp_path / 'phase'}",
                      f"--safe_ranges={blocker / 'ranges.json'}", timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  assert "--safe_ranges=" in result.stderr and "Nothing was run" in result.stderr
  assert not (tmp_path / "phase").exists()
