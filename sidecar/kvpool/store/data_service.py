"""``StoreData``, the gRPC service a tenant's sidecar calls: protobuf in, :class:`StoreNode` calls,
protobuf out.

The tenant comes from the token in the call's metadata, never from the message; an unknown or
missing token is UNAUTHENTICATED (the admin token names no tenant either).  ``Health`` and
``GetRing`` are open (probes, a sidecar catching up with the ring); ``Stats`` shows a tenant its own
usage and the admin (the operator) every tenant's.  These are the cold calls only: exists, reads and
writes have no gRPC form, they go over the data session (:mod:`.data_session`).  ``DataTicket``
hands a tenant the one-use ticket that opens a plaintext data connection (:mod:`kvpool.core.tickets`)
on a node whose data session is not encrypted.
"""

from __future__ import annotations

import time
from typing import Any

import grpc

from kvpool.core import errors, pki
from kvpool.core.keys import unpack_keys
from kvpool.core.tickets import TicketBook
from kvpool.core.traffic import traffic_class_or_default
from kvpool.store.admin_service import admin_allows
from kvpool.store.node import StoreNode
from kvpool.store.rdma import StoreRdma
from kvpool.wire import grpc_status, tls
from kvpool.wire.convert import ring_to_pb
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.proto import store_pb2_grpc as pbg


def _keys(blob: bytes) -> list[bytes]:
    try:
        return unpack_keys(blob)
    except ValueError as exc:
        raise errors.InvalidArgument(str(exc)) from None


