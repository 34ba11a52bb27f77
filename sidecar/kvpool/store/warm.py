"""Warm-up on scale-up: a previous owner pushes its hottest objects whose owner is now a new node.

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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..keys import KEY_BYTES
from ..proto import store_pb2 as pb
from ..ring import Ring, owners
from .node import StoreNode
from .push import Targets, batch_cap, batches, pace_delay, push_batch

log = logging.getLogger("kvpool.store.warm")


def warm_targets(key_blob: bytes, ring: Ring, added: Collection[str], holder: str = "") -> npt.NDArray[np.intp]:
    """Where ``holder`` pushes each of its objects: per key, its write owners under ``ring``
    (indices into the active members, primary first) that are among ``added``, -1 elsewhere;
    shape (n_keys, min(ring.replicas, active)) (pure).

    With replication R an object lives at R previous owners, and all of them would push it to
    the same new owner; only the first of them in weight order does (the previous owners are
    the R highest-weight members that were not added, rendezvous weights being fixed per key
    and member).  A holder that was not a previous owner (a copy left from an earlier epoch)
    pushes, as with R=1 every holder does.
    """
    n = len(key_blob) // KEY_BYTES
    active = [m.id for m in ring.active]
    joined = [j for j, mid in enumerate(active) if mid in set(added)]
    r = max(1, min(ring.replicas, len(active)))
    if n == 0 or not active or not joined:
        return np.full((n, r if active else 0), -1, dtype=np.intp)
    if r == 1:
        top = ring.owners_of(key_blob)[:, None]
        return np.where(np.isin(top, joined), top, -1)
    ranked = owners(key_blob, active, len(active))  # every member, by weight
    top = ranked[:, :r]
    targets = np.where(np.isin(top, joined), top, -1)
    if holder in active:
        previous = ~np.isin(ranked, joined)
        rank_before = np.cumsum(previous, axis=1) - 1  # rank among the previous owners
        at = np.argmax(ranked == active.index(holder), axis=1)
        mine = rank_before[np.arange(n), at]
        targets[(mine >= 1) & (mine < r)] = -1  # a previous owner after the first: it pushes
    return targets


def plan_warm(key_blob: bytes, last_access: Sequence[float] | npt.NDArray[Any], sizes: Sequence[int] | npt.NDArray[Any],
              ring: Ring, added: Collection[str], fraction: float = 0.0,
              targets: npt.NDArray[Any] | None = None, holder: str = "") -> npt.NDArray[np.intp]:
    """Indices of the objects to push, hottest (latest ``last_access``) first (pure).
    ``targets``: ``warm_targets(key_blob, ring, added, holder)`` when the caller has it already.

    An object moves when one of its owners among the active members of ``ring`` is one of
    ``added`` (and ``holder`` is the one of its previous owners that pushes it: :func:`warm_targets`).
    ``fraction`` in (0, 1) keeps only the hottest objects whose bytes add up to at most that
    share of the moved bytes (0 or ≥ 1: all of them).
    """
    n = len(key_blob) // KEY_BYTES
    if n == 0 or not ring.active or not added:
        return np.zeros(0, dtype=np.intp)
    if targets is None:
        targets = warm_targets(key_blob, ring, added, holder)
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


def run_warm(node: StoreNode, ring: Ring, added: Collection[str], progress: Any,
             max_bytes_per_second: int = 0, fraction: float = 0.0) -> None:
    """Push the planned objects (the thread behind the ``Warm`` RPC); ``progress`` is the
    service's :class:`~kvpool.store.service.WarmProgress`, updated as it goes."""
    p = progress
    deadline = p.deadline_unix_ms / 1000.0 if p.deadline_unix_ms else float("inf")
    started = time.monotonic()
    entries = [e for e in node.objects_hottest_first() if e.kind == pb.BLOCK]
    active = ring.active
    targets = Targets(node)
    try:
        if entries:
            blob = b"".join(e.key for e in entries)
            # Once: the plan and the push both route by it.
            target = warm_targets(blob, ring, added, node.node_id)
            order = plan_warm(blob, [e.last_access for e in entries], [e.size for e in entries], ring, added,
                              fraction, targets=target)
        else:
            order, target = np.zeros(0, dtype=np.intp), np.zeros((0, 1), dtype=np.intp)
        todo = [entries[int(i)] for i in order]
        # An object bound for several added owners (R > 1) is one push to each, next to each
        # other; the progress counts pushes (copies made), which with R=1 are the objects.
        pushes = [(e, t) for e, row in zip(todo, target[order].tolist(), strict=True) for t in row if t >= 0]
        p.planned_objects = p.remaining_objects = len(pushes)
        p.planned_bytes = sum(e.size for e, _ in pushes)
        sent = 0
        cap = batch_cap(max_bytes_per_second)
        for tgt, batch in batches([e for e, _ in pushes], [t for _, t in pushes], max_bytes=cap):
            if node.ring.epoch > ring.epoch or p.cancelled:
                break  # a newer ring: its own warm-up plans again
            wait = pace_delay(sent, time.monotonic() - started, max_bytes_per_second)
            if wait > 0:
                time.sleep(min(wait, max(0.0, deadline - time.time())))
            if time.time() >= deadline:
                break
            client = targets.client(active[tgt].address, batch[0].tenant)  # None: a revoked tenant
            codes = push_batch(node, client, batch, ring.epoch) if client is not None else {}
            for e in batch:
                code = codes.get(id(e), -1)
                if code == pb.OK:
                    p.moved_objects += 1
                    p.moved_bytes += e.size
                    sent += e.size
                elif code == pb.ALREADY_EXISTS:
                    p.skipped_objects += 1
                    p.skipped_bytes += e.size
                else:
                    p.failed_objects += 1
                p.remaining_objects -= 1
    except Exception:
        log.exception("warm-up failed")
    finally:
        p.state = "done"
        targets.close()
        log.info("warm-up of epoch %d done: moved %d objects (%d bytes), skipped %d, failed %d, left %d",
                 ring.epoch, p.moved_objects, p.moved_bytes, p.skipped_objects, p.failed_objects,
                 p.remaining_objects)
