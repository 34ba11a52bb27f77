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

import heapq
import itertools
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpool.arena.allocator import OutOfSpace
from kvpool.arena.dram import DramTier
from kvpool.arena.eviction import watermark_need
from kvpool.core.checksum import checksum
from kvpool.core.sizing import payload_arena_bytes
from kvpool.sidecar.journal import FLAG_DIRTY, FLAG_POOLED, FREE, Journal, PersistentArena, new_id
from kvpool.wire.proto import store_pb2 as pb

RESERVED, COMMITTED, DEAD = 0, 1, 2


class LocalEntry:
    __slots__ = ("key", "kind", "traffic_class", "size", "checksum", "offset", "state", "pins",
                 "pooled", "dirty", "last_access", "expires")


    def __init__(self, key: bytes, kind: int, traffic_class: str, size: int, offset: int) -> None:
        self.key = key
        self.kind = kind
        self.traffic_class = traffic_class
        self.size = size
        self.checksum = 0
        self.offset = offset
        self.state = RESERVED
        self.pins = 0
        self.pooled = False   # the pool is known to hold it: never re-send
        self.dirty = False    # exists only here and must reach the pool (write-back, state)
        self.last_access = time.time()
        self.expires = 0.0


@dataclass
class LocalLease:
    lease_id: int
    expires: float
    entries: list[LocalEntry]


