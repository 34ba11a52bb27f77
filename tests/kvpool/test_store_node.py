"""The store node's state machine in-process (no sockets): guard, leases, commits, accounting.

Bytes are moved the way the data session moves them: a write is ``acquire`` → copy into the
arena → ``release_guard``, a read ``read_pin`` → copy out → ``read_unpin``.  The integration
tests in tests/kvpool/store do the same over TCP.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.core import errors
from kvpool.core.checksum import checksum
from kvpool.core.ring import Member, Ring
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS
from kvpool.store.node import NodeConfig, StoreNode, Tenant
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB = 1 << 10
T = "default"


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[object]:
    made: list[StoreNode] = []

    def make(**kw: object) -> StoreNode:
        # Generous bounds of the waits for the disk (a loaded test machine): bytes, not latency.
        kw = {"tier_read_seconds": 10.0, "demote_wait_seconds": 10.0, **kw}
        cfg = NodeConfig(node_id=f"n{len(made)}", shm_dir=str(tmp_path), **kw)  # type: ignore[arg-type]
        n = StoreNode(cfg)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def write(node: StoreNode, off: int, tok: int, data: bytes) -> bool:
    e = node.acquire("write", off, len(data), tok)
    if e is None:
        return False
    try:
        node.dram.view[off:off + len(data)] = data
    finally:
        node.release_guard(e)
    return True


def put(node: StoreNode, keys: list[bytes], vals: list[bytes], tenant: str = T, kind: int = pb.BLOCK,
        tc: str = DEFAULT_TRAFFIC_CLASS) -> list[int]:
    codes, offs, toks, rid = node.put_start(tenant, keys, [len(v) for v in vals], tc, kind)
    sums = [0] * len(keys)
    for i, c in enumerate(codes):
        if c == pb.OK:
            assert write(node, offs[i], toks[i], vals[i])
            sums[i] = checksum(vals[i])
    if not rid:
        return codes
    commit = node.put_commit(tenant, rid, sums)
    return [commit[i] if c == pb.OK else c for i, c in enumerate(codes)]


def get(node: StoreNode, keys: list[bytes], tenant: str = T, kind: int = pb.BLOCK) -> list[bytes | None]:
    codes, found = node.read_pin(tenant, keys, kind)
    try:
        return [bytes(node.dram.slice(e.offset, e.size)) if c == pb.OK and e is not None else None
                for c, e in zip(codes, found, strict=True)]
    finally:
        node.read_unpin(found)


def test_tokens_are_random(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=1 << 20)
    keys = [bytes([i]) * 32 for i in range(64)]
    _, _, toks, _ = node.put_start(T, keys, [10] * 64, DEFAULT_TRAFFIC_CLASS, pb.BLOCK)
    assert len(set(toks)) == 64 and 0 not in toks
    gaps = sorted(abs(a - b) for a, b in zip(toks, toks[1:], strict=False))
    assert gaps[0] > 1 << 20  # nothing like a counter


def test_block_and_state_objects_share_a_key(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=1 << 20)
    k = b"s" * 32
    assert put(node, [k], [b"block"]) == [pb.OK]
    assert put(node, [k], [b"state!"], kind=pb.STATE) == [pb.OK]
    assert get(node, [k]) == [b"block"]
    assert get(node, [k], kind=pb.STATE) == [b"state!"]
    assert node.remove(T, [k], pb.STATE) == [pb.OK]
    assert get(node, [k]) == [b"block"]
    with pytest.raises(errors.InvalidArgument):
        node.exists(T, [k], kind=9)


def test_commits_are_verified_on_multi_tenant_nodes(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=1 << 20)
    k1, k2 = b"1" * 32, b"2" * 32
    # Single-tenant node: the commit's checksum is taken on trust (readers verify).
    codes, offs, toks, rid = node.put_start(T, [k1], [100], DEFAULT_TRAFFIC_CLASS, pb.BLOCK)
    assert node.put_commit(T, rid, [12345]) == [pb.OK]
    node.set_tenants([Tenant("a", "tok-a")])
    codes, offs, toks, rid = node.put_start("a", [k2], [100], DEFAULT_TRAFFIC_CLASS, pb.BLOCK)
    assert write(node, offs[0], toks[0], b"x" * 100)
    assert node.put_commit("a", rid, [checksum(b"y" * 100)]) == [pb.CHECKSUM]
    assert node.exists("a", [k2])[0] == 0
    assert put(node, [k2], [b"x" * 100], tenant="a") == [pb.OK]


def test_commit_waits_for_a_write_that_is_finishing(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=1 << 20, commit_grace_seconds=5.0)
    k = b"w" * 32
    _, offs, toks, rid = node.put_start(T, [k], [100], DEFAULT_TRAFFIC_CLASS, pb.BLOCK)
    e = node.acquire("write", offs[0], 100, toks[0])
    assert e is not None

    def finish() -> None:
        time.sleep(0.05)
        node.dram.view[offs[0]:offs[0] + 100] = b"z" * 100
        node.release_guard(e)

    threading.Thread(target=finish).start()
    assert node.put_commit(T, rid, [checksum(b"z" * 100)]) == [pb.OK]
    assert get(node, [k]) == [b"z" * 100]
    # A write that never finishes within the grace is refused, and its space comes back.
    node.cfg.commit_grace_seconds = 0.05
    k2 = b"v" * 32
    _, offs, toks, rid = node.put_start(T, [k2], [100], DEFAULT_TRAFFIC_CLASS, pb.BLOCK)
    e2 = node.acquire("write", offs[0], 100, toks[0])
    assert e2 is not None
    assert node.put_commit(T, rid, [0]) == [pb.LEASE_EXPIRED]
    node.release_guard(e2)
    assert node.exists(T, [k2])[0] == 0
    assert node.dram.alloc.used == node.dram.alloc.rounded(100)


def test_reservation_ids_never_issued_are_invalid(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=1 << 20)
    for rid in (0, 1, 10**9):
        with pytest.raises(errors.InvalidArgument):
            node.put_commit(T, rid, [0])
    _, _, _, rid = node.put_start(T, [b"a" * 32, b"b" * 32], [10, 10], DEFAULT_TRAFFIC_CLASS, pb.BLOCK)
    with pytest.raises(errors.InvalidArgument):
        node.put_commit(T, rid, [0])
    # A revoked reservation was issued: its commit is too late, not invalid.
    node.put_revoke(T, rid)
    assert node.put_commit(T, rid, [0, 0]) == [pb.LEASE_EXPIRED, pb.LEASE_EXPIRED]


def test_fragmented_arena_evicts_until_an_extent_fits(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=1 << 20, high_watermark=0.999, low_watermark=0.99)
    # Alternate small and medium objects, then remove every medium one: lots of free bytes, but
    # no free extent as large as 256 KiB.
    small = [bytes([1, i]) * 16 for i in range(100)]
    medium = [bytes([2, i]) * 16 for i in range(100)]
    placed_m = []
    for i in range(100):
        if put(node, [small[i]], [b"s" * 4096]) != [pb.OK]:
            break
        if put(node, [medium[i]], [b"m" * 8192]) != [pb.OK]:
            break
        placed_m.append(medium[i])
    node.remove(T, placed_m)
    assert node.dram.alloc.free_bytes >= 256 * KiB > node.dram.alloc.largest_free
    assert put(node, [b"L" * 32], [b"L" * (256 * KiB)]) == [pb.OK]
    assert get(node, [b"L" * 32]) == [b"L" * (256 * KiB)]
    node.dram.alloc.check()


def test_quota_larger_than_the_object_evicts_nothing(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=1 << 20)
    node.set_tenants([Tenant("q", "tok-q", quota_bytes=64 * KiB, evict_own_on_quota=True)])
    keys = [bytes([i]) * 32 for i in range(4)]
    assert put(node, keys, [b"x" * (16 * KiB)] * 4, tenant="q") == [pb.OK] * 4
    assert put(node, [b"big" + b"\0" * 29], [b"y" * (65 * KiB)], tenant="q") == [pb.QUOTA_EXCEEDED]
    assert node.exists("q", keys)[0] == 4


def test_promotion_in_a_batch_never_evicts_an_earlier_item(make_node, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=256 * KiB, ssd_path=str(tmp_path / "ssd"), ssd_bytes=4 << 20)
    keys = [bytes([i]) * 32 for i in range(16)]
    vals = [bytes([i]) * (60 * KiB) for i in range(16)]
    for k, v in zip(keys, vals, strict=True):
        assert put(node, [k], [v]) == [pb.OK]
    assert node.counters[StoreCounter.DEMOTED] > 0
    # Batches of 3 x 60 KiB fit in DRAM together; each promotion evicts others (never these).
    for i in range(0, 15, 3):
        assert get(node, keys[i:i + 3]) == vals[i:i + 3]


def test_random_operations_keep_the_books_balanced(make_node, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=512 * KiB, ssd_path=str(tmp_path / "ssd2"), ssd_bytes=1 << 20,
                     sharedfs_path=str(tmp_path / "fs"))
    node.set_tenants([Tenant("a", "tok-a", b"sa", 200 * KiB), Tenant("b", "tok-b", b"sb", 300 * KiB, {}, True)])
    rng = random.Random(7)
    keys = [bytes([i]) * 32 for i in range(20)]
    tenants = [T, "a", "b"]
    leases: list[int] = []
    for _ in range(1500):
        t = rng.choice(tenants)
        kind = rng.choice([pb.BLOCK, pb.BLOCK, pb.STATE])
        ks = rng.sample(keys, rng.randint(1, 5))
        op = rng.random()
        if op < 0.35:
            vals = [bytes([hash((t, k, kind)) & 0xFF]) * rng.randint(1, 90 * KiB) for k in ks]
            put(node, ks, vals, tenant=t, kind=kind)
        elif op < 0.45:
            _, _, _, rid = node.put_start(t, ks, [rng.randint(1, 50 * KiB) for _ in ks], "agent", kind,
                                          timeout_ms=rng.randint(1, 20))
            if rid and rng.random() < 0.5:
                node.put_revoke(t, rid)
        elif op < 0.7:
            for k, g in zip(ks, get(node, ks, tenant=t, kind=kind), strict=True):
                assert g is None or set(g) == {hash((t, k, kind)) & 0xFF}
        elif op < 0.8:
            _, _, lease = node.exists(t, ks, kind=kind, pin=True, lease_ms=rng.randint(1, 30))
            if lease is not None:
                leases.append(lease.lease_id)
        elif op < 0.9:
            node.remove(t, ks, kind)
        else:
            node.release(leases[-3:], t)
        for part in (node.dram.alloc, node.tier("ssd").alloc):
            assert 0 <= part.used <= part.capacity
        assert all(x.used_bytes >= 0 and x.objects >= 0 for x in node.tenants.values())
    assert node.counters[StoreCounter.DEMOTED], node.counters
    assert node.counters[StoreCounter.PROMOTED] and node.counters[StoreCounter.EVICTED_QUOTA], node.counters
    time.sleep(0.05)  # every reservation and lease above has expired
    for t in tenants:
        for kind in (pb.BLOCK, pb.STATE):
            node.remove(t, keys, kind)
    node.dram.alloc.check()
    node.tier("ssd").alloc.check()
    assert node.dram.alloc.used == 0 and node.tier("ssd").alloc.used == 0
    assert all(x.used_bytes == 0 and x.objects == 0 for x in node.tenants.values()), node.tenants
    assert node.live_tokens() == 0 and [t[3] for t in node.stats()["tiers"]] == [0, 0]
    for t in tenants:
        assert node.exists(t, keys, prefix_only=False)[1] == bytes(len(keys))
    # Shared-fs files are unlinked off the index lock, in the chain's order (tiers/chain.py):
    # wait (bounded) until the removals queued above have run.
    deadline = time.monotonic() + 30
    while not node.settled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [p for p in (tmp_path / "fs").rglob("*") if p.is_file()] == []


def test_state_objects_never_leave_dram(make_node, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=256 * KiB, ssd_path=str(tmp_path / "ssd3"), ssd_bytes=4 << 20,
                     sharedfs_path=str(tmp_path / "fs3"))
    states = [bytes([0xA0, i]) * 16 for i in range(3)]
    assert put(node, states, [b"S" * (40 * KiB)] * 3, kind=pb.STATE) == [pb.OK] * 3
    for i in range(20):  # push 5x the arena of blocks through
        assert put(node, [bytes([0xB0, i]) * 16], [b"B" * (60 * KiB)]) == [pb.OK]
    assert node.counters[StoreCounter.DEMOTED] > 0
    assert {node.where(T, k, pb.STATE) for k in states} <= {None, "dram"}
    # Evicted states are gone (a miss), never served from a lower tier.
    for g in get(node, states, kind=pb.STATE):
        assert g is None or g == b"S" * (40 * KiB)


def test_a_writer_cannot_hold_a_reservation_for_days(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=1 << 20)
    t0 = time.time()
    _, offs, toks, rid = node.put_start(T, [b"r" * 32], [10], DEFAULT_TRAFFIC_CLASS, pb.BLOCK, timeout_ms=2**32 - 1)
    e = node.acquire("write", offs[0], 10, toks[0])
    assert e is not None and e.expires <= t0 + node.cfg.reservation_seconds_max + 1
    node.release_guard(e)


def test_a_huge_batch_against_a_pinned_arena_is_refused_quickly(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=1 << 20)
    keys = [i.to_bytes(32, "little") for i in range(200)]
    assert put(node, keys, [b"p" * 4096] * 200) == [pb.OK] * 200
    _, _, lease = node.exists(T, keys, pin=True, lease_ms=60_000)
    assert lease is not None
    calls = 0
    orig = node._space.evict_dram

    def counting(*a: object, **kw: object) -> int:
        nonlocal calls
        calls += 1
        return orig(*a, **kw)  # type: ignore[arg-type]

    node._space.evict_dram = counting  # type: ignore[method-assign]
    more = [(10**6 + i).to_bytes(32, "little") for i in range(20_000)]
    codes, _, _, _ = node.put_start(T, more, [4096] * len(more), DEFAULT_TRAFFIC_CLASS, pb.BLOCK)
    assert pb.NO_SPACE in codes and set(codes) <= {pb.OK, pb.NO_SPACE}
    assert calls <= 3  # not one eviction pass per refused item


def test_reads_count_in_the_hit_rate_once_per_block(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=1 << 20)
    rng = random.Random(7)
    keys = [rng.randbytes(32) for _ in range(4)]
    assert put(node, keys[:3], [b"v" * 100] * 3) == [pb.OK] * 3

    def rate() -> tuple[int, int]:
        return node.counters[StoreCounter.HIT_BLOCKS], node.counters[StoreCounter.LOOKUP_BLOCKS]

    # A read (read_pin, as the data session's GET) is a lookup itself.
    assert get(node, keys) == [b"v" * 100] * 3 + [None]
    assert rate() == (3, 4)
    codes, found = node.read_pin(T, keys[1:])
    node.read_unpin(found)
    assert codes == [pb.OK, pb.OK, pb.NOT_FOUND] and rate() == (5, 7)
    # A match, then the read of its lease: the match counted the blocks, the read does not again.
    prefix, _, lease = node.exists(T, keys, pin=True, lease_ms=10_000)
    assert prefix == 3 and lease is not None and rate() == (8, 11)
    codes, found = node.read_pin(T, keys[:3], drop_lease_id=lease.lease_id)
    node.read_unpin(found)
    assert codes == [pb.OK] * 3 and rate() == (8, 11)


def test_a_match_lease_pins_whatever_decides_on_pins_even_though_it_counts_them_lazily(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=256 * KiB)
    keys = [bytes([0xC0, i]) * 16 for i in range(4)]
    assert put(node, keys, [b"m" * (40 * KiB)] * 4) == [pb.OK] * 4
    _, _, lease = node.exists(T, keys, pin=True, lease_ms=60_000)
    assert lease is not None
    assert node.remove(T, keys[:1]) == [pb.IN_FLIGHT]  # removal settles the pins first
    _, _, second = node.exists(T, keys, pin=True, lease_ms=60_000)
    assert second is not None
    for i in range(20):  # write pressure: 3x the arena; the pinned objects stay
        put(node, [bytes([0xD0, i]) * 16], [b"w" * (40 * KiB)])
    assert get(node, keys) == [b"m" * (40 * KiB)] * 4
    assert {e.pins for e in node.entries(T, keys) if e is not None} == {2}
    node.release([lease.lease_id, second.lease_id], T)
    assert {e.pins for e in node.entries(T, keys) if e is not None} == {0}
    # A lease released before anything settled leaves no pin behind.
    _, _, third = node.exists(T, keys, pin=True, lease_ms=60_000)
    assert third is not None
    node.release([third.lease_id], T)
    assert node.remove(T, keys) == [pb.OK] * 4


def _codes(node: StoreNode, keys: list[bytes], epoch: int, kind: int = pb.BLOCK) -> list[int]:
    """The PUT_START codes of a write routed by ring ``epoch`` (the reservation revoked after)."""
    codes, _, _, rid = node.put_start(T, keys, [100] * len(keys), DEFAULT_TRAFFIC_CLASS, kind, epoch=epoch)
    if rid:
        node.put_revoke(T, rid)
    return list(codes)


def test_a_write_routed_by_a_stale_epoch_is_refused_for_what_the_node_does_not_own(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(dram_bytes=1 << 20)  # node id "n0"
    rng = random.Random(5)
    keys = [rng.randbytes(32) for _ in range(64)]
    # Written while n0 was the only member (epoch 1): a committed copy here of every key.
    node.set_ring(Ring(epoch=1, members=(Member("n0", "a"),)))
    assert put(node, keys[:8], [b"x"] * 8) == [pb.OK] * 8
    # Epoch 2: n9 joined, with replication 2 (each block at both members, a state object at
    # its primary only).
    ring = node.set_ring(Ring(epoch=2, members=(Member("n0", "a"), Member("n9", "b")), replicas=2))
    primary = [ring.active[i].id == "n0" for i in ring.owners_of(keys).tolist()]
    assert 10 < sum(primary) < 54
    assert _codes(node, keys[8:], 1) == [pb.OK] * 56  # both members own every block
    assert _codes(node, keys, 1, pb.STATE) == [pb.OK if p else pb.WRONG_OWNER for p in primary]
    refused = 64 - sum(primary)
    # Replication 1: the blocks n9 owns are refused, those already here too (not ALREADY_EXISTS:
    # a stale writer would count them written where no reader routing by epoch 3 looks).
    node.set_ring(Ring(epoch=3, members=(Member("n0", "a"), Member("n9", "b"))))
    want = [(pb.ALREADY_EXISTS if i < 8 else pb.OK) if p else pb.WRONG_OWNER for i, p in enumerate(primary)]
    assert _codes(node, keys, 2) == want
    assert node.counters[StoreCounter.REFUSED_WRONG_OWNER] == 2 * refused
    # The caller's own epoch, a newer one (this node is behind) or none: taken as before.
    for epoch in (0, 3, 4):
        assert _codes(node, keys[8:], epoch) == [pb.OK] * 56
    # A node draining in the newest ring answers DRAINING to everyone, stale or not.
    node.set_ring(Ring(epoch=4, members=(Member("n0", "a", "draining"), Member("n9", "b"))))
    assert _codes(node, keys, 3) == [pb.DRAINING] * 64
    assert node.counters[StoreCounter.REFUSED_WRONG_OWNER] == 2 * refused
