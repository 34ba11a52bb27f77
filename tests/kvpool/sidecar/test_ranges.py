"""Sparse reads through two sidecars of one pool (real LocalCluster processes): byte-exact ranges
of remote and local objects, only the ranges on the wire (the store nodes' ``range_bytes_sent``),
the object never pulled into the reader's local tier, scratch space freed with the lease, and
per-key INVALID / NOT_FOUND in batches."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from kvpool.core import errors
from kvpool.wire.counters import SidecarCounter, StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


def _settled(h: Any, client: Any) -> None:
    h.wait_for(lambda: client.stats().pending_pool_bytes == 0, what="write-through backlog to drain")


def _sent(lc: Any) -> int:
    """Range bytes every store node has sent so far."""
    total = 0
    for addr in lc.stores:
        with lc.admin(addr) as c:
            total += int(c.stats().counters[StoreCounter.RANGE_BYTES_SENT])
    return total


def _expected(value: bytes, pairs: Any) -> bytes:
    return b"".join(value[o:o + n] for o, n in pairs)


def _topk(rng: random.Random, size: int, fraction: float, chunk: int = 16 * KiB) -> list[tuple[int, int]]:
    slots = size // chunk
    return [(s * chunk, chunk) for s in sorted(rng.sample(range(slots), max(1, round(slots * fraction))))]


@pytest.fixture(scope="module")
def reader(shared: Any) -> int:
    """A sidecar of its own for the reads whose local tier is watched (nothing else uses it)."""
    return int(shared.sidecars.index(shared.add_sidecar(local_bytes=32 * MiB)))


def test_remote_ranges_move_only_the_ranges(shared: Any, reader: int, h: Any, rng: random.Random) -> None:
    with shared.connect(0) as a, shared.connect(reader) as b:
        [key] = h.keys(rng, 1)
        [value] = h.values(rng, [4 * MiB])
        assert a.put([key], [value]) == [pb.OK]
        _settled(h, a)
        before_b = b.stats()
        for fraction in (0.01, 0.1, 1.0):
            pairs = _topk(rng, len(value), fraction)
            sent0 = _sent(shared)
            with b.get_ranges(key, pairs) as views:
                assert [len(v) for v in views] == [n for _, n in pairs]
                assert b"".join(bytes(v) for v in views) == _expected(value, pairs)
            assert _sent(shared) - sent0 == sum(n for _, n in pairs)
        after_b = b.stats()
        # Served from the owner, never brought into b's local tier, its scratch freed with the lease.
        assert after_b.local_objects == before_b.local_objects == 0
        assert after_b.local_used_bytes == before_b.local_used_bytes == 0
        assert after_b.counters[SidecarCounter.RANGE_HITS_POOL] - before_b.counters[SidecarCounter.RANGE_HITS_POOL] == 3
        assert after_b.counters[SidecarCounter.READ_HITS_POOL] == before_b.counters[SidecarCounter.READ_HITS_POOL]
        assert b.match([key]) == 1
        assert b.stats().counters[SidecarCounter.HIT_BLOCKS_LOCAL] == after_b.counters[SidecarCounter.HIT_BLOCKS_LOCAL]


def test_local_ranges_come_from_the_local_tier(shared: Any, h: Any, rng: random.Random) -> None:
    with shared.connect(0) as a:
        [key] = h.keys(rng, 1)
        [value] = h.values(rng, [1 * MiB + 7])
        assert a.put([key], [value]) == [pb.OK]
        _settled(h, a)
        before = a.stats().counters
        sent0 = _sent(shared)
        pairs = [(len(value) - 7, 7), (3, 4000), (3, 1)]
        with a.get_ranges(key, pairs) as views:
            assert b"".join(bytes(v) for v in views) == _expected(value, pairs)
        assert _sent(shared) == sent0  # nothing asked of the pool
        after = a.stats().counters
        assert after[SidecarCounter.RANGE_HITS_LOCAL] - before[SidecarCounter.RANGE_HITS_LOCAL] == 1
        assert after[SidecarCounter.RANGE_BYTES_LOCAL] - before[SidecarCounter.RANGE_BYTES_LOCAL] == 4008


def test_batches_mix_local_remote_missing_and_invalid(shared: Any, h: Any, rng: random.Random) -> None:
    with shared.connect(0) as a, shared.connect(1) as b:
        keys = h.keys(rng, 6)
        values = h.values(rng, [100_000] * 6)
        assert a.put(keys[:3], values[:3]) == [pb.OK] * 3
        assert b.put(keys[3:], values[3:]) == [pb.OK] * 3
        _settled(h, a)
        _settled(h, b)
        missing = h.keys(rng, 1)[0]
        ask = [keys[0], keys[3], missing, keys[1], keys[4], keys[2], keys[5], keys[0]]
        per_key = [[(0, 10)], [(99_990, 10), (5, 5)], [(0, 1)], [(99_999, 2)], [(100_000, 1)], [(5, 0)],
                   [(-1, 3)], [(1, 99_999)]]
        sent0 = _sent(shared)
        with b.get_ranges_many(ask, per_key) as got:
            # keys[0..2] are remote for b (the nodes check the bounds), keys[3..5] local (b checks).
            assert got.codes == [pb.OK, pb.OK, pb.NOT_FOUND, pb.INVALID, pb.INVALID, pb.INVALID, pb.INVALID, pb.OK]
            assert got.sizes[3] == 100_000 and got.sizes[4] == 100_000 and got.sizes[2] == 0
            vals = dict(zip(keys, values, strict=True))
            for i in (0, 1, 7):
                views = got.views[i]
                assert views is not None
                assert b"".join(bytes(v) for v in views) == _expected(vals[ask[i]], per_key[i])
            assert got.views[2] is None and got.views[3] is None
        assert _sent(shared) - sent0 == 10 + 99_999  # the remote OK ones only
        # Into caller buffers: back to back; too small a buffer is INVALID and not asked.
        first, second = bytearray(15), np.zeros(10, np.uint8)
        codes = b.get_ranges_into([keys[0], keys[3], keys[1]], [[(10, 5), (0, 10)], [(50, 10)], [(0, 4)]],
                                  [first, second, bytearray(3)])
        assert codes == [pb.OK, pb.OK, pb.INVALID]
        assert bytes(first) == values[0][10:15] + values[0][:10] and second.tobytes() == values[3][50:60]
        with pytest.raises(errors.NotFound):
            b.get_ranges(missing, [(0, 1)])
        with pytest.raises(errors.InvalidArgument, match="100000-byte object"):
            b.get_ranges(keys[0], [(99_999, 2)])
        with pytest.raises(errors.InvalidArgument, match="negative"):
            b.get_ranges(keys[0], [(0, -2)])
        with pytest.raises(errors.InvalidArgument, match="zero-length"):
            b.get_ranges(keys[3], [(0, 0)])


def test_a_released_range_read_frees_its_scratch(shared: Any, reader: int, h: Any, rng: random.Random) -> None:
    with shared.connect(0) as a, shared.connect(reader) as b:
        [key] = h.keys(rng, 1)
        [value] = h.values(rng, [2 * MiB])
        assert a.put([key], [value]) == [pb.OK]
        _settled(h, a)
        used0 = b.stats().local_used_bytes
        got = b.get_ranges(key, [(0, 1 * MiB)])
        assert used0 == 0 and b.stats().local_used_bytes >= 1 * MiB  # the scratch, held by the lease
        assert bytes(got[0]) == value[:1 * MiB]
        got.release()
        assert b.stats().local_used_bytes == used0


def test_copies_release_their_lease_in_the_next_call(shared: Any, reader: int, h: Any, rng: random.Random) -> None:
    """``get_ranges_into`` pays one round trip: its lease (holding pool ranges' scratch) is
    dropped by the next ranged read, or when the client closes."""
    with shared.connect(0) as a:
        [key] = h.keys(rng, 1)
        [value] = h.values(rng, [2 * MiB])
        assert a.put([key], [value]) == [pb.OK]
        _settled(h, a)
    c = shared.connect(reader)
    try:
        buf = bytearray(1 * MiB)
        assert c.stats().local_used_bytes == 0
        assert c.get_ranges_into([key], [[(1 * MiB, 1 * MiB)]], [buf]) == [pb.OK] and bytes(buf) == value[1 * MiB:]
        assert c.stats().local_used_bytes >= 1 * MiB  # held until the next call
        assert c.get_ranges_into([key], [[(0, 4 * KiB)]], [buf]) == [pb.OK] and bytes(buf[:4 * KiB]) == value[:4 * KiB]
        assert 0 < c.stats().local_used_bytes < 1 * MiB  # the first one gone, the second held
    finally:
        c.close()
    with shared.connect(reader) as d:
        assert d.stats().local_used_bytes == 0
