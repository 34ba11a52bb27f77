"""Byte-exact round trips through two sidecars sharing a pool, zero-copy local hits, and the
client's read/write paths (views, caller buffers, every buffer type)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from kvpool.core import errors
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
SIZES = [1, 2, 4095, 4096, 4097, 64 * KiB, 128 * KiB + 3, 1 * MiB, 1 * MiB + 1, 4 * MiB]


def _settled(h: Any, client: Any) -> None:
    """Write-through is asynchronous: wait until the sidecar's backlog to the pool is empty."""
    h.wait_for(lambda: client.stats().pending_pool_bytes == 0, what="write-through backlog to drain")


@pytest.mark.parametrize("size", SIZES)
def test_single_object_across_sidecars(shared: Any, h: Any, rng: random.Random, size: int) -> None:
    with shared.connect(0) as a, shared.connect(1) as b:
        [key] = h.keys(rng, 1)
        [value] = h.values(rng, [size])
        assert a.put([key], [value]) == [pb.OK]
        _settled(h, a)
        assert b.match([key]) == 1
        with b.get([key]) as got:
            assert len(got) == 1 and len(got[0]) == size and bytes(got[0]) == value
        # And back on the writer, from its own local tier.
        with a.get([key]) as got:
            assert bytes(got[0]) == value


@pytest.mark.parametrize("size,count", [(1, 200), (4 * KiB, 128), (128 * KiB, 32), (1 * MiB, 16), (4 * MiB, 4)])
def test_batches_across_sidecars(shared: Any, h: Any, rng: random.Random, size: int, count: int) -> None:
    with shared.connect(0) as a, shared.connect(1) as b:
        keys = h.keys(rng, count)
        values = h.values(rng, [size] * count)
        assert a.put(keys, values) == [pb.OK] * count
        _settled(h, a)
        before = h.counters(b)
        assert b.match(keys) == count
        with b.get(keys) as got:
            assert [bytes(v) for v in got] == values
        after = h.counters(b)
        assert after[SidecarCounter.READ_HITS_POOL] - before.get(SidecarCounter.READ_HITS_POOL, 0) == count
        # Both store nodes took part (the keys are spread over the ring).
        owners = {shared.store_ids.index(n) for n in _owner_ids(shared, keys)}
        assert owners == {0, 1} or count < 8


def _owner_ids(lc: Any, keys: list[bytes]) -> list[str]:
    from kvpool.core.ring import owners
    return [lc.store_ids[i] for i in owners(b"".join(keys), lc.store_ids)[:, 0].tolist()]


def test_mixed_sizes_in_one_batch_and_prefix_match(shared: Any, h: Any, rng: random.Random) -> None:
    sizes = [rng.choice(SIZES) for _ in range(24)]
    with shared.connect(0) as a, shared.connect(1) as b:
        keys = h.keys(rng, len(sizes))
        values = h.values(rng, sizes)
        assert a.put(keys, values) == [pb.OK] * len(keys)
        _settled(h, a)
        # The match is a prefix: an unknown key in the middle stops it there.
        holey = keys[:10] + h.keys(rng, 1) + keys[10:]
        assert b.match(holey) == 10
        assert b.match(keys) == len(keys)
        with b.get(keys) as got:
            assert [bytes(v) for v in got] == values


def test_buffer_types_and_get_into(shared: Any, h: Any, rng: random.Random) -> None:
    raw = [rng.randbytes(n) for n in (3, 5000, 70000, 1 << 20)]
    arr2d = np.frombuffer(rng.randbytes(4096 * 4), dtype=np.float32).reshape(64, 64)
    values: list[Any] = [raw[0], bytearray(raw[1]), memoryview(raw[2]), np.frombuffer(raw[3], dtype=np.uint8),
                         arr2d]
    expect = raw + [arr2d.tobytes()]
    with shared.connect(0) as a, shared.connect(1) as b:
        keys = h.keys(rng, len(values))
        assert a.put(keys, values) == [pb.OK] * len(keys)
        _settled(h, a)
        bufs = [bytearray(len(e) + 7) for e in expect]  # larger than needed is fine
        assert b.get_into(keys, bufs) == [len(e) for e in expect]
        assert [bytes(bf[:len(e)]) for bf, e in zip(bufs, expect, strict=True)] == expect
        # A numpy destination, and a miss reported as -1 rather than raised.
        out = np.zeros(len(expect[4]), dtype=np.uint8)
        assert b.get_into([keys[4], h.keys(rng, 1)[0]], [out, bytearray(8)]) == [len(expect[4]), -1]
        assert out.tobytes() == expect[4]
        with pytest.raises(errors.InvalidArgument):
            b.get_into([keys[3]], [bytearray(10)])  # too small a buffer: a clear error


