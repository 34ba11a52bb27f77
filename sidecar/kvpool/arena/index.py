"""The index of an arena, shared by the store node and the sidecar's local tier.

One implementation of what both caches keep about their objects: the entry state machine, the
two-phase write (reserve → commit or abort), leases that pin objects (with expiry), reservations
(with expiry), the per-level LRU, write tokens and the bookkeeping of extents that a holder
keeps alive after their object is gone.  No I/O and no lock: the owner (``StoreNode``,
``LocalTier``) serializes every call under its own lock, and nothing else touches these dicts.

Entry states (``State``), one set of names for both caches::

    RESERVED ──commit──▶ COMMITTING ──verified──▶ COMMITTED ──forget──▶ DEAD
        │                     │                                        ▲
        └──abort / expiry─────┴────────────────────────────────────────┘

COMMITTING exists only where a commit is verified outside the owner's lock (the store); the
local tier publishes RESERVED → COMMITTED directly.  A DEAD entry's extent is freed by the last
holder: ``inflight`` (a transfer, a tier copy) always holds it, ``pins`` (a lease) holds it only
where clients read the arena in place without a guard (``pins_hold_extent``: the local tier).

Levels: an entry lives at ``tier`` (0: the arena, 1.. the tiers below it, in the owner's chain
order); each level with an allocator has its own LRU.  The partition (``tenant``) separates
tenants in a store node; the local tier uses one partition.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from enum import IntEnum
from typing import Any, Generic, TypeVar

from kvpool.arena.allocator import ExtentAllocator

ARENA = 0
"""The level of the arena itself (``Entry.tier``); the owner's levels below count from 1."""

BLOCK, STATE = 0, 1
"""Object kinds (``store_pb2.BLOCK``/``STATE``; the values of the wire enum)."""


class State(IntEnum):
    """Where an entry is in its life (see the module docstring)."""

    RESERVED = 0
    """Space is held; a writer may be copying into it; never visible."""
    COMMITTING = 1
    """Commit under way (its bytes are being verified): no more writes, not visible yet."""
    COMMITTED = 2
    """Visible and immutable."""
    DEAD = 3
    """Forgotten: no lookup finds it; its extent is freed by its last holder."""


RESERVED, COMMITTING, COMMITTED, DEAD = State.RESERVED, State.COMMITTING, State.COMMITTED, State.DEAD


def index_key(key: bytes, kind: int) -> bytes:
    """Key of an entry in its partition: a block and a state object may share a key."""
    return key if kind == BLOCK else key + b"\x01"


class Entry:
    """One object of an index.  Per object, never per byte."""

    __slots__ = ("key", "tenant", "kind", "traffic_class", "size", "checksum", "offset", "tier", "state",
                 "pins", "inflight", "last_access", "expires", "token")

    def __init__(self, key: bytes, tenant: str, kind: int, traffic_class: str, size: int, offset: int = -1) -> None:
        self.key = key
        self.tenant = tenant
        self.kind = kind
        self.traffic_class = traffic_class
        self.size = size
        self.checksum = 0
        self.offset = offset
        self.tier = ARENA
        """Level in the owner's chain."""
        self.state = RESERVED
        self.pins = 0
        """Leases (and promotions, for the store) holding it: eviction and removal leave it."""
        self.inflight = 0
        """Byte transfers or tier copies using its extent right now: the extent stays allocated."""
        self.last_access = time.time()
        self.expires = 0.0
        """Reservation expiry (RESERVED only)."""
        self.token = 0
        """Transfer token of its writes (store; 0: none)."""


E = TypeVar("E", bound=Entry)


class Lease(Generic[E]):
    """Pins over ``entries`` until ``expires`` (or a release)."""

    __slots__ = ("lease_id", "expires", "entries", "tenant")

    def __init__(self, lease_id: int, expires: float, entries: list[E], tenant: str = "") -> None:
        self.lease_id = lease_id
        self.expires = expires
        self.entries = entries
        self.tenant = tenant


class Reservation:
    """The entries of one two-phase write (None where an item got no space)."""

    __slots__ = ("reservation_id", "tenant", "entries", "expires")

    def __init__(self, reservation_id: int, tenant: str, entries: list[Entry | None], expires: float) -> None:
        self.reservation_id = reservation_id
        self.tenant = tenant
        self.entries = entries
        self.expires = expires


_NOTHING: list[Entry] = []
"""What :meth:`ArenaIndex.sweep` hands back when nothing expired (never appended to)."""


