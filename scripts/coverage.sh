#!/usr/bin/env bash
# Line coverage of toolkit/ by the suite, the processes the tests start included (torchrun ranks,
# dsat trials: coverage's `patch = subprocess`, configured in setup.cfg). Extra arguments go to
# pytest. Slower than scripts/test.sh (the tracer runs in every process).
#
#   bash scripts/coverage.sh             # prints the report; total on the last line
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
export PATH="$root/.venv/bin:$PATH"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$root/.venv/torch_extensions}"
cd "$root"
rm -rf .coverage-data && mkdir .coverage-data
status=0
"$root/.venv/bin/python" -m coverage run --rcfile=setup.cfg -m pytest -q -p no:cacheprovider \
  -n "${TOOLKIT_TEST_WORKERS:-3}" --dist loadscope "$@" || status=$?
"$root/.venv/bin/python" -m coverage combine --rcfile=setup.cfg -q
"$root/.venv/bin/python" -m coverage report --rcfile=setup.cfg --skip-covered | tail -25
exit "$status"
