"""One exception tree for the data plane, mapped to result codes and gRPC status in one place.

Batch calls return per-item :class:`~kvpool.proto.store_pb2.Code` values; whole-call failures
raise a :class:`KvpoolError` subclass.  ``error_for_code``, ``GRPC_STATUS`` and ``SESSION_STATUS``
(the one-byte call status of the binary data session, :mod:`kvpool.store.data_protocol`) are the
only translations between the forms.
"""

from __future__ import annotations

from typing import cast

import grpc

from .proto import store_pb2 as pb

Code = pb.Code
Kind = pb.Kind


# Codes and kinds travel as plain ints (the data sessions' bytes, the client APIs' arguments, the
# pool's UNREACHABLE beside the node's codes); the generated stubs type message fields as the enum
# classes, whose values are those same ints at runtime (pb.Code is not even callable).  These two
# are the typed views at that boundary: no conversion and no check (the receiver validates).
def as_code(code: int) -> Code:
    """``code``, an answer of a node or sidecar, as a ``Code`` message field."""
    return cast(Code, code)


def as_kind(kind: int) -> Kind:
    """``kind``, an object kind a caller passed, as a ``Kind`` message field."""
    return cast(Kind, kind)


class KvpoolError(Exception):
    """Base of every kvpool data-plane error."""

    code: int = pb.INVALID


class NotFound(KvpoolError, KeyError):
    code = pb.NOT_FOUND

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "not found"


class QuotaExceeded(KvpoolError):
    code = pb.QUOTA_EXCEEDED


class NoSpace(KvpoolError):
    code = pb.NO_SPACE


class LeaseExpired(KvpoolError):
    code = pb.LEASE_EXPIRED


class ChecksumMismatch(KvpoolError):
    code = pb.CHECKSUM


class InvalidArgument(KvpoolError, ValueError):
    code = pb.INVALID


class WrongOwner(KvpoolError):
    code = pb.WRONG_OWNER


class InFlight(KvpoolError):
    code = pb.IN_FLIGHT


class Draining(KvpoolError):
    code = pb.DRAINING


class TooLarge(KvpoolError):
    code = pb.TOO_LARGE


class Unauthenticated(KvpoolError):
    code = pb.INVALID


class PermissionDenied(KvpoolError):
    code = pb.INVALID


class Unavailable(KvpoolError):
    """The peer (store node or sidecar) cannot be reached."""


class SidecarRestarted(Unavailable):
    """The sidecar is another life than the one the call's leases, reservation or offsets came
    from (it was restarted): say Hello again, then retry (:class:`kvpool.Client` does, once)."""


INCARNATION_METADATA = "kvpool-incarnation"
"""gRPC call metadata: the sidecar incarnation the client knows (HelloReply.incarnation)."""


class DeadlineExceeded(Unavailable):
    """The peer did not answer within the call's deadline (it may be hung: a stopped process, a
    long pause); the call was given up, the connection it used is closed."""


class WrongTenant(PermissionDenied):
    """A handoff record of another tenant."""

    code = pb.WRONG_TENANT


class HandoffInvalid(KvpoolError, ValueError):
    """A handoff record that is malformed or whose tag does not verify (altered or forged)."""

    code = pb.HANDOFF_INVALID


class HandoffExpired(KvpoolError):
    """A handoff record past its expiry."""

    code = pb.HANDOFF_EXPIRED


class Unsupported(KvpoolError):
    """The peer cannot serve this call at all (a ranged read of a node without the data session)."""

    code = pb.UNSUPPORTED


_BY_CODE: dict[int, type[KvpoolError]] = {
    pb.NOT_FOUND: NotFound, pb.QUOTA_EXCEEDED: QuotaExceeded, pb.NO_SPACE: NoSpace,
    pb.LEASE_EXPIRED: LeaseExpired, pb.CHECKSUM: ChecksumMismatch, pb.INVALID: InvalidArgument,
    pb.WRONG_OWNER: WrongOwner, pb.IN_FLIGHT: InFlight, pb.DRAINING: Draining,
    pb.TOO_LARGE: TooLarge, pb.WRONG_TENANT: WrongTenant, pb.HANDOFF_INVALID: HandoffInvalid,
    pb.HANDOFF_EXPIRED: HandoffExpired,
    pb.UNSUPPORTED: Unsupported,
    pb.UNAVAILABLE: Unavailable,
}

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


SESSION_OK = 0
"""Call status of a data-session frame that succeeded (its per-item codes say the rest)."""
SESSION_STATUS: dict[type[KvpoolError], int] = {
    KvpoolError: 1, InvalidArgument: 2, Unauthenticated: 3, PermissionDenied: 4, Draining: 5,
    Unavailable: 6, TooLarge: 7, Unsupported: 8, SidecarRestarted: 9,
}
_FROM_SESSION: dict[int, type[KvpoolError]] = {v: k for k, v in SESSION_STATUS.items()}


def session_status_for(exc: KvpoolError) -> int:
    """The data-session call status of a whole-call failure (the nearest listed ancestor)."""
    for cls in type(exc).__mro__:
        if cls in SESSION_STATUS:
            return SESSION_STATUS[cls]
    return SESSION_STATUS[KvpoolError]


def from_session_status(status: int, message: str = "") -> KvpoolError:
    """The exception a data-session call status stands for (client side); unknown values are
    the base class, never success."""
    cls = _FROM_SESSION.get(status, KvpoolError)
    return cls(message or f"data session call failed ({cls.__name__})")


def code_name(code: int) -> str:
    return str(pb.Code.Name(code))


def error_for_code(code: int, message: str = "") -> KvpoolError:
    cls = _BY_CODE.get(code, KvpoolError)
    return cls(message or code_name(code))


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
