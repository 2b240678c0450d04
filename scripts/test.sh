#!/usr/bin/env bash
# Sets up (scripts/setup_env.sh) and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q "$@"
