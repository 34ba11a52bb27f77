"""Test helpers for code that uses the transfer engine (kept in the package so store and
sidecar tests can use them too): a recording :class:`Guard`, a server+engine pair, a TCP proxy
that cuts connections mid-stream, a hand-driven raw connection for frame-level tests, and a
simulated RDMA device (one-sided copies by address,
rkey and bounds checked like a NIC) so the RDMA path runs on hosts without one.

Nothing here is used on the data path.
"""

from __future__ import annotations

import ctypes
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.rdma import RdmaSegmentKey, WorkRequestPlan, buffer_address
from kvpool.transfer.segment import Guard, Op, Segment, SegmentRegistry
from kvpool.transfer.server import TransferServer
from kvpool.transfer.status import TransferCode, TransferStatus
from kvpool.wire.tls import TlsConfig


def random_bytes(n: int, seed: int) -> npt.NDArray[np.uint8]:
    """``n`` reproducible pseudo-random bytes."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def tcp_socket(address: str, timeout: float = 10.0, tls: TlsConfig | None = None) -> socket.socket:
    """A connected TCP socket to ``host:port`` (a TLS client of it with ``tls``)."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    if tls is None:
        return sock
    try:
        return tls.wrap_client(sock, host)
    except BaseException:
        sock.close()
        raise


def unix_socket(path: str, timeout: float = 10.0) -> socket.socket:
    """A connected unix stream socket to ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(path)
    return sock


class RawConnection:
    """A blocking socket driven by hand, for tests that send frames (good or malformed) and read
    exact answers: ``send`` writes everything, ``recv`` reads exactly ``n`` bytes or raises."""

    def __init__(self, sock: socket.socket, timeout: float = 10.0) -> None:
        self.sock = sock
        self.sock.settimeout(timeout)
        self.rid = 0

    def send(self, frame: list[bytes] | bytes) -> None:
        self.sock.sendall(frame if isinstance(frame, bytes) else b"".join(frame))

    def recv(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError(f"closed after {len(data)} of {n} bytes")
            data += chunk
        return bytes(data)

    def closed_by_peer(self) -> bool:
        """Read until the peer closes (True), a reset counting as closed; a peer that never
        closes fails the test with the socket's timeout."""
        try:
            while self.sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()


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
    """A transfer server plus an engine that reaches its segments over ``kind``: "tcp", "shm",
    "rdma-sim" (the simulated device; the caller makes :func:`rdma_status` report it) or "rdma"
    (the host's first device, looped back). Segments not attached otherwise go over TCP."""

    kind: str
    registry: SegmentRegistry
    server: TransferServer
    engine: TransferEngine
    segments: list[Segment] = field(default_factory=list)
    rdma: Any = None  # SimulatedRdmaContext or RdmaContext
    queue_pair: Any = None
    _responder: Any = None  # the serving side of a real loopback queue pair

    @property
    def address(self) -> str:
        return self.server.address

    def segment(self, name: str, size: int, guard: Guard | None = None) -> Segment:
        if self.kind in ("rdma-sim", "rdma"):
            seg = Segment.anonymous(name, size)
            self.registry.register(seg, guard)
            if self.rdma is None:
                self._open_rdma()
            self.engine.attach_rdma(self.address, self.queue_pair, [self.rdma.register(name, seg.view)])
        elif self.kind == "shm":
            seg = Segment.shared(name, size)
            assert seg.path is not None
            self.registry.register(seg, guard)
            self.engine.attach_shared(self.address, name, seg.path)
        else:
            seg = Segment.anonymous(name, size)
            self.registry.register(seg, guard)
        self.segments.append(seg)
        return seg

    def _open_rdma(self) -> None:
        if self.kind == "rdma-sim":
            self.rdma = SimulatedRdmaContext()
            self.queue_pair = self.rdma.create_queue_pair()
            return
        from kvpool.transfer.rdma import RdmaContext

        self.rdma = RdmaContext()
        self.queue_pair = self.rdma.create_queue_pair()
        self._responder = self.rdma.create_queue_pair()
        self.queue_pair.connect(self._responder.endpoint)
        self._responder.connect(self.queue_pair.endpoint)

    def close(self) -> None:
        self.engine.close()  # closes the attached queue pair
        self.server.stop()
        if self._responder is not None:
            self._responder.close()
        if self.kind == "rdma" and self.rdma is not None:
            self.rdma.close()
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


class _Region:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class SimulatedRdmaContext:
    """Stands in for :class:`~kvpool.transfer.rdma.RdmaContext`: tracks registered regions."""

    def __init__(self) -> None:
        self.regions: list[tuple[int, int, int]] = []  # (start, end, key)
        self.temporary: list[_Region] = []

    def register(self, name: str, view: memoryview) -> RdmaSegmentKey:
        addr = buffer_address(view)
        key = len(self.regions) + 1
        self.regions.append((addr, addr + view.nbytes, key))
        return RdmaSegmentKey(name, addr, view.nbytes, key)

    def lkey_for(self, addr: int, length: int) -> int | None:
        for start, end, key in self.regions:
            if start <= addr and addr + length <= end:
                return key
        return None

    def register_temporary(self, addr: int, length: int) -> tuple[int, _Region]:
        region = _Region()
        self.temporary.append(region)
        self.regions.append((addr, addr + length, 10_000 + len(self.temporary)))
        return self.regions[-1][2], region

    def create_queue_pair(self) -> SimulatedQueuePair:
        return SimulatedQueuePair(self)


class SimulatedQueuePair:
    """One-sided READ/WRITE by ``memmove``, checking keys and bounds the way a NIC would
    (a violation completes with an error, like IBV_WC_REM_ACCESS_ERR). ``fail_wr`` injects
    completion errors for chosen work-request ids."""

    def __init__(self, context: SimulatedRdmaContext, fail_wr: set[int] | None = None) -> None:
        self.context = context
        self.fail_wr = fail_wr or set()
        self.posted: list[WorkRequestPlan] = []
        self.closed = False

    def _allowed(self, addr: int, length: int, key: int) -> bool:
        return any(k == key and s <= addr and addr + length <= e for s, e, k in self.context.regions)

    def execute(
        self, plans: list[WorkRequestPlan], lkeys: dict[int, int], stall_timeout: float
    ) -> dict[int, TransferStatus]:
        errors: dict[int, TransferStatus] = {}
        for p in plans:
            self.posted.append(p)
            if p.wr_id in self.fail_wr:
                errors.setdefault(p.index, TransferStatus(TransferCode.CONNECTION, "injected completion error"))
                continue
            if not self._allowed(p.local_addr, p.length, lkeys[p.wr_id]) or not self._allowed(
                p.remote_addr, p.length, p.rkey
            ):
                errors.setdefault(p.index, TransferStatus(TransferCode.CONNECTION, "remote access error"))
                continue
            dst, src = (p.local_addr, p.remote_addr) if p.is_read else (p.remote_addr, p.local_addr)
            ctypes.memmove(dst, src, p.length)
        return errors

    def close(self) -> None:
        self.closed = True
