"""The capture test of issue 23: what crosses the wire of a default LocalCluster.

Every packet on the loopback of a network namespace of its own (``unshare -rn``: the child has
CAP_NET_RAW over a ``lo`` no other process uses) is recorded during put, match, get from the
pool, admin calls and a handoff whose state is read peer to peer (``_capture_pool.py``), then
searched for the tenant token, the admin token and the payload markers.  Three pools: the
default (TLS everywhere: none is found), the data-session opt-out (the payload is found, the
tokens are not: the data connections are opened by tickets), and a plaintext pool (every one
is found: the control showing the capture sees the traffic at all).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _can_unshare() -> str:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare(1) and ip(8)"
    r = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10)
    return "" if r.returncode == 0 else f"cannot create a user+network namespace: {r.stderr.decode().strip()}"


WHY_NOT = _can_unshare()


def _capture(mode: str, out: Path) -> tuple[bytes, dict[str, str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(["unshare", "-rn", sys.executable, str(HERE / "_capture_pool.py"), mode, str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "DONE" in r.stdout, f"{mode}: {r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    blob = (out / "capture.bin").read_bytes()
    assert len(blob) > 100_000, f"{mode}: only {len(blob)} bytes captured"
    return blob, json.loads((out / "secrets.json").read_text())


def _found(blob: bytes, secrets: dict[str, str]) -> dict[str, bool]:
    return {name: value.encode() in blob for name, value in secrets.items()}


@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)
def test_nothing_secret_crosses_the_wire_of_a_default_pool(tmp_path: Path) -> None:
    blob, secrets = _capture("tls", tmp_path)
    assert _found(blob, secrets) == {"tenant_token": False, "admin_token": False, "payload": False, "state": False}


@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)
def test_the_data_session_opt_out_shows_payload_but_no_token(tmp_path: Path) -> None:
    blob, secrets = _capture("plain-data", tmp_path)
    found = _found(blob, secrets)
    # Blocks and the state object (written through to the pool) cross the data session in the clear.
    assert found == {"tenant_token": False, "admin_token": False, "payload": True, "state": True}


@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)
def test_a_plaintext_pool_shows_everything_to_the_same_capture(tmp_path: Path) -> None:
    blob, secrets = _capture("plaintext", tmp_path)
    assert _found(blob, secrets) == {"tenant_token": True, "admin_token": True, "payload": True, "state": True}
