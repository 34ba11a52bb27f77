"""The counter names of the store node and the sidecar: one typed schema, the wire's contract.

A store node sends its counters in ``StoreStats.counters`` (and a tenant's share of them in each
``TenantStats.counters``), a sidecar in ``SidecarStats.counters``: ``map<string, uint64>`` whose
keys are the values of :class:`StoreCounter` and :class:`SidecarCounter`.  The code bumps
``counters[StoreCounter.STORED]`` (a ``StrEnum`` member is its own string, so the protobuf map,
``Counter[str]`` and a reader's ``.get("stored")`` all see the same key); the operator, the
sidecar's metrics, the benchmarks and the tests read them through these names too.

Some names are built from a per-item code or an outcome: those families have a function here
(:func:`pool_write_failed`, :func:`handoff_refused`, :func:`handoff_state`,
:func:`copyover_result`) that only ever returns a name of the schema.  ``tests/kvpool/
test_counters.py`` fails when a process sends a name :func:`is_store_counter` /
:func:`is_sidecar_counter` does not know, and when a literal ``counters["name"]`` creeps back in.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

from kvpool.core.errors import Code
from kvpool.core.handoff_record import StateOutcome
from kvpool.core.retry import UNREACHABLE


class StoreCounter(enum.StrEnum):
    """Counters of a store node (``StoreStats.counters``); the ones in :data:`TENANT_COUNTERS`
    are also kept per tenant (``TenantStats.counters``)."""

    # -- writes (two-phase: reserve, then commit or revoke)
    STORED = "stored"
    """Objects committed (per tenant too)."""
    STORED_BYTES = "stored_bytes"
    """Payload bytes committed (per tenant too)."""
    DUPLICATES = "duplicates"
    """Reservations answered ALREADY_EXISTS: the key was committed already."""
    REVOKED = "revoked"
    """Reservations revoked by their writer (PutRevoke, or a revoke at commit)."""
    RESERVATIONS_EXPIRED = "reservations_expired"
    """Reservations dropped because their writer never committed them in time."""
    PUT_ORDER_WAITED_OUT = "put_order_waited_out"
    """Parts of a batch split over several data connections whose earlier part never came in
    time: reserved out of batch order."""
    CHECKSUM_FAILURES = "checksum_failures"
    """Objects whose bytes did not match their checksum (at commit, or read back from a lower
    tier); the object is dropped (per tenant too)."""

    # -- refusals (a per-item code other than OK)
    REFUSED_SPACE = "refused_space"
    """Reservations refused NO_SPACE: nothing could be evicted to make room (per tenant too)."""
    REFUSED_QUOTA = "refused_quota"
    """Reservations refused QUOTA_EXCEEDED (per tenant too)."""
    REFUSED_WRONG_OWNER = "refused_wrong_owner"
    """Keys refused WRONG_OWNER: this node does not own them in its ring epoch."""

    # -- reads
    LOOKUP_BLOCKS = "lookup_blocks"
    """Blocks asked for by match/exists/read (a match-then-read counts each block once; per tenant
    too)."""
    HIT_BLOCKS = "hit_blocks"
    """Of those, blocks found (the prefix that matched; per tenant too, and by tier: :func:`tier_hits`)."""
    GET_BLOCKS = "get_blocks"
    """Blocks asked for by reads."""
    GET_HITS = "get_hits"
    """Of those, blocks served."""
    BYTES_SENT = "bytes_sent"
    """Payload bytes of the objects handed to readers (gets; per tenant too).  Ranged reads count
    what they moved in ``range_bytes_sent``."""
    LEASES_EXPIRED = "leases_expired"
    """Read leases (pins) that ran out before their reader released them."""
    RANGE_READS = "range_reads"
    """Keys asked for by ranged reads."""
    RANGE_HITS = "range_hits"
    """Of those, keys served."""
    RANGE_BYTES_SENT = "range_bytes_sent"
    """Bytes of the ranges sent (what a sparse read moved, against the objects' sizes; per tenant too)."""

    # -- RDMA (kvpool.store.rdma): one-sided reads by sidecars
    RDMA_CONNECTS = "rdma_connects"
    """Queue pairs connected to a sidecar's (ConnectRdma)."""
    RDMA_HOLDS = "rdma_holds"
    """Holds granted for one-sided reads (HoldExtents that found something)."""
    RDMA_HOLDS_EXPIRED = "rdma_holds_expired"
    """Holds that ran out before their reader released them."""
    RDMA_RESERVATIONS = "rdma_reservations"
    """Reservations made for one-sided writes (ReserveRdma that reserved something)."""

    # -- removal and eviction
    REMOVED = "removed"
    """Objects removed by a Remove call."""
    EVICTED = "evicted"
    """Objects evicted to make room (LRU; per tenant too)."""
    EVICTED_QUOTA = "evicted_quota"
    """Objects of a tenant evicted to bring it back under its quota or share (per tenant too)."""
    EXPIRED = "expired"
    """Objects dropped because their traffic class's TTL passed (per tenant too)."""

    # -- tiers (promotion, demotion, encryption at rest)
    DEMOTED = "demoted"
    """Objects moved down a tier (DRAM to SSD, SSD to shared fs)."""
    PROMOTED = "promoted"
    """Objects moved up into DRAM for a read."""
    DEMOTIONS_REQUESTED = "demotions_requested"
    """Demotions started because a Demote call asked (the rest of ``demoted`` made room)."""
    DEMOTIONS_ABANDONED = "demotions_abandoned"
    """Demotions given up (the object changed or the tier failed while it was moving)."""
    DEMOTE_WAITS_TIMED_OUT = "demote_waits_timed_out"
    """Reservations that waited for a demotion to free DRAM until their deadline."""
    TIER_STAT_TIMEOUTS = "tier_stat_timeouts"
    """Tier usage probes (statfs of a disk tier) that did not answer in time."""
    SEALED = "sealed"
    """Objects encrypted at rest on their way down from DRAM."""
    AT_REST_AUTH_FAILURES = "at_rest_auth_failures"
    """Objects on a disk tier whose at-rest tag did not authenticate (tampered, truncated, sealed
    for another tenant or key): dropped (per tenant too)."""
    AT_REST_PREVIOUS_KEY_OPENS = "at_rest_previous_key_opens"
    """Objects opened with a previous master key (key rotation in progress)."""
    MASTER_KEY_RELOADS = "master_key_reloads"
    """Master key files re-read after a change (key rotation)."""
    MASTER_KEY_RELOAD_ERRORS = "master_key_reload_errors"
    """Master key files that changed but did not parse: the node keeps its keys."""


class SidecarCounter(enum.StrEnum):
    """Counters of a sidecar (``SidecarStats.counters``).  Some are gauges read from their owner
    at Stats time (``Sidecar.stats``), not bumped."""

    # -- the engine's calls
    MATCH_CALLS = "match_calls"
    """Match calls."""
    LOOKUP_BLOCKS = "lookup_blocks"
    """Blocks asked for by match calls."""
    HIT_BLOCKS_LOCAL = "hit_blocks_local"
    """Of those, matched in the local tier."""
    HIT_BLOCKS_POOL = "hit_blocks_pool"
    """Of those, matched in the pool."""
    READ_BLOCKS = "read_blocks"
    """Blocks asked for by reads."""
    READ_HITS_LOCAL = "read_hits_local"
    """Of those, read from the local tier."""
    READ_HITS_POOL = "read_hits_pool"
    """Of those, fetched from the pool."""
    READ_MISSES = "read_misses"
    """Of those, found nowhere."""
    RESTORED_BYTES_LOCAL = "restored_bytes_local"
    """Bytes handed to the engine by reads from the local tier (restored, not recomputed)."""
    RESTORED_BYTES_POOL = "restored_bytes_pool"
    """Bytes handed to the engine by reads fetched from the pool."""
    READ_NO_ROOM = "read_no_room"
    """Blocks found in the pool that a read could not land: the local tier had no room."""
    READ_STASH_HITS = "read_stash_hits"
    """Blocks a read copied straight into the client's registered memory."""
    RANGE_READS = "range_reads"
    """Keys asked for by ranged reads."""
    RANGE_HITS_LOCAL = "range_hits_local"
    """Of those, served from the local tier."""
    RANGE_HITS_POOL = "range_hits_pool"
    """Of those, served from the pool."""
    RANGE_BYTES_LOCAL = "range_bytes_local"
    """Bytes of ranges served from the local tier."""
    RANGE_BYTES_POOL = "range_bytes_pool"
    """Bytes of ranges fetched from the pool."""
    PUT_BLOCKS = "put_blocks"
    """Blocks written by the engine."""
    PUT_SPILLED_ROUNDS = "put_spilled_rounds"
    """Puts that did not fit the local tier and went to the pool in rounds."""
    PUT_STREAMED = "put_streamed"
    """Blocks a put streamed to the pool directly (no room in the local tier)."""

    # -- RDMA reads from store nodes (kvpool.pool.rdma_path); a fallback goes over TCP
    RDMA_CONNECTS = "rdma_connects"
    """Queue pairs connected to store nodes."""
    RDMA_READS = "rdma_reads"
    """Objects read one-sided (RDMA READ) and verified."""
    RDMA_READ_BYTES = "rdma_read_bytes"
    """Their bytes."""
    RDMA_WRITES = "rdma_writes"
    """Objects written one-sided (RDMA WRITE into a reserved extent, then committed)."""
    RDMA_WRITE_BYTES = "rdma_write_bytes"
    """Their bytes."""
    RDMA_FALLBACK_NO_LOCAL_DEVICE = "rdma_fallback_no_local_device"
    """Store nodes read over TCP because this sidecar has no RDMA device (once per node client)."""
    RDMA_FALLBACK_NO_REMOTE_DEVICE = "rdma_fallback_no_remote_device"
    """Store nodes read over TCP because they advertise no RDMA device (once per check)."""
    RDMA_FALLBACK_CONNECT_FAILED = "rdma_fallback_connect_failed"
    """Connections to a store node's RDMA side that failed (TCP until the next try)."""
    RDMA_FALLBACK_HOLD_FAILED = "rdma_fallback_hold_failed"
    """Reads whose HoldExtents call, or writes whose ReserveRdma call, failed: the batch went
    over TCP."""
    RDMA_FALLBACK_TRANSFER_FAILED = "rdma_fallback_transfer_failed"
    """Objects whose one-sided transfer failed (a broken queue pair): moved over TCP instead."""
    RDMA_FALLBACK_CHECKSUM = "rdma_fallback_checksum"
    """Objects whose one-sided bytes did not match their checksum: re-read over TCP."""

    # -- the local tier
    STORED = "stored"
    """Objects committed to the local tier."""
    REFUSED_SPACE = "refused_space"
    """Local reservations refused: nothing could be evicted to make room."""
    RESERVATIONS_EXPIRED = "reservations_expired"
    """Local reservations never committed in time."""
    EVICTED = "evicted"
    """Objects evicted from the local tier."""

    # -- pool reads
    POOL_FETCH_FAILURES = "pool_fetch_failures"
    """Blocks matched in the pool whose fetch failed (counted as misses)."""
    POOL_CHECKSUM_FAILURES = "pool_checksum_failures"
    """Of those, blocks whose bytes did not match their checksum."""

    # -- pool writes (write-through and write-back, retries)
    POOL_WRITES = "pool_writes"
    """Objects the pool took (OK or ALREADY_EXISTS)."""
    POOL_WRITES_SHED = "pool_writes_shed"
    """Pool writes deferred because the backlog was full."""
    POOL_WRITES_HELD_BACK = "pool_writes_held_back"
    """Write-through batches the pool writer held back while puts were being served (they
    compete for the same cores: ``SidecarConfig.pool_write_yield_ms``)."""
    POOL_WRITES_RETRIED = "pool_writes_retried"
    """Pool writes queued again (after a ring change or a passing failure)."""
    POOL_WRITES_BACKOFF = "pool_writes_backoff"
    """Pool writes scheduled for another try after a passing failure."""
    POOL_WRITES_DROPPED = "pool_writes_dropped"
    """Pool writes given up: write-through blocks stay local-only, evicted copies are lost."""

    # -- copy-over of blocks found at a previous owner after a ring change
    POOL_COPYOVER_QUEUED = "pool_copyover_queued"
    """Blocks queued to be copied to their new owner."""
    POOL_COPYOVER_SHED = "pool_copyover_shed"
    """Blocks not queued: the copy-over queue was full."""
    POOL_COPYOVER_DUPLICATE = "pool_copyover_duplicate"
    """Blocks not queued: already in the queue."""
    POOL_COPYOVER_WRITTEN = "pool_copyover_written"
    """Blocks copied to their new owner."""
    POOL_COPYOVER_PRESENT = "pool_copyover_present"
    """Blocks the new owner already held."""
    POOL_COPYOVER_FAILED = "pool_copyover_failed"
    """Blocks whose copy failed (the warm-up push covers them)."""

    # -- prefill -> decode handoff
    HANDOFFS_PUBLISHED = "handoffs_published"
    """Handoff records signed by this (prefill) sidecar."""
    HANDOFFS_ACCEPTED = "handoffs_accepted"
    """Handoff records accepted by this (decode) sidecar."""
    HANDOFF_STATE_CHECKSUM_FAILURES = "handoff_state_checksum_failures"
    """State objects fetched from the prefill peer whose checksum did not match."""

    # -- restart (adoption of the arena a previous process left)
    RESTART_ARENA_RESET = "restart_arena_reset"
    """1 when the arena could not be adopted and the local tier started empty."""
    RESTART_ADOPTED_OBJECTS = "restart_adopted_objects"
    """Objects adopted from the previous process's arena."""
    RESTART_ADOPTED_BYTES = "restart_adopted_bytes"
    """Their bytes."""
    RESTART_DROPPED_CHECKSUM = "restart_dropped_checksum"
    """Objects dropped at adoption: torn (checksum mismatch)."""
    RESTART_DROPPED_UNCOMMITTED = "restart_dropped_uncommitted"
    """Objects dropped at adoption: reserved, never committed."""
    RESTART_DROPPED_INCOHERENT = "restart_dropped_incoherent"
    """Objects dropped at adoption: journal and arena disagree."""
    RESTART_DROPPED_OBJECTS = "restart_dropped_objects"
    """All objects dropped at adoption (the three above)."""
    RESTART_QUARANTINED_BYTES = "restart_quarantined_bytes"
    """Bytes held back at adoption until the previous process's clients are gone."""
    RESTART_RESUMED_POOL_WRITES = "restart_resumed_pool_writes"
    """Adopted objects not yet in the pool whose pool writes were resumed."""

    # -- gauges of the pool client, read at Stats time
    POOL_ERRORS = "pool_errors"
    """Failed calls to store nodes."""
    POOL_MATCH_RELEASES_SENT = "pool_match_releases_sent"
    """Releases of match leases sent to store nodes."""
    POOL_MATCH_RELEASES_CARRIED = "pool_match_releases_carried"
    """Releases of match leases carried on a later call instead."""
    POOL_DEADLINE_MISSES = "pool_deadline_misses"
    """Calls to a store node that missed their deadline."""
    POOL_CALLS_SKIPPED = "pool_calls_skipped"
    """Calls not made: their store node was suspect."""
    POOL_PROBES_OK = "pool_probes_ok"
    """Probes of a suspect store node that let it back in."""
    POOL_PROBES_FAILED = "pool_probes_failed"
    """Probes of a suspect store node that failed."""
    LOCAL_ONLY_OBJECTS = "local_only_objects"
    """Objects in the local tier the pool does not hold (yet)."""
    RING_TRANSITION = "ring_transition"
    """1 while a ring change is recent: missing keys are looked for at their previous owners."""
    POOL_COPYOVER_QUEUED_BYTES = "pool_copyover_queued_bytes"
    """Bytes in the copy-over queue."""


class EventsCounter(enum.StrEnum):
    """Counters of the KV-events publisher (``kv_events.EventPublisher.counters``), of either
    process; not sent in Stats."""

    BATCHES = "batches"
    """Event batches published."""
    EVENTS = "events"
    """Events published."""
    REPLAYS = "replays"
    """Replay requests answered."""
    REPLAY_MALFORMED = "replay_malformed"
    """Replay requests that did not parse."""
    SNAPSHOTS = "snapshots"
    """Snapshots sent."""
    ERRORS = "errors"
    """Publish errors."""


class FetchDecisionCounter(enum.StrEnum):
    """The fetch-or-recompute decision of an engine integration (vLLM connector, SGLang backend,
    LMCache connector), in the integration's own stats (``kvpool.integrations.crossover``); not
    sent in Stats.  Counted per lookup (a request whose allocation vLLM retries is looked up again)."""

    LOADED = "loaded"
    """Lookups whose match was loaded (above the crossover, or ``fetch_decision: always``)."""
    LOADED_TOKENS = "loaded_tokens"
    """Tokens of those."""
    RECOMPUTED_CHEAPER = "recomputed_cheaper"
    """Lookups whose match was recomputed: below the crossover (recomputing was faster)."""
    RECOMPUTED_CHEAPER_TOKENS = "recomputed_cheaper_tokens"
    """Tokens of those (in the pool, not loaded)."""
    RECOMPUTED_MISSING = "recomputed_missing"
    """Lookups that found nothing to load (not in the pool beyond what the engine had)."""

class MissReason(enum.StrEnum):
    """Why a block asked for was not loaded: the ``reason`` label of the miss counters (the store
    node's ``kvpool_store_miss_blocks``, the sidecar's ``kvpool_miss_blocks``; the engine's
    recomputed-because-cheaper is ``FetchDecisionCounter.RECOMPUTED_CHEAPER``).  Each process counts
    the reasons it knows, each miss once: a store node the ones of its lookups, a sidecar the ones
    the store never sees."""

    ABSENT = "absent"
    """Never written here, or gone for a reason no longer remembered (store)."""
    EXPIRED = "expired"
    """Dropped because its TTL passed (store: a recently dropped key)."""
    EVICTED = "evicted"
    """Evicted to make room (store: a recently evicted key)."""
    QUOTA = "quota"
    """Its write was refused, or it was evicted, for its tenant's quota (store)."""
    CHECKSUM = "checksum"
    """Its bytes failed their checksum or at-rest authentication (store: read back from a lower
    tier; sidecar: fetched over the wire)."""
    NODE_DOWN = "node_down"
    """Its node (sidecar) or lower tier (store) did not answer in time, or was down."""
    NO_ROOM = "no_room"
    """Found in the pool, but the sidecar's local tier had no room to land it (sidecar)."""
    RECOMPUTED_CHEAPER = "recomputed_cheaper"
    """Matched, but the engine recomputed it: cheaper than loading (engine integration)."""


MISS_PREFIX = "miss_"
"""``miss_<reason>``: blocks a store node's lookups missed, by :class:`MissReason` (in
``StoreStats.counters`` and ``TenantStats.counters``)."""


def miss_reason(reason: MissReason) -> str:
    """The store counter of blocks missed for ``reason`` (``miss_<reason>``)."""
    return MISS_PREFIX + MissReason(reason).value


# ------------------------------------------------------------------------------ groups

TENANT_COUNTERS: frozenset[StoreCounter] = frozenset({
    StoreCounter.STORED, StoreCounter.STORED_BYTES, StoreCounter.BYTES_SENT, StoreCounter.RANGE_BYTES_SENT,
    StoreCounter.LOOKUP_BLOCKS,
    StoreCounter.HIT_BLOCKS, StoreCounter.REFUSED_SPACE, StoreCounter.REFUSED_QUOTA, StoreCounter.EVICTED,
    StoreCounter.EVICTED_QUOTA, StoreCounter.EXPIRED, StoreCounter.CHECKSUM_FAILURES,
    StoreCounter.AT_REST_AUTH_FAILURES})
"""The store counters also kept per tenant (``TenantStats.counters``), besides the families
:func:`tier_hits` and :func:`miss_reason`."""

REFUSALS: tuple[StoreCounter, ...] = (StoreCounter.REFUSED_QUOTA,)
"""What the operator sums into a tenant's ``refusals`` (TenantNamespace status)."""

EVICTIONS: tuple[StoreCounter, ...] = (StoreCounter.EVICTED, StoreCounter.EVICTED_QUOTA, StoreCounter.EXPIRED)
"""What the operator sums into a tenant's ``evictions`` (TenantNamespace status)."""

RESTART: tuple[SidecarCounter, ...] = tuple(c for c in SidecarCounter if c.startswith("restart_"))
"""What a sidecar's restart (arena adoption) reports."""


# ------------------------------------------------------------------- built names (families)

def _code_name(code: int) -> str:
    return "unreachable" if code == UNREACHABLE else Code(code).name.lower()


POOL_WRITE_PREFIX = "pool_write_"
"""``pool_write_<code>``: sidecar pool writes that failed, by per-item code (``unreachable``: the
node did not answer)."""
POOL_WRITE_CODES: frozenset[str] = frozenset(
    {_code_name(c) for c in Code if c not in (Code.OK, Code.ALREADY_EXISTS)} | {"unreachable"})

HANDOFFS_REFUSED_PREFIX = "handoffs_refused_"
"""``handoffs_refused_<code>``: handoff records a decode sidecar refused, by code."""
HANDOFF_REFUSED_CODES: frozenset[str] = frozenset(_code_name(c) for c in Code if c != Code.OK)

HANDOFF_STATE_PREFIX = "handoff_state_"
"""``handoff_state_<outcome>``: accepted handoffs by where their state object came from."""
HANDOFF_STATES: frozenset[str] = frozenset(o.name.lower() for o in StateOutcome)


TIER_HITS_PREFIX = "hits_"
"""``hits_<tier>``: store blocks found by lookups, by the tier they were found in (per tenant too)."""
TIER_NAMES: frozenset[str] = frozenset({"dram", "ssd", "sharedfs"})

STORE_MISS_REASONS: frozenset[MissReason] = frozenset({
    MissReason.ABSENT, MissReason.EXPIRED, MissReason.EVICTED, MissReason.QUOTA, MissReason.CHECKSUM,
    MissReason.NODE_DOWN})
"""The miss reasons a store node counts (``miss_<reason>``, per tenant too)."""
SIDECAR_MISS_REASONS: frozenset[MissReason] = frozenset({MissReason.NODE_DOWN, MissReason.CHECKSUM,
                                                         MissReason.NO_ROOM})
"""The miss reasons a sidecar counts (the ones its store nodes never see), from its counters at
scrape time (``kvpool.sidecar.metrics.misses``)."""


def tier_hits(tier: str) -> str:
    """The store counter of blocks found in ``tier`` (a name of :data:`TIER_NAMES`)."""
    if tier not in TIER_NAMES:
        raise ValueError(f"unknown tier {tier!r}")
    return TIER_HITS_PREFIX + tier


def pool_write_failed(code: int) -> str:
    """The sidecar counter of a pool write that failed with ``code`` (or ``UNREACHABLE``)."""
    return POOL_WRITE_PREFIX + _code_name(code)


def handoff_refused(code: int) -> str:
    """The sidecar counter of a handoff record refused with ``code``."""
    return HANDOFFS_REFUSED_PREFIX + _code_name(code)


def handoff_state(outcome: StateOutcome) -> str:
    """The sidecar counter of an accepted handoff whose state object came from ``outcome``."""
    return HANDOFF_STATE_PREFIX + StateOutcome(outcome).name.lower()


def copyover_result(code: int) -> SidecarCounter:
    """The sidecar counter of one block's copy-over to its new owner, by the owner's code."""
    if code == Code.OK:
        return SidecarCounter.POOL_COPYOVER_WRITTEN
    if code == Code.ALREADY_EXISTS:
        return SidecarCounter.POOL_COPYOVER_PRESENT
    return SidecarCounter.POOL_COPYOVER_FAILED


# ------------------------------------------------------------------------------ checks

_STORE_NAMES = frozenset(c.value for c in StoreCounter)
_SIDECAR_NAMES = frozenset(c.value for c in SidecarCounter)


def is_store_counter(name: str) -> bool:
    """Whether a store node may send ``name``."""
    if name in _STORE_NAMES:
        return True
    if name.startswith(TIER_HITS_PREFIX):
        return name[len(TIER_HITS_PREFIX):] in TIER_NAMES
    return name.startswith(MISS_PREFIX) and name[len(MISS_PREFIX):] in STORE_MISS_REASONS


def is_tenant_counter(name: str) -> bool:
    """Whether a store node may send ``name`` in a tenant's counters (``TenantStats.counters``):
    :data:`TENANT_COUNTERS` and the families :func:`tier_hits`, :func:`miss_reason`."""
    return name in TENANT_COUNTERS or (name not in _STORE_NAMES and is_store_counter(name))


def is_sidecar_counter(name: str) -> bool:
    """Whether a sidecar may send ``name``."""
    if name in _SIDECAR_NAMES:
        return True
    for prefix, suffixes in ((POOL_WRITE_PREFIX, POOL_WRITE_CODES), (HANDOFFS_REFUSED_PREFIX, HANDOFF_REFUSED_CODES),
                             (HANDOFF_STATE_PREFIX, HANDOFF_STATES)):
        if name.startswith(prefix) and name[len(prefix):] in suffixes:
            return True
    return False


def unknown(names: Iterable[str], known: type[StoreCounter] | type[SidecarCounter]) -> list[str]:
    """The names that are not in the schema of ``known``'s process."""
    check = is_store_counter if known is StoreCounter else is_sidecar_counter
    return sorted(n for n in names if not check(n))


def total(counters: Mapping[str, int], names: Iterable[str]) -> int:
    """The sum of ``names`` in ``counters`` (a name that was never bumped counts 0)."""
    return sum(int(counters.get(n, 0)) for n in names)
