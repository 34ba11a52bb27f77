"""TCP transport: K persistent connections per peer, each driven by its own worker thread.

Workers take slices from one shared per-peer queue (reads before writes), so a slow connection
simply takes fewer and large requests spread over all streams. Each worker pipelines: it keeps
up to ``max_inflight`` slices / ``window_bytes`` bytes outstanding and matches the in-order
responses. It never starts sending a write payload while read responses are still due on its
connection: both sides would otherwise block in ``sendall`` with full socket buffers.

Failure policy: a connection error fails every slice outstanding on that connection; each goes
back to the front of the queue and is retried once — on whichever connection takes it first, a
freshly opened one if that is the failed worker's own — and fails with ``CONNECTION`` the second
time. A retried slice is re-sent whole, so partial bytes of the first attempt are overwritten. A stall (no progress for
``stall_timeout``) fails the outstanding slices *and* the slices still queued for that peer with
``TIMEOUT`` — retrying into a stalled peer would multiply the wait.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
from dataclasses import dataclass

from kvpool.transfer import _sockio
from kvpool.transfer.batch import BatchHandle, Slice
from kvpool.transfer.plan import TransferRequest, slice_size, split
from kvpool.transfer.protocol import (
    OP_READ,
    OP_WRITE,
    RESPONSE_SIZE,
    ProtocolError,
    decode_response,
    encode_request,
)
from kvpool.transfer.status import STATUS_OK, TransferCode, TransferStatus
from kvpool.wire.tls import TlsConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TcpSettings:
    """Tuning of the TCP transport (see :class:`~kvpool.transfer.TransferEngine`)."""

    connections: int = 2
    """Persistent connections (and worker threads) per peer."""
    slice_bytes: int = 1 << 20
    """Largest piece a request is cut into; pieces spread over the connections."""
    min_slice_bytes: int = 64 << 10
    """Smallest piece worth its own round trip when a small batch is spread over connections."""
    stall_timeout: float = 10.0
    """Seconds without progress on a connection before its slices fail with TIMEOUT."""
    max_inflight: int = 64
    """Slices outstanding per connection (pipelining depth for small requests)."""
    window_bytes: int = 4 << 20
    """Payload bytes outstanding per connection; a slice larger than this still goes alone."""
    read_burst: int = 32
    """Reads a connection sends ahead of a waiting write before it lets the write through."""
    tls: TlsConfig | None = None
    """TLS client configuration of every connection (None: plain TCP)."""


def parse_address(peer: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` → ``(host, port)``; raises ``ValueError``."""
    host, sep, port = peer.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"peer address must be host:port, not {peer!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    value = int(port)
    if not 0 < value < 65536:
        raise ValueError(f"bad port in {peer!r}")
    return host, value


class TcpPeer:
    """TCP transport to one remote transfer server: its queue and connection workers."""

    inline = False

    def __init__(self, address: str, settings: TcpSettings) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self.settings = settings
        self.cond = threading.Condition()
        self.reads: collections.deque[Slice] = collections.deque()
        self.writes: collections.deque[Slice] = collections.deque()
        self.closed = False
        self.workers = [_Worker(self, i) for i in range(settings.connections)]
        for worker in self.workers:
            worker.start()

    def handles(self, segment: str) -> bool:
        return True  # the fallback: the server answers NO_SEGMENT for what it does not have

    def submit(self, handle: BatchHandle, items: list[tuple[int, TransferRequest]]) -> None:
        """Cut the requests into slices (see :func:`~kvpool.transfer.plan.plan_slices`), register
        them with ``handle``, queue them. Inlined here: it runs for every batch."""
        settings = self.settings
        size = slice_size(sum(req.length for _, req in items), settings.connections, settings.slice_bytes,
                          settings.min_slice_bytes)  # fmt: skip
        names: dict[str, bytes] = {}
        slices: list[Slice] = []
        append = slices.append
        for index, req in items:
            name = names.get(req.remote_segment)
            if name is None:
                name = names[req.remote_segment] = req.remote_segment.encode("utf-8")
            is_read = req.op == "read"
            if req.length <= size:
                append(Slice(handle, index, is_read, req.local, name, req.remote_offset, req.length, req.token))
                handle._expect(index, 1)
                continue
            pieces = split(req.length, size)
            for start, n in pieces:
                append(
                    Slice(
                        handle, index, is_read, req.local[start : start + n], name, req.remote_offset + start, n,
                        req.token,
                    )
                )  # fmt: skip
            handle._expect(index, len(pieces))
        self.enqueue(slices)

    def enqueue(self, slices: list[Slice]) -> None:
        with self.cond:
            if self.closed:
                closed = True
            else:
                closed = False
                for s in slices:
                    (self.reads if s.is_read else self.writes).append(s)
                self.cond.notify_all()
        if closed:
            for s in slices:
                s.fail(TransferCode.CONNECTION, "transfer engine closed")

    def requeue(self, slices: list[Slice]) -> None:
        """Put retried slices at the front, in their original order."""
        with self.cond:
            if not self.closed:
                for s in reversed(slices):
                    (self.reads if s.is_read else self.writes).appendleft(s)
                self.cond.notify_all()
                return
        for s in slices:
            s.fail(TransferCode.CONNECTION, "transfer engine closed")

    def stats(self) -> collections.Counter[str]:
        """Counters of all workers of this peer (bytes, slices by outcome, retries, connects)."""
        total = collections.Counter[str]()
        for worker in self.workers:
            total.update(dict.copy(worker.stats))  # dict.copy is atomic under the GIL; iteration is not
        return total

    def drain_queued(self) -> list[Slice]:
        with self.cond:
            queued = list(self.reads) + list(self.writes)
            self.reads.clear()
            self.writes.clear()
        return queued

    def close(self, timeout: float = 5.0) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        for worker in self.workers:
            worker.interrupt()
        current = threading.current_thread()
        for worker in self.workers:
            if worker is not current:  # close() may run in a done-callback on a worker
                worker.join(timeout)
        for s in self.drain_queued():
            s.fail(TransferCode.CONNECTION, "transfer engine closed")


