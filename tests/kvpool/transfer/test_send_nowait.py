"""Stream.send_nowait: what the kernel takes now, the rest left for a blocking send (the
sidecar starts an EXISTS at every node this way, so a node slow to read its request holds
back no other node's)."""

from __future__ import annotations

import socket
import threading

from kvpool.transfer import _sockio
from kvpool.transfer.stream import Stream


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    _sockio.set_stall_timeout(a, 5.0)
    _sockio.set_stall_timeout(b, 5.0)
    return a, b


def test_send_nowait_returns_the_rest_without_blocking_and_send_finishes_in_order() -> None:
    a, b = _pair()
    try:
        head, body = b"H" * 16, bytes(range(256)) * 4096  # 1 MiB: far over both buffers
        rest = Stream(a).send_nowait([head, memoryview(body)])  # the peer reads nothing yet
        left = sum(v.nbytes for v in rest)
        assert 0 < left < len(head) + len(body)
        got = bytearray(len(head) + len(body))
        reader = threading.Thread(target=_sockio.recv_exact, args=(b, memoryview(got)))
        reader.start()
        Stream(a).send(rest)
        reader.join(10)
        assert not reader.is_alive()
        assert bytes(got) == head + body
    finally:
        a.close()
        b.close()


def test_send_nowait_of_what_fits_leaves_nothing() -> None:
    a, b = _pair()
    try:
        assert Stream(a).send_nowait([b"abc", b"", memoryview(b"defg")]) == []
        got = bytearray(7)
        _sockio.recv_exact(b, memoryview(got))
        assert bytes(got) == b"abcdefg"
    finally:
        a.close()
        b.close()
