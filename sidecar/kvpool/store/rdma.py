"""A store node's RDMA side: its DRAM arena registered with the device, the queue pairs of the
sidecars that connected (``ConnectRdma``), the holds that keep extents in place under
one-sided reads (``HoldExtents`` / ``ReleaseExtents``) and the reservations of one-sided writes
(``ReserveRdma`` / ``CommitRdma``).

A one-sided READ runs without this node's CPU, so nothing here can check an access as the data
session does per frame: the reader is handed the arena's rkey once, and each read first asks
for a hold — the objects marked in flight exactly as a data-session GET marks them while it
sends (:meth:`StoreNode.read_pin <kvpool.store.node.StoreNode.read_pin>`), so neither eviction,
demotion, expiry nor a removal can give their extents to another object — with an expiry
(``hold_ms``, at most ``lease_ms_max``), so a reader that died frees them.  A read that outlives
its hold may see a reused extent: the reader verifies every object's checksum, and re-reads a
mismatch over TCP.

A one-sided write reserves as a data-session PUT does (:meth:`StoreNode.put_start`) and holds
each reserved slot as that PUT's guard does while its payload arrives
(:meth:`StoreNode.acquire`: eviction, a revoke or the reservation's expiry leave the extent alone)
— from the reservation until the commit, or until the reservation's own expiry.  The commit
releases them first, then commits with the writer's checksums (verified by the node when it
verifies commits); a writer whose WRITE failed revokes instead.

Tenancy: the rkey covers the whole arena, so a reader that holds it can read any extent of it
(as with Mooncake's transfer engine), whatever its tenant.  A node therefore serves RDMA only
while at most one tenant holds a token on it (open tenancy, or a single-tenant pool); on a node
shared by several tenants ``ConnectRdma``, holds and reservations are refused (PermissionDenied:
the sidecars read and write over TCP, counted as a fallback) unless the node is told its
tenants trust each other (``--rdma-shared-tenants`` / ``rdmaSharedTenants``).  The check is made
on every hold and reservation, so tenants added after a reader connected end its RDMA reads.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvpool.core import errors
from kvpool.store.node import Entry, StoreNode
from kvpool.transfer.rdma import RdmaEndpoint, open_context
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.store.rdma")

ARENA_SEGMENT = "dram"
"""The segment name of the node's DRAM arena in the key handed to readers."""


@dataclass
class _Hold:
    tenant: str
    entries: list[Entry | None]
    expires: float


