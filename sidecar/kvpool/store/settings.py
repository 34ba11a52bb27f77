"""Settings of one store node (from the CLI or the operator's ConfigMap: :mod:`kvpool.store.config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.core import ranges
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS, DEFAULT_TTL_SECONDS
from kvpool.store.tenants import DEFAULT_TENANT


@dataclass
class NodeConfig:
    """Settings of one store node (from the CLI or the operator's ConfigMap)."""

    node_id: str = "store-0"
    dram_bytes: int = 256 << 20
    """Payload capacity of the DRAM arena."""
    ssd_path: str = ""
    ssd_bytes: int = 0
    sharedfs_path: str = ""
    shm_dir: str = "/dev/shm"
    high_watermark: float = 0.95
    """Eviction starts when an admission would take a tier above this fraction..."""
    low_watermark: float = 0.85
    """...and frees down to this fraction (batching evictions)."""
    ttl_seconds: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TTL_SECONDS))
    default_ttl: float = DEFAULT_TTL_SECONDS[DEFAULT_TRAFFIC_CLASS]
    reservation_seconds: float = 30.0
    """An uncommitted reservation expires after this long (a dead writer leaves nothing)."""
    reservation_seconds_max: float = 300.0
    """Upper bound of a writer's own ``timeout_ms``: a reservation cannot hold space for days."""
    commit_grace_seconds: float = 1.0
    """How long a commit waits for writes to its slots that are still in flight before it
    refuses them (a writer must wait for its transfers; this only absorbs the race between a
    transport's completion and its guard release)."""
    lease_ms_default: int = 5000
    lease_ms_max: int = 60000
    max_object_bytes: int = 64 << 20
    verify_on_commit: bool | None = None
    """Hash what a writer committed before it becomes visible (one pass over the bytes, outside
    the index lock).  ``None`` = automatic: on as soon as the node has tenants with tokens,
    because a writer that commits a slot without writing it would otherwise publish the
    previous occupant's bytes — possibly another tenant's — under a checksum it guessed."""
    open_tenancy: bool = True
    """Calls without a token act as the default tenant (dev/local pools)."""
    max_range_bytes: int = ranges.DEFAULT_MAX_BYTES
    """Bytes one ranged read (data-session GET_RANGES) may move; keys past it are INVALID."""
    max_ranges_per_key: int = ranges.MAX_RANGES_PER_KEY
    """Ranges of one key in one ranged read; more is INVALID for that key."""
    events: Any = None
    """A ``kvpool.wire.kv_events.EventsConfig``: publish the stored/removed blocks of ``events_tenant``."""
    events_tenant: str = DEFAULT_TENANT
    """The one tenant whose events a node publishes (ZMQ PUB authenticates nobody: give a
    tenant's router its own endpoint, reachable by it only)."""
    master_key: bytes = field(default=b"", repr=False)
    """Master key of encryption at rest (from ``--master-key-file``): objects on the SSD and
    shared-filesystem tiers are sealed per tenant (``kvpool.tiers.atrest``).  Empty: in the clear."""
    previous_master_keys: list[bytes] = field(default_factory=list, repr=False)
    """Earlier master keys, still opened (never used to seal): what they sealed stays readable."""
    master_key_file: str = ""
    previous_master_keys_file: str = ""
    """Where the keys came from: re-read when they change (a rotated Secret), see ``keywatch``."""
    master_key_reload_seconds: float = 10.0
    """How often the key files are checked for a change (0: never)."""
    tier_read_seconds: float = 0.25
    """Bound of the SSD/shared-fs reads a read call waits for (promotion to DRAM): what has not
    arrived by then is a miss of that call, so a slow or hung disk never stalls a reader."""
    gone_keys: int = 65536
    """Keys whose drop or refusal the node remembers, to tell a lookup's miss reason (evicted,
    expired, quota) from "absent" (:mod:`kvpool.store.gone`; 0: every miss is absent)."""
    demote_wait_seconds: float = 0.5
    """How long a write that needs DRAM waits for demotions to the SSD (with the index lock
    released); then what does not fit is NO_SPACE: a slow disk sheds writes, never blocks reads."""
    fault_tier_delay_file: str = ""
    """Test hook (``--fault-tier-delay-file``): while this file exists, every SSD/shared-fs read,
    write, stat and unlink sleeps the seconds it holds (``tiers.FaultDelay``).  Not for production."""
    rdma: str = ""
    """RDMA device of the node (``--rdma``): ``auto``, ``off``, ``device:<name>`` or
    ``sim:<dir>`` (:func:`kvpool.transfer.rdma.open_context`; "" = ``$KVPOOL_RDMA``, else
    ``auto``).  With one, the DRAM arena is registered and sidecars read it one-sided
    (:mod:`kvpool.store.rdma`)."""
    rdma_shared_tenants: bool = False
    """Serve RDMA on a node several tenants share (``--rdma-shared-tenants``): one rkey spans the
    whole arena, so only for tenants that trust each other."""
