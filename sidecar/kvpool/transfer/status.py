"""Transfer status codes and per-request results — the one place they are defined.

Every transport (TCP, shared memory, RDMA) and the wire protocol report outcomes with the same
:class:`TransferCode`; the numeric values are part of the TCP wire format, so never renumber them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TransferCode(enum.IntEnum):
    """Outcome of one transfer request (values travel on the wire as one byte)."""

    OK = 0
    #: The segment's guard refused the access (expired lease, recycled slot, unpinned object).
    LEASE_INVALID = 1
    #: ``offset``/``length`` do not fit inside the remote segment (or the local buffer is wrong).
    OUT_OF_BOUNDS = 2
    #: The peer has no segment of that name.
    NO_SEGMENT = 3
    #: The connection failed (refused, reset, closed) and the one retry failed too.
    CONNECTION = 4
    #: No progress for ``stall_timeout`` seconds.
    TIMEOUT = 5
    #: The peer violated the wire protocol (bad magic/version, malformed response).
    PROTOCOL = 6


@dataclass(frozen=True, slots=True)
class TransferStatus:
    """Result of one :class:`~kvpool.transfer.TransferRequest` of a batch."""

    code: TransferCode
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code is TransferCode.OK


#: Shared instance for the common case, so a successful request allocates nothing.
STATUS_OK = TransferStatus(TransferCode.OK)
