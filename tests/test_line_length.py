"""Every line of the project's Python reads without scrolling: at most 100 characters."""

import pathlib

from tests.helpers import ROOT

LIMIT = 100
FOLDERS = ("pipejax", "scripts", "configs", "tests")


def long_lines(root: pathlib.Path) -> list[str]:
  """'FILE:LINE (N characters)' for each line over LIMIT in the *.py files under FOLDERS."""
  found = []
  for folder in FOLDERS:
    for path in sorted((root / folder).rglob("*.py")):
      name = path.relative_to(root).as_posix()
      for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if len(line) > LIMIT:
          found.append(f"{name}:{number} ({len(line)} characters)")
  return found


def test_no_line_is_longer_than_a_hundred_characters():
  long = long_lines(pathlib.Path(ROOT))
  assert not long, f"Wrap these lines to at most {LIMIT} characters:\n" + "\n".join(long)


def test_the_measure_counts_characters_not_bytes_in_python_files_only(tmp_path):
  (tmp_path / "pipejax" / "core").mkdir(parents=True)
  (tmp_path / "scripts").mkdir()
  (tmp_path / "scripts" / "s.py").write_text("x = 1\n" + "#" * LIMIT + "\n" + "β" * LIMIT + "\n"
                                             + "y" * (LIMIT + 1) + "\n", encoding="utf-8")
  (tmp_path / "pipejax" / "core" / "c.py").write_text("z" * (LIMIT + 1) + "\n")
  (tmp_path / "pipejax" / "m.txt").write_text("z" * (LIMIT + 1) + "\n")
  assert long_lines(tmp_path) == [f"pipejax/core/c.py:1 ({LIMIT + 1} characters)",
                                  f"scripts/s.py:4 ({LIMIT + 1} characters)"]
