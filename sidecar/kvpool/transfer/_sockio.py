"""Blocking socket helpers that move payload straight between sockets and memoryviews.

The GIL is released inside every ``recv_into``/``sendmsg`` call, so K connection threads move
bytes in parallel; the Python work per call is constant, never per byte.

A TLS socket (``ssl.SSLSocket``, :mod:`kvpool.wire.tls`) has no ``sendmsg``/``recvmsg_into`` and
takes no flags: it gets the same helpers through ``sendall``/``recv_into`` of each caller buffer
(OpenSSL encrypts from and decrypts into that memory: no copy in Python), and a Python timeout
instead of the kernel's (OpenSSL retries a read that the kernel timed out, so a stalled peer would
never surface).
"""

from __future__ import annotations

import array
import os
import socket
import ssl
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.wire.tls import TlsConfig

#: What a stalled peer raises: the kernel timeout (SO_RCVTIMEO/SO_SNDTIMEO) on a blocking socket
#: surfaces as EAGAIN (``BlockingIOError``); a Python-level timeout as ``TimeoutError``.
STALL_ERRORS = (TimeoutError, BlockingIOError)

#: Fixed kernel socket buffers, or ``None`` for the kernel's autotuning — which measured as
#: cheaper per byte on loopback than fixed 4 MiB buffers (setting them disables autotuning).
SOCKET_BUFFER_BYTES: int | None = None


def tune(sock: socket.socket) -> None:
    """No Nagle delay for the small pipelined headers; buffer sizes per ``SOCKET_BUFFER_BYTES``."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCKET_BUFFER_BYTES is None:
        return
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:
            pass  # capped by net.core.*mem_max; the default still works


def connect(address: tuple[str, int], timeout: float, tls: TlsConfig | None = None) -> socket.socket:
    """A tuned connection (no Nagle, stall timeouts of ``timeout`` seconds); with ``tls``, a TLS
    client of the server's certificate (the handshake within ``timeout``).  Closed on failure."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        tune(sock)
        if tls is not None:
            sock = tls.wrap_client(sock, address[0])
        set_stall_timeout(sock, timeout)
    except BaseException:
        sock.close()
        raise
    return sock


