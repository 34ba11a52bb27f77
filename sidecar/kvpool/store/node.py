"""The store node's state machine: index, two-phase writes, leases, eviction, quota, tiers.

This module is transport-free: the gRPC services (``data_service.py``, ``admin_service.py``) adapt protobuf to these
methods, the transfer server moves bytes into the offsets they hand out and calls the
:class:`StoreNode` as its :class:`~kvpool.transfer.Guard` (so a recycled slot is never read and
an expired reservation is never written).  One lock guards the index; no bytes are copied and
no tier below DRAM is read or written while holding it (moves between tiers: ``demoter``).

Index: tenant → key → :class:`Entry`.  Each tenant has its own partition, so the same key of two
tenants names two different objects.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.arena.allocator import OutOfSpace
from kvpool.arena.dram import DramTier
from kvpool.arena.eviction import choose_victims, is_expired, watermark_need
from kvpool.core import ranges
from kvpool.core.checksum import checksum
from kvpool.core.errors import InvalidArgument
from kvpool.core.ring import Ring, stale_wrong_owner
from kvpool.core.sizing import payload_arena_bytes
from kvpool.store.quota import Held, ring_share, trim_to_share
from kvpool.tiers.atrest import AtRest, sealed_size
from kvpool.tiers.base import FaultDelay
from kvpool.tiers.chain import FsView, TierMover
from kvpool.tiers.sharedfs import SharedFsHeader, SharedFsTier
from kvpool.tiers.ssd import SsdTier
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.store")

DAY = 86400.0
DEFAULT_TTL = {"agent": 3 * DAY, "chatbot": 7 * DAY}
DEFAULT_TENANT = "default"

RESERVED, COMMITTED, COMMITTING = 0, 1, 2
KINDS = (pb.BLOCK, pb.STATE)


def index_key(key: bytes, kind: int) -> bytes:
    """Key of an entry in its tenant's partition: a block and a state object may share a key."""
    return key if kind == pb.BLOCK else key + b"\x01"


def check_kind(kind: int) -> int:
    if kind not in KINDS:
        raise InvalidArgument(f"unknown object kind {kind}")
    return kind


class Entry:
    """One object in the index.  Per object, never per byte."""

    __slots__ = ("key", "tenant", "kind", "traffic_class", "size", "checksum", "tier", "offset",
                 "token", "last_access", "state", "pins", "inflight", "expires", "on_fs", "gen", "moving")

    def __init__(self, key: bytes, tenant: str, kind: int, traffic_class: str, size: int) -> None:
        self.key = key
        self.tenant = tenant
        self.kind = kind
        self.traffic_class = traffic_class
        self.size = size
        self.checksum = 0
        self.tier = "dram"
        self.offset = -1
        self.token = 0
        self.last_access = time.time()
        self.state = RESERVED
        self.pins = 0
        self.inflight = 0
        self.expires = 0.0  # reservation expiry (RESERVED only)
        self.on_fs = False  # a copy exists on the shared-filesystem tier (removed with the object)
        self.gen = 0  # generation its SSD copy was sealed under (encryption at rest)
        self.moving = 0  # a tier move in progress (demoter.DEMOTING / PROMOTING)


Promoted = tuple[dict[int, int], list["Entry"]]
"""What a read's promotion left: id(entry) → code of the failed ones, and the entries it pinned."""


@dataclass
class Tenant:
    tenant_id: str
    token: str = ""
    salt: bytes = b""
    quota_bytes: int = 0
    """The tenant's limit for the whole pool (logical bytes); 0 = none."""
    ttl_seconds: dict[str, float] = field(default_factory=dict)
    evict_own_on_quota: bool = False
    share_bytes: int = 0
    """What this node admits of the quota under its ring (:func:`kvpool.store.quota.ring_share`)."""
    used_bytes: int = 0
    objects: int = 0
    counters: Counter[str] = field(default_factory=Counter)


@dataclass
class Lease:
    lease_id: int
    expires: float
    entries: list[Entry]
    tenant: str = DEFAULT_TENANT
    read_tokens: list[int] = field(default_factory=list)
    """Transfer tokens issued under this lease (Get): they die with it, so a read after the
    lease expired is refused by the guard even when the object is still in place."""


@dataclass
class Reservation:
    reservation_id: int
    tenant: str
    entries: list[Entry | None]
    expires: float


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
    ttl_seconds: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TTL))
    default_ttl: float = 7 * DAY
    reservation_seconds: float = 30.0
    reservation_seconds_max: float = 300.0
    """Upper bound of a writer's own ``timeout_ms``: a reservation cannot hold space for days."""
    commit_grace_seconds: float = 1.0
    """How long a commit waits for writes to its slots that are still in flight before it
    refuses them (a writer must wait for its transfers; this only absorbs the race between a
    transport's completion and its guard release)."""
    """An uncommitted reservation expires after this long (a dead writer leaves nothing)."""
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
    data_session: bool = True
    """Serve the one-round-trip binary data session (get, put, exists) on the transfer port
    beside the gRPC API; off, clients use the gRPC calls (the compatibility path)."""
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
    demote_wait_seconds: float = 0.5
    """How long a write that needs DRAM waits for demotions to the SSD (with the index lock
    released); then what does not fit is NO_SPACE: a slow disk sheds writes, never blocks reads."""
    fault_tier_delay_file: str = ""
    """Test hook (``--fault-tier-delay-file``): while this file exists, every SSD/shared-fs read,
    write, stat and unlink sleeps the seconds it holds (``tiers.FaultDelay``).  Not for production."""


