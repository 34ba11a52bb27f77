"""The image tools/image.sh builds from `Dockerfile`: its OCI config as a runtime reads it from the
archive, and commands run inside it (buildah, chroot isolation).

tools/test.sh builds it before pytest (cached by the hash of its inputs, seconds when warm); here
``tools/image.sh --print-env`` only finds it, or builds it on a first run outside test.sh.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpool_operator.podsecurity import IMAGE_GID, IMAGE_UID
from tests.kvpool.test_sigterm import Init

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("KVPOOL_CACHE", Path.home() / ".cache/kvpool"))


def _unavailable() -> str | None:
    if os.environ.get("KVPOOL_SKIP_IMAGE") == "1":
        return "KVPOOL_SKIP_IMAGE=1"
    if os.geteuid() != 0:
        return "building the image needs root (mmdebstrap, buildah's storage)"
    if not all(shutil.which(t) for t in ("mmdebstrap", "buildah")) and not shutil.which("apt-get"):
        return "neither mmdebstrap and buildah nor apt-get to install them"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=_unavailable() or "")


@pytest.fixture(scope="module")
def image() -> dict[str, str]:
    out = subprocess.run(["bash", "tools/image.sh", "--print-env"], cwd=ROOT, capture_output=True, text=True,
                         timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    env = dict(line.split("=", 1) for line in out.stdout.splitlines())
    assert sorted(env) == ["KVPOOL_IMAGE", "KVPOOL_IMAGE_ARCHIVE", "KVPOOL_PAUSE_ARCHIVE", "KVPOOL_PAUSE_IMAGE"]
    return env


def _oci(archive: str) -> tuple[str, dict[str, Any]]:
    """(the ref name a runtime's import gives it, the image config) from an OCI archive."""
    with tarfile.open(archive) as tar:
        def blob(digest: str) -> Any:
            f = tar.extractfile(f"blobs/{digest.replace(':', '/')}")
            assert f is not None
            return json.load(f)

        index_file = tar.extractfile("index.json")
        assert index_file is not None
        index = json.load(index_file)
        (desc,) = index["manifests"]
        manifest = blob(desc["digest"])
        return desc["annotations"]["org.opencontainers.image.ref.name"], blob(manifest["config"]["digest"])


@pytest.mark.timeout(1500)
def test_archives_carry_their_names_and_the_image_user(image: dict[str, str]) -> None:
    ref, config = _oci(image["KVPOOL_IMAGE_ARCHIVE"])
    assert ref == image["KVPOOL_IMAGE"]
    c = config["config"]
    assert c["User"] == f"{IMAGE_UID}:{IMAGE_GID}"
    assert c["Entrypoint"] == ["kvpool"]
    assert any(e.startswith("PATH=/opt/kvpool/venv/bin:") for e in c["Env"])
    ref, config = _oci(image["KVPOOL_PAUSE_ARCHIVE"])
    assert ref == image["KVPOOL_PAUSE_IMAGE"]
    assert config["config"]["Entrypoint"] == ["/pause"]


# buildah's mounts (the store's own, a container's rootfs) stay in a mount namespace of their own.
PRIVATE = ["unshare", "--mount", "--propagation", "private"]


@dataclass(frozen=True)
class Working:
    """A working container of the image in tools/image.sh's buildah store."""

    buildah: list[str]
    ctr: str

    def run(self, *argv: str) -> str:
        """``buildah run`` (chroot isolation) as the image's user, with its environment."""
        out = subprocess.run([*PRIVATE, *self.buildah, "run", "--isolation", "chroot", self.ctr, "--", *argv],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{argv}: {out.stdout[-2000:]} {out.stderr[-2000:]}"
        return out.stdout


@pytest.fixture(scope="module")
def container(image: dict[str, str]) -> Iterator[Working]:
    store = CACHE / "images"
    buildah = ["buildah", "--root", str(store / "storage"), "--runroot", str(store / "run"),
               "--storage-driver", "overlay"]
    made = subprocess.run([*PRIVATE, *buildah, "from", "--pull=never", "--name", f"kvpool-test-{os.getpid()}",
                           image["KVPOOL_IMAGE"]], capture_output=True, text=True, check=True, timeout=120)
    ctr = made.stdout.strip()
    try:
        yield Working(buildah, ctr)
    finally:
        subprocess.run([*PRIVATE, *buildah, "rm", ctr], capture_output=True, timeout=120)


@pytest.mark.timeout(1500)
def test_runs_as_the_image_user_with_every_role_importable(container: Working) -> None:
    # The primary group from /etc/passwd is the one a runtime uses when the pod names none.
    assert container.run("id", "-u").strip() == str(IMAGE_UID)
    assert container.run("id", "-g").strip() == str(IMAGE_GID)
    assert container.run("sh", "-c", "grep ^kvpool: /etc/passwd").startswith(f"kvpool:x:{IMAGE_UID}:{IMAGE_GID}:")
    assert "store" in container.run("kvpool", "--help")
    # Every role's modules load (numpy needs libstdc++; the dependencies' stripped tests are unused).
    container.run("python3", "-c", "import kvpool.store.main, kvpool.sidecar.main, kvpool.apps.router_api, "
                                   "kvpool.apps.loadgen, kvpool_operator.main, kvpool_operator.handlers, kopf, "
                                   "kubernetes.client, cryptography.hazmat.primitives.ciphers.aead, numpy, "
                                   "zmq, msgspec")  # KV events: a KVPool's spec.router.events
    # The injected engine-client copy (kvpool._deps) runs as `python3 -m ...` on the PATH.
    assert container.run("sh", "-c", "command -v python3").strip() == "/opt/kvpool/venv/bin/python3"


@pytest.mark.timeout(1500)
def test_no_build_tools_in_the_image(container: Working) -> None:
    tools = container.run("sh", "-c", "for t in gcc cc c++ make ld; do command -v $t || true; done; "
                                      "ls /opt/kvpool/venv/bin")
    assert not any(line.endswith(("/gcc", "/cc", "/c++", "/make", "/ld")) for line in tools.splitlines()), tools
    assert "pip" not in tools.split()  # the venv's own pip went with the build stage


# As a pod runs it: PID 1 of its own PID namespace, the image's user and environment, the root
# filesystem read-only, memory-backed /tmp and /dev/shm (the pods' emptyDirs).
_AS_A_POD = """set -e
m=$($BUILDAH mount "$CTR")
mount --bind "$m" "$m"
mount -o remount,bind,ro "$m"
if chroot "$m" touch /opt/kvpool/probe 2>/dev/null; then echo "the root filesystem is writable" >&2; exit 1; fi
mount -t proc proc "$m/proc"
mount --rbind /dev "$m/dev"
mount -t tmpfs -o mode=1777 tmpfs "$m/dev/shm"
mount -t tmpfs -o mode=1777 tmpfs "$m/tmp"
exec chroot --userspec="$USERSPEC" "$m" env -i $IMAGE_ENV "$@"
"""


@pytest.mark.timeout(1500)
def test_store_sidecar_and_router_serve_on_a_read_only_root_and_stop_on_sigterm(
        container: Working, image: dict[str, str], tmp_path: Path) -> None:
    _, config = _oci(image["KVPOOL_IMAGE_ARCHIVE"])
    env = {"CTR": container.ctr, "BUILDAH": " ".join(container.buildah), "USERSPEC": config["config"]["User"],
           "IMAGE_ENV": " ".join(config["config"]["Env"])}
    started: list[Init] = []

    def start(name: str, *argv: str) -> Init:
        d = tmp_path / name
        d.mkdir()
        p = Init(["bash", "-c", _AS_A_POD, "as-a-pod", *config["config"]["Entrypoint"], *argv], d, env)
        started.append(p)
        return p

    try:
        store = start("store", "store", "--listen", "127.0.0.1:0", "--transfer-port", "0", "--dram", "16MiB",
                      "--node-id", "s")
        address = store.wait_line("READY", timeout=120).split()[1]
        sidecar = start("sidecar", "sidecar", "--socket", "/tmp/kvpool.sock", "--pool", address, "--local", "8MiB")
        sidecar.wait_line("READY", timeout=120)
        router = start("router", "router-api", "--pool", address, "--listen", "127.0.0.1:0", "--http", "")
        router.wait_line("READY", timeout=120)
        for p in (router, sidecar, store):
            assert p.terminate()[0] == 0, p.stderr()[-2000:]
        assert any(ln.startswith("FLUSHED ") for ln in sidecar.lines)
    finally:
        for p in started:
            p.kill()
