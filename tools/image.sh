#!/usr/bin/env bash
# Build kvpool's image from `Dockerfile` on this machine, without Docker and without a registry,
# into OCI archives a container runtime imports (the real-node test tier: `ctr images import`).
#
#   bash tools/image.sh              build what is missing, then print the four lines below
#   bash tools/image.sh --print-env  the same, but stdout holds only these lines (the build's log
#                                    goes to stderr), for `eval "$(bash tools/image.sh --print-env)"`:
#     KVPOOL_IMAGE_ARCHIVE=<cache>/images/kvpool-<hash12>.oci.tar   OCI archive of the kvpool image
#     KVPOOL_IMAGE=localhost/kvpool:<hash12>                         the name it carries
#     KVPOOL_PAUSE_ARCHIVE=<cache>/images/pause-<hash12>.oci.tar     OCI archive of the pod sandbox image
#     KVPOOL_PAUSE_IMAGE=localhost/kvpool-pause:<hash12>             the name it carries
#   `ctr -n k8s.io images import "$KVPOOL_IMAGE_ARCHIVE"` stores it as $KVPOOL_IMAGE (the archive's
#   ref name is that full reference).
#
# How: Debian's mmdebstrap builds a bookworm rootfs with Python 3.11 from this machine's apt
# mirror (the stand-in for python:3.11-slim, which no registry here serves); buildah tags it
# docker.io/library/python:3.11-slim in a private store under <cache>/images/storage, so the
# Dockerfile builds unchanged, and writes the result with `buildah push ... oci-archive:`. The
# pause image is a static C program (tools/image/pause.c) in an image of its own.
# Cached: each archive's name holds the hash of its inputs (the base recipe, Dockerfile,
# .dockerignore, pyproject.toml, README.md and the sources under sidecar/ and operator/), so a
# warm run only hashes (times and sizes: README, "The image"). mmdebstrap and buildah are
# apt-installed when missing. Runs as root (mmdebstrap, buildah's storage).
set -euo pipefail
cd "$(dirname "$0")/.."

