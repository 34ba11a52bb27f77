"""Seeded, bounded random request sequences against a real node: no crash, no wedge, no wrong bytes.

Every value is derived from (tenant, key, kind, length), so any successful read can be checked
whatever the interleaving of puts, removes, evictions and tier moves was.  Every gRPC failure
must be one of the statuses of the error tree (never UNKNOWN/INTERNAL: an unhandled exception
in the node).  At the end the node must answer, round-trip, and — once every key is removed
and every reservation/lease has expired — account for exactly zero bytes.
"""

from __future__ import annotations

import base64
import hashlib
import random
import socket
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest

from kvpool.core import errors
from kvpool.transfer.protocol import OP_READ, OP_WRITE, encode_request
from kvpool.wire import store_frames as dp
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
TENANTS = [
    {"tenantId": "t1", "token": "tok-1", "salt": base64.b64encode(b"one").decode(), "quotaBytes": 3 * MiB},
    {"tenantId": "t2", "token": "tok-2", "salt": base64.b64encode(b"two").decode(), "quotaBytes": 2 * MiB,
     "evictOwnOnQuota": True},
]
TOKENS = ["", "tok-1", "tok-2"]
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION}
ALLOWED_ERRORS = (errors.InvalidArgument, errors.Unauthenticated, errors.PermissionDenied, errors.NoSpace,
                  errors.LeaseExpired, errors.QuotaExceeded)
OPS_PER_THREAD = 160


def expected(token: str, key: bytes, kind: int, n: int) -> bytes:
    seed = hashlib.sha256(token.encode() + b"|" + key + bytes([kind])).digest()
    return random.Random(seed).randbytes(n)


class Fuzzer:
    def __init__(self, node: Any, rng: random.Random, keys: list[bytes], h: Any) -> None:
        self.node = node
        self.h = h
        self.rng = rng
        self.keys = keys
        self.clients = {t: node.client(t) for t in TOKENS}
        self.stub = node.stub()
        self.admin_stub = node.admin_stub()
        self.failures: list[str] = []
        self.counts: dict[str, int] = {}

    # -- generators ---------------------------------------------------------------------------

    def size(self) -> int:
        r = self.rng.random()
        if r < 0.05:
            return self.rng.choice([0, 5 * MiB, 2**40])
        if r < 0.25:
            return self.rng.randint(1, 64)
        if r < 0.9:
            return self.rng.randint(65, 300 * KiB)
        return self.rng.choice([1 * MiB, 1 * MiB + 3])

    def some_keys(self, lo: int = 1, hi: int = 8) -> list[bytes]:
        return self.rng.sample(self.keys, self.rng.randint(lo, min(hi, len(self.keys))))

    def kind(self) -> int:
        return pb.STATE if self.rng.random() < 0.2 else pb.BLOCK

    # -- checks -------------------------------------------------------------------------------

    def check_read(self, token: str, key: bytes, kind: int, got: bytes | bytearray | None) -> None:
        if got is not None and bytes(got) != expected(token, key, kind, len(got)):
            self.failures.append(f"wrong bytes for token={token!r} key={key.hex()[:8]} kind={kind} len={len(got)}")

    def rpc(self, fn: Any, req: Any, token: str = "") -> Any:
        try:
            return fn(req, timeout=20, metadata=(("authorization", f"Bearer {token}"),) if token else ())
        except grpc.RpcError as err:
            if err.code() not in ALLOWED:
                self.failures.append(f"{fn._method}: {err.code()} {err.details()}")
            return None

    # -- operations ---------------------------------------------------------------------------

    def op_put(self) -> None:
        token = self.rng.choice(TOKENS)
        kind = self.kind()
        keys = self.some_keys()
        vals = [expected(token, k, kind, min(self.size(), 5 * MiB)) for k in keys]
        codes = self.clients[token].put(keys, vals, kind=kind)
        if len(codes) != len(keys):
            self.failures.append("put: wrong number of codes")

    def op_get(self) -> None:
        token = self.rng.choice(TOKENS)
        kind = self.kind()
        keys = self.some_keys()
        for k, g in zip(keys, self.clients[token].get(keys, kind=kind), strict=True):
            self.check_read(token, k, kind, g)

    def op_exists(self) -> None:
        token = self.rng.choice(TOKENS)
        c = self.clients[token]
        r = c.exists(self.some_keys(0, 12), pin=self.rng.random() < 0.3, lease_ms=self.rng.randint(1, 300),
                     prefix_only=self.rng.random() < 0.5, kind=self.rng.choice([0, 1, 0, 3]))
        if r.lease_id and self.rng.random() < 0.5:
            c.release([r.lease_id])

    def op_remove(self) -> None:
        token = self.rng.choice(TOKENS)
        self.clients[token].remove(self.some_keys(), kind=self.kind())

    def op_garbage_grpc(self) -> None:
        token = self.rng.choice(TOKENS + ["bogus"])
        blob = self.rng.randbytes(self.rng.choice([0, 1, 31, 32, 33, 64, 100]))
        which = self.rng.randrange(4)
        if which == 0:
            self.rpc(self.stub.Remove, pb.RemoveRequest(keys=blob, kind=self.rng.randint(-2, 4)), token)  # type: ignore[arg-type]
        elif which == 1:
            self.rpc(self.stub.Release, pb.ReleaseRequest(lease_ids=[self.rng.getrandbits(64)]), token)
        elif which == 2:
            self.rpc(self.admin_stub.SetRing, pb.Ring(epoch=self.rng.getrandbits(64)), token)
        else:
            self.rpc(self.stub.Stats, pb.Empty(), token)

    def op_garbage_transfer(self) -> None:
        host, _, port = self.node.transfer_address.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                r = self.rng.random()
                if r < 0.4:
                    sock.sendall(self.rng.randbytes(self.rng.randint(1, 400)))
                else:
                    op = self.rng.choice([OP_READ, OP_WRITE])
                    n = self.rng.choice([0, 1, 4096, 2**40])
                    hdr = encode_request(op, self.rng.getrandbits(64), b"dram", self.rng.getrandbits(24),
                                         n, self.rng.getrandbits(64))
                    sock.sendall(hdr + (self.rng.randbytes(min(n, 4096)) if op == OP_WRITE else b""))
                sock.shutdown(socket.SHUT_WR)
                sock.settimeout(5)
                while sock.recv(65536):
                    pass
        except OSError:
            pass  # the node may cut us off; that is its right

    def op_garbage_session(self) -> None:
        """Data-session frames: random bytes after the magic, or a valid header with lying
        counts and lengths, or a PUT whose payload stops short."""
        host, _, port = self.node.transfer_address.rpartition(":")
        token = self.rng.choice(TOKENS + ["bogus"]).encode()
        try:
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                r = self.rng.random()
                keys = b"".join(self.rng.sample(self.keys, 3))
                if r < 0.3:
                    sock.sendall(dp.REQUEST_MAGIC + self.rng.randbytes(self.rng.randint(1, 400)))
                elif r < 0.6:
                    hdr = dp.REQUEST.pack(dp.REQUEST_MAGIC, dp.VERSION, self.rng.randint(0, 6), self.rng.randint(0, 3),
                                          self.rng.getrandbits(8), self.rng.getrandbits(32),
                                          self.rng.choice([0, 3, 2**16, 2**32 - 1]), self.rng.getrandbits(32),
                                          self.rng.choice([0, len(token), 5000]), self.rng.choice([0, 7]),
                                          self.rng.getrandbits(64), self.rng.getrandbits(64))
                    sock.sendall(hdr + token + keys)
                else:
                    sizes = np.array([self.rng.choice([0, 1, 4096, 2**41]) for _ in range(3)], np.uint64)
                    frame = dp.encode_request(dp.OP_PUT, 1, token, keys, kind=self.rng.randint(0, 2),
                                              sizes=sizes)
                    sock.sendall(b"".join(frame))
                    sock.sendall(self.rng.randbytes(self.rng.randint(0, 6000)))  # short or long
                sock.shutdown(socket.SHUT_WR)
                sock.settimeout(5)
                while sock.recv(65536):
                    pass
        except OSError:
            pass  # the node may cut us off; that is its right

    def run(self, n: int) -> None:
        ops = [(self.op_put, 5), (self.op_get, 4), (self.op_exists, 3), (self.op_remove, 2),
               (self.op_garbage_grpc, 2), (self.op_garbage_transfer, 1), (self.op_garbage_session, 3)]
        choices = [f for f, w in ops for _ in range(w)]
        for _ in range(n):
            op = self.rng.choice(choices)
            self.counts[op.__name__] = self.counts.get(op.__name__, 0) + 1
            try:
                op()
            except ALLOWED_ERRORS:
                pass
            except Exception as exc:
                self.failures.append(f"{op.__name__}: {type(exc).__name__}: {exc}")


