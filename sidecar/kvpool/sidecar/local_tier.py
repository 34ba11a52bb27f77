"""The sidecar's local tier: a shared-memory arena mapped by the sidecar and its clients.

Objects are immutable once committed; a client reads them in place (zero copy) while a lease
pins them, and writes cost one copy into a reserved extent.  LRU eviction between watermarks
never touches pinned, reserved or in-flight objects; objects that exist only here (state
objects, write-back blocks) are handed to an ``on_evict`` hook first so they can be flushed.
One lock guards the index; bytes are copied under it only when a dirty object is evicted.
A sidecar's tier is persistent (``socket_path``): the arena is a named file with a journal
that a restarted sidecar adopts (:mod:`kvpool.sidecar.journal`, :meth:`LocalTier.adopt`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpool.arena.allocator import OutOfSpace
from kvpool.arena.dram import DramTier
from kvpool.arena.eviction import watermark_need
from kvpool.arena.index import ARENA, COMMITTED, DEAD, RESERVED, ArenaIndex, Entry, Lease
from kvpool.core.checksum import checksum
from kvpool.core.sizing import payload_arena_bytes
from kvpool.sidecar.journal import FLAG_DIRTY, FLAG_POOLED, FREE, AdoptionPlan, Journal, PersistentArena
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

_PART = ""
"""The local tier's one partition of its index (a sidecar serves one tenant)."""


class LocalEntry(Entry):
    """An object of the local tier: an index entry and what the pool knows of it."""

    __slots__ = ("pooled", "dirty")

    def __init__(self, key: bytes, kind: int, traffic_class: str, size: int, offset: int) -> None:
        super().__init__(key, _PART, kind, traffic_class, size, offset)
        self.pooled = False   # the pool is known to hold it: never re-send
        self.dirty = False    # exists only here and must reach the pool (write-back, state)


LocalLease = Lease[LocalEntry]


