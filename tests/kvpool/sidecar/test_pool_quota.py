"""A tenant's ``quotaBytes`` is a limit for the whole pool (issue 19, finding 3), with real store
and sidecar processes: 1 MiB on 4 store nodes holds within the stated slack with R=1 and R=2,
after a node is lost and after one is added; and the writer learns the pool's verdict
(``Client.put(..., wait=True)`` answers QUOTA_EXCEEDED).

Usage is counted as the quota is (``kvpool.store.quota``): logical bytes, the bytes the tenant's
objects take on all store nodes divided by the copies kept (min(R, nodes)).
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import pytest

from kvpool.apps.cluster import LocalCluster
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
QUOTA = 1 * MiB
SLACK = 0.10
"""The stated slack (README "Quotas"): the pool holds at most quota x (1 + SLACK) of a tenant."""
OBJECT = 4 * KiB
BATCH = 64
TENANT = "t"


def _cluster(replication: int, stores: int = 4, sidecars: int = 1, **kw: Any) -> LocalCluster:
    return LocalCluster(stores=stores, sidecars=sidecars, tenants=[TENANT] * sidecars, quotas={TENANT: QUOTA},
                        replication=replication, store_bytes=32 * MiB, local_bytes=32 * MiB, drain_seconds=3, **kw)


def _physical(lc: LocalCluster) -> int:
    """The tenant's bytes on every live store node (admin view)."""
    total = 0
    for addr, p in zip(lc.stores, lc.store_procs, strict=True):
        if p.popen.poll() is not None:
            continue
        with lc.admin(addr) as c:
            total += sum(t.used_bytes for t in c.stats().tenants if t.tenant_id == TENANT)
    return total


def _live_stores(lc: LocalCluster) -> int:
    return sum(p.popen.poll() is None for p in lc.store_procs)


def _logical(lc: LocalCluster) -> float:
    return _physical(lc) / max(1, min(lc.replication, _live_stores(lc)))


