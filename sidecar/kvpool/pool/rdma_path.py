"""One-sided reads and writes of store nodes over RDMA, with the data session (TCP) as the
fallback: the sidecar's half of :mod:`kvpool.store.rdma`.

:class:`LocalRdma` is this process's device (``$KVPOOL_RDMA``, :func:`~kvpool.transfer.rdma.open_context`)
or the reason it has none, and the counters of every node's reader.  :class:`RdmaPath` is the
path to one node: connected lazily by the first read (``ConnectRdma``: our queue pair's endpoint
in, the node's and the rkey of its DRAM arena out); each read then asks the node to hold the
objects in place (``HoldExtents``: where they are, their sizes and checksums), READs them
one-sided into the caller's buffers, releases the hold (without waiting) and verifies every
object's checksum.  What did not come whole and verified — a failed transfer (the queue pair is
then dropped, and reconnected ``retry_seconds`` later), a checksum mismatch (an extent that
changed under the read, the hold having run out) — is handed back for a re-read over TCP.
Writes reserve (``ReserveRdma``: the slots held for the writes), WRITE one-sided and commit
with the checksums (``CommitRdma``); a failed WRITE revokes, and the batch goes over TCP.  A
node without a device, or one the connection to fails, is read and written over TCP until the
next try.
Every fallback is counted by its reason (``SidecarCounter.RDMA_FALLBACK_*``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvpool.core.checksum import checksum
from kvpool.core.keys import KEY_BYTES
from kvpool.transfer.plan import TransferRequest
from kvpool.transfer.rdma import RdmaEndpoint, RdmaPeer, RdmaSegmentKey, open_context
from kvpool.transfer.status import TransferCode, TransferStatus
from kvpool.wire import grpc_status
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.pool.rdma")

Dest = Callable[[int, int], memoryview | None]


class LocalRdma:
    """This process's RDMA device, or why it has none; the RDMA counters of all its paths."""

    def __init__(self, spec: str | None = None) -> None:
        self.context, self.reason = open_context(spec)
        self._counters: Counter[str] = Counter()
        self._lock = threading.Lock()

    def register(self, name: str, view: memoryview) -> None:
        """Register long-lived local memory (the sidecar's arena) once, so reads into it need no
        registration per batch (other buffers get one for the duration of their batch)."""
        if self.context is None:
            return
        try:
            self.context.register(name, view)
        except Exception as exc:  # a locked-memory limit: reads still work, registering per batch
            log.warning("RDMA: %s not registered (%s); reads into it register per batch", name, exc)

    def count(self, what: SidecarCounter, n: int = 1) -> None:
        with self._lock:
            self._counters[what] += n

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def close(self) -> None:
        context, self.context = self.context, None
        if context is not None:
            context.close()


@dataclass
class RdmaReadResult:
    """What a one-sided read did: final codes where the node answered, and the items to re-read
    over TCP (``redo``) with the buffers ``dest`` already gave them."""

    codes: list[pb.Code]
    sizes: list[int]
    checksums: list[int]
    epoch: int
    redo: list[int] = field(default_factory=list)
    buffers: dict[int, memoryview] = field(default_factory=dict)


