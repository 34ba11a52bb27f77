"""The Prometheus metric names of the store node, the sidecar and the engine integrations: one place.

``docs/metrics.md`` lists every family with its type and labels; the chart's dashboard and alert
rules are written against these names, so a rename is a contract change (change the doc with it).
Store nodes serve :class:`StoreMetric` (``kvpool.store.metrics``), sidecars :class:`SidecarMetric`
(``kvpool.sidecar.metrics``), an engine process that runs an integration :class:`EngineMetric`.
Label values come from typed enums too: :class:`~kvpool.wire.counters.MissReason`,
:class:`EvictionReason`, :class:`RefusalReason`, :class:`DemotionReason`, :class:`PushState`;
the ``tenant`` label is bounded (:data:`OTHER_TENANT`).

A family whose type is a counter is named here without the ``_total`` suffix prometheus-client
appends (``kvpool_store_hit_blocks`` is scraped as ``kvpool_store_hit_blocks_total``).
"""

from __future__ import annotations

import enum

OTHER_TENANT = "_other"
"""The ``tenant`` label of every tenant that is not configured (revoked, unknown, anonymous):
one value, so the label's cardinality is bounded by the configured tenants, never by callers."""


class StoreMetric(enum.StrEnum):
    """Families served by a store node's ``/metrics`` (``kvpool store --metrics-port``)."""

    # -- counters
    LOOKUP_BLOCKS = "kvpool_store_lookup_blocks"
    """{tenant}: blocks asked for by match/read (a match-then-read counts each block once)."""
    HIT_BLOCKS = "kvpool_store_hit_blocks"
    """{tenant, tier}: of those, blocks found, by the tier they were found in (dram, ssd, sharedfs)."""
    BYTES_IN = "kvpool_store_bytes_in"
    """{tenant}: payload bytes committed (written into the pool)."""
    BYTES_OUT = "kvpool_store_bytes_out"
    """{tenant}: payload bytes sent to readers (gets and ranged gets)."""
    MISS_BLOCKS = "kvpool_store_miss_blocks"
    """{tenant, reason}: blocks a lookup did not find, by the reasons a store node knows
    (:class:`~kvpool.wire.counters.MissReason`: absent, expired, evicted, quota, checksum, node_down
    for a lower tier that did not answer in time)."""
    OBJECTS_STORED = "kvpool_store_objects_stored"
    """{tenant}: objects committed."""
    EVICTIONS = "kvpool_store_evictions"
    """{tenant, reason}: objects dropped to make room or by policy (:class:`EvictionReason`)."""
    DEMOTIONS = "kvpool_store_demotions"
    """{reason}: objects moved down a tier (:class:`DemotionReason`)."""
    PROMOTIONS = "kvpool_store_promotions"
    """Objects moved up into DRAM for a read."""
    QUOTA_REFUSALS = "kvpool_store_quota_refusals"
    """{tenant}: writes refused QUOTA_EXCEEDED."""
    REFUSALS = "kvpool_store_refusals"
    """{reason}: writes refused, by :class:`RefusalReason` (node-wide)."""
    EVENTS = "kvpool_store_events"
    """{event}: every store counter of ``StoreStats.counters`` (event = a ``StoreCounter`` value)."""
    # -- gauges (read at scrape time)
    TIER_CAPACITY_BYTES = "kvpool_store_tier_capacity_bytes"
    """{tier}: capacity of a tier (DRAM arena payload capacity, SSD bytes)."""
    TIER_USED_BYTES = "kvpool_store_tier_used_bytes"
    """{tier}: bytes in use."""
    TIER_OBJECTS = "kvpool_store_tier_objects"
    """{tier}: objects held."""
    TENANT_USED_BYTES = "kvpool_store_tenant_used_bytes"
    """{tenant}: bytes a tenant holds here (counted against its quota)."""
    TENANT_QUOTA_BYTES = "kvpool_store_tenant_quota_bytes"
    """{tenant}: the tenant's quota for the whole pool (0: none)."""
    TENANT_SHARE_BYTES = "kvpool_store_tenant_share_bytes"
    """{tenant}: this node's share of that quota under its ring (0: none)."""
    TENANT_OBJECTS = "kvpool_store_tenant_objects"
    """{tenant}: objects a tenant holds here."""
    LEASES = "kvpool_store_leases"
    """Read leases (pins) alive."""
    RESERVATIONS = "kvpool_store_reservations"
    """Write reservations alive (reserved, not yet committed or revoked)."""
    DRAINING = "kvpool_store_draining"
    """1 while the node is draining (its ring marks it so), else 0."""
    RING_EPOCH = "kvpool_store_ring_epoch"
    """The ring epoch the node serves by."""
    INFO = "kvpool_store_info"
    """{node_id}: always 1 (joins a scrape target to its ring member)."""
    DRAIN_RUNNING = "kvpool_store_drain_running"
    """1 while a drain pushes objects, else 0."""
    DRAIN_OBJECTS = "kvpool_store_drain_objects"
    """{state}: objects of the current/last drain, by :class:`PushState` (moved, dropped, remaining)."""
    DRAIN_BYTES = "kvpool_store_drain_bytes"
    """{state}: bytes of the current/last drain (moved, dropped)."""
    DRAIN_DEADLINE = "kvpool_store_drain_deadline_timestamp_seconds"
    """Unix time the current/last drain must end by (0: none)."""
    WARM_RUNNING = "kvpool_store_warm_running"
    """1 while a warm-up pushes objects to new members, else 0."""
    WARM_OBJECTS = "kvpool_store_warm_objects"
    """{state}: objects of the current/last warm-up (planned, moved, skipped, failed, remaining)."""
    WARM_BYTES = "kvpool_store_warm_bytes"
    """{state}: bytes of the current/last warm-up (planned, moved, skipped)."""
    # -- histogram
    OP_SECONDS = "kvpool_store_op_seconds"
    """{op}: latency of a data-session request (exists, get, get_ranges, put), timed per request."""