def _write(lc: LocalCluster, rng: random.Random, nbytes: int, h: Any) -> list[bytes]:
    """Write ``nbytes`` of new objects through sidecar 0 and push them to the pool (what the pool
    refuses is dropped by the flush)."""
    keys = h.keys(rng, nbytes // OBJECT)
    with lc.connect(0) as c:
        h.wait_for(lambda: c.stats().ring_epoch == lc.epoch, what="the sidecar to learn the ring")
        for i in range(0, len(keys), BATCH):
            batch = keys[i:i + BATCH]
            assert c.put(batch, [rng.randbytes(OBJECT) for _ in batch]) == [pb.OK] * len(batch)
        c.flush(timeout_ms=20000)
        h.wait_for(lambda: c.stats().pending_pool_bytes == 0, what="write-through backlog")
    return keys


def _assert_within_quota(lc: LocalCluster, what: str) -> float:
    held = _logical(lc)
    print(f"{what}: the pool holds {held / MiB:.3f} MiB of a {QUOTA / MiB:.0f} MiB quota "
          f"({_physical(lc) / MiB:.3f} MiB on {_live_stores(lc)} nodes, R={lc.replication})")
    assert held <= QUOTA * (1 + SLACK), f"{what}: {held / MiB:.3f} MiB held of a 1 MiB quota"
    return held


@pytest.mark.parametrize("replication", [1, 2])
def test_quota_holds_across_the_pool(replication: int, h: Any, rng: random.Random) -> None:
    """Finding 3: 4 MiB written under a 1 MiB quota on 4 store nodes (633cc92: 3.69 MiB held)."""
    with _cluster(replication, sidecars=2) as lc:
        keys = _write(lc, rng, 4 * MiB, h)
        held = _assert_within_quota(lc, f"R={replication}")
        # A limit, not a refusal of everything: the tenant gets (nearly) its quota.
        assert held >= 0.75 * QUOTA
        # Counted another way: the distinct objects a fresh sidecar of the tenant reads from the
        # pool (with R=2 an object one owner admitted and the other refused has one copy).
        with lc.connect(1) as fresh:
            readable = sum(n == OBJECT for n in fresh.get_into(keys, [bytearray(OBJECT) for _ in keys])) * OBJECT
        print(f"R={replication}: {readable / MiB:.3f} MiB readable from the pool")
        assert 0.75 * QUOTA <= readable <= QUOTA * (1 + SLACK)


@pytest.mark.parametrize("replication", [1, 2])
def test_quota_holds_after_a_node_is_lost(replication: int, h: Any, rng: random.Random) -> None:
    with _cluster(replication) as lc:
        _write(lc, rng, 2 * MiB, h)
        _assert_within_quota(lc, "before the loss")
        lost = lc.store_procs[1]
        os.kill(lost.pid, signal.SIGKILL)
        lost.popen.wait(timeout=30)
        lc.publish_ring()  # the survivors' shares grow: the quota is over 3 nodes now
        _write(lc, rng, 4 * MiB, h)
        held = _assert_within_quota(lc, "after the loss")
        assert held >= 0.75 * QUOTA  # the survivors took the lost node's part of the quota


@pytest.mark.parametrize("replication", [1, 2])
def test_quota_holds_after_a_scale_up(replication: int, h: Any, rng: random.Random) -> None:
    with _cluster(replication) as lc:
        _write(lc, rng, 4 * MiB, h)
        _assert_within_quota(lc, "before the scale-up")
        lc.add_store()  # a new ring of 5: every share shrinks, and the new node has room
        _write(lc, rng, 4 * MiB, h)
        _assert_within_quota(lc, "after the scale-up")


def test_writer_sees_quota_exceeded(h: Any, rng: random.Random) -> None:
    """``put(wait=True)``: the pool's per-key verdict, and it is the truth: what it calls OK a
    fresh sidecar of the tenant reads from the pool, what it refused is not there."""
    with _cluster(1, sidecars=2) as lc:
        from kvpool.client.client import Client

        keys = h.keys(rng, 2 * MiB // OBJECT)
        values = [rng.randbytes(OBJECT) for _ in keys]
        codes: list[int] = []
        with Client(lc.sidecars[0]) as c:
            h.wait_for(lambda: c.stats().ring_epoch == lc.epoch, what="the sidecar to learn the ring")
            for i in range(0, len(keys), BATCH):
                codes += c.put(keys[i:i + BATCH], values[i:i + BATCH], wait=True)
        assert set(codes) <= {pb.OK, pb.QUOTA_EXCEEDED}, codes
        ok = [i for i, code in enumerate(codes) if code == pb.OK]
        refused = [i for i, code in enumerate(codes) if code == pb.QUOTA_EXCEEDED]
        assert refused and len(ok) * OBJECT <= QUOTA * (1 + SLACK) and len(ok) * OBJECT >= 0.75 * QUOTA
        _assert_within_quota(lc, "after put(wait=True)")
        with lc.connect(1) as fresh:
            got = fresh.get_into(keys, [bytearray(OBJECT) for _ in keys])
        assert [i for i, n in enumerate(got) if n == OBJECT] == ok


def test_put_wait_is_bounded_by_its_deadline(h: Any, rng: random.Random) -> None:
    """A pool that does not answer (its one store node stopped): ``put(wait=True)`` returns within
    its ``wait_seconds`` (plus a generous margin for a loaded machine), every object UNAVAILABLE,
    and the object stays readable locally; the write lands once the node is back."""
    with LocalCluster(stores=1, sidecars=1, store_bytes=32 * MiB, local_bytes=32 * MiB, drain_seconds=3) as lc:
        keys = h.keys(rng, 8)
        values = [rng.randbytes(OBJECT) for _ in keys]
        with lc.connect(0) as c:
            assert c.put(keys[:4], values[:4], wait=True) == [pb.OK] * 4
            store = lc.store_procs[0]
            os.kill(store.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                codes = c.put(keys[4:], values[4:], wait=True, wait_seconds=1.0)
                took = time.monotonic() - t0
            finally:
                os.kill(store.pid, signal.SIGCONT)
            assert codes == [pb.UNAVAILABLE] * 4 and took < 1.0 + 4.0, (codes, took)
            with c.get(keys[4:]) as got:
                assert [bytes(v) for v in got] == values[4:]
            assert c.flush(timeout_ms=20000).dropped_objects == 0
        with lc.admin(lc.stores[0]) as a:
            h.wait_for(lambda: sum(t.objects for t in a.stats().tenants) == 8, what="the late writes to land")


def test_writer_sees_the_pools_codes_for_a_batch_larger_than_the_local_tier(h: Any, rng: random.Random) -> None:
    """A put of 2 MiB into a 512 KiB local tier goes in rounds (and from the client's memory);
    with ``wait=True`` every code is still the pool's, and the pool's is the truth."""
    with LocalCluster(stores=4, sidecars=2, tenants=[TENANT] * 2, quotas={TENANT: QUOTA}, store_bytes=32 * MiB,
                      local_bytes=512 * KiB, drain_seconds=3) as lc:
        keys = h.keys(rng, 2 * MiB // OBJECT)
        values = [rng.randbytes(OBJECT) for _ in keys]
        with lc.connect(0) as c:
            h.wait_for(lambda: c.stats().ring_epoch == lc.epoch, what="the sidecar to learn the ring")
            codes = c.put(keys, values, wait=True)
            counters = h.counters(c)
        assert counters.get(SidecarCounter.PUT_SPILLED_ROUNDS, 0) + counters.get(SidecarCounter.PUT_STREAMED, 0) > 0, \
            counters
        assert set(codes) <= {pb.OK, pb.QUOTA_EXCEEDED}, sorted(set(codes))
        ok = [i for i, code in enumerate(codes) if code == pb.OK]
        assert 0.75 * QUOTA <= len(ok) * OBJECT <= QUOTA * (1 + SLACK)
        _assert_within_quota(lc, "after a spilling put(wait=True)")
        with lc.connect(1) as fresh:
            got = fresh.get_into(keys, [bytearray(OBJECT) for _ in keys])
        assert [i for i, n in enumerate(got) if n == OBJECT] == ok
