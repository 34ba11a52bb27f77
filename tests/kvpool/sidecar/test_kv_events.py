"""KV events for routers: a router process (vLLM's event types, no kvpool code) keeps one index
per sidecar that agrees with what each sidecar's local tier holds, through puts, evictions,
removals and a sidecar killed and restarted on the same endpoints; and one for a store node's
tenant, through commits, evictions and removals, blind to the other tenants."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("zmq", reason="the events extra (pyzmq, msgspec) is not installed")
pytest.importorskip("msgspec", reason="the events extra (pyzmq, msgspec) is not installed")

from kvpool.apps.cluster import LocalCluster, spawn, stop_procs  # noqa: E402
from kvpool.pool.node_client import StoreClient  # noqa: E402
from kvpool.wire.counters import SidecarCounter, StoreCounter

KiB, MiB = 1 << 10, 1 << 20
HERE = Path(__file__).resolve().parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Router:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_kv_router.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.call(None) == {"ready": True}

    def call(self, req: dict[str, Any] | None) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if req is not None:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the router exited (rc={self.proc.poll()})"
        return json.loads(line)

    def index(self) -> dict[str, set[str]]:
        return {n: set(v) for n, v in self.call({"op": "dump"})["index"].items()}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.fixture
def router() -> Iterator[Router]:
    r = Router()
    try:
        yield r
    finally:
        r.close()


def _wire(key: bytes, fmt: str) -> str:
    return key.hex() if fmt == "bytes" else key[-8:].hex()


def _held(client: Any, keys: list[bytes], fmt: str) -> set[str]:
    """What the sidecar's local tier holds (a local-only sidecar: a match is a local hit)."""
    out = set()
    for k in keys:
        n, lease = client.match_lease([k])
        if lease:
            client.release(lease)
        if n:
            out.add(_wire(k, fmt))
    return out


def test_router_index_follows_puts_evictions_and_a_restart(router: Router, h: Any) -> None:
    rng = random.Random(7)
    fmts = {"a": "bytes", "b": "int"}
    ports = {n: (_port(), _port()) for n in fmts}

    def args(n: str) -> list[str]:
        pub, rep = ports[n]
        return ["--events-endpoint", f"tcp://127.0.0.1:{pub}", "--events-replay-endpoint", f"tcp://127.0.0.1:{rep}",
                "--events-hash-format", fmts[n], "--events-block-size", "16"]

    with LocalCluster(stores=0, sidecars=0, local_bytes=2 * MiB) as lc:
        addr = {n: lc.add_sidecar(extra_args=args(n)) for n in fmts}
        clients = {n: lc.connect(i) for i, n in enumerate(fmts)}
        put: dict[str, list[bytes]] = {n: [] for n in fmts}

        def put_blocks(n: str, count: int) -> None:
            keys = [rng.randbytes(32) for _ in range(count)]
            for i in range(0, count, 4):
                clients[n].put(keys[i:i + 4], [rng.randbytes(100 * KiB) for _ in keys[i:i + 4]])
            put[n] += keys

        def consistent() -> bool:
            want = {n: _held(clients[n], put[n], fmts[n]) for n in fmts}
            return router.index() == want

        # Blocks stored before the router joins reach it through the replay snapshot.
        put_blocks("a", 8)
        for n in fmts:
            pub, rep = ports[n]
            assert router.call({"op": "add", "name": n, "pub": f"tcp://127.0.0.1:{pub}",
                                "replay": f"tcp://127.0.0.1:{rep}"}) == {"ok": True}
        h.wait_for(consistent, 30, what="the router's index after the snapshot")
        assert len(router.index()["a"]) == 8

        # Puts, then evictions: 2 MiB of local tier holds about 19 blocks of 100 KiB.
        put_blocks("b", 6)
        put_blocks("a", 40)
        h.wait_for(consistent, 30, what="the router's index after evictions")
        st = clients["a"].stats()
        assert st.counters[SidecarCounter.EVICTED] > 10
        assert len(router.index()["a"]) == st.local_objects < 48
        # An explicit removal is an event too.
        assert clients["b"].remove(put["b"][:2]) == [0, 0]
        h.wait_for(consistent, 30, what="the router's index after a removal")
        assert len(router.index()["b"]) == 4

        # Kill sidecar "a" (no goodbye) and start another on the same endpoints: its blocks are
        # gone, and the router must say so even before the new one stores anything.
        proc = lc.sidecar_procs[0]
        proc.popen.kill()
        stop_procs([proc])
        clients["a"].close()
        addr["a"] = lc.add_sidecar(extra_args=args("a"))
        clients["a"] = lc.connect(len(lc.sidecar_procs) - 1)
        h.wait_for(lambda: router.index()["a"] == set(), 30, what="the restarted sidecar's index to empty")
        put_blocks("a", 5)
        h.wait_for(consistent, 30, what="the router's index after the restart")
        assert len(router.index()["a"]) == 5
        assert len(router.index()["b"]) == 4  # the other instance was never disturbed

        # Kill sidecar "b" and start it again on the same socket and arena (a pod's container
        # restart): it adopts its blocks but one whose bytes were changed meanwhile, and its first
        # events say exactly that (AllBlocksCleared + BlockStored of what it kept, one batch).
        held = [k for k in put["b"] if _wire(k, fmts["b"]) in router.index()["b"]]
        with clients["b"].get(held[:1]) as got:
            base = np.frombuffer(clients["b"]._arena_ro, np.uint8).ctypes.data
            off = int(np.frombuffer(got[0], np.uint8).ctypes.data - base)
        clients["b"]._arena[off] ^= 0xFF
        lc.restart_sidecar(lc.sidecars.index(addr["b"]), kill=True)
        h.wait_for(lambda: len(router.index()["b"]) == 3, 30, what="the adopting sidecar's events")
        h.wait_for(consistent, 30, what="the router's index after an adopting restart")
        assert _wire(held[0], fmts["b"]) not in router.index()["b"]


