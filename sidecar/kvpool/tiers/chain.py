"""Tier moves of a store node, with every byte of tier I/O and sealing outside the index lock.

A slow or hung disk must never stall DRAM hits or other tenants, so no SSD or shared-filesystem
read or write, and no sealing (encryption at rest), runs under the node's ``lock``.  A move of
an object between tiers (DRAM → SSD or shared fs, SSD → shared fs, and back to DRAM for a read)
has three steps:

1. *Plan*, under the lock (no I/O): allocate the destination extent, mark the entry ``moving``
   and hold it — a demotion holds it ``inflight`` (it stays readable from DRAM, and victim choice
   skips it, so it is never demoted twice), a promotion or an SSD → shared-fs move ``pins`` it
   (neither eviction, expiry nor a removal takes it meanwhile) — and queue the copy.
2. *Copy*, without the lock: read, seal or open, verify, write.
3. *Publish*, under the lock: the entry points at its new place and its old extent is freed —
   unless it changed meanwhile (removed; read or pinned by a lease, for a demotion: the new copy
   is dropped and the entry stays where it was, readable).

Demotions and SSD → shared-fs moves run on one background thread, first in first out (a later
move of the same object never overtakes an earlier one).  A writer that needs DRAM waits for
them at most ``NodeConfig.demote_wait_seconds``, with the lock released, and then gets NO_SPACE
for what does not fit: when the disk cannot keep up, writes are shed, reads never wait.
Promotions run on a small pool; a reader waits at most ``NodeConfig.tier_read_seconds`` and the
objects that did not arrive by then are misses of that call (the copy still lands for the next).
When DRAM is full while demotions are on their way, a writer sheds rather than demoting more
(the choice of victims stays ``eviction.choose_victims``, pure, made under the lock).

The shared filesystem's metadata is handled the same way: the headers of unknown keys are read
off the lock (:meth:`TierMover.stat_files`, bounded like a read) and adopted under it, and a
removed object's file is unlinked by the background thread, FIFO with the copies; until then,
and for a header read before the unlink, the file is not adopted (:meth:`TierMover.may_adopt`).
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
from typing import TYPE_CHECKING

from kvpool.arena.allocator import OutOfSpace
from kvpool.arena.eviction import watermark_need
from kvpool.core.checksum import checksum
from kvpool.tiers.atrest import sealed_size
from kvpool.tiers.sharedfs import SharedFsHeader
from kvpool.wire.proto import store_pb2 as pb

if TYPE_CHECKING:
    from kvpool.store.node import Entry, StoreNode

log = logging.getLogger("kvpool.store")

IDLE, DEMOTING, PROMOTING = 0, 1, 2
"""``Entry.moving``: what a planned move is doing to the entry."""

COMMITTED = 1  # node.COMMITTED (not imported: node imports this module)


@dataclass
class _Move:
    entry: Entry
    src: str
    dst: str
    offset: int = -1
    """Destination extent (SSD or DRAM); -1 for the shared filesystem."""
    gen: int = 0
    code: int = pb.OK
    started: float = field(default_factory=time.monotonic)
    guarded: bool = False
    """A shared-fs destination whose object was removed meanwhile: already in ``fs_removing``."""
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class FsView:
    """Headers of shared-fs files read off the lock (:meth:`TierMover.stat_files`), and when the
    reading started: a file unlinked after that is not adopted (``TierMover.may_adopt``)."""

    headers: dict[bytes, SharedFsHeader]
    since: float


@dataclass
class _Unlink:
    """The removal of an object's shared-fs file (queued, FIFO with the moves)."""

    tenant: str
    salt: bytes
    key: bytes


