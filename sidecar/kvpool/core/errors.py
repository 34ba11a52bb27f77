"""One exception tree for the data plane and its result codes, in one place (pure; no I/O).

Batch calls return per-item :class:`Code` values; whole-call failures raise a
:class:`KvpoolError` subclass.  ``error_for_code`` and ``SESSION_STATUS`` (the one-byte call status
of the binary sessions, :mod:`kvpool.wire.frames`) translate between the forms here; the gRPC
status mapping is the wire's (:mod:`kvpool.wire.grpc_status`).
"""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    """Per-item result of a data-plane call: the ``Code`` enum of ``store.proto`` (the wire's
    contract), as Python sees it.  ``tests/kvpool/test_codes.py`` fails if the two ever differ."""

    OK = 0
    NOT_FOUND = 1
    QUOTA_EXCEEDED = 2
    NO_SPACE = 3
    LEASE_EXPIRED = 4
    ALREADY_EXISTS = 5
    CHECKSUM = 6
    INVALID = 7
    WRONG_OWNER = 8
    IN_FLIGHT = 9
    DRAINING = 10
    TOO_LARGE = 11
    WRONG_TENANT = 12
    HANDOFF_INVALID = 13
    HANDOFF_EXPIRED = 14
    UNSUPPORTED = 15
    UNAVAILABLE = 16


class Kind(enum.IntEnum):
    """What an object is: a KV block (any tier, replicated) or a state object (DRAM only)."""

    BLOCK = 0
    STATE = 1


class KvpoolError(Exception):
    """Base of every kvpool data-plane error."""

    code: int = Code.INVALID


class NotFound(KvpoolError, KeyError):
    code = Code.NOT_FOUND

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "not found"


class QuotaExceeded(KvpoolError):
    code = Code.QUOTA_EXCEEDED


class NoSpace(KvpoolError):
    code = Code.NO_SPACE


class LeaseExpired(KvpoolError):
    code = Code.LEASE_EXPIRED


class ChecksumMismatch(KvpoolError):
    code = Code.CHECKSUM


class InvalidArgument(KvpoolError, ValueError):
    code = Code.INVALID


class WrongOwner(KvpoolError):
    code = Code.WRONG_OWNER


class InFlight(KvpoolError):
    code = Code.IN_FLIGHT


class Draining(KvpoolError):
    code = Code.DRAINING


class TooLarge(KvpoolError):
    code = Code.TOO_LARGE


class Unauthenticated(KvpoolError):
    code = Code.INVALID


class PermissionDenied(KvpoolError):
    code = Code.INVALID


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


class Suspect(Unavailable):
    """The peer missed an earlier call's deadline and has not answered since: this call was not
    made (calls fail at once until a probe is answered; :mod:`kvpool.core.breaker`)."""


class WrongTenant(PermissionDenied):
    """A handoff record of another tenant."""

    code = Code.WRONG_TENANT


class HandoffInvalid(KvpoolError, ValueError):
    """A handoff record that is malformed or whose tag does not verify (altered or forged)."""

    code = Code.HANDOFF_INVALID


class HandoffExpired(KvpoolError):
    """A handoff record past its expiry."""

    code = Code.HANDOFF_EXPIRED


class Unsupported(KvpoolError):
    """The peer cannot serve this call at all (a ranged read of a node without the data session)."""

    code = Code.UNSUPPORTED


_BY_CODE: dict[int, type[KvpoolError]] = {
    Code.NOT_FOUND: NotFound, Code.QUOTA_EXCEEDED: QuotaExceeded, Code.NO_SPACE: NoSpace,
    Code.LEASE_EXPIRED: LeaseExpired, Code.CHECKSUM: ChecksumMismatch, Code.INVALID: InvalidArgument,
    Code.WRONG_OWNER: WrongOwner, Code.IN_FLIGHT: InFlight, Code.DRAINING: Draining,
    Code.TOO_LARGE: TooLarge, Code.WRONG_TENANT: WrongTenant, Code.HANDOFF_INVALID: HandoffInvalid,
    Code.HANDOFF_EXPIRED: HandoffExpired,
    Code.UNSUPPORTED: Unsupported,
    Code.UNAVAILABLE: Unavailable,
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
    try:
        return Code(code).name
    except ValueError:
        return f"code {code}"


def error_for_code(code: int, message: str = "") -> KvpoolError:
    cls = _BY_CODE.get(code, KvpoolError)
    return cls(message or code_name(code))
