"""Warm-up on scale-up: a previous owner pushes its hottest objects whose owner is now a new node.

Rendezvous hashing moves a key only to a member that joined (DESIGN §6), so after a ring change
that adds members, the objects a node holds and no longer owns are exactly those owned by the
added members.  Without a push they would be misses at their new owner once readers stop
falling back to the old one; so each previous owner pushes them, most recently used first,
paced by a bandwidth bound (:func:`kvpool.store.drain.pace_delay`) so that serving keeps the
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
from ..ring import Ring
from ..store_client import StoreClient
from ..transfer import TransferEngine
from .drain import pace_delay
from .node import DEFAULT_TENANT, Entry, StoreNode

log = logging.getLogger("kvpool.store.warm")


def plan_warm(key_blob: bytes, last_access: Sequence[float] | npt.NDArray[Any], sizes: Sequence[int] | npt.NDArray[Any],
              ring: Ring, added: Collection[str], fraction: float = 0.0,
              owners: npt.NDArray[Any] | None = None) -> npt.NDArray[np.intp]:
    """Indices of the objects to push, hottest (latest ``last_access``) first (pure).
    ``owners``: ``ring.owners_of(key_blob)`` when the caller has it already.

    An object moves when its owner among the active members of ``ring`` is one of ``added``.
    ``fraction`` in (0, 1) keeps only the hottest objects whose bytes add up to at most that
    share of the moved bytes (0 or ≥ 1: all of them).
    """
    n = len(key_blob) // KEY_BYTES
    active = [m.id for m in ring.active]
    if n == 0 or not active or not added:
        return np.zeros(0, dtype=np.intp)
    joined = set(added)
    targets = [j for j, mid in enumerate(active) if mid in joined]
    if owners is None:
        owners = ring.owners_of(key_blob)
    moved = np.flatnonzero(np.isin(owners, targets))
    if len(moved) == 0:
        return moved.astype(np.intp)
    la = np.asarray(last_access, dtype=np.float64)[moved]
    order = moved[np.argsort(-la, kind="stable")]
    if 0.0 < fraction < 1.0:
        sz = np.asarray(sizes, dtype=np.int64)[order]
        budget = fraction * float(sz.sum())
        order = order[np.cumsum(sz) <= budget]
    return order.astype(np.intp)


BATCH_OBJECTS = 16
BATCH_BYTES = 4 << 20


def batches(entries: Sequence[Any], targets: Sequence[int], max_objects: int = BATCH_OBJECTS,
            max_bytes: int = BATCH_BYTES) -> list[tuple[int, list[Any]]]:
    """Split the push, in its order, into (target, entries) runs of one target, tenant and traffic
    class, at most ``max_objects`` and (unless one object alone is larger) ``max_bytes`` each: one
    put per run (pure)."""
    out: list[tuple[int, list[Any]]] = []
    size = 0
    for e, t in zip(entries, targets, strict=True):
        if out:
            tgt, run = out[-1]
            same = tgt == t and run[0].tenant == e.tenant and run[0].traffic_class == e.traffic_class
            if same and len(run) < max_objects and size + e.size <= max_bytes:
                run.append(e)
                size += e.size
                continue
        out.append((t, [e]))
        size = e.size
    return out


def push_batch(node: StoreNode, client: StoreClient, batch: Sequence[Entry], epoch: int) -> dict[int, int]:
    """One put of ``batch`` to ``client``'s node; id(entry) → code for those read here (the put
    asks first, so ALREADY_EXISTS costs no bytes).  Empty when the target failed."""
    codes: dict[int, int] = {}

    def sink(held: list[Entry], views: list[memoryview]) -> None:
        got = client.put([e.key for e in held], views, traffic_class=held[0].traffic_class or "chatbot",
                         kind=held[0].kind, epoch=epoch, checksums=[e.checksum for e in held])
        codes.update((id(e), c) for e, c in zip(held, got, strict=True))

    try:
        node.read_objects(batch, sink)
    except Exception as exc:  # a dead target fails this batch, the push goes on
        log.warning("warm-up push of %d objects failed: %s", len(batch), exc)
        return {}
    return codes


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
    engine = TransferEngine()
    clients: dict[tuple[str, str], StoreClient] = {}
    entries = [e for e in node.objects_hottest_first() if e.kind == pb.BLOCK]
    active = ring.active
    try:
        if entries:
            blob = b"".join(e.key for e in entries)
            owner = ring.owners_of(blob)  # once: the plan and the push both route by it
            order = plan_warm(blob, [e.last_access for e in entries], [e.size for e in entries], ring, added,
                              fraction, owners=owner)
        else:
            order, owner = np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp)
        todo = [entries[int(i)] for i in order]
        p.planned_objects = p.remaining_objects = len(todo)
        p.planned_bytes = sum(e.size for e in todo)
        sent = 0
        # Bounded, a batch carries at most ~0.1 s of the rate: the pacing stays fine-grained.
        cap = min(BATCH_BYTES, max_bytes_per_second // 10) if max_bytes_per_second > 0 else BATCH_BYTES
        for tgt, batch in batches(todo, [int(owner[i]) for i in order.tolist()], max_bytes=cap):
            if node.ring.epoch > ring.epoch or p.cancelled:
                break  # a newer ring: its own warm-up plans again
            wait = pace_delay(sent, time.monotonic() - started, max_bytes_per_second)
            if wait > 0:
                time.sleep(min(wait, max(0.0, deadline - time.time())))
            if time.time() >= deadline:
                break
            e0, target = batch[0], active[tgt]
            tenant = node.tenants.get(e0.tenant)
            token = tenant.token if tenant is not None else ""
            codes: dict[int, int] = {}
            if e0.tenant == DEFAULT_TENANT or token:  # a revoked tenant cannot be written as itself
                ck = (target.address, token)
                client = clients.get(ck)
                if client is None:
                    client = clients[ck] = StoreClient(target.address, token, engine=engine)
                codes = push_batch(node, client, batch, ring.epoch)
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
        for c in clients.values():
            c.close()
        engine.close()
        log.info("warm-up of epoch %d done: moved %d objects (%d bytes), skipped %d, failed %d, left %d",
                 ring.epoch, p.moved_objects, p.moved_bytes, p.skipped_objects, p.failed_objects,
                 p.remaining_objects)
