"""Same-host shared-memory transport: a request is one memory copy, no socket.

The peer's segment is a :meth:`Segment.shared` file that this process maps as well; reads and
writes are ``numpy.copyto`` between the caller's buffer and the mapping (the GIL is released for
the copy). The peer's :class:`~kvpool.transfer.Guard` cannot run here — nothing on the peer
side sees the access — so a reader must verify the object's checksum (and a lease obtained over
the control plane) itself; a writer must only write into space reserved for it.
"""

from __future__ import annotations

import threading

import numpy as np

from kvpool.transfer.batch import BatchHandle
from kvpool.transfer.plan import TransferRequest
from kvpool.transfer.protocol import check_bounds
from kvpool.transfer.segment import Segment
from kvpool.transfer.status import STATUS_OK, TransferCode, TransferStatus


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` through numpy (one memcpy, GIL released for large copies)."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class ShmPeer:
    """Shared-memory transport to one peer: its attached segments, mapped here."""

    inline = True

    def __init__(self, address: str) -> None:
        self.address = address
        self._lock = threading.Lock()
        self._segments: dict[str, Segment] = {}

    def attach(self, name: str, path: str) -> Segment:
        segment = Segment.open_shared(name, path)
        with self._lock:
            old = self._segments.get(name)
            self._segments = {**self._segments, name: segment}  # swapped whole: readers never lock
        if old is not None:
            old.close()
        return segment

    def detach(self, name: str) -> None:
        with self._lock:
            segments = dict(self._segments)
            segment = segments.pop(name, None)
            self._segments = segments
        if segment is not None:
            segment.close()

    def handles(self, segment: str) -> bool:
        return segment in self._segments

    def submit(self, handle: BatchHandle, items: list[tuple[int, TransferRequest]]) -> None:
        for index, _ in items:
            handle._expect(index, 1)
        for index, req in items:
            handle._complete(index, self.transfer(req))

    def transfer(self, req: TransferRequest) -> TransferStatus:
        segment = self._segments.get(req.remote_segment)
        if segment is None:
            return TransferStatus(TransferCode.NO_SEGMENT, f"segment {req.remote_segment!r} not attached")
        try:
            view = segment.view
        except ValueError:
            return TransferStatus(TransferCode.NO_SEGMENT, f"segment {req.remote_segment!r} detached")
        why = check_bounds(req.remote_offset, req.length, view.nbytes)
        if why is not None:
            return TransferStatus(TransferCode.OUT_OF_BOUNDS, why)
        remote = view[req.remote_offset : req.remote_offset + req.length]
        if req.op == "read":
            copy_bytes(req.local, remote)
        else:
            copy_bytes(remote, req.local)
        return STATUS_OK

    def close(self) -> None:
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
        for segment in segments:
            segment.close()
