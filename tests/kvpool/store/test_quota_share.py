"""The pool-wide quota's pure parts (``kvpool.store.quota``): each node's share of a tenant's
quota under a ring, the usage in the quota's unit, and what a node over its share drops."""

from __future__ import annotations

import random
from pathlib import Path

from kvpool.core.checksum import checksum
from kvpool.core.ring import Member, Ring, owners
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS
from kvpool.store.node import NodeConfig, StoreNode, Tenant
from kvpool.store.quota import Held, pool_usage, quota_share, ring_share, trim_to_share
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

MiB = 1 << 20


def _ring(n: int, replicas: int = 1, draining: int = 0) -> Ring:  # s0 .. s<draining - 1> drain
    return Ring(1, tuple(Member(f"s{i}", f"a{i}", "draining" if i < draining else "active") for i in range(n)),
                replicas=replicas)


def test_share_is_the_quota_times_copies_over_active_members() -> None:
    assert quota_share(MiB, 1, 4) == MiB // 4
    assert quota_share(MiB, 2, 4) == MiB // 2
    assert quota_share(MiB, 3, 4) == 3 * MiB // 4
    # R above the members: every member keeps every object, so each admits the whole quota.
    assert quota_share(MiB, 3, 2) == MiB
    # Rounded up, never down: the shares add up to at least quota x copies, at most n bytes over.
    assert quota_share(10, 1, 3) == 4 and quota_share(10, 2, 3) == 7
    for q in (1, 999, MiB + 1):
        for n in range(1, 9):
            for r in range(1, 4):
                copies = min(r, n)
                assert q * copies <= n * quota_share(q, r, n) < q * copies + n
    # No quota stays none; no ring (a standalone node, or before the first SetRing): all of it.
    assert quota_share(0, 2, 4) == 0
    assert quota_share(MiB, 1, 0) == MiB


def test_ring_share_counts_active_members_only() -> None:
    assert ring_share(MiB, _ring(4)) == MiB // 4
    assert ring_share(MiB, _ring(4, replicas=2)) == MiB // 2
    # A draining member takes no writes: the others' shares cover the quota without it.
    assert ring_share(MiB, _ring(5, draining=1)) == MiB // 4
    # Node loss (3 left) grows each share; a scale-up (5) shrinks it.
    assert ring_share(MiB, _ring(3)) > ring_share(MiB, _ring(4)) > ring_share(MiB, _ring(5))
    assert ring_share(MiB, Ring(0)) == MiB


def test_shares_cover_the_keys_the_ring_sends_each_node() -> None:
    """What makes the sum of shares the pool limit: rendezvous hashing gives each active member
    about copies/n of a tenant's writes, so a node fills its share when the pool is at the quota."""
    rng = random.Random(7)
    keys = [rng.randbytes(32) for _ in range(8000)]
    for n, r in ((4, 1), (4, 2), (5, 2)):
        ids = [f"s{i}" for i in range(n)]
        per_node = [0] * n
        for row in owners(keys, ids, r).tolist():
            for j in row:
                per_node[j] += 1
        expected = len(keys) * quota_share(MiB, r, n) / MiB
        assert all(abs(c - expected) < 0.06 * expected for c in per_node), (n, r, per_node, expected)


def test_pool_usage_is_in_logical_bytes() -> None:
    assert pool_usage(2 * MiB, 2, 4) == MiB
    assert pool_usage(MiB, 1, 4) == MiB
    assert pool_usage(3, 2, 4) == 2  # rounded up: at the limit never reads under it
    assert pool_usage(MiB, 3, 2) == MiB // 2  # R above the members: min(R, n) copies
    assert pool_usage(MiB, 2, 0) == MiB


def test_trim_drops_foreign_objects_first_then_own_only_when_asked() -> None:
    held = [Held(10, 5.0, True), Held(10, 1.0, False), Held(10, 3.0, False), Held(10, 0.5, True)]
    # 40 used, share 25: the foreign ones go, oldest first; an own one only with evict_own.
    assert trim_to_share(40, 25, held, evict_own=False) == [1, 2]
    assert trim_to_share(40, 15, held, evict_own=False) == [1, 2]  # the rest stays: refused until under
    assert trim_to_share(40, 15, held, evict_own=True) == [1, 2, 3]
    assert trim_to_share(40, 35, held, evict_own=True) == [1]
    # Within the share, or no quota: nothing.
    assert trim_to_share(40, 40, held, evict_own=True) == []
    assert trim_to_share(40, 0, held, evict_own=True) == []
    assert trim_to_share(40, 10, [], evict_own=True) == []


