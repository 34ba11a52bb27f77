"""Prometheus metrics of the sidecar (prometheus-client), served on ``--metrics-port``.

Labels are per tenant and tier, never per key (a sidecar serves one tenant).  Gauges, the
miss reasons, the restored bytes and every Stats counter are computed at scrape time from the
sidecar's state (a collector), so the hot path only bumps counters and observes histograms.
Names: :class:`~kvpool.wire.metric_names.SidecarMetric` (``docs/metrics.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool.wire import metrics_http
from kvpool.wire.counters import SIDECAR_MISS_REASONS, MissReason, SidecarCounter, is_sidecar_counter
from kvpool.wire.metric_names import SidecarMetric as M

LOOKUP_BLOCKS = Counter(M.LOOKUP_BLOCKS, "Blocks asked for by match calls", ["tenant"])
HIT_BLOCKS = Counter(M.HIT_BLOCKS, "Blocks matched (block-weighted hits)", ["tenant", "tier"])
READ_BLOCKS = Counter(M.READ_BLOCKS, "Blocks read", ["tenant", "tier"])
READ_BYTES = Counter(M.READ_BYTES, "Bytes handed to the engine", ["tenant"])
PUT_BYTES = Counter(M.PUT_BYTES, "Bytes written by the engine", ["tenant"])
POOL_BYTES_OUT = Counter(M.POOL_BYTES_OUT, "Bytes written to the pool", ["tenant"])
POOL_BYTES_IN = Counter(M.POOL_BYTES_IN, "Bytes fetched from the pool into the local tier", ["tenant"])
LATENCY = Histogram(M.OP_SECONDS, "Latency of sidecar operations", ["op"],
                    buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0))


def record_match(tenant: str, asked: int, local: int, pool: int, seconds: float) -> None:
    LOOKUP_BLOCKS.labels(tenant).inc(asked)
    if local:
        HIT_BLOCKS.labels(tenant, "local").inc(local)
    if pool:
        HIT_BLOCKS.labels(tenant, "pool").inc(pool)
    LATENCY.labels("match").observe(seconds)


def record_read(tenant: str, n: int, local: int, pool: int, nbytes: int, seconds: float,
                pool_bytes: int = 0) -> None:
    if pool_bytes:
        POOL_BYTES_IN.labels(tenant).inc(pool_bytes)
    if local:
        READ_BLOCKS.labels(tenant, "local").inc(local)
    if pool:
        READ_BLOCKS.labels(tenant, "pool").inc(pool)
    READ_BYTES.labels(tenant).inc(nbytes)
    LATENCY.labels("read").observe(seconds)


def misses(counters: Mapping[str, int]) -> dict[MissReason, int]:
    """The blocks a sidecar missed for the reasons only it knows (pure; the store nodes count
    theirs): a fetch of a matched block that failed its checksum, or failed otherwise (the node
    went down or missed its deadline), and blocks found with no room to land them."""
    checksum = counters.get(SidecarCounter.POOL_CHECKSUM_FAILURES, 0)
    out = {MissReason.CHECKSUM: checksum,
           MissReason.NODE_DOWN: max(0, counters.get(SidecarCounter.POOL_FETCH_FAILURES, 0) - checksum),
           MissReason.NO_ROOM: counters.get(SidecarCounter.READ_NO_ROOM, 0)}
    assert set(out) == SIDECAR_MISS_REASONS
    return out


class _StateCollector(Collector):
    def __init__(self, sidecar: Any) -> None:
        self.sidecar = sidecar

    def collect(self) -> Any:
        s = self.sidecar
        tenant = s.cfg.tenant_id
        c: Mapping[str, int] = dict(s.counters)
        missed = CounterMetricFamily(M.MISS_BLOCKS, "Blocks asked for and not loaded, by the reasons a sidecar knows",
                                     labels=["tenant", "reason"])
        for reason, n in sorted(misses(c).items()):
            missed.add_metric([tenant, reason], n)
        yield missed
        restored = CounterMetricFamily(M.RESTORED_BYTES, "Bytes loaded into the engine by reads",
                                       labels=["tenant", "source"])
        restored.add_metric([tenant, "local"], c.get(SidecarCounter.RESTORED_BYTES_LOCAL, 0))
        restored.add_metric([tenant, "pool"], c.get(SidecarCounter.RESTORED_BYTES_POOL, 0))
        yield restored
        events = CounterMetricFamily(M.EVENTS, "Every counter of SidecarStats.counters", labels=["event"])
        for name in sorted(n for n in c if is_sidecar_counter(n)):
            events.add_metric([name], c[name])
        yield events
        yield GaugeMetricFamily(M.LOCAL_USED_BYTES, "Local tier bytes in use", value=s.local.used)
        yield GaugeMetricFamily(M.LOCAL_CAPACITY_BYTES, "Local tier capacity", value=s.local.capacity)
        yield GaugeMetricFamily(M.POOL_NODES_UP, "Store nodes reachable", value=s.pool.nodes_up())
        yield GaugeMetricFamily(M.LOCAL_OBJECTS, "Objects in the local tier", value=s.local.objects())
        yield GaugeMetricFamily(M.POOL_PENDING_BYTES, "Bytes waiting to be written to the pool",
                                value=s.backlog_bytes())
        yield GaugeMetricFamily(M.RING_EPOCH, "Ring epoch the sidecar routes by", value=s.pool.ring.epoch)
        yield CounterMetricFamily(M.POOL_ERRORS, "Failed pool calls", value=s.pool.errors)
        yield CounterMetricFamily(M.POOL_DEADLINE_MISSES, "Pool calls given up at their deadline",
                                  value=s.pool.deadline_misses)
        yield CounterMetricFamily(M.POOL_CALLS_SKIPPED, "Pool calls not sent: their store node was suspect",
                                  value=s.pool.calls_skipped)
        yield CounterMetricFamily(M.LOCAL_EVICTIONS, "Objects evicted from the local tier",
                                  value=s.counters[SidecarCounter.EVICTED])
        yield CounterMetricFamily(M.POOL_WRITES_SHED, "Pool writes deferred because the backlog was full",
                                  value=s.counters[SidecarCounter.POOL_WRITES_SHED])
        yield CounterMetricFamily(M.POOL_WRITES_BACKOFF,
                                  "Write-through blocks and evicted copies scheduled for another pool write "
                                  "after a passing failure",
                                  value=s.counters[SidecarCounter.POOL_WRITES_BACKOFF])
        yield CounterMetricFamily(M.POOL_WRITES_DROPPED,
                                  "Pool writes given up after their retries or for a full backlog (write-through "
                                  "blocks stay local-only, evicted copies are lost)",
                                  value=s.counters[SidecarCounter.POOL_WRITES_DROPPED])


def record_put(tenant: str, nbytes: int, seconds: float) -> None:
    PUT_BYTES.labels(tenant).inc(nbytes)
    LATENCY.labels("put").observe(seconds)


def serve(port: int, sidecar: Any, addr: str = "0.0.0.0") -> metrics_http.MetricsServer | None:
    """Serve the process's registry on ``addr:port`` (``metrics_http.EPHEMERAL``: any free port;
    0: none), with ``sidecar``'s collector in it (one sidecar per process)."""
    if port == 0:
        return None
    REGISTRY.register(_StateCollector(sidecar))
    return metrics_http.serve(port, addr, REGISTRY)
