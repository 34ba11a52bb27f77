#!/usr/bin/env bash
# Install everything kvpool needs on a fresh machine (idempotent; quick when already done).
# Expensive artefacts (Go builds of the control plane, peer packages) are cached under
# ${KVPOOL_CACHE:-$HOME/.cache/kvpool}, which survives between runs on the same machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export KVPOOL_CACHE="${KVPOOL_CACHE:-$HOME/.cache/kvpool}"
mkdir -p "$KVPOOL_CACHE"
PY="${PYTHON:-python3}"

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
[ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || need_apt+=(libibverbs1)
# The real-node e2e tier (e2e/realnode.py): Debian's container runtime and CNI plugins, and the
# iptables kube-proxy programs; containerd is never started as a service, only inside the tier's
# private namespace.
for pkg in containerd runc iptables; do command -v "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg"); done
[ -e /usr/lib/cni/bridge ] || need_apt+=(containernetworking-plugins)
if [ ${#need_apt[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: apt-get install ${need_apt[*]}"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}") >/dev/null \
    || echo "setup: apt-get failed; tests needing ${need_apt[*]} will skip with the reason"
fi

# Debian's Prometheus 2.42 (prometheus + promtool) for the chart's rule and dashboard tests
# (tests/kvpool_chart/test_monitoring.py): the package is downloaded with apt and unpacked into the
# cache, not installed, because installing it would start a prometheus service on :9090 here.
PROM_DIR="$KVPOOL_CACHE/prometheus"
if [ ! -x "$PROM_DIR/usr/bin/promtool" ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: apt-get download prometheus (unpacked into $PROM_DIR)"
  deb_dir="$(mktemp -d)"
  chmod 755 "$deb_dir"  # apt's _apt user writes the download there
  if (cd "$deb_dir" && { apt-get download -qq prometheus >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get download -qq prometheus; } >/dev/null 2>&1; } \
      && rm -rf "$PROM_DIR.tmp" && dpkg-deb -x prometheus_*.deb "$PROM_DIR.tmp"); then
    rm -rf "$PROM_DIR" && mv "$PROM_DIR.tmp" "$PROM_DIR"
  else
    echo "setup: no prometheus package; the promtool and scrape tests will skip with the reason"
  fi
  rm -rf "$deb_dir"
fi

# kvpool's Python packages live in a virtual environment of their own under the cache, never in
# the machine's Python: installing into it once upgraded another package's pinned dependency
# (pydantic under aws-sam-translator). tools/test.sh and tools/demo.sh run in this venv.
VENV="$KVPOOL_CACHE/venv"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: python -m venv $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
stamp="$VENV/.kvpool-pip-$(sha256sum pyproject.toml | cut -c1-16)"
# The test and demo commands put this checkout's sidecar/ and operator/ first on PYTHONPATH, so an
# editable install of another clone (CI clones beside a working tree) is harmless and is not
# re-pointed here: re-pointing it would switch every other checkout's runs to this one's code.
# So a changed pyproject.toml installs its requirements (dependencies + the dev extra) only; the
# project itself is installed (editable, without dependencies: the `kvpool` console script that the
# e2e pods run) only where no kvpool is there yet.
if [ ! -e "$stamp" ] || ! "$VPY" -c "import kvpool, grpc, numpy, xxhash" >/dev/null 2>&1; then
  echo "setup: pip install the requirements of pyproject.toml (dependencies + dev) into $VENV"
  reqs="$KVPOOL_CACHE/requirements-$(sha256sum pyproject.toml | cut -c1-16).txt"
  "$VPY" -c 'import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["dev"]))' > "$reqs"
  "$VPY" -m pip install -q --disable-pip-version-check -r "$reqs" 2>&1 | grep -v "as the 'root' user" || true
  if ! "$VPY" -c "import kvpool" >/dev/null 2>&1; then
    echo "setup: pip install --no-deps -e ."
    "$VPY" -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | grep -v "as the 'root' user" || true
  fi
  touch "$stamp"
fi
# The `kvpool` command (what e2e pods run) is `python -m kvpool` of whichever kvpool comes first on
# PYTHONPATH: pip's console script names the entry point's module, and a venv made before a module
# moved kept a script that imports the old path (seen when kvpool.cli became kvpool.apps.cli).
printf '#!/bin/sh\n# Written by tools/setup.sh: python -m kvpool, with this venv.\nexec "%s" -m kvpool "$@"\n' "$VPY" > "$VENV/bin/kvpool"
chmod +x "$VENV/bin/kvpool"
PY="$VPY"
"$PY" -c "import kvpool, grpc, numpy, xxhash" || { echo "setup: kvpool is not importable"; exit 1; }
