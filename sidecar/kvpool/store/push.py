"""Pushing a node's objects to other nodes in batches: shared by the drain and the warm push.

Both walk the node's objects hottest first, group them into batches bound for one target (one
put each: a few round trips instead of one per object) from a bounded window of the walk, pace
the batches by a bandwidth bound and stop at a deadline.  The grouping and the pacing are pure;
:func:`push_batch` does the reading and the put; :class:`Targets` keeps one client per (target,
tenant token); :class:`Progress` is what a running job reports.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from kvpool.core.push_status import DrainStatus, WarmStatus
from kvpool.core.traffic import traffic_class_or_default
from kvpool.pool.node_client import StoreClient
from kvpool.store.node import DEFAULT_TENANT, Entry, StoreNode

log = logging.getLogger("kvpool.store.push")
S = TypeVar("S", DrainStatus, WarmStatus)

BATCH_OBJECTS = 16
BATCH_BYTES = 4 << 20
GROUP_WINDOW = 128
"""Objects ahead in the hottest-first order a batch may take its objects from (:func:`batches`):
eight batches' worth, so that a drain to up to eight owners still fills its batches."""


class Progress(Generic[S]):
    """A push job as it runs: its status, and the flag that stops it before its next batch.

    Only the job's thread writes the status, and it replaces it whole (:meth:`add`, :meth:`set`):
    a status call on another thread reads one consistent snapshot, never a half-counted batch."""

    def __init__(self, status: S) -> None:
        self.status: S = status
        self.stop = threading.Event()
        self.stopped_as = "superseded"
        """The state a job stopped before its end ends in (a drain: "superseded" or "cancelled")."""

    def add(self, **deltas: int) -> None:
        """Add to the status's counters."""
        s = self.status
        self.status = replace(s, **{k: getattr(s, k) + v for k, v in deltas.items()})

    def set(self, **values: Any) -> None:
        self.status = replace(self.status, **values)


def pace_delay(sent_bytes: int, elapsed_s: float, max_bytes_per_second: int) -> float:
    """Seconds to wait so that ``sent_bytes`` in ``elapsed_s`` stays within the bound (pure)."""
    if max_bytes_per_second <= 0:
        return 0.0
    return max(0.0, sent_bytes / max_bytes_per_second - elapsed_s)


def batch_cap(max_bytes_per_second: int) -> int:
    """Bytes one batch may carry: at most ~0.1 s of the rate, so the pacing stays fine-grained (pure)."""
    return min(BATCH_BYTES, max_bytes_per_second // 10) if max_bytes_per_second > 0 else BATCH_BYTES


@dataclass(slots=True)
class _Batch:
    """One batch while :func:`batches` groups: ``first`` is the place of its first object."""

    first: int
    group: tuple[Any, ...]
    """(target, tenant, traffic class, kind)."""
    objects: list[Any] = field(default_factory=list)
    size: int = 0
    full: bool = False


def batches(entries: Sequence[Any], targets: Sequence[int], max_objects: int = BATCH_OBJECTS,
            max_bytes: int = BATCH_BYTES, window: int = GROUP_WINDOW) -> list[tuple[int, list[Any]]]:
    """Group the push, given hottest first, into (target, entries) batches of one target, tenant,
    traffic class and kind, at most ``max_objects`` and (unless one object alone is larger)
    ``max_bytes`` each: one put per batch (pure).

    A batch takes its objects from a bounded window of the order, not only from a run of
    neighbours: a drain to several owners interleaves them, so runs are mostly one or two objects
    long, and each costs a put's round trips.  A batch stops taking objects when it is full or
    when its first (hottest) object is ``window`` places behind the walk; batches go out in the
    order of their first objects, and keep the order inside.  So an object goes out at most
    ``window`` places after its place in the order (and at most that many before it).
    """
    out: list[tuple[int, list[Any]]] = []
    filling: dict[tuple[Any, ...], _Batch] = {}  # (target, tenant, class, kind) -> its batch taking objects
    started: collections.deque[_Batch] = collections.deque()  # every batch not out yet, oldest first
    for i, (e, t) in enumerate(zip(entries, targets, strict=True)):
        group = (t, e.tenant, e.traffic_class, e.kind)
        b = filling.get(group)
        if b is not None and b.size + e.size > max_bytes:
            b.full = True
            b = None
        if b is None:
            b = filling[group] = _Batch(i, group)
            started.append(b)
        b.objects.append(e)
        b.size += e.size
        if len(b.objects) >= max_objects or b.size >= max_bytes:
            b.full = True
        if b.full:
            del filling[group]
        # Out go the oldest batches that are full or whose first object the walk has left a
        # window behind (a full batch may wait for an older one: the order is by first object).
        while started and (started[0].full or started[0].first <= i - window):
            done = started.popleft()
            if not done.full:  # aged out: the group's next object starts a new batch
                del filling[done.group]
            out.append((done.group[0], done.objects))
    out.extend((b.group[0], b.objects) for b in started)
    return out


def replica_pushes(own: npt.NDArray[np.intp], single_copy: Sequence[bool]) -> tuple[list[int], list[int]]:
    """The pushes of objects given hottest first, each to every one of its owners (``own[i]``:
    object i's owners, primary first, as :meth:`Ring.write_owners`), a single-copy object (a
    state object) to its primary only: (object index, target) pairs, in the objects' order
    and an object's owners next to each other, for :func:`batches` (pure)."""
    objs: list[int] = []
    tgts: list[int] = []
    r = own.shape[1] if own.ndim == 2 else 0
    for i, row in enumerate(own.tolist()):
        for t in row[:1] if single_copy[i] else row[:r]:
            objs.append(i)
            tgts.append(t)
    return objs, tgts


def push_batch(node: StoreNode, client: StoreClient, batch: Sequence[Entry], epoch: int) -> dict[int, int]:
    """One put of ``batch`` to ``client``'s node; id(entry) → code for those read here (the put
    asks first, so ALREADY_EXISTS costs no bytes).  Empty when the target failed."""
    codes: dict[int, int] = {}

    def sink(held: list[Entry], views: list[memoryview]) -> None:
        got = client.put([e.key for e in held], views, traffic_class=traffic_class_or_default(held[0].traffic_class),
                         kind=held[0].kind, epoch=epoch, checksums=[e.checksum for e in held])
        codes.update((id(e), c) for e, c in zip(held, got, strict=True))

    try:
        node.read_objects(batch, sink)
    except Exception as exc:  # a dead target fails this batch, the push goes on
        log.warning("push of %d objects failed: %s", len(batch), exc)
        return {}
    return codes


class Targets:
    """One client per (target address, tenant token); a context manager."""

    def __init__(self, node: StoreNode) -> None:
        self.node = node
        self.clients: dict[tuple[str, str], StoreClient] = {}

    def client(self, address: str, tenant_id: str) -> StoreClient | None:
        """The client writing ``tenant_id``'s objects to ``address``; None for a tenant without a
        token (revoked): written without one, its objects would land in the open default partition."""
        tenant = self.node.tenants.get(tenant_id)
        token = tenant.token if tenant is not None else ""
        if tenant_id != DEFAULT_TENANT and not token:
            return None
        ck = (address, token)
        c = self.clients.get(ck)
        if c is None:
            c = self.clients[ck] = StoreClient(address, token)
        return c

    def close(self) -> None:
        for c in self.clients.values():
            c.close()

    def __enter__(self) -> Targets:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
