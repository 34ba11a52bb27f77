"""Prometheus metrics of a store node (``kvpool store --metrics-port``): read at scrape time.

Everything but the latency histogram is a collector over what the node already keeps: its
``stats()`` (counters per node and per tenant, tiers, tenants' usage, leases) and the drain and
warm-up jobs' status.  So the hot path pays nothing for them; the histogram costs one
``observe`` per data-session request (:class:`~kvpool.store.data_session.DataSessionHandler`).
Each node has its own registry (several nodes may share a process in tests).  Names:
:class:`~kvpool.wire.metric_names.StoreMetric`; ``docs/metrics.md`` lists them.

The ``tenant`` label takes a configured tenant's id or :data:`~kvpool.wire.metric_names.OTHER_TENANT`
(:func:`tenant_label`): tenants a node only knows from objects it still holds (revoked, or written
under open tenancy by ids nobody configured) fold into one value.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvpool.core.push_status import DrainStatus, WarmStatus
from kvpool.wire.counters import (
    MISS_PREFIX,
    STORE_MISS_REASONS,
    TIER_HITS_PREFIX,
    StoreCounter,
    is_store_counter,
    miss_reason,
    tier_hits,
)
from kvpool.wire.metric_names import (
    OTHER_TENANT,
    DemotionReason,
    EvictionReason,
    PushState,
    RefusalReason,
)
from kvpool.wire.metric_names import StoreMetric as M

LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 2.5)
"""Seconds; a data-session request takes from ~100 µs (a match) to a second (a large batch)."""

EVICTIONS = {EvictionReason.LRU: StoreCounter.EVICTED, EvictionReason.QUOTA: StoreCounter.EVICTED_QUOTA,
             EvictionReason.EXPIRED: StoreCounter.EXPIRED}
REFUSALS = {RefusalReason.QUOTA: StoreCounter.REFUSED_QUOTA, RefusalReason.SPACE: StoreCounter.REFUSED_SPACE,
            RefusalReason.WRONG_OWNER: StoreCounter.REFUSED_WRONG_OWNER}


def tenant_label(tenant: str, configured: Collection[str]) -> str:
    """The ``tenant`` label of ``tenant`` (pure): its id when configured, else one fixed value."""
    return tenant if tenant in configured else OTHER_TENANT


def tenant_counters(rows: list[tuple[Any, ...]], configured: Collection[str]) -> dict[str, Counter[str]]:
    """The tenants' counters (``Tenants.rows``) summed by label (pure)."""
    out: dict[str, Counter[str]] = {}
    for tid, _used, _quota, _objects, counters, _share in rows:
        out.setdefault(tenant_label(tid, configured), Counter()).update(counters)
    return out