def shutdown(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways, from any thread (a thread blocked on it wakes to an EOF);
    never raises.  Done on the descriptor: ``SSLSocket.shutdown`` also drops the socket's SSL
    object under a thread that may be reading through it (an ``AttributeError`` there)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def set_stall_timeout(sock: socket.socket, seconds: float) -> None:
    """Make ``sock`` blocking with kernel send/receive timeouts of ``seconds``.

    Kernel timeouts instead of ``settimeout``: a Python timeout puts the socket in non-blocking
    mode, which costs a ``poll`` per call and defeats ``MSG_WAITALL``, so a 1 MiB receive would
    take dozens of syscalls instead of one.
    """
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds or None)
        return
    sock.settimeout(None)
    whole = int(seconds)
    packed = struct.pack("ll", whole, int((seconds - whole) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, packed)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, packed)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely or raise ``ConnectionError`` (EOF) / ``TimeoutError``."""
    got = 0
    total = view.nbytes
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    while got < total:
        n = sock.recv_into(view[got:], total - got, flags)
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {total} bytes")
        got += n


def recv_with_fds(sock: socket.socket, view: memoryview, max_fds: int = 1) -> list[int] | None:
    """Fill ``view`` (a frame header) and return the descriptors passed with it (``SCM_RIGHTS``);
    None on a clean end of stream before the first byte.  More descriptors than ``max_fds``
    (the kernel drops the rest: ``MSG_CTRUNC``) closes the ones that came and raises."""
    n, ancillary, flags, _ = sock.recvmsg_into([view], socket.CMSG_SPACE(max_fds * 4),
                                               socket.MSG_WAITALL | socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", data[:len(data) - len(data) % 4]))
    if flags & socket.MSG_CTRUNC:
        close_fds(fds)
        raise ConnectionError("more descriptors than a frame may carry")
    if n == 0 and not fds:
        return None
    if n < view.nbytes:
        try:
            recv_exact(sock, view[n:])
        except BaseException:
            close_fds(fds)
            raise
    return fds


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def send_with_fd(sock: socket.socket, buffers: list[bytes], fd: int) -> None:
    """Send ``buffers`` with ``fd`` attached to their first byte (``SCM_RIGHTS``)."""
    data = b"".join(buffers)
    sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    if sent < len(data):
        sock.sendall(data[sent:])


def discard(sock: socket.socket, length: int, scratch: memoryview) -> None:
    """Consume ``length`` bytes of a payload that will not be stored (keeps the stream in sync)."""
    while length > 0:
        n = sock.recv_into(scratch, min(length, scratch.nbytes))
        if n == 0:
            raise ConnectionError("peer closed the connection inside a payload")
        length -= n


def send_all(sock: socket.socket, header: bytes, payload: memoryview | None = None) -> None:
    """Send ``header`` then ``payload`` with as few syscalls as the kernel allows (usually one)."""
    if payload is None or payload.nbytes == 0:
        sock.sendall(header)
        return
    if isinstance(sock, ssl.SSLSocket):
        send_buffers(sock, [header, payload])
        return
    total = len(header) + payload.nbytes
    sent = sock.sendmsg([header, payload])
    if sent == total:
        return
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    sock.sendall(payload[sent - len(header) :])


#: Buffers per ``sendmsg`` call (Linux IOV_MAX is 1024).
MAX_IOV = 512


def send_buffers(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Send every buffer in order, gathering them into ``sendmsg`` calls (partial sends resumed;
    empty buffers are fine)."""
    if isinstance(sock, ssl.SSLSocket):
        _send_tls(sock, buffers)
        return
    sent = 0
    if len(buffers) <= MAX_IOV:
        # The usual frame: one sendmsg of the buffers as given moves it all (a blocking socket
        # returns short only on a stall timeout or a signal), no per-buffer Python before it.
        sent = sock.sendmsg(buffers)
        total = 0
        for b in buffers:
            total += b.nbytes if isinstance(b, memoryview) else len(b)
        if sent == total:
            return
    views = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers]
    i = _advance(views, 0, sent)
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i : i + MAX_IOV]))


def send_buffers_nowait(sock: socket.socket, buffers: list[bytes | memoryview]) -> list[memoryview]:
    """Send what the kernel takes now without blocking (``MSG_DONTWAIT``); the rest, in order
    (empty when all went).  A caller sending to several peers starts every one of them this
    way, so none waits for another to read (a frame over the peer's receive window blocks
    until the peer is scheduled and reads), then sends the rests with :func:`send_buffers`."""
    views = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers]
    if isinstance(sock, ssl.SSLSocket):
        return views  # no non-blocking TLS write: the caller sends it all with send_buffers
    i = 0
    while i < len(views):
        want = sum(v.nbytes for v in views[i : i + MAX_IOV])
        try:
            sent = sock.sendmsg(views[i : i + MAX_IOV], [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        i = _advance(views, i, sent)
        if sent < want:
            break
    return views[i:]


#: Buffers under this many bytes are joined before a TLS write (a record each would cost more
#: than the copy of a frame header); larger ones are encrypted from the caller's memory.
_TLS_JOIN_BYTES = 16 << 10


def _send_tls(sock: ssl.SSLSocket, buffers: Sequence[bytes | memoryview]) -> None:
    small: list[bytes | memoryview] = []
    for b in buffers:
        n = b.nbytes if isinstance(b, memoryview) else len(b)
        if n < _TLS_JOIN_BYTES:
            small.append(b)
            continue
        if small:
            sock.sendall(b"".join(small))
            small = []
        sock.sendall(b)
    if small:
        sock.sendall(b"".join(small))


def _advance(views: list[memoryview], i: int, sent: int) -> int:
    """Past ``sent`` bytes of ``views`` from index ``i`` (the view cut in the middle is trimmed in
    place; empty views skipped): the index of the first view with bytes left."""
    while sent:
        n = views[i].nbytes
        if sent >= n:
            sent -= n
            i += 1
        else:
            views[i] = views[i][sent:]
            sent = 0
    while i < len(views) and views[i].nbytes == 0:
        i += 1
    return i
