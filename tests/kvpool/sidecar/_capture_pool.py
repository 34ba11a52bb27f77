"""Child of test_capture.py: run a LocalCluster workload while recording every packet on ``lo``.

Run inside its own network namespace (``unshare -rn``: a user and network namespace, where this
process has CAP_NET_RAW over a loopback nobody else uses), so the capture holds this pool's
traffic only.  ``python _capture_pool.py MODE OUTDIR``; MODE is ``tls`` (the default cluster),
``plain-data`` (TLS, the data session opted out) or ``plaintext`` (``LocalCluster(tls=False)``:
the control that shows the capture sees what crosses the wire).  Writes OUTDIR/capture.bin
(the packets back to back) and OUTDIR/secrets.json (the tenant token, the admin token, the
payload marker) and prints ``DONE <packets>``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from kvpool.apps.cluster import LocalCluster
from kvpool.core import handoff_record as ho
from kvpool.core.keys import KeySpace

ETH_P_ALL = 0x0003
MARKER = b"KVPOOL-CAPTURE-PAYLOAD-MARKER-7f3a9c!"
STATE_MARKER = b"KVPOOL-CAPTURE-STATE-MARKER-b41e02!"


class Capture:
    """Every frame seen on ``lo`` (both directions) until :meth:`stop`."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.2)
        self.packets: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        buf = bytearray(1 << 17)
        while not self._stop.is_set():
            try:
                n = self.sock.recv_into(buf)
            except TimeoutError:
                continue
            self.packets.append(bytes(buf[:n]))

    def stop(self) -> list[bytes]:
        time.sleep(0.5)  # the last packets of the workload
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        return self.packets


def workload(lc: LocalCluster) -> None:
    """put, match, get (from the pool), an admin call, a handoff with its state read peer to peer."""
    ks = KeySpace(model="capture", block_tokens=lc.block_tokens)
    b = lc.block_tokens
    prompt = list(range(1000, 1000 + 4 * b + 7))
    keys = ks.block_keys(prompt)
    values = [MARKER * (16384 // len(MARKER)) for _ in keys]
    with lc.connect(0) as p, lc.connect(1) as d:
        assert p.put(keys, values) == [0] * len(keys)
        deadline = time.monotonic() + 30
        while p.stats().pending_pool_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.match(keys) == len(keys)  # from the pool: the decode sidecar holds nothing yet
        got = d.get(keys)
        assert all(bytes(v) == values[i] for i, v in enumerate(got)), "pool read mismatch"
        lc.publish_ring()  # admin calls to every store node
        pos = (len(prompt) - 1) // b * b
        state = STATE_MARKER * (65536 // len(STATE_MARKER))
        assert p.put_state(keys[pos // b - 1], pos, state) == 0
        rec = p.publish_prefill(keys, len(prompt), hold_ms=20_000)
        assert rec.has_peer, "the state is not exported"
        with d.accept_handoff(rec.to_bytes()) as res:
            assert res.state_outcome == ho.StateOutcome.PEER, res.state_detail


def main() -> int:
    mode, out = sys.argv[1], sys.argv[2]
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=10)
    cap = Capture()
    kw: dict[str, object] = {}
    if mode == "plain-data":
        kw["store_args"] = ["--plaintext-data-session"]
    elif mode == "plaintext":
        kw["tls"] = False
    with LocalCluster(stores=2, sidecars=2, tenants=["acme", "acme"], store_bytes=32 << 20, local_bytes=16 << 20,
                      block_tokens=16, **kw) as lc:  # type: ignore[arg-type]
        workload(lc)
        secrets = {"tenant_token": lc.tokens["acme"], "admin_token": lc.admin_token, "payload": MARKER.decode(),
                   "state": STATE_MARKER.decode()}
    packets = cap.stop()
    with open(os.path.join(out, "capture.bin"), "wb") as f:
        for pkt in packets:
            f.write(pkt)
    with open(os.path.join(out, "secrets.json"), "w") as f:
        json.dump(secrets, f)
    print(f"DONE {len(packets)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