class LocalTier:
    def __init__(self, capacity: int, directory: str, label: str = "sidecar",
                 high_watermark: float = 0.95, low_watermark: float = 0.85,
                 reservation_seconds: float = 30.0, socket_path: str = "", tenant: str = "") -> None:
        # ``capacity`` is a payload capacity: that much fits before eviction starts.
        size = payload_arena_bytes(capacity, high_watermark)
        self.arena: DramTier | PersistentArena = (
            PersistentArena(size, directory, socket_path, tenant) if socket_path
            else DramTier(size, directory, label=label, keep_path=True))
        self.journal: Journal | None = self.arena.journal if isinstance(self.arena, PersistentArena) else None
        """With ``socket_path``: the arena is a named file with a journal, which a restarted
        sidecar adopts (:meth:`adopt`, :mod:`kvpool.sidecar.journal`)."""
        self.capacity = self.arena.capacity
        self.high, self.low = high_watermark, low_watermark
        self.reservation_seconds = reservation_seconds
        self._lock = threading.RLock()
        # Clients read views of the arena in place, unguarded: a lease's pin keeps an extent.
        self._index = ArenaIndex([self.arena.alloc], pins_hold_extent=True)
        self.counters: Counter[str] = Counter()
        self.on_evict: Callable[[list[tuple[LocalEntry, bytes]]], None] | None = None
        self.events: Any = None
        """A :class:`kvpool.wire.kv_events.EventPublisher` told of every block stored and removed here
        (under this lock: its hooks only append to a list)."""

    @property
    def used(self) -> int:
        return self.arena.alloc.used

    def objects(self) -> int:
        """Committed objects held."""
        with self._lock:
            return self._index.count()

    def view(self, e: Entry) -> memoryview:
        return self.arena.slice(e.offset, e.size)

    # -- leases -------------------------------------------------------------------------------

    def _sweep(self, now: float) -> None:
        for e in self._index.sweep(now)[1]:
            self._forget(e)  # type: ignore[arg-type]
            self.counters[SidecarCounter.RESERVATIONS_EXPIRED] += 1

    def _new_lease(self, entries: list[LocalEntry], lease_ms: int, now: float) -> LocalLease:
        # Under the lock: pinning must be atomic with the lookup that found the entries, or a
        # concurrent eviction could free (and a put reuse) an extent between the two.
        return self._index.new_lease(entries, now + max(lease_ms, 1) / 1000.0)

    def lease(self, entries: list[LocalEntry], lease_ms: int) -> LocalLease:
        """Pin those of ``entries`` that are still live (an evicted one is left out: its extent
        may already belong to another object)."""
        with self._lock:
            return self._new_lease([e for e in entries if e.state == COMMITTED], lease_ms, time.time())

    def release(self, lease_ids: Sequence[int]) -> None:
        with self._lock:
            self._index.release(lease_ids)

    def pin_live(self, e: LocalEntry) -> bool:
        """One more pin on a committed ``e`` (a transfer guard's: :meth:`unpin` drops it); False
        when it is gone."""
        with self._lock:
            if e.state != COMMITTED:
                return False
            e.pins += 1
            return True

    def unpin(self, e: Entry) -> None:
        """Drop one pin taken by hand (:meth:`pin_live`); frees a dead extent."""
        with self._lock:
            self._index.unpin(e)

    # -- lookups ------------------------------------------------------------------------------

    def match_prefix(self, key_array: npt.NDArray[np.void], lease_ms: int = 0) -> tuple[int, LocalLease | None]:
        """Leading run of keys (an array of 32-byte voids, the wire form) held locally
        (committed blocks), pinned by a lease when ``lease_ms``."""
        with self._lock:
            if not len(key_array) or not self._index.has_block(_PART, key_array[0].tobytes()):
                # The common miss of a sidecar that never saw this prefix: no scan, and the
                # keys are not even split into bytes objects (~15 us per 1000 keys).
                return 0, None
            found = self._index.match_blocks(_PART, key_array.tolist())
            n = len(found) if all(found) else found.index(None)  # all(): see StoreNode.exists
            hits: list[LocalEntry] = found[:n]  # type: ignore[assignment]
            now = time.time()
            self._index.touch_all(hits, now, ARENA)
            lease = self._new_lease(hits, lease_ms, now) if lease_ms and hits else None
            return n, lease

    def lookup(self, keys: list[bytes], kind: int, lease_ms: int = 0
               ) -> tuple[list[LocalEntry | None], LocalLease | None]:
        """Committed objects (None where absent); with ``lease_ms`` a lease pins what was found
        (possibly nothing yet: :meth:`insert_fetched` adds to it)."""
        with self._lock:
            now = time.time()
            self._sweep(now)
            out: list[LocalEntry | None] = self._index.lookup(_PART, keys, kind)  # type: ignore[assignment]
            hits = [e for e in out if e is not None]
            self._index.touch_all(hits, now, ARENA)
            lease = self._new_lease(hits, lease_ms, now) if lease_ms else None
            return out, lease

    # -- writes -------------------------------------------------------------------------------

    def reserve(self, keys: list[bytes], sizes: Sequence[int], kind: int, traffic_class: str,
                ) -> tuple[list[pb.Code], list[LocalEntry | None], int]:
        """Extents for a batch: per-item codes, entries (None where not reserved), reservation id."""
        now = time.time()
        entries: list[LocalEntry | None] = [None] * len(keys)
        evicted: list[tuple[LocalEntry, bytes]] = []
        idx = self._index
        with self._lock:
            self._sweep(now)
            olds = idx.get_many(_PART, keys, kind)
            codes, incoming = _admit(keys, sizes, olds, self.arena.alloc.rounded, self.capacity)
            for e, c in zip(olds, codes, strict=True):
                if e is not None and c in (pb.ALREADY_EXISTS, pb.IN_FLIGHT):
                    e.last_access = now
            need = watermark_need(self.used, incoming, self.capacity, self.high, self.low)
            if need:
                self._evict(need, evicted, whole=False)
            expires = now + self.reservation_seconds
            seen: set[bytes] = set()
            for i, (k, s) in enumerate(zip(keys, sizes, strict=True)):
                if codes[i] != pb.OK:
                    continue
                if k in seen:  # duplicate inside the batch
                    codes[i] = pb.INVALID
                    continue
                try:
                    off = self._alloc_evicting(s, evicted)
                except OutOfSpace:
                    codes[i] = pb.NO_SPACE
                    self.counters[SidecarCounter.REFUSED_SPACE] += 1
                    continue
                e = LocalEntry(k, kind, traffic_class, s, off)
                e.expires = expires
                idx.reserve(e)
                entries[i] = e
                seen.add(k)
            if self.journal is not None:
                self.journal.reserved([e for e in entries if e is not None])
            rid = (idx.open_reservation(_PART, entries, expires)  # type: ignore[arg-type]
                   if any(e is not None for e in entries) else 0)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return codes, entries, rid

    def reservation_entries(self, rid: int) -> list[LocalEntry | None] | None:
        """The entries of an open reservation (a copy), None when it is gone."""
        with self._lock:
            res = self._index.reservation(rid)
            return list(res.entries) if res is not None else None  # type: ignore[arg-type]

    def commit(self, rid: int, checksums: Sequence[int], dirty: bool, pooled: bool = False, pin_ms: int = 0
               ) -> tuple[list[pb.Code], list[LocalEntry], LocalLease | None]:
        """Publish a reservation's extents; with ``pin_ms`` the published entries are pinned in
        the same step (the write-through queue holds them until they reach the pool)."""
        with self._lock:
            res = self._index.reservation(rid)
            if res is None:
                return [pb.LEASE_EXPIRED] * len(checksums), [], None
            entries: list[LocalEntry | None] = res.entries  # type: ignore[assignment]
            if len(checksums) != len(entries):
                raise ValueError(f"{len(checksums)} checksums for {len(entries)} items")
            self._index.close_reservation(rid)
            codes = [pb.OK] * len(entries)
            done: list[LocalEntry] = []
            now = time.time()
            for i, e in enumerate(entries):
                if e is None:
                    codes[i] = pb.INVALID
                    continue
                if e.state != RESERVED:
                    codes[i] = pb.LEASE_EXPIRED
                    continue
                self._publish(e, checksums[i], dirty, pooled, now)
                done.append(e)
            if self.journal is not None:
                self.journal.committed(done)
            lease = self._new_lease(list(done), pin_ms, now) if pin_ms and done else None
            return codes, done, lease

    def _publish(self, e: LocalEntry, csum: int, dirty: bool, pooled: bool, now: float) -> None:
        e.checksum = csum
        e.dirty = dirty
        e.pooled = pooled
        self._index.publish(e, now)
        if e.kind == pb.BLOCK and self.events is not None:
            self.events.stored(e.key)
        self.counters[SidecarCounter.STORED] += 1

    def insert_fetched(self, e: LocalEntry, csum: int, lease: LocalLease | None = None) -> None:
        """An object fetched from the pool into an extent from :meth:`reserve_one`; pinned by
        ``lease`` (when it is still live) in the same step that makes it evictable."""
        with self._lock:
            self._publish(e, csum, dirty=False, pooled=True, now=time.time())
            if self.journal is not None:
                self.journal.committed([e])
            if lease is not None and self._index.live(lease):
                self._index.add_to_lease(lease, e)

    def reserve_one(self, key: bytes, size: int, kind: int) -> tuple[pb.Code, LocalEntry | None]:
        """An extent for one object fetched from the pool (no reservation timer: the fetcher
        publishes or abandons it); the code says why there is none (IN_FLIGHT: being fetched)."""
        codes, entries, rid = self.reserve([key], [size], kind, "")
        with self._lock:
            self._index.close_reservation(rid)
        return codes[0], entries[0]

    def pin_into(self, lease: LocalLease, keys: Sequence[bytes], kind: int) -> tuple[list[LocalEntry | None], int]:
        """Committed objects among ``keys`` added to a live ``lease``; also how many are still
        reserved (in flight: a concurrent fetch or put that has not committed yet)."""
        out: list[LocalEntry | None] = []
        pending = 0
        idx = self._index
        with self._lock:
            live = idx.live(lease)
            now = time.time()
            for k in keys:
                e = idx.get(_PART, k, kind)
                if isinstance(e, LocalEntry) and e.state == COMMITTED and live:
                    idx.add_to_lease(lease, e)
                    idx.touch(e, now)
                    out.append(e)
                else:
                    pending += e is not None and e.state == RESERVED
                    out.append(None)
        return out, pending

    def scratch(self, sizes: Sequence[int], lease: LocalLease) -> list[LocalEntry | None]:
        """Arena extents outside the index, for bytes that are not whole objects (the ranges of a
        sparse read fetched from the pool): never matched, cached or evicted; held by ``lease``
        and by the fetch itself (two pins), so a lease that expires while the bytes are still
        landing cannot free the extent under them (:meth:`scratch_done` drops the fetch's pin).
        None where there is no room (even after evicting cached objects) or the lease is gone."""
        out: list[LocalEntry | None] = []
        evicted: list[tuple[LocalEntry, bytes]] = []
        with self._lock:
            live = self._index.live(lease)
            for s in sizes:
                if not live or s <= 0 or self.arena.alloc.rounded(s) > self.capacity:
                    out.append(None)
                    continue
                try:
                    off = self._alloc_evicting(s, evicted)
                except OutOfSpace:
                    self.counters[SidecarCounter.REFUSED_SPACE] += 1
                    out.append(None)
                    continue
                e = LocalEntry(b"", -1, "", s, off)
                e.state = DEAD  # freed by the last unpin, as a removed object would be
                self._index.add_to_lease(lease, e, pins=2)
                out.append(e)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return out

    def scratch_done(self, e: LocalEntry, lease: LocalLease, keep: bool) -> bool:
        """The fetch into scratch ``e`` ended; unless ``keep`` (its bytes go to the client) the
        lease lets go of it at once too.  False when the bytes cannot be handed out: the lease
        expired meanwhile, so the extent is free (and may be reused) the moment this returns."""
        with self._lock:
            live = self._index.live(lease)
            pins = 2 if not keep and self._index.drop_from_lease(lease, e) else 1
            self._index.unpin(e, pins)
            return keep and live

    def abandon(self, e: LocalEntry) -> None:
        with self._lock:
            if e.state == RESERVED:
                self._forget(e)

    def remove(self, keys: list[bytes], kind: int) -> list[pb.Code]:
        with self._lock:
            codes: list[pb.Code] = []
            for e in self._index.lookup(_PART, keys, kind):
                if e is None:
                    codes.append(pb.NOT_FOUND)
                else:
                    self._forget(e)  # type: ignore[arg-type]
                    codes.append(pb.OK)
            return codes

    def _forget(self, e: LocalEntry) -> None:
        if e.state == DEAD:
            return
        if self.events is not None and e.state == COMMITTED and e.kind == pb.BLOCK:
            self.events.removed(e.key)
        if self.journal is not None:
            self.journal.freed(e.offset)
        self._index.forget(e)

    def _alloc_evicting(self, size: int, evicted: list[tuple[LocalEntry, bytes]]) -> int:
        """Allocate, evicting least-recently-used objects until a *contiguous* extent is free:
        freeing ``size`` bytes in total is not enough when the free space is fragmented."""
        try:
            return self.arena.alloc.alloc(size)
        except OutOfSpace:
            self._evict(self.arena.alloc.rounded(size), evicted, whole=True)
        return self.arena.alloc.alloc(size)

    def _evict(self, need: int, out: list[tuple[LocalEntry, bytes]], whole: bool) -> None:
        """Free LRU victims now until ``need`` bytes were freed (``whole``: until a free extent
        of ``need`` bytes exists); dirty ones (only here) leave a copy for the ``on_evict``
        hook, which pushes them to the pool outside the lock."""
        alloc = self.arena.alloc
        freed = 0
        for e in self._index.lru():
            if (alloc.largest_free if whole else freed) >= need:
                break
            if e.pins:
                continue
            assert isinstance(e, LocalEntry)
            if e.dirty:
                out.append((e, bytes(self.view(e))))
            self._forget(e)
            freed += e.size
            self.counters[SidecarCounter.EVICTED] += 1

    def mark_dirty(self, entries: Sequence[LocalEntry]) -> None:
        """These objects now exist only here (a deferred pool write): eviction hands them over."""
        with self._lock:
            for e in entries:
                if e.state == COMMITTED and not e.pooled:
                    e.dirty = True
            self.note_flags(entries)

    def mark_local_only(self, e: LocalEntry, dirty: bool) -> None:
        """An object fetched from a peer, not the pool: never assumed pooled; ``dirty`` hands it
        over on eviction and drain."""
        with self._lock:
            if e.state == COMMITTED:
                e.pooled = False
                e.dirty = dirty
                self.note_flags([e])

    def local_only(self) -> list[LocalEntry]:
        """Objects that exist only here (dirty): what SIGTERM must flush, hottest first."""
        with self._lock:
            out: list[LocalEntry] = [e for e in self._index.lru() if e.dirty]  # type: ignore[attr-defined,misc]
        out.sort(key=lambda e: e.last_access, reverse=True)
        return out

    def events_snapshot(self) -> tuple[list[bytes], list[tuple[int, bytes]]]:
        """Every block held now and the events not yet published, taken together (exact)."""
        with self._lock:
            return self._index.block_keys(_PART), self.events.take_pending() if self.events is not None else []

    def close(self) -> None:
        self.arena.close()

    # -- persistence (kvpool.sidecar.journal) -----------------------------------------------------

    def note_flags(self, entries: Sequence[LocalEntry]) -> None:
        """Journal the dirty/pooled flags of those of ``entries`` still here (the pool writer
        calls it after a write: a restart then does not send them again)."""
        if self.journal is None:
            return
        with self._lock:
            self.journal.flags([e for e in entries if e.state == COMMITTED])

    def adopt(self, grace_ms: int) -> tuple[list[LocalEntry], dict[str, int]]:
        """Take over the objects a previous life left in the arena (when it was adopted):
        each committed object whose bytes match its checksum is indexed again; the rest is
        dropped.  Adopted objects stay pinned for ``grace_ms`` (a client of the old life may
        still read views of them) and the extents of uncommitted writes stay out of use for the
        reservation time (a client of the old life may still be copying into them).  Returns
        the adopted entries and counts (``restart_*``)."""
        arena = self.arena
        if not isinstance(arena, PersistentArena) or arena.opened.plan is None:
            return [], {}
        plan = arena.opened.plan
        kept, extents, quarantine, torn = _survivors(arena, plan)
        align = arena.alloc.align
        now = time.time()
        with self._lock:
            self.arena.alloc = type(self.arena.alloc).with_allocated(self.capacity, align, extents)
            self._index.set_alloc(0, self.arena.alloc)
            for e in kept:
                e.last_access = now
                self._index.adopt(e)
                if e.kind == pb.BLOCK and self.events is not None:
                    self.events.stored(e.key)
            if kept:
                self._new_lease(kept, grace_ms, now)
            if quarantine:
                self._new_lease(quarantine, int(self.reservation_seconds * 1000), now)
        counts = _restart_counts(kept, quarantine, torn, plan)
        self.counters.update(counts)
        return kept, counts


