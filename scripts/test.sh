#!/usr/bin/env bash
# Sets up (scripts/setup_env.sh) and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# Eight fake CPU devices, so the multi-device tests run in the same process as the others.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
# One compilation cache for the run, started empty: the tests start trainer processes that compile
# the same programs again (a study's runs, a run resumed after a stop), and a cache hit skips that.
export JAX_COMPILATION_CACHE_DIR="$PWD/.pytest_cache/jax_compilation_cache"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
rm -rf "$JAX_COMPILATION_CACHE_DIR"
# One worker per core (at most 4), each test file on one worker so that its module fixtures are
# built once: the suite is mostly compiling and starting trainer processes, one core at a time.
# The files go out longest first (tests/conftest.py), not in pytest-xdist's most-tests-first order.
# The randomized chaos rounds repeat at random moments what deterministic tests here check at
# fixed ones (a kill, a stop, a mismatched process); at 4 minutes of CPU they stay out, so that a
# 2-core CI finishes in 15 minutes. `-m chaos` as an extra argument runs them (the last -m wins),
# as does scripts/chaos.py at any scale.
exec .venv/bin/python -m pytest -q -n auto --maxprocesses=4 --dist loadfile --no-loadscope-reorder \
    --durations=20 -m "not chaos" "$@"
