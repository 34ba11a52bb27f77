"""``Client.reserve``: a put whose copy into the arena is the caller's own write (what the engine
integrations gather their KV into), and ``get_many(local_only=True)`` (the arena's objects, the
rest fetched nowhere), on real sidecar and store processes."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

import kvpool
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

MiB = 1 << 20
CLUSTER = {"stores": 2, "sidecars": 2, "store_bytes": 64 * MiB, "local_bytes": 16 * MiB}


def test_filled_in_place_objects_are_committed_readable_and_reach_the_pool(module_cluster: Any, rng: random.Random,
                                                                           h: Any) -> None:
    keys, values = h.keys(rng, 3), h.values(rng, (1, 4097, MiB + 5))
    with kvpool.connect(module_cluster.sidecars[0]) as a:
        res = a.reserve(keys, [len(v) for v in values])
        assert res.codes == [pb.OK] * 3
        for v, dst in zip(values, res.views, strict=True):
            assert dst is not None and len(dst) == len(v) and not dst.readonly
            np.frombuffer(dst, np.uint8)[:] = np.frombuffer(v, np.uint8)
        assert res.commit() == [pb.OK] * 3
        with pytest.raises(RuntimeError, match="twice"):
            res.commit()
        with a.get(keys) as got:
            assert [bytes(g) for g in got] == values
        # Present already: not reserved again, no view to fill.
        again = a.reserve(keys[:1], [len(values[0])])
        assert again.codes == [pb.ALREADY_EXISTS] and again.views == [None]
        assert again.commit() == [pb.ALREADY_EXISTS]
    with kvpool.connect(module_cluster.sidecars[1]) as b:  # written through to the pool, checksums and all
        h.wait_for(lambda: b.match(keys) == 3, what="the objects to reach the pool")
        with b.get(keys) as got:
            assert [bytes(g) for g in got] == values


def test_an_uncommitted_reservation_shows_nothing_and_one_too_large_is_left_to_put(module_cluster: Any,
                                                                                   rng: random.Random, h: Any) -> None:
    keys = h.keys(rng, 2)
    with kvpool.connect(module_cluster.sidecars[0]) as a:
        res = a.reserve(keys, [100, 32 * MiB])  # the second is larger than the whole local tier
        assert res.codes[0] == pb.OK and res.codes[1] in (pb.TOO_LARGE, pb.NO_SPACE) and res.views[1] is None
        assert a.match(keys[:1]) == 0  # reserved, not committed: invisible


def test_a_local_only_read_gives_the_arena_objects_and_fetches_nothing(module_cluster: Any, rng: random.Random,
                                                                        h: Any) -> None:
    keys, values = h.keys(rng, 3), h.values(rng, (64, 64, 64))
    with kvpool.connect(module_cluster.sidecars[0]) as a:
        assert a.put(keys[:2], values[:2]) == [pb.OK] * 2
        with a.get_many(keys, local_only=True) as r:
            assert r.codes == [pb.OK, pb.OK, pb.NOT_FOUND]
            assert [bytes(v) for v in r.views[:2] if v is not None] == values[:2] and r.views[2] is None
    with kvpool.connect(module_cluster.sidecars[1]) as b:
        h.wait_for(lambda: b.match(keys[:2]) == 2, what="the objects to reach the pool")
        before = b.stats()
        with b.get_many(keys[:2], local_only=True) as r:  # in the pool, not in this sidecar's arena
            assert r.codes == [pb.NOT_FOUND] * 2
        after = b.stats()
        assert after.local_objects == before.local_objects  # nothing was fetched into the arena
        assert after.counters[SidecarCounter.READ_HITS_POOL] == before.counters[SidecarCounter.READ_HITS_POOL]
        assert after.counters[SidecarCounter.READ_MISSES] == before.counters[SidecarCounter.READ_MISSES]
