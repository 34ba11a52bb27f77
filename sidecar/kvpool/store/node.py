"""The store node: a composition of its arena index, tier chain, tenants, space and writes.

This module is transport-free: the gRPC services (``data_service.py``, ``admin_service.py``) adapt protobuf to these
methods, the transfer server moves bytes into the offsets they hand out and calls the
:class:`StoreNode` as its :class:`~kvpool.transfer.Guard` (so a recycled slot is never read and
an expired reservation is never written).  One lock guards the index and is shared by the parts;
no bytes are copied and no tier below DRAM is read or written while holding it (moves between
tiers: :mod:`kvpool.tiers.chain`, which holds it only to mark and to flip).

Parts: :class:`~kvpool.arena.index.ArenaIndex` (entries, leases, reservations, LRU, tokens),
:class:`~kvpool.tiers.chain.TierChain` (DRAM → SSD → shared fs), :class:`~kvpool.store.tenants.Tenants`,
:class:`~kvpool.store.space.Space` (eviction, expiry, quota trims) and
:class:`~kvpool.store.writes.Writes` (two-phase writes).  Each tenant has its own partition of
the index, so the same key of two tenants names two different objects.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvpool.arena.dram import DramTier
from kvpool.arena.index import ARENA, COMMITTED, RESERVED, ArenaIndex, Lease
from kvpool.core.errors import InvalidArgument
from kvpool.core.ring import Ring, stale_wrong_owner
from kvpool.core.sizing import payload_arena_bytes
from kvpool.store.settings import NodeConfig as NodeConfig
from kvpool.store.space import Space
from kvpool.store.tenants import DEFAULT_TENANT as DEFAULT_TENANT
from kvpool.store.tenants import Tenant as Tenant
from kvpool.store.tenants import Tenants
from kvpool.store.writes import Writes
from kvpool.tiers.atrest import AtRest
from kvpool.tiers.base import FaultDelay
from kvpool.tiers.chain import FsView, TierChain, TieredEntry
from kvpool.tiers.sharedfs import SharedFsHeader, SharedFsTier
from kvpool.tiers.ssd import SsdTier
from kvpool.wire.proto import store_pb2 as pb

Entry = TieredEntry
KINDS = (pb.BLOCK, pb.STATE)


def check_kind(kind: int) -> int:
    if kind not in KINDS:
        raise InvalidArgument(f"unknown object kind {kind}")
    return kind


Promoted = tuple[dict[int, int], list[Entry]]
"""What a read's promotion left: id(entry) → code of the failed ones, and the entries it pinned."""


