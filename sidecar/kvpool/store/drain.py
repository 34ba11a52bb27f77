"""Drain: a leaving node pushes its objects, hottest first, to their owners in the new ring.

Runs in a background thread of the draining node until every object moved or the deadline
passed; what could not move by then is counted as dropped.  Objects bound for one owner go
several to a put (:mod:`kvpool.store.push`, shared with the warm push).  With a bandwidth bound the pusher
sleeps whenever it is ahead of ``max_bytes_per_second`` (so a drain under load does not take the
network and the cores from serving); the deadline still wins.  Writes use the owning tenant's token,
so the objects land in the same tenant partition at the new owner.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from kvpool.core.ring import Ring
from kvpool.store.node import Entry, StoreNode
from kvpool.store.push import Targets, batch_cap, batches, pace_delay, push_batch, replica_pushes
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.store.drain")


def run_drain(node: StoreNode, ring: Ring, progress: object, max_bytes_per_second: int = 0) -> None:
    """Push every object, hottest first, in batches to its owners in ``ring`` (the thread behind
    the ``Drain`` RPC); ``progress`` is the service's ``DrainProgress``, updated per batch.

    With replication R a block goes to each of its R owners under ``ring`` (most of them hold it
    already, as the other replicas: the put asks first, so they cost a round trip in a batch and
    no bytes); a state object keeps one copy, at its primary.  An object counts as moved when at
    least one of its owners holds it afterwards, as dropped when none does.  A newer ``Drain``
    supersedes this one (``progress.stop`` is set): it stops before its next batch and leaves
    what it did not push to the newer drain, uncounted; so does a newer ring that makes this node
    active again (``progress.stopped_as``: "cancelled")."""
    p = progress  # DrainProgress; typed loosely to avoid an import cycle with the service
    stop: threading.Event = p.stop  # type: ignore[attr-defined]
    deadline = p.deadline_unix_ms / 1000.0  # type: ignore[attr-defined]
    started = time.monotonic()
    active = ring.active
    objects = list(node.objects_hottest_first())
    p.remaining_objects = len(objects)  # type: ignore[attr-defined]
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
                wait = pace_delay(p.moved_bytes + p.dropped_bytes,  # type: ignore[attr-defined]
                                  time.monotonic() - started, max_bytes_per_second)
                if wait > 0:
                    stop.wait(min(wait, max(0.0, deadline - time.time())))
                if stop.is_set() or time.time() >= deadline:
                    break
                client = targets.client(active[int(tgt)].address, batch[0].tenant)
                codes = push_batch(node, client, batch, ring.epoch) if client is not None else {}
                tally.count(p, batch, codes)
        except Exception:
            log.exception("drain failed")
        finally:
            if stop.is_set():
                p.state = p.stopped_as  # type: ignore[attr-defined]
            else:
                # Whatever is left when the deadline hits is dropped (unless an owner has it
                # already): count it, never hide it.
                tally.finish(p, [e for e in objects if id(e) not in tally.finished])
                p.state = "done"  # type: ignore[attr-defined]
    if stop.is_set():
        log.info("drain of epoch %d stopped: %s", ring.epoch, p.stopped_as)  # type: ignore[attr-defined]
        return
    log.info("drain done: moved %d objects (%d bytes), dropped %d", p.moved_objects,  # type: ignore[attr-defined]
             p.moved_bytes, p.dropped_objects)  # type: ignore[attr-defined]


class _Tally:
    """Per-object outcome of a drain whose objects go to one or more owners each."""

    def __init__(self, left: dict[int, int]) -> None:
        self.left = left
        """id(entry) -> pushes of it not done yet."""
        self.held: set[int] = set()
        """id(entry) of objects an owner holds now."""
        self.finished: set[int] = set()
        """id(entry) of objects counted in the progress."""

    def count(self, p: object, batch: list[Entry], codes: dict[int, int]) -> None:
        """Add one batch's outcome: an owner has it now (OK, or ALREADY_EXISTS: nothing was
        sent) or not (not read here, refused or failed at the target); an object is counted, as
        moved or dropped, with its last push."""
        for e in batch:
            k = id(e)
            if codes.get(k, -1) in (pb.OK, pb.ALREADY_EXISTS):
                self.held.add(k)
            self.left[k] -= 1
            if self.left[k] <= 0:
                self.finish(p, [e])

    def finish(self, p: object, entries: list[Entry]) -> None:
        """Count ``entries`` as moved (an owner holds each) or dropped."""
        for e in entries:
            self.finished.add(id(e))
            if id(e) in self.held:
                p.moved_objects += 1  # type: ignore[attr-defined]
                p.moved_bytes += e.size  # type: ignore[attr-defined]
            else:
                p.dropped_objects += 1  # type: ignore[attr-defined]
                p.dropped_bytes += e.size  # type: ignore[attr-defined]
            p.remaining_objects -= 1  # type: ignore[attr-defined]
