#!/usr/bin/env bash
# Set everything up and run every test (unit, integration, control plane, end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
# This checkout's code, whichever clone the editable install points at (setup.sh).
export PYTHONPATH="$PWD/sidecar:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
echo "== checks: generated code, lint, import contracts"
"$PY" tools/genproto.py --check
"$PY" -m ruff check -q sidecar operator tests tools e2e bench
lint-imports --no-cache >/dev/null || lint-imports --no-cache
echo "== pytest"
set +e
"$PY" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here"
  exit 1
fi
exit "$rc"
