"""Prometheus metrics of the sidecar (prometheus-client).

Labels are per tenant and tier, never per key.  Gauges are computed at scrape time from the
sidecar's state (a collector), so the hot path only bumps counters and observes histograms.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool.wire.counters import SidecarCounter

LOOKUP_BLOCKS = Counter("kvpool_lookup_blocks_total", "Blocks asked for by match calls", ["tenant"])
HIT_BLOCKS = Counter("kvpool_hit_blocks_total", "Blocks matched (block-weighted hits)", ["tenant", "tier"])
READ_BLOCKS = Counter("kvpool_read_blocks_total", "Blocks read", ["tenant", "tier"])
READ_BYTES = Counter("kvpool_read_bytes_total", "Bytes handed to the engine", ["tenant"])
PUT_BYTES = Counter("kvpool_put_bytes_total", "Bytes written by the engine", ["tenant"])
POOL_BYTES_OUT = Counter("kvpool_pool_bytes_out_total", "Bytes written to the pool", ["tenant"])
POOL_BYTES_IN = Counter("kvpool_pool_bytes_in_total", "Bytes fetched from the pool into the local tier", ["tenant"])
LATENCY = Histogram("kvpool_op_seconds", "Latency of sidecar operations", ["op"],
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


class _StateCollector(Collector):
    def __init__(self, sidecar: Any) -> None:
        self.sidecar = sidecar

    def collect(self) -> Any:
        s = self.sidecar
        yield GaugeMetricFamily("kvpool_local_used_bytes", "Local tier bytes in use", value=s.local.used)
        yield GaugeMetricFamily("kvpool_local_capacity_bytes", "Local tier capacity", value=s.local.capacity)
        yield GaugeMetricFamily("kvpool_pool_nodes_up", "Store nodes reachable", value=s.pool.nodes_up())
        yield GaugeMetricFamily("kvpool_local_objects", "Objects in the local tier", value=s.local.objects())
        yield GaugeMetricFamily("kvpool_pool_pending_bytes", "Bytes waiting to be written to the pool",
                                value=s.backlog_bytes())
        yield GaugeMetricFamily("kvpool_ring_epoch", "Ring epoch the sidecar routes by", value=s.pool.ring.epoch)
        yield CounterMetricFamily("kvpool_pool_errors", "Failed pool calls", value=s.pool.errors)
        yield CounterMetricFamily("kvpool_pool_deadline_misses", "Pool calls given up at their deadline",
                                  value=s.pool.deadline_misses)
        yield CounterMetricFamily("kvpool_pool_calls_skipped", "Pool calls not sent: their store node was suspect",
                                  value=s.pool.calls_skipped)
        yield CounterMetricFamily("kvpool_local_evictions", "Objects evicted from the local tier",
                                  value=s.counters[SidecarCounter.EVICTED])
        yield CounterMetricFamily("kvpool_pool_writes_shed", "Pool writes deferred because the backlog was full",
                                  value=s.counters[SidecarCounter.POOL_WRITES_SHED])
        yield CounterMetricFamily("kvpool_pool_writes_backoff",
                                  "Write-through blocks and evicted copies scheduled for another pool write "
                                  "after a passing failure",
                                  value=s.counters[SidecarCounter.POOL_WRITES_BACKOFF])
        yield CounterMetricFamily("kvpool_pool_writes_dropped",
                                  "Pool writes given up after their retries or for a full backlog (write-through "
                                  "blocks stay local-only, evicted copies are lost)",
                                  value=s.counters[SidecarCounter.POOL_WRITES_DROPPED])


def record_put(tenant: str, nbytes: int, seconds: float) -> None:
    PUT_BYTES.labels(tenant).inc(nbytes)
    LATENCY.labels("put").observe(seconds)


def serve(port: int, sidecar: Any, addr: str = "0.0.0.0") -> None:
    REGISTRY.register(_StateCollector(sidecar))
    start_http_server(port, addr=addr)
