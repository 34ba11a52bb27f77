"""The chain of tiers below an arena (DRAM → SSD → shared fs): moves, with all tier I/O off the lock.

A slow or hung disk must never stall DRAM hits or other tenants, so no read or write of a tier
below the arena, and no sealing (encryption at rest), runs under the owner's index lock.  A move
of an object between levels (down: DRAM → the first level below that takes it, an extent level
→ the next one when it is full; up: back to DRAM for a read) has three steps:

1. *Mark*, under the lock (no I/O): allocate the destination extent, mark the entry ``moving``
   and hold it — a demotion holds it ``inflight`` (it stays readable from DRAM, and victim choice
   skips it, so it is never demoted twice), a promotion or a move between lower levels ``pins``
   it (neither eviction, expiry nor a removal takes it meanwhile) — and queue the copy.
2. *Move*, without the lock: read, seal or open, verify, write.
3. *Flip*, under the lock: the entry points at its new place and its old extent is freed —
   unless it changed meanwhile (removed; read or pinned by a lease, for a demotion: the new copy
   is dropped and the entry stays where it was, readable).

The levels are chosen by their order in the chain, never by name: level 0 is the arena, each
level below either has extents (an allocator: the SSD) or keeps one file per key (the shared
filesystem, which outlives the node and is shared by all nodes).

Demotions and moves between lower levels run on one background thread, first in first out (a
later move of the same object never overtakes an earlier one).  A writer that needs DRAM waits
for them at most its deadline, with the lock released, and then gets NO_SPACE for what does not
fit: when the disk cannot keep up, writes are shed, reads never wait.  Promotions run on a small
pool; a reader waits at most its bound and the objects that did not arrive by then are misses of
that call (the copy still lands for the next).

The shared filesystem's metadata is handled the same way: the headers of unknown keys are read
off the lock (:meth:`TierChain.stat_files`, bounded like a read) and adopted under it, and a
removed object's file is unlinked by the background thread, FIFO with the copies; until then,
and for a header read before the unlink, the file is not adopted (:meth:`FsLedger.may_adopt`).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpool.arena.allocator import ExtentAllocator, OutOfSpace
from kvpool.arena.eviction import watermark_need
from kvpool.arena.index import ARENA, COMMITTED, ArenaIndex, Entry
from kvpool.core.checksum import checksum
from kvpool.tiers.atrest import AtRest, sealed_size
from kvpool.tiers.sharedfs import SharedFsHeader
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.store")

IDLE, DEMOTING, PROMOTING = 0, 1, 2
"""``TieredEntry.moving``: what a planned move is doing to the entry."""


class TieredEntry(Entry):
    """An entry of an arena with levels below it."""

    __slots__ = ("moving", "gen", "on_fs")

    def __init__(self, key: bytes, tenant: str, kind: int, traffic_class: str, size: int) -> None:
        super().__init__(key, tenant, kind, traffic_class, size)
        self.moving = IDLE
        """A move in progress (DEMOTING / PROMOTING)."""
        self.gen = 0
        """Generation its copy below was sealed under (encryption at rest)."""
        self.on_fs = False
        """A copy exists in the per-key level (removed with the object)."""


class ChainOwner(Protocol):
    """What the chain asks of the node it moves objects for; called with the lock held."""

    def discard(self, e: TieredEntry) -> None:
        """Forget an object everywhere (its accounting, events and files too)."""

    def evict_dram(self, need: int, now: float, expire_all: bool = True) -> int:
        """Drop or demote DRAM victims for ``need`` bytes; the bytes freed now."""

    def alloc_dram(self, size: int, now: float) -> int:
        """A DRAM extent (evicting); raises OutOfSpace."""

    def fs_salt(self, tenant: str) -> bytes:
        """Key of a tenant's file names in the per-key level."""

    def account(self, tenant: str, delta_bytes: int) -> None:
        """An object entered (+) or left (-) the levels the tenant's quota counts (extents)."""

    def count(self, what: StoreCounter, tenant: str = "") -> None:
        """Add one to a counter of the node (and of ``tenant``, when given)."""


@dataclass
class _Move:
    entry: TieredEntry
    src: int
    dst: int
    offset: int = -1
    """Destination extent; -1 for a per-key level."""
    gen: int = 0
    code: int = pb.OK
    started: float = field(default_factory=time.monotonic)
    guarded: bool = False
    """A per-key destination whose object was removed meanwhile: already marked removing."""
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class FsView:
    """Headers of shared-fs files read off the lock (:meth:`TierChain.stat_files`), and when the
    reading started: a file unlinked after that is not adopted (``FsLedger.may_adopt``)."""

    headers: dict[bytes, SharedFsHeader]
    since: float


