"""Warm-up on scale-up, and restoring replication after a node left without a drain: a previous
owner pushes its hottest objects to their owners that were not owners before.

Rendezvous hashing moves a key only to a member that joined (DESIGN §6), so after a ring change
that adds members, the objects a node holds and no longer owns are exactly those owned by the
added members.  Without a push they would be misses at their new owner once readers stop
falling back to the old one; so each previous owner pushes them, most recently used first,
paced by a bandwidth bound (:func:`kvpool.store.push.pace_delay`) so that serving keeps the
network and the cores, until done, the deadline, or a newer ring (the plan is stale then).

Unlike a drain the node keeps its copies: readers that fall back to it still find them, and
eviction reclaims them like any cold object.  Only blocks move: they are content-addressed and
immutable, while a state object is single-copy and may be rewritten at its owner meanwhile.
The put asks before it sends, so an object the new owner already has (copied over by a reader,
or pushed before an operator restart) costs no bytes: it is counted as skipped.

When an active member dies and the operator removes it from the ring (no drain: nothing could be
read from it), its blocks have R-1 copies left; under the new ring each of them has one owner
that was not an owner before (the next one in weight order), and the same push, planned with
the removed members (``removed``), gives it the lost copy from the first surviving previous
owner.  With R=1 the only copy died with the node (only a stray copy, e.g. a warm-up's source,
can still be pushed), and a state object, single-copy, is never restored.

:class:`WarmJob` is the node's one warm-up at a time, per ring epoch (the ``StoreAdmin`` service
only adapts it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpool.core.keys import KEY_BYTES
from kvpool.core.push_status import WarmStatus
from kvpool.core.ring import Ring, owners
from kvpool.store.node import StoreNode
from kvpool.store.push import Progress, Targets, batch_cap, batches, pace_delay, push_batch
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.store.warm")


def warm_targets(key_blob: bytes, ring: Ring, added: Collection[str], holder: str = "",
                 removed: Collection[str] = ()) -> npt.NDArray[np.intp]:
    """Where ``holder`` pushes each of its objects: per key, its write owners under ``ring``
    (indices into the active members, primary first) that were not owners before it, -1
    elsewhere; shape (n_keys, min(ring.replicas, active)) (pure).

    Before it, the active members were those of ``ring`` less ``added``, plus ``removed``
    (active members that left it without a drain: a dead node).  Rendezvous weights are fixed
    per key and member, so one ranking over both sets gives the owners before and after: an
    owner after that was not one before is among ``added`` (a scale-up) or took the place of a
    removed owner (replication to restore).

    With replication R an object lives at R previous owners, and each would push it; only the
    first of them in weight order that is still active does (the highest-ranked surviving
    previous owner).  A holder that was not a previous owner (a copy left from an earlier epoch:
    a warm-up's source, a drain's target) pushes, as with R=1 every holder does; with R=1 and
    the owner removed that stray copy is the only one left to restore.
    """
    n = len(key_blob) // KEY_BYTES
    active = [m.id for m in ring.active]
    joined_ids = set(added)
    gone = [g for g in dict.fromkeys(removed) if g not in set(active)]
    joined = [j for j, mid in enumerate(active) if mid in joined_ids]
    r = max(1, min(ring.replicas, len(active)))
    if n == 0 or not active or not (joined or gone):
        return np.full((n, r if active else 0), -1, dtype=np.intp)
    mine = active.index(holder) if holder in active else -1
    if r == 1 and not gone:
        top = ring.owners_of(key_blob)[:, None]
        return np.where(np.isin(top, joined) & (top != mine), top, -1)
    members = active + gone  # index >= len(active): a removed member
    ranked = owners(key_blob, members, len(members))  # every member, by weight
    rows = np.arange(n)[:, None]
    previous = ~np.isin(ranked, joined)  # active before the change
    r_before = max(1, min(ring.replicas, len(members) - len(joined)))
    was_owner = previous & (np.cumsum(previous, axis=1) <= r_before)
    now = ranked < len(active)
    at_top = np.argsort(~now, axis=1, kind="stable")[:, :r]  # places of the owners after, by weight
    top = ranked[rows, at_top]
    targets = np.where(was_owner[rows, at_top] | (top == mine), -1, top)  # the holder has its own copy
    if mine >= 0:
        me = ranked == mine
        survivor = was_owner & now
        first = np.argmax(survivor, axis=1)  # the pusher's place (any, when no previous owner survives)
        pushes = ~(me & was_owner).any(axis=1) | me[np.arange(n), first]
        targets[~pushes] = -1  # a previous owner after the first surviving one
    return targets


def plan_warm(key_blob: bytes, last_access: Sequence[float] | npt.NDArray[Any], sizes: Sequence[int] | npt.NDArray[Any],
              ring: Ring, added: Collection[str], fraction: float = 0.0,
              targets: npt.NDArray[Any] | None = None, holder: str = "",
              removed: Collection[str] = ()) -> npt.NDArray[np.intp]:
    """Indices of the objects to push, hottest (latest ``last_access``) first (pure).
    ``targets``: ``warm_targets(key_blob, ring, added, holder, removed)`` when the caller has it already.

    An object moves when one of its owners among the active members of ``ring`` was not one
    before (one of ``added``, or the next owner in place of one of ``removed``), and ``holder``
    is the one of its previous owners that pushes it (:func:`warm_targets`).
    ``fraction`` in (0, 1) keeps only the hottest objects whose bytes add up to at most that
    share of the moved bytes (0 or ≥ 1: all of them).
    """
    n = len(key_blob) // KEY_BYTES
    if n == 0 or not ring.active or not (added or removed):
        return np.zeros(0, dtype=np.intp)
    if targets is None:
        targets = warm_targets(key_blob, ring, added, holder, removed)
    moved = np.flatnonzero((targets >= 0).any(axis=1))
    if len(moved) == 0:
        return moved.astype(np.intp)
    la = np.asarray(last_access, dtype=np.float64)[moved]
    order = moved[np.argsort(-la, kind="stable")]
    if 0.0 < fraction < 1.0:
        sz = np.asarray(sizes, dtype=np.int64)[order]
        budget = fraction * float(sz.sum())
        order = order[np.cumsum(sz) <= budget]
    return order.astype(np.intp)


def added_members(previous: Ring | None, ring: Ring) -> list[str]:
    """Active members of ``ring`` that were not active in ``previous`` (pure)."""
    before = {m.id for m in previous.active} if previous is not None else set()
    return [m.id for m in ring.active if m.id not in before]


class WarmJob:
    """The node's warm-up push: one at a time, each for one ring epoch (thread-safe)."""

    def __init__(self, node: StoreNode) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._progress: Progress[WarmStatus] = Progress(WarmStatus())

    def status(self) -> WarmStatus:
        return self._progress.status

    def start(self, ring: Ring, added: Collection[str], deadline_unix_ms: int = 0, max_bytes_per_second: int = 0,
              fraction: float = 0.0, removed: Collection[str] = ()) -> WarmStatus:
        """Start (once per epoch: idempotent, so an operator may call again) the push of the
        objects now owned by ``added``, or by the next owners in place of ``removed``
        (replication restored); a warm-up of an older epoch is stopped."""
        with self._lock:
            now = self._progress.status
            if now.state in ("running", "done") and now.epoch == ring.epoch:
                return now
            self._progress.stop.set()
            progress = Progress(WarmStatus(state="running", deadline_unix_ms=deadline_unix_ms, epoch=ring.epoch))
            self._progress = progress
            threading.Thread(target=run_warm, args=(self.node, ring, list(added), progress, max_bytes_per_second,
                                                    fraction, list(removed)), name="warm", daemon=True).start()
            return progress.status