def _survivors(arena: PersistentArena, plan: AdoptionPlan
               ) -> tuple[list[LocalEntry], list[tuple[int, int]], list[LocalEntry], int]:
    """What a previous life's journal leaves (:meth:`LocalTier.adopt`): the committed objects
    whose bytes match their checksums, the extents to keep allocated (theirs and the quarantined
    uncommitted writes'), the quarantine (dead entries) and how many objects were torn.  Marks
    every other slot of the journal free."""
    slots = arena.journal.slots
    kept: list[LocalEntry] = []
    torn = 0
    align = arena.alloc.align
    for i in plan.candidates.tolist():
        r = slots[i]
        off, size = int(r["offset"]), int(r["size"])
        if checksum(arena.slice(off, size)) != int(r["checksum"]):
            torn += 1
            continue
        e = LocalEntry(bytes(r["key"]), int(r["kind"]), r["tclass"].decode("utf-8", "replace"), size, off)
        e.checksum = int(r["checksum"])
        e.state = COMMITTED
        e.dirty = bool(r["flags"] & FLAG_DIRTY)
        e.pooled = bool(r["flags"] & FLAG_POOLED)
        kept.append(e)
    # Uncommitted extents that do not overlap a kept object: quarantined, then free.
    rounded = arena.alloc.rounded
    spans: list[tuple[int, int, LocalEntry | None]] = [(e.offset, rounded(e.size), e) for e in kept]
    for i in plan.reserved.tolist():
        off, size = int(slots["offset"][i]), int(slots["size"][i])
        if off == i * align and 0 < size <= arena.capacity:
            spans.append((off, rounded(size), None))
    spans.sort(key=lambda t: (t[0], t[2] is None))  # an object before a reservation at its offset
    extents: list[tuple[int, int]] = []
    quarantine: list[LocalEntry] = []
    end = 0
    for off, size, owner in spans:
        if off < end or off + size > arena.capacity:
            if owner is not None:  # cannot happen: plan_adoption dropped overlapping objects
                kept.remove(owner)
                torn += 1
            continue
        extents.append((off, size))
        end = off + size
        if owner is None:
            q = LocalEntry(b"", -1, "", size, off)
            q.state = DEAD
            quarantine.append(q)
    # Every slot but the kept objects' is free now (the quarantine lives in memory only).
    keep = np.zeros(len(slots), bool)
    keep[[e.offset // align for e in kept]] = True
    slots["state"][~keep] = FREE
    return kept, extents, quarantine, torn


def _admit(keys: Sequence[bytes], sizes: Sequence[int], olds: Sequence[Entry | None],
           rounded: Callable[[int], int], capacity: int) -> tuple[list[pb.Code], int]:
    """Which items of a write may reserve (``olds``: the entries their keys have now): per-item
    codes and the bytes the admitted ones need."""
    codes = [pb.OK] * len(keys)
    incoming = 0
    for i, (k, s, old) in enumerate(zip(keys, sizes, olds, strict=True)):
        if s <= 0 or len(k) != 32:
            codes[i] = pb.INVALID
        elif rounded(s) > capacity:
            codes[i] = pb.TOO_LARGE
        elif old is not None:
            codes[i] = pb.ALREADY_EXISTS if old.state == COMMITTED else pb.IN_FLIGHT
        else:
            incoming += rounded(s)
    return codes, incoming


def _restart_counts(kept: list[LocalEntry], quarantine: list[LocalEntry], torn: int, plan: AdoptionPlan
                    ) -> dict[str, int]:
    return {SidecarCounter.RESTART_ADOPTED_OBJECTS: len(kept),
            SidecarCounter.RESTART_ADOPTED_BYTES: sum(e.size for e in kept),
            SidecarCounter.RESTART_DROPPED_CHECKSUM: torn,
            SidecarCounter.RESTART_DROPPED_UNCOMMITTED: len(plan.reserved),
            SidecarCounter.RESTART_DROPPED_INCOHERENT: len(plan.incoherent),
            SidecarCounter.RESTART_DROPPED_OBJECTS: torn + len(plan.reserved) + len(plan.incoherent),
            SidecarCounter.RESTART_QUARANTINED_BYTES: sum(q.size for q in quarantine)}
