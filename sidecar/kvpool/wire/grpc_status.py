"""The gRPC form of the data plane's errors: status codes both ways (server and client side)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NoReturn, TypeVar, cast

import grpc

from kvpool.core.errors import (
    DeadlineExceeded,
    Draining,
    InvalidArgument,
    KvpoolError,
    LeaseExpired,
    NoSpace,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    SidecarRestarted,
    Unauthenticated,
    Unavailable,
    Unsupported,
    WrongOwner,
)
from kvpool.wire.proto import store_pb2 as pb

T = TypeVar("T")

GRPC_STATUS: dict[type[KvpoolError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    QuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NoSpace: grpc.StatusCode.RESOURCE_EXHAUSTED,
    LeaseExpired: grpc.StatusCode.FAILED_PRECONDITION,
    WrongOwner: grpc.StatusCode.FAILED_PRECONDITION,
    Draining: grpc.StatusCode.UNAVAILABLE,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    SidecarRestarted: grpc.StatusCode.ABORTED,
    Unsupported: grpc.StatusCode.UNIMPLEMENTED,
}
_FROM_GRPC: dict[grpc.StatusCode, type[KvpoolError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: NoSpace,
    grpc.StatusCode.FAILED_PRECONDITION: LeaseExpired,
    grpc.StatusCode.UNIMPLEMENTED: Unsupported,
    grpc.StatusCode.ABORTED: SidecarRestarted,
}



# Codes and kinds travel as plain ints (the data sessions' bytes, the client APIs' arguments, the
# pool's UNREACHABLE beside the node's codes); the generated stubs type message fields as the enum
# classes, whose values are those same ints at runtime (pb.Code is not even callable).  These two
# are the typed views at that boundary: no conversion and no check (the receiver validates).
def as_code(code: int) -> pb.Code:
    """``code``, an answer of a node or sidecar, as a ``Code`` message field."""
    return cast(pb.Code, code)


def as_kind(kind: int) -> pb.Kind:
    """``kind``, an object kind a caller passed, as a ``Kind`` message field."""
    return cast(pb.Kind, kind)


def grpc_status_for(exc: KvpoolError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in GRPC_STATUS:
            return GRPC_STATUS[cls]
    return grpc.StatusCode.INTERNAL


def from_rpc_error(err: grpc.RpcError) -> KvpoolError:
    """Translate a failed call into the exception tree (client side)."""
    status = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    detail = err.details() if hasattr(err, "details") else str(err)
    if status == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"{status.name}: {detail}")
    if status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return Unavailable(f"{status.name}: {detail}")
    return _FROM_GRPC.get(status, KvpoolError)(detail or status.name)


# -- server side ---------------------------------------------------------------------------


def bearer(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The token of a call's ``authorization: Bearer <token>`` metadata ("" without one)."""
    for k, v in metadata or ():
        if k == "authorization" and isinstance(v, str) and v.startswith("Bearer "):
            return v[7:]
    return ""


def answer(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
    """``fn()``; a data-plane error it raises ends the call with its status (a ValueError, a
    malformed argument, with INVALID_ARGUMENT)."""
    try:
        return fn()
    except KvpoolError as exc:
        abort(context, grpc_status_for(exc), str(exc))
    except ValueError as exc:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, detail: str) -> NoReturn:
    """End the call with ``code`` (``context.abort`` raises; typed here as never returning)."""
    context.abort(code, detail)
    raise AssertionError("unreachable: abort raises")