def test_store_node_events_of_one_tenant(router: Router, h: Any, tmp_path: Path) -> None:
    rng = random.Random(11)
    pub, rep = _port(), _port()
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps([{"tenantId": "t1", "token": "tok-1"}, {"tenantId": "t2", "token": "tok-2"}]))
    proc = spawn("store-ev", ["store", "--listen", "127.0.0.1:0", "--transfer-port", "0", "--dram", str(2 * MiB),
                              "--node-id", "store-ev", "--tenants", str(tenants), "--closed",
                              "--events-endpoint", f"tcp://127.0.0.1:{pub}",
                              "--events-replay-endpoint", f"tcp://127.0.0.1:{rep}", "--events-tenant", "t1"],
                 str(tmp_path))
    try:
        addr = proc.ready_line.split()[1]
        with StoreClient(addr, "tok-1") as c1, StoreClient(addr, "tok-2") as c2:
            keys: list[bytes] = []

            def put(c: StoreClient, n: int) -> list[bytes]:
                ks = [rng.randbytes(32) for _ in range(n)]
                for i in range(0, n, 4):
                    assert c.put(ks[i:i + 4], [rng.randbytes(100 * KiB) for _ in ks[i:i + 4]]) == [0] * len(ks[i:i + 4])
                return ks

            def consistent() -> bool:
                present = c1.exists(keys, prefix_only=False).present if keys else []
                return router.index().get("t1") == {k.hex() for k, p in zip(keys, present, strict=True) if p}

            keys += put(c1, 6)
            assert router.call({"op": "add", "name": "t1", "pub": f"tcp://127.0.0.1:{pub}",
                                "replay": f"tcp://127.0.0.1:{rep}"}) == {"ok": True}
            h.wait_for(consistent, 30, what="the store's events after the snapshot")
            assert len(router.index()["t1"]) == 6
            theirs = put(c2, 4)  # another tenant's blocks are never published (they evict ours)
            keys += put(c1, 20)  # 2 MiB of DRAM and no tier below: the oldest are dropped
            assert c1.remove(keys[-2:]) == [0, 0]
            h.wait_for(consistent, 30, what="the store's events after evictions and removals")
            assert c1.stats().counters[StoreCounter.EVICTED] > 5
            assert not router.index()["t1"] & {k.hex() for k in theirs}
    finally:
        stop_procs([proc])
