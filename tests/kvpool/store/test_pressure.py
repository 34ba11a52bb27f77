"""Capacity, eviction, TTL and quota of a real node under write pressure."""

from __future__ import annotations

import base64
import random
import time
from typing import Any

import pytest

from kvpool.core import errors
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def nodes(module_stores: Any) -> Any:
    return module_stores.start_many({
        "pressure": {"dram": "8MiB"},
        "ttl": {"dram": "4MiB", "config": {"ttlSeconds": {"chatbot": 1, "agent": 3600}}},
        "ttl_tenant": {"dram": "4MiB", "config": {"ttlSeconds": {"agent": 3600}},
                       "tenants": [{"tenantId": "brief", "token": "tok-brief", "ttlSeconds": {"agent": 1}}]},
        "quota": {"dram": "16MiB", "tenants": _tenants(), "closed": True},
        "evictown": {"dram": "16MiB", "tenants": _tenants(), "closed": True}})


def _check_within_capacity(h: Any, c: Any) -> Any:
    st = c.stats()
    dram = h.stats_tier(st, "dram")
    assert 0 <= dram.used_bytes <= dram.capacity_bytes
    for t in st.tenants:
        assert t.quota_bytes == 0 or t.used_bytes <= t.quota_bytes
    return st


def test_write_pressure_stays_within_capacity_and_evicts(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["pressure"]
    c = node.client()
    cap = h.stats_tier(c.stats(), "dram").capacity_bytes
    written: list[tuple[bytes, bytes]] = []
    total = 0
    while total < 3 * cap:
        # Mixed sizes (fragmentation): 1 B .. 1 MiB, batches of 1..16.
        n = rng.randint(1, 16)
        sizes = [rng.choice([1, 4 * KiB, 100 * KiB, 128 * KiB, 300 * KiB, 1 * MiB, rng.randint(1, MiB)])
                 for _ in range(n)]
        keys = h.rand_keys(rng, n)
        vals = h.rand_values(rng, sizes)
        codes = c.put(keys, vals)
        # Nothing is pinned, so eviction can always make room: a refusal here would be a lost write.
        assert codes == [pb.OK] * n, [errors.code_name(x) for x in codes]
        written += list(zip(keys, vals, strict=True))
        total += sum(sizes)
        _check_within_capacity(h, c)
    st = c.stats()
    assert st.counters[StoreCounter.EVICTED] > 0
    assert st.counters[StoreCounter.STORED] == len(written)
    dram = h.stats_tier(st, "dram")
    assert dram.objects == st.counters[StoreCounter.STORED] - st.counters[StoreCounter.EVICTED]
    # Whatever is still there is byte-exact; whatever is gone is a clean miss; the newest survive.
    keys = [k for k, _ in written]
    got = []
    for i in range(0, len(keys), 16):
        got += c.get(keys[i:i + 16])
    present = 0
    for (_, v), g in zip(written, got, strict=True):
        if g is not None:
            assert bytes(g) == v
            present += 1
    assert present == dram.objects
    assert got[-1] is not None
    assert h.stats_tenant(st, "default").used_bytes <= dram.used_bytes


def test_object_larger_than_the_arena_is_refused_clearly(nodes: Any, h: Any, rng: random.Random) -> None:
    c = nodes["quota"].client("tok-big")  # a tenant without a quota: only the arena limits it
    before = h.stats_tenant(c.stats(), "big").counters.get(StoreCounter.STORED, 0)
    keys = h.rand_keys(rng, 2)
    assert c.put(keys, [b"a" * (20 * MiB), b"b" * 1000]) == [pb.TOO_LARGE, pb.OK]
    assert h.stats_tenant(c.stats(), "big").counters[StoreCounter.STORED] == before + 1


def test_ttl_expired_objects_are_evicted_first(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["ttl"]
    c = node.client()
    size = 256 * KiB
    old_agent = h.rand_keys(rng, 6)    # least recently used, but within their TTL
    new_chat = h.rand_keys(rng, 6)     # more recent, but their 1 s TTL runs out
    agent_vals = h.rand_values(rng, [size] * 6)
    assert c.put(old_agent, agent_vals, traffic_class="agent") == [pb.OK] * 6
    time.sleep(0.05)
    assert c.put(new_chat, h.rand_values(rng, [size] * 6), traffic_class="chatbot") == [pb.OK] * 6
    assert c.stats().counters.get(StoreCounter.EVICTED, 0) == 0
    time.sleep(1.3)
    # 12 x 256 KiB = 3 MiB stored; 6 more (4.5 MiB) exceed the 4 MiB payload capacity, so some
    # objects must go.  Plain LRU would take the agent objects (oldest); expiry first takes the
    # chatbot ones.
    assert c.put(h.rand_keys(rng, 6), h.rand_values(rng, [size] * 6), traffic_class="agent") == [pb.OK] * 6
    st = c.stats()
    assert st.counters[StoreCounter.EXPIRED] >= 2
    assert st.counters.get(StoreCounter.EVICTED, 0) == 0
    assert c.exists(old_agent).prefix == 6
    assert [bytes(g) if g is not None else None for g in c.get(old_agent)] == agent_vals
    assert c.exists(new_chat, prefix_only=False).present.count(True) == 6 - st.counters[StoreCounter.EXPIRED]
    assert h.stats_tenant(st, "default").counters[StoreCounter.EXPIRED] == st.counters[StoreCounter.EXPIRED]


def test_tenant_ttl_override_expires_first(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["ttl_tenant"]
    pool, brief = node.client(), node.client("tok-brief")
    size = 256 * KiB
    old_pool = h.rand_keys(rng, 6)     # oldest, pool TTL (1 h)
    new_brief = h.rand_keys(rng, 6)    # newer, but this tenant's agent TTL is 1 s
    pool_vals = h.rand_values(rng, [size] * 6)
    assert pool.put(old_pool, pool_vals, traffic_class="agent") == [pb.OK] * 6
    time.sleep(0.05)
    assert brief.put(new_brief, h.rand_values(rng, [size] * 6), traffic_class="agent") == [pb.OK] * 6
    time.sleep(1.3)
    assert pool.put(h.rand_keys(rng, 6), h.rand_values(rng, [size] * 6), traffic_class="agent") == [pb.OK] * 6
    st = node.client().stats()
    assert h.stats_tenant(st, "brief").counters[StoreCounter.EXPIRED] >= 2
    assert st.counters.get(StoreCounter.EVICTED, 0) == 0
    assert [bytes(g) if g is not None else None for g in pool.get(old_pool)] == pool_vals


def _tenants() -> list[dict[str, Any]]:
    return [
        {"tenantId": "refuse", "token": "tok-refuse", "salt": base64.b64encode(b"s1").decode(),
         "quotaBytes": 1 * MiB},
        {"tenantId": "evict", "token": "tok-evict", "salt": base64.b64encode(b"s2").decode(),
         "quotaBytes": 1 * MiB, "evictOwnOnQuota": True},
        {"tenantId": "big", "token": "tok-big"},
    ]


def test_quota_refusals_are_counted_and_reported(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["quota"]
    c = node.client("tok-refuse")
    size = 256 * KiB
    keys = h.rand_keys(rng, 8)
    vals = h.rand_values(rng, [size] * 8)
    codes = c.put(keys, vals)
    # Exactly the quota fits (4 x 256 KiB = 1 MiB); the rest is refused, item by item.
    assert codes == [pb.OK] * 4 + [pb.QUOTA_EXCEEDED] * 4
    codes = c.put(keys[4:], vals[4:])
    assert codes == [pb.QUOTA_EXCEEDED] * 4
    # An object that could never fit the quota is refused as well (and evicts nothing).
    assert c.put(h.rand_keys(rng, 1), [b"z" * (2 * MiB)]) == [pb.QUOTA_EXCEEDED]
    st = c.stats()
    t = h.stats_tenant(st, "refuse")
    assert t.counters[StoreCounter.REFUSED_QUOTA] == 9
    assert t.quota_bytes == 1 * MiB and t.used_bytes == 1 * MiB and t.objects == 4
    assert st.counters[StoreCounter.REFUSED_QUOTA] == 9
    # What was accepted is intact; what was refused is not there.
    assert [bytes(g) if g is not None else None for g in c.get(keys)] == vals[:4] + [None] * 4
    # Removing frees quota.
    assert c.remove(keys[:2]) == [pb.OK] * 2
    assert c.put(keys[4:6], vals[4:6]) == [pb.OK] * 2
    # Another tenant's quota is its own.
    big = node.client("tok-big")
    assert big.put(h.rand_keys(rng, 8), h.rand_values(rng, [size] * 8)) == [pb.OK] * 8


def test_quota_evict_own_mode(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["evictown"]
    other = node.client("tok-big")
    size = 256 * KiB
    other_keys = h.rand_keys(rng, 4)
    other_vals = h.rand_values(rng, [size] * 4)
    assert other.put(other_keys, other_vals) == [pb.OK] * 4
    c = node.client("tok-evict")
    keys = h.rand_keys(rng, 12)
    vals = h.rand_values(rng, [size] * 12)
    for i in range(0, 12, 2):
        assert c.put(keys[i:i + 2], vals[i:i + 2]) == [pb.OK] * 2
        _check_within_capacity(h, c)
    st = c.stats()
    t = h.stats_tenant(st, "evict")
    assert t.used_bytes <= 1 * MiB
    assert t.counters[StoreCounter.EVICTED_QUOTA] == 8
    assert t.counters.get(StoreCounter.REFUSED_QUOTA, 0) == 0
    # Its own least recently used objects went; the newest quota's worth is intact.
    got = c.get(keys)
    assert [g is not None for g in got] == [False] * 8 + [True] * 4
    assert [bytes(g) for g in got[8:] if g is not None] == vals[8:]
    # Nobody else paid for it.
    assert [bytes(g) if g is not None else None for g in other.get(other_keys)] == other_vals
    # A single object above the whole quota is still refused (evicting everything would not help).
    assert c.put(h.rand_keys(rng, 1), [b"q" * (2 * MiB)]) == [pb.QUOTA_EXCEEDED]
    assert c.exists(keys[8:]).prefix == 4