class StoreDataService(pbg.StoreDataServicer):
    def __init__(self, node: StoreNode, transfer_address: str, admin_token: str = "",
                 rdma: StoreRdma | None = None, tickets: TicketBook | None = None,
                 require_operator: bool = False) -> None:
        self.node = node
        self.require_operator = require_operator
        """Over TLS the admin token opens every tenant's Stats only with the operator's certificate."""
        self.tickets = tickets
        """The node's data-session tickets (None: its data session is TLS, or plain without them)."""
        self.rdma = rdma
        """The node's RDMA side (None: no device; the RDMA calls are then UNIMPLEMENTED)."""
        self.transfer_address = transfer_address
        """Where the node's data session is served (its Health says so)."""
        self.admin_token = admin_token

    def _tenant(self, context: grpc.ServicerContext) -> str:
        tid = self.node.authenticate(grpc_status.bearer(context.invocation_metadata()))
        if tid is None:
            grpc_status.abort(context, grpc.StatusCode.UNAUTHENTICATED, "unknown or missing tenant token")
        return tid

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.Empty:
        tenant = self._tenant(context)
        # Only the caller's own leases, of this life.
        self.node.release(list(request.lease_ids), tenant, request.incarnation)
        return pb.Empty()

    def Remove(self, request: pb.RemoveRequest, context: grpc.ServicerContext) -> pb.CodesReply:
        tenant = self._tenant(context)
        return grpc_status.answer(context, lambda: pb.CodesReply(
            codes=self.node.remove(tenant, _keys(request.keys), request.kind)))

    def Health(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.HealthReply:
        return pb.HealthReply(ok=True, node_id=self.node.node_id, epoch=self.node.ring.epoch,
                              transfer_address=self.transfer_address, incarnation=self.node.incarnation,
                              rdma_device=self.rdma.device if self.rdma is not None else "",
                              data_session_plaintext=self.tickets is not None)

    def DataTicket(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DataTicketReply:
        tenant = self._tenant(context)
        if self.tickets is None:
            grpc_status.abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                              "this node's data session is TLS: it takes no tickets")
        ticket, expires = self.tickets.issue(tenant, int(time.time() * 1000))
        return pb.DataTicketReply(ticket=ticket, expires_unix_ms=expires)

    def GetRing(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.Ring:
        ring = ring_to_pb(self.node.ring)
        if self.rdma is not None:  # the node advertises its own RDMA endpoint in its entry
            for m in ring.members:
                if m.id == self.node.node_id:
                    m.rdma_device = self.rdma.device
        return ring

    # -- RDMA: the out-of-band half of one-sided reads (kvpool.store.rdma) ----------------------

    def _rdma(self, context: grpc.ServicerContext) -> StoreRdma:
        if self.rdma is None:
            grpc_status.abort(context, grpc.StatusCode.UNIMPLEMENTED, "this node has no RDMA device")
        return self.rdma

    def ConnectRdma(self, request: pb.ConnectRdmaRequest, context: grpc.ServicerContext) -> pb.ConnectRdmaReply:
        self._tenant(context)
        rdma = self._rdma(context)
        endpoint, key = grpc_status.answer(context, lambda: rdma.connect(request.endpoint))
        return pb.ConnectRdmaReply(endpoint=endpoint, arena_key=key, incarnation=self.node.incarnation)

    def HoldExtents(self, request: pb.HoldExtentsRequest, context: grpc.ServicerContext) -> pb.HoldExtentsReply:
        tenant = self._tenant(context)
        rdma = self._rdma(context)
        hold_id, codes, found = grpc_status.answer(context, lambda: rdma.hold(
            tenant, _keys(request.keys), request.kind, request.hold_ms, request.drop_lease_id))
        return pb.HoldExtentsReply(
            codes=codes, offsets=[e.offset if e is not None else 0 for e in found],
            sizes=[e.size if e is not None else 0 for e in found],
            checksums=[e.checksum if e is not None else 0 for e in found],
            hold_id=hold_id, epoch=self.node.ring.epoch, incarnation=self.node.incarnation)

    def ReleaseExtents(self, request: pb.ReleaseExtentsRequest, context: grpc.ServicerContext) -> pb.Empty:
        tenant = self._tenant(context)
        self._rdma(context).release(tenant, list(request.hold_ids))
        return pb.Empty()

    def ReserveRdma(self, request: pb.ReserveRdmaRequest, context: grpc.ServicerContext) -> pb.ReserveRdmaReply:
        tenant = self._tenant(context)
        rdma = self._rdma(context)
        codes, offsets, rid = grpc_status.answer(context, lambda: rdma.reserve(
            tenant, _keys(request.keys), list(request.sizes), traffic_class_or_default(request.traffic_class),
            request.kind, request.timeout_ms, request.epoch))
        return pb.ReserveRdmaReply(codes=codes, offsets=offsets, reservation_id=rid, epoch=self.node.ring.epoch,
                                   incarnation=self.node.incarnation)

    def CommitRdma(self, request: pb.CommitRdmaRequest, context: grpc.ServicerContext) -> pb.CodesReply:
        tenant = self._tenant(context)
        rdma = self._rdma(context)
        return pb.CodesReply(codes=grpc_status.answer(context, lambda: rdma.commit(
            tenant, request.reservation_id, list(request.checksums), request.revoke)))

    def Stats(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.StatsReply:
        # The admin (operator) sees every tenant; a tenant sees only its own usage and counters.
        # Without an admin token (dev pools) an anonymous caller counts as the admin.
        token = grpc_status.bearer(context.invocation_metadata())
        only: str | None = None
        admin = self.admin_token and admin_allows(self.admin_token, token) and (
            not self.require_operator or tls.grpc_peer_identity(context) == pki.operator())
        if not admin:
            tid = self._tenant(context)
            if token or self.admin_token:
                only = tid
        s: dict[str, Any] = self.node.stats()
        if only is not None:
            s["tenants"] = [t for t in s["tenants"] if t[0] == only]
        counters = s["counters"]
        return pb.StatsReply(
            node_id=s["node_id"], epoch=s["epoch"], draining=s["draining"],
            tiers=[pb.TierStats(name=n, capacity_bytes=c, used_bytes=u, objects=o) for n, c, u, o in s["tiers"]],
            tenants=[pb.TenantStats(tenant_id=t, used_bytes=u, quota_bytes=q, objects=max(o, 0), counters=c,
                                    share_bytes=share)
                     for t, u, q, o, c, share in s["tenants"]],
            counters=counters, hit_blocks=counters.get(StoreCounter.HIT_BLOCKS, 0),
            lookup_blocks=counters.get(StoreCounter.LOOKUP_BLOCKS, 0), incarnation=s["incarnation"],
            foreign_bytes=s["foreign_bytes"])
