"""The transfer engine: batch-first byte moves between caller memory and peers' segments.

``submit(peer, requests)`` returns a :class:`BatchHandle` at once; each request is routed to a
transport: same-host shared memory when the peer's segment was attached with
:meth:`TransferEngine.attach_shared`, else TCP (RDMA is chosen only when this host has devices
and the peer's keys were attached; see :mod:`kvpool.transfer.rdma`).

Thread safety: every public method may be called from any thread, concurrently.
Buffers: ``request.local`` is the caller's memory; it is written (read op) or read (write op)
until that request's status is final, and never after.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.transfer import rdma
from kvpool.transfer.batch import BatchHandle
from kvpool.transfer.plan import TransferRequest
from kvpool.transfer.shm import ShmPeer
from kvpool.transfer.status import TransferStatus
from kvpool.transfer.tcp import TcpPeer, TcpSettings, parse_address
from kvpool.transfer.transport import Item, Transport
from kvpool.wire.tls import TlsConfig


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Tuning of a :class:`TransferEngine`; every field has a working default."""

    connections_per_peer: int = 2
    """TCP connections (each with its own worker thread) per peer."""
    slice_bytes: int = 1 << 20
    """Largest piece a request is cut into; pieces spread over the connections."""
    min_slice_bytes: int = 64 << 10
    """Smallest piece worth its own round trip when a small batch is spread over connections."""
    stall_timeout: float = 10.0
    """Seconds without progress on a connection before its requests fail with TIMEOUT."""
    max_inflight: int = 64
    """Requests pipelined per connection."""
    window_bytes: int = 4 << 20
    """Payload bytes outstanding per connection."""


