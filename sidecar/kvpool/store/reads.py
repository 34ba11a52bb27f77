"""Lookups and reads of a store node: Exists (match) and the data session's pinned reads.

A part of :class:`~kvpool.store.node.StoreNode`, sharing its index lock.  A read first brings
the objects it asks for that are below DRAM up (the tier chain's promotions, waited for without
the lock, at most ``tier_read_seconds``), then pins what is in DRAM under the lock; the shared
filesystem's headers of unknown keys are read off the lock too and adopted under it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from operator import attrgetter

from kvpool.arena.dram import DramTier
from kvpool.arena.index import ARENA, COMMITTED, ArenaIndex, Lease
from kvpool.core.errors import InvalidArgument
from kvpool.store.gone import Gone
from kvpool.store.settings import NodeConfig
from kvpool.store.tenants import Tenants
from kvpool.tiers.base import Location
from kvpool.tiers.chain import TierChain
from kvpool.tiers.chain import TieredEntry as Entry
from kvpool.tiers.ledger import FsView
from kvpool.wire.counters import MissReason, StoreCounter, miss_reason, tier_hits
from kvpool.wire.proto import store_pb2 as pb

Promoted = tuple[dict[int, int], list[Entry], dict[int, int]]
"""What a read's promotion left: id(entry) → code of the failed ones, the entries it pinned, and
id(entry) → the level each one below DRAM was found in (the hit-by-tier counters)."""

_MISS = {r: miss_reason(r) for r in MissReason}
_TIER_OF = attrgetter("tier")
_SIZE_OF = attrgetter("size")


def promotion_miss(code: int) -> MissReason:
    """Why an object found below DRAM is a read's miss, from its promotion's code (pure): its
    bytes failed their check (a checksum or an at-rest tag), or it did not come up in time
    (NOT_FOUND: still on its way)."""
    if code == pb.CHECKSUM:
        return MissReason.CHECKSUM
    if code == pb.NOT_FOUND:
        return MissReason.NODE_DOWN
    return MissReason.EVICTED if code == pb.NO_SPACE else MissReason.ABSENT


def check_kind(kind: int) -> int:
    if kind not in (pb.BLOCK, pb.STATE):
        raise InvalidArgument(f"unknown object kind {kind}")
    return kind


class Reads:
    """Lookups and reads of one node (see the module docstring)."""

    def __init__(self, cfg: NodeConfig, lock: threading.RLock, index: ArenaIndex, tenants: Tenants,
                 chain: TierChain | None, dram: DramTier, counters: Counter[str],
                 sweep: Callable[[float], None], gone: Gone) -> None:
        self.cfg = cfg
        self.gone = gone
        self._lock = lock
        self._index = index
        self.tenants = tenants
        self.chain = chain
        self._fs = chain.per_key if chain is not None else -1
        self.dram = dram
        self.counters = counters
        self._sweep = sweep
        self._tier_names = ([tier_hits(chain.name(lv)) for lv in range(len(chain.levels))] if chain is not None
                            else [tier_hits(dram.name)])
        """The hit counter of each level (0: DRAM)."""

    def _lookup(self, tenant: str, key: bytes, kind: int, fs: FsView | None = None) -> Entry | None:
        """The committed object of ``key``, or one adopted from ``fs``: the headers of the
        shared-fs files of unknown keys, located without the lock (:meth:`_locate_sharedfs`)."""
        e = self._index.get(tenant, key, kind)
        if e is not None and e.state == COMMITTED:
            return e  # type: ignore[return-value]
        if e is None and fs is not None and kind == pb.BLOCK:
            loc = fs.found.get(key)
            if loc is not None:
                return self._adopt_sharedfs(tenant, key, loc, fs.since)
        return None

    def _locate_sharedfs(self, tenant: str, keys: list[bytes], kind: int, prefix_only: bool) -> FsView | None:
        """The shared-fs files of those ``keys`` this node does not hold, located without the
        lock for at most ``tier_read_seconds`` (``TierChain.locate_files``; what is not located
        by then is a miss); with ``prefix_only`` up to the first key with no file."""
        if self._fs < 0 or self.chain is None or kind != pb.BLOCK:
            return None
        with self._lock:
            missing = self._index.unknown(tenant, keys)
            salt = self.tenants.fs_salt(tenant) if missing else b""
        if not missing:
            return None
        return self.chain.locate_files(tenant, salt, missing, prefix_only, self.cfg.tier_read_seconds)

    def _adopt_sharedfs(self, tenant: str, key: bytes, loc: Location, since: float) -> Entry | None:
        """A shared-filesystem object written by any node (or a previous life) becomes known;
        ``loc``: its file, located off the lock from ``since`` (a block; sealed when this node
        encrypts at rest, in the clear when not: a file in the clear is not trusted by an
        encrypting node, anyone with write access to the mount could have planted it)."""
        assert self.chain is not None
        if not self.chain.may_adopt(tenant, key, since):
            return None  # the file of an object removed here (its unlink on its way, or done since)
        if not 0 < loc.size <= min(self.cfg.max_object_bytes, self.dram.capacity):
            return None  # a damaged header must not make the node evict DRAM for a phantom
        e = Entry(key, tenant, pb.BLOCK, "", loc.size)
        # Its checksum is the first promotion's (the tier verifies the file: header, tag).
        e.state, e.tier, e.below, e.fs = COMMITTED, self._fs, loc, loc
        self.tenants[tenant].objects += 1
        self._index.adopt(e)
        return e

    def exists(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK, prefix_only: bool = True,
               pin: bool = False, lease_ms: int = 0) -> tuple[int, bytes, Lease[Entry] | None]:
        """Longest present prefix and per-key presence; optionally pin the prefix."""
        check_kind(kind)
        fs = self._locate_sharedfs(tenant, keys, kind, prefix_only)
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
            # The matched prefix are the hits; the misses are counted for the first key missing.
            matched = hits[:prefix]
            self._count_lookup(tenant, len(keys), self._levels(matched), keys[prefix] if prefix < len(keys) else None)
            lease = (self._index.new_lease(matched, self._lease_expiry(lease_ms, now), tenant, lazy=True)
                     if pin and prefix else None)
            return prefix, bytes(present), lease

    def _lease_expiry(self, lease_ms: int, now: float) -> float:
        return now + min(lease_ms or self.cfg.lease_ms_default, self.cfg.lease_ms_max) / 1000.0

    def _promote_for_read(self, tenant: str, keys: list[bytes], kind: int) -> Promoted:
        """Bring a read's objects that are below DRAM up, without the lock, waiting at most
        ``tier_read_seconds``: id(entry) → code of those that failed (``TierChain.promote``),
        and the read's objects, pinned meanwhile (making room for one must not demote
        another); :meth:`_hold_found` unpins them."""
        if self.chain is None:
            return {}, [], {}
        fs = self._locate_sharedfs(tenant, keys, kind, prefix_only=False)
        with self._lock:
            found = [e for e in (self._lookup(tenant, k, kind, fs) for k in keys) if e is not None]
            # Pinned even when all are in DRAM: a demotion in flight would otherwise move one down
            # before the read's own pass marks it (then a miss).
            self._index.pin(found)
            if all(e.tier == ARENA for e in found):
                return {}, found, {}
            below = {id(e): e.tier for e in found if e.tier != ARENA}
        return self._promote_pinned(found, self.cfg.tier_read_seconds), found, below

    def _promote_pinned(self, pinned: list[Entry], timeout: float) -> dict[int, int]:
        """``TierChain.promote`` of objects the caller pinned (unpinned here if it raises)."""
        assert self.chain is not None
        try:
            return self.chain.promote(pinned, timeout, self.cfg.high_watermark, self.cfg.low_watermark)
        except BaseException:
            with self._lock:
                self._index.unpin_all(pinned)
            raise

    def _hold_found(self, tenant: str, keys: list[bytes], kind: int, drop_lease_id: int,
                    now: float, promoted: Promoted, whole: bool) -> tuple[list[pb.Code], list[Entry | None]]:
        """Look up each object of a read and mark it in flight (``inflight`` + 1, until
        :meth:`read_unpin`); drop the caller's ``drop_lease_id`` (a match lease the read
        supersedes).  An object below DRAM (its promotion, :meth:`_promote_for_read`, failed or
        is still on its way) is a miss: no tier I/O here.  Caller holds the lock."""
        failed, held, below = promoted
        self._sweep(now)
        codes = [pb.OK] * len(keys)
        found: list[Entry | None] = self._index.lookup(tenant, keys, kind)  # type: ignore[assignment]
        hit: list[Entry] = []
        missed: list[tuple[int, MissReason | None]] = []  # None: not held here (its reason is Gone's)
        for i, e in enumerate(found):
            if e is None:
                codes[i] = pb.NOT_FOUND
                missed.append((i, None))
            elif e.tier != ARENA:
                codes[i] = pb.Code.ValueType(failed.get(id(e), pb.NOT_FOUND))
                found[i] = None
                missed.append((i, promotion_miss(codes[i])))
            else:
                e.inflight += 1
                hit.append(e)
        self._index.touch_all(hit, now, ARENA)
        hits = len(hit)
        self._index.unpin_all(held)  # the promotion's hold: the read's own marks are taken
        self.counters[StoreCounter.GET_BLOCKS] += len(keys)
        self.counters[StoreCounter.GET_HITS] += hits
        t = self.tenants[tenant]
        if hit and whole:
            t.count(self.counters, StoreCounter.BYTES_SENT, sum(map(_SIZE_OF, hit)))
        old = self._index.lease(drop_lease_id) if drop_lease_id else None
        if old is not None and old.tenant == tenant:
            self._index.drop_lease(old)
        else:
            # Not the read of a match made here (whose Exists counted these blocks): the read
            # is the lookup.  Hits by the level they were found in (promoted ones: before).
            levels = [0] * len(self._tier_names)
            came_up = [lv for eid, lv in below.items() if eid not in failed]
            for lv in came_up:
                levels[lv] += 1
            levels[ARENA] = max(0, hits - len(came_up))
            self._count_lookup(tenant, len(keys), levels, None)
            # A promotion that failed its check dropped the object: its key's failure says why.
            dropped = {e.key: promotion_miss(failed[id(e)]) for e in held if id(e) in failed} if failed else {}
            reasons = Counter(why or dropped.get(keys[i]) or self.gone.reason(tenant, keys[i]) for i, why in missed)
            for why, n in reasons.items():  # counted once per reason, not per key
                t.count(self.counters, _MISS[why], n)
        return codes, found

    def _levels(self, hits: list[Entry]) -> list[int]:
        """How many of ``hits`` are in each level (C-level counts: no per-key Python)."""
        if len(self._tier_names) == 1:
            return [len(hits)]
        tiers = list(map(_TIER_OF, hits))
        return [tiers.count(lv) for lv in range(len(self._tier_names))]

    def _count_lookup(self, tenant: str, asked: int, levels: list[int], first_missing: bytes | None) -> None:
        """Count a lookup in the hit rate the node reports (``hit_blocks`` / ``lookup_blocks`` of
        Stats, summed into the pool's ``hitRate`` by the operator), for the node and ``tenant``,
        with the hits by the level they were found in (``levels``) and, given ``first_missing``,
        the misses under that key's reason (:class:`~kvpool.store.gone.Gone`).  Block-weighted:
        every key asked counts once per request, hits are the keys found.  An Exists counts (its
        matched prefix are the hits), and so does a read, except the read of a match's lease: the
        match counted those blocks already, so a match-then-read counts each block once.  Lock held."""
        hits = sum(levels)
        t = self.tenants[tenant]
        t.count(self.counters, StoreCounter.LOOKUP_BLOCKS, asked)
        t.count(self.counters, StoreCounter.HIT_BLOCKS, hits)
        for lv, n in enumerate(levels):
            if n:
                t.count(self.counters, self._tier_names[lv], n)
        if first_missing is not None and asked > hits:
            t.count(self.counters, _MISS[self.gone.reason(tenant, first_missing)], asked - hits)

    def read_pin(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK,
                 drop_lease_id: int = 0, whole: bool = True) -> tuple[list[pb.Code], list[Entry | None]]:
        """The committed objects of ``keys``, promoted to DRAM, for a transfer that happens right
        now on the caller's own connection (the data session): objects below DRAM are promoted
        first, without the lock and for at most ``tier_read_seconds`` (the rest are misses);
        each found object then stays in flight, so neither eviction nor a removal can recycle
        its extent, until :meth:`read_unpin`.

        An in-flight mark, not a pin: a removal that lands while the reply is still being sent
        succeeds (the extent is freed after the send, as an unlinked open file), rather than the
        caller who just got its bytes seeing IN_FLIGHT for its own read."""
        check_kind(kind)
        promoted = self._promote_for_read(tenant, keys, kind)
        with self._lock:
            return self._hold_found(tenant, keys, kind, drop_lease_id, time.time(), promoted, whole)

    def read_objects(self, entries: Sequence[Entry], sink: Callable[[list[Entry], list[memoryview]], None]) -> int:
        """Hand several objects' bytes to ``sink`` at once (``StoreNode.read_objects``); how many."""
        held: list[Entry] = []
        views: list[memoryview] = []
        pinned: list[Entry] = []
        if self.chain is not None:
            with self._lock:  # pinned, so making room for one never demotes another of the batch
                pinned = [e for e in entries if e.state == COMMITTED]
                self._index.pin(pinned)
            # A background push (drain, warm-up): it may wait for a slow disk longer than a read.
            self._promote_pinned(pinned, max(self.cfg.tier_read_seconds, 30.0))
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

    def read_unpin(self, found: Sequence[Entry | None]) -> None:
        with self._lock:
            for e in found:
                if e is not None:
                    self._index.release_inflight(e)  # removed while it was being sent: freed now