class StoreCollector(Collector):
    """The node's state as metric families, built at each scrape (see the module docstring)."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], drain: Callable[[], DrainStatus],
                 warm: Callable[[], WarmStatus]) -> None:
        self.stats, self.drain, self.warm = stats, drain, warm

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        configured = s["configured"]
        per_tenant = tenant_counters(s["tenants"], configured)
        node: Mapping[str, int] = s["counters"]
        tiers = sorted({t[0] for t in s["tiers"]} | {n[len(TIER_HITS_PREFIX):] for n in node
                                                     if n.startswith(TIER_HITS_PREFIX) and is_store_counter(n)})
        yield from _tenant_families(per_tenant, tiers)
        yield from _usage_families(s, configured)
        yield from _node_families(node)
        yield from _push_families(self.drain(), self.warm())


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


def _gauge(name: str, doc: str, labels: list[str] | None = None, value: float | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels, value=value)


def _tenant_families(per_tenant: Mapping[str, Counter[str]], tiers: list[str]) -> Iterator[Metric]:
    lookups = _counter(M.LOOKUP_BLOCKS, "Blocks asked for by match/read", ["tenant"])
    hits = _counter(M.HIT_BLOCKS, "Blocks found, by the tier they were found in", ["tenant", "tier"])
    misses = _counter(M.MISS_BLOCKS, "Blocks not found, by reason", ["tenant", "reason"])
    bytes_in = _counter(M.BYTES_IN, "Payload bytes committed", ["tenant"])
    bytes_out = _counter(M.BYTES_OUT, "Payload bytes sent to readers", ["tenant"])
    stored = _counter(M.OBJECTS_STORED, "Objects committed", ["tenant"])
    evictions = _counter(M.EVICTIONS, "Objects dropped, by reason", ["tenant", "reason"])
    quota = _counter(M.QUOTA_REFUSALS, "Writes refused QUOTA_EXCEEDED", ["tenant"])
    for tenant, c in sorted(per_tenant.items()):
        lookups.add_metric([tenant], c[StoreCounter.LOOKUP_BLOCKS])
        for tier in tiers:
            hits.add_metric([tenant, tier], c[tier_hits(tier)])
        for reason in sorted(STORE_MISS_REASONS):
            misses.add_metric([tenant, reason], c[miss_reason(reason)])
        bytes_in.add_metric([tenant], c[StoreCounter.STORED_BYTES])
        bytes_out.add_metric([tenant], c[StoreCounter.BYTES_SENT] + c[StoreCounter.RANGE_BYTES_SENT])
        stored.add_metric([tenant], c[StoreCounter.STORED])
        for why, counter in EVICTIONS.items():
            evictions.add_metric([tenant, why], c[counter])
        quota.add_metric([tenant], c[StoreCounter.REFUSED_QUOTA])
    yield from (lookups, hits, misses, bytes_in, bytes_out, stored, evictions, quota)


def _usage_families(s: Mapping[str, Any], configured: Collection[str]) -> Iterator[Metric]:
    cap = _gauge(M.TIER_CAPACITY_BYTES, "Capacity of a tier", ["tier"])
    used = _gauge(M.TIER_USED_BYTES, "Bytes in use in a tier", ["tier"])
    objs = _gauge(M.TIER_OBJECTS, "Objects held in a tier", ["tier"])
    for name, capacity, in_use, objects in s["tiers"]:
        cap.add_metric([name], capacity)
        used.add_metric([name], in_use)
        objs.add_metric([name], objects)
    yield from (cap, used, objs)
    t_used = _gauge(M.TENANT_USED_BYTES, "Bytes a tenant holds here", ["tenant"])
    t_quota = _gauge(M.TENANT_QUOTA_BYTES, "A tenant's quota for the whole pool (0: none)", ["tenant"])
    t_share = _gauge(M.TENANT_SHARE_BYTES, "This node's share of a tenant's quota (0: none)", ["tenant"])
    t_objs = _gauge(M.TENANT_OBJECTS, "Objects a tenant holds here", ["tenant"])
    rows: dict[str, list[int]] = {}
    for tid, in_use, quota, objects, _c, share in s["tenants"]:
        label = tenant_label(tid, configured)
        row = rows.setdefault(label, [0, 0, 0, 0])
        row[0] += in_use
        row[1] = max(row[1], quota) if label == OTHER_TENANT else quota
        row[2] = max(row[2], share) if label == OTHER_TENANT else share
        row[3] += max(objects, 0)
    for label, (in_use, quota, share, objects) in sorted(rows.items()):
        t_used.add_metric([label], in_use)
        t_quota.add_metric([label], quota)
        t_share.add_metric([label], share)
        t_objs.add_metric([label], objects)
    yield from (t_used, t_quota, t_share, t_objs)
    yield _gauge(M.LEASES, "Read leases (pins) alive", value=s["leases"])
    yield _gauge(M.RESERVATIONS, "Write reservations alive", value=s["reservations"])
    yield _gauge(M.DRAINING, "1 while the ring marks the node draining", value=int(bool(s["draining"])))
    yield _gauge(M.RING_EPOCH, "Ring epoch the node serves by", value=s["epoch"])
    info = _gauge(M.INFO, "The node's id in the ring", ["node_id"])
    info.add_metric([s["node_id"]], 1)
    yield info


def _node_families(c: Mapping[str, int]) -> Iterator[Metric]:
    requested = c.get(StoreCounter.DEMOTIONS_REQUESTED, 0)
    demotions = _counter(M.DEMOTIONS, "Objects moved down a tier, by reason", ["reason"])
    demotions.add_metric([DemotionReason.REQUESTED], requested)
    demotions.add_metric([DemotionReason.PRESSURE], max(0, c.get(StoreCounter.DEMOTED, 0) - requested))
    yield demotions
    yield CounterMetricFamily(M.PROMOTIONS, "Objects moved up into DRAM for a read",
                              value=c.get(StoreCounter.PROMOTED, 0))
    refusals = _counter(M.REFUSALS, "Writes refused, by reason", ["reason"])
    for reason, counter in REFUSALS.items():
        refusals.add_metric([reason], c.get(counter, 0))
    yield refusals
    events = _counter(M.EVENTS, "Every counter of StoreStats.counters", ["event"])
    for counter in StoreCounter:
        events.add_metric([counter], c.get(counter, 0))
    for name in sorted(n for n in c if n.startswith((TIER_HITS_PREFIX, MISS_PREFIX)) and is_store_counter(n)):
        events.add_metric([name], c[name])
    yield events


def _push_families(d: DrainStatus, w: WarmStatus) -> Iterator[Metric]:
    yield _gauge(M.DRAIN_RUNNING, "1 while a drain pushes objects", value=int(d.state == "running"))
    objs = _gauge(M.DRAIN_OBJECTS, "Objects of the current or last drain", ["state"])
    for state, v in ((PushState.MOVED, d.moved_objects), (PushState.DROPPED, d.dropped_objects),
                     (PushState.REMAINING, d.remaining_objects)):
        objs.add_metric([state], v)
    nbytes = _gauge(M.DRAIN_BYTES, "Bytes of the current or last drain", ["state"])
    for state, v in ((PushState.MOVED, d.moved_bytes), (PushState.DROPPED, d.dropped_bytes)):
        nbytes.add_metric([state], v)
    yield from (objs, nbytes)
    yield _gauge(M.DRAIN_DEADLINE, "Unix time the drain must end by (0: none)", value=d.deadline_unix_ms / 1000.0)
    yield _gauge(M.WARM_RUNNING, "1 while a warm-up pushes objects", value=int(w.state == "running"))
    objs = _gauge(M.WARM_OBJECTS, "Objects of the current or last warm-up", ["state"])
    for state, v in ((PushState.PLANNED, w.planned_objects), (PushState.MOVED, w.moved_objects),
                     (PushState.SKIPPED, w.skipped_objects), (PushState.FAILED, w.failed_objects),
                     (PushState.REMAINING, w.remaining_objects)):
        objs.add_metric([state], v)
    nbytes = _gauge(M.WARM_BYTES, "Bytes of the current or last warm-up", ["state"])
    for state, v in ((PushState.PLANNED, w.planned_bytes), (PushState.MOVED, w.moved_bytes),
                     (PushState.SKIPPED, w.skipped_bytes)):
        nbytes.add_metric([state], v)
    yield from (objs, nbytes)


class StoreMetrics:
    """A node's registry: the collector, and the latency histogram its data session feeds."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], drain: Callable[[], DrainStatus],
                 warm: Callable[[], WarmStatus]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StoreCollector(stats, drain, warm))
        self._latency = Histogram(M.OP_SECONDS, "Latency of a data-session request", ["op"],
                                  buckets=LATENCY_BUCKETS, registry=self.registry)
        self._by_op: dict[str, Any] = {}

    def observe(self, op: str, seconds: float) -> None:
        """One request's latency (the child of each op is looked up once, then cached)."""
        child = self._by_op.get(op)
        if child is None:
            child = self._by_op[op] = self._latency.labels(op)
        child.observe(seconds)
