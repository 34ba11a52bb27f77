"""The store node's state machine: index, two-phase writes, leases, eviction, quota, tiers.

This module is transport-free: the gRPC service (``service.py``) adapts protobuf to these
methods, the transfer server moves bytes into the offsets they hand out and calls the
:class:`StoreNode` as its :class:`~kvpool.transfer.Guard` (so a recycled slot is never read and
an expired reservation is never written).  One lock guards the index; no bytes are copied while
holding it except SSD promotion/demotion of single objects.

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

from ..proto import store_pb2 as pb
from ..ring import Ring
from .allocator import OutOfSpace
from .eviction import choose_victims, is_expired, watermark_need
from .tiers import DramTier, SharedFsTier, SsdTier, checksum

log = logging.getLogger("kvpool.store")

DAY = 86400.0
DEFAULT_TTL = {"agent": 3 * DAY, "chatbot": 7 * DAY}
DEFAULT_TENANT = "default"

RESERVED, COMMITTED = 0, 1


def payload_arena_bytes(payload: int, high_watermark: float, align: int = 4096) -> int:
    """Arena size so that ``payload`` bytes fit below the high watermark."""
    raw = int(payload / high_watermark) + align
    return -(-raw // align) * align


class Entry:
    """One object in the index.  Per object, never per byte."""

    __slots__ = ("key", "tenant", "kind", "traffic_class", "size", "checksum", "tier", "offset",
                 "token", "last_access", "state", "pins", "inflight", "expires")

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


@dataclass
class Tenant:
    tenant_id: str
    token: str = ""
    salt: bytes = b""
    quota_bytes: int = 0
    ttl_seconds: dict[str, float] = field(default_factory=dict)
    evict_own_on_quota: bool = False
    used_bytes: int = 0
    objects: int = 0
    counters: Counter[str] = field(default_factory=Counter)


@dataclass
class Lease:
    lease_id: int
    expires: float
    entries: list[Entry]


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
    """An uncommitted reservation expires after this long (a dead writer leaves nothing)."""
    lease_ms_default: int = 5000
    lease_ms_max: int = 60000
    max_object_bytes: int = 64 << 20
    verify_on_commit: bool = False
    """Hash what a writer committed (costs one pass over the bytes; readers verify anyway)."""
    open_tenancy: bool = True
    """Calls without a token act as the default tenant (dev/local pools)."""


class StoreNode:
    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        # dram_bytes is a payload capacity: that much fits before eviction starts at the high watermark.
        self.dram = DramTier(payload_arena_bytes(cfg.dram_bytes, cfg.high_watermark), cfg.shm_dir, label=cfg.node_id)
        self.ssd = SsdTier(cfg.ssd_path, cfg.ssd_bytes, cfg.node_id) if cfg.ssd_path and cfg.ssd_bytes else None
        self.sharedfs = SharedFsTier(cfg.sharedfs_path) if cfg.sharedfs_path else None
        self.lock = threading.RLock()
        self.index: dict[str, dict[bytes, Entry]] = {}
        # Committed block objects only, per tenant: the match fast path is one C-level map over
        # this dict (a reserved or state entry must never count as a hit).
        self.blocks: dict[str, dict[bytes, Entry]] = {}
        self.lru_dram: OrderedDict[int, Entry] = OrderedDict()  # id(entry) → entry, oldest first
        self.lru_ssd: OrderedDict[int, Entry] = OrderedDict()
        self.by_token: dict[int, Entry] = {}
        self.leases: dict[int, Lease] = {}
        self._lease_heap: list[tuple[float, int]] = []
        self.reservations: dict[int, Reservation] = {}
        self._res_heap: list[tuple[float, int]] = []
        self.tenants: dict[str, Tenant] = {DEFAULT_TENANT: Tenant(DEFAULT_TENANT)}
        self.token_to_tenant: dict[str, str] = {}
        self.counters: Counter[str] = Counter()
        self.ring = Ring(epoch=0)
        self.draining = False
        self._ids = itertools.count(1)
        # Tokens are random per node life: a token from before a restart matches nothing.
        self._token_base = secrets.randbits(62) << 1
        self._token_seq = itertools.count(1)
        self.ssd_used = 0

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

    def _tenant(self, tid: str) -> Tenant:
        t = self.tenants.get(tid)
        if t is None:
            t = self.tenants[tid] = Tenant(tid)
        return t

    # ------------------------------------------------------------------ housekeeping

    def _new_token(self) -> int:
        return (self._token_base + next(self._token_seq)) & 0x7FFFFFFFFFFFFFFF

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
        self.leases.pop(lease.lease_id, None)
        for e in lease.entries:
            e.pins -= 1

    def _new_lease(self, entries: list[Entry], lease_ms: int, now: float) -> Lease:
        ms = min(lease_ms or self.cfg.lease_ms_default, self.cfg.lease_ms_max)
        lease = Lease(next(self._ids), now + ms / 1000.0, entries)
        for e in entries:
            e.pins += 1
        self.leases[lease.lease_id] = lease
        heapq.heappush(self._lease_heap, (lease.expires, lease.lease_id))
        return lease

    # ------------------------------------------------------------------ lookups

    def _lookup(self, part: dict[bytes, Entry], tenant: str, key: bytes, kind: int) -> Entry | None:
        e = part.get(key)
        if e is not None and e.state == COMMITTED and e.kind == kind:
            return e
        if e is None and self.sharedfs is not None and kind == pb.BLOCK:
            return self._adopt_sharedfs(tenant, key)
        return None

    def _adopt_sharedfs(self, tenant: str, key: bytes) -> Entry | None:
        """A shared-filesystem object written by any node (or a previous life) becomes known."""
        assert self.sharedfs is not None
        hdr = self.sharedfs.stat(self._tenant(tenant).salt, key)
        if hdr is None or hdr.kind != pb.BLOCK:
            return None
        e = Entry(key, tenant, hdr.kind, "", hdr.size)
        e.state, e.tier, e.checksum = COMMITTED, "sharedfs", hdr.checksum
        self.index.setdefault(tenant, {})[key] = e
        self.blocks.setdefault(tenant, {})[key] = e
        return e

    def exists(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK, prefix_only: bool = True,
               pin: bool = False, lease_ms: int = 0) -> tuple[int, bytes, Lease | None]:
        """Longest present prefix and per-key presence; optionally pin the prefix."""
        now = time.time()
        with self.lock:
            self._sweep(now)
            if self.sharedfs is None and kind == pb.BLOCK:
                # Fast path: C-level map over the committed blocks; the prefix ends at the first
                # None.  No per-key Python: matching reads metadata only and does not touch the
                # LRU (the Get that follows a match does).
                found: list[Entry | None] = list(map(self.blocks.get(tenant, {}).get, keys))
                try:
                    prefix = found.index(None)
                except ValueError:
                    prefix = len(found)
                if prefix_only:
                    present = bytearray(b"\x01" * prefix + b"\x00" * (len(keys) - prefix))
                else:
                    present = bytearray(e is not None for e in found)
                hits: list[Entry] = found[:prefix]  # type: ignore[assignment]
            else:
                part = self.index.get(tenant, {})
                found = [self._lookup(part, tenant, k, kind) for k in keys]
                present = bytearray(len(keys))
                prefix = 0
                hits = []
                for i, e in enumerate(found):
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
            # Block-weighted: every key asked counts, hits are the matched prefix.
            self.counters["lookup_blocks"] += len(keys)
            self.counters["hit_blocks"] += prefix
            lease = self._new_lease(hits[:prefix], lease_ms, now) if pin and prefix else None
            return prefix, bytes(present), lease

    # ------------------------------------------------------------------ writes

    def put_start(self, tenant: str, keys: list[bytes], sizes: Sequence[int], traffic_class: str,
                  kind: int, timeout_ms: int = 0) -> tuple[list[int], list[int], list[int], int]:
        """Reserve space for each item: per-item codes, offsets, tokens and a reservation id."""
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        now = time.time()
        codes = [pb.OK] * len(keys)
        offsets = [0] * len(keys)
        tokens = [0] * len(keys)
        entries: list[Entry | None] = [None] * len(keys)
        with self.lock:
            self._sweep(now)
            if self.draining:
                return [pb.DRAINING] * len(keys), offsets, tokens, 0
            t = self._tenant(tenant)
            part = self.index.setdefault(tenant, {})
            # Batch admission: make room once for the whole batch (watermarks), then allocate.
            incoming = 0
            seen: set[bytes] = set()
            for i, (k, size) in enumerate(zip(keys, sizes, strict=True)):
                old = part.get(k)
                if size <= 0 or len(k) != 32:
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
            need = watermark_need(self.dram.alloc.used, incoming, self.dram.capacity,
                                  self.cfg.high_watermark, self.cfg.low_watermark)
            if need:
                self._evict_dram(need, now)
            for i, (k, size) in enumerate(zip(keys, sizes, strict=True)):
                if codes[i] != pb.OK:
                    continue
                try:
                    off = self._alloc_dram(size, now)
                except OutOfSpace:
                    codes[i] = pb.NO_SPACE
                    self.counters["refused_space"] += 1
                    t.counters["refused_space"] += 1
                    continue
                e = Entry(k, tenant, kind, traffic_class, size)
                e.offset = off
                e.token = self._new_token()
                e.expires = now + (timeout_ms / 1000.0 if timeout_ms else self.cfg.reservation_seconds)
                part[k] = e
                self.by_token[e.token] = e
                t.used_bytes += size
                offsets[i], tokens[i], entries[i] = off, e.token, e
            rid = 0
            if any(e is not None for e in entries):
                rid = next(self._ids)
                expires = max(e.expires for e in entries if e is not None)
                self.reservations[rid] = Reservation(rid, tenant, entries, expires)
                heapq.heappush(self._res_heap, (expires, rid))
            return codes, offsets, tokens, rid

    def _admit_quota(self, t: Tenant, keys: list[bytes], sizes: Sequence[int], codes: list[int],
                     now: float) -> None:
        if not t.quota_bytes:
            return
        want = t.used_bytes
        for i, size in enumerate(sizes):
            if codes[i] != pb.OK:
                continue
            if want + size > t.quota_bytes and t.evict_own_on_quota:
                self._evict_tenant(t, want + size - t.quota_bytes, now)
                want = t.used_bytes + sum(s for j, s in enumerate(sizes[:i]) if codes[j] == pb.OK)
            if want + size > t.quota_bytes:
                codes[i] = pb.QUOTA_EXCEEDED
                self.counters["refused_quota"] += 1
                t.counters["refused_quota"] += 1
                continue
            want += size

    def _alloc_dram(self, size: int, now: float) -> int:
        try:
            return self.dram.alloc.alloc(size)
        except OutOfSpace:
            # Fragmentation or a full arena: free what the largest object needs, then retry.
            self._evict_dram(self.dram.alloc.rounded(size), now, expire_all=False)
            return self.dram.alloc.alloc(size)

    def put_commit(self, tenant: str, reservation_id: int, checksums: Sequence[int],
                   revoke: bytes = b"") -> list[int]:
        now = time.time()
        with self.lock:
            res = self.reservations.get(reservation_id)
            if res is None or res.tenant != tenant:
                return [pb.LEASE_EXPIRED] * max(len(checksums), 1)
            if len(checksums) != len(res.entries):
                raise ValueError(f"{len(checksums)} checksums for {len(res.entries)} items")
            codes = [pb.OK] * len(res.entries)
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
                if self.cfg.verify_on_commit and checksum(self.dram.slice(e.offset, e.size)) != checksums[i]:
                    self._discard(e)
                    codes[i] = pb.CHECKSUM
                    self.counters["checksum_failures"] += 1
                    continue
                e.checksum = int(checksums[i])
                e.state = COMMITTED
                if e.kind == pb.BLOCK:
                    self.blocks.setdefault(e.tenant, {})[e.key] = e
                e.last_access = now
                self.lru_dram[id(e)] = e
                t = self._tenant(e.tenant)
                t.objects += 1
                t.counters["stored"] += 1
                self.counters["stored"] += 1
                self.counters["stored_bytes"] += e.size
            del self.reservations[reservation_id]
            return codes

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
        part = self.index.get(e.tenant)
        if part is not None and part.get(e.key) is e:
            del part[e.key]
        blocks = self.blocks.get(e.tenant)
        if blocks is not None and blocks.get(e.key) is e:
            del blocks[e.key]
        self.by_token.pop(e.token, None)
        t = self._tenant(e.tenant)
        if e.tier == "dram" and e.offset >= 0:
            self.lru_dram.pop(id(e), None)
            if e.inflight == 0:
                self.dram.alloc.free(e.offset)
            else:
                # Bytes are moving right now: the transfer's release frees the extent.
                e.state = -1
            t.used_bytes -= e.size
        elif e.tier == "ssd" and self.ssd is not None:
            self.lru_ssd.pop(id(e), None)
            self.ssd.alloc.free(e.offset)
            t.used_bytes -= e.size
        elif e.tier == "sharedfs" and self.sharedfs is not None:
            self.sharedfs.remove(t.salt, e.key)
        if was_committed:
            t.objects -= 1
        e.offset = -1 if e.inflight == 0 else e.offset
        e.token = 0

    # ------------------------------------------------------------------ reads

    def get(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK, lease_ms: int = 0,
            lease_id: int = 0) -> tuple[list[int], list[Entry | None], Lease | None]:
        """Locations of committed objects, promoted to DRAM, pinned by a lease for the transfer."""
        now = time.time()
        with self.lock:
            self._sweep(now)
            part = self.index.get(tenant, {})
            codes = [pb.OK] * len(keys)
            found: list[Entry | None] = [None] * len(keys)
            pinned: list[Entry] = []
            for i, k in enumerate(keys):
                e = self._lookup(part, tenant, k, kind)
                if e is None:
                    codes[i] = pb.NOT_FOUND
                    continue
                if e.tier != "dram" and not self._promote(e, now):
                    codes[i] = pb.NOT_FOUND if e.tier != "dram" else pb.CHECKSUM
                    continue
                e.last_access = now
                self.lru_dram.move_to_end(id(e))
                found[i] = e
                pinned.append(e)
            self.counters["get_blocks"] += len(keys)
            self.counters["get_hits"] += len(pinned)
            if lease_id:
                old = self.leases.get(lease_id)
                if old is not None:
                    self._drop_lease(old)
            lease = self._new_lease(pinned, lease_ms, now) if pinned else None
            return codes, found, lease

    def release(self, lease_ids: Sequence[int]) -> None:
        with self.lock:
            for lid in lease_ids:
                lease = self.leases.get(lid)
                if lease is not None:
                    self._drop_lease(lease)

    def remove(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK) -> list[int]:
        with self.lock:
            part = self.index.get(tenant, {})
            codes = []
            for k in keys:
                e = part.get(k)
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

        Reads need a committed object with this token (its generation: a recycled slot has a new
        token) and in bounds; writes need a live reservation.  The entry is marked in flight so
        eviction leaves it alone until :meth:`release_guard`.
        """
        with self.lock:
            e = self.by_token.get(token)
            if e is None or e.tier != "dram" or not (e.offset <= offset and offset + length <= e.offset + e.size):
                return None
            if op == "read" and e.state != COMMITTED:
                return None
            if op == "write" and (e.state != RESERVED or e.expires < time.time()):
                return None
            e.inflight += 1
            return e

    def release_guard(self, e: Entry) -> None:
        with self.lock:
            e.inflight -= 1
            if e.inflight == 0 and e.state == -1 and e.offset >= 0:
                self.dram.alloc.free(e.offset)
                e.offset = -1

    # ------------------------------------------------------------------ eviction and tiers

    def _evict_dram(self, need: int, now: float, expire_all: bool = True) -> int:
        plan = choose_victims(list(self.lru_dram.values()), need, now, self._ttl_map(), self.cfg.default_ttl,
                              expire_all=expire_all)
        freed = 0
        for c in plan.victims:
            e: Entry = c  # type: ignore[assignment]
            expired = is_expired(e, now, self._ttl_map_for(e), self._ttl_for(e))
            if expired:
                self._discard(e)
                self.counters["expired"] += 1
                self._tenant(e.tenant).counters["expired"] += 1
            elif e.kind == pb.BLOCK and self._demote(e, now):
                self.counters["demoted"] += 1
            else:
                self._discard(e)
                self.counters["evicted"] += 1
                self._tenant(e.tenant).counters["evicted"] += 1
            freed += e.size
        return freed

    def _ttl_map(self) -> dict[str, float]:
        return self.cfg.ttl_seconds

    def _ttl_map_for(self, e: Entry) -> dict[str, float]:
        return {e.traffic_class: self._ttl_for(e)}

    def _evict_tenant(self, t: Tenant, need: int, now: float) -> None:
        """Quota with eviction: drop the tenant's own least recently used objects."""
        own = [e for e in itertools.chain(self.lru_ssd.values(), self.lru_dram.values()) if e.tenant == t.tenant_id]
        own.sort(key=lambda e: e.last_access)
        plan = choose_victims(own, need, now, {}, 0.0, expire_all=False)
        for c in plan.victims:
            self._discard(c)  # type: ignore[arg-type]
            self.counters["evicted_quota"] += 1
            t.counters["evicted_quota"] += 1

    def _demote(self, e: Entry, now: float) -> bool:
        """Move a DRAM object to the SSD tier (or the shared filesystem); False if neither can."""
        src = self.dram.slice(e.offset, e.size)
        if self.ssd is not None:
            try:
                off = self.ssd.alloc.alloc(e.size)
            except OutOfSpace:
                self._evict_ssd(self.ssd.alloc.rounded(e.size) + int(self.ssd.capacity * 0.05))
                try:
                    off = self.ssd.alloc.alloc(e.size)
                except OutOfSpace:
                    return self._demote_sharedfs(e, src)
            self.ssd.write(off, src)
            self._move(e, "ssd", off)
            self.lru_ssd[id(e)] = e
            return True
        return self._demote_sharedfs(e, src)

    def _demote_sharedfs(self, e: Entry, src: memoryview) -> bool:
        if self.sharedfs is None:
            return False
        self.sharedfs.write(self._tenant(e.tenant).salt, e.key, e.kind, src, e.checksum)
        self._move(e, "sharedfs", -1)
        self._tenant(e.tenant).used_bytes -= e.size  # shared tier is outside the node's quota
        return True

    def _move(self, e: Entry, tier: str, offset: int) -> None:
        self.lru_dram.pop(id(e), None)
        self.by_token.pop(e.token, None)
        self.dram.alloc.free(e.offset)
        e.tier, e.offset, e.token = tier, offset, 0

    def _evict_ssd(self, need: int) -> None:
        assert self.ssd is not None
        freed = 0
        for e in list(self.lru_ssd.values()):
            if freed >= need:
                break
            if e.pins:
                continue
            if self.sharedfs is not None:
                buf = bytearray(e.size)
                self.ssd.read_into(e.offset, memoryview(buf))
                self.sharedfs.write(self._tenant(e.tenant).salt, e.key, e.kind, memoryview(buf), e.checksum)
                self.lru_ssd.pop(id(e), None)
                self.ssd.alloc.free(e.offset)
                self._tenant(e.tenant).used_bytes -= e.size
                e.tier, e.offset = "sharedfs", -1
                self.counters["demoted"] += 1
            else:
                self._discard(e)
                self.counters["evicted"] += 1
                self._tenant(e.tenant).counters["evicted"] += 1
            freed += e.size

    def _promote(self, e: Entry, now: float) -> bool:
        """Bring an SSD/shared-fs object into DRAM, verifying its checksum; False = a miss."""
        try:
            off = self._alloc_dram(e.size, now)
        except OutOfSpace:
            return False
        dst = self.dram.slice(off, e.size)
        ok = False
        if e.tier == "ssd" and self.ssd is not None:
            self.ssd.read_into(e.offset, dst)
            ok = True
        elif e.tier == "sharedfs" and self.sharedfs is not None:
            ok = self.sharedfs.read_into(self._tenant(e.tenant).salt, e.key, dst) is not None
        if ok and checksum(dst) != e.checksum:
            ok = False
            self.counters["checksum_failures"] += 1
        if not ok:
            self.dram.alloc.free(off)
            self._discard(e)
            return False
        if e.tier == "ssd" and self.ssd is not None:
            self.lru_ssd.pop(id(e), None)
            self.ssd.alloc.free(e.offset)
        elif e.tier == "sharedfs":
            self._tenant(e.tenant).used_bytes += e.size
        e.tier, e.offset, e.token = "dram", off, self._new_token()
        self.by_token[e.token] = e
        self.lru_dram[id(e)] = e
        self.counters["promoted"] += 1
        return True

    def expire_sweep(self) -> int:
        """Drop every expired object (timer-driven, so expired objects do not wait for pressure)."""
        now = time.time()
        n = 0
        with self.lock:
            self._sweep(now)
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
            return self.ring

    def objects_hottest_first(self) -> Iterator[Entry]:
        """Committed objects, most recently used first (the drain order)."""
        with self.lock:
            items = [e for part in self.index.values() for e in part.values() if e.state == COMMITTED]
        items.sort(key=lambda e: e.last_access, reverse=True)
        return iter(items)

    def read_object(self, e: Entry, sink: Callable[[memoryview], None]) -> bool:
        """Hand an object's bytes to ``sink`` (the drain's pusher), pinned while it runs."""
        with self.lock:
            if e.state != COMMITTED:
                return False
            if e.tier != "dram" and not self._promote(e, time.time()):
                return False
            e.inflight += 1
            view = self.dram.slice(e.offset, e.size)
        try:
            sink(view)
            return True
        finally:
            with self.lock:
                e.inflight -= 1
                if e.inflight == 0 and e.state == -1 and e.offset >= 0:
                    self.dram.alloc.free(e.offset)
                    e.offset = -1

    def stats(self) -> dict[str, object]:
        with self.lock:
            self._sweep(time.time())
            dram_objects = len(self.lru_dram)
            return {
                "node_id": self.node_id, "epoch": self.ring.epoch, "draining": self.draining,
                "tiers": [
                    ("dram", self.dram.capacity, self.dram.alloc.used, dram_objects),
                    *([("ssd", self.ssd.capacity, self.ssd.alloc.used, len(self.lru_ssd))] if self.ssd else []),
                ],
                "tenants": [(t.tenant_id, t.used_bytes, t.quota_bytes, t.objects, dict(t.counters))
                            for t in self.tenants.values()],
                "counters": dict(self.counters),
            }

    def close(self) -> None:
        self.dram.close()
        if self.ssd is not None:
            self.ssd.close()

    def pid(self) -> int:
        return os.getpid()