class TierMover:
    """The move engine of one :class:`~kvpool.store.node.StoreNode` (see the module docstring).

    ``plan_demotion``, ``ssd_alloc`` and ``pending_bytes`` are called and read with the node's
    lock held; ``make_room`` and ``promote`` take it themselves and must be called without it.
    """

    def __init__(self, node: StoreNode, promote_workers: int = 4, max_promotions: int = 256) -> None:
        self.node = node
        self.room = threading.Condition(node.lock)
        """Notified when a move is published (DRAM freed, or a copy landed)."""
        self.pending_bytes = 0
        """DRAM bytes of demotions planned and not yet published (freed soon, if the disk allows)."""
        self._queue: deque[_Move | _Unlink] = deque()
        self.fs_removing: Counter[tuple[str, bytes]] = Counter()
        """(tenant, key) of shared-fs files whose unlink is on its way: never adopted meanwhile."""
        self._unlinked: dict[tuple[str, bytes], float] = {}
        """(tenant, key) → when its file was unlinked (monotonic), recent ones: a header read
        before that is stale."""
        self._wake = threading.Condition(threading.Lock())
        self._promoting: dict[int, _Move] = {}
        self._demoting: dict[int, _Move] = {}
        """Moves down in flight by id(entry) (to guard a removed object's file, see ``discarding``)."""
        self._promoting_bytes = 0
        self._max_promotions = max_promotions
        self._max_promoting_bytes = node.dram.capacity // 4
        """Past this many DRAM bytes held by promotions stuck past their read's bound, a read
        starts no more."""
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=promote_workers, thread_name_prefix="kvpool-promote")
        self._thread = threading.Thread(target=self._run, name="kvpool-demoter", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ demotion

    def plan_demotion(self, e: Entry) -> bool:
        """Queue a DRAM object's move to the SSD (or the shared filesystem); False when no tier
        below can take it (the caller drops it).  Caller holds the lock."""
        n = self.node
        move: _Move | None = None
        if n.ssd is not None:
            off = self.ssd_alloc(n._stored_size(e))
            if off is not None:
                move = _Move(e, "dram", "ssd", off)
        if move is None and n.sharedfs is not None:
            move = _Move(e, "dram", "sharedfs")
        if move is None:
            return False
        e.moving = DEMOTING
        e.inflight += 1
        self.pending_bytes += e.size
        self._demoting[id(e)] = move
        self._enqueue(move)
        return True

    def ssd_alloc(self, size: int) -> int | None:
        """An SSD extent of ``size`` bytes, making room by dropping (or, with a shared-fs tier,
        queueing the move of) the coldest SSD objects; None when it cannot.  Caller holds the lock."""
        n = self.node
        assert n.ssd is not None
        if n.ssd.alloc.rounded(size) > n.ssd.capacity:
            return None
        try:
            return n.ssd.alloc.alloc(size)
        except OutOfSpace:
            pass
        n._settle_pins()
        need = n.ssd.alloc.rounded(size) + int(n.ssd.capacity * 0.05)
        freed = 0
        for v in list(n.lru_ssd.values()):
            if freed >= need:
                break
            if v.pins or v.moving:
                continue
            if n.sharedfs is not None:
                # Moved, not lost: but its extent is free only once the copy is out.
                v.moving = DEMOTING
                v.pins += 1
                self._demoting[id(v)] = move = _Move(v, "ssd", "sharedfs")
                self._enqueue(move)
            else:
                n._discard(v)
                n._count_evicted(v)
            freed += v.size  # moved or dropped: either way its extent is on its way out
        try:
            return n.ssd.alloc.alloc(size)
        except OutOfSpace:
            return None

    def make_room(self, sizes: Sequence[int], deadline: float) -> None:
        """Before a write reserves extents of ``sizes`` (rounded) bytes: start the demotions that
        make them fit (down to the low watermark, as a synchronous eviction did), then wait for
        them, with the lock released, until the extents would fit, nothing more can be moved, or
        ``deadline`` (monotonic) passes.  Call without the lock."""
        n = self.node
        total = sum(sizes)
        with self.room:
            need = watermark_need(n.dram.alloc.used - self.pending_bytes, total, n.dram.capacity,
                                  n.cfg.high_watermark, n.cfg.low_watermark)
            if need:
                n._evict_dram(need, time.time())
            step = max(need, max(sizes))
            while not self._fits(sizes):
                if not self.pending_bytes:
                    # Nothing on its way down (a fragmented arena): move more, geometrically.
                    used = n.dram.alloc.used
                    n._evict_dram(step, time.time(), expire_all=False)
                    if not self.pending_bytes and n.dram.alloc.used == used:
                        return  # nothing left to move: the reservation sheds what does not fit
                    step *= 2
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    n.counters["demote_waits_timed_out"] += 1
                    return
                self.room.wait(left)

    def _fits(self, sizes: Sequence[int]) -> bool:
        """Whether extents of ``sizes`` could be allocated now (a trial, undone).  Lock held."""
        alloc = self.node.dram.alloc
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

    def discarding(self, e: Entry) -> None:
        """``e`` is being removed: if a copy of it to the shared filesystem is on its way, no
        lookup may adopt that file from now on (it is unlinked once written).  Lock held."""
        m = self._demoting.get(id(e))
        if m is not None and m.dst == "sharedfs" and not m.guarded:
            m.guarded = True
            self.fs_removing[(e.tenant, e.key)] += 1

    def remove_file(self, tenant: str, salt: bytes, key: bytes) -> None:
        """Unlink an object's shared-fs file off the lock (FIFO: before any later copy of the same
        key is written); until then no lookup adopts it.  Caller holds the lock."""
        self.fs_removing[(tenant, key)] += 1
        self._enqueue(_Unlink(tenant, salt, key))

    def _unlink(self, job: _Unlink) -> None:
        assert self.node.sharedfs is not None
        try:
            self.node.sharedfs.remove(job.salt, job.key)
        except OSError as exc:
            log.warning("shared-fs removal failed: %s", exc)
        with self.node.lock:
            k = (job.tenant, job.key)
            self.fs_removing[k] -= 1
            if self.fs_removing[k] <= 0:
                del self.fs_removing[k]
            now = self._unlinked[k] = time.monotonic()
            if len(self._unlinked) > 4096:
                # A header is used within its read's bound of being read: older marks are moot.
                horizon = now - max(60.0, 10 * self.node.cfg.tier_read_seconds)
                self._unlinked = {x: t for x, t in self._unlinked.items() if t >= horizon}

    def may_adopt(self, tenant: str, key: bytes, since: float) -> bool:
        """Whether a shared-fs file seen by a read that started at ``since`` may be adopted: not
        when its unlink is on its way or happened since.  Lock held."""
        k = (tenant, key)
        return k not in self.fs_removing and self._unlinked.get(k, -1.0) < since

    def stat_files(self, salt: bytes, keys: list[bytes], prefix_only: bool, timeout: float) -> FsView:
        """Headers of the shared-fs files of ``keys`` (with ``prefix_only`` up to the first key
        with none), read on the pool's threads for at most ``timeout`` seconds: a hung file
        system makes the keys not read by then misses.  Call without the lock."""
        fs = self.node.sharedfs
        assert fs is not None
        got: list[tuple[bytes, SharedFsHeader]] = []
        since = time.monotonic()

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
            with self.node.lock:
                self.node.counters["tier_stat_timeouts"] += 1
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
                cleanup = self._publish_down(move)
                if cleanup is not None:
                    self._unlink(cleanup)  # now, on this thread: ahead of any later copy of the key
            except Exception as exc:  # noqa: BLE001 - e.g. the node closing its tiers under a copy
                if not self._closed:
                    log.error("tier mover: %s", exc)

    def _copy_down(self, m: _Move) -> None:
        """Read the object, seal it when encrypting at rest, write it below.  No lock held: the
        entry's source extent is held by the plan (``inflight`` or ``pins``)."""
        n, e = self.node, m.entry
        if m.src == "dram":
            src: memoryview = n.dram.slice(e.offset, e.size)
            if n.at_rest is not None:
                m.gen = secrets.randbits(63)
                src = n.at_rest.seal(e.tenant, e.key, e.kind, m.gen, src)
        else:  # ssd → sharedfs: a sealed copy moves as it is, under the same generation
            assert n.ssd is not None
            m.gen = e.gen
            buf = memoryview(bytearray(n._stored_size(e)))
            n.ssd.read_into(e.offset, buf)
            src = buf
        if m.dst == "ssd":
            assert n.ssd is not None
            n.ssd.write(m.offset, src)
            return
        assert n.sharedfs is not None
        salt = n._fs_salt(e.tenant)
        # An object promoted from the shared tier still has its (immutable) file there.
        if not (e.on_fs and n.sharedfs.stat(salt, e.key) is not None):
            if n.at_rest is None:
                n.sharedfs.write(salt, e.key, e.kind, src, e.checksum)
            else:
                n.sharedfs.write(salt, e.key, e.kind, src, 0, sealed_size=e.size, generation=m.gen)

    def _publish_down(self, m: _Move) -> _Unlink | None:
        """Make a finished copy the object's place (or undo it); returns a shared-fs file to
        remove outside the lock when the copy is not wanted any more."""
        n, e = self.node, m.entry
        with self.room:
            e.moving = IDLE
            self._demoting.pop(id(e), None)
            if m.src == "dram":
                e.inflight -= 1
                self.pending_bytes -= e.size
            else:
                e.pins -= 1
            n._settle_pins()
            gone = e.state != COMMITTED
            if gone or m.code != pb.OK:
                if m.dst == "ssd" and m.offset >= 0:
                    assert n.ssd is not None
                    n.ssd.alloc.free(m.offset)
                if gone:
                    if m.src == "dram" and e.inflight == 0 and e.offset >= 0:
                        n.dram.alloc.free(e.offset)  # removed meanwhile: the last holder frees
                        e.offset = -1
                else:
                    log.warning("tier write failed: dropping the object instead of moving it")
                    n._discard(e)
                    n._count_evicted(e)
                self.room.notify_all()
                # A file written for an object removed meanwhile goes too (FIFO: before any later
                # copy of the same key), or a lookup would bring the removed object back.
                if gone and m.dst == "sharedfs":
                    if not m.guarded:
                        self.fs_removing[(e.tenant, e.key)] += 1
                    return _Unlink(e.tenant, n._fs_salt(e.tenant), e.key)
                return None
            if m.src == "dram" and (e.pins or e.inflight):
                # Read or leased while it was copied: it stays in DRAM (it is hot), the copy goes.
                if m.dst == "ssd":
                    assert n.ssd is not None
                    n.ssd.alloc.free(m.offset)
                else:
                    e.on_fs = True  # the file is there: a removal must take it too
                n.counters["demotions_abandoned"] += 1
                self.room.notify_all()
                return None
            if m.src == "dram":
                n.lru_dram.pop(id(e), None)
                n.by_token.pop(e.token, None)
                n.dram.alloc.free(e.offset)
                e.token = 0
            else:
                assert n.ssd is not None
                n.lru_ssd.pop(id(e), None)
                n.ssd.alloc.free(e.offset)
            e.tier, e.offset, e.gen = m.dst, m.offset, m.gen
            if m.dst == "ssd":
                n.lru_ssd[id(e)] = e
            else:
                e.on_fs = True
                n._tenant(e.tenant).used_bytes -= e.size  # shared tier is outside the node's quota
            if m.src == "dram" and n.at_rest is not None:
                n.counters["sealed"] += 1
            n.counters["demoted"] += 1
            self.room.notify_all()
            return None

    # ------------------------------------------------------------------ promotion

    def promote(self, entries: Sequence[Entry], timeout: float) -> dict[int, int]:
        """Bring the committed objects of ``entries`` that are below DRAM up, waiting at most
        ``timeout`` seconds; returns id(entry) → code for those that failed (NO_SPACE,
        CHECKSUM, NOT_FOUND); those still on their way are neither there nor in DRAM (misses).
        Call without the lock."""
        n = self.node
        failed: dict[int, int] = {}
        waits: list[_Move] = []
        deadline = time.monotonic() + timeout
        todo = list(entries)
        # Room first (demotions, waited for without the lock), then the reservations; another
        # reader or writer may take the room meanwhile, so what did not fit tries again.
        for _ in range(4):
            with n.lock:
                sizes = [n.dram.alloc.rounded(e.size) for e in todo
                         if e.state == COMMITTED and e.tier != "dram" and not e.moving and id(e) not in self._promoting]
            if sizes:
                self.make_room(sizes, deadline)  # a full DRAM: what comes up needs demotions first
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

    def _plan_promotions(self, entries: Sequence[Entry], waits: list[_Move], timeout: float) -> list[Entry]:
        """Start the promotion of each of ``entries`` below DRAM that has room now (or join the
        one under way), appending to ``waits``; returns those that found no room."""
        n = self.node
        short: list[Entry] = []
        with n.lock:
            now = time.time()
            # Promotions that outlived their reads' bound (a slow disk) holding much of the arena:
            # this read starts none (its objects below DRAM are misses), so a hung disk cannot tie
            # up all of it.
            stuck = self._promoting_bytes > self._max_promoting_bytes and sum(
                m.entry.size for m in self._promoting.values()
                if time.monotonic() - m.started > timeout) > self._max_promoting_bytes
            for e in entries:
                if e.state != COMMITTED or e.tier == "dram":
                    continue
                m = self._promoting.get(id(e))
                if m is None:
                    if e.moving or stuck or len(self._promoting) >= self._max_promotions:
                        continue  # moving down right now, or too many reads stuck: a miss
                    try:
                        off = n._alloc_dram(e.size, now)
                    except OutOfSpace:
                        short.append(e)
                        continue
                    m = _Move(e, e.tier, "dram", off)
                    e.moving = PROMOTING
                    e.pins += 1
                    self._promoting[id(e)] = m
                    self._promoting_bytes += e.size
                    self._pool.submit(self._promote_one, m)
                waits.append(m)
        return short

    def _promote_one(self, m: _Move) -> None:
        n, e = self.node, m.entry
        dst = n.dram.slice(m.offset, e.size)
        code = pb.NOT_FOUND
        auth_failed = previous_key = False
        try:
            if n.at_rest is None:
                if m.src == "ssd" and n.ssd is not None:
                    n.ssd.read_into(e.offset, dst)
                    code = pb.OK
                elif m.src == "sharedfs" and n.sharedfs is not None:
                    hdr = n.sharedfs.read_into(n._fs_salt(e.tenant), e.key, dst)
                    code = pb.OK if hdr is not None and not hdr.sealed else pb.NOT_FOUND
            else:
                blob = memoryview(bytearray(sealed_size(e.size)))
                gen = e.gen
                if m.src == "ssd" and n.ssd is not None:
                    n.ssd.read_into(e.offset, blob)
                    present = True
                elif m.src == "sharedfs" and n.sharedfs is not None:
                    salt = n._fs_salt(e.tenant)
                    hdr = n.sharedfs.read_into(salt, e.key, blob)
                    present = hdr is not None or n.sharedfs.stat(salt, e.key) is not None
                    ok_hdr = hdr is not None and hdr.sealed and hdr.size == e.size and hdr.kind == e.kind
                    gen = hdr.generation if hdr is not None and ok_hdr else -1
                else:
                    present = False
                if not present:
                    code = pb.NOT_FOUND  # gone (another node removed it): a plain miss
                elif gen >= 0 and n.at_rest.open_into(e.tenant, e.key, e.kind, gen, blob, dst):
                    code = pb.OK
                    previous_key = not n.at_rest.sealed_with_current(blob)
                else:
                    code, auth_failed = pb.CHECKSUM, True
            if code == pb.OK:
                actual = checksum(dst)
                if not e.checksum and m.src == "sharedfs" and n.at_rest is not None:
                    e.checksum = actual  # adopted: a sealed file carries no checksum; the tag vouched
                elif actual != e.checksum:
                    code = pb.CHECKSUM
        except Exception as exc:  # noqa: BLE001 - an unreadable copy is a miss, never a crash
            log.warning("promotion read failed: %s", exc)
            code = pb.NOT_FOUND
        with n.lock:
            e.pins -= 1
            e.moving = IDLE
            self._promoting.pop(id(e), None)
            self._promoting_bytes -= e.size
            if previous_key:
                n.counters["at_rest_previous_key_opens"] += 1
            if code == pb.OK and e.state == COMMITTED and e.tier == m.src:
                if m.src == "ssd" and n.ssd is not None:
                    n.lru_ssd.pop(id(e), None)
                    n.ssd.alloc.free(e.offset)
                else:
                    n._tenant(e.tenant).used_bytes += e.size
                e.tier, e.offset, e.token = "dram", m.offset, n._new_token()
                e.last_access = time.time()
                n.by_token[e.token] = e
                n.lru_dram[id(e)] = e
                n.counters["promoted"] += 1
            else:
                n.dram.alloc.free(m.offset)
                if code == pb.OK:
                    code = pb.NOT_FOUND  # removed or moved meanwhile
                elif e.state == COMMITTED:
                    if code == pb.CHECKSUM:
                        # A copy that does not authenticate (tampered, truncated, sealed for another
                        # tenant or key) is counted as such; the tag caught it before the checksum.
                        what = "at_rest_auth_failures" if auth_failed else "checksum_failures"
                        n.counters[what] += 1
                        n._tenant(e.tenant).counters[what] += 1
                    n._discard(e)  # the copy was bad or gone: forgotten, a miss
            m.code = code
            self.room.notify_all()
        m.done.set()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