class TransferEngine:
    """Moves bytes for many concurrent batches over persistent per-peer connections."""

    def __init__(
        self,
        connections_per_peer: int = 2,
        slice_bytes: int = 1 << 20,
        stall_timeout: float = 10.0,
        *,
        min_slice_bytes: int = 64 << 10,
        max_inflight: int = 64,
        window_bytes: int = 4 << 20,
        tls: TlsConfig | None = None,
    ) -> None:
        """``tls``: every TCP connection is a TLS client with this process's certificate (the
        peer's transfer server verifies it, and may refuse the identity it names)."""
        if connections_per_peer < 1:
            raise ValueError("connections_per_peer must be at least 1")
        if slice_bytes < 4096:
            raise ValueError("slice_bytes must be at least 4096")
        if stall_timeout <= 0:
            raise ValueError("stall_timeout must be positive")
        self.settings = EngineSettings(
            connections_per_peer, slice_bytes, min_slice_bytes, stall_timeout, max_inflight, window_bytes
        )
        self._tcp_settings = TcpSettings(
            connections=connections_per_peer,
            slice_bytes=slice_bytes,
            min_slice_bytes=min_slice_bytes,
            stall_timeout=stall_timeout,
            max_inflight=max_inflight,
            window_bytes=window_bytes,
            tls=tls,
        )
        self._lock = threading.Lock()
        self._peers: dict[str, TcpPeer] = {}
        self._shm: dict[str, ShmPeer] = {}
        self._rdma: dict[str, rdma.RdmaPeer] = {}
        self._closed = False

    # -- same-host shared memory -------------------------------------------------------------

    def attach_shared(self, peer: str, segment_name: str, path: str) -> None:
        """Map ``peer``'s shared segment ``segment_name`` (a :meth:`Segment.shared` file).

        From now on requests for that segment of that peer are plain memory copies.
        The segment's guard is *not* consulted on this path — verify checksums of what you read.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("transfer engine is closed")
            shm = self._shm.get(peer)
            if shm is None:
                shm = self._shm[peer] = ShmPeer(peer)
        shm.attach(segment_name, path)

    def detach_shared(self, peer: str, segment_name: str) -> None:
        shm = self._shm.get(peer)
        if shm is not None:
            shm.detach(segment_name)

    # -- RDMA ------------------------------------------------------------------------------

    @property
    def rdma_available(self) -> bool:
        return bool(rdma.rdma_devices())

    def attach_rdma(self, peer: str, queue_pair: rdma.QueuePairLike, keys: list[rdma.RdmaSegmentKey]) -> None:
        """Route requests for ``keys``' segments of ``peer`` over a connected RDMA queue pair.

        Calling it again with the same queue pair adds keys; with another one, replaces (and
        closes) the old. Raises :class:`~kvpool.transfer.rdma.RdmaUnavailable` on a host without
        devices, so RDMA is only ever chosen where it exists. The engine owns the queue pair from
        now on. If the queue pair fails, later requests to ``peer`` go over TCP.
        """
        devices, reason = rdma.rdma_status()
        if not devices:
            raise rdma.RdmaUnavailable(f"no RDMA devices: {reason}")
        with self._lock:
            old = self._rdma.get(peer)
            if old is not None and old.qp is queue_pair:
                old.add_keys(keys)
                return
            self._rdma[peer] = rdma.RdmaPeer(queue_pair, keys, self.settings.stall_timeout)
        if old is not None:
            old.close()

    # -- batches ---------------------------------------------------------------------------

    def submit(self, peer: str, requests: Sequence[TransferRequest],
               on_request_done: Callable[[int, TransferStatus], None] | None = None) -> BatchHandle:
        """Start moving ``requests`` to/from ``peer`` (``"host:port"``); returns at once.

        ``on_request_done(index, status)`` runs on the transport thread as each request becomes
        final (before the batch is): callers verify checksums there, overlapping the hash of one
        request with the network moving the next.  Keep it short and never raise from it.

        Each request goes to the first of the peer's transports that handles its segment:
        shared memory, RDMA, then TCP. The asynchronous transports are started first, so the
        network is busy while shared-memory requests are copied inline (those are final when
        this returns). Raises ``ValueError`` for a malformed address and ``RuntimeError`` after
        :meth:`close`, before anything has moved.
        """
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        handle = BatchHandle(len(requests), on_request_done)
        routes: list[Transport] = [t for t in (self._shm.get(peer), self._rdma.get(peer)) if t is not None]
        groups: dict[int, list[Item]] = {}
        tcp_items: list[Item] = []
        for index, req in enumerate(requests):
            if not req.length:
                continue  # nothing to move; final (OK) when sealed
            for position, transport in enumerate(routes):
                if transport.handles(req.remote_segment):
                    groups.setdefault(position, []).append((index, req))
                    break
            else:
                tcp_items.append((index, req))
        work: list[tuple[Transport, list[Item]]] = [(routes[p], items) for p, items in groups.items()]
        if tcp_items:
            work.append((self._tcp_peer(peer), tcp_items))  # may raise: nothing has moved yet
        work.sort(key=lambda pair: pair[0].inline)  # asynchronous ones first
        for transport, items in work:
            transport.submit(handle, items)
        handle._seal()
        return handle

    def transfer(
        self, peer: str, requests: Sequence[TransferRequest], timeout: float | None = None
    ) -> list[TransferStatus]:
        """``submit(...).wait(timeout)`` for callers that just want the statuses."""
        return self.submit(peer, requests).wait(timeout)

    def _tcp_peer(self, address: str) -> TcpPeer:
        peer = self._peers.get(address)
        if peer is not None:
            return peer
        parse_address(address)  # fail fast in the caller's thread on a bad address
        with self._lock:
            if self._closed:
                raise RuntimeError("transfer engine is closed")
            peer = self._peers.get(address)
            if peer is None:
                peer = self._peers[address] = TcpPeer(address, self._tcp_settings)
        return peer

    def stats(self) -> dict[str, int]:
        """Totals over all peers, computed now (cheap; meant to be read at scrape time):
        ``bytes_read``, ``bytes_written``, ``slices_ok``, ``slices_<error>``, ``retries``,
        ``connects``, ``connection_failures``, ``peers``. Never broken down per key or request."""
        with self._lock:
            peers = list(self._peers.values())
        total: collections.Counter[str] = collections.Counter()
        for peer in peers:
            total.update(peer.stats())
        result = dict(total)
        result["peers"] = len(peers)
        return result

    def disconnect(self, peer: str) -> None:
        """Drop ``peer``'s connections and workers (e.g. it left the ring); its queued requests
        fail with CONNECTION. A later submit to it starts afresh. Shared/RDMA attachments stay."""
        with self._lock:
            tcp_peer = self._peers.pop(peer, None)
        if tcp_peer is not None:
            tcp_peer.close()

    def close(self) -> None:
        """Fail what is still queued, stop every worker, unmap shared segments."""
        with self._lock:
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
            rdma_peers, self._rdma = list(self._rdma.values()), {}
            shm_peers, self._shm = list(self._shm.values()), {}
        for peer in peers:
            peer.close()
        for rdma_peer in rdma_peers:
            rdma_peer.close()
        for shm_peer in shm_peers:
            shm_peer.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
