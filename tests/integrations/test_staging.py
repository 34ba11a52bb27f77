"""The integrations' shared data path (:mod:`kvpool.integrations.staging`, no engine, no torch) on real
sidecar and store processes: which path each object takes, shown by its counters, and the bytes exact."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvpool
from kvpool import LocalCluster
from kvpool.integrations.common import IntegrationConfigError
from kvpool.integrations.staging import FastPath, PathStat, StagingPool, path_stats, staging_settings
from kvpool.wire.proto import store_pb2 as pb

MiB = 1 << 20
OBJ = 64 << 10


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(stores=1, sidecars=2, store_bytes=96 * MiB, local_bytes=16 * MiB) as lc:
        yield lc


def written(lc: LocalCluster, seed: int, n: int) -> tuple[list[bytes], list[bytes]]:
    """``n`` objects put through sidecar 0 and present in the pool."""
    rnd = random.Random(seed)
    keys, values = [rnd.randbytes(32) for _ in range(n)], [rnd.randbytes(OBJ - rnd.randrange(64)) for _ in range(n)]
    with kvpool.connect(lc.sidecars[0]) as a:
        assert a.put(keys, values) == [pb.OK] * n
    with kvpool.connect(lc.sidecars[1]) as b:
        deadline = time.monotonic() + 30
        while b.match(keys) != n:
            assert time.monotonic() < deadline, "the writes did not reach the pool"
            time.sleep(0.05)
    return keys, values


def test_remote_objects_land_in_staging_and_local_hits_are_arena_views(cluster: LocalCluster) -> None:
    keys, values = written(cluster, 1, 6)
    with kvpool.connect(cluster.sidecars[1]) as b:
        with b.get(keys[:2]):
            pass  # the first two are local in B now; the other four only in the pool
        st = path_stats()
        fp = FastPath(b, OBJ, 8 * OBJ, 0.05, st)
        before = b.stats().local_objects
        with fp.read(keys) as land:
            assert land.prefix == 6 and [bytes(v) for v in land.views if v is not None] == values
            assert [v.readonly for v in land.views if v is not None] == [True] * 2 + [False] * 4
            assert fp.pool.free == 4
        assert (st[PathStat.LOCAL_VIEWS], st[PathStat.REGISTERED_LANDINGS], st[PathStat.ARENA_LANDINGS]) == (2, 4, 0)
        assert b.stats().local_objects == before  # nothing landed in the arena
        assert fp.pool.free == 8
        fp.close()


def test_a_miss_ends_the_prefix_and_the_rest_of_its_batch_keeps_its_views(cluster: LocalCluster) -> None:
    keys, values = written(cluster, 2, 3)
    with kvpool.connect(cluster.sidecars[1]) as b:
        st = path_stats()
        fp = FastPath(b, OBJ, 8 * OBJ, 0.05, st)
        with fp.read(keys[:1] + [b"\x01" * 32] + keys[2:]) as land:
            assert land.prefix == 1 and bytes(land.views[0] or b"") == values[0]
            # Per-key views, as get_many's: a load of keys in no order (vLLM's tier) takes them.
            assert land.views[1] is None and bytes(land.views[2] or b"") == values[2]
            assert land.error is None and st[PathStat.REGISTERED_LANDINGS] == 2
        fp.close()


def test_busy_staging_is_waited_for_then_the_rest_goes_through_the_arena(cluster: LocalCluster) -> None:
    keys, values = written(cluster, 3, 3)
    with kvpool.connect(cluster.sidecars[1]) as b:
        st = path_stats()
        fp = FastPath(b, OBJ, 2 * OBJ, 0.05, st)
        held, _ = fp.pool.acquire(2, 0)  # another reader holds every slot
        t0 = time.monotonic()
        with fp.read(keys[:2]) as land:
            assert [bytes(v) for v in land.views if v is not None] == values[:2]
        assert time.monotonic() - t0 >= 0.05  # it waited its deadline
        assert (st[PathStat.STAGING_WAITS], st[PathStat.ARENA_LANDINGS], st[PathStat.REGISTERED_LANDINGS]) == (1, 2, 0)
        fp.pool.release(held)
        fp.close()
        # More than the whole staging holds: waiting could not cover it, so the read does not wait.
        more, more_values = written(cluster, 6, 2)
        st = path_stats()
        fp = FastPath(b, OBJ, OBJ, 0.05, st)
        held, _ = fp.pool.acquire(1, 0)
        with fp.read(more) as land:
            assert [bytes(v) for v in land.views if v is not None] == more_values
        assert (st[PathStat.STAGING_WAITS], st[PathStat.ARENA_LANDINGS]) == (0, 2)
        fp.pool.release(held)
        fp.close()


def test_read_each_lands_a_batch_larger_than_staging_in_parts(cluster: LocalCluster) -> None:
    keys, values = written(cluster, 4, 5)
    with kvpool.connect(cluster.sidecars[1]) as b:
        st = path_stats()
        fp = FastPath(b, OBJ, 2 * OBJ, 0.05, st)
        got: list[bytes] = []

        def use(i: int, v: memoryview) -> bool:
            got.append(bytes(v))
            return True

        assert fp.read_each(keys, use) == 5
        assert got == values
        assert (st[PathStat.REGISTERED_LANDINGS], st[PathStat.ARENA_LANDINGS], st[PathStat.STAGING_WAITS]) == (5, 0, 0)
        assert fp.read_each(keys, lambda i, v: i < 2) == 2  # the consumer refused the third
        fp.close()


def test_writes_fill_reserved_extents_and_what_the_tier_cannot_take_is_put_from_staging(
        cluster: LocalCluster) -> None:
    rnd = random.Random(5)
    keys = [rnd.randbytes(32) for _ in range(3)]
    sizes = [OBJ, 20 * MiB, OBJ]  # the second is larger than the whole local tier (16 MiB)
    with kvpool.connect(cluster.sidecars[0]) as a:
        st = path_stats()
        fp = FastPath(a, 20 * MiB, 20 * MiB, 0.05, st)

        def fill(i: int, out: memoryview) -> None:
            np.frombuffer(out, np.uint8)[:] = i + 1

        assert fp.write(keys, sizes, fill) == [pb.OK] * 3
        assert (st[PathStat.ARENA_WRITES], st[PathStat.STAGED_WRITES]) == (2, 1)
        assert fp.pool.free == 1
        assert fp.write(keys[:1], sizes[:1], fill) == [pb.ALREADY_EXISTS]
        fp.close()
    with kvpool.connect(cluster.sidecars[1]) as b:
        for i, (k, n) in enumerate(zip(keys, sizes, strict=True)):
            buf = np.zeros(n, np.uint8)
            deadline = time.monotonic() + 30
            while b.get_into([k], [buf]) != [n]:
                assert time.monotonic() < deadline, "the write did not reach the pool"
                time.sleep(0.05)
            assert bool((buf == i + 1).all())


def test_staging_settings_and_pool_bounds() -> None:
    assert staging_settings({}, "x") == (64 * MiB, 0.05)
    assert staging_settings({"staging_mib": 0.5, "staging_wait_ms": 0}, "x") == (MiB // 2, 0.0)
    for bad in ({"staging_mib": -1}, {"staging_mib": "64"}, {"staging_wait_ms": True}):
        with pytest.raises(IntegrationConfigError, match="must be a number >= 0"):
            staging_settings(bad, "x")


def test_pool_hands_out_at_most_what_is_free_and_waits_only_its_deadline(cluster: LocalCluster) -> None:
    with kvpool.connect(cluster.sidecars[0]) as a:
        pool = StagingPool(a, 4096, 3 * 4096 + 100)
        assert pool.slots == 3 and pool.registered
        got, waited = pool.acquire(5, 0.0)
        assert sorted(got) == [0, 1, 2] and not waited
        t0 = time.monotonic()
        assert pool.acquire(1, 0.05) == ([], True)
        assert time.monotonic() - t0 >= 0.05
        pool.release(got[:1])
        assert pool.acquire(2, 0.05) == (got[:1], False)
        pool.close()