# -- a store node applying it, in-process (the ring change is what SetRing calls) -----------------

def _node(tmp_path: Path, node_id: str = "a") -> StoreNode:
    return StoreNode(NodeConfig(node_id=node_id, dram_bytes=4 * MiB, shm_dir=str(tmp_path)))


def _put(node: StoreNode, keys: list[bytes], size: int) -> list[int]:
    codes, offs, toks, rid = node.put_start("q", keys, [size] * len(keys), DEFAULT_TRAFFIC_CLASS, pb.BLOCK)
    sums = [0] * len(keys)
    for i, c in enumerate(codes):
        if c == pb.OK:
            e = node.acquire("write", offs[i], size, toks[i])
            assert e is not None
            node.dram.view[offs[i]:offs[i] + size] = bytes([i % 251]) * size
            node.release_guard(e)
            sums[i] = checksum(bytes([i % 251]) * size)
    if not rid:
        return codes
    done = node.put_commit("q", rid, sums)
    return [done[i] if c == pb.OK else c for i, c in enumerate(codes)]


def _members(*ids: str, draining: tuple[str, ...] = ()) -> tuple[Member, ...]:
    return tuple(Member(i, f"addr-{i}", "draining" if i in draining else "active") for i in ids)


def test_a_node_admits_its_share_and_follows_the_ring(tmp_path: Path) -> None:
    kib = 1 << 10
    rng = random.Random(3)
    node = _node(tmp_path)
    try:
        node.set_tenants([Tenant("q", "tok-q", quota_bytes=256 * kib)])
        # No ring yet (a standalone node): the whole quota.
        assert node.tenants["q"].share_bytes == 256 * kib
        node.set_ring(Ring(1, _members("a", "b", "c", "d")))
        assert node.tenants["q"].share_bytes == 64 * kib
        keys = [rng.randbytes(32) for _ in range(600)]
        mine = [k for k, o in zip(keys, Ring(1, _members("a", "b", "c", "d")).write_owned("a", keys), strict=True) if o]
        codes = _put(node, mine, kib)
        assert codes.count(pb.OK) == 64 and set(codes) == {pb.OK, pb.QUOTA_EXCEEDED}
        # A node lost: the share grows, and the node takes more of the tenant.
        node.set_ring(Ring(2, _members("a", "b", "c")))
        assert node.tenants["q"].share_bytes == -(-256 * kib // 3)
        more = [rng.randbytes(32) for _ in range(40)]
        assert _put(node, more, kib).count(pb.OK) == 21
        assert node.tenants["q"].used_bytes == 85 * kib
        # A scale-up to 5: over the new share, the node drops objects it no longer owns, never
        # more than it must, and none it still owns (no evictOwnOnQuota).
        ring = Ring(3, _members("a", "b", "c", "x", "y"))
        held = [k for k in mine + more if node.exists("q", [k])[0]]
        assert len(held) == 85
        node.set_ring(ring)
        t = node.tenants["q"]
        assert t.share_bytes == -(-256 * kib // 5)
        kept = [k for k in held if node.exists("q", [k])[0]]
        dropped = set(held) - set(kept)
        owned = dict(zip(held, ring.write_owned("a", held).tolist(), strict=True))
        assert dropped and not any(owned[k] for k in dropped)
        assert t.used_bytes <= t.share_bytes or all(owned[k] for k in kept)
        assert t.used_bytes > t.share_bytes - kib  # dropped down to the share, not below it
        assert t.counters[StoreCounter.EVICTED_QUOTA] == len(dropped)
        # Draining: the node owns nothing, and drops nothing (its objects are on their way out).
        before = t.used_bytes
        node.set_ring(Ring(4, _members("a", "b", draining=("a",))))
        assert t.used_bytes == before
    finally:
        node.close()
