#!/usr/bin/env bash
# Installs the benchmark peers (idempotent: only what is missing is installed).
#   Debian: redis-server (Redis peer), libibverbs1 (Mooncake's binaries link libibverbs.so.1)
#   PyPI:   mooncake-transfer-engine-non-cuda (Mooncake Store), redis + hiredis, numpy
# Usage: bash bench/setup.sh        (as root, or with sudo available)
set -euo pipefail

PY="${PYTHON:-python3}"
MOONCAKE_VERSION="0.3.13.post1"

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing_debs=()
command -v redis-server >/dev/null 2>&1 || missing_debs+=(redis-server)
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then missing_debs+=(libibverbs1); fi
if [ "${#missing_debs[@]}" -gt 0 ]; then
  echo "bench/setup.sh: installing Debian packages: ${missing_debs[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing_debs[@]}"
fi

have_py() {  # have_py DIST VERSION-OR-EMPTY
  "$PY" - "$1" "$2" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
name, want = sys.argv[1], sys.argv[2]
try:
    got = version(name)
except PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if not want or got == want else 1)
PYEOF
}

pip_args=()
have_py mooncake-transfer-engine-non-cuda "$MOONCAKE_VERSION" || \
  pip_args+=("mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION")
have_py redis "" || pip_args+=(redis)
have_py hiredis "" || pip_args+=(hiredis)
have_py numpy "" || pip_args+=(numpy)
if [ "${#pip_args[@]}" -gt 0 ]; then
  echo "bench/setup.sh: pip installing: ${pip_args[*]}"
  "$PY" -m pip install -q "${pip_args[@]}"
fi

# Check that each peer can actually load.
"$PY" -c "import mooncake.store" || { echo "bench/setup.sh: mooncake.store does not import" >&2; exit 1; }
"$PY" -c "import redis, hiredis" || { echo "bench/setup.sh: redis/hiredis do not import" >&2; exit 1; }
redis-server --version >/dev/null
echo "bench/setup.sh: peers ready (redis-server, mooncake $MOONCAKE_VERSION, redis-py + hiredis)"
