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
from kvpool.core.checksum import checksum
from kvpool.transfer import TransferEngine, TransferRequest
from kvpool.transfer.protocol import OP_READ, OP_WRITE, encode_request
from kvpool.wire import store_frames as dp
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
        self.raw_clients = {t: node.client(t, verify=False) for t in TOKENS}
        self.stub = node.stub()
        self.admin_stub = node.admin_stub()
        self.engine = TransferEngine(stall_timeout=5.0)
        self.stale: list[tuple[str, Any, list[bytes], int]] = []
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

    def op_raw_put(self) -> None:
        token = self.rng.choice(TOKENS)
        kind = self.rng.choice([pb.BLOCK, pb.STATE, pb.BLOCK, 5])
        keys = self.some_keys(0, 6)
        sizes = [self.size() for _ in keys]
        if self.rng.random() < 0.1:
            sizes.append(7)  # mismatched lengths
        blob = b"".join(keys)
        if self.rng.random() < 0.05:
            blob += b"\x01"
        start = self.rpc(self.stub.PutStart, pb.PutStartRequest(
            keys=blob, sizes=sizes, kind=kind, traffic_class=self.rng.choice(["chatbot", "agent", "", "x" * 300]),  # type: ignore[arg-type]
            timeout_ms=self.rng.randint(1, 400)), token)
        if start is None:
            return
        reqs, idx, vals = [], [], []
        for i, code in enumerate(start.codes):
            if code != pb.OK:
                continue
            v = expected(token, keys[i], kind, sizes[i])
            vals.append(v)
            off, tok = start.offsets[i], start.tokens[i]
            r = self.rng.random()
            if r < 0.1:
                tok ^= 1 << self.rng.randint(0, 62)
            elif r < 0.15:
                off += self.rng.choice([-4096, 4096, 1])
                off = max(off, 0)
            if self.rng.random() < 0.85:
                reqs.append(TransferRequest("write", memoryview(v), start.location.segment, off, len(v), tok))
                idx.append(i)
        if reqs:
            self.engine.transfer(start.location.transfer_address, reqs)
        r = self.rng.random()
        if r < 0.1:
            return  # abandoned: the reservation must expire
        if r < 0.2:
            self.rpc(self.stub.PutRevoke, pb.PutRevokeRequest(reservation_id=start.reservation_id), token)
            return
        sums = []
        for i in range(len(start.codes)):
            good = start.codes[i] == pb.OK and i < len(sizes)
            s = checksum(expected(token, keys[i], kind, sizes[i])) if good else 0
            sums.append(s if self.rng.random() < 0.9 else self.rng.getrandbits(64))
        if self.rng.random() < 0.05:
            sums.append(1)
        revoke = bytes(self.rng.random() < 0.1 for _ in sums) if self.rng.random() < 0.3 else b""
        rid = start.reservation_id if self.rng.random() < 0.95 else self.rng.getrandbits(64)
        self.rpc(self.stub.PutCommit, pb.PutCommitRequest(reservation_id=rid, checksums=sums, revoke=revoke), token)

    def op_get(self) -> None:
        token = self.rng.choice(TOKENS)
        kind = self.kind()
        keys = self.some_keys()
        for k, g in zip(keys, self.clients[token].get(keys, kind=kind), strict=True):
            self.check_read(token, k, kind, g)

    def op_get_plan_stale(self) -> None:
        token = self.rng.choice(TOKENS)
        kind = self.kind()
        keys = self.some_keys()
        plan = self.h.get_plan(self.clients[token], keys, lease_ms=self.rng.randint(1, 200), kind=kind)
        self.stale.append((token, plan, keys, kind))
        if len(self.stale) > 6 or self.rng.random() < 0.3:
            token, plan, keys, kind = self.stale.pop(self.rng.randrange(len(self.stale)))
            bufs = [bytearray(s) if c == pb.OK else None for c, s in zip(plan.codes, plan.sizes, strict=True)]
            # Without client-side verification: the node's guard alone must keep stale plans out.
            codes = self.h.fetch_into(self.raw_clients[token], plan, [memoryview(b) if b is not None else None
                                                              for b in bufs])
            for k, c, b in zip(keys, codes, bufs, strict=True):
                if c == pb.OK and b is not None:
                    self.check_read(token, k, kind, b)

    def op_exists(self) -> None:
        token = self.rng.choice(TOKENS)
        keys = self.some_keys(0, 12)
        r = self.rpc(self.stub.Exists, pb.ExistsRequest(
            keys=b"".join(keys), pin=self.rng.random() < 0.3, lease_ms=self.rng.randint(1, 300),
            prefix_only=self.rng.random() < 0.5, kind=self.rng.choice([0, 1, 0, 3])), token)  # type: ignore[arg-type]
        if r is not None and r.lease_id and self.rng.random() < 0.5:
            self.rpc(self.stub.Release, pb.ReleaseRequest(lease_ids=[r.lease_id]), token)

    def op_remove(self) -> None:
        token = self.rng.choice(TOKENS)
        self.clients[token].remove(self.some_keys(), kind=self.kind())

    def op_garbage_grpc(self) -> None:
        token = self.rng.choice(TOKENS + ["bogus"])
        blob = self.rng.randbytes(self.rng.choice([0, 1, 31, 32, 33, 64, 100]))
        which = self.rng.randrange(6)
        if which == 0:
            self.rpc(self.stub.Exists, pb.ExistsRequest(keys=blob, kind=self.rng.randint(-2, 4)), token)  # type: ignore[arg-type]
        elif which == 1:
            self.rpc(self.stub.Get, pb.GetRequest(keys=blob, lease_id=self.rng.getrandbits(64),
                                                  lease_ms=self.rng.getrandbits(32)), token)
        elif which == 2:
            self.rpc(self.stub.Remove, pb.RemoveRequest(keys=blob), token)
        elif which == 3:
            self.rpc(self.stub.Release, pb.ReleaseRequest(lease_ids=[self.rng.getrandbits(64)]), token)
        elif which == 4:
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
        ops = [(self.op_put, 5), (self.op_raw_put, 4), (self.op_get, 4), (self.op_get_plan_stale, 2),
               (self.op_exists, 3), (self.op_remove, 2), (self.op_garbage_grpc, 2), (self.op_garbage_transfer, 1),
               (self.op_garbage_session, 1)]
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

    def close(self) -> None:
        self.engine.close()


@pytest.fixture(scope="module")
def nodes(module_stores: Any) -> Any:
    return module_stores.start_many({
        "dram": {"dram": "4MiB", "tenants": TENANTS},
        "all-tiers": {"dram": "4MiB", "tenants": TENANTS, "ssd": "6MiB", "sharedfs": module_stores.tmp / "fs"}})


@pytest.mark.parametrize("tiers", ["dram", "all-tiers"])
def test_random_request_sequences(nodes: Any, h: Any, request: pytest.FixtureRequest, tiers: str) -> None:
    """The client's data session, and the node's gRPC data calls driven by hand (raw puts, stale plans)."""
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
    for f in fuzzers:
        f.close()
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
    assert st.counters["stored"] > 0
