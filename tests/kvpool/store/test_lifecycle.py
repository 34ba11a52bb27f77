"""Leases against a real node: pinned objects are never evicted, and a node full of them refuses.

(Writers killed mid-put: ``test_data_session.py``; reservation expiry and revoke: the node's own
tests, ``tests/kvpool/test_store_node.py``.)"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB = 1 << 10


@pytest.fixture(scope="module")
def nodes(module_stores: Any) -> Any:
    return module_stores.start_many({"pinned": {"dram": "4MiB"}, "allpinned": {"dram": "4MiB"}})


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
    assert st.counters[StoreCounter.REFUSED_SPACE] == codes.count(pb.NO_SPACE)
    assert h.stats_tier(st, "dram").used_bytes <= h.stats_tier(st, "dram").capacity_bytes
    assert c.exists(keys).prefix == 7
