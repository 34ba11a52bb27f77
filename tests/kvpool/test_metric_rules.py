"""The pure parts of the metrics: the bounded memory of why keys went (kvpool.store.gone), the
tenant label's fold, a promotion's miss reason, a sidecar's miss reasons, the port flag, the
engine integrations' sums, and a store collector's drain/warm families from given statuses.
The endpoints themselves are scraped for real in tests/kvpool/sidecar/test_metrics.py."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.core.push_status import DrainStatus, WarmStatus
from kvpool.integrations.engine_metrics import totals
from kvpool.sidecar.metrics import misses
from kvpool.store.gone import Gone
from kvpool.store.metrics import StoreMetrics, tenant_counters, tenant_label
from kvpool.store.reads import promotion_miss
from kvpool.wire import metrics_http
from kvpool.wire.counters import SIDECAR_MISS_REASONS, MissReason, SidecarCounter, StoreCounter
from kvpool.wire.metric_names import OTHER_TENANT, PushState, StoreMetric
from kvpool.wire.proto import store_pb2 as pb


def test_gone_remembers_the_newest_keys_per_tenant() -> None:
    g = Gone(capacity=3)
    g.note("a", b"k1", MissReason.EVICTED)
    g.note("b", b"k1", MissReason.QUOTA)
    assert (g.reason("a", b"k1"), g.reason("b", b"k1"), g.reason("c", b"k1")) == (
        MissReason.EVICTED, MissReason.QUOTA, MissReason.ABSENT)
    g.note("a", b"k2", MissReason.EXPIRED)
    g.note("a", b"k1", MissReason.EXPIRED)  # noted again: the newest, with its new reason
    g.note("a", b"k3", MissReason.EVICTED)  # the oldest ("b", k1) goes
    assert len(g) == 3 and g.reason("b", b"k1") == MissReason.ABSENT and g.reason("a", b"k1") == MissReason.EXPIRED
    off = Gone(capacity=0)
    off.note("a", b"k", MissReason.EVICTED)
    assert len(off) == 0 and off.reason("a", b"k") == MissReason.ABSENT


def test_tenant_label_folds_what_is_not_configured() -> None:
    configured = frozenset({"default", "a"})
    assert [tenant_label(t, configured) for t in ("a", "default", "x", "")] == ["a", "default", OTHER_TENANT,
                                                                              OTHER_TENANT]
    rows = [(f"x{i}", 0, 0, 1, {"stored": 1}, 0) for i in range(100)] + [("a", 0, 0, 1, {"stored": 5}, 0)]
    summed = tenant_counters(rows, configured)
    assert set(summed) == {"a", OTHER_TENANT} and summed[OTHER_TENANT]["stored"] == 100


def test_a_failed_promotion_says_why() -> None:
    assert promotion_miss(pb.CHECKSUM) == MissReason.CHECKSUM
    assert promotion_miss(pb.NOT_FOUND) == MissReason.NODE_DOWN  # still on its way at the deadline
    assert promotion_miss(pb.NO_SPACE) == MissReason.EVICTED
    assert promotion_miss(pb.INVALID) == MissReason.ABSENT


def test_sidecar_miss_reasons_come_from_its_counters() -> None:
    c = Counter({SidecarCounter.POOL_FETCH_FAILURES: 7, SidecarCounter.POOL_CHECKSUM_FAILURES: 2,
                 SidecarCounter.READ_NO_ROOM: 3})
    assert misses(c) == {MissReason.CHECKSUM: 2, MissReason.NODE_DOWN: 5, MissReason.NO_ROOM: 3}
    assert set(misses({})) == SIDECAR_MISS_REASONS


def test_metrics_port_flag() -> None:
    assert [metrics_http.parse_port(v) for v in ("0", "7404", "auto", "AUTO")] == [
        0, 7404, metrics_http.EPHEMERAL, metrics_http.EPHEMERAL]
    for bad in ("-1", "65536", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            metrics_http.parse_port(bad)
    assert metrics_http.serve(0, "127.0.0.1", None) is None  # type: ignore[arg-type]


def test_engine_sums_over_deciders() -> None:
    lookups, tokens = totals([{"loaded": 2, "loaded_tokens": 10, "recomputed_cheaper": 1},
                              {"recomputed_cheaper": 3, "recomputed_cheaper_tokens": 30, "recomputed_missing": 4}])
    assert lookups == {"loaded": 2, "recomputed_cheaper": 4, "recomputed_missing": 4}
    assert tokens == {"loaded": 10, "recomputed_cheaper": 30}


def test_drain_and_warm_progress_and_the_node_families() -> None:
    stats = {"node_id": "n0", "epoch": 7, "draining": True, "incarnation": 1, "leases": 2, "reservations": 1,
             "tiers": [("dram", 100, 40, 4), ("ssd", 1000, 300, 3)], "configured": frozenset({"default"}),
             "tenants": [("default", 340, 0, 7, {"stored": 7, "hits_ssd": 3, "miss_evicted": 2}, 0)],
             "counters": {StoreCounter.DEMOTED: 5, StoreCounter.DEMOTIONS_REQUESTED: 2, "hits_ssd": 3}}
    drain = DrainStatus(state="running", moved_objects=3, moved_bytes=30, remaining_objects=4,
                        deadline_unix_ms=1_700_000_000_000, epoch=7)
    warm = WarmStatus(state="done", planned_objects=5, moved_objects=4, skipped_objects=1)
    m = StoreMetrics(lambda: stats, lambda: drain, lambda: warm)
    m.observe("get", 0.001)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in f.samples}
    assert samples[(StoreMetric.DRAIN_RUNNING, ())] == 1
    assert samples[(StoreMetric.DRAIN_OBJECTS, (("state", PushState.MOVED),))] == 3
    assert samples[(StoreMetric.DRAIN_OBJECTS, (("state", PushState.REMAINING),))] == 4
    assert samples[(StoreMetric.DRAIN_DEADLINE, ())] == 1_700_000_000
    assert samples[(StoreMetric.WARM_RUNNING, ())] == 0
    assert samples[(StoreMetric.WARM_OBJECTS, (("state", PushState.SKIPPED),))] == 1
    assert samples[(StoreMetric.DEMOTIONS + "_total", (("reason", "pressure"),))] == 3
    assert samples[(StoreMetric.DEMOTIONS + "_total", (("reason", "requested"),))] == 2
    assert samples[(StoreMetric.HIT_BLOCKS + "_total", (("tenant", "default"), ("tier", "ssd")))] == 3
    assert samples[(StoreMetric.MISS_BLOCKS + "_total", (("reason", "evicted"), ("tenant", "default")))] == 2
    assert samples[(StoreMetric.TIER_USED_BYTES, (("tier", "ssd"),))] == 300
    assert samples[(StoreMetric.DRAINING, ())] == 1 and samples[(StoreMetric.LEASES, ())] == 2
    assert samples[(StoreMetric.OP_SECONDS + "_count", (("op", "get"),))] == 1
