"""The sidecar's write-behind engine: local objects to the pool, in the background.

One writer thread takes batches off a queue: committed arena entries (pinned while queued:
write-through puts, deferred blocks, due retries) or the bytes of evicted objects (copies, the
only ones left).  The put path never waits for it: over ``max_pending`` bytes of backlog a new
batch is *shed* (its blocks become local-only, handed over on eviction and drain like write-back
blocks, and queued again when the backlog has room).  A write that failed for a passing reason
is tried again with doubling delays (:class:`kvpool.core.retry.RetryQueue`), then counted as
dropped.  While puts are being served the writer holds its next batch back (at most
``yield_seconds``): a write-through and the engine's next put compete for the same cores, and
the put is what the engine waits for.  SIGTERM's flush of what is still local-only:
:mod:`kvpool.sidecar.flush`.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any

from kvpool.core import retry
from kvpool.core.retry import UNREACHABLE, RetryQueue
from kvpool.core.traffic import traffic_class_or_default
from kvpool.pool.fanout import Pool
from kvpool.sidecar import metrics
from kvpool.sidecar.local_tier import LocalEntry, LocalLease, LocalTier
from kvpool.wire import grpc_status
from kvpool.wire.counters import SidecarCounter, pool_write_failed
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.sidecar")

PIN_MS = 600_000
"""Pin of entries on their way to the pool (released when the write is done)."""
QUIET_SECONDS = 0.005
"""No put seen for this long: the puts have paused and the writer goes on (a put of 16 x 1 MiB
takes a few ms between its reserve and its commit, the next one follows its commit at once)."""


def hold_back(now: float, put_seen_at: float, deadline: float) -> float:
    """How long the pool writer should still wait before its next batch: until QUIET_SECONDS
    after the last put seen, and never past ``deadline`` (0: go now)."""
    return max(0.0, min(put_seen_at + QUIET_SECONDS, deadline) - now)


def verdict(got: dict[int, int]) -> dict[int, pb.Code]:
    """A pool write's codes (:meth:`Writer.push`) as a put's answer: UNAVAILABLE where no owner
    was reached."""
    return {k: pb.UNAVAILABLE if c == UNREACHABLE else grpc_status.as_code(c) for k, c in got.items()}


class Writer:
    """The write-behind queue, its thread and its retries; thread-safe."""

    def __init__(self, local: LocalTier, pool: Pool, counters: Any, tenant_id: str, write_back: bool,
                 max_pending: int, retries: int, yield_seconds: float = 0.0) -> None:
        self.local, self.pool, self.counters = local, pool, counters
        self.tenant_id = tenant_id
        self.write_back = write_back
        self.max_pending = max_pending
        self.yield_seconds = yield_seconds
        self._put_seen_at = float("-inf")
        self._lock = threading.Lock()
        self.pending: queue.Queue[tuple[list[LocalEntry], list[bytes] | None] | None] = queue.Queue()
        self.pending_bytes = 0
        self._deferred: collections.deque[LocalEntry] = collections.deque()
        self.deferred_bytes = 0
        self._pins: dict[int, int] = {}  # id(batch) → lease pinning it while the writer has it
        # Blocks waiting to be written again after a passing failure (guarded by ``_lock``);
        # bounded like the backlog they are part of.
        self.retries: RetryQueue[LocalEntry] = RetryQueue(retries, max_pending)
        self._copies: dict[LocalEntry, bytes] = {}
        """Evicted objects waiting in ``retries`` → the copy of their bytes (the only one left)."""
        self._thread = threading.Thread(target=self._loop, name="pool-writer", daemon=True)
        self._thread.start()

    def backlog_bytes(self) -> int:
        """Bytes on their way to the pool: queued, deferred (shed) and waiting for a retry."""
        return max(self.pending_bytes + self.deferred_bytes + self.retries.bytes, 0)

    def sending(self) -> bool:
        """Whether write-through batches are queued or being written (what the drain at
        SIGTERM waits for before it is done)."""
        return self.pending_bytes > 0

    def put_seen(self) -> None:
        """A put is being served (its reserve or its commit): the next batch waits a moment."""
        self._put_seen_at = time.monotonic()

    def _hold_back(self) -> None:
        """Before a batch: wait while puts are being served, at most ``yield_seconds``."""
        if self.yield_seconds <= 0:
            return
        now = time.monotonic()
        deadline = now + self.yield_seconds
        wait = hold_back(now, self._put_seen_at, deadline)
        if wait <= 0:
            return
        self.counters[SidecarCounter.POOL_WRITES_HELD_BACK] += 1
        while wait > 0:
            time.sleep(wait)
            wait = hold_back(time.monotonic(), self._put_seen_at, deadline)

    def close(self) -> None:
        self.pending.put(None)
        self._thread.join(timeout=5)

    # -- what the put path, eviction and ring changes hand over ----------------------------------

    def enqueue(self, entries: list[LocalEntry], copies: list[bytes] | None = None,
                pin: LocalLease | None = None) -> None:
        """Queue a batch for the pool writer: pinned arena entries (``pin``) or evicted copies."""
        size = sum(e.size for e in entries)
        if copies is None and self.pending_bytes + size > self.max_pending and self.pending_bytes > 0:
            # Shed rather than stall the engine: the blocks become local-only (handed over on
            # eviction and drain like write-back blocks) and the writer takes them up again
            # when the backlog has room.
            self.counters[SidecarCounter.POOL_WRITES_SHED] += len(entries)
            self.local.mark_dirty(entries)
            with self._lock:
                self._deferred.extend(entries)
                self.deferred_bytes += size
            if pin is not None:
                self.local.release([pin.lease_id])
            return
        with self._lock:
            self.pending_bytes += size
        if copies is None:
            entries = list(entries)
            if pin is not None:
                self._pins[id(entries)] = pin.lease_id
            self.pending.put((entries, None))
        else:
            self.pending.put((entries, copies))

    def on_evict(self, evicted: list[tuple[LocalEntry, bytes]]) -> None:
        """The local tier evicted these (dirty or not yet pooled) objects: their copies to the pool."""
        if self.pool.enabled:
            self.enqueue([e for e, _ in evicted], [b for _, b in evicted])

    def ring_changed(self, ring: Any) -> None:
        """Write-through blocks whose pool write failed (their owner was unreachable) get another
        chance under the new ring; write-back blocks and state objects wait for eviction/drain."""
        if self.write_back:
            return
        self.defer([e for e in self.local.local_only() if e.kind == pb.BLOCK])

    def defer(self, blocks: list[LocalEntry]) -> None:
        """Queue local-only write-through blocks for another pool write (once each)."""
        if not blocks:
            return
        with self._lock:
            queued = {id(e) for e in self._deferred}
            todo = [e for e in blocks if id(e) not in queued]
            self._deferred.extend(todo)
            self.deferred_bytes += sum(e.size for e in todo)
        self.counters[SidecarCounter.POOL_WRITES_RETRIED] += len(todo)

    # -- writes on the caller's thread -----------------------------------------------------------

    def push_pinned(self, entries: list[LocalEntry], pin: LocalLease | None, what: str) -> dict[int, int]:
        """Write committed arena entries (pinned by ``pin``) to the pool now, then unpin them:
        id(entry) → the pool's code, missing for one not sent (the push raised)."""
        got: dict[int, int] = {}
        try:
            if entries:
                self.push(entries, None, got)
        except Exception:
            log.exception("pool write (%s) failed", what)
        finally:
            if pin is not None:
                self.local.release([pin.lease_id])
        return got

    def write_waited(self, entries: list[LocalEntry], pin: LocalLease, seconds: float) -> dict[int, pb.Code]:
        """Write committed objects (pinned by ``pin``) to the pool on a thread of their own and
        wait for it at most ``seconds``: id(entry) → the pool's code, UNAVAILABLE for an object
        no owner took (down, unreachable) and missing for one whose write was still on its way
        at the deadline.  What happens after is what happens to any write-through: a passing
        failure is tried again later, a refusal leaves the object local-only."""
        got: dict[int, int] = {}
        answer: dict[int, pb.Code] = {}
        lock = threading.Lock()
        finished = threading.Event()

        def run() -> None:
            try:
                got.update(self.push_pinned(entries, pin, "put with wait"))
            finally:
                with lock:  # all at once: a caller past its deadline sees none of it, never half
                    answer.update(verdict(got))
                finished.set()
            self.retry_later(entries, None, got)

        threading.Thread(target=run, name="kvpool-put-wait", daemon=True).start()
        finished.wait(seconds)
        with lock:
            return dict(answer)

    def push(self, entries: list[LocalEntry], copies: list[bytes] | None,
             codes_out: dict[int, int] | None = None) -> tuple[int, int]:
        """Write a batch to the owners (never what the pool is known to hold); ok / failed counts
        (and, into ``codes_out``, id(entry) → the pool's code for each entry sent).

        An item refused because our ring is stale (DRAINING, WRONG_OWNER) is sent once more after
        learning the new ring; one that still failed stays local-only (dirty), so eviction or
        the drain at SIGTERM hands it over again (and the pool writer tries a write-through
        block again later if the failure was a passing one: :meth:`retry_later`).
        """
        todo = [i for i, e in enumerate(entries) if not e.pooled]
        if not todo:
            return 0, 0
        epoch = self.pool.ring.epoch
        ok = failed = 0
        groups: dict[tuple[int, str], list[int]] = {}
        for i in todo:
            groups.setdefault((entries[i].kind, traffic_class_or_default(entries[i].traffic_class)), []).append(i)
        still_local: list[LocalEntry] = []
        journaled: list[LocalEntry] = []  # now in the pool: a restart need not send them again
        for (kind, traffic_class), sel in groups.items():
            codes: dict[int, int] = {}
            for attempt in range(2):
                views = [memoryview(copies[i]) if copies is not None else self.local.view(entries[i]) for i in sel]
                routed = self.pool.ring.epoch
                got = self.pool.put([entries[i].key for i in sel], views, [entries[i].checksum for i in sel],
                                    traffic_class, kind)
                codes.update(zip(sel, got, strict=True))
                stale = [i for i in sel if codes[i] in (pb.DRAINING, pb.WRONG_OWNER)]
                # A writer, not the engine's read path: it may wait (bounded) for the newer ring.
                if not stale or attempt or not self.pool.catch_up(routed, wait_seconds=self.pool.rpc_timeout):
                    break
                sel = stale
            for i, c in codes.items():
                if codes_out is not None:
                    codes_out[id(entries[i])] = c
                if c in (pb.OK, pb.ALREADY_EXISTS):
                    entries[i].pooled = True
                    entries[i].dirty = False
                    ok += 1
                    if copies is None:
                        journaled.append(entries[i])
                else:
                    failed += 1
                    self.counters[pool_write_failed(c)] += 1
                    if copies is None:
                        still_local.append(entries[i])
        self.local.note_flags(journaled)
        if still_local:
            self.local.mark_dirty(still_local)
            if self.pool.ring.epoch != epoch and not self.write_back:
                # The ring changed while this batch was on its way (to an owner that is gone):
                # the retry of :meth:`ring_changed` may have missed it, so queue it again.
                self.defer([e for e in still_local if e.kind == pb.BLOCK])
        self.counters[SidecarCounter.POOL_WRITES] += ok
        metrics.POOL_BYTES_OUT.labels(self.tenant_id).inc(sum(entries[i].size for i in todo if entries[i].pooled))
        return ok, failed

    # -- the writer thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        """The pool writer (background thread): one queued batch after another; in between,
        deferred blocks and due retries are queued again."""
        while True:
            try:
                item = self.pending.get(timeout=0.1)
            except queue.Empty:
                self._resume_waiting()
                continue
            if item is None:
                return
            entries, copies = item
            codes: dict[int, int] = {}
            try:
                self._hold_back()
                self.push(entries, copies, codes)
            except Exception:
                log.exception("pool write failed")
            finally:
                with self._lock:
                    self.pending_bytes -= sum(e.size for e in entries)
                lid = self._pins.pop(id(entries), None)
                if lid:
                    self.local.release([lid])
            self.retry_later(entries, copies, codes)
            if self.pending.empty():
                self._resume_waiting()
            else:
                self._resume_retries()  # due retries queue behind the batches already waiting

    def _resume_waiting(self) -> None:
        """Queue again what waits for the writer: deferred blocks (backlog room) and due retries."""
        if self._deferred:
            self._resume_deferred()
        self._resume_retries()

    def _resume_deferred(self) -> None:
        """Queue deferred write-through blocks again while the backlog has room."""
        batch: list[LocalEntry] = []
        nbytes = 0
        with self._lock:
            while self._deferred and len(batch) < 64:
                e = self._deferred[0]
                if batch and self.pending_bytes + nbytes + e.size > self.max_pending:
                    break
                self._deferred.popleft()
                batch.append(e)
                nbytes += e.size
            # Moved from deferred to pending in one step: the backlog never reads 0 meanwhile.
            self.deferred_bytes -= nbytes
            self.pending_bytes += nbytes
        if not batch:
            return
        lease = self.local.lease([e for e in batch if e.dirty], PIN_MS)  # evicted ones went as copies
        with self._lock:
            self.pending_bytes -= nbytes - sum(e.size for e in lease.entries)
        self._queue_pinned(lease)

    def _queue_pinned(self, lease: LocalLease) -> None:
        """Queue the entries ``lease`` pins as one batch (the writer releases it), or release it."""
        if lease.entries:
            entries = list(lease.entries)
            self._pins[id(entries)] = lease.lease_id
            self.pending.put((entries, None))
        else:
            self.local.release([lease.lease_id])

    def retry_later(self, entries: list[LocalEntry], copies: list[bytes] | None, codes: dict[int, int]) -> None:
        """After a batch: schedule another write of each write-through block or evicted copy
        that failed for a passing reason (:func:`kvpool.core.retry.retried`).  One tried too
        often, or not fitting the backlog, is counted as dropped: a block still local stays
        local-only (eviction or the drain hands it over), an evicted copy is lost."""
        scheduled = kept_local = lost = lost_bytes = 0
        now = time.monotonic()
        with self._lock:
            for i, e in enumerate(entries):
                copy = copies[i] if copies is not None else None
                # A block missing from ``codes`` was not sent (the push raised): try it again too.
                if not retry.retried(codes.get(id(e), UNREACHABLE), e.pooled, copy is not None, e.kind == pb.BLOCK,
                                     self.write_back):
                    self.retries.settle(e)
                elif self.retries.schedule(e, e.size, now):
                    scheduled += 1
                    if copy is not None:
                        self._copies[e] = copy
                elif copy is None:
                    kept_local += 1
                else:
                    lost += 1
                    lost_bytes += e.size
        if scheduled:
            self.counters[SidecarCounter.POOL_WRITES_BACKOFF] += scheduled
        if kept_local or lost:
            self.counters[SidecarCounter.POOL_WRITES_DROPPED] += kept_local + lost
        if kept_local:
            log.warning("%d write-through blocks dropped after %d pool write retries (or for a full backlog): "
                        "they stay local-only", kept_local, self.retries.max_attempts)
        if lost:
            log.warning("%d evicted objects (%d bytes) lost: their pool write failed for a passing reason %d "
                        "times, or the backlog (%d bytes) had no room for their copies", lost, lost_bytes,
                        self.retries.max_attempts + 1, self.retries.max_bytes)

    def _resume_retries(self) -> None:
        """Queue the retries that are due: the evicted copies as one batch, the blocks still local
        and not pooled as one pinned batch."""
        now = time.monotonic()
        with self._lock:
            due = self.retries.next_due()
            if due is None or due > now:
                return
            taken = self.retries.take_due(now, 64)
            copied = [(e, self._copies.pop(e)) for e, _ in taken if e in self._copies]
            # Moved from the retries to pending in one step: the backlog never reads 0 meanwhile.
            self.pending_bytes += sum(size for _, size in taken)
        if copied:
            self.pending.put(([e for e, _ in copied], [c for _, c in copied]))
        in_copies = {id(e) for e, _ in copied}
        local = [e for e, _ in taken if id(e) not in in_copies]
        if not local:
            return
        live = [e for e in local if e.dirty and not e.pooled]
        lease = self.local.lease(live, PIN_MS)  # an evicted block went to the pool as a copy
        kept = {id(e) for e in lease.entries}
        with self._lock:
            self.pending_bytes -= sum(e.size for e in local if id(e) not in kept)
            for e in local:
                if id(e) not in kept:
                    self.retries.settle(e)
        self._queue_pinned(lease)

    def take_retries(self) -> dict[LocalEntry, bytes]:
        """Everything waiting for a retry, now (the drain does not wait out backoffs): the
        evicted objects' copies, handed to the caller; the blocks still local are left to the
        drain's pass over the local tier."""
        with self._lock:
            taken = self.retries.take_due(float("inf"), len(self.retries))
            for e, _ in taken:
                self.retries.settle(e)
            return {e: self._copies.pop(e) for e, _ in taken if e in self._copies}
