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

data_dir=/usr/share/datasets/fashion-mnist
if [ ! -f "$data_dir/train-images-idx3-ubyte.gz" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "Installing the Fashion-MNIST data package (dataset-fashion-mnist)..."
    apt-get update -qq >/dev/null && apt-get install -y -qq dataset-fashion-mnist >/dev/null
  elif command -v sudo >/dev/null && command -v apt-get >/dev/null; then
    sudo apt-get update -qq >/dev/null && sudo apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    echo "Note: Fashion-MNIST is not in $data_dir and apt-get is not available here. Install the" \
         "Debian package dataset-fashion-mnist, or point the training config's data_dir at a" \
         "directory with the four IDX .gz files." >&2
  fi
fi