class StoreNode:
    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        # dram_bytes is a payload capacity: that much fits before eviction starts at the high watermark.
        self.dram = DramTier(payload_arena_bytes(cfg.dram_bytes, cfg.high_watermark), cfg.shm_dir, label=cfg.node_id)
        fault = FaultDelay(cfg.fault_tier_delay_file)
        self.ssd = (SsdTier(cfg.ssd_path, cfg.ssd_bytes, cfg.node_id, fault=fault)
                    if cfg.ssd_path and cfg.ssd_bytes else None)
        self.sharedfs = SharedFsTier(cfg.sharedfs_path, fault=fault) if cfg.sharedfs_path else None
        self.at_rest = AtRest(cfg.master_key, cfg.previous_master_keys) if cfg.master_key else None
        self.events: Any = None  # a kvpool.wire.kv_events.EventPublisher, set by the service when configured
        self.lock = threading.RLock()
        self._released = threading.Condition(self.lock)  # signalled when a reserved slot's write ends
        self.index: dict[str, dict[bytes, Entry]] = {}
        # Committed block objects only, per tenant: the match fast path is one C-level map over
        # this dict (a reserved or state entry must never count as a hit).
        self.blocks: dict[str, dict[bytes, Entry]] = {}
        self.lru_dram: OrderedDict[int, Entry] = OrderedDict()  # id(entry) → entry, oldest first
        self.lru_ssd: OrderedDict[int, Entry] = OrderedDict()
        self.by_token: dict[int, Entry] = {}  # write/generation token → entry
        self.read_tokens: dict[int, tuple[Entry, Lease]] = {}  # lease-scoped read token → entry
        self.leases: dict[int, Lease] = {}
        # Match leases whose pins are not yet counted into their entries (every other lease's
        # are): see _settle_pins.
        self._uncounted: dict[int, Lease] = {}
        self._lease_heap: list[tuple[float, int]] = []
        self.reservations: dict[int, Reservation] = {}
        self._res_heap: list[tuple[float, int]] = []
        self.tenants: dict[str, Tenant] = {DEFAULT_TENANT: Tenant(DEFAULT_TENANT)}
        self.token_to_tenant: dict[str, str] = {}
        self.counters: Counter[str] = Counter()
        self.ring = Ring(epoch=0)
        self.draining = False
        # This life of the node: lease and reservation ids start at a random base, so an id held
        # across a restart (a writer between reserve and commit, a matcher holding a lease) names
        # nothing here, instead of whatever this life issued under the same number.
        self.incarnation = 1 + secrets.randbits(62)
        self._first_id = 1 + secrets.randbits(62)
        self._ids = itertools.count(self._first_id)
        self._last_id = self._first_id - 1
        self.ssd_used = 0
        # Moves between tiers, outside the lock; None without a tier below DRAM (evictions drop).
        self.mover = TierMover(self) if self.ssd is not None or self.sharedfs is not None else None

    # ------------------------------------------------------------------ tenancy

    def authenticate(self, token: str) -> str | None:
        """Tenant id for a token; None when the token is unknown (the caller refuses)."""
        if not token:
            return DEFAULT_TENANT if self.cfg.open_tenancy else None
        return self.token_to_tenant.get(token)

    def set_tenants(self, configs: Sequence[Tenant], replace: bool = False) -> None:
        with self.lock:
            listed = {c.tenant_id for c in configs}
            if replace:
                for tid in list(self.tenants):
                    if tid not in listed and tid != DEFAULT_TENANT:
                        self._revoke_tenant(tid)
            for c in configs:
                t = self.tenants.get(c.tenant_id)
                if t is None:
                    t = self.tenants[c.tenant_id] = Tenant(c.tenant_id)
                if t.token and t.token != c.token:
                    self.token_to_tenant.pop(t.token, None)
                t.token, t.salt, t.quota_bytes = c.token, c.salt, c.quota_bytes
                t.share_bytes = ring_share(c.quota_bytes, self.ring)
                t.ttl_seconds = dict(c.ttl_seconds)
                t.evict_own_on_quota = c.evict_own_on_quota
                if c.token:
                    self.token_to_tenant[c.token] = c.tenant_id

    def _revoke_tenant(self, tid: str) -> None:
        t = self.tenants.get(tid)
        if t is None:
            return
        self.token_to_tenant.pop(t.token, None)
        t.token = ""
        # Objects stay until evicted, but nobody can reach them any more without a token.

    def set_policy(self, ttl: dict[str, float], high: float, low: float) -> None:
        with self.lock:
            if ttl:
                self.cfg.ttl_seconds = dict(ttl)
            if 0 < low < high <= 1:
                self.cfg.high_watermark, self.cfg.low_watermark = high, low

    def _ttl_for(self, e: Entry) -> float:
        t = self.tenants.get(e.tenant)
        if t and e.traffic_class in t.ttl_seconds:
            return t.ttl_seconds[e.traffic_class]
        return self.cfg.ttl_seconds.get(e.traffic_class, self.cfg.default_ttl)

    def _fs_salt(self, tid: str) -> bytes:
        """Key of the shared-fs file names of a tenant.  The tenant id is always mixed in: two
        tenants configured without a salt must still never name (and so read) each other's files."""
        return b"kvpool-tenant\0" + tid.encode() + b"\0" + self._tenant(tid).salt

    def _tenant(self, tid: str) -> Tenant:
        t = self.tenants.get(tid)
        if t is None:
            t = self.tenants[tid] = Tenant(tid)
        return t

    # ------------------------------------------------------------------ housekeeping

    def _new_token(self) -> int:
        """A random 63-bit transfer token.

        Random, not sequential: the transfer port does not know tenants, so a token is the only
        thing between a peer and a slot; one tenant's tokens must say nothing about another's
        (and a token from before a restart matches nothing).
        """
        while True:
            t = secrets.randbits(63)
            if t and t not in self.by_token and t not in self.read_tokens:
                return t

    def _next_id(self) -> int:
        self._last_id = next(self._ids)
        return self._last_id

    def _sweep(self, now: float) -> None:
        """Drop expired leases and reservations (cheap: heaps ordered by expiry)."""
        while self._lease_heap and self._lease_heap[0][0] <= now:
            _, lid = heapq.heappop(self._lease_heap)
            lease = self.leases.get(lid)
            if lease is not None and lease.expires <= now:
                self._drop_lease(lease)
                self.counters["leases_expired"] += 1
        while self._res_heap and self._res_heap[0][0] <= now:
            _, rid = heapq.heappop(self._res_heap)
            res = self.reservations.pop(rid, None)
            if res is not None:
                for e in res.entries:
                    if e is not None and e.state == RESERVED:
                        self._discard(e)
                        self.counters["reservations_expired"] += 1

    def _drop_lease(self, lease: Lease) -> None:
        if self.leases.pop(lease.lease_id, None) is None:
            return
        if self._uncounted.pop(lease.lease_id, None) is None:
            for e in lease.entries:
                e.pins -= 1
        for t in lease.read_tokens:
            self.read_tokens.pop(t, None)
        # lease.read_tokens stays as it is: a Get reply may still be assembled from it (outside
        # the lock); those tokens are dead, so the reply is well-formed and its reads fail closed.

    def _lease_expiry(self, lease_ms: int, now: float) -> float:
        return now + min(lease_ms or self.cfg.lease_ms_default, self.cfg.lease_ms_max) / 1000.0

    def _register_lease(self, lease: Lease) -> Lease:
        self.leases[lease.lease_id] = lease
        heapq.heappush(self._lease_heap, (lease.expires, lease.lease_id))
        return lease

    def _new_lease(self, entries: list[Entry], lease_ms: int, now: float, tenant: str = DEFAULT_TENANT) -> Lease:
        """A match lease over ``entries``, its pins counted lazily (:meth:`_settle_pins`)."""
        lease = Lease(self._next_id(), self._lease_expiry(lease_ms, now), entries, tenant)
        self._uncounted[lease.lease_id] = lease
        return self._register_lease(lease)

    def _settle_pins(self) -> None:
        """Count the pins of the match leases not counted yet.  Caller holds the lock.

        A match pins thousands of objects and is usually released within milliseconds, before
        anything asks whether an object is pinned: counting its pins on creation and again on
        release was two thirds of an Exists of 2048 keys.  So a match lease is only recorded,
        and whatever decides on ``pins`` (eviction, expiry, removal) settles first: ``pins`` is
        exact whenever it is read."""
        if not self._uncounted:
            return
        for lease in self._uncounted.values():
            for e in lease.entries:
                e.pins += 1
        self._uncounted.clear()

    # ------------------------------------------------------------------ lookups

    def _lookup(self, part: dict[bytes, Entry], tenant: str, key: bytes, kind: int,
                fs: FsView | None = None) -> Entry | None:
        """The committed object of ``key``, or one adopted from ``fs``: the headers of the
        shared-fs files of unknown keys, read without the lock (:meth:`_stat_sharedfs`)."""
        e = part.get(index_key(key, kind))
        if e is not None and e.state == COMMITTED and e.kind == kind:
            return e
        if e is None and fs is not None and kind == pb.BLOCK:
            hdr = fs.headers.get(key)
            if hdr is not None:
                return self._adopt_sharedfs(tenant, key, hdr, fs.since)
        return None

    def _stat_sharedfs(self, tenant: str, keys: list[bytes], kind: int,
                       prefix_only: bool) -> FsView | None:
        """Headers of the shared-fs files of those ``keys`` this node does not hold, read without
        the lock for at most ``tier_read_seconds`` (``TierMover.stat_files``; what is not read by
        then is a miss); with ``prefix_only`` up to the first key with no file."""
        if self.sharedfs is None or self.mover is None or kind != pb.BLOCK:
            return None
        with self.lock:
            part = self.index.get(tenant, {})
            missing = [k for k in keys if part.get(k) is None]
            salt = self._fs_salt(tenant) if missing else b""
        if not missing:
            return None
        return self.mover.stat_files(salt, missing, prefix_only, self.cfg.tier_read_seconds)

    def _adopt_sharedfs(self, tenant: str, key: bytes, hdr: SharedFsHeader, since: float) -> Entry | None:
        """A shared-filesystem object written by any node (or a previous life) becomes known;
        ``hdr``: its header, read off the lock from ``since``."""
        assert self.sharedfs is not None and self.mover is not None
        if hdr.kind != pb.BLOCK or not self.mover.may_adopt(tenant, key, since):
            return None  # the file of an object removed here (its unlink on its way, or done since)
        if hdr.sealed != (self.at_rest is not None):
            # A file in the clear is not trusted by an encrypting node (anyone with write access
            # to the mount could have planted it); a sealed one cannot be opened without a key.
            return None
        if not 0 < hdr.size <= min(self.cfg.max_object_bytes, self.dram.capacity):
            return None  # a damaged header must not make the node evict DRAM for a phantom
        e = Entry(key, tenant, hdr.kind, "", hdr.size)
        e.state, e.tier, e.checksum, e.on_fs = COMMITTED, "sharedfs", hdr.checksum, True  # sealed: 0, set on open
        self._tenant(tenant).objects += 1
        self.index.setdefault(tenant, {})[key] = e
        self.blocks.setdefault(tenant, {})[key] = e
        return e

    def exists(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK, prefix_only: bool = True,
               pin: bool = False, lease_ms: int = 0) -> tuple[int, bytes, Lease | None]:
        """Longest present prefix and per-key presence; optionally pin the prefix."""
        check_kind(kind)
        fs = self._stat_sharedfs(tenant, keys, kind, prefix_only)
        now = time.time()
        with self.lock:
            self._sweep(now)
            if self.sharedfs is None and kind == pb.BLOCK:
                # Fast path: C-level map over the committed blocks; the prefix ends at the first
                # None.  No per-key Python: matching reads metadata only and does not touch the
                # LRU (the Get that follows a match does).
                found: list[Entry | None] = list(map(self.blocks.get(tenant, {}).get, keys))
                # all() tests truthiness (an Entry is always true), ~3x cheaper than index(None)'s
                # rich comparison per item; the usual answer is "all present".
                prefix = len(found) if all(found) else found.index(None)
                if prefix_only:
                    present = bytearray(b"\x01" * prefix + b"\x00" * (len(keys) - prefix))
                else:
                    present = bytearray(e is not None for e in found)
                hits: list[Entry] = found[:prefix]  # type: ignore[assignment]
            else:
                part = self.index.get(tenant, {})
                present = bytearray(len(keys))
                prefix = 0
                hits = []
                for i, k in enumerate(keys):
                    e = self._lookup(part, tenant, k, kind, fs)
                    if e is None or e.state != COMMITTED or e.kind != kind:
                        if prefix_only:
                            break
                        continue
                    present[i] = 1
                    if prefix == i:
                        prefix += 1
                    hits.append(e)
                for e in hits:
                    e.last_access = now
                    if e.tier == "dram":
                        self.lru_dram.move_to_end(id(e))
            self._count_lookup(len(keys), prefix)  # the matched prefix are the hits
            lease = self._new_lease(hits[:prefix], lease_ms, now, tenant) if pin and prefix else None
            return prefix, bytes(present), lease

    # ------------------------------------------------------------------ writes

    def put_start(self, tenant: str, keys: list[bytes], sizes: Sequence[int], traffic_class: str,
                  kind: int, timeout_ms: int = 0, epoch: int = 0) -> tuple[list[pb.Code], list[int], list[int], int]:
        """Reserve space for each item: per-item codes, offsets, tokens and a reservation id.

        ``epoch``: the ring epoch the caller routed by (0: unknown); under an older one than
        this node's, the keys this node does not own are WRONG_OWNER (:func:`stale_wrong_owner`).
        """
        if len(keys) != len(sizes):
            raise InvalidArgument(f"{len(keys)} keys but {len(sizes)} sizes")
        check_kind(kind)
        now = time.time()
        codes = [pb.OK] * len(keys)
        # Outside the lock (the ring is replaced whole, never changed in place); when the
        # caller routed by our epoch (or knows none) this is one comparison.
        foreign = stale_wrong_owner(self.ring, self.node_id, epoch, keys, single_copy=kind == pb.STATE)
        if foreign is not None and not foreign.any():
            foreign = None
        offsets = [0] * len(keys)
        tokens = [0] * len(keys)
        entries: list[Entry | None] = [None] * len(keys)
        if self.mover is not None:
            self._make_room(tenant, keys, sizes, kind)
        with self.lock:
            self._sweep(now)
            if self.draining:
                return [pb.DRAINING] * len(keys), offsets, tokens, 0
            if foreign is not None:
                self.counters["refused_wrong_owner"] += int(foreign.sum())
            t = self._tenant(tenant)
            part = self.index.setdefault(tenant, {})
            # Batch admission: make room once for the whole batch (watermarks), then allocate.
            incoming = 0
            seen: set[bytes] = set()
            for i, (k, size) in enumerate(zip(keys, sizes, strict=True)):
                old = part.get(index_key(k, kind))
                if foreign is not None and foreign[i]:
                    codes[i] = pb.WRONG_OWNER  # even when held here: its owner is where readers look
                elif size <= 0 or len(k) != 32:
                    codes[i] = pb.INVALID
                elif size > self.cfg.max_object_bytes or self.dram.alloc.rounded(size) > self.dram.capacity:
                    codes[i] = pb.TOO_LARGE
                elif k in seen:
                    codes[i] = pb.INVALID  # duplicate key inside one batch
                elif old is not None and old.state == COMMITTED:
                    codes[i] = pb.ALREADY_EXISTS
                    old.last_access = now
                    self.counters["duplicates"] += 1
                elif old is not None:
                    codes[i] = pb.IN_FLIGHT
                else:
                    seen.add(k)
                    incoming += self.dram.alloc.rounded(size)
            self._admit_quota(t, keys, sizes, codes, now)
            incoming = sum(self.dram.alloc.rounded(s) for s, c in zip(sizes, codes, strict=True) if c == pb.OK)
            need = watermark_need(self.dram.alloc.used - self._pending_demotions(), incoming, self.dram.capacity,
                                  self.cfg.high_watermark, self.cfg.low_watermark)
            if need:
                self._evict_dram(need, now)
            evictable = True
            for i, (k, size) in enumerate(zip(keys, sizes, strict=True)):
                if codes[i] != pb.OK:
                    continue
                try:
                    # Once eviction found nothing to free, the rest of the batch only tries the
                    # free list: a huge batch against a pinned arena must not cost items x objects.
                    off = self._alloc_dram(size, now) if evictable else self.dram.alloc.alloc(size)
                except OutOfSpace:
                    evictable = False
                    codes[i] = pb.NO_SPACE
                    self.counters["refused_space"] += 1
                    t.counters["refused_space"] += 1
                    continue
                e = Entry(k, tenant, kind, traffic_class, size)
                e.offset = off
                e.token = self._new_token()
                e.expires = now + (min(timeout_ms / 1000.0, self.cfg.reservation_seconds_max) if timeout_ms
                                   else self.cfg.reservation_seconds)
                part[index_key(k, kind)] = e
                self.by_token[e.token] = e
                t.used_bytes += size
                offsets[i], tokens[i], entries[i] = off, e.token, e
            rid = 0
            if any(e is not None for e in entries):
                rid = self._next_id()
                expires = max(e.expires for e in entries if e is not None)
                self.reservations[rid] = Reservation(rid, tenant, entries, expires)
                heapq.heappush(self._res_heap, (expires, rid))
            return codes, offsets, tokens, rid

    def _pending_demotions(self) -> int:
        """DRAM bytes on their way down (still allocated; freed when their copies land)."""
        return self.mover.pending_bytes if self.mover is not None else 0

    def _make_room(self, tenant: str, keys: list[bytes], sizes: Sequence[int], kind: int) -> None:
        """Before a write reserves: start the demotions its new objects need, then wait for them
        at most ``demote_wait_seconds`` with the lock released (``demoter.TierMover.make_room``).
        The reservation that follows takes what fits; the rest is NO_SPACE."""
        assert self.mover is not None
        with self.lock:
            part = self.index.get(tenant, {})
            cap = min(self.cfg.max_object_bytes, self.dram.capacity)
            sizes_new = [self.dram.alloc.rounded(s) for k, s in zip(keys, sizes, strict=True)
                         if 0 < s <= cap and index_key(k, kind) not in part]
        if sizes_new:
            self.mover.make_room(sizes_new, time.monotonic() + self.cfg.demote_wait_seconds)

    def _admit_quota(self, t: Tenant, keys: list[bytes], sizes: Sequence[int], codes: list[pb.Code],
                     now: float) -> None:
        """Refuse (QUOTA_EXCEEDED) the items that would take the tenant past this node's share of
        its pool quota (:mod:`kvpool.store.quota`), evicting its own objects first when it asked."""
        limit = t.share_bytes
        if not limit:
            return
        want = t.used_bytes
        evictable = t.evict_own_on_quota
        for i, size in enumerate(sizes):
            if codes[i] != pb.OK:
                continue
            if want + size > limit and evictable and size <= limit:
                if not self._evict_tenant(t, want + size - limit, now):
                    evictable = False  # nothing of its own left to evict: stop scanning for this batch
                want = t.used_bytes + sum(s for j, s in enumerate(sizes[:i]) if codes[j] == pb.OK)
            if want + size > limit:
                codes[i] = pb.QUOTA_EXCEEDED
                self.counters["refused_quota"] += 1
                t.counters["refused_quota"] += 1
                continue
            want += size

    def _fit_quota_shares(self) -> None:
        """After a ring change (caller holds the lock): each tenant's share under the new ring;
        a tenant now over its share here drops what :func:`kvpool.store.quota.trim_to_share`
        picks (objects this node no longer owns first), so a scale-up does not let the pool
        hold the old shares plus the new node's."""
        me = self.ring.member(self.node_id)
        # A draining node (or one the ring left out) owns nothing and takes no writes: what it
        # holds is on its way to the owners (the drain), not to be dropped here.
        trim = me is not None and me.state == "active"
        for t in self.tenants.values():
            t.share_bytes = ring_share(t.quota_bytes, self.ring)
            if not trim or not t.share_bytes or t.used_bytes <= t.share_bytes:
                continue
            self._settle_pins()
            mine = [e for e in itertools.chain(self.lru_ssd.values(), self.lru_dram.values())
                    if e.tenant == t.tenant_id and e.state == COMMITTED and not e.pins and not e.inflight]
            owned = [False] * len(mine)
            for kind in (pb.BLOCK, pb.STATE):
                idx = [i for i, e in enumerate(mine) if e.kind == kind]
                if idx:
                    got = self.ring.write_owned(self.node_id, [mine[i].key for i in idx],
                                                1 if kind == pb.STATE else None)
                    for i, o in zip(idx, got.tolist(), strict=True):
                        owned[i] = o
            held = [Held(e.size, e.last_access, o) for e, o in zip(mine, owned, strict=True)]
            for i in trim_to_share(t.used_bytes, t.share_bytes, held, t.evict_own_on_quota):
                self._discard(mine[i])
                self.counters["evicted_quota"] += 1
                t.counters["evicted_quota"] += 1

    def _alloc_dram(self, size: int, now: float) -> int:
        try:
            return self.dram.alloc.alloc(size)
        except OutOfSpace:
            pass
        if self._pending_demotions():
            # Demotions are on their way (a slow disk, or room made for another writer): more of
            # them would free nothing now and only push hot objects down.  This write sheds.
            raise OutOfSpace("DRAM full while demotions are in flight")
        # A full or fragmented arena: evict LRU objects (in batches of what this one needs) until a
        # contiguous extent appears or nothing evictable is left.  Free bytes alone are not enough.
        need = self.dram.alloc.rounded(size)
        while True:
            freed = self._evict_dram(need, now, expire_all=False)
            try:
                return self.dram.alloc.alloc(size)
            except OutOfSpace:
                if freed == 0:
                    raise
                need *= 2  # geometric: a badly fragmented arena costs O(log n) passes, not O(n)

    def _verify_commits(self) -> bool:
        v = self.cfg.verify_on_commit
        return bool(self.token_to_tenant) if v is None else v

    def put_commit(self, tenant: str, reservation_id: int, checksums: Sequence[int],
                   revoke: bytes = b"", incarnation: int = 0) -> list[pb.Code]:
        """Commit (or revoke, per item) a reservation.  ``incarnation``: the life that issued it
        (0: unchecked); a reservation of another life is gone: LEASE_EXPIRED, nothing applied."""
        now = time.time()
        if incarnation and incarnation != self.incarnation:
            with self.lock:
                self.counters["refused_other_incarnation"] += 1
            return [pb.LEASE_EXPIRED] * max(len(checksums), 1)
        with self.lock:
            self._sweep(now)
            if not self._first_id <= reservation_id <= self._last_id:
                raise InvalidArgument(f"reservation {reservation_id} was never issued by this life of the node")
            res = self.reservations.get(reservation_id)
            if res is None or res.tenant != tenant:
                return [pb.LEASE_EXPIRED] * max(len(checksums), 1)
            n = len(res.entries)
            if len(checksums) != n:
                raise InvalidArgument(f"{len(checksums)} checksums for {n} items")
            if revoke and len(revoke) != n:
                raise InvalidArgument(f"revoke map of {len(revoke)} bytes for {n} items")
            # A transport may report a write complete a moment before it releases the guard (the
            # response and the release race); give in-flight writes a short grace to finish.
            deadline = time.monotonic() + self.cfg.commit_grace_seconds
            while any(e is not None and e.state == RESERVED and e.inflight for e in res.entries):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._released.wait(left)
            if self.reservations.get(reservation_id) is not res:
                return [pb.LEASE_EXPIRED] * n  # a concurrent commit, revoke or expiry took it
            # From here the reservation is this call's: a concurrent commit sees it gone.
            del self.reservations[reservation_id]
            codes = [pb.OK] * n
            todo: list[int] = []
            for i, e in enumerate(res.entries):
                if e is None:
                    codes[i] = pb.INVALID
                    continue
                if e.state != RESERVED or self.by_token.get(e.token) is not e:
                    codes[i] = pb.LEASE_EXPIRED
                    continue
                if (revoke and revoke[i]) or e.inflight:
                    # A write still in flight at commit means the writer did not wait: refuse.
                    self._discard(e)
                    codes[i] = pb.LEASE_EXPIRED if not (revoke and revoke[i]) else pb.OK
                    if revoke and revoke[i]:
                        self.counters["revoked"] += 1
                    continue
                e.state = COMMITTING  # the guard refuses further writes from now on
                todo.append(i)
            verify = self._verify_commits()
            if not verify:
                self._finish_commits(res, todo, checksums, codes, None, now)
                return codes
            for i in todo:
                e = res.entries[i]
                assert e is not None
                e.inflight += 1  # keeps the extent allocated while it is hashed without the lock
        # Hash outside the lock: a 4 MiB object must not stall every other call of the node.
        sums: dict[int, int] = {}
        for i in todo:
            e = res.entries[i]
            assert e is not None
            sums[i] = checksum(self.dram.slice(e.offset, e.size))
        with self.lock:
            for i in todo:
                e = res.entries[i]
                assert e is not None
                e.inflight -= 1
            self._finish_commits(res, todo, checksums, codes, sums, time.time())
        return codes

    def _finish_commits(self, res: Reservation, todo: list[int], checksums: Sequence[int], codes: list[pb.Code],
                        sums: dict[int, int] | None, now: float) -> None:
        for i in todo:
            e = res.entries[i]
            assert e is not None
            if e.state != COMMITTING:  # discarded meanwhile (e.g. the tenant was revoked)
                codes[i] = pb.LEASE_EXPIRED
                continue
            if sums is not None and sums[i] != checksums[i]:
                self._discard(e)
                codes[i] = pb.CHECKSUM
                self.counters["checksum_failures"] += 1
                self._tenant(e.tenant).counters["checksum_failures"] += 1
                continue
            e.checksum = int(checksums[i])
            e.state = COMMITTED
            if e.kind == pb.BLOCK:
                self.blocks.setdefault(e.tenant, {})[e.key] = e
                if self.events is not None and e.tenant == self.cfg.events_tenant:
                    self.events.stored(e.key)
            e.last_access = now
            self.lru_dram[id(e)] = e
            t = self._tenant(e.tenant)
            t.objects += 1
            t.counters["stored"] += 1
            self.counters["stored"] += 1
            self.counters["stored_bytes"] += e.size

    def put_revoke(self, tenant: str, reservation_id: int) -> None:
        with self.lock:
            res = self.reservations.get(reservation_id)
            if res is None or res.tenant != tenant:
                return
            del self.reservations[reservation_id]
            for e in res.entries:
                if e is not None and e.state == RESERVED:
                    self._discard(e)
                    self.counters["revoked"] += 1

    def _discard(self, e: Entry) -> None:
        """Forget an object everywhere and free its space (caller holds the lock)."""
        was_committed = e.state == COMMITTED
        if was_committed and self.events is not None and e.kind == pb.BLOCK and e.tenant == self.cfg.events_tenant:
            self.events.removed(e.key)
        part = self.index.get(e.tenant)
        ik = index_key(e.key, e.kind)
        if part is not None and part.get(ik) is e:
            del part[ik]
        blocks = self.blocks.get(e.tenant)
        if blocks is not None and blocks.get(e.key) is e:
            del blocks[e.key]
        self.by_token.pop(e.token, None)
        t = self._tenant(e.tenant)
        if e.tier == "dram" and e.offset >= 0:
            self.lru_dram.pop(id(e), None)
            if e.inflight == 0:
                self.dram.alloc.free(e.offset)
            t.used_bytes -= e.size
        elif e.tier == "ssd" and self.ssd is not None and e.offset >= 0:
            self.lru_ssd.pop(id(e), None)
            self.ssd.alloc.free(e.offset)
            t.used_bytes -= e.size
        if e.moving and self.mover is not None:
            self.mover.discarding(e)
        if (e.on_fs or e.tier == "sharedfs") and self.sharedfs is not None and self.mover is not None:
            # The copy below goes too (unlinked off the lock; meanwhile no lookup adopts it), or
            # the next lookup would bring a removed object back.
            self.mover.remove_file(e.tenant, self._fs_salt(e.tenant), e.key)
            e.on_fs = False
        if was_committed:
            t.objects -= 1
        # In flight (a transfer holds the guard): release_guard frees the extent afterwards.
        e.state = -1
        e.offset = -1 if e.inflight == 0 else e.offset
        e.token = 0

    # ------------------------------------------------------------------ reads

    def get(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK, lease_ms: int = 0,
            lease_id: int = 0) -> tuple[list[pb.Code], list[Entry | None], Lease | None]:
        """Locations of committed objects, promoted to DRAM, pinned by a lease for the transfer.

        Objects below DRAM are promoted first, without the lock and for at most
        ``tier_read_seconds`` (the rest are misses); then each is pinned.  The lease's
        ``read_tokens`` are the transfer tokens, index-parallel to the found objects.
        """
        check_kind(kind)
        promoted = self._promote_for_read(tenant, keys, kind)
        with self.lock:
            return self._get_locked(tenant, keys, kind, lease_ms, lease_id, promoted)

    def _get_locked(self, tenant: str, keys: list[bytes], kind: int, lease_ms: int, lease_id: int,
                    promoted: Promoted) -> tuple[list[pb.Code], list[Entry | None], Lease | None]:
        """:meth:`get` once its promotions are done (``promoted``); caller holds the lock."""
        now = time.time()
        codes, found = self._pin_found(tenant, keys, kind, lease_id, now, promoted)
        lease = Lease(self._next_id(), self._lease_expiry(lease_ms, now), [], tenant)
        for e in found:
            if e is None:
                continue
            lease.entries.append(e)
            t = self._new_token()
            self.read_tokens[t] = (e, lease)
            lease.read_tokens.append(t)
        if not lease.entries:
            return codes, found, None
        self._register_lease(lease)
        return codes, found, lease

    def _promote_for_read(self, tenant: str, keys: list[bytes], kind: int) -> Promoted:
        """Bring a read's objects that are below DRAM up, without the lock, waiting at most
        ``tier_read_seconds``: id(entry) → code of those that failed (``TierMover.promote``),
        and the read's objects, pinned meanwhile (making room for one must not demote
        another); :meth:`_pin_found` unpins them."""
        if self.mover is None:
            return {}, []
        fs = self._stat_sharedfs(tenant, keys, kind, prefix_only=False)
        with self.lock:
            part = self.index.get(tenant, {})
            found = [e for e in (self._lookup(part, tenant, k, kind, fs) for k in keys) if e is not None]
            # Pinned even when all are in DRAM: a demotion in flight would otherwise move one down
            # before the read's own pass takes its pin (then a miss).
            for e in found:
                e.pins += 1
            if all(e.tier == "dram" for e in found):
                return {}, found
        try:
            return self.mover.promote(found, self.cfg.tier_read_seconds), found
        except BaseException:
            with self.lock:
                for e in found:
                    e.pins -= 1
            raise

    def _pin_found(self, tenant: str, keys: list[bytes], kind: int, drop_lease_id: int,
                   now: float, promoted: Promoted) -> tuple[list[pb.Code], list[Entry | None]]:
        """Look up and pin (``pins`` + 1) each object of a read; drop the caller's
        ``drop_lease_id`` (a match lease the read supersedes).  An object below DRAM (its
        promotion, :meth:`_promote_for_read`, failed or is still on its way) is a miss: no tier
        I/O here.  Caller holds the lock."""
        failed, held = promoted
        self._sweep(now)
        part = self.index.get(tenant, {})
        codes = [pb.OK] * len(keys)
        found: list[Entry | None] = [None] * len(keys)
        hits = 0
        for i, k in enumerate(keys):
            e = self._lookup(part, tenant, k, kind)
            if e is None:
                codes[i] = pb.NOT_FOUND
                continue
            if e.tier != "dram":
                codes[i] = pb.Code.ValueType(failed.get(id(e), pb.NOT_FOUND))
                continue
            e.pins += 1
            e.last_access = now
            self.lru_dram.move_to_end(id(e))
            found[i] = e
            hits += 1
        for e in held:
            e.pins -= 1  # the promotion's hold: the read's own pins are taken
        self.counters["get_blocks"] += len(keys)
        self.counters["get_hits"] += hits
        old = self.leases.get(drop_lease_id) if drop_lease_id else None
        if old is not None and old.tenant == tenant:
            self._drop_lease(old)
        else:
            # Not the read of a match made here (whose Exists counted these blocks): the read
            # is the lookup, over gRPC and the data session alike.
            self._count_lookup(len(keys), hits)
        return codes, found

    def _count_lookup(self, asked: int, hits: int) -> None:
        """Count a lookup in the hit rate the node reports (``hit_blocks`` / ``lookup_blocks`` of
        Stats, summed into the pool's ``hitRate`` by the operator).  Block-weighted: every key
        asked counts once per request, hits are the keys found.  An Exists counts (its matched
        prefix are the hits), and so does a read, except the read of a match's lease: the match
        counted those blocks already, so a match-then-read counts each block once.  Caller
        holds the lock."""
        self.counters["lookup_blocks"] += asked
        self.counters["hit_blocks"] += hits

    def read_pin(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK,
                 drop_lease_id: int = 0) -> tuple[list[pb.Code], list[Entry | None]]:
        """:meth:`get` for a transfer that happens right now on the caller's own connection (the
        data session): no lease and no tokens; each found object stays pinned and in flight,
        so neither eviction nor a removal can recycle its extent, until :meth:`read_unpin`.

        The lookup pin becomes an in-flight mark at once: a removal that lands while the reply
        is still being sent succeeds (the extent is freed after the send, as an unlinked open
        file), rather than the caller who just got its bytes seeing IN_FLIGHT for its own read."""
        check_kind(kind)
        promoted = self._promote_for_read(tenant, keys, kind)
        with self.lock:
            codes, found = self._pin_found(tenant, keys, kind, drop_lease_id, time.time(), promoted)
            for e in found:
                if e is not None:
                    e.pins -= 1
                    e.inflight += 1
        return codes, found

    def read_unpin(self, found: Sequence[Entry | None]) -> None:
        with self.lock:
            for e in found:
                if e is None:
                    continue
                e.inflight -= 1
                if e.inflight == 0 and e.state == -1 and e.offset >= 0:
                    self.dram.alloc.free(e.offset)  # removed while it was being sent
                    e.offset = -1

    def note_range_read(self, keys: int, served: int, nbytes: int) -> None:
        """Count a ranged read: keys asked, keys served, bytes of ranges sent (``range_bytes_sent``:
        what a sparse read moved, to compare with the objects' sizes)."""
        with self.lock:
            self.counters["range_reads"] += keys
            self.counters["range_hits"] += served
            self.counters["range_bytes_sent"] += nbytes

    def get_plan(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK, lease_ms: int = 0,
                 lease_id: int = 0) -> tuple[list[pb.Code], list[int], list[int], list[int], list[int], Lease | None]:
        """:meth:`get` as plain numbers (codes, offsets, sizes, checksums, tokens, lease), taken
        under the lock: a lease that expires right away must not leave a half-read answer."""
        check_kind(kind)
        promoted = self._promote_for_read(tenant, keys, kind)
        with self.lock:
            codes, found, lease = self._get_locked(tenant, keys, kind, lease_ms, lease_id, promoted)
            tokens = self.get_tokens(lease, found)
            offsets = [e.offset if e is not None else 0 for e in found]
            sizes = [e.size if e is not None else 0 for e in found]
            sums = [e.checksum if e is not None else 0 for e in found]
        return codes, offsets, sizes, sums, tokens, lease

    def get_tokens(self, lease: Lease | None, found: Sequence[Entry | None]) -> list[int]:
        """Transfer tokens of a :meth:`get` answer, index-parallel to ``found`` (0 for misses)."""
        if lease is None:
            return [0] * len(found)
        it = iter(lease.read_tokens)
        return [next(it) if e is not None else 0 for e in found]

    def release(self, lease_ids: Sequence[int], tenant: str | None = None, incarnation: int = 0) -> None:
        """Drop leases of ``tenant``; ``incarnation``: the life that issued them (0: unchecked),
        another life's release drops nothing."""
        if incarnation and incarnation != self.incarnation:
            return
        with self.lock:
            for lid in lease_ids:
                lease = self.leases.get(lid)
                if lease is not None and (tenant is None or lease.tenant == tenant):
                    self._drop_lease(lease)

    def remove(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK) -> list[pb.Code]:
        check_kind(kind)
        with self.lock:
            self._sweep(time.time())
            self._settle_pins()
            part = self.index.get(tenant, {})
            codes: list[pb.Code] = []
            for k in keys:
                e = part.get(index_key(k, kind))
                if e is None or e.state != COMMITTED or e.kind != kind:
                    codes.append(pb.NOT_FOUND)
                elif e.pins:
                    codes.append(pb.IN_FLIGHT)
                else:
                    self._discard(e)
                    self.counters["removed"] += 1
                    codes.append(pb.OK)
            return codes

    # ------------------------------------------------------------------ transfer guard

    def acquire(self, op: str, offset: int, length: int, token: int) -> Entry | None:
        """Guard for the transfer server: admit a byte transfer only for a live slot.

        Reads need a read token of a live lease (Get), on a committed DRAM object, in bounds:
        an expired lease, a released one or a recycled slot is refused.  Writes need the
        generation token of a live reservation.  The entry is marked in flight so eviction
        and frees leave it alone until :meth:`release_guard`.
        """
        now = time.time()
        with self.lock:
            if op == "read":
                hit = self.read_tokens.get(token)
                if hit is None:
                    return None
                e, lease = hit
                if lease.expires < now or self.leases.get(lease.lease_id) is not lease or e.state != COMMITTED:
                    return None
            elif op == "write":
                e2 = self.by_token.get(token)
                if e2 is None or e2.state != RESERVED or e2.expires < now:
                    return None
                e = e2
            else:
                return None
            if e.tier != "dram" or not (e.offset <= offset and offset + length <= e.offset + e.size):
                return None
            e.inflight += 1
            return e

    def release_guard(self, e: Entry) -> None:
        with self.lock:
            e.inflight -= 1
            if e.inflight == 0:
                if e.state == -1 and e.offset >= 0:
                    self.dram.alloc.free(e.offset)
                    e.offset = -1
                elif e.state == RESERVED:
                    self._released.notify_all()  # a commit may be waiting for this write

    # ------------------------------------------------------------------ eviction and tiers

    def _dram_victims(self, need: int, now: float, expire_all: bool) -> list[Entry]:
        self._settle_pins()
        entries = list(self.lru_dram.values())
        if not any(t.ttl_seconds for t in self.tenants.values()):
            plan = choose_victims(entries, need, now, self._ttl_map(), self.cfg.default_ttl, expire_all=expire_all)
            return plan.victims  # type: ignore[return-value]
        # Some tenant overrides the pool's TTLs: decide expiry per object (tenant + class), then
        # plain LRU for the rest (an empty TTL map never expires anything).
        expired: list[Entry] = []
        rest: list[Entry] = []
        freed = 0
        for e in entries:
            if e.pins or e.inflight:
                continue
            if (expire_all or freed < need) and is_expired(e, now, {e.traffic_class: self._ttl_for(e)}, 0.0):
                expired.append(e)
                freed += e.size
            else:
                rest.append(e)
        plan = choose_victims(rest, max(0, need - freed), now, {}, 0.0, expire_all=False)
        return expired + plan.victims  # type: ignore[operator]

    def _evict_dram(self, need: int, now: float, expire_all: bool = True) -> int:
        """Drop expired victims, start the demotion of the others (or drop them without a tier
        below); the DRAM bytes freed now (a demotion frees its bytes when its copy lands)."""
        freed = 0
        for e in self._dram_victims(need, now, expire_all):
            expired = is_expired(e, now, self._ttl_map_for(e), self._ttl_for(e))
            if expired:
                self._discard(e)
                self.counters["expired"] += 1
                self._tenant(e.tenant).counters["expired"] += 1
            elif e.kind == pb.BLOCK and self.mover is not None and self.mover.plan_demotion(e):
                continue
            else:
                self._discard(e)
                self._count_evicted(e)
            freed += e.size
        return freed

    def _count_evicted(self, e: Entry) -> None:
        self.counters["evicted"] += 1
        self._tenant(e.tenant).counters["evicted"] += 1

    def _ttl_map(self) -> dict[str, float]:
        return self.cfg.ttl_seconds

    def _ttl_map_for(self, e: Entry) -> dict[str, float]:
        return {e.traffic_class: self._ttl_for(e)}

    def _evict_tenant(self, t: Tenant, need: int, now: float) -> int:
        """Quota with eviction: drop the tenant's own least recently used objects; bytes freed."""
        self._settle_pins()
        own = [e for e in itertools.chain(self.lru_ssd.values(), self.lru_dram.values()) if e.tenant == t.tenant_id]
        own.sort(key=lambda e: e.last_access)
        plan = choose_victims(own, need, now, {}, 0.0, expire_all=False)
        for c in plan.victims:
            self._discard(c)  # type: ignore[arg-type]
            self.counters["evicted_quota"] += 1
            t.counters["evicted_quota"] += 1
        return plan.freed_bytes

    # ------------------------------------------------------------------ encryption at rest

    def _stored_size(self, e: Entry) -> int:
        return sealed_size(e.size) if self.at_rest is not None else e.size

    def set_master_keys(self, current: bytes, previous: Sequence[bytes]) -> None:
        """A rotation: seal under ``current`` from now on, open what any of the keys sealed."""
        if self.at_rest is None:
            raise ValueError("this node does not encrypt at rest: it has no master key to rotate")
        with self.lock:  # no seal or open is half-way through a key swap
            self.at_rest.set_keys(current, previous)
            self.counters["master_key_reloads"] += 1

    def expire_sweep(self) -> int:
        """Drop every expired object (timer-driven, so expired objects do not wait for pressure)."""
        now = time.time()
        n = 0
        with self.lock:
            self._sweep(now)
            self._settle_pins()
            for lru in (self.lru_dram, self.lru_ssd):
                for e in list(lru.values()):
                    if not e.pins and not e.inflight and is_expired(e, now, {e.traffic_class: self._ttl_for(e)}, 0):
                        self._discard(e)
                        self.counters["expired"] += 1
                        self._tenant(e.tenant).counters["expired"] += 1
                        n += 1
        return n

    # ------------------------------------------------------------------ ring, drain, stats

    def set_ring(self, ring: Ring) -> Ring:
        with self.lock:
            if ring.epoch >= self.ring.epoch:
                self.ring = ring
                me = ring.member(self.node_id)
                self.draining = me is not None and me.state == "draining"
                self._fit_quota_shares()
            return self.ring

    def objects_hottest_first(self) -> Iterator[Entry]:
        """Committed objects, most recently used first (the drain order)."""
        with self.lock:
            items = [e for part in self.index.values() for e in part.values() if e.state == COMMITTED]
        items.sort(key=lambda e: e.last_access, reverse=True)
        return iter(items)

    def read_objects(self, entries: Sequence[Entry], sink: Callable[[list[Entry], list[memoryview]], None]) -> int:
        """Hand several objects' bytes to ``sink`` at once (a batched push), each held in flight
        while it runs; objects gone or not promotable meanwhile are left out.  How many were."""
        held: list[Entry] = []
        views: list[memoryview] = []
        pinned: list[Entry] = []
        if self.mover is not None:
            with self.lock:  # pinned, so making room for one never demotes another of the batch
                pinned = [e for e in entries if e.state == COMMITTED]
                for e in pinned:
                    e.pins += 1
            try:
                # A background push (drain, warm-up): it may wait for a slow disk longer than a read.
                self.mover.promote(pinned, max(self.cfg.tier_read_seconds, 30.0))
            except BaseException:
                with self.lock:
                    for e in pinned:
                        e.pins -= 1
                raise
        with self.lock:
            for e in entries:
                if e.state != COMMITTED or e.tier != "dram":
                    continue
                e.inflight += 1
                held.append(e)
                views.append(self.dram.slice(e.offset, e.size))
            for e in pinned:
                e.pins -= 1
        try:
            if held:
                sink(held, views)
        finally:
            self.read_unpin(held)
        return len(held)

    def stats(self) -> dict[str, object]:
        with self.lock:
            self._sweep(time.time())
            dram_objects = len(self.lru_dram)
            return {
                "node_id": self.node_id, "epoch": self.ring.epoch, "draining": self.draining,
                "incarnation": self.incarnation,
                "tiers": [
                    ("dram", self.dram.capacity, self.dram.alloc.used, dram_objects),
                    *([("ssd", self.ssd.capacity, self.ssd.alloc.used, len(self.lru_ssd))] if self.ssd else []),
                ],
                "tenants": [(t.tenant_id, t.used_bytes, t.quota_bytes, t.objects, dict(t.counters), t.share_bytes)
                            for t in self.tenants.values()],
                "counters": dict(self.counters),
            }

    def events_snapshot(self) -> tuple[list[bytes], list[tuple[int, bytes]]]:
        """The events tenant's committed blocks and the events not yet published, taken together."""
        with self.lock:
            keys = list(self.blocks.get(self.cfg.events_tenant, {}))
            return keys, self.events.take_pending() if self.events is not None else []

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        if self.mover is not None:
            self.mover.close()
        self.dram.close()
        if self.ssd is not None:
            self.ssd.close()

    def pid(self) -> int:
        return os.getpid()
