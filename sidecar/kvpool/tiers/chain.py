"""The chain of tiers below an arena (DRAM → SSD → shared fs): moves, with all tier I/O off the lock.

A slow or hung disk must never stall DRAM hits or other tenants, so no read or write of a tier
below the arena, and no sealing (encryption at rest), runs under the owner's index lock.  A move
of an object between levels (down: DRAM → the first level below that takes it, an extent level
→ the next one when it is full; up: back to DRAM for a read) has three steps:

1. *Mark*, under the lock (no I/O): reserve the destination (``Tier.reserve``: an addressed
   level's extent; a named level's file is reserved by the copy, FIFO with its unlinks), mark the entry ``moving``
   and hold it — a demotion holds it ``inflight`` (it stays readable from DRAM, and victim choice
   skips it, so it is never demoted twice), a promotion or a move between lower levels ``pins``
   it (neither eviction, expiry nor a removal takes it meanwhile) — and queue the copy.
2. *Move*, without the lock: ``read_batch`` from the source, ``write_batch`` to the destination
   (each level a :class:`~kvpool.tiers.base.Tier`; a sealed one, ``SealedTier``, seals and
   opens inside its calls).  The arena's own extents are handed over as zero-copy views.
3. *Flip*, under the lock: the entry points at its new place and its old extent is freed —
   unless it changed meanwhile (removed; read or pinned by a lease, for a demotion: the new copy
   is dropped and the entry stays where it was, readable).

The levels are chosen by their order in the chain, never by name: level 0 is the arena (carved
by the owner's index, served in place), each level below is a Tier, either addressed (the SSD:
its objects known by their :class:`~kvpool.arena.extents.Location` only, freed at once) or named
(``Tier.named``: the shared filesystem, one file per key, which outlives the node and is shared
by all nodes; its files are unlinked off the lock).

Demotions and moves between lower levels run on one background thread, first in first out (a
later move of the same object never overtakes an earlier one).  A writer that needs DRAM waits
for them at most its deadline, with the lock released, and then gets NO_SPACE for what does not
fit: when the disk cannot keep up, writes are shed, reads never wait.  Promotions run on a small
pool; a reader waits at most its bound and the objects that did not arrive by then are misses of
that call (the copy still lands for the next).

The shared filesystem's metadata is handled the same way: the headers of unknown keys are read
off the lock (:meth:`TierChain.locate_files`, bounded like a read) and adopted under it, and a
removed object's file is unlinked by the background thread, FIFO with the copies
(:mod:`kvpool.tiers.ledger`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

from kvpool.arena.allocator import OutOfSpace
from kvpool.arena.dram import DramTier
from kvpool.arena.eviction import watermark_need
from kvpool.arena.extents import Location, ObjectRef
from kvpool.arena.index import ARENA, BLOCK, COMMITTED, ArenaIndex, Entry
from kvpool.core.errors import Code
from kvpool.tiers.base import Tier
from kvpool.tiers.ledger import FsLedger, FsView, Unlink, locate_into
from kvpool.tiers.moves import DEMOTING, IDLE, PROMOTING, Move, copy_down, fits, read_up
from kvpool.tiers.moves import TieredEntry as TieredEntry  # the chain's entries: imported from here
from kvpool.tiers.sealed import SealedTier
from kvpool.wire.counters import StoreCounter

log = logging.getLogger("kvpool.store")


class ChainOwner(Protocol):
    """What the chain asks of the node it moves objects for; called with the lock held."""

    def discard(self, e: TieredEntry) -> None:
        """Forget an object everywhere (its accounting, events and files too)."""

    def evict_dram(self, need: int, now: float, expire_all: bool = True) -> int:
        """Drop or demote DRAM victims for ``need`` bytes; the bytes freed now."""

    def alloc_dram(self, size: int, now: float) -> int:
        """A DRAM extent (evicting); raises OutOfSpace."""

    def fs_salt(self, tenant: str) -> bytes:
        """Key of a tenant's file names in the named level."""

    def account(self, tenant: str, delta_bytes: int) -> None:
        """An object entered (+) or left (-) the levels the tenant's quota counts (extents)."""

    def count(self, what: StoreCounter, tenant: str = "") -> None:
        """Add one to a counter of the node (and of ``tenant``, when given)."""


