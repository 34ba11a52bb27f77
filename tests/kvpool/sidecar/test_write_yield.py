"""The pool writer holds a write-through batch back while puts are being served (they compete
for the same cores; the put is what the engine waits for), at most ``--pool-write-yield-ms``,
and everything still reaches the pool.  Pure rule first, then real store and sidecar processes."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvpool.apps.cluster import LocalCluster
from kvpool.sidecar.writer import QUIET_SECONDS, hold_back
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
CLUSTER = dict(stores=1, sidecars=1, store_bytes=128 * MiB, local_bytes=64 * MiB)


def test_no_put_seen_lately_goes_at_once() -> None:
    assert hold_back(now=10.0, put_seen_at=10.0 - QUIET_SECONDS, deadline=11.0) == 0.0
    assert hold_back(now=10.0, put_seen_at=float("-inf"), deadline=11.0) == 0.0


def test_a_put_just_seen_waits_until_the_puts_pause() -> None:
    assert hold_back(now=10.0, put_seen_at=10.0, deadline=11.0) == pytest.approx(QUIET_SECONDS)
    assert hold_back(now=10.0, put_seen_at=9.999, deadline=11.0) == pytest.approx(QUIET_SECONDS - 0.001)


def test_never_past_the_deadline() -> None:
    assert hold_back(now=10.0, put_seen_at=10.0, deadline=10.001) == pytest.approx(0.001)
    assert hold_back(now=10.0, put_seen_at=10.0, deadline=9.0) == 0.0


def _put_back_to_back(h: Any, c: Any, rng: random.Random, batches: int) -> list[bytes]:
    keys: list[bytes] = []
    value = rng.randbytes(256 * KiB)
    for _ in range(batches):
        ks = h.keys(rng, 8)
        assert c.put(ks, [value] * len(ks)) == [pb.OK] * len(ks)
        keys += ks
    return keys


def _all_pooled(h: Any, c: Any, writes_before: int, n: int) -> None:
    h.wait_for(lambda: c.stats().pending_pool_bytes == 0
               and h.counters(c).get(SidecarCounter.POOL_WRITES, 0) >= writes_before + n,
               timeout=30, what="every put written through to the pool")
    assert h.counters(c).get(SidecarCounter.LOCAL_ONLY_OBJECTS, 0) == 0


def test_puts_back_to_back_hold_the_write_through_back_and_all_of_it_reaches_the_pool(
        module_cluster: LocalCluster, h: Any, rng: random.Random) -> None:
    with module_cluster.connect(0) as c:
        held, writes = (h.counters(c).get(n, 0) for n in (SidecarCounter.POOL_WRITES_HELD_BACK,
                                                            SidecarCounter.POOL_WRITES))
        keys = _put_back_to_back(h, c, rng, 12)
        _all_pooled(h, c, writes, len(keys))
        assert h.counters(c).get(SidecarCounter.POOL_WRITES_HELD_BACK, 0) > held


def test_a_sidecar_told_not_to_yield_never_holds_back(module_cluster: LocalCluster, h: Any,
                                                      rng: random.Random) -> None:
    address = module_cluster.add_sidecar(extra_args=["--pool-write-yield-ms", "0"])
    with module_cluster.connect(len(module_cluster.sidecars) - 1) as c:
        assert module_cluster.sidecars[-1] == address
        writes = h.counters(c).get(SidecarCounter.POOL_WRITES, 0)
        keys = _put_back_to_back(h, c, rng, 12)
        _all_pooled(h, c, writes, len(keys))
        assert h.counters(c).get(SidecarCounter.POOL_WRITES_HELD_BACK, 0) == 0
