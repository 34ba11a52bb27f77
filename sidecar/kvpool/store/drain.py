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
import time

from ..proto import store_pb2 as pb
from ..ring import Ring
from .node import Entry, StoreNode
from .push import Targets, batch_cap, batches, pace_delay, push_batch

log = logging.getLogger("kvpool.store.drain")


def run_drain(node: StoreNode, ring: Ring, progress: object, max_bytes_per_second: int = 0) -> None:
    """Push every object, hottest first, in batches to its owner in ``ring`` (the thread behind
    the ``Drain`` RPC); ``progress`` is the service's ``DrainProgress``, updated per batch."""
    p = progress  # DrainProgress; typed loosely to avoid an import cycle with the service
    deadline = p.deadline_unix_ms / 1000.0  # type: ignore[attr-defined]
    started = time.monotonic()
    active = ring.active
    objects = list(node.objects_hottest_first())
    p.remaining_objects = len(objects)  # type: ignore[attr-defined]
    plan: list[tuple[int, list[Entry]]] = [(-1, objects)]  # until routed, everything is left
    done = 0  # plan[:done] was handled, the rest is left
    with Targets(node) as targets:
        try:
            if not active:
                raise RuntimeError("no active member to drain to")
            owners = ring.owners_of(b"".join(e.key for e in objects)).tolist() if objects else []
            plan = batches(objects, owners, max_bytes=batch_cap(max_bytes_per_second))
            for tgt, batch in plan:
                wait = pace_delay(p.moved_bytes + p.dropped_bytes,  # type: ignore[attr-defined]
                                  time.monotonic() - started, max_bytes_per_second)
                if wait > 0:
                    time.sleep(min(wait, max(0.0, deadline - time.time())))
                if time.time() >= deadline:
                    break
                client = targets.client(active[int(tgt)].address, batch[0].tenant)
                codes = push_batch(node, client, batch, ring.epoch) if client is not None else {}
                _count(p, batch, codes)
                done += 1
        except Exception:
            log.exception("drain failed")
        finally:
            # Whatever is left when the deadline hits is dropped: count it, never hide it.
            left = [e for _, batch in plan[done:] for e in batch]
            if left:
                p.dropped_objects += len(left)  # type: ignore[attr-defined]
                p.dropped_bytes += sum(e.size for e in left)  # type: ignore[attr-defined]
                p.remaining_objects = 0  # type: ignore[attr-defined]
            p.state = "done"  # type: ignore[attr-defined]
    log.info("drain done: moved %d objects (%d bytes), dropped %d", p.moved_objects,  # type: ignore[attr-defined]
             p.moved_bytes, p.dropped_objects)  # type: ignore[attr-defined]


def _count(p: object, batch: list[Entry], codes: dict[int, int]) -> None:
    """Add one batch's outcome to the progress: there now (OK, or ALREADY_EXISTS: nothing was
    sent) is moved; not read here, refused or failed at the target is dropped."""
    for e in batch:
        if codes.get(id(e), -1) in (pb.OK, pb.ALREADY_EXISTS):
            p.moved_objects += 1  # type: ignore[attr-defined]
            p.moved_bytes += e.size  # type: ignore[attr-defined]
        else:
            p.dropped_objects += 1  # type: ignore[attr-defined]
            p.dropped_bytes += e.size  # type: ignore[attr-defined]
        p.remaining_objects -= 1  # type: ignore[attr-defined]
