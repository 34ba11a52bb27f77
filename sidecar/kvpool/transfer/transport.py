"""The one Transport interface every way of moving bytes implements (TCP, shm, RDMA).

A transport object serves one peer. The engine asks each transport of the peer, in priority
order (shared memory, RDMA, TCP), whether it ``handles`` a request's segment, groups the batch
accordingly, and hands each transport its share with ``submit``. The same conformance suite
(``tests/kvpool/transfer/test_conformance.py``) runs against every implementation.
"""

from __future__ import annotations

from typing import Protocol

from kvpool.transfer.batch import BatchHandle
from kvpool.transfer.plan import TransferRequest

#: ``(index in the batch, request)``: what a transport is given.
Item = tuple[int, TransferRequest]


class Transport(Protocol):
    """Moves the bytes of requests between caller buffers and one peer's segments.

    ``submit`` must, before it returns, register every piece it will complete with
    ``handle._expect(index, pieces)``; it may complete pieces at once (inline copies) or later
    from its own threads, but must complete every registered piece exactly once — with an error
    status if need be — and must not touch a request's buffer after its last piece completed.
    Items never have ``length == 0`` (the engine finishes those itself). Thread-safe.
    """

    #: ``True`` when ``submit`` does the work in the caller's thread (the engine starts the
    #: asynchronous transports first so the network is busy meanwhile).
    inline: bool

    def handles(self, segment: str) -> bool:
        """Whether requests for ``segment`` of this peer should go this way."""
        ...

    def submit(self, handle: BatchHandle, items: list[Item]) -> None: ...

    def close(self) -> None:
        """Fail whatever is still pending (CONNECTION) and release resources."""
        ...