class StoreNode:
    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        # dram_bytes is a payload capacity: that much fits before eviction starts at the high watermark.
        self.dram = DramTier(payload_arena_bytes(cfg.dram_bytes, cfg.high_watermark), cfg.shm_dir, label=cfg.node_id)
        fault = FaultDelay(cfg.fault_tier_delay_file)
        below: list[Any] = []  # the chain's order: SSD, then the shared filesystem
        if cfg.ssd_path and cfg.ssd_bytes:
            below.append(SsdTier(cfg.ssd_path, cfg.ssd_bytes, cfg.node_id, fault=fault))
        if cfg.sharedfs_path:
            below.append(SharedFsTier(cfg.sharedfs_path, fault=fault))
        self._below = below
        self.at_rest = AtRest(cfg.master_key, cfg.previous_master_keys) if cfg.master_key else None
        self.events: Any = None  # a kvpool.wire.kv_events.EventPublisher, set by the service when configured
        self._lock = threading.RLock()
        levels = [self.dram, *below]
        self._index = ArenaIndex([getattr(t, "alloc", None) for t in levels], pins_hold_extent=False)
        self.tenants = Tenants(cfg.open_tenancy)
        self.counters: Counter[str] = Counter()
        self.ring = Ring(epoch=0)
        self.draining = False
        # This life of the node: an incarnation and leases/reservations ids from a random base.
        self.incarnation = 1 + secrets.randbits(62)
        # Moves between tiers, outside the lock; None without a tier below DRAM (evictions drop).
        self.chain = TierChain(self, self._index, self._lock, levels, self.at_rest) if below else None
        self._fs = self.chain.per_key if self.chain is not None else -1
        self._space = Space(cfg, self._index, self.tenants, self.chain, self.counters, self.discard)
        self._writes = Writes(cfg, self._lock, self._index, self.tenants, self._space, self.dram, self.counters,
                              self.discard, self._published, self._sweep)

    # ------------------------------------------------------------------ tenancy, policy, keys

    def authenticate(self, token: str) -> str | None:
        """Tenant id for a token; None when the token is unknown (the caller refuses)."""
        return self.tenants.authenticate(token)

    def set_tenants(self, configs: Sequence[Tenant], replace: bool = False) -> None:
        with self._lock:
            self.tenants.set(configs, replace, self.ring)

    def set_policy(self, ttl: dict[str, float], high: float, low: float) -> None:
        with self._lock:
            if ttl:
                self.cfg.ttl_seconds = dict(ttl)
            if 0 < low < high <= 1:
                self.cfg.high_watermark, self.cfg.low_watermark = high, low

    def set_master_keys(self, current: bytes, previous: Sequence[bytes]) -> None:
        """A rotation: seal under ``current`` from now on, open what any of the keys sealed."""
        if self.at_rest is None:
            raise ValueError("this node does not encrypt at rest: it has no master key to rotate")
        with self._lock:  # no seal or open is half-way through a key swap
            self.at_rest.set_keys(current, previous)
            self.counters["master_key_reloads"] += 1

    # ------------------------------------------------------------------ what the parts ask (ChainOwner)

    def count(self, what: str, tenant: str = "") -> None:
        """Add one to a counter (and to ``tenant``'s, when given)."""
        with self._lock:
            self.counters[what] += 1
            if tenant:
                self.tenants[tenant].counters[what] += 1

    def fs_salt(self, tenant: str) -> bytes:
        return self.tenants.fs_salt(tenant)

    def account(self, tenant: str, delta_bytes: int) -> None:
        self.tenants[tenant].used_bytes += delta_bytes

    def evict_dram(self, need: int, now: float, expire_all: bool = True) -> int:
        return self._space.evict_dram(need, now, expire_all)

    def alloc_dram(self, size: int, now: float) -> int:
        return self._space.alloc_dram(size, now)

    def _published(self, e: Entry) -> None:
        if e.kind == pb.BLOCK and self.events is not None and e.tenant == self.cfg.events_tenant:
            self.events.stored(e.key)

    def discard(self, e: Entry) -> None:
        """Forget an object everywhere and free its space (caller holds the lock)."""
        was_committed = e.state == COMMITTED
        if was_committed and self.events is not None and e.kind == pb.BLOCK and e.tenant == self.cfg.events_tenant:
            self.events.removed(e.key)
        t = self.tenants[e.tenant]
        if e.offset >= 0 and (self.chain is None or self.chain.allocs[e.tier] is not None):
            t.used_bytes -= e.size
        self._index.forget(e)  # in flight (a transfer holds the guard): its release frees the extent
        if self.chain is not None:
            if e.moving:
                self.chain.discarding(e)
            if (e.on_fs or e.tier == self._fs) and self._fs >= 0:
                # The copy below goes too (unlinked off the lock; meanwhile no lookup adopts it), or
                # the next lookup would bring a removed object back.
                self.chain.remove_file(e.tenant, self.tenants.fs_salt(e.tenant), e.key)
                e.on_fs = False
        if was_committed:
            t.objects -= 1

    def _sweep(self, now: float) -> None:
        """Drop expired leases and reservations.  Lock held."""
        dropped, expired = self._index.sweep(now)
        self.counters["leases_expired"] += dropped
        for e in expired:
            self.discard(e)  # type: ignore[arg-type]
            self.counters["reservations_expired"] += 1

    # ------------------------------------------------------------------ lookups

    def _lookup(self, tenant: str, key: bytes, kind: int, fs: FsView | None = None) -> Entry | None:
        """The committed object of ``key``, or one adopted from ``fs``: the headers of the
        shared-fs files of unknown keys, read without the lock (:meth:`_stat_sharedfs`)."""
        e = self._index.get(tenant, key, kind)
        if e is not None and e.state == COMMITTED:
            return e  # type: ignore[return-value]
        if e is None and fs is not None and kind == pb.BLOCK:
            hdr = fs.headers.get(key)
            if hdr is not None:
                return self._adopt_sharedfs(tenant, key, hdr, fs.since)
        return None

    def _stat_sharedfs(self, tenant: str, keys: list[bytes], kind: int, prefix_only: bool) -> FsView | None:
        """Headers of the shared-fs files of those ``keys`` this node does not hold, read without
        the lock for at most ``tier_read_seconds`` (``TierChain.stat_files``; what is not read by
        then is a miss); with ``prefix_only`` up to the first key with no file."""
        if self._fs < 0 or self.chain is None or kind != pb.BLOCK:
            return None
        with self._lock:
            missing = self._index.unknown(tenant, keys)
            salt = self.tenants.fs_salt(tenant) if missing else b""
        if not missing:
            return None
        return self.chain.stat_files(salt, missing, prefix_only, self.cfg.tier_read_seconds)

    def _adopt_sharedfs(self, tenant: str, key: bytes, hdr: SharedFsHeader, since: float) -> Entry | None:
        """A shared-filesystem object written by any node (or a previous life) becomes known;
        ``hdr``: its header, read off the lock from ``since``."""
        assert self.chain is not None
        if hdr.kind != pb.BLOCK or not self.chain.may_adopt(tenant, key, since):
            return None  # the file of an object removed here (its unlink on its way, or done since)
        if hdr.sealed != (self.at_rest is not None):
            # A file in the clear is not trusted by an encrypting node (anyone with write access
            # to the mount could have planted it); a sealed one cannot be opened without a key.
            return None
        if not 0 < hdr.size <= min(self.cfg.max_object_bytes, self.dram.capacity):
            return None  # a damaged header must not make the node evict DRAM for a phantom
        e = Entry(key, tenant, hdr.kind, "", hdr.size)
        e.state, e.tier, e.checksum, e.on_fs = COMMITTED, self._fs, hdr.checksum, True  # sealed: 0, set on open
        self.tenants[tenant].objects += 1
        self._index.adopt(e)
        return e

    def exists(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK, prefix_only: bool = True,
               pin: bool = False, lease_ms: int = 0) -> tuple[int, bytes, Lease | None]:
        """Longest present prefix and per-key presence; optionally pin the prefix."""
        check_kind(kind)
        fs = self._stat_sharedfs(tenant, keys, kind, prefix_only)
        now = time.time()
        with self._lock:
            self._sweep(now)
            if self._fs < 0 and kind == pb.BLOCK:
                # Fast path: C-level map over the committed blocks; the prefix ends at the first
                # None.  No per-key Python: matching reads metadata only and does not touch the
                # LRU (the Get that follows a match does).
                found = self._index.match_blocks(tenant, keys)
                # all() tests truthiness (an Entry is always true), ~3x cheaper than index(None)'s
                # rich comparison per item; the usual answer is "all present".
                prefix = len(found) if all(found) else found.index(None)
                if prefix_only:
                    present = bytearray(b"\x01" * prefix + b"\x00" * (len(keys) - prefix))
                else:
                    present = bytearray(e is not None for e in found)
                hits: list[Entry] = found[:prefix]  # type: ignore[assignment]
            else:
                present = bytearray(len(keys))
                prefix = 0
                hits = []
                for i, k in enumerate(keys):
                    e = self._lookup(tenant, k, kind, fs)
                    if e is None:
                        if prefix_only:
                            break
                        continue
                    present[i] = 1
                    if prefix == i:
                        prefix += 1
                    hits.append(e)
                self._index.touch_all(hits, now)
            self._count_lookup(len(keys), prefix)  # the matched prefix are the hits
            lease = (self._index.new_lease(hits[:prefix], self._lease_expiry(lease_ms, now), tenant, lazy=True)  # type: ignore[arg-type]
                     if pin and prefix else None)
            return prefix, bytes(present), lease

    def _lease_expiry(self, lease_ms: int, now: float) -> float:
        return now + min(lease_ms or self.cfg.lease_ms_default, self.cfg.lease_ms_max) / 1000.0

    def where(self, tenant: str, key: bytes, kind: int = pb.BLOCK) -> str | None:
        """Name of the tier holding ``key`` (None: not held here)."""
        with self._lock:
            e = self._index.committed(tenant, key, kind)
            return None if e is None else self.chain.name(e.tier) if self.chain is not None else self.dram.name

    def entries(self, tenant: str, keys: Sequence[bytes], kind: int = pb.BLOCK) -> list[Entry | None]:
        """The committed objects of ``keys`` (None where absent): for :meth:`read_objects`."""
        with self._lock:
            return [self._index.committed(tenant, k, kind) for k in keys]  # type: ignore[misc]

    # ------------------------------------------------------------------ writes (store.writes)

    def put_start(self, tenant: str, keys: list[bytes], sizes: Sequence[int], traffic_class: str,
                  kind: int, timeout_ms: int = 0, epoch: int = 0) -> tuple[list[pb.Code], list[int], list[int], int]:
        """Reserve space for each item: per-item codes, offsets, tokens and a reservation id.

        ``epoch``: the ring epoch the caller routed by (0: unknown); under an older one than
        this node's, the keys this node does not own are WRONG_OWNER (:func:`stale_wrong_owner`).
        """
        if len(keys) != len(sizes):
            raise InvalidArgument(f"{len(keys)} keys but {len(sizes)} sizes")
        check_kind(kind)
        # Outside the lock (the ring is replaced whole, never changed in place); when the
        # caller routed by our epoch (or knows none) this is one comparison.
        foreign = stale_wrong_owner(self.ring, self.node_id, epoch, keys, single_copy=kind == pb.STATE)
        if foreign is not None and not foreign.any():
            foreign = None
        return self._writes.start(tenant, keys, sizes, traffic_class, kind, timeout_ms, foreign,
                                  lambda: self.draining)

    def put_commit(self, tenant: str, reservation_id: int, checksums: Sequence[int],
                   revoke: bytes = b"", incarnation: int = 0) -> list[pb.Code]:
        """Commit (or revoke, per item) a reservation.  ``incarnation``: the life that issued it
        (0: unchecked); a reservation of another life is gone: LEASE_EXPIRED, nothing applied."""
        if incarnation and incarnation != self.incarnation:
            self.count("refused_other_incarnation")
            return [pb.LEASE_EXPIRED] * max(len(checksums), 1)
        return self._writes.commit(tenant, reservation_id, checksums, revoke)

    def put_revoke(self, tenant: str, reservation_id: int) -> None:
        self._writes.revoke(tenant, reservation_id)

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
        with self._lock:
            return self._get_locked(tenant, keys, kind, lease_ms, lease_id, promoted)

    def _get_locked(self, tenant: str, keys: list[bytes], kind: int, lease_ms: int, lease_id: int,
                    promoted: Promoted) -> tuple[list[pb.Code], list[Entry | None], Lease | None]:
        """:meth:`get` once its promotions are done (``promoted``); caller holds the lock."""
        now = time.time()
        codes, found = self._pin_found(tenant, keys, kind, lease_id, now, promoted)
        hits: list[Entry] = [e for e in found if e is not None]
        if not hits:
            return codes, found, None
        # The read's own pins (taken by _pin_found) become the lease's.
        lease = self._index.new_lease(hits, self._lease_expiry(lease_ms, now), tenant, pinned=True,  # type: ignore[arg-type]
                                      read_tokens=True)
        return codes, found, lease

    def _promote_for_read(self, tenant: str, keys: list[bytes], kind: int) -> Promoted:
        """Bring a read's objects that are below DRAM up, without the lock, waiting at most
        ``tier_read_seconds``: id(entry) → code of those that failed (``TierChain.promote``),
        and the read's objects, pinned meanwhile (making room for one must not demote
        another); :meth:`_pin_found` unpins them."""
        if self.chain is None:
            return {}, []
        fs = self._stat_sharedfs(tenant, keys, kind, prefix_only=False)
        with self._lock:
            found = [e for e in (self._lookup(tenant, k, kind, fs) for k in keys) if e is not None]
            # Pinned even when all are in DRAM: a demotion in flight would otherwise move one down
            # before the read's own pass takes its pin (then a miss).
            self._index.pin(found)
            if all(e.tier == ARENA for e in found):
                return {}, found
        try:
            return self.chain.promote(found, self.cfg.tier_read_seconds, self.cfg.high_watermark,
                                      self.cfg.low_watermark), found
        except BaseException:
            with self._lock:
                self._index.unpin_all(found)
            raise

    def _pin_found(self, tenant: str, keys: list[bytes], kind: int, drop_lease_id: int,
                   now: float, promoted: Promoted) -> tuple[list[pb.Code], list[Entry | None]]:
        """Look up and pin (``pins`` + 1) each object of a read; drop the caller's
        ``drop_lease_id`` (a match lease the read supersedes).  An object below DRAM (its
        promotion, :meth:`_promote_for_read`, failed or is still on its way) is a miss: no tier
        I/O here.  Caller holds the lock."""
        failed, held = promoted
        self._sweep(now)
        codes = [pb.OK] * len(keys)
        found: list[Entry | None] = self._index.lookup(tenant, keys, kind)  # type: ignore[assignment]
        hits = 0
        for i, e in enumerate(found):
            if e is None:
                codes[i] = pb.NOT_FOUND
            elif e.tier != ARENA:
                codes[i] = pb.Code.ValueType(failed.get(id(e), pb.NOT_FOUND))
                found[i] = None
            else:
                e.pins += 1
                self._index.touch(e, now)
                hits += 1
        self._index.unpin_all(held)  # the promotion's hold: the read's own pins are taken
        self.counters["get_blocks"] += len(keys)
        self.counters["get_hits"] += hits
        old = self._index.lease(drop_lease_id) if drop_lease_id else None
        if old is not None and old.tenant == tenant:
            self._index.drop_lease(old)
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
        counted those blocks already, so a match-then-read counts each block once.  Lock held."""
        self.counters["lookup_blocks"] += asked
        self.counters["hit_blocks"] += hits

    def read_pin(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK,
                 drop_lease_id: int = 0) -> tuple[list[pb.Code], list[Entry | None]]:
        """:meth:`get` for a transfer that happens right now on the caller's own connection (the
        data session): no lease and no tokens; each found object stays in flight, so neither
        eviction nor a removal can recycle its extent, until :meth:`read_unpin`.

        The lookup pin becomes an in-flight mark at once: a removal that lands while the reply
        is still being sent succeeds (the extent is freed after the send, as an unlinked open
        file), rather than the caller who just got its bytes seeing IN_FLIGHT for its own read."""
        check_kind(kind)
        promoted = self._promote_for_read(tenant, keys, kind)
        with self._lock:
            codes, found = self._pin_found(tenant, keys, kind, drop_lease_id, time.time(), promoted)
            for e in found:
                if e is not None:
                    e.pins -= 1
                    e.inflight += 1
        return codes, found

    def read_unpin(self, found: Sequence[Entry | None]) -> None:
        with self._lock:
            for e in found:
                if e is not None:
                    self._index.release_inflight(e)  # removed while it was being sent: freed now

    def note_range_read(self, keys: int, served: int, nbytes: int) -> None:
        """Count a ranged read: keys asked, keys served, bytes of ranges sent (``range_bytes_sent``:
        what a sparse read moved, to compare with the objects' sizes)."""
        with self._lock:
            self.counters["range_reads"] += keys
            self.counters["range_hits"] += served
            self.counters["range_bytes_sent"] += nbytes

    def get_plan(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK, lease_ms: int = 0,
                 lease_id: int = 0) -> tuple[list[pb.Code], list[int], list[int], list[int], list[int], Lease | None]:
        """:meth:`get` as plain numbers (codes, offsets, sizes, checksums, tokens, lease), taken
        under the lock: a lease that expires right away must not leave a half-read answer."""
        check_kind(kind)
        promoted = self._promote_for_read(tenant, keys, kind)
        with self._lock:
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
        with self._lock:
            self._index.release(lease_ids, tenant)

    def remove(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK) -> list[pb.Code]:
        check_kind(kind)
        with self._lock:
            self._sweep(time.time())
            self._index.settle_pins()
            codes: list[pb.Code] = []
            for e in self._index.lookup(tenant, keys, kind):
                if e is None:
                    codes.append(pb.NOT_FOUND)
                elif e.pins:
                    codes.append(pb.IN_FLIGHT)
                else:
                    self.discard(e)  # type: ignore[arg-type]
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
        with self._lock:
            if op == "read":
                e = self._index.by_read_token(token, now)
            elif op == "write":
                e = self._index.by_token(token)
                if e is not None and (e.state != RESERVED or e.expires < now):
                    e = None
            else:
                return None
            if e is None or e.tier != ARENA or not (e.offset <= offset and offset + length <= e.offset + e.size):
                return None
            e.inflight += 1
            return e  # type: ignore[return-value]

    def release_guard(self, e: Entry) -> None:
        with self._lock:
            self._index.release_inflight(e)
            if e.inflight == 0 and e.state == RESERVED:  # a commit may be waiting for this write
                self._writes.released.notify_all()

    # ------------------------------------------------------------------ expiry, ring, drain feed, stats

    def expire_sweep(self) -> int:
        """Drop every expired object (timer-driven, so expired objects do not wait for pressure)."""
        now = time.time()
        with self._lock:
            self._sweep(now)
            return self._space.expire(now)

    def demote(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Start moving these DRAM blocks one tier down now (as eviction would); how many started."""
        with self._lock:
            found = [self._index.committed(tenant, k, pb.BLOCK) for k in keys]
            return sum(1 for e in found if isinstance(e, Entry) and e.tier == ARENA and not e.moving
                       and self.chain is not None and self.chain.plan_demotion(e))

    def tier(self, name: str) -> Any:
        """The tier called ``name`` ("dram", "ssd", "sharedfs"), None when this node has none."""
        return next((t for t in (self.dram, *self._below) if t.name == name), None)

    def live_tokens(self) -> int:
        """Transfer tokens alive (of reservations, objects and read leases)."""
        with self._lock:
            return self._index.token_count()

    def settled(self) -> bool:
        """No tier move or file removal queued or under way."""
        return self.chain is None or self.chain.idle()

    def set_ring(self, ring: Ring) -> Ring:
        with self._lock:
            if ring.epoch >= self.ring.epoch:
                self.ring = ring
                me = ring.member(self.node_id)
                self.draining = me is not None and me.state == "draining"
                self._space.fit_shares(ring, self.node_id)
            return self.ring

    def objects_hottest_first(self) -> Iterator[Entry]:
        """Committed objects, most recently used first (the drain order)."""
        with self._lock:
            items: list[Entry] = self._index.all_committed()  # type: ignore[assignment]
        items.sort(key=lambda e: e.last_access, reverse=True)
        return iter(items)

    def read_objects(self, entries: Sequence[Entry], sink: Callable[[list[Entry], list[memoryview]], None]) -> int:
        """Hand several objects' bytes to ``sink`` at once (a batched push), each held in flight
        while it runs; objects gone or not promotable meanwhile are left out.  How many were."""
        held: list[Entry] = []
        views: list[memoryview] = []
        pinned: list[Entry] = []
        if self.chain is not None:
            with self._lock:  # pinned, so making room for one never demotes another of the batch
                pinned = [e for e in entries if e.state == COMMITTED]
                self._index.pin(pinned)
            try:
                # A background push (drain, warm-up): it may wait for a slow disk longer than a read.
                self.chain.promote(pinned, max(self.cfg.tier_read_seconds, 30.0), self.cfg.high_watermark,
                                   self.cfg.low_watermark)
            except BaseException:
                with self._lock:
                    self._index.unpin_all(pinned)
                raise
        with self._lock:
            for e in entries:
                if e.state != COMMITTED or e.tier != ARENA:
                    continue
                e.inflight += 1
                held.append(e)
                views.append(self.dram.slice(e.offset, e.size))
            self._index.unpin_all(pinned)
        try:
            if held:
                sink(held, views)
        finally:
            self.read_unpin(held)
        return len(held)

    def stats(self) -> dict[str, object]:
        with self._lock:
            self._sweep(time.time())
            levels = [self.dram, *self._below]
            return {
                "node_id": self.node_id, "epoch": self.ring.epoch, "draining": self.draining,
                "incarnation": self.incarnation,
                "tiers": [(t.name, t.capacity, t.alloc.used, self._index.count(i))
                          for i, t in enumerate(levels) if getattr(t, "alloc", None) is not None],
                "tenants": self.tenants.rows(),
                "counters": dict(self.counters),
            }

    def events_snapshot(self) -> tuple[list[bytes], list[tuple[int, bytes]]]:
        """The events tenant's committed blocks and the events not yet published, taken together."""
        with self._lock:
            keys = self._index.block_keys(self.cfg.events_tenant)
            return keys, self.events.take_pending() if self.events is not None else []

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        if self.chain is not None:
            self.chain.close()
        self.dram.close()
        for t in self._below:
            t.close()

    def pid(self) -> int:
        return os.getpid()
