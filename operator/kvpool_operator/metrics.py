"""Prometheus metrics of the operator (scraped from ``--metrics-port``).

Low-cardinality labels only: the resource kind and an outcome, never an object name.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvpool.wire.metric_names import TlsMetric

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter("kvpool_operator_reconciles_total", "Reconciles by resource kind and result",
                     ["kind", "result"], registry=REGISTRY)
RECONCILE_SECONDS = Histogram("kvpool_operator_reconcile_seconds", "Time of one reconcile", ["kind"],
                              registry=REGISTRY)
ERRORS = Counter("kvpool_operator_errors_total", "Reconcile errors by resource kind and error class",
                 ["kind", "error"], registry=REGISTRY)
DRAINS = Counter("kvpool_operator_drains_total", "Scale-down drains by result (Started, Completed, "
                 "DeadlineExceeded, Cancelled)", ["result"], registry=REGISTRY)
DRAIN_MOVED_BYTES = Counter("kvpool_operator_drain_moved_bytes_total", "Bytes moved by completed drains",
                            registry=REGISTRY)
DRAIN_DROPPED_BYTES = Counter("kvpool_operator_drain_dropped_bytes_total", "Bytes dropped by completed drains",
                              registry=REGISTRY)
REBALANCES = Counter("kvpool_operator_rebalances_total", "Scale-up rebalances (warm-up pushes) by result "
                     "(Started, Completed, DeadlineExceeded, Cancelled)", ["result"], registry=REGISTRY)
INJECTIONS = Counter("kvpool_operator_injections_total", "Admission decisions on pods by reason (Injected or the "
                     "skip reason)", ["reason"], registry=REGISTRY)
SCALE_DOWN_BLOCKED = Counter("kvpool_operator_scale_down_blocked_total", "Scale-downs refused", registry=REGISTRY)
CERT_EXPIRY = Gauge(TlsMetric.CERTIFICATE_EXPIRY, "Unix time a certificate of the pool expires (kind: ca, the "
                    "earliest of the trusted bundle; serving, the store nodes'; client, the operator's; router)",
                    ["pool_namespace", "pool", "kind"], registry=REGISTRY)
"""Labelled with the KVPool's namespace and name as the store and sidecar series are (the scrape's
``namespace`` is the operator pod's own)."""
POOLS = Gauge("kvpool_operator_pools", "KVPools this operator reconciles", registry=REGISTRY)


def serve(port: int, addr: str = "0.0.0.0") -> Any:
    """Serve ``/metrics`` (port 0: not at all); returns the server (``shutdown()`` then
    ``server_close()`` stop it)."""
    if not port:
        return None
    server, _ = start_http_server(port, addr=addr, registry=REGISTRY)
    return server