class StoreRdma:
    """See the module docstring; thread-safe."""

    def __init__(self, node: StoreNode, context: Any, max_queue_pairs: int = 256,
                 sweep_seconds: float = 1.0, shared_tenants: bool = False) -> None:
        self.node = node
        self.shared_tenants = shared_tenants
        self.context = context
        self.device: str = str(context.device)
        self.arena_key = context.register(ARENA_SEGMENT, node.dram.view)
        self.max_queue_pairs = max_queue_pairs
        self._lock = threading.Lock()
        self._queue_pairs: OrderedDict[int, Any] = OrderedDict()
        self._holds: dict[int, _Hold] = {}
        self._writing: dict[int, _Hold] = {}  # reservation id -> the slots held for RDMA WRITEs
        self._ids = itertools.count(1 + secrets.randbits(62))  # an id of another life names nothing
        self._stop = threading.Event()
        # Holds of readers that died expire on this timer, not only at the next call.
        self._sweeper = threading.Thread(target=self._sweep_loop, args=(sweep_seconds,), daemon=True,
                                         name="rdma-holds")
        self._sweeper.start()

    @classmethod
    def open(cls, node: StoreNode, spec: str, shared_tenants: bool = False) -> StoreRdma | None:
        """The node's RDMA side for ``spec`` (:func:`~kvpool.transfer.rdma.open_context`); None,
        with the reason logged, when there is no device: the node serves TCP only."""
        context, reason = open_context(spec)
        if context is None:
            log.info("RDMA: TCP only (%s)", reason)
            return None
        try:
            return cls(node, context, shared_tenants=shared_tenants)
        except Exception as exc:  # registration refused (locked-memory limit, a device error)
            log.warning("RDMA: TCP only, the arena could not be registered: %s", exc)
            context.close()
            return None

    def check_tenancy(self) -> None:
        """Refuse one-sided access on a node several tenants share (module docstring)."""
        holders = self.node.tenants.token_holders()
        if holders > 1 and not self.shared_tenants:
            raise errors.PermissionDenied(
                f"RDMA is refused on this node: {holders} tenants share it and one-sided access reads the "
                "whole arena (set rdmaSharedTenants where the tenants trust each other); use TCP")

    def connect(self, endpoint: bytes) -> tuple[bytes, bytes]:
        """A queue pair connected to the caller's ``endpoint``: its endpoint and the arena's key."""
        self.check_tenancy()
        remote = RdmaEndpoint.decode(endpoint)
        try:
            qp = self.context.accept(remote)
        except Exception as exc:
            raise errors.Unavailable(f"RDMA connect failed: {exc}") from None
        with self._lock:
            self._queue_pairs[qp.endpoint.qp_num] = qp
            old = (self._queue_pairs.popitem(last=False)[1]
                   if len(self._queue_pairs) > self.max_queue_pairs else None)
        if old is not None:
            old.close()  # the least recently connected: its reader falls back and reconnects
        self.node.count(StoreCounter.RDMA_CONNECTS)
        return qp.endpoint.encode(), self.arena_key.encode()

    def hold(self, tenant: str, keys: list[bytes], kind: int, hold_ms: int,
             drop_lease_id: int = 0) -> tuple[int, list[pb.Code], list[Entry | None]]:
        """The objects of ``keys`` held in place for a one-sided read: ``(hold id, codes,
        entries)``; the id is 0 when none was found."""
        self.check_tenancy()
        self.sweep()
        codes, found = self.node.read_pin(tenant, keys, kind, drop_lease_id)
        if not any(e is not None for e in found):
            return 0, codes, found
        cfg = self.node.cfg
        expires = time.monotonic() + min(hold_ms or cfg.lease_ms_default, cfg.lease_ms_max) / 1000.0
        hold_id = next(self._ids)
        with self._lock:
            self._holds[hold_id] = _Hold(tenant, found, expires)
        self.node.count(StoreCounter.RDMA_HOLDS)
        return hold_id, codes, found

    def release(self, tenant: str, hold_ids: list[int]) -> None:
        """End the caller's holds (another tenant's ids release nothing)."""
        with self._lock:
            ended = [self._holds.pop(h) for h in hold_ids
                     if h in self._holds and self._holds[h].tenant == tenant]
        for hold in ended:
            self.node.read_unpin(hold.entries)

    def reserve(self, tenant: str, keys: list[bytes], sizes: list[int], traffic_class: str, kind: int,
                timeout_ms: int, epoch: int) -> tuple[list[pb.Code], list[int], int]:
        """Reserve slots for one-sided writes and hold them until :meth:`commit`: ``(codes,
        offsets, reservation id)``."""
        self.check_tenancy()
        self.sweep()
        node = self.node
        codes, offsets, tokens, rid = node.put_start(tenant, keys, sizes, traffic_class, kind, timeout_ms, epoch)
        held: list[Entry] = []
        for i, code in enumerate(codes):
            if code == pb.OK:
                e = node.acquire("write", offsets[i], sizes[i], tokens[i])
                if e is None:  # gone already (expired at once): nothing may be written
                    for h in held:
                        node.release_guard(h)
                    node.put_revoke(tenant, rid)
                    raise errors.LeaseExpired("a reservation ended before its writes could be held")
                held.append(e)
        if rid:
            cfg = node.cfg
            seconds = min(timeout_ms / 1000.0 if timeout_ms else cfg.reservation_seconds, cfg.reservation_seconds_max)
            with self._lock:
                self._writing[rid] = _Hold(tenant, list(held), time.monotonic() + seconds)
            node.count(StoreCounter.RDMA_RESERVATIONS)
        return codes, offsets, rid

    def commit(self, tenant: str, reservation_id: int, checksums: list[int], revoke: bool) -> list[pb.Code]:
        """Release the slots of a reservation, then commit it (or revoke it: ``[]``)."""
        with self._lock:
            hold = self._writing.get(reservation_id)
            if hold is not None and hold.tenant == tenant:
                del self._writing[reservation_id]
            else:
                hold = None
        for e in hold.entries if hold is not None else ():
            self.node.release_guard(e)  # type: ignore[arg-type]
        if revoke:
            self.node.put_revoke(tenant, reservation_id)
            return []
        return self.node.put_commit(tenant, reservation_id, checksums)

    def sweep(self) -> int:
        """End the holds (of reads and of writes) past their expiry; how many."""
        now = time.monotonic()
        with self._lock:
            ended = [self._holds.pop(h) for h in [h for h, v in self._holds.items() if v.expires <= now]]
            writes = [self._writing.pop(r) for r in [r for r, v in self._writing.items() if v.expires <= now]]
        for hold in ended:
            self.node.read_unpin(hold.entries)
            self.node.count(StoreCounter.RDMA_HOLDS_EXPIRED)
        for hold in writes:  # the reservation expires on its own: its slots are freed then
            for e in hold.entries:
                self.node.release_guard(e)  # type: ignore[arg-type]
        return len(ended) + len(writes)

    def held(self) -> int:
        """Holds alive, of reads and of writes (a test of the books)."""
        with self._lock:
            return len(self._holds) + len(self._writing)

    def connected(self) -> int:
        """Queue pairs kept (at most ``max_queue_pairs``)."""
        with self._lock:
            return len(self._queue_pairs)

    def _sweep_loop(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            try:
                self.sweep()
            except Exception:  # never let housekeeping kill the node
                log.exception("RDMA hold sweep failed")

    def close(self) -> None:
        self._stop.set()
        self._sweeper.join(5)
        with self._lock:
            holds, self._holds = list(self._holds.values()), {}
            writes, self._writing = list(self._writing.values()), {}
            qps, self._queue_pairs = list(self._queue_pairs.values()), OrderedDict()
        for hold in holds:
            self.node.read_unpin(hold.entries)
        for hold in writes:
            for e in hold.entries:
                self.node.release_guard(e)  # type: ignore[arg-type]
        for qp in qps:
            qp.close()
        self.context.close()
