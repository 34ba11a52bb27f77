#!/usr/bin/env bash
# Set everything up and run every test (unit, integration, control plane, end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
PY="${PYTHON:-python3}"
"$PY" tools/genproto.py --check
"$PY" -m ruff check sidecar operator tests tools || { echo "ruff failed"; exit 1; }
set +e
"$PY" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here"
  exit 1
fi
exit "$rc"
