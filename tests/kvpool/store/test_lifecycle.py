"""Two-phase writes and leases against a real node: dead writers leave nothing, stale reads fail closed."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from typing import Any

import pytest

from kvpool.core.checksum import checksum
from kvpool.transfer import TransferEngine, TransferRequest
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def nodes(module_stores: Any) -> Any:
    return module_stores.start_many({
        "twophase": {"dram": "8MiB"},
        "lease": {"dram": "4MiB"}, "recycle": {"dram": "4MiB"}, "pinned": {"dram": "4MiB"},
        "allpinned": {"dram": "4MiB"}})


def _usage(h: Any, c: Any) -> tuple[int, int, dict[str, int]]:
    """DRAM bytes in use, the default tenant's bytes, and the node's counters (for deltas)."""
    st = c.stats()
    return (h.stats_tier(st, "dram").used_bytes, h.stats_tenant(st, "default").used_bytes, dict(st.counters))


def _spawn_writer(node: Any, h: Any, mode: str, key: bytes, size: int, timeout_ms: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(h.here / "_killed_writer.py"), node.address, mode, key.hex(),
                             str(size), str(timeout_ms)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_wrote(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("WROTE"):
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"writer failed: {line!r} {err}")


def test_writer_killed_before_commit_leaves_nothing(nodes: Any, h: Any, rng: random.Random) -> None:
    """Two real writer processes reserve and send bytes (one all of them, one half), then die."""
    node = nodes["twophase"]
    c = node.client()
    used0, tenant0, counters0 = _usage(h, c)
    keys = h.rand_keys(rng, 2)
    size = 1 * MiB
    timeout_ms = 3000  # long enough for the checks below on a loaded machine, short enough to wait for
    t0 = time.monotonic()
    procs = [_spawn_writer(node, h, mode, k, size, timeout_ms) for mode, k in zip(["full", "partial"], keys,
                                                                                  strict=True)]
    try:
        for p in procs:
            _wait_wrote(p)
        # Reserved (and, for "full", every byte written): still invisible to everyone.
        assert c.exists(keys, prefix_only=False).present == [False, False]
        assert c.get(keys) == [None, None]
        s = c.stats()
        assert h.stats_tier(s, "dram").used_bytes >= used0 + 2 * size  # the reservations hold their space...
        # ...and their keys, so a concurrent writer is told someone else is writing them.
        assert c.put(keys, [b"x" * size] * 2) == [pb.IN_FLIGHT] * 2
    finally:
        for p in procs:
            p.kill()
            p.communicate(timeout=10)
    assert c.exists(keys, prefix_only=False).present == [False, False]
    assert c.get(keys) == [None, None]
    # After the reservations' expiry the space comes back and the keys are free again.
    left = timeout_ms / 1000 - (time.monotonic() - t0)
    if left > 0:
        time.sleep(left)

    h.wait_for(lambda: _usage(h, c)[:2] == (used0, tenant0), 10, what="reservation space to be reclaimed")
    counters = _usage(h, c)[2]
    assert counters["reservations_expired"] - counters0.get("reservations_expired", 0) == 2
    assert counters.get("stored", 0) == counters0.get("stored", 0)
    values = h.rand_values(rng, [size, size])
    assert c.put(keys, values) == [pb.OK, pb.OK]
    assert [bytes(g) if g is not None else None for g in c.get(keys)] == values


def test_commit_after_reservation_expiry_is_refused(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["twophase"]
    stub = node.stub()
    c = node.client()
    used0, tenant0, _ = _usage(h, c)
    [key] = h.rand_keys(rng, 1)
    value = rng.randbytes(64 * KiB)
    t0 = time.monotonic()
    start = stub.PutStart(pb.PutStartRequest(keys=key, sizes=[len(value)], timeout_ms=1000), timeout=10)
    assert list(start.codes) == [pb.OK]
    with TransferEngine() as engine:
        [st] = engine.transfer(start.location.transfer_address, [TransferRequest(
            "write", memoryview(value), start.location.segment, start.offsets[0], len(value), start.tokens[0])])
        assert st.ok
        time.sleep(max(0.0, t0 + 1.1 - time.monotonic()))
        # A write after expiry is refused by the guard...
        [st] = engine.transfer(start.location.transfer_address, [TransferRequest(
            "write", memoryview(value), start.location.segment, start.offsets[0], len(value), start.tokens[0])])
        assert not st.ok
    # ...and so is the commit: nothing becomes visible.
    commit = stub.PutCommit(pb.PutCommitRequest(reservation_id=start.reservation_id,
                                                checksums=[checksum(value)]), timeout=10)
    assert list(commit.codes) == [pb.LEASE_EXPIRED]
    assert c.exists([key]).prefix == 0
    assert _usage(h, c)[:2] == (used0, tenant0)


def test_revoke_frees_the_reservation(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["twophase"]
    stub = node.stub()
    c = node.client()
    _, tenant0, counters0 = _usage(h, c)
    keys = h.rand_keys(rng, 3)
    start = stub.PutStart(pb.PutStartRequest(keys=b"".join(keys), sizes=[4096] * 3), timeout=10)
    assert list(start.codes) == [pb.OK] * 3
    # Per-item revoke inside the commit: item 1 revoked, the others committed.
    vals = [bytes([i]) * 4096 for i in range(3)]
    with TransferEngine() as engine:
        sts = engine.transfer(start.location.transfer_address, [TransferRequest(
            "write", memoryview(v), start.location.segment, start.offsets[i], 4096, start.tokens[i])
            for i, v in enumerate(vals)])
        assert all(s.ok for s in sts)
    commit = stub.PutCommit(pb.PutCommitRequest(reservation_id=start.reservation_id,
                                                checksums=[checksum(v) for v in vals], revoke=b"\x00\x01\x00"),
                            timeout=10)
    assert list(commit.codes) == [pb.OK, pb.OK, pb.OK]
    assert c.exists(keys, prefix_only=False).present == [True, False, True]
    # Whole-reservation revoke.
    start = stub.PutStart(pb.PutStartRequest(keys=keys[1], sizes=[4096]), timeout=10)
    stub.PutRevoke(pb.PutRevokeRequest(reservation_id=start.reservation_id), timeout=10)
    assert c.exists([keys[1]]).prefix == 0
    _, tenant1, counters1 = _usage(h, c)
    assert counters1["revoked"] - counters0.get("revoked", 0) == 2
    assert tenant1 - tenant0 == 2 * 4096
    # A commit of a revoked reservation commits nothing.
    commit = stub.PutCommit(pb.PutCommitRequest(reservation_id=start.reservation_id, checksums=[0]), timeout=10)
    assert list(commit.codes) == [pb.LEASE_EXPIRED]
    assert c.exists([keys[1]]).prefix == 0


def _stale_fetch(h: Any, node: Any, plan: Any, size: int, verify: bool) -> tuple[int, bytes]:
    c = node.client(verify=verify)
    buf = bytearray(size)
    [code] = h.fetch_into(c, plan, [memoryview(buf)])
    return code, bytes(buf)


def test_expired_lease_fails_closed(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["lease"]
    c = node.client()
    size = 256 * KiB
    [ka, kb] = h.rand_keys(rng, 2)
    va, vb = rng.randbytes(size), rng.randbytes(size)
    assert c.put([ka], [va]) == [pb.OK]
    t0 = time.monotonic()
    plan = h.get_plan(c, [ka], lease_ms=1000)
    assert plan.codes == [pb.OK]
    # Within the lease the plan reads the object.
    code, got = _stale_fetch(h, node, plan, size, verify=True)
    assert code == pb.OK and got == va
    # Pinned: removing it is refused while the lease lives.
    assert c.remove([ka]) == [pb.IN_FLIGHT]
    time.sleep(max(0.0, t0 + 1.1 - time.monotonic()))
    # Lease gone, object still there: the stale plan is refused, not served.
    for verify in (True, False):
        code, _ = _stale_fetch(h, node, plan, size, verify)
        assert code == pb.LEASE_EXPIRED
    # Recycle the slot: remove the object and write another one of the same size.
    assert c.remove([ka]) == [pb.OK]
    assert c.put([kb], [vb]) == [pb.OK]
    plan_b = h.get_plan(c, [kb])
    assert plan_b.offsets == plan.offsets, "the new object should reuse the freed slot"
    c.release([plan_b.lease_id])
    for verify in (True, False):
        code, got = _stale_fetch(h, node, plan, size, verify)
        assert code in (pb.LEASE_EXPIRED, pb.CHECKSUM)
        assert code != pb.OK
        if not verify:
            assert got != vb, "the guard let a stale plan read another object's bytes"


def test_slot_recycled_by_eviction_fails_closed(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["recycle"]
    c = node.client()
    size = 512 * KiB
    keys = h.rand_keys(rng, 40)
    vals = h.rand_values(rng, [size] * 40)
    assert c.put(keys[:1], vals[:1]) == [pb.OK]
    plan = h.get_plan(c, keys[:1], lease_ms=100)
    time.sleep(0.2)
    # Write pressure: far more than the arena, so the first object is evicted and its slot reused.
    for i in range(1, 40, 4):
        assert c.put(keys[i:i + 4], vals[i:i + 4]) == [pb.OK] * len(keys[i:i + 4])
    assert c.exists(keys[:1]).prefix == 0
    assert c.stats().counters["evicted"] > 0
    for verify in (True, False):
        code, got = _stale_fetch(h, node, plan, size, verify)
        assert code in (pb.LEASE_EXPIRED, pb.CHECKSUM)
        if not verify:
            assert got not in vals, "the guard let a stale plan read another object's bytes"


def test_pinned_objects_are_never_evicted(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["pinned"]
    c = node.client()
    size = 256 * KiB
    keys = h.rand_keys(rng, 12)
    vals = h.rand_values(rng, [size] * 12)
    assert c.put(keys[:8], vals[:8]) == [pb.OK] * 8
    ex = c.exists(keys[:8], pin=True, lease_ms=30000)
    assert ex.prefix == 8 and ex.lease_id
    # 8 pinned objects fill half the arena; push 3x the arena through what is left.
    codes: list[int] = []
    for _ in range(6):
        more = h.rand_keys(rng, 8)
        codes += c.put(more, h.rand_values(rng, [size] * 8))
    assert set(codes) <= {pb.OK, pb.NO_SPACE}
    assert c.exists(keys[:8]).prefix == 8
    assert [bytes(g) if g is not None else None for g in c.get(keys[:8])] == vals[:8]
    c.release([ex.lease_id])
    # Once released they are ordinary LRU objects again.
    for _ in range(3):
        more = h.rand_keys(rng, 8)
        assert c.put(more, h.rand_values(rng, [size] * 8)) == [pb.OK] * 8
    assert c.exists(keys[:8]).prefix == 0


def test_everything_pinned_refuses_with_no_space(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["allpinned"]
    c = node.client()
    size = 512 * KiB
    keys = h.rand_keys(rng, 7)
    assert c.put(keys, h.rand_values(rng, [size] * 7)) == [pb.OK] * 7
    ex = c.exists(keys, pin=True, lease_ms=30000)
    assert ex.prefix == 7
    more = h.rand_keys(rng, 4)
    codes = c.put(more, h.rand_values(rng, [size] * 4))
    assert pb.NO_SPACE in codes
    st = c.stats()
    assert st.counters["refused_space"] == codes.count(pb.NO_SPACE)
    assert h.stats_tier(st, "dram").used_bytes <= h.stats_tier(st, "dram").capacity_bytes
    assert c.exists(keys).prefix == 7
