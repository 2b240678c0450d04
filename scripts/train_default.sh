#!/usr/bin/env bash
# Sets up (scripts/setup_env.sh) and trains the default: Fashion-MNIST, PB + SC + LWP at
# micro-batch 1 through a one-layer-per-stage pipeline. Extra arguments go to scripts/train.py,
# e.g. --config.method=pb or --workdir=runs/other.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python scripts/train.py --config=configs/default.py --workdir=runs/default "$@"