# All of it in one function, which bash reads whole before running it: an edit of this file
# while a build runs (it takes minutes) cannot change what the running build does next.
main() {
  print_env=0
  case "${1:-}" in
    --print-env) print_env=1 ;;
    "") ;;
    *) echo "usage: bash tools/image.sh [--print-env]" >&2; exit 2 ;;
  esac
  # With --print-env everything but the four lines goes to stderr.
  if [ "$print_env" -eq 1 ]; then exec 3>&1 1>&2; else exec 3>&1; fi

  OUT="${KVPOOL_CACHE:-$HOME/.cache/kvpool}/images"
  mkdir -p "$OUT"

  # The base rootfs recipe: the `essential` variant has no apt, so every
  # package is listed; without libstdc++6 `import numpy` fails at run time. The hook makes Debian's
  # Python behave like the python image's: pip may install into it, `python`/`pip` exist. The
  # merged-usr hook spares the usrmerge package (and the 55 MB of Perl it pulls in), and the
  # documentation, manuals and translations stay out (46 MB), as in python:3.11-slim.
  BASE_SUITE=bookworm
  BASE_INCLUDE=python3,python3-pip,python3-venv,ca-certificates,passwd,libstdc++6,netbase,tzdata
  BASE_OPTS=(--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
             '--dpkgopt=path-exclude=/usr/share/doc/*' '--dpkgopt=path-exclude=/usr/share/man/*'
             '--dpkgopt=path-exclude=/usr/share/locale/*' '--dpkgopt=path-exclude=/usr/share/info/*')
  BASE_HOOK='rm -f "$1"/usr/lib/python3.11/EXTERNALLY-MANAGED; ln -sf /usr/bin/python3 "$1"/usr/local/bin/python; ln -sf /usr/bin/pip3 "$1"/usr/local/bin/pip; rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*'
  BASE_REF=docker.io/library/python:3.11-slim
  PAUSE_CFLAGS="-static -Os -Wall -Wextra"

  sha() { sha256sum | cut -c1-12; }
  step() { echo "== $(date -u +%T) $*"; }
  names() {
    base_hash=$(printf '%s\n' "$BASE_SUITE" "$BASE_INCLUDE" "$BASE_HOOK" "${BASE_OPTS[@]}" | sha)
    # The build context's files, as .dockerignore leaves them (bytecode and build leftovers excluded).
    src_hash=$( { printf '%s\n' "$base_hash"
                  find Dockerfile .dockerignore pyproject.toml README.md sidecar operator -type f \
                       -not -path '*/__pycache__/*' -not -name '*.pyc' -not -path '*.egg-info/*' \
                       -not -path '*/build/*' -print0 | sort -z | xargs -0 sha256sum; } | sha)
    pause_hash=$( { printf '%s\n' "$PAUSE_CFLAGS"; cat tools/image/pause.c; } | sha)
    IMAGE="localhost/kvpool:$src_hash"
    ARCHIVE="$OUT/kvpool-$src_hash.oci.tar"
    PAUSE_IMAGE="localhost/kvpool-pause:$pause_hash"
    PAUSE_ARCHIVE="$OUT/pause-$pause_hash.oci.tar"
    BASE_TAR="$OUT/base-$BASE_SUITE-$base_hash.tar"
  }
  names

  emit() {
    # Marked as in use: the clean-up below leaves what a run used within two hours.
    touch -c "$ARCHIVE" "$PAUSE_ARCHIVE" "$BASE_TAR" 2>/dev/null || true
    printf 'KVPOOL_IMAGE_ARCHIVE=%s\nKVPOOL_IMAGE=%s\nKVPOOL_PAUSE_ARCHIVE=%s\nKVPOOL_PAUSE_IMAGE=%s\n' \
      "$ARCHIVE" "$IMAGE" "$PAUSE_ARCHIVE" "$PAUSE_IMAGE" >&3
  }
  if [ -s "$ARCHIVE" ] && [ -s "$PAUSE_ARCHIVE" ]; then
    emit
    exit 0
  fi

  # One build at a time (tools/test.sh and the real-node tier may both ask); the second waits,
  # then finds the archives made.
  exec 9>"$OUT/build.lock"
  flock -w 1800 9 || { echo "tools/image.sh: another build held $OUT/build.lock for 30 minutes" >&2; exit 1; }
  names  # again: the sources may have changed while another build held the lock
  if [ -s "$ARCHIVE" ] && [ -s "$PAUSE_ARCHIVE" ]; then
    emit
    exit 0
  fi

  need=()
  command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
  command -v buildah >/dev/null || need+=(buildah)
  command -v gcc >/dev/null || need+=(gcc libc6-dev)
  if [ "${#need[@]}" -ne 0 ]; then
    step "apt-get install ${need[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=600 "${need[@]}" >/dev/null \
      || { apt-get update -q -o DPkg::Lock::Timeout=600 >/dev/null \
           && DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=600 "${need[@]}" >/dev/null; }
  fi

  # Scratch space: each archive is written here and moved into place whole.
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT

  if [ ! -s "$BASE_TAR" ]; then
    step "base rootfs: mmdebstrap $BASE_SUITE (essential + $BASE_INCLUDE), from the machine's apt sources"
    # No mirror argument: mmdebstrap then uses the host's apt sources (the machine's mirror).
    # Its log (the hooks talk even with --quiet) is shown only when it fails.
    mmdebstrap --quiet --variant=essential --include="$BASE_INCLUDE" "${BASE_OPTS[@]}" --customize-hook="$BASE_HOOK" \
      "$BASE_SUITE" "$tmp/base.tar" >"$tmp/mmdebstrap.log" 2>&1 || { cat "$tmp/mmdebstrap.log"; return 1; }
    mv "$tmp/base.tar" "$BASE_TAR"
  fi

  build() {
    set -euo pipefail
    # A private store, never the machine's /var/lib/containers; run in a private mount namespace
    # (below), so an interrupted build leaves no overlay mounts on the host.
    local BUILDAH=(buildah --root "$OUT/storage" --runroot "$OUT/run" --storage-driver overlay) ctr old
    # Working containers an interrupted build left behind (tests name theirs otherwise).
    for ctr in $("${BUILDAH[@]}" containers --format '{{.ContainerName}}' | grep -e '-working-container' || true); do
      "${BUILDAH[@]}" rm "$ctr" >/dev/null
    done
    # The stand-in is made again only when its recipe changed: a new one would invalidate every
    # cached layer above it (the dependencies' download and install).
    if [ "$("${BUILDAH[@]}" inspect --type image --format '{{index .OCIv1.Config.Labels "kvpool.base"}}' \
            "$BASE_REF" 2>/dev/null)" != "$base_hash" ]; then
      step "$BASE_REF (stand-in) from $BASE_TAR"
      ctr=$("${BUILDAH[@]}" from --pull=never scratch)
      "${BUILDAH[@]}" add "$ctr" "$BASE_TAR" / >/dev/null
      "${BUILDAH[@]}" config --label "kvpool.base=$base_hash" --env LANG=C.UTF-8 \
        --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd '["python3"]' "$ctr"
      "${BUILDAH[@]}" commit --rm -q "$ctr" "$BASE_REF" >/dev/null
      # Every cached layer stood on the previous stand-in: none can serve again.
      "${BUILDAH[@]}" rmi --prune >/dev/null || true  # a failed prune costs only disk
    fi
    if [ ! -s "$ARCHIVE" ]; then
      step "$IMAGE: buildah bud Dockerfile"
      # The machine's CA bundle is mounted for pip (its index may sit behind a CA the fresh rootfs
      # does not trust); mounted, never copied into a layer.
      "${BUILDAH[@]}" bud --isolation chroot --pull=never --layers -q \
        -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
        -t "$IMAGE" . >/dev/null
      "${BUILDAH[@]}" push -q "$IMAGE" "oci-archive:$tmp/kvpool.tar:$IMAGE"
      mv "$tmp/kvpool.tar" "$ARCHIVE"
      # Earlier builds' images go (about 270 MB each); the cached layers they share stay.
      for old in $("${BUILDAH[@]}" images --format '{{.Name}}:{{.Tag}}' --filter reference=localhost/kvpool); do
        [ "$old" = "$IMAGE" ] || "${BUILDAH[@]}" rmi "$old" >/dev/null
      done
    fi
    if [ ! -s "$PAUSE_ARCHIVE" ]; then
      step "$PAUSE_IMAGE: static pause (tools/image/pause.c)"
      # shellcheck disable=SC2086  # PAUSE_CFLAGS is a list of flags
      gcc $PAUSE_CFLAGS -o "$tmp/pause" tools/image/pause.c
      strip "$tmp/pause"
      ctr=$("${BUILDAH[@]}" from --pull=never scratch)
      "${BUILDAH[@]}" copy "$ctr" "$tmp/pause" /pause >/dev/null
      "${BUILDAH[@]}" config --entrypoint '["/pause"]' --user 65535:65535 "$ctr"
      "${BUILDAH[@]}" commit --rm -q "$ctr" "$PAUSE_IMAGE" >/dev/null
      "${BUILDAH[@]}" push -q "$PAUSE_IMAGE" "oci-archive:$tmp/pause.tar:$PAUSE_IMAGE"
      mv "$tmp/pause.tar" "$PAUSE_ARCHIVE"
    fi
  }
  export -f build step
  export OUT BASE_REF base_hash BASE_TAR IMAGE ARCHIVE PAUSE_IMAGE PAUSE_ARCHIVE PAUSE_CFLAGS tmp
  unshare --mount --propagation private bash -c build
  emit
  # Older archives of the same kind go (each build leaves one, about 105 MB), but only those no
  # run has used for two hours (emit touches what it hands out): another checkout on the same
  # machine and cache (a CI clone beside a working tree) may be importing its own right now.
  find "$OUT" -maxdepth 1 -mmin +120 \( -name 'kvpool-*.oci.tar' -a -not -name "${ARCHIVE##*/}" \
    -o -name 'pause-*.oci.tar' -a -not -name "${PAUSE_ARCHIVE##*/}" \
    -o -name 'base-*.tar' -a -not -name "${BASE_TAR##*/}" \) -delete
}
main "$@"
exit
