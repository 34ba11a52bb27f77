"""``StoreAdmin``, the gRPC service only the operator calls: the ring, the tenants and the policy a
node serves, and its push jobs (drain, warm-up).  Protobuf in, calls of :class:`StoreNode`,
:class:`~kvpool.store.drain.DrainJob` and :class:`~kvpool.store.warm.WarmJob`, protobuf out.

The admin credential is checked once for the whole service, by :class:`AdminGate` in front of it,
not method by method: a method added to the service is guarded without a line here, and a
tenant's token reaches none of them.  On a node that serves TLS the credential is two things: the
admin token *and* the operator's client certificate (:func:`kvpool.core.pki.operator`), so a
leaked token alone opens nothing, and neither does a tenant's or a node's certificate.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc

from kvpool.core import pki
from kvpool.core.ring import Ring
from kvpool.store.drain import DrainJob
from kvpool.store.node import StoreNode, Tenant
from kvpool.store.warm import WarmJob
from kvpool.wire import grpc_status, tls
from kvpool.wire.convert import drain_status_to_pb, ring_from_pb, ring_to_pb, warm_status_to_pb
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.proto import store_pb2_grpc as pbg

SERVICE = pb.DESCRIPTOR.services_by_name["StoreAdmin"].full_name


def admin_allows(admin_token: str, presented: str) -> bool:
    """Whether a call carrying ``presented`` may use the admin API of a node whose admin token is
    ``admin_token``: that token, and only it.  A node without one (a dev pool) takes calls that
    carry no token, and still refuses any token (a tenant's is never an admin's)."""
    if admin_token:
        return hmac.compare_digest(presented.encode(), admin_token.encode())
    return not presented


class AdminGate(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped here (Any)
    """Refuses (PERMISSION_DENIED) every ``StoreAdmin`` call that :func:`admin_allows` refuses,
    before the request is even read; other services' calls pass untouched.  With
    ``require_operator`` (a node serving TLS) the call must also come from the operator's client
    certificate: checked when the call starts, before the method runs."""

    def __init__(self, admin_token: str, require_operator: bool = False) -> None:
        self._admin_token = admin_token
        self._require_operator = require_operator
        self._prefix = f"/{SERVICE}/"
        self._refuse = grpc.unary_unary_rpc_method_handler(self._refused)

    @staticmethod
    def _refused(request: bytes, context: grpc.ServicerContext) -> None:
        grpc_status.abort(context, grpc.StatusCode.PERMISSION_DENIED, "admin token required")

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        if handler_call_details.method.startswith(self._prefix):
            token = grpc_status.bearer(handler_call_details.invocation_metadata)
            if not admin_allows(self._admin_token, token):
                return self._refuse
            if self._require_operator:
                return _operator_only(continuation(handler_call_details))
        return continuation(handler_call_details)


def _operator_only(handler: Any) -> Any:
    """``handler`` (unary-unary, as every admin method) behind a check of the peer's certificate:
    the interceptor sees no peer, the call's context does."""
    if handler is None or handler.unary_unary is None:
        return handler
    inner = handler.unary_unary

    def guarded(request: Any, context: grpc.ServicerContext) -> Any:
        who = tls.grpc_peer_identity(context)
        if who != pki.operator():
            grpc_status.abort(context, grpc.StatusCode.PERMISSION_DENIED,
                              f"admin calls need the operator's client certificate (the peer is {who or 'anonymous'})")
        return inner(request, context)
    return grpc.unary_unary_rpc_method_handler(guarded, request_deserializer=handler.request_deserializer,
                                               response_serializer=handler.response_serializer)


class StoreAdminService(pbg.StoreAdminServicer):
    """The admin methods, behind :class:`AdminGate` (they check no credential themselves)."""

    def __init__(self, node: StoreNode) -> None:
        self.node = node
        self.drain = DrainJob(node)
        self.warm = WarmJob(node)

    def _ring(self, msg: pb.Ring, context: grpc.ServicerContext) -> Ring:
        return grpc_status.answer(context, lambda: ring_from_pb(msg))

    def SetRing(self, request: pb.Ring, context: grpc.ServicerContext) -> pb.Ring:
        ring = self.node.set_ring(self._ring(request, context))  # the ring it serves: a newer one stays
        self.drain.ring_changed(ring)
        return ring_to_pb(ring)

    def SetTenants(self, request: pb.SetTenantsRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.node.set_tenants([Tenant(t.tenant_id, t.token, bytes(t.salt), t.quota_bytes,
                                      {k: float(v) for k, v in t.ttl_seconds.items()}, t.evict_own_on_quota)
                               for t in request.tenants], request.replace)
        return pb.Empty()

    def SetPolicy(self, request: pb.PolicyRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.node.set_policy({k: float(v) for k, v in request.ttl_seconds.items()},
                             request.high_watermark, request.low_watermark)
        return pb.Empty()

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainStatus:
        ring = self._ring(request.ring, context)
        self.node.set_ring(ring)
        return drain_status_to_pb(self.drain.start(ring, request.deadline_unix_ms, request.max_bytes_per_second))

    def GetDrainStatus(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DrainStatus:
        return drain_status_to_pb(self.drain.status())

    def Warm(self, request: pb.WarmRequest, context: grpc.ServicerContext) -> pb.WarmStatus:
        ring = self._ring(request.ring, context)
        if not 0.0 <= request.fraction <= 1.0:
            grpc_status.abort(context, grpc.StatusCode.INVALID_ARGUMENT, "fraction must be in [0, 1]")
        self.node.set_ring(ring)
        return warm_status_to_pb(self.warm.start(ring, request.added, request.deadline_unix_ms,
                                                 request.max_bytes_per_second, request.fraction, request.removed))

    def GetWarmStatus(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.WarmStatus:
        return warm_status_to_pb(self.warm.status())
