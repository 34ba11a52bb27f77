"""send_buffers: every byte in order, whatever the kernel takes per sendmsg call."""

from __future__ import annotations

import random
import socket
import threading
from typing import Any

import pytest

from kvpool.transfer import _sockio


class ShortSocket:
    """A socket stand-in whose sendmsg takes at most ``limit`` bytes per call."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.out = bytearray()
        self.calls = 0

    def sendmsg(self, buffers: Any) -> int:
        assert len(buffers) <= _sockio.MAX_IOV
        self.calls += 1
        data = b"".join(bytes(b) for b in buffers)[:self.limit]
        self.out += data
        return len(data)


@pytest.mark.parametrize("limit", [1, 7, 4096, 1 << 30])
def test_partial_sends_resume_in_order(limit: int) -> None:
    rng = random.Random(limit)
    bufs: list[bytes | memoryview] = []
    for k in range(40):
        raw = rng.randbytes(rng.choice([0, 1, 3, 100, 5000]))
        bufs.append(memoryview(raw) if k % 2 else raw)
    sock = ShortSocket(limit)
    _sockio.send_buffers(sock, bufs)  # type: ignore[arg-type]
    assert bytes(sock.out) == b"".join(bytes(b) for b in bufs)
    if limit == 1 << 30:
        assert sock.calls == 1  # the whole frame in one call


def test_more_buffers_than_one_call_takes() -> None:
    bufs = [bytes([k % 251]) * 3 for k in range(_sockio.MAX_IOV * 2 + 5)] + [b""]
    sock = ShortSocket(1 << 30)
    _sockio.send_buffers(sock, bufs)  # type: ignore[arg-type]
    assert bytes(sock.out) == b"".join(bufs) and sock.calls == 3


def test_over_a_real_socket_with_a_small_send_buffer() -> None:
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        payload = [random.Random(1).randbytes(300_000), b"", memoryview(b"tail" * 1000)]
        want = b"".join(bytes(p) for p in payload)
        got = bytearray()

        def reader() -> None:
            while len(got) < len(want):
                chunk = b.recv(65536)
                if not chunk:
                    return
                got.extend(chunk)
        t = threading.Thread(target=reader)
        t.start()
        _sockio.send_buffers(a, payload)
        t.join(timeout=10)
        assert not t.is_alive() and bytes(got) == want
    finally:
        a.close()
        b.close()
