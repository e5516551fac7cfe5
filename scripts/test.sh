#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. Extra arguments go to pytest.
#
#   bash scripts/test.sh                 # everything CI runs
#   bash scripts/test.sh -k config -x    # a subset
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