@dataclass
class _Unlink:
    """The removal of an object's shared-fs file (queued, FIFO with the moves)."""

    tenant: str
    salt: bytes
    key: bytes


class FsLedger:
    """Which files of the per-key level a lookup may adopt: not one whose unlink is on its way,
    nor one unlinked after the lookup started reading its header.  Called under the owner's lock."""

    def __init__(self) -> None:
        self._removing: Counter[tuple[str, bytes]] = Counter()
        """(tenant, key) of files whose unlink is on its way: never adopted meanwhile."""
        self._unlinked: dict[tuple[str, bytes], float] = {}
        """(tenant, key) → when its file was unlinked (monotonic), recent ones: a header read
        before that is stale."""
        self.horizon = 60.0
        """How long an unlink is remembered (a header is used within its read's bound)."""

    def removing(self, tenant: str, key: bytes) -> None:
        self._removing[(tenant, key)] += 1

    def unlinked(self, tenant: str, key: bytes) -> None:
        k = (tenant, key)
        self._removing[k] -= 1
        if self._removing[k] <= 0:
            del self._removing[k]
        now = self._unlinked[k] = time.monotonic()
        if len(self._unlinked) > 4096:
            self._unlinked = {x: t for x, t in self._unlinked.items() if t >= now - self.horizon}

    def may_adopt(self, tenant: str, key: bytes, since: float) -> bool:
        """Whether a file seen by a read that started at ``since`` may be adopted."""
        k = (tenant, key)
        return k not in self._removing and self._unlinked.get(k, -1.0) < since

    def busy(self) -> bool:
        return bool(self._removing)


def _read_below(tier: Any, e: TieredEntry, salt: bytes, dst: memoryview) -> SharedFsHeader | None:
    """Read ``e``'s stored bytes (sealed or plain) from ``tier`` into ``dst``: an extent level
    at ``e.offset``, a per-key level by its file (its header, None when there is none)."""
    if getattr(tier, "alloc", None) is not None:
        tier.read_into(e.offset, dst)
        return SharedFsHeader(e.kind, e.size, e.checksum, sealed=False, generation=e.gen)
    hdr: SharedFsHeader | None = tier.read_into(salt, e.key, dst)
    return hdr


def _open_up(at_rest: AtRest | None, tier: Any, e: TieredEntry, salt: bytes, dst: memoryview
             ) -> tuple[int, bool, bool]:
    """Read ``e`` from ``tier`` into ``dst`` (opening it when sealed) and verify it: a code,
    whether authentication failed, and whether an earlier master key opened it.  No lock."""
    extents = getattr(tier, "alloc", None) is not None
    if at_rest is None:
        hdr = _read_below(tier, e, salt, dst)
        code = pb.OK if hdr is not None and not hdr.sealed else pb.NOT_FOUND
        if code == pb.OK and checksum(dst) != e.checksum:
            code = pb.CHECKSUM
        return code, False, False
    blob = memoryview(bytearray(sealed_size(e.size)))
    hdr = _read_below(tier, e, salt, blob)
    gen = e.gen
    if not extents:
        present = hdr is not None or tier.stat(salt, e.key) is not None
        ok_hdr = hdr is not None and hdr.sealed and hdr.size == e.size and hdr.kind == e.kind
        gen = hdr.generation if hdr is not None and ok_hdr else -1
        if not present:
            return pb.NOT_FOUND, False, False  # gone (another node removed it): a plain miss
    if gen < 0 or not at_rest.open_into(e.tenant, e.key, e.kind, gen, blob, dst):
        return pb.CHECKSUM, True, False
    previous = not at_rest.sealed_with_current(blob)
    actual = checksum(dst)
    if not e.checksum and not extents:
        e.checksum = actual  # adopted: a sealed file carries no checksum; the tag vouched
    elif actual != e.checksum:
        return pb.CHECKSUM, False, previous
    return pb.OK, False, previous


def _fits(alloc: ExtentAllocator, sizes: Sequence[int]) -> bool:
    """Whether extents of ``sizes`` could be allocated now (a trial, undone).  Lock held."""
    if alloc.largest_free >= sum(sizes):
        return True
    got: list[int] = []
    try:
        for size in sizes:
            got.append(alloc.alloc(size))
        return True
    except OutOfSpace:
        return False
    finally:
        for off in got:
            alloc.free(off)


