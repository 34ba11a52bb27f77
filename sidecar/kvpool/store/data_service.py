"""``StoreData``, the gRPC service a tenant's sidecar calls: protobuf in, :class:`StoreNode` calls,
protobuf out.

The tenant comes from the token in the call's metadata, never from the message; an unknown or
missing token is UNAUTHENTICATED (the admin token names no tenant either).  ``Health`` and
``GetRing`` are open (probes, a sidecar catching up with the ring); ``Stats`` shows a tenant its own
usage and the admin (the operator) every tenant's.  Hot reads and writes normally go over the data
session (:mod:`.data_session`); these are their gRPC form.
"""

from __future__ import annotations

from typing import Any

import grpc

from kvpool.core import errors
from kvpool.core.keys import unpack_keys
from kvpool.store.admin_service import admin_allows
from kvpool.store.node import StoreNode
from kvpool.wire import grpc_status
from kvpool.wire.convert import ring_to_pb
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.proto import store_pb2_grpc as pbg


def _keys(blob: bytes) -> list[bytes]:
    try:
        return unpack_keys(blob)
    except ValueError as exc:
        raise errors.InvalidArgument(str(exc)) from None


class StoreDataService(pbg.StoreDataServicer):
    def __init__(self, node: StoreNode, location: pb.Location, admin_token: str = "") -> None:
        self.node = node
        self.location = location
        """Where the node's DRAM arena is reached (its transfer address, its shared-memory file)."""
        self.admin_token = admin_token

    def _tenant(self, context: grpc.ServicerContext) -> str:
        tid = self.node.authenticate(grpc_status.bearer(context.invocation_metadata()))
        if tid is None:
            grpc_status.abort(context, grpc.StatusCode.UNAUTHENTICATED, "unknown or missing tenant token")
        return tid

    def Exists(self, request: pb.ExistsRequest, context: grpc.ServicerContext) -> pb.ExistsReply:
        tenant = self._tenant(context)

        def run() -> pb.ExistsReply:
            prefix, present, lease = self.node.exists(
                tenant, _keys(request.keys), request.kind, request.prefix_only, request.pin, request.lease_ms)
            return pb.ExistsReply(prefix=prefix, present=present, lease_id=lease.lease_id if lease else 0,
                                  lease_expires_unix_ms=int(lease.expires * 1000) if lease else 0,
                                  epoch=self.node.ring.epoch, incarnation=self.node.incarnation)
        return grpc_status.answer(context, run)

    def PutStart(self, request: pb.PutStartRequest, context: grpc.ServicerContext) -> pb.PutStartReply:
        tenant = self._tenant(context)

        def run() -> pb.PutStartReply:
            codes, offsets, tokens, rid = self.node.put_start(
                tenant, _keys(request.keys), list(request.sizes), request.traffic_class or "chatbot",
                request.kind, request.timeout_ms, request.epoch)
            return pb.PutStartReply(codes=codes, offsets=offsets, tokens=tokens, reservation_id=rid,
                                    location=self.location, epoch=self.node.ring.epoch,
                                    incarnation=self.node.incarnation)
        return grpc_status.answer(context, run)

    def PutCommit(self, request: pb.PutCommitRequest, context: grpc.ServicerContext) -> pb.PutCommitReply:
        tenant = self._tenant(context)
        return grpc_status.answer(context, lambda: pb.PutCommitReply(codes=self.node.put_commit(
            tenant, request.reservation_id, list(request.checksums), request.revoke, request.incarnation)))

    def PutRevoke(self, request: pb.PutRevokeRequest, context: grpc.ServicerContext) -> pb.Empty:
        tenant = self._tenant(context)
        self.node.put_revoke(tenant, request.reservation_id)
        return pb.Empty()

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.GetReply:
        tenant = self._tenant(context)

        def run() -> pb.GetReply:
            # Tokens are lease-scoped: they die with the lease.
            codes, offsets, sizes, sums, tokens, lease = self.node.get_plan(
                tenant, _keys(request.keys), request.kind, request.lease_ms, request.lease_id)
            return pb.GetReply(codes=codes, offsets=offsets, sizes=sizes, checksums=sums, tokens=tokens,
                               lease_id=lease.lease_id if lease else 0,
                               lease_expires_unix_ms=int(lease.expires * 1000) if lease else 0,
                               location=self.location, epoch=self.node.ring.epoch,
                               incarnation=self.node.incarnation)
        return grpc_status.answer(context, run)

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
                              transfer_address=self.location.transfer_address, incarnation=self.node.incarnation)

    def GetRing(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.Ring:
        return ring_to_pb(self.node.ring)

    def Stats(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.StatsReply:
        # The admin (operator) sees every tenant; a tenant sees only its own usage and counters.
        # Without an admin token (dev pools) an anonymous caller counts as the admin.
        token = grpc_status.bearer(context.invocation_metadata())
        only: str | None = None
        if not (self.admin_token and admin_allows(self.admin_token, token)):
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
            counters=counters, hit_blocks=counters.get("hit_blocks", 0),
            lookup_blocks=counters.get("lookup_blocks", 0), incarnation=s["incarnation"])
