#!/usr/bin/env bash
# Set everything up and run the main job: `kvpool demo` on an embedded local pool.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec "${PYTHON:-python3}" -m kvpool demo "$@"