def _copy_down(m: _Move, levels: Sequence[Any], at_rest: AtRest | None, stored: int, salt: bytes) -> None:
    """Read the object, seal it when encrypting at rest, write it below.  No lock held: the
    entry's source extent is held by the mark (``inflight`` or ``pins``)."""
    e = m.entry
    src: memoryview
    if m.src == ARENA:
        src = levels[ARENA].slice(e.offset, e.size)
        if at_rest is not None:
            m.gen = secrets.randbits(63)
            src = at_rest.seal(e.tenant, e.key, e.kind, m.gen, src)
    else:  # between levels below: a sealed copy moves as it is, under the same generation
        m.gen = e.gen
        src = memoryview(bytearray(stored))
        _read_below(levels[m.src], e, b"", src)
    dst = levels[m.dst]
    if m.offset >= 0:
        dst.write(m.offset, src)
        return
    # An object promoted from the per-key level still has its (immutable) file there.
    if not (e.on_fs and dst.stat(salt, e.key) is not None):
        if at_rest is None:
            dst.write(salt, e.key, e.kind, src, e.checksum)
        else:
            dst.write(salt, e.key, e.kind, src, 0, sealed_size=e.size, generation=m.gen)


class TierChain:
    """The move engine of one arena and the levels below it (see the module docstring).

    ``levels``: the arena's tier first, then the tiers below in chain order.  ``lock``: the
    owner's index lock (every method but ``make_room``, ``promote`` and ``stat_files`` is called
    with it held; those three take it themselves)."""

    def __init__(self, owner: ChainOwner, index: ArenaIndex, lock: threading.RLock, levels: Sequence[Any],
                 at_rest: AtRest | None, promote_workers: int = 4, max_promotions: int = 256) -> None:
        self.owner = owner
        self.index = index
        self.levels = list(levels)
        self.allocs: list[ExtentAllocator | None] = [getattr(t, "alloc", None) for t in self.levels]
        self.per_key = next((i for i, a in enumerate(self.allocs) if a is None), -1)
        """The level with one file per key (the shared filesystem), -1: none."""
        self.at_rest = at_rest
        self.room = threading.Condition(lock)
        """Notified when a move is flipped (DRAM freed, or a copy landed)."""
        self.pending_bytes = 0
        """DRAM bytes of demotions planned and not yet flipped (freed soon, if the disk allows)."""
        self._queue: deque[_Move | _Unlink] = deque()
        self.files = FsLedger()
        """Which per-key files a lookup may adopt (under the lock)."""
        self._wake = threading.Condition(threading.Lock())
        self._promoting: dict[int, _Move] = {}
        self._demoting: dict[int, _Move] = {}
        """Moves down in flight by id(entry) (to guard a removed object's file, see ``discarding``)."""
        self._promoting_bytes = 0
        self._max_promotions = max_promotions
        self._max_promoting_bytes = self.levels[ARENA].capacity // 4
        """Past this many DRAM bytes held by promotions stuck past their read's bound, a read
        starts no more."""
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=promote_workers, thread_name_prefix="kvpool-promote")
        self._thread = threading.Thread(target=self._run, name="kvpool-demoter", daemon=True)
        self._thread.start()

    def name(self, level: int) -> str:
        return str(self.levels[level].name)

    def stored_size(self, e: Entry) -> int:
        """Bytes of ``e`` in a level below (sealed when encrypting at rest)."""
        return sealed_size(e.size) if self.at_rest is not None else e.size

    def idle(self) -> bool:
        """No demotion, move or unlink queued or in flight."""
        with self.room:
            return not self.pending_bytes and not self._queue and not self._demoting and not self.files.busy()

    # ------------------------------------------------------------------ demotion

    def plan_demotion(self, e: TieredEntry) -> bool:
        """Mark a DRAM object for its move to the first level below that takes it; False when
        none can (the caller drops it).  Lock held."""
        move: _Move | None = None
        for level in range(ARENA + 1, len(self.levels)):
            if self.allocs[level] is None:
                move = _Move(e, ARENA, level)
                break
            off = self._alloc_below(level, self.stored_size(e))
            if off is not None:
                move = _Move(e, ARENA, level, off)
                break
        if move is None:
            return False
        e.moving = DEMOTING
        e.inflight += 1
        self.pending_bytes += e.size
        self._demoting[id(e)] = move
        self._enqueue(move)
        return True

    def _alloc_below(self, level: int, size: int) -> int | None:
        """An extent of ``size`` bytes at ``level``, making room by moving its coldest objects
        one level down (or dropping them at the bottom); None when it cannot.  Lock held."""
        alloc = self.allocs[level]
        assert alloc is not None
        if alloc.rounded(size) > alloc.capacity:
            return None
        try:
            return alloc.alloc(size)
        except OutOfSpace:
            pass
        self.index.settle_pins()
        need = alloc.rounded(size) + int(alloc.capacity * 0.05)
        nxt = level + 1 if level + 1 < len(self.levels) else -1
        freed = 0
        for v in self.index.lru(level):
            if freed >= need:
                break
            assert isinstance(v, TieredEntry)
            if v.pins or v.moving:
                continue
            off = -1
            if nxt >= 0 and self.allocs[nxt] is not None:
                try:
                    off = self.allocs[nxt].alloc(self.stored_size(v))  # type: ignore[union-attr]
                except OutOfSpace:
                    nxt = -1
            if nxt >= 0:
                # Moved, not lost: but its extent is free only once the copy is out.
                v.moving = DEMOTING
                v.pins += 1
                self._demoting[id(v)] = move = _Move(v, level, nxt, off)
                self._enqueue(move)
            else:
                self.owner.discard(v)
                self.owner.count(StoreCounter.EVICTED, v.tenant)
            freed += v.size  # moved or dropped: either way its extent is on its way out
        try:
            return alloc.alloc(size)
        except OutOfSpace:
            return None

    def make_room(self, sizes: Sequence[int], deadline: float, high: float, low: float) -> None:
        """Before a write reserves DRAM extents of ``sizes`` (rounded) bytes: start the demotions
        that make them fit (down to the ``low`` watermark once above ``high``), then wait for
        them, with the lock released, until the extents would fit, nothing more can be moved, or
        ``deadline`` (monotonic) passes.  Call without the lock."""
        alloc = self.allocs[ARENA]
        assert alloc is not None
        total = sum(sizes)
        with self.room:
            need = watermark_need(alloc.used - self.pending_bytes, total, alloc.capacity, high, low)
            if need:
                self.owner.evict_dram(need, time.time())
            step = max(need, max(sizes))
            while not _fits(alloc, sizes):
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

    def discarding(self, e: TieredEntry) -> None:
        """``e`` is being removed: if a copy of it to the per-key level is on its way, no lookup
        may adopt that file from now on (it is unlinked once written).  Lock held."""
        m = self._demoting.get(id(e))
        if m is not None and m.dst == self.per_key and not m.guarded:
            m.guarded = True
            self.files.removing(e.tenant, e.key)

    def remove_file(self, tenant: str, salt: bytes, key: bytes) -> None:
        """Unlink an object's shared-fs file off the lock (FIFO: before any later copy of the same
        key is written); until then no lookup adopts it.  Lock held."""
        self.files.removing(tenant, key)
        self._enqueue(_Unlink(tenant, salt, key))

    def _unlink(self, job: _Unlink) -> None:
        try:
            self.levels[self.per_key].remove(job.salt, job.key)
        except OSError as exc:
            log.warning("shared-fs removal failed: %s", exc)
        with self.room:
            self.files.unlinked(job.tenant, job.key)

    def stat_files(self, salt: bytes, keys: list[bytes], prefix_only: bool, timeout: float) -> FsView:
        """Headers of the per-key level's files of ``keys`` (with ``prefix_only`` up to the first
        key with none), read on the pool's threads for at most ``timeout`` seconds: a hung file
        system makes the keys not read by then misses.  Call without the lock."""
        fs = self.levels[self.per_key]
        got: list[tuple[bytes, SharedFsHeader]] = []
        since = time.monotonic()
        self.files.horizon = max(60.0, 10 * timeout)

        def run() -> None:
            for k in keys:
                hdr = fs.stat(salt, k)
                if hdr is None:
                    if prefix_only:
                        return
                    continue
                got.append((k, hdr))
        try:
            self._pool.submit(run).result(timeout)
        except FutureTimeout:
            with self.room:
                self.owner.count(StoreCounter.TIER_STAT_TIMEOUTS)
        except (OSError, RuntimeError) as exc:  # an unreadable directory, or shut down: misses
            log.warning("shared-fs lookup failed: %s", exc)
        return FsView(dict(list(got)), since)  # a copy: the stats may still be running

    def _enqueue(self, move: _Move | _Unlink) -> None:
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
                if isinstance(move, _Unlink):
                    self._unlink(move)
                    continue
                try:
                    self._copy_down(move)
                except Exception as exc:  # noqa: BLE001 - a failed copy drops the object, never the thread
                    log.warning("tier move of an object failed: %s", exc)
                    move.code = pb.CHECKSUM
                cleanup = self._flip_down(move)
                if cleanup is not None:
                    self._unlink(cleanup)  # now, on this thread: ahead of any later copy of the key
            except Exception as exc:  # noqa: BLE001 - e.g. the node closing its tiers under a copy
                if not self._closed:
                    log.error("tier chain: %s", exc)

    def _copy_down(self, m: _Move) -> None:
        """The move of a mark, without the lock (:func:`_copy_down`)."""
        salt = self.owner.fs_salt(m.entry.tenant) if m.offset < 0 else b""
        _copy_down(m, self.levels, self.at_rest, self.stored_size(m.entry), salt)

    def _flip_down(self, m: _Move) -> _Unlink | None:
        """Make a finished copy the object's place (or undo it); returns a shared-fs file to
        remove outside the lock when the copy is not wanted any more."""
        e = m.entry
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
            dst_alloc = self.allocs[m.dst]
            self.room.notify_all()
            if gone or m.code != pb.OK:
                if dst_alloc is not None and m.offset >= 0:
                    dst_alloc.free(m.offset)
                if not gone:
                    log.warning("tier write failed: dropping the object instead of moving it")
                    self.owner.discard(e)
                    self.owner.count(StoreCounter.EVICTED, e.tenant)
                # A file written for an object removed meanwhile goes too (FIFO: before any later
                # copy of the same key), or a lookup would bring the removed object back.
                if gone and dst_alloc is None:
                    if not m.guarded:
                        self.files.removing(e.tenant, e.key)
                    return _Unlink(e.tenant, self.owner.fs_salt(e.tenant), e.key)
                return None
            if m.src == ARENA and (e.pins or e.inflight):
                # Read or leased while it was copied: it stays in DRAM (it is hot), the copy goes.
                if dst_alloc is not None:
                    dst_alloc.free(m.offset)
                else:
                    e.on_fs = True  # the file is there: a removal must take it too
                self.owner.count(StoreCounter.DEMOTIONS_ABANDONED)
                return None
            if m.src == ARENA:
                self.index.drop_token(e)
            self.index.move(e, m.dst, m.offset)
            e.gen = m.gen
            if dst_alloc is None:
                e.on_fs = True
            if self.allocs[m.src] is not None and dst_alloc is None:
                self.owner.account(e.tenant, -e.size)  # the per-key level is outside the quota
            if m.src == ARENA and self.at_rest is not None:
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
        waits: list[_Move] = []
        deadline = time.monotonic() + timeout
        todo = list(entries)
        rounded = self.levels[ARENA].alloc.rounded
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
            failed[id(e)] = pb.NO_SPACE
        for m in waits:
            if not m.done.wait(max(0.0, deadline - time.monotonic())):
                continue
            if m.code != pb.OK:
                failed[id(m.entry)] = m.code
        return failed

    def _plan_promotions(self, entries: Sequence[TieredEntry], waits: list[_Move], timeout: float
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
                    m = _Move(e, e.tier, ARENA, off)
                    e.moving = PROMOTING
                    e.pins += 1
                    self._promoting[id(e)] = m
                    self._promoting_bytes += e.size
                    self._pool.submit(self._promote_one, m)
                waits.append(m)
        return short

    def _promote_one(self, m: _Move) -> None:
        e = m.entry
        dst = self.levels[ARENA].slice(m.offset, e.size)
        salt = b"" if self.allocs[m.src] is not None else self.owner.fs_salt(e.tenant)
        try:
            code, auth_failed, previous_key = _open_up(self.at_rest, self.levels[m.src], e, salt, dst)
        except Exception as exc:  # noqa: BLE001 - an unreadable copy is a miss, never a crash
            log.warning("promotion read failed: %s", exc)
            code, auth_failed, previous_key = pb.NOT_FOUND, False, False
        with self.room:
            e.pins -= 1
            e.moving = IDLE
            self._promoting.pop(id(e), None)
            self._promoting_bytes -= e.size
            if previous_key:
                self.owner.count(StoreCounter.AT_REST_PREVIOUS_KEY_OPENS)
            if code == pb.OK and e.state == COMMITTED and e.tier == m.src:
                if self.allocs[m.src] is None:
                    self.owner.account(e.tenant, e.size)
                self.index.move(e, ARENA, m.offset)
                self.index.bind_token(e)
                e.last_access = time.time()
                self.owner.count(StoreCounter.PROMOTED)
            else:
                self.allocs[ARENA].free(m.offset)  # type: ignore[union-attr]
                if code == pb.OK:
                    code = pb.NOT_FOUND  # removed or moved meanwhile
                elif e.state == COMMITTED:
                    if code == pb.CHECKSUM:
                        # A copy that does not authenticate (tampered, truncated, sealed for another
                        # tenant or key) is counted as such; the tag caught it before the checksum.
                        self.owner.count(StoreCounter.AT_REST_AUTH_FAILURES if auth_failed
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