class LocalTier:
    def __init__(self, capacity: int, directory: str, label: str = "sidecar",
                 high_watermark: float = 0.95, low_watermark: float = 0.85,
                 reservation_seconds: float = 30.0, socket_path: str = "", tenant: str = "") -> None:
        # ``capacity`` is a payload capacity: that much fits before eviction starts.
        self.arena: DramTier | PersistentArena
        self.journal: Journal | None = None
        """With ``socket_path``: the arena is a named file with a journal, which a restarted
        sidecar adopts (:meth:`adopt`, :mod:`kvpool.sidecar.journal`)."""
        if socket_path:
            self.arena = PersistentArena(payload_arena_bytes(capacity, high_watermark), directory, socket_path,
                                         tenant)
            self.journal = self.arena.journal
        else:
            self.arena = DramTier(payload_arena_bytes(capacity, high_watermark), directory, label=label,
                                  keep_path=True)
        self.capacity = self.arena.capacity
        self.high, self.low = high_watermark, low_watermark
        self.reservation_seconds = reservation_seconds
        self.lock = threading.RLock()
        self.index: dict[tuple[int, bytes], LocalEntry] = {}
        self.blocks: dict[bytes, LocalEntry] = {}  # kind BLOCK, committed: the match fast path
        self.lru: OrderedDict[int, LocalEntry] = OrderedDict()
        self.leases: dict[int, LocalLease] = {}
        self._heap: list[tuple[float, int]] = []
        self.reservations: dict[int, tuple[float, list[LocalEntry | None]]] = {}
        self._res_heap: list[tuple[float, int]] = []
        self._ids = itertools.count(new_id() >> 2)  # random base: ids of a previous life name nothing
        self.counters: Counter[str] = Counter()
        self.on_evict: Callable[[list[tuple[LocalEntry, bytes]]], None] | None = None
        self.events: Any = None
        """A :class:`kvpool.wire.kv_events.EventPublisher` told of every block stored and removed here
        (under this lock: its hooks only append to a list)."""

    @property
    def used(self) -> int:
        return self.arena.alloc.used

    def view(self, e: LocalEntry) -> memoryview:
        return self.arena.slice(e.offset, e.size)

    # -- leases -------------------------------------------------------------------------------

    def _sweep(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            _, lid = heapq.heappop(self._heap)
            lease = self.leases.get(lid)
            if lease is not None and lease.expires <= now:
                self._drop_lease(lease)
        while self._res_heap and self._res_heap[0][0] <= now:
            _, rid = heapq.heappop(self._res_heap)
            res = self.reservations.pop(rid, None)
            for e in (res[1] if res else []):
                if e is not None and e.state == RESERVED:
                    self._forget(e)
                    self.counters["reservations_expired"] += 1

    def _drop_lease(self, lease: LocalLease) -> None:
        self.leases.pop(lease.lease_id, None)
        for e in lease.entries:
            self._unpin_locked(e)

    def _unpin_locked(self, e: LocalEntry) -> None:
        e.pins -= 1
        if e.pins == 0 and e.state == DEAD:
            self.arena.alloc.free(e.offset)  # removed or evicted while pinned: its extent goes now

    def _new_lease(self, entries: list[LocalEntry], lease_ms: int, now: float) -> LocalLease:
        # Under self.lock: pinning must be atomic with the lookup that found the entries, or a
        # concurrent eviction could free (and a put reuse) an extent between the two.
        lease = LocalLease(next(self._ids), now + max(lease_ms, 1) / 1000.0, entries)
        for e in entries:
            e.pins += 1
        self.leases[lease.lease_id] = lease
        heapq.heappush(self._heap, (lease.expires, lease.lease_id))
        return lease

    def lease(self, entries: list[LocalEntry], lease_ms: int) -> LocalLease:
        """Pin those of ``entries`` that are still live (an evicted one is left out: its extent
        may already belong to another object)."""
        with self.lock:
            return self._new_lease([e for e in entries if e.state == COMMITTED], lease_ms, time.time())

    def release(self, lease_ids: Sequence[int]) -> None:
        with self.lock:
            for lid in lease_ids:
                lease = self.leases.get(lid)
                if lease is not None:
                    self._drop_lease(lease)

    # -- lookups ------------------------------------------------------------------------------

    def match_prefix(self, key_array: npt.NDArray[np.void], lease_ms: int = 0) -> tuple[int, LocalLease | None]:
        """Leading run of keys (an array of 32-byte voids, the wire form) held locally
        (committed blocks), pinned by a lease when ``lease_ms``."""
        with self.lock:
            if not len(key_array) or key_array[0].tobytes() not in self.blocks:
                # The common miss of a sidecar that never saw this prefix: no scan, and the
                # keys are not even split into bytes objects (~15 us per 1000 keys).
                return 0, None
            found = list(map(self.blocks.get, key_array.tolist()))
            n = len(found) if all(found) else found.index(None)  # all(): see StoreNode.exists
            hits: list[LocalEntry] = found[:n]  # type: ignore[assignment]
            now = time.time()
            for e in hits:
                e.last_access = now
                self.lru.move_to_end(id(e))
            lease = self._new_lease(hits, lease_ms, now) if lease_ms and hits else None
            return n, lease

    def lookup(self, keys: list[bytes], kind: int, lease_ms: int = 0
               ) -> tuple[list[LocalEntry | None], LocalLease | None]:
        """Committed objects (None where absent); with ``lease_ms`` a lease pins what was found
        (possibly nothing yet: :meth:`insert_fetched` adds to it)."""
        with self.lock:
            now = time.time()
            self._sweep(now)
            out: list[LocalEntry | None] = []
            for k in keys:
                e = self.index.get((kind, k))
                if e is not None and e.state == COMMITTED:
                    e.last_access = now
                    self.lru.move_to_end(id(e))
                    out.append(e)
                else:
                    out.append(None)
            lease = self._new_lease([e for e in out if e is not None], lease_ms, now) if lease_ms else None
            return out, lease

    # -- writes -------------------------------------------------------------------------------

    def reserve(self, keys: list[bytes], sizes: Sequence[int], kind: int, traffic_class: str,
                ) -> tuple[list[pb.Code], list[LocalEntry | None], int]:
        """Extents for a batch: per-item codes, entries (None where not reserved), reservation id."""
        now = time.time()
        codes = [pb.OK] * len(keys)
        entries: list[LocalEntry | None] = [None] * len(keys)
        evicted: list[tuple[LocalEntry, bytes]] = []
        with self.lock:
            self._sweep(now)
            incoming = 0
            for i, (k, s) in enumerate(zip(keys, sizes, strict=True)):
                old = self.index.get((kind, k))
                if s <= 0 or len(k) != 32:
                    codes[i] = pb.INVALID
                elif self.arena.alloc.rounded(s) > self.capacity:
                    codes[i] = pb.TOO_LARGE
                elif old is not None:
                    codes[i] = pb.ALREADY_EXISTS if old.state == COMMITTED else pb.IN_FLIGHT
                    old.last_access = now
                else:
                    incoming += self.arena.alloc.rounded(s)
            need = watermark_need(self.used, incoming, self.capacity, self.high, self.low)
            if need:
                evicted += self._evict(need)
            for i, (k, s) in enumerate(zip(keys, sizes, strict=True)):
                if codes[i] != pb.OK:
                    continue
                if (kind, k) in self.index:  # duplicate inside the batch
                    codes[i] = pb.INVALID
                    continue
                try:
                    off = self._alloc_evicting(s, evicted)
                except OutOfSpace:
                    codes[i] = pb.NO_SPACE
                    self.counters["refused_space"] += 1
                    continue
                e = LocalEntry(k, kind, traffic_class, s, off)
                e.expires = now + self.reservation_seconds
                self.index[(kind, k)] = e
                entries[i] = e
            if self.journal is not None:
                self.journal.reserved([e for e in entries if e is not None])
            rid = 0
            if any(e is not None for e in entries):
                rid = next(self._ids)
                self.reservations[rid] = (now + self.reservation_seconds, entries)
                heapq.heappush(self._res_heap, (now + self.reservation_seconds, rid))
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return codes, entries, rid

    def commit(self, rid: int, checksums: Sequence[int], dirty: bool, pooled: bool = False, pin_ms: int = 0
               ) -> tuple[list[pb.Code], list[LocalEntry], LocalLease | None]:
        """Publish a reservation's extents; with ``pin_ms`` the published entries are pinned in
        the same step (the write-through queue holds them until they reach the pool)."""
        with self.lock:
            res = self.reservations.pop(rid, None)
            if res is None:
                return [pb.LEASE_EXPIRED] * len(checksums), [], None
            entries = res[1]
            if len(checksums) != len(entries):
                self.reservations[rid] = res
                raise ValueError(f"{len(checksums)} checksums for {len(entries)} items")
            codes = [pb.OK] * len(entries)
            done: list[LocalEntry] = []
            for i, e in enumerate(entries):
                if e is None:
                    codes[i] = pb.INVALID
                    continue
                if e.state != RESERVED:
                    codes[i] = pb.LEASE_EXPIRED
                    continue
                self._publish(e, checksums[i], dirty, pooled)
                done.append(e)
            if self.journal is not None:
                self.journal.committed(done)
            lease = self._new_lease(list(done), pin_ms, time.time()) if pin_ms and done else None
            return codes, done, lease

    def _publish(self, e: LocalEntry, csum: int, dirty: bool, pooled: bool) -> None:
        e.checksum = csum
        e.state = COMMITTED
        e.dirty = dirty
        e.pooled = pooled
        e.last_access = time.time()
        self.lru[id(e)] = e
        if e.kind == pb.BLOCK:
            self.blocks[e.key] = e
            if self.events is not None:
                self.events.stored(e.key)
        self.counters["stored"] += 1

    def insert_fetched(self, e: LocalEntry, csum: int, lease: LocalLease | None = None) -> None:
        """An object fetched from the pool into an extent from :meth:`reserve_one`; pinned by
        ``lease`` (when it is still live) in the same step that makes it evictable."""
        with self.lock:
            self._publish(e, csum, dirty=False, pooled=True)
            if self.journal is not None:
                self.journal.committed([e])
            if lease is not None and self.leases.get(lease.lease_id) is lease:
                lease.entries.append(e)
                e.pins += 1

    def reserve_one(self, key: bytes, size: int, kind: int) -> tuple[pb.Code, LocalEntry | None]:
        """An extent for one object fetched from the pool (no reservation timer: the fetcher
        publishes or abandons it); the code says why there is none (IN_FLIGHT: being fetched)."""
        codes, entries, rid = self.reserve([key], [size], kind, "")
        with self.lock:
            self.reservations.pop(rid, None)
        return codes[0], entries[0]

    def pin_into(self, lease: LocalLease, keys: Sequence[bytes], kind: int) -> tuple[list[LocalEntry | None], int]:
        """Committed objects among ``keys`` added to a live ``lease``; also how many are still
        reserved (in flight: a concurrent fetch or put that has not committed yet)."""
        out: list[LocalEntry | None] = []
        pending = 0
        with self.lock:
            live = self.leases.get(lease.lease_id) is lease
            now = time.time()
            for k in keys:
                e = self.index.get((kind, k))
                if e is not None and e.state == COMMITTED and live:
                    e.pins += 1
                    lease.entries.append(e)
                    e.last_access = now
                    self.lru.move_to_end(id(e))
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
        with self.lock:
            live = self.leases.get(lease.lease_id) is lease
            for s in sizes:
                if not live or s <= 0 or self.arena.alloc.rounded(s) > self.capacity:
                    out.append(None)
                    continue
                try:
                    off = self._alloc_evicting(s, evicted)
                except OutOfSpace:
                    self.counters["refused_space"] += 1
                    out.append(None)
                    continue
                e = LocalEntry(b"", -1, "", s, off)
                e.state = DEAD  # freed by the last unpin, as a removed object would be
                e.pins = 2
                lease.entries.append(e)
                out.append(e)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return out

    def scratch_done(self, e: LocalEntry, lease: LocalLease, keep: bool) -> bool:
        """The fetch into scratch ``e`` ended; unless ``keep`` (its bytes go to the client) the
        lease lets go of it at once too.  False when the bytes cannot be handed out: the lease
        expired meanwhile, so the extent is free (and may be reused) the moment this returns."""
        with self.lock:
            live = self.leases.get(lease.lease_id) is lease
            pins = 1
            if not keep and live and e in lease.entries:
                lease.entries.remove(e)
                pins = 2
            e.pins -= pins
            if e.pins == 0:
                self.arena.alloc.free(e.offset)
            return keep and live

    def revoke(self, rid: int) -> None:
        with self.lock:
            res = self.reservations.pop(rid, None)
            for e in (res[1] if res else []):
                if e is not None and e.state == RESERVED:
                    self._forget(e)

    def abandon(self, e: LocalEntry) -> None:
        with self.lock:
            if e.state == RESERVED:
                self._forget(e)

    def remove(self, keys: list[bytes], kind: int) -> list[pb.Code]:
        with self.lock:
            codes: list[pb.Code] = []
            for k in keys:
                e = self.index.get((kind, k))
                if e is None or e.state != COMMITTED:
                    codes.append(pb.NOT_FOUND)
                else:
                    self._forget(e)
                    codes.append(pb.OK)
            return codes

    def _forget(self, e: LocalEntry) -> None:
        if self.events is not None and e.state == COMMITTED and e.kind == pb.BLOCK:
            self.events.removed(e.key)
        if self.index.get((e.kind, e.key)) is e:
            del self.index[(e.kind, e.key)]
        if self.blocks.get(e.key) is e:
            del self.blocks[e.key]
        self.lru.pop(id(e), None)
        if self.journal is not None and e.state != DEAD:
            self.journal.freed(e.offset)
        e.state = DEAD
        if e.pins == 0:
            self.arena.alloc.free(e.offset)

    def _alloc_evicting(self, size: int, evicted: list[tuple[LocalEntry, bytes]]) -> int:
        """Allocate, evicting least-recently-used objects until a *contiguous* extent is free:
        freeing ``size`` bytes in total is not enough when the free space is fragmented."""
        alloc = self.arena.alloc
        try:
            return alloc.alloc(size)
        except OutOfSpace:
            pass
        need = alloc.rounded(size)
        for e in list(self.lru.values()):
            if alloc.largest_free >= need:
                break
            if e.pins:
                continue
            if e.dirty:
                evicted.append((e, bytes(self.view(e))))
            self._forget(e)
            self.counters["evicted"] += 1
        return alloc.alloc(size)

    def _evict(self, need: int) -> list[tuple[LocalEntry, bytes]]:
        """Free LRU victims now; dirty ones (only here) leave a copy for the ``on_evict`` hook,
        which pushes them to the pool outside the lock."""
        out: list[tuple[LocalEntry, bytes]] = []
        freed = 0
        for e in list(self.lru.values()):
            if freed >= need:
                break
            if e.pins:
                continue
            if e.dirty:
                out.append((e, bytes(self.view(e))))
            self._forget(e)
            freed += e.size
            self.counters["evicted"] += 1
        return out

    def mark_dirty(self, entries: Sequence[LocalEntry]) -> None:
        """These objects now exist only here (a deferred pool write): eviction hands them over."""
        with self.lock:
            for e in entries:
                if e.state == COMMITTED and not e.pooled:
                    e.dirty = True
            self.note_flags(entries)

    def objects(self) -> int:
        """Objects held."""
        return len(self.lru)

    def reservation_entries(self, rid: int) -> list[LocalEntry | None] | None:
        """The entries of an open reservation (a copy), None when it is gone."""
        with self.lock:
            res = self.reservations.get(rid)
            return list(res[1]) if res is not None else None

    def pin_live(self, e: LocalEntry) -> bool:
        """One more pin on a committed ``e`` (a transfer guard's: :meth:`unpin` drops it); False
        when it is gone."""
        with self.lock:
            if e.state != COMMITTED:
                return False
            e.pins += 1
            return True

    def unpin(self, e: LocalEntry) -> None:
        """Drop one pin taken by hand (the handoff export's guard); frees a dead extent."""
        with self.lock:
            self._unpin_locked(e)

    def mark_local_only(self, e: LocalEntry, dirty: bool) -> None:
        """An object fetched from a peer, not the pool: never assumed pooled; ``dirty`` hands it
        over on eviction and drain."""
        with self.lock:
            if e.state == COMMITTED:
                e.pooled = False
                e.dirty = dirty
                self.note_flags([e])

    def local_only(self) -> list[LocalEntry]:
        """Objects that exist only here (dirty): what SIGTERM must flush, hottest first."""
        with self.lock:
            out = [e for e in self.lru.values() if e.dirty and e.state == COMMITTED]
        out.sort(key=lambda e: e.last_access, reverse=True)
        return out

    def events_snapshot(self) -> tuple[list[bytes], list[tuple[int, bytes]]]:
        """Every block held now and the events not yet published, taken together (exact)."""
        with self.lock:
            return list(self.blocks), self.events.take_pending() if self.events is not None else []

    def close(self) -> None:
        self.arena.close()

    # -- persistence (kvpool.sidecar.journal) -----------------------------------------------------

    def note_flags(self, entries: Sequence[LocalEntry]) -> None:
        """Journal the dirty/pooled flags of those of ``entries`` still here (the pool writer
        calls it after a write: a restart then does not send them again)."""
        if self.journal is None:
            return
        with self.lock:
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
        plan, journal = arena.opened.plan, arena.journal
        slots = journal.slots
        kept: list[LocalEntry] = []
        torn = 0
        align = self.arena.alloc.align
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
        rounded = self.arena.alloc.rounded
        spans: list[tuple[int, int, LocalEntry | None]] = [(e.offset, rounded(e.size), e) for e in kept]
        for i in plan.reserved.tolist():
            off, size = int(slots["offset"][i]), int(slots["size"][i])
            if off == i * align and 0 < size <= self.capacity:
                spans.append((off, rounded(size), None))
        spans.sort(key=lambda t: (t[0], t[2] is None))  # an object before a reservation at its offset
        extents: list[tuple[int, int]] = []
        quarantine: list[LocalEntry] = []
        end = 0
        for off, size, owner in spans:
            if off < end or off + size > self.capacity:
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
        now = time.time()
        with self.lock:
            self.arena.alloc = type(self.arena.alloc).with_allocated(self.capacity, align, extents)
            for e in kept:
                e.last_access = now
                self.index[(e.kind, e.key)] = e
                if e.kind == pb.BLOCK:
                    self.blocks[e.key] = e
                    if self.events is not None:
                        self.events.stored(e.key)
                self.lru[id(e)] = e
            if kept:
                self._new_lease(kept, grace_ms, now)
            if quarantine:
                self._new_lease(quarantine, int(self.reservation_seconds * 1000), now)
        counts = {"restart_adopted_objects": len(kept), "restart_adopted_bytes": sum(e.size for e in kept),
                  "restart_dropped_checksum": torn, "restart_dropped_uncommitted": len(plan.reserved),
                  "restart_dropped_incoherent": len(plan.incoherent),
                  "restart_dropped_objects": torn + len(plan.reserved) + len(plan.incoherent),
                  "restart_quarantined_bytes": sum(q.size for q in quarantine)}
        self.counters.update(counts)
        return kept, counts
