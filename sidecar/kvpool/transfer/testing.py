"""Test helpers for code that uses the transfer engine (kept in the package so store and
sidecar tests can use them too): a recording :class:`Guard`, a server+engine pair, and a TCP
proxy that cuts connections mid-stream.

Nothing here is used on the data path.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.segment import Guard, Op, Segment, SegmentRegistry
from kvpool.transfer.server import TransferServer


def random_bytes(n: int, seed: int) -> npt.NDArray[np.uint8]:
    """``n`` reproducible pseudo-random bytes."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@dataclass
class RecordingGuard:
    """Refuses tokens in ``refuse``; records every acquire and release."""

    refuse: set[int] = field(default_factory=set)
    acquired: list[tuple[Op, int, int, int, str]] = field(default_factory=list)
    released: list[object] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def acquire(self, op: Op, offset: int, length: int, token: int) -> object | None:
        with self.lock:
            self.acquired.append((op, offset, length, token, threading.current_thread().name))
        if token in self.refuse:
            return None
        return (op, offset, length)

    def release(self, handle: object) -> None:
        with self.lock:
            self.released.append(handle)


@dataclass
class Remote:
    """A transfer server plus an engine that talks to it over ``kind`` ("tcp" or "shm")."""

    kind: str
    registry: SegmentRegistry
    server: TransferServer
    engine: TransferEngine
    segments: list[Segment] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.server.address

    def segment(self, name: str, size: int, guard: Guard | None = None) -> Segment:
        if self.kind == "shm":
            seg = Segment.shared(name, size)
            assert seg.path is not None
            self.registry.register(seg, guard)
            self.engine.attach_shared(self.address, name, seg.path)
        else:
            seg = Segment.anonymous(name, size)
            self.registry.register(seg, guard)
        self.segments.append(seg)
        return seg

    def close(self) -> None:
        self.engine.close()
        self.server.stop()
        for seg in self.segments:
            seg.close()


class CuttingProxy:
    """TCP proxy to ``upstream`` that cuts connection number i once ``cut(i)`` bytes flowed in
    either direction (``None``: never). Closing both ends mimics a reset peer mid-payload."""

    def __init__(self, upstream: str, cut: Callable[[int], int | None]) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.cut = cut
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.accepted = 0
        self.cuts = 0
        self.sockets: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.stopping = False
        self.lock = threading.Lock()
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self.threads.append(thread)

    @property
    def address(self) -> str:
        host, port = self.listener.getsockname()[:2]
        return f"{host}:{port}"

    def _accept(self) -> None:
        while not self.stopping:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            with self.lock:
                index = self.accepted
                self.accepted += 1
                self.sockets += [down, up]
            limit = self.cut(index)
            for src, dst, lim in ((down, up, limit), (up, down, limit)):
                t = threading.Thread(target=self._pump, args=(src, dst, lim, down, up), daemon=True)
                t.start()
                self.threads.append(t)

    def _pump(
        self, src: socket.socket, dst: socket.socket, limit: int | None, a: socket.socket, b: socket.socket
    ) -> None:
        moved = 0
        buf = bytearray(65536)
        view = memoryview(buf)
        try:
            while True:
                want = len(buf) if limit is None else min(len(buf), limit - moved)
                if want <= 0:
                    with self.lock:
                        self.cuts += 1
                    break
                n = src.recv_into(view, want)
                if n == 0:
                    break
                dst.sendall(view[:n])
                moved += n
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.stopping = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        with self.lock:
            sockets = list(self.sockets)
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self.threads:
            t.join(5)
        for s in sockets:
            s.close()


#: Signature of the ``make_remote`` fixture: ``make_remote(kind, **engine_args)``.
MakeRemote = Callable[..., Remote]
#: Signature of the ``proxy`` fixture: ``proxy(upstream_address, cut)``.
MakeProxy = Callable[[str, Callable[[int], "int | None"]], CuttingProxy]
