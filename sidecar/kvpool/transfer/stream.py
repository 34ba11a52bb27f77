"""A blocking byte stream over one TCP connection, for sessions that carry their own frames.

The transfer server hands a connection whose first bytes name a registered session (see
``TransferServer(sessions=...)``) to that session's handler as a :class:`Stream`; clients open
one with :func:`connect`.  Only this package touches the socket: handlers and clients see
``recv_exact`` / ``recv_buffers`` (scatter into caller memory) / ``send`` (gather from caller
memory), each a few syscalls per frame whatever the number of objects, with the GIL released
inside every call.  Over TLS (``connect(tls=...)``, a server's ``TransferServer(tls=...)``) the
same calls encrypt from and decrypt into the caller's memory (:mod:`kvpool.transfer._sockio`).
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.transfer import _sockio

if TYPE_CHECKING:
    from kvpool.wire.tls import TlsConfig

#: Buffers per ``recvmsg_into``/``sendmsg`` call (Linux IOV_MAX is 1024).
MAX_IOV = _sockio.MAX_IOV

STALL_ERRORS = _sockio.STALL_ERRORS


class Stream:
    """One connection; not thread-safe (one caller at a time, e.g. from a pool of streams)."""

    def __init__(self, sock: socket.socket, head: bytes = b"") -> None:
        self._sock = sock
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._head = head
        """Bytes already read off the connection (a server's session magic), served first by
        every read."""
        self.closed = False
        self.received = 0
        """Bytes received so far (a caller can tell whether a peer answered at all)."""
        self.timeout = 0.0
        """The stall timeout armed on the socket now (seconds; 0: not known)."""

    def set_timeout(self, seconds: float) -> None:
        """Arm the kernel's send/receive stall timeouts for the next calls (a call's deadline; a
        syscall only when it changes)."""
        if seconds != self.timeout:
            _sockio.set_stall_timeout(self._sock, seconds)
            self.timeout = seconds

    def recv_exact(self, view: memoryview | bytearray) -> None:
        """Fill ``view`` or raise ``ConnectionError`` (EOF) / ``TimeoutError`` (stall)."""
        mv = memoryview(view)
        if self._head:
            n = self._take_head(mv)
            mv = mv[n:]
        _sockio.recv_exact(self._sock, mv)
        self.received += len(view)

    def _take_head(self, view: memoryview) -> int:
        n = min(len(self._head), view.nbytes)
        view[:n] = self._head[:n]
        self._head = self._head[n:]
        return n

    def peer(self) -> socket.socket:
        """The connection's socket (a TLS server asks it who the peer is)."""
        return self._sock

    def recv_some(self, view: memoryview | bytearray) -> int:
        """One ``recv_into`` (0 at a clean EOF)."""
        if self._head:
            n = self._take_head(memoryview(view))
            self.received += n
            return n
        n = self._sock.recv_into(view)
        self.received += n
        return n

    def recv_buffers(self, views: Sequence[memoryview], deadline: float | None = None) -> None:
        """Fill every view in order, scattering with ``recvmsg_into`` (one call per ``MAX_IOV``
        buffers when the kernel has the bytes).  ``deadline`` (monotonic seconds): a peer still
        sending after it raises ``TimeoutError`` (the stall timeout bounds each syscall; this
        bounds the whole, against a peer that trickles)."""
        pending = [v for v in views if v.nbytes]
        while self._head and pending:
            n = self._take_head(pending[0])
            self.received += n
            pending[0] = pending[0][n:]
            if not pending[0].nbytes:
                pending.pop(0)
        if self._tls:
            for v in pending:
                _sockio.recv_exact(self._sock, v)
                self.received += v.nbytes
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError("payload not received by its deadline")
            return
        i = 0
        while i < len(pending):
            batch = pending[i:i + MAX_IOV]
            want = sum(v.nbytes for v in batch)
            got = self._sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
            self.received += got
            if got == 0:
                raise ConnectionError("peer closed the connection inside a payload")
            if got == want:
                i += len(batch)
                continue
            # Partial: skip the filled views, trim the one cut in the middle, go on.
            for j, v in enumerate(batch):
                if got >= v.nbytes:
                    got -= v.nbytes
                    continue
                pending[i + j] = v[got:]
                i += j
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("payload not received by its deadline")

    def discard(self, length: int) -> None:
        """Consume ``length`` bytes nobody wants (keeps the stream in sync)."""
        skipped = min(len(self._head), length)
        self._head = self._head[skipped:]
        scratch = memoryview(bytearray(min(length - skipped, 256 << 10) or 1))
        _sockio.discard(self._sock, length - skipped, scratch)
        self.received += length

    def send(self, buffers: Sequence[bytes | memoryview]) -> None:
        """Send every buffer in order (gathered into as few ``sendmsg`` calls as possible)."""
        _sockio.send_buffers(self._sock, buffers)

    def send_nowait(self, buffers: Sequence[bytes | memoryview]) -> list[memoryview]:
        """Send what the kernel takes now, without blocking; the rest (for :meth:`send`)."""
        return _sockio.send_buffers_nowait(self._sock, [b for b in buffers if len(b)])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        _sockio.shutdown(self._sock)
        self._sock.close()


def connect(address: tuple[str, int], timeout: float, tls: TlsConfig | None = None) -> Stream:
    """A tuned connection (no Nagle, kernel stall timeouts of ``timeout`` seconds); with ``tls``,
    a TLS client of the server's certificate (the handshake within ``timeout``)."""
    stream = Stream(_sockio.connect(address, timeout, tls))
    stream.timeout = timeout
    return stream