class SidecarMetric(enum.StrEnum):
    """Families served by a sidecar's ``/metrics`` (``--metrics-port``, on by default when injected)."""

    LOOKUP_BLOCKS = "kvpool_lookup_blocks"
    """{tenant}: counter, blocks asked for by match calls."""
    HIT_BLOCKS = "kvpool_hit_blocks"
    """{tenant, tier}: counter, blocks matched, tier local or pool."""
    READ_BLOCKS = "kvpool_read_blocks"
    """{tenant, tier}: counter, blocks read, tier local or pool."""
    READ_BYTES = "kvpool_read_bytes"
    """{tenant}: counter, bytes handed to the engine."""
    PUT_BYTES = "kvpool_put_bytes"
    """{tenant}: counter, bytes written by the engine."""
    POOL_BYTES_OUT = "kvpool_pool_bytes_out"
    """{tenant}: counter, bytes written to the pool."""
    POOL_BYTES_IN = "kvpool_pool_bytes_in"
    """{tenant}: counter, bytes fetched from the pool."""
    RESTORED_BYTES = "kvpool_restored_bytes"
    """{tenant, source}: counter, bytes loaded into the engine by reads, source local or pool (the
    "useful restore" against ``kvpool_pool_bytes_out``: writing alone proves no reuse)."""
    MISS_BLOCKS = "kvpool_miss_blocks"
    """{tenant, reason}: counter, blocks the engine asked for and did not get, by the reasons a
    sidecar knows (:class:`~kvpool.wire.counters.MissReason`: node_down, checksum, no_room); the store
    nodes count the reasons they know in ``kvpool_store_miss_blocks``."""
    EVENTS = "kvpool_sidecar_events"
    """{event}: counter, every sidecar counter of ``SidecarStats.counters`` (event = its name)."""
    OP_SECONDS = "kvpool_op_seconds"
    """{op}: histogram, latency of match, read and put."""
    LOCAL_USED_BYTES = "kvpool_local_used_bytes"
    LOCAL_CAPACITY_BYTES = "kvpool_local_capacity_bytes"
    LOCAL_OBJECTS = "kvpool_local_objects"
    POOL_NODES_UP = "kvpool_pool_nodes_up"
    POOL_PENDING_BYTES = "kvpool_pool_pending_bytes"
    RING_EPOCH = "kvpool_ring_epoch"
    POOL_ERRORS = "kvpool_pool_errors"
    POOL_DEADLINE_MISSES = "kvpool_pool_deadline_misses"
    POOL_CALLS_SKIPPED = "kvpool_pool_calls_skipped"
    LOCAL_EVICTIONS = "kvpool_local_evictions"
    POOL_WRITES_SHED = "kvpool_pool_writes_shed"
    POOL_WRITES_BACKOFF = "kvpool_pool_writes_backoff"
    POOL_WRITES_DROPPED = "kvpool_pool_writes_dropped"



class EngineMetric(enum.StrEnum):
    """Families an engine integration registers in its process's default registry (served by the
    engine's own ``/metrics``, e.g. vLLM's API server), from ``FetchDecisionCounter``."""

    FETCH_DECISIONS = "kvpool_engine_fetch_decisions"
    """{decision}: counter, lookups by decision (loaded, recomputed_cheaper, recomputed_missing)."""
    FETCH_DECISION_TOKENS = "kvpool_engine_fetch_decision_tokens"
    """{decision}: counter, their tokens (loaded, recomputed_cheaper)."""


class TlsMetric(enum.StrEnum):
    """Families of the pool's TLS (issue 23 part 1): the chart's KVPoolCertificateNearExpiry alert
    and the dashboard read them (charts/kvpool/files)."""

    CERTIFICATE_EXPIRY = "kvpool_certificate_expiry_timestamp_seconds"
    """{pool_namespace, pool, kind}: gauge (the operator's), unix time a certificate of the pool expires
    (kind: ``ca``, the earliest of the trusted bundle, ``serving``, ``client``, ``router``)."""


class EvictionReason(enum.StrEnum):
    """``reason`` of ``kvpool_store_evictions``."""

    LRU = "lru"
    """Least recently used, to make room."""
    QUOTA = "quota"
    """The tenant's own, to bring it under its quota or share."""
    EXPIRED = "expired"
    """Its traffic class's TTL passed."""


class DemotionReason(enum.StrEnum):
    """``reason`` of ``kvpool_store_demotions``."""

    PRESSURE = "pressure"
    """Moved down to make room in DRAM."""
    REQUESTED = "requested"
    """Moved down because a Demote call asked (a sidecar's hint)."""


class RefusalReason(enum.StrEnum):
    """``reason`` of ``kvpool_store_refusals``."""

    QUOTA = "quota"
    SPACE = "space"
    WRONG_OWNER = "wrong_owner"


class PushState(enum.StrEnum):
    """``state`` of the drain and warm-up gauges."""

    PLANNED = "planned"
    MOVED = "moved"
    SKIPPED = "skipped"
    DROPPED = "dropped"
    FAILED = "failed"
    REMAINING = "remaining"