class RdmaPath:
    """The RDMA path to one store node (see the module docstring); thread-safe."""

    def __init__(self, local: LocalRdma, stub: Any, metadata: tuple[tuple[str, str], ...], address: str,
                 timeout: float = 5.0, retry_seconds: float = 10.0, hold_ms: int = 5000) -> None:
        self.local = local
        self.stub = stub
        self.metadata = metadata
        self.address = address
        self.timeout = timeout
        self.retry_seconds = retry_seconds
        self.hold_ms = hold_ms
        self._peer: RdmaPeer | None = None
        self._segment = ""  # the node's arena, as its key names it
        self._incarnation = 0  # the node's life the connection was made with
        self._next_try = 0.0
        self._noted_no_device = False
        self._lock = threading.Lock()
        self._busy = threading.Lock()  # one batch at a time on the queue pair (its send queue and CQ)

    def _link(self) -> RdmaPeer | None:
        """The connected queue pair to the node, connecting when due; None: use TCP."""
        peer = self._peer
        if peer is not None and not peer.broken:
            return peer
        if self.local.context is None:
            if not self._noted_no_device:
                self._noted_no_device = True
                self.local.count(SidecarCounter.RDMA_FALLBACK_NO_LOCAL_DEVICE)
            return None
        if time.monotonic() < self._next_try:
            return None
        with self._lock:
            if self._peer is not None and not self._peer.broken:
                return self._peer
            if time.monotonic() < self._next_try:
                return None
            self._next_try = time.monotonic() + self.retry_seconds
            if self._peer is not None:
                with self._busy:  # not under a batch of another thread still on its way out
                    self._peer.close()
                self._peer = None
            self._peer = self._connect()
            return self._peer

    def _connect(self) -> RdmaPeer | None:
        qp = self.local.context.create_queue_pair()
        try:
            reply = self.stub.ConnectRdma(pb.ConnectRdmaRequest(endpoint=qp.endpoint.encode()),
                                          timeout=self.timeout, metadata=self.metadata)
            qp.connect(RdmaEndpoint.decode(reply.endpoint))
            key = RdmaSegmentKey.decode(reply.arena_key)
        except grpc.RpcError as err:
            qp.close()
            no_device = hasattr(err, "code") and err.code() == grpc.StatusCode.UNIMPLEMENTED
            self.local.count(SidecarCounter.RDMA_FALLBACK_NO_REMOTE_DEVICE if no_device
                             else SidecarCounter.RDMA_FALLBACK_CONNECT_FAILED)
            if not no_device:
                log.warning("RDMA connect to %s failed, reading over TCP: %s", self.address, err)
            return None
        except Exception as exc:  # the queue pair did not come up (ours or a malformed answer)
            qp.close()
            self.local.count(SidecarCounter.RDMA_FALLBACK_CONNECT_FAILED)
            log.warning("RDMA connect to %s failed, reading over TCP: %s", self.address, exc)
            return None
        self.local.count(SidecarCounter.RDMA_CONNECTS)
        self._segment, self._incarnation = key.segment, reply.incarnation
        return RdmaPeer(qp, [key], stall_timeout=self.timeout)

    def read(self, keys: bytes, dest: Dest, kind: int, lease_id: int = 0,
             timeout: float | None = None) -> RdmaReadResult | None:
        """Read ``keys`` one-sided into the buffers ``dest`` gives; None when this node is read
        over TCP (no device, no connection, the hold refused): nothing was asked of ``dest``."""
        peer = self._link()
        if peer is None:
            return None
        n = len(keys) // KEY_BYTES
        try:
            reply = self.stub.HoldExtents(
                pb.HoldExtentsRequest(keys=keys, kind=grpc_status.as_kind(kind), hold_ms=self.hold_ms,
                                      drop_lease_id=lease_id),
                timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            self._refused(peer, err)
            return None
        if reply.incarnation != self._incarnation:
            # Another life of the node: the arena key of the connection is not its arena's.
            self._release(reply.hold_id)
            self._drop(peer)
            self.local.count(SidecarCounter.RDMA_FALLBACK_HOLD_FAILED)
            return None
        codes: list[pb.Code] = list(reply.codes)
        sizes = [int(s) for s in reply.sizes]
        sums = [int(c) for c in reply.checksums]
        if len(codes) != n or len(sizes) != n or len(sums) != n or len(reply.offsets) != n:
            self._release(reply.hold_id)
            self.local.count(SidecarCounter.RDMA_FALLBACK_HOLD_FAILED)
            return None
        result = RdmaReadResult(codes, sizes, sums, reply.epoch)
        order: list[int] = []
        requests: list[TransferRequest] = []
        try:
            for i, (code, offset) in enumerate(zip(codes, reply.offsets, strict=True)):
                if code != pb.OK:
                    continue
                buf = dest(i, sizes[i])
                if buf is None or buf.nbytes < sizes[i]:
                    codes[i] = pb.INVALID
                    continue
                result.buffers[i] = buf = buf[:sizes[i]]
                order.append(i)
                requests.append(TransferRequest("read", buf, self._segment, offset, sizes[i]))
            statuses = self._run(peer, requests)
        finally:
            self._release(reply.hold_id)
        self._settle(result, order, statuses)
        return result

    def _refused(self, peer: RdmaPeer, err: grpc.RpcError) -> None:
        """A HoldExtents/ReserveRdma call failed: counted; the connection is dropped when the
        node lost its device (a restart without one) or is unreachable — not when it was slow
        (a missed deadline: this batch goes over TCP, the next tries RDMA again) or refused the
        arguments."""
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE):
            self._drop(peer)
        self.local.count(SidecarCounter.RDMA_FALLBACK_HOLD_FAILED)

    def _drop(self, peer: RdmaPeer) -> None:
        """Stop using ``peer``: reads go over TCP until the next connection, ``retry_seconds`` on."""
        peer.broken = True
        self._next_try = time.monotonic() + self.retry_seconds

    def _run(self, peer: RdmaPeer, requests: list[TransferRequest]) -> list[TransferStatus]:
        if not requests:
            return []
        try:
            with self._busy:
                statuses = peer.run(requests)
        except Exception as exc:  # a device error fails the batch as a whole, never hangs it
            statuses = [TransferStatus(TransferCode.CONNECTION, f"RDMA error: {exc}")] * len(requests)
            peer.broken = True
        if peer.broken:  # the queue pair is in error: TCP until the next connection, not before
            self._drop(peer)
        return statuses

    def _settle(self, result: RdmaReadResult, order: list[int], statuses: list[TransferStatus]) -> None:
        """Verify what arrived; what failed or does not match goes to ``redo``, counted."""
        failed = checksum_bad = moved = 0
        for i, status in zip(order, statuses, strict=True):
            if not status.ok:
                failed += 1
                result.redo.append(i)
            elif checksum(result.buffers[i]) != result.checksums[i]:
                checksum_bad += 1
                result.redo.append(i)
            else:
                moved += result.sizes[i]
        if failed:
            self.local.count(SidecarCounter.RDMA_FALLBACK_TRANSFER_FAILED, failed)
        if checksum_bad:
            self.local.count(SidecarCounter.RDMA_FALLBACK_CHECKSUM, checksum_bad)
        good = len(order) - failed - checksum_bad
        if good:
            self.local.count(SidecarCounter.RDMA_READS, good)
            self.local.count(SidecarCounter.RDMA_READ_BYTES, moved)

    def write(self, keys: bytes, views: Sequence[memoryview], checksums: Sequence[int] | None,
              traffic_class: str, kind: int, timeout_ms: int = 0, epoch: int = 0) -> tuple[list[int], int] | None:
        """Store objects one-sided: reserve (``ReserveRdma``, the slots held for the writes), RDMA
        WRITE each into its slot, commit with the checksums (``CommitRdma``).  ``(codes, the
        node's epoch)``; None when the batch goes over TCP (no connection, the reservation
        refused, a WRITE or the commit failed: a failed WRITE revokes the reservation first)."""
        peer = self._link()
        if peer is None:
            return None
        try:
            reply = self.stub.ReserveRdma(
                pb.ReserveRdmaRequest(keys=keys, sizes=[v.nbytes for v in views], traffic_class=traffic_class,
                                      kind=grpc_status.as_kind(kind), timeout_ms=timeout_ms, epoch=epoch),
                timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            self._refused(peer, err)
            return None
        rid = reply.reservation_id
        codes: list[int] = list(reply.codes)
        if reply.incarnation != self._incarnation or len(codes) != len(views) or len(reply.offsets) != len(views):
            self._end_reservation(rid, [], revoke=True)
            self._drop(peer)
            self.local.count(SidecarCounter.RDMA_FALLBACK_HOLD_FAILED)
            return None
        todo = [i for i, c in enumerate(codes) if c == pb.OK]
        if not todo:
            return codes, reply.epoch
        statuses = self._run(peer, [TransferRequest("write", views[i], self._segment, reply.offsets[i],
                                                    views[i].nbytes) for i in todo])
        if not all(st.ok for st in statuses):
            self._end_reservation(rid, [], revoke=True)
            self.local.count(SidecarCounter.RDMA_FALLBACK_TRANSFER_FAILED, len(todo))
            return None
        ok = set(todo)
        sums = [(checksums[i] if checksums is not None else checksum(v)) if i in ok else 0
                for i, v in enumerate(views)]
        final = self._end_reservation(rid, sums, revoke=False)
        if final is None or len(final) != len(codes):
            self.local.count(SidecarCounter.RDMA_FALLBACK_TRANSFER_FAILED, len(todo))
            return None  # unknown whether it committed: TCP's put answers ALREADY_EXISTS if it did
        for i in todo:
            codes[i] = final[i]
        written = [i for i in todo if codes[i] == pb.OK]
        if written:
            self.local.count(SidecarCounter.RDMA_WRITES, len(written))
            self.local.count(SidecarCounter.RDMA_WRITE_BYTES, sum(views[i].nbytes for i in written))
        return codes, reply.epoch

    def _end_reservation(self, rid: int, checksums: list[int], revoke: bool) -> list[int] | None:
        """CommitRdma (or its revoke): the per-item codes, None when the call failed."""
        if not rid:
            return []
        try:
            reply = self.stub.CommitRdma(pb.CommitRdmaRequest(reservation_id=rid, checksums=checksums, revoke=revoke),
                                         timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError:
            return None  # a revoke that did not arrive: the reservation expires on its own
        return list(reply.codes)

    def _release(self, hold_id: int) -> None:
        """End a hold without waiting for the answer (it expires on its own if this is lost)."""
        if hold_id:
            self.stub.ReleaseExtents.future(pb.ReleaseExtentsRequest(hold_ids=[hold_id]), timeout=self.timeout,
                                            metadata=self.metadata)

    def close(self) -> None:
        with self._lock:
            peer, self._peer = self._peer, None
        if peer is not None:
            peer.close()


def merge(first: RdmaReadResult, again_codes: list[pb.Code], again_sizes: list[int], again_sums: list[int]) -> None:
    """Put the TCP re-read of ``first.redo`` (in that order) into ``first``'s results."""
    for j, i in enumerate(first.redo):
        first.codes[i], first.sizes[i], first.checksums[i] = again_codes[j], again_sizes[j], again_sums[j]

