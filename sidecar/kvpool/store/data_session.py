"""Server side of the data session (:mod:`kvpool.wire.store_frames`): frames in, node calls,
frames and arena bytes out.

One handler call per connection, run on the transfer server's connection thread.  The tenant
comes from the token in each frame, checked exactly as the gRPC service checks its bearer token
(:meth:`StoreNode.authenticate`); a refused token gets an error status and no bytes.  Payload
moves with ``sendmsg`` from arena views (GET; GET_RANGES sends only the asked ranges) and
``recvmsg_into`` into reserved arena extents (PUT), never through Python per byte.  A PUT whose
payload does not arrive whole is revoked, so a writer killed mid-put leaves nothing visible; a
frame that does not parse closes this connection only.

On a node whose data session is plaintext (``tickets``: the trusted-network opt-out) no frame's
token is taken: a connection opens with a HELLO carrying a one-use ticket from the TLS control
channel (:mod:`kvpool.core.tickets`), which binds it to the ticket's tenant, and its frames carry
no token at all — nothing on the wire names a tenant's secret.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from kvpool.core import errors, ranges
from kvpool.core.checksum import checksum
from kvpool.core.errors import Code
from kvpool.core.keys import unpack_keys
from kvpool.core.put_order import PutOrder
from kvpool.core.tickets import TicketBook
from kvpool.core.traffic import traffic_class_or_default
from kvpool.store.node import Entry, StoreNode
from kvpool.transfer.stream import STALL_ERRORS, Stream
from kvpool.wire import store_frames as dp
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.store.session")

_OP_NAMES = {dp.OP_EXISTS: "exists", dp.OP_GET: "get", dp.OP_GET_RANGES: "get_ranges", dp.OP_PUT: "put"}
"""The ``op`` label of ``kvpool_store_op_seconds`` of each request."""


class DataSessionHandler:
    """Serves data-session connections for one node (a ``TransferServer`` session handler)."""

    magic = dp.REQUEST_MAGIC

    def __init__(self, node: StoreNode, order: PutOrder | None = None,
                 observe: Callable[[str, float], None] | None = None, tickets: TicketBook | None = None) -> None:
        self.node = node
        self.order = order if order is not None else PutOrder()
        self.observe = observe
        """Where each request's latency goes (op name, seconds: the node's metrics), or None."""
        self.tickets = tickets
        """The node's data-session tickets: set when its data session is plaintext (no token taken)."""

    def __call__(self, stream: Stream, stopping: threading.Event) -> None:
        header = bytearray(dp.REQUEST_SIZE)
        view = memoryview(header)
        bound: str | None = None  # the tenant a ticket bound this connection to
        while not stopping.is_set():
            try:
                got = stream.recv_some(view)
            except STALL_ERRORS:
                continue  # idle between frames
            if got == 0:
                return
            if got < dp.REQUEST_SIZE:
                stream.recv_exact(view[got:])
            req = dp.decode_request(header)
            body = bytearray(req.body_bytes())
            if body:
                stream.recv_exact(body)
            parsed = dp.decode_request_body(req, body)
            pairs = None
            if req.op == dp.OP_GET_RANGES:
                blob = bytearray(dp.ranges_bytes(parsed))
                if blob:
                    stream.recv_exact(blob)
                pairs = ranges.decode(parsed.counts if parsed.counts is not None else [], blob)
            if req.op == dp.OP_HELLO and req.flags & dp.FLAG_TICKET:
                bound = self._ticket(stream, req, parsed.token) or bound
                continue
            self._serve(stream, req, parsed, pairs, bound)

    def _ticket(self, stream: Stream, req: dp.Request, ticket: str) -> str | None:
        """Admit a ticket (its tenant) or answer why not (None)."""
        tenant = None
        if self.tickets is not None:
            try:
                tenant = self.tickets.admit(base64.b64decode(ticket, validate=True), int(time.time() * 1000))
            except ValueError:
                tenant = None
        if tenant is None:
            exc = errors.Unauthenticated("data-session ticket refused (forged, expired or used)"
                                         if self.tickets is not None else "this node takes no tickets")
            stream.send([dp.encode_response(dp.OP_HELLO, req.request_id, status=errors.session_status_for(exc),
                                            message=str(exc), epoch=self.node.ring.epoch)])
            return None
        stream.send([dp.encode_response(dp.OP_HELLO, req.request_id, lease_id=self.node.incarnation,
                                        epoch=self.node.ring.epoch)])
        return tenant

    # -- one frame ---------------------------------------------------------------------------

    def _serve(self, stream: Stream, req: dp.Request, body: dp.RequestBody,
               pairs: ranges.Pairs | None = None, bound: str | None = None) -> None:
        reply_op = dp.OP_PUT_READY if req.op == dp.OP_PUT else req.op
        if req.op == dp.OP_HELLO:
            # The node's incarnation rides in the HELLO reply's lease id (unused by HELLO).
            stream.send([dp.encode_response(dp.OP_HELLO, req.request_id, lease_id=self.node.incarnation,
                                            epoch=self.node.ring.epoch)])
            return
        t0 = time.perf_counter()
        try:
            if bound is not None and not body.token:
                tenant: str | None = bound
            elif self.tickets is not None:
                raise errors.Unauthenticated("a plaintext data session opens with a ticket (DataTicket)")
            else:
                tenant = self.node.authenticate(body.token)
            if tenant is None:
                raise errors.Unauthenticated("unknown or missing tenant token")
            keys = unpack_keys(body.keys)
            if req.op == dp.OP_GET:
                self._get(stream, req, tenant, keys)
            elif req.op == dp.OP_EXISTS:
                self._exists(stream, req, tenant, keys)
            elif req.op == dp.OP_GET_RANGES:
                assert body.counts is not None and pairs is not None
                self._get_ranges(stream, req, tenant, keys, ranges.split(body.counts, pairs))
            else:
                self._put(stream, req, tenant, keys, body)
        except (errors.KvpoolError, ValueError) as exc:
            if not isinstance(exc, errors.KvpoolError):
                exc = errors.InvalidArgument(str(exc))
            stream.send([dp.encode_response(reply_op, req.request_id, req.items,
                                            status=errors.session_status_for(exc), message=str(exc),
                                            epoch=self.node.ring.epoch)])
        if self.observe is not None:  # one observation per request, never per key or byte
            self.observe(_OP_NAMES.get(req.op, "other"), time.perf_counter() - t0)

    def _exists(self, stream: Stream, req: dp.Request, tenant: str, keys: list[bytes]) -> None:
        if req.lease_id:
            # A lease this tenant holds, dropped first: an EXISTS of no keys is the session's
            # release (a sidecar drops its match leases this way, not over gRPC).
            self.node.release([req.lease_id], tenant)
        prefix, present, lease = self.node.exists(tenant, keys, req.kind, bool(req.flags & dp.FLAG_PREFIX_ONLY),
                                                  bool(req.flags & dp.FLAG_PIN), req.lease_ms)
        stream.send([dp.encode_response(dp.OP_EXISTS, req.request_id, req.items, prefix=prefix,
                                        lease_id=lease.lease_id if lease else 0, epoch=self.node.ring.epoch),
                     dp.encode_bitmap(present)])

    def _get(self, stream: Stream, req: dp.Request, tenant: str, keys: list[bytes]) -> None:
        node = self.node
        codes, found = node.read_pin(tenant, keys, req.kind, req.lease_id)
        try:
            # Plain lists, one pass: per-item numpy stores cost more than the whole frame's
            # other Python at the batch sizes a read has (tens of keys).
            n = len(keys)
            sizes = [0] * n
            sums = [0] * n
            views: list[memoryview] = []
            arena = node.dram
            for i, e in enumerate(found):
                if e is not None:
                    sizes[i] = e.size
                    sums[i] = e.checksum
                    views.append(arena.slice(e.offset, e.size))
            head = dp.encode_response(dp.OP_GET, req.request_id, n, epoch=node.ring.epoch, payload_len=sum(sizes))
            stream.send([head, dp.encode_get_table(codes, sizes, sums), *views])
        finally:
            node.read_unpin(found)

    def _get_ranges(self, stream: Stream, req: dp.Request, tenant: str, keys: list[bytes],
                    per_key: list[ranges.Pairs]) -> None:
        """Only the asked byte ranges of each object, straight from the arena; each range hashed
        as it is queued (the client verifies it), the objects held in flight for the send."""
        node = self.node
        pinned, found = node.read_pin(tenant, keys, req.kind, req.lease_id, whole=False)
        try:
            n = len(keys)
            sizes = [e.size if e is not None else 0 for e in found]
            codes = ranges.plan([Code(c) for c in pinned], sizes, per_key, node.cfg.max_ranges_per_key,
                                node.cfg.max_range_bytes)
            sums = np.zeros(sum(len(p) for p in per_key), np.uint64)
            views: list[memoryview] = []
            arena = node.dram
            at = 0
            sent = 0
            for i, e in enumerate(found):
                pairs = per_key[i]
                if e is not None and codes[i] == Code.OK:
                    whole = arena.slice(e.offset, e.size)
                    if req.flags & dp.FLAG_VERIFY_OBJECT and checksum(whole) != e.checksum:
                        codes[i] = Code.CHECKSUM
                    else:
                        for j, (off, ln) in enumerate(pairs.tolist()):
                            v = whole[off:off + ln]
                            # The whole object: its writer's checksum, no second pass over it.
                            sums[at + j] = e.checksum if ln == e.size else checksum(v)
                            views.append(v)
                            sent += ln
                at += len(pairs)
            head = dp.encode_response(dp.OP_GET_RANGES, req.request_id, n, epoch=node.ring.epoch, payload_len=sent)
            # Counted before the first byte leaves: a client that has its bytes sees the count.
            node.note_range_read(n, sum(1 for c in codes if c == Code.OK), sent, tenant)
            stream.send([head, dp.encode_range_table(codes, sizes, sums), *views])
        finally:
            node.read_unpin(found)

    def _put(self, stream: Stream, req: dp.Request, tenant: str, keys: list[bytes], body: dp.RequestBody) -> None:
        assert body.sizes is not None
        node = self.node
        sizes = body.sizes.tolist()
        ticket = dp.split_ticket(req.lease_id)
        if ticket is not None:
            # One part of a batch sent over several connections: reserve in batch order.
            if not self.order.wait_turn(tenant, ticket[0], ticket[1]):
                # The batch's order is lost (its earlier part is late or gone).
                node.count(StoreCounter.PUT_ORDER_WAITED_OUT)
        try:
            codes, offsets, tokens, rid = node.put_start(tenant, keys, sizes,
                                                         traffic_class_or_default(body.traffic_class),
                                                         req.kind, req.lease_ms, req.epoch)
        finally:
            if ticket is not None:
                self.order.reserved(tenant, *ticket)
        todo = [i for i, c in enumerate(codes) if c == pb.OK]
        held: list[Entry] = []
        targets: list[memoryview | None] = []
        done = False
        try:
            stream.send([dp.encode_response(dp.OP_PUT_READY, req.request_id, len(keys), epoch=node.ring.epoch),
                         bytes(codes)])
            if not todo:
                return
            # The guard of each slot, as for a transfer-engine write: an expired reservation is
            # refused, and eviction or a revoke leaves an extent being written alone.
            for i in todo:
                e = node.acquire("write", offsets[i], sizes[i], tokens[i])
                if e is not None:
                    held.append(e)
                targets.append(node.dram.slice(offsets[i], sizes[i]) if e is not None else None)
            if len(held) == len(todo):
                stream.recv_buffers(targets)  # type: ignore[arg-type]
            else:  # a reservation gone meanwhile (expired): its bytes still arrive, dropped
                for i, target in zip(todo, targets, strict=True):
                    if target is None:
                        stream.discard(sizes[i])
                    else:
                        stream.recv_exact(target)
            trailer = bytearray(8 * len(keys))
            stream.recv_exact(trailer)
            checksums = dp.decode_checksums(trailer, len(keys))
            done = True
        finally:
            for e in held:
                node.release_guard(e)
            if not done and rid:
                node.put_revoke(tenant, rid)  # a short or broken stream: nothing becomes visible
        final = node.put_commit(tenant, rid, checksums)
        stream.send([dp.encode_response(dp.OP_PUT_DONE, req.request_id, len(keys), epoch=node.ring.epoch),
                     bytes(final)])
