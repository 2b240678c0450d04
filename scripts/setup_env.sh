#!/usr/bin/env bash
# Idempotent set-up used by the README's commands and CI: a virtualenv in .venv with pipejax and
# its pinned dependencies, and the Fashion-MNIST Debian package where this machine can install it.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# Reinstall only when pyproject.toml changed since the last successful install.
stamp=.venv/.pipejax-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[test]"
  touch "$stamp"
fi

# The project's own bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (as on CI), every
# process would otherwise compile pipejax's sources again on import.
.venv/bin/python -m compileall -q pipejax scripts configs tests >/dev/null

# Debian data packages, where the machine can install them: the package and a file it provides.
ensure_package() {
  local package=$1 marker=$2
  if [ -e "$marker" ]; then
    return 0
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "Installing the Debian data package $package..."
    apt-get update -qq >/dev/null && apt-get install -y -qq "$package" >/dev/null
  elif command -v sudo >/dev/null && command -v apt-get >/dev/null; then
    sudo apt-get update -qq >/dev/null && sudo apt-get install -y -qq "$package" >/dev/null
  else
    echo "Note: $marker is missing and apt-get is not available here. Install the Debian" \
         "package $package, or point the training config's data_dir at a copy of its files." >&2
  fi
}

ensure_package dataset-fashion-mnist /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
ensure_package fortunes /usr/share/games/fortunes/fortunes  # the text corpus of docs/lm.md