class ArenaIndex:
    """Entries, leases, reservations, LRU and tokens of one arena (and its levels below).

    Not thread-safe: the owner calls every method under its lock.  ``allocs``: the allocator of
    each level whose extents the index frees (None for a level the owner frees itself, through
    its tier, or without extents, e.g. a shared filesystem).  ``ordered``: the levels with an LRU
    (default: those with an allocator)."""

    def __init__(self, allocs: Sequence[ExtentAllocator | None], pins_hold_extent: bool,
                 ordered: Sequence[bool] | None = None) -> None:
        self._allocs = list(allocs)
        self._ordered = list(ordered) if ordered is not None else [a is not None for a in self._allocs]
        self._pins_hold = pins_hold_extent
        self._parts: dict[str, dict[bytes, Entry]] = {}
        # Committed blocks only, per partition: the match fast path is one C-level map over this
        # dict (a reserved or state entry must never count as a hit).
        self._blocks: dict[str, dict[bytes, Entry]] = {}
        self._lru: list[OrderedDict[int, Entry]] = [OrderedDict() for _ in self._allocs]
        self._leases: dict[int, Lease[Any]] = {}
        # Leases whose pins are not counted into their entries yet (see settle_pins).
        self._uncounted: dict[int, Lease[Any]] = {}
        self._lease_heap: list[tuple[float, int]] = []
        self._reservations: dict[int, Reservation] = {}
        self._res_heap: list[tuple[float, int]] = []
        self._by_token: dict[int, Entry] = {}
        # Ids start at a random base: an id held across a restart (a writer between reserve and
        # commit, a matcher holding a lease) names nothing in this life.
        self._first_id = 1 + secrets.randbits(62)
        self._ids = itertools.count(self._first_id)
        self._last_id = self._first_id - 1

    # ------------------------------------------------------------------ ids, allocators

    def next_id(self) -> int:
        self._last_id = next(self._ids)
        return self._last_id

    def issued(self, some_id: int) -> bool:
        """Whether this life of the index could have issued ``some_id``."""
        return self._first_id <= some_id <= self._last_id

    def alloc(self, level: int = 0) -> ExtentAllocator:
        a = self._allocs[level]
        assert a is not None, f"level {level} has no extents"
        return a

    def set_alloc(self, level: int, alloc: ExtentAllocator) -> None:
        """Replace a level's allocator (a restarted sidecar rebuilds its arena's)."""
        self._allocs[level] = alloc

    # ------------------------------------------------------------------ lookups

    def get(self, tenant: str, key: bytes, kind: int) -> Entry | None:
        """The entry of ``key`` in any live state (None: none)."""
        part = self._parts.get(tenant)
        return part.get(index_key(key, kind)) if part is not None else None

    def get_many(self, tenant: str, keys: Sequence[bytes], kind: int) -> list[Entry | None]:
        """:meth:`get` of each of ``keys`` (one C-level map for blocks)."""
        part = self._parts.get(tenant, {})
        if kind == BLOCK:
            return list(map(part.get, keys))
        return [part.get(k + b"\x01") for k in keys]

    def committed(self, tenant: str, key: bytes, kind: int) -> Entry | None:
        e = self.get(tenant, key, kind)
        return e if e is not None and e.state == COMMITTED else None

    def match_blocks(self, tenant: str, keys: Iterable[bytes]) -> list[Entry | None]:
        """Committed blocks of ``keys`` (None where absent), one C-level map: the match path."""
        return list(map(self._blocks.get(tenant, {}).get, keys))

    def has_block(self, tenant: str, key: bytes) -> bool:
        return key in self._blocks.get(tenant, ())

    def block_keys(self, tenant: str) -> list[bytes]:
        return list(self._blocks.get(tenant, ()))

    def lookup(self, tenant: str, keys: Sequence[bytes], kind: int) -> list[Entry | None]:
        """Committed objects of ``keys`` (None where absent)."""
        if kind == BLOCK:
            return self.match_blocks(tenant, keys)
        part = self._parts.get(tenant, {})
        out: list[Entry | None] = []
        for k in keys:
            e = part.get(index_key(k, kind))
            out.append(e if e is not None and e.state == COMMITTED else None)
        return out

    def unknown(self, tenant: str, keys: Sequence[bytes]) -> list[bytes]:
        """Those of ``keys`` (blocks) with no entry at all."""
        part = self._parts.get(tenant, {})
        return [k for k in keys if part.get(k) is None]

    def all_committed(self) -> list[Entry]:
        return [e for part in self._parts.values() for e in part.values() if e.state == COMMITTED]

    def lru(self, level: int = 0) -> list[Entry]:
        """Committed entries at ``level``, least recently used first (a copy)."""
        return list(self._lru[level].values())

    def ordered_levels(self) -> list[int]:
        """The levels that keep an LRU (``ordered``), top (the arena) first."""
        return [lv for lv, o in enumerate(self._ordered) if o]

    def count(self, level: int = 0) -> int:
        return len(self._lru[level])

    def touch(self, e: Entry, now: float) -> None:
        """``e`` was used at ``now``: in the arena, its most recently used object (the levels
        below keep the order objects arrived in)."""
        e.last_access = now
        if e.tier == ARENA:
            self._lru[ARENA].move_to_end(id(e))

    def touch_all(self, entries: Iterable[Entry], now: float, level: int = -1) -> None:
        """:meth:`touch` each of ``entries``; ``level``: ARENA when they are all there (the usual
        batch of hits: one LRU for the whole loop)."""
        if level == ARENA:
            move = self._lru[ARENA].move_to_end
            for e in entries:
                e.last_access = now
                move(id(e))
            return
        for e in entries:
            self.touch(e, now)

    # ------------------------------------------------------------------ writes

    def reserve(self, e: Entry) -> None:
        """Index a new RESERVED entry (the caller checked there is none for its key)."""
        part = self._parts.get(e.tenant)
        if part is None:
            part = self._parts[e.tenant] = {}
        part[index_key(e.key, e.kind)] = e
        if e.token:
            self._by_token[e.token] = e

    def open_reservation(self, tenant: str, entries: list[Entry | None], expires: float) -> int:
        rid = self.next_id()
        self._reservations[rid] = Reservation(rid, tenant, entries, expires)
        heapq.heappush(self._res_heap, (expires, rid))
        return rid

    def reservation(self, rid: int) -> Reservation | None:
        return self._reservations.get(rid)

    def close_reservation(self, rid: int) -> Reservation | None:
        """Take a reservation out (a commit, a revoke): nobody else can take it after this."""
        return self._reservations.pop(rid, None)

    def publish(self, e: Entry, now: float) -> None:
        """A committed object becomes visible (and evictable) at level ``e.tier``."""
        e.state = COMMITTED
        e.last_access = now
        if e.kind == BLOCK:
            blocks = self._blocks.get(e.tenant)
            if blocks is None:
                blocks = self._blocks[e.tenant] = {}
            blocks[e.key] = e
        self._lru[e.tier][id(e)] = e

    def adopt(self, e: Entry) -> None:
        """Index an object found committed (a restart's journal, a shared file): no LRU when its
        level has none."""
        self._parts.setdefault(e.tenant, {})[index_key(e.key, e.kind)] = e
        if e.kind == BLOCK:
            self._blocks.setdefault(e.tenant, {})[e.key] = e
        if self._ordered[e.tier]:
            self._lru[e.tier][id(e)] = e

    def forget(self, e: Entry) -> None:
        """Forget an object everywhere and free its extent unless a holder keeps it (then the
        last holder frees it: :meth:`release_inflight`, :meth:`unpin`)."""
        part = self._parts.get(e.tenant)
        ik = index_key(e.key, e.kind)
        if part is not None and part.get(ik) is e:
            del part[ik]
        blocks = self._blocks.get(e.tenant)
        if blocks is not None and blocks.get(e.key) is e:
            del blocks[e.key]
        self._lru[e.tier].pop(id(e), None)
        if e.token:
            self._by_token.pop(e.token, None)
            e.token = 0
        e.state = DEAD
        if not e.inflight and not (self._pins_hold and e.pins):
            self._free_if_unheld(e)

    def _free_if_unheld(self, e: Entry) -> None:
        if e.state != DEAD or e.offset < 0 or e.inflight or (self._pins_hold and e.pins):
            return
        alloc = self._allocs[e.tier]
        if alloc is not None:
            alloc.free(e.offset)
        e.offset = -1

    def move(self, e: Entry, level: int, offset: int) -> None:
        """A committed object now lives at ``level``/``offset`` (a tier move landed); its old
        extent is freed."""
        self._lru[e.tier].pop(id(e), None)
        old = self._allocs[e.tier]
        if old is not None and e.offset >= 0:
            old.free(e.offset)
        e.tier, e.offset = level, offset
        if self._ordered[level]:
            self._lru[level][id(e)] = e

    # ------------------------------------------------------------------ holders

    def hold(self, entries: Iterable[Entry]) -> None:
        for e in entries:
            e.inflight += 1

    def release_inflight(self, e: Entry) -> None:
        """A transfer or copy of ``e`` ended; a dead entry's extent goes with its last holder."""
        e.inflight -= 1
        if e.inflight == 0 and e.state == DEAD:
            self._free_if_unheld(e)

    def pin(self, entries: Iterable[Entry]) -> None:
        for e in entries:
            e.pins += 1

    def unpin(self, e: Entry, n: int = 1) -> None:
        e.pins -= n
        if e.pins == 0 and e.state == DEAD:
            self._free_if_unheld(e)

    def unpin_all(self, entries: Iterable[Entry]) -> None:
        for e in entries:
            e.pins -= 1
            if e.pins == 0 and e.state == DEAD:
                self._free_if_unheld(e)

    # ------------------------------------------------------------------ tokens

    def new_token(self) -> int:
        """A random 63-bit transfer token.

        Random, not sequential: the transfer port does not know tenants, so a token is the only
        thing between a peer and a slot; one tenant's tokens must say nothing about another's
        (and a token from before a restart matches nothing)."""
        while True:
            t = secrets.randbits(63)
            if t and t not in self._by_token:
                return t

    def bind_token(self, e: Entry) -> int:
        e.token = self.new_token()
        self._by_token[e.token] = e
        return e.token

    def drop_token(self, e: Entry) -> None:
        if e.token:
            self._by_token.pop(e.token, None)
            e.token = 0

    def by_token(self, token: int) -> Entry | None:
        """The entry whose write token this is."""
        return self._by_token.get(token)

    def token_count(self) -> int:
        """Live write tokens (a test of the books: none once everything is gone)."""
        return len(self._by_token)

    # ------------------------------------------------------------------ leases

    def lease_count(self) -> int:
        """Leases alive (not yet released, dropped or swept)."""
        return len(self._leases)

    def reservation_count(self) -> int:
        """Reservations open (reserved, not yet committed, revoked or expired)."""
        return len(self._reservations)

    def new_lease(self, entries: list[E], expires: float, tenant: str = "", lazy: bool = False) -> Lease[E]:
        """Pin ``entries`` until ``expires``.  ``lazy``: the pins are counted only when something
        asks (:meth:`settle_pins`) — a match pins thousands of objects and is usually released
        within milliseconds, before anything reads ``pins``."""
        lease = Lease(self.next_id(), expires, entries, tenant)
        if lazy:
            self._uncounted[lease.lease_id] = lease
        else:
            for e in entries:
                e.pins += 1
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._lease_heap, (expires, lease.lease_id))
        return lease

    def lease(self, lease_id: int) -> Lease[Any] | None:
        return self._leases.get(lease_id)

    def live(self, lease: Lease[Any]) -> bool:
        return self._leases.get(lease.lease_id) is lease

    def add_to_lease(self, lease: Lease[E], e: E, pins: int = 1) -> None:
        lease.entries.append(e)
        if lease.lease_id in self._uncounted:
            pins -= 1
        e.pins += pins

    def drop_from_lease(self, lease: Lease[E], e: E) -> bool:
        """Take ``e`` out of a live lease (its pin stays with the caller); False if it was not in."""
        if not self.live(lease) or e not in lease.entries:
            return False
        lease.entries.remove(e)
        return True

    def drop_lease(self, lease: Lease[Any]) -> None:
        if self._leases.pop(lease.lease_id, None) is None:
            return
        if self._uncounted.pop(lease.lease_id, None) is None:
            self.unpin_all(lease.entries)

    def release(self, lease_ids: Iterable[int], tenant: str | None = None) -> None:
        """Drop the leases of ``lease_ids`` (of ``tenant`` only, when given)."""
        for lid in lease_ids:
            lease = self._leases.get(lid)
            if lease is not None and (tenant is None or lease.tenant == tenant):
                self.drop_lease(lease)

    def settle_pins(self) -> None:
        """Count the pins of the lazy leases: ``pins`` is exact whenever whatever decides on it
        (eviction, expiry, removal) calls this first."""
        if not self._uncounted:
            return
        for lease in self._uncounted.values():
            for e in lease.entries:
                e.pins += 1
        self._uncounted.clear()

    # ------------------------------------------------------------------ expiry

    def sweep(self, now: float) -> tuple[int, list[Entry]]:
        """Drop the leases that expired; close the reservations that did.  Returns the number of
        leases dropped and the still-RESERVED entries of the expired reservations, for the owner
        to forget (with its own accounting).  Cheap: heaps ordered by expiry."""
        lh, rh = self._lease_heap, self._res_heap
        if (not lh or lh[0][0] > now) and (not rh or rh[0][0] > now):
            return 0, _NOTHING  # the usual call: nothing expired
        dropped = 0
        while self._lease_heap and self._lease_heap[0][0] <= now:
            _, lid = heapq.heappop(self._lease_heap)
            lease = self._leases.get(lid)
            if lease is not None and lease.expires <= now:
                self.drop_lease(lease)
                dropped += 1
        expired: list[Entry] = []
        while self._res_heap and self._res_heap[0][0] <= now:
            _, rid = heapq.heappop(self._res_heap)
            res = self._reservations.pop(rid, None)
            if res is not None:
                expired += [e for e in res.entries if e is not None and e.state == RESERVED]
        return dropped, expired
