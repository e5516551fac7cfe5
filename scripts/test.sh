#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. Extra arguments go to pytest.
#
#   bash scripts/test.sh                 # everything CI runs
#   bash scripts/test.sh -k config -x    # a subset
#   bash scripts/test.sh -n 0 tests/x.py # one process, e.g. for pdb
#
# The tests run in TOOLKIT_TEST_WORKERS pytest-xdist workers (default 3), a test file per worker at
# a time (tests/conftest.py groups them), the slowest files first.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
# One PATH for every process: DeepSpeed builds its CPU ops with the first `ninja` on PATH, and two
# different ninjas (the venv's and the system's) make processes rebuild them.
export PATH="$root/.venv/bin:$PATH"
# DeepSpeed's CPU ops, built once by scripts/setup.sh into the venv (see scripts/build_ops.py).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$root/.venv/torch_extensions}"
cd "$root"
# Lint, import order and types first (configured in pyproject.toml): a new violation fails CI.
"$root/.venv/bin/ruff" check toolkit
"$root/.venv/bin/mypy"
start=$(date +%s)
status=0
"$root/.venv/bin/python" -m pytest -q -p no:cacheprovider --durations=30 \
  -n "${TOOLKIT_TEST_WORKERS:-3}" --dist loadscope "$@" || status=$?
echo "test.sh: the suite took $(( $(date +%s) - start )) s of wall time (exit $status)"
exit "$status"