class TierChain:
    """The move engine of one arena and the levels below it (see the module docstring).

    ``arena``: the arena (level 0, carved by ``index``); ``below``: the tiers below it in chain
    order.  ``lock``: the owner's index lock (every method but ``make_room``, ``promote``,
    ``locate_files``, ``idle`` and ``close`` is called with it held; those take what they need
    themselves)."""

    def __init__(self, owner: ChainOwner, index: ArenaIndex, lock: threading.RLock, arena: DramTier,
                 below: Sequence[Tier], promote_workers: int = 4, max_promotions: int = 256) -> None:
        self.owner = owner
        self.index = index
        self.arena = arena
        self.levels: list[Tier] = [arena, *below]
        self.named = [False] + [t.named for t in below]
        """Per level: a named tier (files outside the quota, freed off the lock)."""
        self.sealed = [False] + [isinstance(t, SealedTier) for t in below]
        self.per_key = next((i for i, n in enumerate(self.named) if n), -1)
        """The named level (the shared filesystem), -1: none."""
        self.room = threading.Condition(lock)
        """Notified when a move is flipped (DRAM freed, or a copy landed)."""
        self.pending_bytes = 0
        """DRAM bytes of demotions planned and not yet flipped (freed soon, if the disk allows)."""
        self._queue: deque[Move | Unlink] = deque()
        self.files = FsLedger()
        """Which named-level files a lookup may adopt (under the lock)."""
        self._wake = threading.Condition(threading.Lock())
        self._promoting: dict[int, Move] = {}
        self._demoting: dict[int, Move] = {}
        """Moves down in flight by id(entry) (to guard a removed object's file, see ``forget``)."""
        self._promoting_bytes = 0
        self._max_promotions = max_promotions
        self._max_promoting_bytes = arena.capacity // 4
        """Past this many DRAM bytes held by promotions stuck past their read's bound, a read
        starts no more."""
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=promote_workers, thread_name_prefix="kvpool-promote")
        self._thread = threading.Thread(target=self._run, name="kvpool-demoter", daemon=True)
        self._thread.start()

    def name(self, level: int) -> str:
        return self.levels[level].name

    def in_quota(self, e: Entry) -> bool:
        """Whether ``e`` takes room the tenant's quota counts (an extent: in the arena or an
        addressed level).  Lock held."""
        return e.offset >= 0 if e.tier == ARENA else not self.named[e.tier]

    def idle(self) -> bool:
        """No demotion, move or unlink queued or in flight."""
        with self.room:
            return not self.pending_bytes and not self._queue and not self._demoting and not self.files.busy()

    def _ref(self, e: Entry, level: int) -> ObjectRef:
        return ObjectRef(e.tenant, e.key, e.kind, self.owner.fs_salt(e.tenant) if self.named[level] else b"")

    # ------------------------------------------------------------------ demotion

    def plan_demotion(self, e: TieredEntry) -> bool:
        """Mark a DRAM object for its move to the first level below that takes it; False when
        none can (the caller drops it).  Lock held."""
        move: Move | None = None
        for level in range(ARENA + 1, len(self.levels)):
            if self.named[level]:
                move = Move(e, ARENA, level)
                break
            loc = self._reserve_below(level, e)
            if loc is not None:
                move = Move(e, ARENA, level, loc=loc)
                break
        if move is None:
            return False
        e.moving = DEMOTING
        e.inflight += 1
        self.pending_bytes += e.size
        self._demoting[id(e)] = move
        self._enqueue(move)
        return True

    def _reserve_below(self, level: int, e: Entry) -> Location | None:
        """Room for ``e`` at the addressed ``level``, made by moving its coldest objects one
        level down (or dropping them at the bottom); None when there is none.  Lock held."""
        tier = self.levels[level]
        if e.size > tier.capacity:
            return None
        ref = self._ref(e, level)
        loc = tier.reserve([ref], [e.size])[0]
        if loc is not None:
            return loc
        self.index.settle_pins()
        need = e.size + int(tier.capacity * 0.05)
        nxt = level + 1 if level + 1 < len(self.levels) else -1
        freed = 0
        for v in self.index.lru(level):
            if freed >= need:
                break
            assert isinstance(v, TieredEntry)
            if v.pins or v.moving:
                continue
            vloc: Location | None = None
            if nxt >= 0 and not self.named[nxt]:
                vloc = self.levels[nxt].reserve([self._ref(v, nxt)], [v.size])[0]
                if vloc is None:
                    nxt = -1
            if nxt >= 0:
                # Moved, not lost: but its extent is free only once the copy is out.
                v.moving = DEMOTING
                v.pins += 1
                self._demoting[id(v)] = move = Move(v, level, nxt, src_loc=v.below, loc=vloc)
                self._enqueue(move)
            else:
                self.owner.discard(v)
                self.owner.count(StoreCounter.EVICTED, v.tenant)
            freed += v.size  # moved or dropped: either way its extent is on its way out
        return tier.reserve([ref], [e.size])[0]

    def make_room(self, sizes: Sequence[int], deadline: float, high: float, low: float) -> None:
        """Before a write reserves DRAM extents of ``sizes`` (rounded) bytes: start the demotions
        that make them fit (down to the ``low`` watermark once above ``high``), then wait for
        them, with the lock released, until the extents would fit, nothing more can be moved, or
        ``deadline`` (monotonic) passes.  Call without the lock."""
        alloc = self.index.alloc(ARENA)
        total = sum(sizes)
        with self.room:
            need = watermark_need(alloc.used - self.pending_bytes, total, alloc.capacity, high, low)
            if need:
                self.owner.evict_dram(need, time.time())
            step = max(need, max(sizes))
            while not fits(alloc, sizes):
                if not self.pending_bytes:
                    # Nothing on its way down (a fragmented arena): move more, geometrically.
                    used = alloc.used
                    self.owner.evict_dram(step, time.time(), expire_all=False)
                    if not self.pending_bytes and alloc.used == used:
                        return  # nothing left to move: the reservation sheds what does not fit
                    step *= 2
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    self.owner.count(StoreCounter.DEMOTE_WAITS_TIMED_OUT)
                    return
                self.room.wait(left)

    def forget(self, e: TieredEntry) -> None:
        """``e`` is being removed (the index forgot it): free its place below — an addressed
        level's now, its named-level file off the lock (FIFO: before any later copy of the same
        key is written; meanwhile no lookup adopts it) — and, if a copy of it to the named level
        is on its way, keep lookups from adopting that file too (it is unlinked once written).
        Lock held."""
        m = self._demoting.get(id(e)) if e.moving else None
        if m is not None and self.named[m.dst] and not m.guarded:
            m.guarded = True
            self.files.removing(e.tenant, e.key)
        if e.tier != ARENA and e.below is not None and not self.named[e.tier]:
            self.levels[e.tier].free([e.below])
        e.below = None
        if e.fs is not None:
            self.files.removing(e.tenant, e.key)
            self._enqueue(Unlink(e.fs))
            e.fs = None

    def _unlink(self, job: Unlink) -> None:
        try:
            self.levels[self.per_key].free([job.loc])
        except OSError as exc:
            log.warning("shared-fs removal failed: %s", exc)
        with self.room:
            self.files.unlinked(job.loc.ref.tenant, job.loc.ref.key)

    def locate_files(self, tenant: str, salt: bytes, keys: list[bytes], prefix_only: bool, timeout: float) -> FsView:
        """The named level's files of ``keys`` (with ``prefix_only`` up to the first key with
        none), located on the pool's threads for at most ``timeout`` seconds: a hung file system
        makes the keys not located by then misses.  Call without the lock."""
        got: list[tuple[bytes, Location]] = []
        since = time.monotonic()
        self.files.horizon = max(60.0, 10 * timeout)
        refs = [ObjectRef(tenant, k, BLOCK, salt) for k in keys]
        try:
            self._pool.submit(locate_into, self.levels[self.per_key], self.sealed[self.per_key], refs, prefix_only,
                              got).result(timeout)
        except FutureTimeout:
            with self.room:
                self.owner.count(StoreCounter.TIER_STAT_TIMEOUTS)
        except (OSError, RuntimeError) as exc:  # an unreadable directory, or shut down: misses
            log.warning("shared-fs lookup failed: %s", exc)
        return FsView(dict(list(got)), since)  # a copy: the lookups may still be running

    def may_adopt(self, tenant: str, key: bytes, since: float) -> bool:
        """Whether a file located from ``since`` may be adopted (not removed here meanwhile;
        call under the lock)."""
        return self.files.may_adopt(tenant, key, since)

    def _enqueue(self, move: Move | Unlink) -> None:
        with self._wake:
            self._queue.append(move)
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                move = self._queue.popleft()
            try:
                if isinstance(move, Unlink):
                    self._unlink(move)
                    continue
                try:
                    self._copy_down(move)
                except Exception as exc:  # noqa: BLE001 - a failed copy drops the object, never the thread
                    log.warning("tier move of an object failed: %s", exc)
                    move.code = Code.CHECKSUM
                cleanup = self._flip_down(move)
                if cleanup is not None:
                    self._unlink(cleanup)  # now, on this thread: ahead of any later copy of the key
            except Exception as exc:  # noqa: BLE001 - e.g. the node closing its tiers under a copy
                if not self._closed:
                    log.error("tier chain: %s", exc)

    def _copy_down(self, m: Move) -> None:
        """The copy of a move down, without the lock (:func:`~kvpool.tiers.moves.copy_down`)."""
        copy_down(m, self.arena, self.levels, self.sealed[m.dst], self._ref(m.entry, m.dst))

    def _flip_down(self, m: Move) -> Unlink | None:
        """Make a finished copy the object's place (or undo it); returns a named-level file to
        remove outside the lock when the copy is not wanted any more."""
        e = m.entry
        named = self.named[m.dst]
        with self.room:
            e.moving = IDLE
            self._demoting.pop(id(e), None)
            if m.src == ARENA:
                self.pending_bytes -= e.size
                self.index.release_inflight(e)  # removed meanwhile: the last holder frees
            else:
                e.pins -= 1
            self.index.settle_pins()
            gone = e.state != COMMITTED
            self.room.notify_all()
            if gone or m.code != Code.OK:
                if not gone:
                    log.warning("tier write failed: dropping the object instead of moving it")
                    self.owner.discard(e)
                    self.owner.count(StoreCounter.EVICTED, e.tenant)
                if not named:
                    if m.loc is not None:
                        self.levels[m.dst].free([m.loc])
                    return None
                if gone or (m.loc is not None and not m.reused):
                    # A file written for an object removed meanwhile goes too (FIFO: before any
                    # later copy of the same key), or a lookup would bring the removed object back.
                    if not m.guarded:
                        self.files.removing(e.tenant, e.key)
                    return Unlink(m.loc or Location(self._ref(e, m.dst), e.size))
                return None
            assert m.loc is not None
            if m.src == ARENA and (e.pins or e.inflight):
                # Read or leased while it was copied: it stays in DRAM (it is hot), the copy goes.
                if named:
                    e.fs = m.loc  # the file is there: a removal must take it too
                else:
                    self.levels[m.dst].free([m.loc])
                self.owner.count(StoreCounter.DEMOTIONS_ABANDONED)
                return None
            if m.src == ARENA:
                self.index.drop_token(e)
            elif not self.named[m.src] and m.src_loc is not None:
                self.levels[m.src].free([m.src_loc])
            self.index.move(e, m.dst, -1)  # (frees its arena extent)
            e.below = m.loc
            if named:
                e.fs = m.loc
                if not self.named[m.src]:
                    self.owner.account(e.tenant, -e.size)  # the named level is outside the quota
            if m.src == ARENA and self.sealed[m.dst]:
                self.owner.count(StoreCounter.SEALED)
            self.owner.count(StoreCounter.DEMOTED)
            return None

    # ------------------------------------------------------------------ promotion

    def promote(self, entries: Sequence[TieredEntry], timeout: float, high: float, low: float) -> dict[int, int]:
        """Bring the committed objects of ``entries`` that are below DRAM up, waiting at most
        ``timeout`` seconds; returns id(entry) → code for those that failed (NO_SPACE,
        CHECKSUM, NOT_FOUND); those still on their way are neither there nor in DRAM (misses).
        Call without the lock."""
        failed: dict[int, int] = {}
        waits: list[Move] = []
        deadline = time.monotonic() + timeout
        todo = list(entries)
        rounded = self.index.alloc(ARENA).rounded
        # Room first (demotions, waited for without the lock), then the reservations; another
        # reader or writer may take the room meanwhile, so what did not fit tries again.
        for _ in range(4):
            with self.room:
                sizes = [rounded(e.size) for e in todo
                         if e.state == COMMITTED and e.tier != ARENA and not e.moving and id(e) not in self._promoting]
            if sizes:
                self.make_room(sizes, deadline, high, low)  # a full DRAM: what comes up needs demotions first
            todo = self._plan_promotions(todo, waits, timeout)
            if not todo or time.monotonic() >= deadline:
                break
        for e in todo:
            failed[id(e)] = Code.NO_SPACE
        for m in waits:
            if not m.done.wait(max(0.0, deadline - time.monotonic())):
                continue
            if m.code != Code.OK:
                failed[id(m.entry)] = m.code
        return failed

    def _plan_promotions(self, entries: Sequence[TieredEntry], waits: list[Move], timeout: float
                         ) -> list[TieredEntry]:
        """Start the promotion of each of ``entries`` below DRAM that has room now (or join the
        one under way), appending to ``waits``; returns those that found no room."""
        short: list[TieredEntry] = []
        with self.room:
            now = time.time()
            # Promotions that outlived their reads' bound (a slow disk) holding much of the arena:
            # this read starts none (its objects below DRAM are misses), so a hung disk cannot tie
            # up all of it.
            stuck = self._promoting_bytes > self._max_promoting_bytes and sum(
                m.entry.size for m in self._promoting.values()
                if time.monotonic() - m.started > timeout) > self._max_promoting_bytes
            for e in entries:
                if e.state != COMMITTED or e.tier == ARENA:
                    continue
                m = self._promoting.get(id(e))
                if m is None:
                    if e.moving or stuck or len(self._promoting) >= self._max_promotions:
                        continue  # moving down right now, or too many reads stuck: a miss
                    try:
                        off = self.owner.alloc_dram(e.size, now)
                    except OutOfSpace:
                        short.append(e)
                        continue
                    m = Move(e, e.tier, ARENA, src_loc=e.below, offset=off)
                    e.moving = PROMOTING
                    e.pins += 1
                    self._promoting[id(e)] = m
                    self._promoting_bytes += e.size
                    self._pool.submit(self._promote_one, m)
                waits.append(m)
        return short

    def _promote_one(self, m: Move) -> None:
        e = m.entry
        # An addressed level's read is verified against what it was given (the checksum of the
        # bytes it wrote, or the seal's tag): hashing again is needed only for a shared file,
        # which another node may have written, and to learn an adopted object's checksum.
        code, actual = read_up(m, self.arena, self.levels[m.src], self.named[m.src] or not e.checksum)
        with self.room:
            e.pins -= 1
            e.moving = IDLE
            self._promoting.pop(id(e), None)
            self._promoting_bytes -= e.size
            if code == Code.OK and actual >= 0 and e.checksum and actual != e.checksum:
                code = Code.CHECKSUM  # (an adopted file's object has no checksum yet: the tier vouched)
            if code == Code.OK and e.state == COMMITTED and e.tier == m.src:
                if self.named[m.src]:
                    self.owner.account(e.tenant, e.size)
                elif m.src_loc is not None:
                    self.levels[m.src].free([m.src_loc])
                if actual >= 0:
                    e.checksum = actual
                self.index.move(e, ARENA, m.offset)
                e.below = None
                self.index.bind_token(e)
                e.last_access = time.time()
                self.owner.count(StoreCounter.PROMOTED)
            else:
                self.index.alloc(ARENA).free(m.offset)
                if code == Code.OK:
                    code = Code.NOT_FOUND  # removed or moved meanwhile
                elif e.state == COMMITTED:
                    if code == Code.CHECKSUM:
                        # A sealed copy that does not open (tampered, truncated, sealed for another
                        # tenant or key) is counted as such: the tag caught it, not the checksum.
                        self.owner.count(StoreCounter.AT_REST_AUTH_FAILURES if self.sealed[m.src]
                                         else StoreCounter.CHECKSUM_FAILURES, e.tenant)
                    self.owner.discard(e)  # the copy was bad or gone: forgotten, a miss
            m.code = code
            self.room.notify_all()
        m.done.set()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