class _Worker(threading.Thread):
    def __init__(self, peer: TcpPeer, index: int) -> None:
        super().__init__(name=f"kvpool-transfer-{peer.address}-{index}", daemon=True)
        self.peer = peer
        self.sock: socket.socket | None = None
        self.inflight: collections.deque[Slice] = collections.deque()
        self.inflight_reads = 0
        self.inflight_bytes = 0
        self.reads_since_write = 0
        self.next_id = 1
        # Counters owned by this thread alone (no lock); summed at scrape time.
        self.stats = collections.Counter[str]()
        self.response = bytearray(RESPONSE_SIZE)
        self.response_view = memoryview(self.response)

    def interrupt(self) -> None:
        sock = self.sock
        if sock is not None:
            _sockio.shutdown(sock)  # from another thread: on the descriptor (see there)

    def run(self) -> None:
        try:
            while self._step():
                pass
        except Exception:  # a bug here must not leave batches hanging
            log.exception("transfer worker %s crashed", self.name)
            self._abort(TransferCode.CONNECTION, "transfer worker crashed", [])
        finally:
            self._disconnect()
            for s in self.inflight:
                s.fail(TransferCode.CONNECTION, "transfer engine closed")
            self.inflight.clear()

    # -- one iteration: take work, send it, receive one response ----------------------------

    def _step(self) -> bool:
        peer = self.peer
        settings = peer.settings
        take: list[Slice] = []
        with peer.cond:
            while not peer.closed and not self.inflight and not peer.reads and not peer.writes:
                peer.cond.wait()
            if peer.closed:
                return False
            count = len(self.inflight)
            window = self.inflight_bytes
            reads_due = self.inflight_reads
            while count < settings.max_inflight and (count == 0 or window < settings.window_bytes):
                # Reads first, but a waiting write gets its turn after a burst of reads, so a
                # steady read load cannot starve writes.
                if peer.reads and not (peer.writes and self.reads_since_write >= settings.read_burst):
                    s = peer.reads.popleft()
                    reads_due += 1
                    if peer.writes:
                        self.reads_since_write += 1
                elif peer.writes and reads_due == 0:
                    s = peer.writes.popleft()
                    self.reads_since_write = 0
                else:
                    break
                take.append(s)
                count += 1
                window += s.length
        if take and not self._send(take):
            return True
        if self.inflight:
            self._receive_one()
        return True

    def _connect(self) -> None:
        timeout = self.peer.settings.stall_timeout
        self.sock = _sockio.connect((self.peer.host, self.peer.port), timeout, self.peer.settings.tls)
        self.stats["connects"] += 1

    def _disconnect(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            _sockio.shutdown(sock)
            sock.close()

    def _send(self, take: list[Slice]) -> bool:
        """Send the requests of ``take`` (and write payloads) in as few ``sendmsg`` calls as the
        kernel allows; pipelined headers in one call instead of one syscall and segment each."""
        try:
            if self.sock is None:
                self._connect()
        except _sockio.STALL_ERRORS as exc:
            self._abort(TransferCode.TIMEOUT, f"connect to {self.peer.address} stalled: {exc}", take)
            return False
        except OSError as exc:
            self._abort(TransferCode.CONNECTION, f"connect to {self.peer.address}: {exc}", take)
            return False
        sock = self.sock
        assert sock is not None
        buffers: list[bytes | memoryview] = []
        for s in take:
            s.request_id = self.next_id
            self.next_id += 1
            buffers.append(
                encode_request(
                    OP_READ if s.is_read else OP_WRITE, s.request_id, s.segment, s.remote_offset, s.length, s.token
                )
            )
            if not s.is_read:
                buffers.append(s.local)
            # Outstanding before the bytes go out: a failure mid-send must settle it too.
            self._push(s)
        try:
            _sockio.send_buffers(sock, buffers)
        except _sockio.STALL_ERRORS as exc:
            self._abort(TransferCode.TIMEOUT, f"stalled sending to {self.peer.address}: {exc}", [])
            return False
        except OSError as exc:
            self._abort(TransferCode.CONNECTION, f"{self.peer.address}: {exc}", [])
            return False
        return True

    def _push(self, s: Slice) -> None:
        self.inflight.append(s)
        self.inflight_bytes += s.length
        if s.is_read:
            self.inflight_reads += 1

    def _pop(self) -> Slice:
        s = self.inflight.popleft()
        self.inflight_bytes -= s.length
        if s.is_read:
            self.inflight_reads -= 1
        return s

    def _receive_one(self) -> None:
        sock = self.sock
        assert sock is not None
        s = self.inflight[0]
        try:
            _sockio.recv_exact(sock, self.response_view)
            resp = decode_response(self.response)
            if resp.request_id != s.request_id:
                raise ProtocolError(f"response for request {resp.request_id}, expected {s.request_id}")
            message = ""
            if resp.msg_len:
                raw = bytearray(resp.msg_len)
                _sockio.recv_exact(sock, memoryview(raw))
                message = raw.decode("utf-8", "replace")
            if resp.code is TransferCode.OK and s.is_read:
                if resp.payload_len != s.length:
                    raise ProtocolError(f"read response carries {resp.payload_len} bytes, expected {s.length}")
                _sockio.recv_exact(sock, s.local)
            elif resp.payload_len:
                raise ProtocolError(f"unexpected payload of {resp.payload_len} bytes")
        except _sockio.STALL_ERRORS as exc:
            self._abort(TransferCode.TIMEOUT, f"stalled receiving from {self.peer.address}: {exc}", [])
            return
        except ProtocolError as exc:
            self._abort(TransferCode.PROTOCOL, f"{self.peer.address}: {exc}", [])
            return
        except OSError as exc:
            self._abort(TransferCode.CONNECTION, f"{self.peer.address}: {exc}", [])
            return
        self._pop()
        stats = self.stats
        if resp.code is TransferCode.OK:
            stats["bytes_read" if s.is_read else "bytes_written"] += s.length
            stats["slices_ok"] += 1
            s.complete(STATUS_OK)
        else:
            stats["slices_" + resp.code.name.lower()] += 1
            s.complete(TransferStatus(resp.code, message))

    def _abort(self, code: TransferCode, message: str, unsent: list[Slice]) -> None:
        """The connection is unusable: drop it and settle everything that was riding on it."""
        self._disconnect()
        failed = list(self.inflight) + unsent
        self.inflight.clear()
        self.inflight_bytes = 0
        self.inflight_reads = 0
        retry: list[Slice] = []
        for s in failed:
            if code is TransferCode.CONNECTION and s.attempts == 0 and not self.peer.closed:
                s.attempts += 1
                retry.append(s)
            else:
                s.fail(code, message)
                self.stats["slices_" + code.name.lower()] += 1
        self.stats["retries"] += len(retry)
        self.stats["connection_failures"] += 1
        if retry:
            self.peer.requeue(retry)
        if code is TransferCode.TIMEOUT:
            for s in self.peer.drain_queued():
                s.fail(code, f"peer {self.peer.address} stalled: {message}")
        log.debug("transfer connection %s: %s (%d retried)", self.name, message, len(retry))
