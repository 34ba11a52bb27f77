#!/usr/bin/env bash
# Set everything up and run the main job: `kvpool demo` on an embedded local pool.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
# setup.sh's virtual environment (kvpool's packages never go into the machine's Python): its
# python runs everything below, and its bin/ comes first on PATH (lint-imports, and the `kvpool`
# command that the e2e pods run).
VENV="${KVPOOL_CACHE:-$HOME/.cache/kvpool}/venv"
export PATH="$VENV/bin:$PATH"
# This checkout's code, whichever clone the editable install points at (setup.sh).
export PYTHONPATH="$PWD/sidecar:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
exec "$VENV/bin/python" -m kvpool demo "$@"
