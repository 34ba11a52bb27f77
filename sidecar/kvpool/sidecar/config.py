"""Settings of one sidecar: :class:`SidecarConfig`, the one place each default is defined.

The command line (:mod:`kvpool.sidecar.main`) takes its defaults from here, and the operator's
pool-deadline defaults are checked against them (``tests/kvpool_operator/test_injection.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.core.deadlines import Deadlines
from kvpool.wire.kv_events import EventsConfig
from kvpool.wire.tls import TlsConfig


@dataclass
class SidecarConfig:
    """Settings of one sidecar."""

    socket: str
    """Path of the unix socket the client connects to; the arena is created beside it."""
    pool: list[str] = field(default_factory=list)
    """Seed addresses of store nodes (empty: local tier only)."""
    local_bytes: int = 256 << 20
    """Payload capacity of the local tier (``--local``)."""
    tenant_id: str = "default"
    """The tenant this sidecar serves (``--tenant`` or the mounted credentials)."""
    token: str = ""
    """The tenant's token at the store nodes (from the mounted credentials)."""
    write_back: bool = False
    """Blocks reach the pool on local eviction instead of right after the put."""
    drain_seconds: float = 20.0
    """How long SIGTERM's flush of local-only objects may take."""
    ring_poll_seconds: float = 5.0
    """Ask the nodes for the ring at least this often (one GetRing per node, concurrently)."""
    lease_ms: int = 10000
    """Lease of a match or read when the client asks for none."""
    max_lease_ms: int = 60000
    """Longest lease a client may ask for (a lease pins local-tier space)."""
    max_pending_bytes: int = 0
    """Write-through backlog above which new pool writes are shed (0: a quarter of the local tier)."""
    metrics_port: int = 0
    """Port of the Prometheus endpoint (0: none; ``kvpool.wire.metrics_http.EPHEMERAL``: any free one)."""
    metrics_addr: str = "0.0.0.0"
    """Address the Prometheus endpoint listens on."""
    arena_dir: str = ""
    """Directory of the shared-memory arena ("" : beside the socket); it must be memory-backed
    (tmpfs), else every write to the arena dirties disk pages."""
    events: EventsConfig | None = None
    """Publish the local tier's stored/removed events for KV-aware routers (``kvpool.wire.kv_events``)."""
    handoff_listen: str = ""
    """``host:port`` of the transfer port that exports state objects to decode sidecars (prefill →
    decode handoff); "" exports none (records then send the decode side to the pool)."""
    handoff_advertise: str = ""
    """The address decode sidecars reach that port at (default: the bound address)."""
    handoff_key: bytes = b""
    """Secret signing handoff records, shared by the tenant's sidecars (default: the tenant token)."""
    tls: TlsConfig | None = None
    """This sidecar's certificate (its tenant's identity, :func:`kvpool.core.pki.tenant`), key and
    the pool's CA bundle: the store nodes are verified against it and see the certificate; the
    handoff port serves TLS and exports only to sidecars of this tenant.  None: plaintext."""
    max_handoff_hold_ms: int = 120_000
    """Longest a state object stays exported (the export pins local-tier space)."""
    transition_seconds: float = 600.0
    """How long after a ring change reads that miss look where keys used to live (``Pool``)."""
    copy_over_bytes: int = -1
    """Bound of the copy-over queue (blocks found at a previous owner, written to the new one):
    -1 an eighth of the local tier, 0 off."""
    max_registered_bytes: int = 1 << 40
    """Client memory (``Client.alloc_buffer``) the sidecar maps at most, over all connections; a
    registration beyond it is refused (the client then reads through the arena)."""
    pool_write_yield_ms: int = 50
    """Longest the pool writer holds a write-through batch back while puts are being served
    (one seen in the last few ms): the write and the engine's next put compete for the same
    cores, and the put is what the engine waits for.  Under sustained puts the backlog then
    grows and sheds (``max_pending_bytes``) rather than slow the puts; 0: never held back."""
    pool_write_retries: int = 10
    """Retries of a write-through block, or of an evicted object's copy, whose pool write failed
    for a passing reason (busy or unreachable owner, another writer's reservation, ...:
    ``kvpool.core.retry``), with doubling delays (0.2 s up to 5 s: about 30 s in all); then it
    is counted as dropped (a block stays local-only, a copy is lost)."""
    match_deadline_ms: int = 100
    """Deadline of a match or exists at one store node (``--match-deadline-ms``): a node that
    has not answered by then is given up for this call (its keys are misses) and is suspect."""
    read_deadline_ms: int = 100
    """Base deadline of a read from one store node (``--read-deadline-ms``): until the node says
    what it sends, and then plus the payload at ``read_bytes_per_second``."""
    read_bytes_per_second: int = 100_000_000
    """Bandwidth floor a read's payload is given time for (``--read-bytes-per-second``)."""
    probe_deadline_ms: int = 1000
    """How long a probe of a suspect node waits (``--probe-deadline-ms``; in the background)."""
    suspect_backoff_ms: int = 1000
    """Back-off after a failed probe before the next one (doubling up to 8x;
    ``--suspect-backoff-ms``).  The first probe goes out right after the failure."""

    def deadlines(self) -> Deadlines:
        """The pool's per-call deadlines (:class:`kvpool.core.deadlines.Deadlines`)."""
        return Deadlines(self.match_deadline_ms / 1000.0, self.read_deadline_ms / 1000.0,
                         float(self.read_bytes_per_second), self.probe_deadline_ms / 1000.0)

    def lease(self, asked_ms: int) -> int:
        """The lease a call gets when it asks for ``asked_ms`` (0: the default), bounded."""
        return min(asked_ms or self.lease_ms, self.max_lease_ms)


DEFAULTS = SidecarConfig(socket="")
"""Every default, for the command line's options (one definition: the fields above)."""