@pytest.fixture(scope="module")
def nodes(module_stores: Any) -> Any:
    return module_stores.start_many({
        "dram": {"dram": "4MiB", "tenants": TENANTS},
        "all-tiers": {"dram": "4MiB", "tenants": TENANTS, "ssd": "6MiB", "sharedfs": module_stores.tmp / "fs"}})


@pytest.mark.parametrize("tiers", ["dram", "all-tiers"])
def test_random_request_sequences(nodes: Any, h: Any, request: pytest.FixtureRequest, tiers: str) -> None:
    """The client's data session, garbage gRPC calls, transfer requests and session frames."""
    node = nodes[tiers]
    seed = f"{request.node.nodeid}"
    keys = h.rand_keys(random.Random(seed), 24)
    fuzzers = [Fuzzer(node, random.Random(f"{seed}/{i}"), keys, h) for i in range(2)]
    threads = [threading.Thread(target=f.run, args=(OPS_PER_THREAD,)) for f in fuzzers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "the node wedged a request sequence"
    failures = [x for f in fuzzers for x in f.failures]
    assert failures == [], failures[:20]
    assert node.alive()
    # Health and a fresh round trip.
    c = node.client()
    assert c.health().ok
    k, v = b"\xee" * 32, b"after the storm" * 1000
    c.remove([k])
    assert c.put([k], [v]) == [pb.OK]
    assert [bytes(g) for g in c.get([k]) if g is not None] == [v]
    # Accounting: remove everything, let reservations and leases expire, and nothing may be left.
    time.sleep(0.5)

    def drained() -> bool:
        for token in TOKENS:
            for kind in (pb.BLOCK, pb.STATE):
                node.client(token).remove(keys + [k], kind=kind)
        st = node.client().stats()
        return all(t.used_bytes == 0 and t.objects == 0 for t in st.tiers if t.name != "sharedfs")

    h.wait_for(drained, 15, interval=0.3, what="all space to be reclaimed")
    for token in TOKENS:
        for kind in (pb.BLOCK, pb.STATE):
            assert node.client(token).exists(keys, prefix_only=False, kind=kind).present == [False] * len(keys)
    st = node.client().stats()
    for t in st.tenants:
        assert t.used_bytes == 0 and t.objects == 0, t
    assert st.counters[StoreCounter.STORED] > 0