def run_warm(node: StoreNode, ring: Ring, added: Collection[str], progress: Progress[WarmStatus],
             max_bytes_per_second: int = 0, fraction: float = 0.0, removed: Collection[str] = ()) -> None:
    """Push the planned objects (the thread of a :class:`WarmJob`), counting in ``progress`` per batch."""
    p = progress
    deadline = p.status.deadline_unix_ms / 1000.0 if p.status.deadline_unix_ms else float("inf")
    started = time.monotonic()
    entries = [e for e in node.objects_hottest_first() if e.kind == pb.BLOCK]
    active = ring.active
    targets = Targets(node)
    try:
        if entries:
            blob = b"".join(e.key for e in entries)
            # Once: the plan and the push both route by it.
            target = warm_targets(blob, ring, added, node.node_id, removed)
            order = plan_warm(blob, [e.last_access for e in entries], [e.size for e in entries], ring, added,
                              fraction, targets=target, removed=removed)
        else:
            order, target = np.zeros(0, dtype=np.intp), np.zeros((0, 1), dtype=np.intp)
        todo = [entries[int(i)] for i in order]
        # An object bound for several added owners (R > 1) is one push to each, next to each
        # other; the progress counts pushes (copies made), which with R=1 are the objects.
        pushes = [(e, t) for e, row in zip(todo, target[order].tolist(), strict=True) for t in row if t >= 0]
        p.set(planned_objects=len(pushes), remaining_objects=len(pushes),
              planned_bytes=sum(e.size for e, _ in pushes))
        sent = 0
        cap = batch_cap(max_bytes_per_second)
        for tgt, batch in batches([e for e, _ in pushes], [t for _, t in pushes], max_bytes=cap):
            if node.ring.epoch > ring.epoch or p.stop.is_set():
                break  # a newer ring: its own warm-up plans again
            wait = pace_delay(sent, time.monotonic() - started, max_bytes_per_second)
            if wait > 0:
                time.sleep(min(wait, max(0.0, deadline - time.time())))
            if time.time() >= deadline:
                break
            client = targets.client(active[tgt].address, batch[0].tenant)  # None: a revoked tenant
            codes = push_batch(node, client, batch, ring.epoch) if client is not None else {}
            moved = [e.size for e in batch if codes.get(id(e), -1) == pb.OK]
            skipped = [e.size for e in batch if codes.get(id(e), -1) == pb.ALREADY_EXISTS]
            sent += sum(moved)
            p.add(moved_objects=len(moved), moved_bytes=sum(moved), skipped_objects=len(skipped),
                  skipped_bytes=sum(skipped), failed_objects=len(batch) - len(moved) - len(skipped),
                  remaining_objects=-len(batch))
    except Exception:
        log.exception("warm-up failed")
    finally:
        p.set(state="done")
        targets.close()
        s = p.status
        log.info("warm-up of epoch %d done: moved %d objects (%d bytes), skipped %d, failed %d, left %d",
                 ring.epoch, s.moved_objects, s.moved_bytes, s.skipped_objects, s.failed_objects,
                 s.remaining_objects)
