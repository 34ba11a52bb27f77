"""Prometheus metrics of a real pool (``LocalCluster`` processes, their ``/metrics`` scraped over
HTTP and parsed with prometheus-client's own text parser): after puts, gets, misses, a quota
refusal and evictions the right store series move, with the right miss reasons; a drain's progress
shows; the ``tenant`` label stays bounded by the configured tenants; sidecars serve their metrics
by default.

Names: ``kvpool.wire.metric_names`` (``docs/metrics.md``).
"""

from __future__ import annotations

import base64
import json
import random
import time
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.apps.cluster import LocalCluster
from kvpool.pool.node_client import StoreClient
from kvpool.wire.counters import MissReason
from kvpool.wire.metric_names import (
    OTHER_TENANT,
    EvictionReason,
    PushState,
    RefusalReason,
    SidecarMetric,
    StoreMetric,
)
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
OBJECT = 64 * KiB
QUOTA = 4 * OBJECT

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Series:
    """Every sample of a ``/metrics`` page: (name, labels) → value."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(series: Series, name: str, **labels: str) -> float:
    """One sample (0 when absent: a counter that never moved may not be exposed yet)."""
    return series.get((name, frozenset(labels.items())), 0.0)


def label_values(series: Series, name: str, label: str) -> set[str]:
    return {dict(labels)[label] for n, labels in series if n == name and label in dict(labels)}


CLUSTER = dict(stores=1, sidecars=2, tenants=["a", "b"], quotas={"a": QUOTA}, store_bytes=2 * MiB,
               local_bytes=8 * MiB, drain_seconds=3)
"""One store node (2 MiB of DRAM, so evictions come soon) and a sidecar of each of two tenants;
tenant ``a`` has a quota of four objects."""


@pytest.fixture
def lc(module_cluster: LocalCluster) -> LocalCluster:
    return module_cluster


def _store(lc: LocalCluster, tenant: str) -> StoreClient:
    return StoreClient(lc.stores[0], token=lc.tokens[tenant])


def test_store_series_follow_puts_gets_misses_refusals_and_evictions(lc: LocalCluster, h: Any,
                                                                     rng: random.Random) -> None:
    url = lc.metrics_url("store", 0)
    s0 = scrape(url)
    b, a = _store(lc, "b"), _store(lc, "a")
    try:
        keys = h.keys(rng, 8)
        assert b.put(keys, h.values(rng, [OBJECT] * 8)) == [pb.OK] * 8
        got = b.get(keys)
        assert all(v is not None and len(v) == OBJECT for v in got)
        unknown = h.keys(rng, 3)
        assert b.exists(unknown).prefix == 0

        def answered() -> Any:
            # A request's latency is observed once its whole answer is sent, so the client can
            # hold the answer a moment before the node's thread has recorded it (a CI run scraped
            # in between: exists' count still 0).
            s = scrape(url)
            ops = ("put", "get", "exists")
            seen = all(value(s, StoreMetric.OP_SECONDS + "_count", op=op)
                       > value(s0, StoreMetric.OP_SECONDS + "_count", op=op) for op in ops)
            return s if seen else None
        s1 = h.wait_for(answered, what="a latency observation of each of put, get and exists")
        d = lambda name, **kw: value(s1, name, **kw) - value(s0, name, **kw)  # noqa: E731
        assert d(StoreMetric.BYTES_IN + "_total", tenant="b") == 8 * OBJECT
        assert d(StoreMetric.OBJECTS_STORED + "_total", tenant="b") == 8
        assert d(StoreMetric.BYTES_OUT + "_total", tenant="b") == 8 * OBJECT
        assert d(StoreMetric.LOOKUP_BLOCKS + "_total", tenant="b") == 8 + 3
        assert d(StoreMetric.HIT_BLOCKS + "_total", tenant="b", tier="dram") == 8
        assert d(StoreMetric.MISS_BLOCKS + "_total", tenant="b", reason=MissReason.ABSENT) == 3
        assert value(s1, StoreMetric.TENANT_USED_BYTES, tenant="b") == 8 * OBJECT
        assert value(s1, StoreMetric.TIER_USED_BYTES, tier="dram") >= 8 * OBJECT
        assert value(s1, StoreMetric.TIER_CAPACITY_BYTES, tier="dram") >= 2 * MiB

        # A quota refusal: tenant a may hold four objects here; the rest are refused, and a later
        # lookup of them misses for the quota.
        mine = h.keys(rng, 6)
        codes = a.put(mine, h.values(rng, [OBJECT] * 6))
        refused = [k for k, c in zip(mine, codes, strict=True) if c == pb.QUOTA_EXCEEDED]
        assert len(refused) == 2 and codes.count(pb.OK) == 4
        assert a.exists(refused).prefix == 0
        s2 = scrape(url)
        assert value(s2, StoreMetric.QUOTA_REFUSALS + "_total", tenant="a") == 2
        assert value(s2, StoreMetric.REFUSALS + "_total", reason=RefusalReason.QUOTA) == 2
        assert value(s2, StoreMetric.MISS_BLOCKS + "_total", tenant="a", reason=MissReason.QUOTA) == 2
        assert value(s2, StoreMetric.TENANT_QUOTA_BYTES, tenant="a") == QUOTA

        # Evictions: tenant b writes more than the node's DRAM holds; what went is counted by
        # reason, and a lookup of an evicted key says so.
        more = h.keys(rng, 40)
        for i in range(0, 40, 8):
            b.put(more[i:i + 8], h.values(rng, [OBJECT] * 8))
        s3 = scrape(url)
        assert value(s3, StoreMetric.EVICTIONS + "_total", tenant="b", reason=EvictionReason.LRU) > 0
        present = b.exists(keys + more, prefix_only=False).present
        gone = [k for k, p in zip(keys + more, present, strict=True) if not p]
        assert gone
        before = value(scrape(url), StoreMetric.MISS_BLOCKS + "_total", tenant="b", reason=MissReason.EVICTED)
        assert b.exists(gone[:1]).prefix == 0
        s4 = scrape(url)
        assert value(s4, StoreMetric.MISS_BLOCKS + "_total", tenant="b", reason=MissReason.EVICTED) == before + 1

        # Pins: a match's lease is a gauge while it lives.
        held = b.exists(more[-1:], pin=True, lease_ms=60_000)
        assert held.prefix == 1
        assert value(scrape(url), StoreMetric.LEASES) >= 1
    finally:
        a.close()
        b.close()


def test_tenant_label_is_bounded_by_the_configured_tenants(lc: LocalCluster, h: Any, rng: random.Random) -> None:
    """Thirty tenants write and are then revoked: their objects stay, but the scrape shows them as
    one ``_other`` tenant, not thirty label values."""
    with open(lc.tenants_file) as f:
        configured = [pb.TenantConfig(tenant_id=t["tenantId"], token=t["token"], quota_bytes=t["quotaBytes"],
                                      salt=base64.b64decode(t["salt"])) for t in json.load(f)]
    extra = [pb.TenantConfig(tenant_id=f"x{i}", token=f"tok-x{i}-{rng.randrange(1 << 30)}") for i in range(30)]
    with lc.admin(lc.stores[0]) as admin:
        admin.set_tenants(extra)
        for t in extra:
            c = StoreClient(lc.stores[0], token=t.token)
            try:
                assert c.put(h.keys(rng, 1), [b"x" * KiB]) == [pb.OK]
            finally:
                c.close()
        admin.set_tenants(configured, replace=True)
    s = scrape(lc.metrics_url("store", 0))
    for name in (StoreMetric.TENANT_OBJECTS, StoreMetric.BYTES_IN + "_total", StoreMetric.LOOKUP_BLOCKS + "_total"):
        assert label_values(s, name, "tenant") <= {"a", "b", "default", OTHER_TENANT}, name
    assert value(s, StoreMetric.TENANT_OBJECTS, tenant=OTHER_TENANT) == 30
    assert value(s, StoreMetric.BYTES_IN + "_total", tenant=OTHER_TENANT) == 30 * KiB


def test_sidecars_serve_metrics_by_default(lc: LocalCluster, h: Any, rng: random.Random) -> None:
    """A LocalCluster sidecar serves /metrics without being asked (an ephemeral 127.0.0.1 port on
    its READY line); what a read hands the engine is counted as restored bytes."""
    keys = h.keys(rng, 3)
    values = h.values(rng, [16 * KiB] * 3)
    with lc.connect(1) as c:  # tenant b
        assert c.put(keys, values) == [pb.OK] * 3
        s0 = scrape(lc.metrics_url("sidecar", 1))
        with c.get(keys) as got:
            assert [bytes(v) for v in got] == values
        s1 = scrape(lc.metrics_url("sidecar", 1))
    restored = (value(s1, SidecarMetric.RESTORED_BYTES + "_total", tenant="b", source="local")
                - value(s0, SidecarMetric.RESTORED_BYTES + "_total", tenant="b", source="local"))
    assert restored == 3 * 16 * KiB
    assert label_values(s1, SidecarMetric.MISS_BLOCKS + "_total", "reason") == {"node_down", "checksum", "no_room"}
    assert value(s1, SidecarMetric.LOCAL_CAPACITY_BYTES) > 0
    assert value(s1, SidecarMetric.EVENTS + "_total", event="put_blocks") >= 3


def test_drain_progress_is_scraped(h: Any, rng: random.Random) -> None:
    """A leaving node's drain shows on its /metrics: draining, the objects moved, its deadline; the
    node that takes them counts the bytes in."""
    with LocalCluster(stores=2, sidecars=0, store_bytes=16 * MiB) as lc2:
        leaving = StoreClient(lc2.stores[1])
        try:
            keys = h.keys(rng, 12)
            assert leaving.put(keys, h.values(rng, [16 * KiB] * 12)) == [pb.OK] * 12
            before = value(scrape(lc2.metrics_url("store", 0)), StoreMetric.BYTES_IN + "_total", tenant="default")
            lc2.publish_ring(draining=["store-1"])
            deadline_ms = int((time.time() + 60) * 1000)
            with lc2.admin(lc2.stores[1]) as admin:
                admin.drain(leaving.get_ring(), deadline_ms)
                h.wait_for(lambda: admin.drain_status().state == "done", 60, "the drain to finish")
            s = scrape(lc2.metrics_url("store", 1))
            assert value(s, StoreMetric.DRAINING) == 1 and value(s, StoreMetric.DRAIN_RUNNING) == 0
            assert value(s, StoreMetric.DRAIN_OBJECTS, state=PushState.MOVED) == 12
            assert value(s, StoreMetric.DRAIN_OBJECTS, state=PushState.REMAINING) == 0
            assert value(s, StoreMetric.DRAIN_BYTES, state=PushState.MOVED) == 12 * 16 * KiB
            assert value(s, StoreMetric.DRAIN_DEADLINE) == deadline_ms / 1000
            taken = value(scrape(lc2.metrics_url("store", 0)), StoreMetric.BYTES_IN + "_total", tenant="default")
            assert taken - before == 12 * 16 * KiB
        finally:
            leaving.close()
