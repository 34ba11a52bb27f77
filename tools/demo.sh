#!/usr/bin/env bash
# Set everything up and run the main job: `kvpool demo` on an embedded local pool.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
# This checkout's code, whichever clone the editable install points at (setup.sh).
export PYTHONPATH="$PWD/sidecar:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m kvpool demo "$@"
