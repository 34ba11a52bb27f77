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
from pathlib import Path
from typing import Any

import pytest

from kvpool_operator.podsecurity import IMAGE_GID, IMAGE_UID

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


@pytest.fixture(scope="module")
def container(image: dict[str, str]) -> Iterator[list[str]]:
    """``buildah run`` in a working container of the image (its user, env and entrypoint)."""
    store = CACHE / "images"
    buildah = ["buildah", "--root", str(store / "storage"), "--runroot", str(store / "run"),
               "--storage-driver", "overlay"]
    ctr = subprocess.run([*buildah, "from", "--pull=never", image["KVPOOL_IMAGE"]], capture_output=True,
                         text=True, check=True, timeout=120).stdout.strip()
    try:
        yield [*buildah, "run", "--isolation", "chroot", ctr, "--"]
    finally:
        subprocess.run([*buildah, "rm", ctr], capture_output=True, timeout=120)


def _run(container: list[str], *argv: str) -> str:
    out = subprocess.run([*container, *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{argv}: {out.stdout[-2000:]} {out.stderr[-2000:]}"
    return out.stdout


@pytest.mark.timeout(1500)
def test_runs_as_the_image_user_with_every_role_importable(container: list[str]) -> None:
    # The primary group from /etc/passwd is the one a runtime uses when the pod names none.
    assert _run(container, "id", "-u").strip() == str(IMAGE_UID)
    assert _run(container, "id", "-g").strip() == str(IMAGE_GID)
    assert _run(container, "sh", "-c", "grep ^kvpool: /etc/passwd").startswith(f"kvpool:x:{IMAGE_UID}:{IMAGE_GID}:")
    assert "store" in _run(container, "kvpool", "--help")
    # Every role's modules load (numpy needs libstdc++; the dependencies' stripped tests are unused).
    _run(container, "python3", "-c", "import kvpool.store.main, kvpool.sidecar.main, kvpool.apps.router_api, "
                                     "kvpool.apps.loadgen, kvpool_operator.main, kvpool_operator.handlers, kopf, "
                                     "kubernetes.client, cryptography.hazmat.primitives.ciphers.aead, numpy")
    # The injected engine-client copy (kvpool._deps) runs as `python3 -m ...` on the PATH.
    assert _run(container, "sh", "-c", "command -v python3").strip() == "/opt/kvpool/venv/bin/python3"


@pytest.mark.timeout(1500)
def test_no_build_tools_in_the_image(container: list[str]) -> None:
    tools = _run(container, "sh", "-c", "for t in gcc cc c++ make ld; do command -v $t || true; done; "
                                        "ls /opt/kvpool/venv/bin")
    assert not any(line.endswith(("/gcc", "/cc", "/c++", "/make", "/ld")) for line in tools.splitlines()), tools
    assert "pip" not in tools.split()  # the venv's own pip went with the build stage