def test_repeated_get_is_zero_copy_local_hit(shared: Any, h: Any, rng: random.Random) -> None:
    with shared.connect(0) as a, shared.connect(1) as b:
        keys = h.keys(rng, 8)
        values = h.values(rng, [256 * KiB] * 8)
        assert a.put(keys, values) == [pb.OK] * 8
        _settled(h, a)
        with b.get(keys) as first:  # from the pool, promoted into b's arena
            assert [bytes(v) for v in first] == values
        before = h.counters(b)
        with b.get(keys) as again, b.get(keys) as third:
            # Views into the shared arena: no copy, read-only, the same memory twice.
            for v, w, want in zip(again, third, values, strict=True):
                assert isinstance(v, memoryview) and v.readonly
                assert v.obj is w.obj and v.obj is b._arena_ro.obj
                assert bytes(v) == want
                assert np.shares_memory(np.asarray(v), np.asarray(w))
        after = h.counters(b)
        assert after[SidecarCounter.READ_HITS_LOCAL] - before.get(SidecarCounter.READ_HITS_LOCAL, 0) == 16
        assert after.get(SidecarCounter.READ_HITS_POOL, 0) == before.get(SidecarCounter.READ_HITS_POOL, 0)
        assert b.match(keys) == 8
        st = b.stats()
        assert st.counters[SidecarCounter.HIT_BLOCKS_LOCAL] >= 8


def test_missing_key_raises_typed_error(shared: Any, h: Any, rng: random.Random) -> None:
    with shared.connect(0) as a:
        keys = h.keys(rng, 3)
        assert a.put(keys[:2], h.values(rng, [10, 10])) == [pb.OK, pb.OK]
        assert a.match(keys) == 2
        with pytest.raises(errors.NotFound) as ei:
            a.get(keys)
        assert "index 2" in str(ei.value)
        assert isinstance(ei.value, KeyError)  # engines may catch it as a KeyError


def test_put_is_idempotent_and_never_changes_an_object(shared: Any, h: Any, rng: random.Random) -> None:
    from kvpool.pool.node_client import StoreClient

    with shared.connect(0) as a, shared.connect(1) as b:
        [key] = h.keys(rng, 1)
        first, second = h.values(rng, [1000, 1000])
        assert a.put([key], [first]) == [pb.OK]
        _settled(h, a)
        assert a.put([key], [second]) == [pb.ALREADY_EXISTS]
        with a.get([key]) as got:
            assert bytes(got[0]) == first
        # Another sidecar writing the same key: its pool write finds the object there already.
        assert b.put([key], [second]) == [pb.OK]
        _settled(h, b)
        # The pool kept the first object (a committed object never changes).
        with StoreClient(shared.stores[_store_index(shared, key)]) as c:
            [pooled] = c.get([key])
            assert pooled is not None and bytes(pooled) == first


def _store_index(lc: Any, key: bytes) -> int:
    return int(lc.store_ids.index(_owner_ids(lc, [key])[0]))


def test_many_client_threads_share_one_sidecar(shared: Any, h: Any, rng: random.Random) -> None:
    import concurrent.futures as cf

    with shared.connect(0) as a, shared.connect(1) as b:
        batches = [(h.keys(rng, 8), h.values(rng, [rng.randrange(1, 300 * KiB) for _ in range(8)]))
                   for _ in range(24)]

        def write(batch: tuple[list[bytes], list[bytes]]) -> list[int]:
            return list(a.put(*batch))

        with cf.ThreadPoolExecutor(6) as ex:
            assert all(codes == [pb.OK] * 8 for codes in ex.map(write, batches))
        _settled(h, a)

        def read(batch: tuple[list[bytes], list[bytes]]) -> bool:
            keys, values = batch
            with b.get(keys) as got:
                return [bytes(v) for v in got] == values

        # The same keys from several threads at once: each lands once, every reader gets it.
        with cf.ThreadPoolExecutor(6) as ex:
            assert all(ex.map(read, batches + batches + batches))
