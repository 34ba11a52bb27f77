"""kvpool.transfer — moves KV bytes between registered memory segments, batch-first.

One-sided moves: a control call says *which* bytes — segment name, offset, length, lease
token — and this package moves them (the handoff's point-to-point state reads, benchmarks).
The hot store calls do not go through it: the store's data session (:mod:`kvpool.wire.store_frames`,
:mod:`kvpool.pool.data_client`) is an RPC that carries its bytes in its own replies, in one
round trip, over a connection this package's server hands to the store (a session magic,
:mod:`kvpool.wire.frames`).

Serving side::

    registry = SegmentRegistry()
    registry.register(Segment.shared("arena", 1 << 30), guard=node_guard)
    server = TransferServer(registry, host="0.0.0.0", port=7001).start()

Requesting side::

    engine = TransferEngine(connections_per_peer=2)
    handle = engine.submit("10.0.0.5:7001", [
        TransferRequest("read", buf_view, "arena", offset, length, token=lease_token),
    ])
    statuses = handle.wait()          # one TransferStatus per request, in order

Transports, chosen per request: same-host shared memory when the peer's segment was attached
with ``engine.attach_shared`` (a memory copy; the guard is *not* consulted — verify checksums);
RDMA when this host has devices and the peer's keys were attached with ``engine.attach_rdma``;
TCP otherwise (K persistent connections per peer, requests sliced across them, a failed slice
retried once on a fresh connection, a stall failing with TIMEOUT instead of hanging).

Guarantees callers rely on:

* Per-request results: one bad request (unknown segment, out of bounds, refused by the guard)
  fails alone; the rest of its batch proceeds.
* A request's status becomes final only after every byte transfer for it has stopped, so once
  ``wait()`` returns the caller's buffers are no longer touched.
* Every batch finishes: connection failures, stalls and ``close()`` all end in a status.
* All public methods are thread-safe; ``submit`` never blocks on the network.

Status codes (:class:`TransferCode`) are defined once, in :mod:`kvpool.transfer.status`.
"""

from kvpool.transfer.batch import BatchHandle
from kvpool.transfer.engine import EngineSettings, TransferEngine
from kvpool.transfer.plan import TransferRequest
from kvpool.transfer.rdma import rdma_devices, rdma_status
from kvpool.transfer.segment import Guard, Segment, SegmentRegistry
from kvpool.transfer.server import TransferServer
from kvpool.transfer.status import TransferCode, TransferStatus

__all__ = [
    "BatchHandle",
    "EngineSettings",
    "Guard",
    "Segment",
    "SegmentRegistry",
    "TransferCode",
    "TransferEngine",
    "TransferRequest",
    "TransferServer",
    "TransferStatus",
    "rdma_devices",
    "rdma_status",
]
