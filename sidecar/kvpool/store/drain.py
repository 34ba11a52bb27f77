"""Drain: a leaving node pushes its objects, hottest first, to their owners in the new ring.

Runs in a background thread of the draining node until every object moved or the deadline
passed; what could not move by then is counted as dropped.  Objects bound for one owner go
several to a put (:mod:`kvpool.store.push`, shared with the warm push).  With a bandwidth bound the pusher
sleeps whenever it is ahead of ``max_bytes_per_second`` (so a drain under load does not take the
network and the cores from serving); the deadline still wins.  Writes use the owning tenant's token,
so the objects land in the same tenant partition at the new owner.

:class:`DrainJob` is the node's one drain at a time: a ``Drain`` of a newer epoch supersedes the
running one, a ring that makes the node active again cancels it (the ``StoreAdmin`` service only
adapts it).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from kvpool.core.push_status import DrainStatus
from kvpool.core.ring import Ring
from kvpool.store.node import Entry, StoreNode
from kvpool.store.push import Progress, Targets, batch_cap, batches, pace_delay, push_batch, replica_pushes
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.store.drain")


class DrainJob:
    """The node's drain: at most one pusher at a time, each for one ring epoch (thread-safe)."""

    def __init__(self, node: StoreNode) -> None:
        self.node = node
        self._lock = threading.Lock()  # one start at a time decides which drain runs
        self._progress: Progress[DrainStatus] = Progress(DrainStatus())
        self._thread: threading.Thread | None = None

    def status(self) -> DrainStatus:
        return self._progress.status

    def start(self, ring: Ring, deadline_unix_ms: int, max_bytes_per_second: int = 0) -> DrainStatus:
        """Start pushing every object to its owners in ``ring`` (in which this node is draining).
        Idempotent (the operator may call again after a restart), and a call for an older epoch
        than the drain at hand (a late retry) changes nothing.  A newer epoch supersedes a drain
        still running by its older ring: it stops before its next batch, and the new one starts
        once it has (never two pushers at once)."""
        with self._lock:
            now = self._progress.status
            if ring.epoch <= now.epoch and now.state != "idle":
                return now
            before, before_thread = self._progress, self._thread
            before.stop.set()
            progress = Progress(DrainStatus(state="running", deadline_unix_ms=deadline_unix_ms, epoch=ring.epoch))

            def run() -> None:
                if before_thread is not None:
                    before_thread.join()
                run_drain(self.node, ring, progress, max_bytes_per_second)
            self._progress = progress
            self._thread = threading.Thread(target=run, name="drain", daemon=True)
            self._thread.start()
            return progress.status

    def ring_changed(self, ring: Ring) -> None:
        """A ring newer than the running drain's in which this node is an active member again
        calls the scale-down off: the drain stops before its next batch (what it pushed stays,
        as extra copies).  A ring without the node (removed mid-push) lets the drain go on."""
        me = ring.member(self.node.node_id)
        with self._lock:
            p = self._progress
            if (p.status.state == "running" and ring.epoch > p.status.epoch and me is not None
                    and me.state == "active"):
                p.stopped_as = "cancelled"
                p.stop.set()
                log.info("drain of epoch %d cancelled: epoch %d makes this node active again", p.status.epoch,
                         ring.epoch)


def run_drain(node: StoreNode, ring: Ring, progress: Progress[DrainStatus], max_bytes_per_second: int = 0) -> None:
    """Push every object, hottest first, in batches to its owners in ``ring`` (the thread of a
    :class:`DrainJob`), counting in ``progress`` per batch.

    With replication R a block goes to each of its R owners under ``ring`` (most of them hold it
    already, as the other replicas: the put asks first, so they cost a round trip in a batch and
    no bytes); a state object keeps one copy, at its primary.  An object counts as moved when at
    least one of its owners holds it afterwards, as dropped when none does.  A newer drain
    supersedes this one (``progress.stop`` is set): it stops before its next batch and leaves
    what it did not push to the newer drain, uncounted; so does a newer ring that makes this node
    active again (``progress.stopped_as``: "cancelled")."""
    p = progress
    deadline = p.status.deadline_unix_ms / 1000.0
    started = time.monotonic()
    active = ring.active
    objects = list(node.objects_hottest_first())
    p.set(remaining_objects=len(objects))
    tally = _Tally({id(e): 0 for e in objects})
    with Targets(node) as targets:
        try:
            if not active:
                raise RuntimeError("no active member to drain to")
            own = ring.write_owners(b"".join(e.key for e in objects)) if objects else np.zeros((0, 1), np.intp)
            objs, tgts = replica_pushes(own, [e.kind != pb.BLOCK for e in objects])
            for i in objs:
                tally.left[id(objects[i])] += 1
            plan = batches([objects[i] for i in objs], tgts, max_bytes=batch_cap(max_bytes_per_second))
            for tgt, batch in plan:
                wait = pace_delay(p.status.moved_bytes + p.status.dropped_bytes, time.monotonic() - started,
                                  max_bytes_per_second)
                if wait > 0:
                    p.stop.wait(min(wait, max(0.0, deadline - time.time())))
                if p.stop.is_set() or time.time() >= deadline:
                    break
                client = targets.client(active[int(tgt)].address, batch[0].tenant)
                codes = push_batch(node, client, batch, ring.epoch) if client is not None else {}
                tally.count(p, batch, codes)
        except Exception:
            log.exception("drain failed")
        finally:
            if p.stop.is_set():
                p.set(state=p.stopped_as)
            else:
                # Whatever is left when the deadline hits is dropped (unless an owner has it
                # already): count it, never hide it.
                tally.finish(p, [e for e in objects if id(e) not in tally.finished])
                p.set(state="done")
    if p.stop.is_set():
        log.info("drain of epoch %d stopped: %s", ring.epoch, p.stopped_as)
        return
    s = p.status
    log.info("drain done: moved %d objects (%d bytes), dropped %d", s.moved_objects, s.moved_bytes, s.dropped_objects)


class _Tally:
    """Per-object outcome of a drain whose objects go to one or more owners each."""

    def __init__(self, left: dict[int, int]) -> None:
        self.left = left
        """id(entry) -> pushes of it not done yet."""
        self.held: set[int] = set()
        """id(entry) of objects an owner holds now."""
        self.finished: set[int] = set()
        """id(entry) of objects counted in the progress."""

    def count(self, p: Progress[DrainStatus], batch: list[Entry], codes: dict[int, int]) -> None:
        """Add one batch's outcome: an owner has it now (OK, or ALREADY_EXISTS: nothing was
        sent) or not (not read here, refused or failed at the target); an object is counted, as
        moved or dropped, with its last push."""
        last = []
        for e in batch:
            k = id(e)
            if codes.get(k, -1) in (pb.OK, pb.ALREADY_EXISTS):
                self.held.add(k)
            self.left[k] -= 1
            if self.left[k] <= 0:
                last.append(e)
        self.finish(p, last)

    def finish(self, p: Progress[DrainStatus], entries: list[Entry]) -> None:
        """Count ``entries`` as moved (an owner holds each) or dropped."""
        moved = [e.size for e in entries if id(e) in self.held]
        dropped = [e.size for e in entries if id(e) not in self.held]
        self.finished.update(id(e) for e in entries)
        p.add(moved_objects=len(moved), moved_bytes=sum(moved), dropped_objects=len(dropped),
              dropped_bytes=sum(dropped), remaining_objects=-len(entries))
