"""A small pool of persistent connections to one node's transfer port, for the data session.

Each exchange takes a connection (an idle one, else a new one) armed with the call's deadline
as its stall timeout, and gives it back once the stream is in sync again; a connection that
failed is closed, never reused.  An exchange whose reused connection turned out dead before the
node answered (the node closed it idle) is sent once more on a fresh one — never after a stall:
a hung node would only be waited for again.  A batch cut into parts runs them on several
connections at once (:meth:`StreamPool.parallel`).

Connections are TLS with ``tls``.  To a node whose data session is plaintext (the trusted-network
opt-out) each new connection first presents a one-use ticket (``ticket``: fetched over the TLS
control channel for every connection, :mod:`kvpool.core.tickets`), and frames carry no token.
"""

from __future__ import annotations

import base64
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpool.core import errors
from kvpool.transfer.stream import STALL_ERRORS, Stream, connect
from kvpool.transfer.tcp import parse_address
from kvpool.wire import store_frames as dp
from kvpool.wire.tls import TlsConfig


def split_parts(n: int, parts: int) -> list[range]:
    """Contiguous, nearly equal index ranges (at most ``parts``, none empty; none for n = 0)."""
    if n <= 0:
        return []
    parts = max(1, min(parts, n))
    step, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        end = start + step + (1 if p < extra else 0)
        out.append(range(start, end))
        start = end
    return out


class StreamPool:
    """Connections to one node's transfer port; thread-safe."""

    def __init__(self, address: str, token: str = "", timeout: float = 10.0, connections: int = 2,
                 max_idle: int = 8, tls: TlsConfig | None = None,
                 ticket: Callable[[float], bytes] | None = None) -> None:
        self.address = address
        self._addr = parse_address(address)
        self._tls = tls
        self._ticket = ticket
        self._token = b"" if ticket is not None else token.encode("utf-8")
        self.timeout = timeout
        self.connections = max(1, connections)
        self._max_idle = max_idle
        self._idle: list[Stream] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self.incarnation = 0
        """The node's incarnation as its last HELLO told (:meth:`hello`)."""
        self._pool = ThreadPoolExecutor(max_workers=self.connections - 1,
                                        thread_name_prefix="kvpool-data") if self.connections > 1 else None

    # -- connections -----------------------------------------------------------------------

    def _take(self, timeout: float | None = None) -> tuple[Stream, bool]:
        """A connection (an idle one, else a new one), armed with ``timeout`` (default: the
        session's) as its stall timeout."""
        seconds = timeout or self.timeout
        with self._lock:
            if self._closed:
                raise errors.Unavailable("data session closed")
            stream = self._idle.pop() if self._idle else None
        if stream is not None:
            try:
                stream.set_timeout(seconds)
            except OSError:
                stream.close()
                stream = None
            else:
                return stream, True
        return self._open(seconds), False

    def _open(self, seconds: float) -> Stream:
        """A new connection (a TLS client, or bound by a ticket to a plaintext session)."""
        try:
            stream = connect(self._addr, seconds, self._tls)
        except STALL_ERRORS:
            raise errors.DeadlineExceeded(f"data session to {self.address}: connect timed out") from None
        except OSError as exc:
            raise errors.Unavailable(f"data session to {self.address}: {exc}") from None
        if self._ticket is not None:
            try:
                self._present_ticket(stream, self._ticket(seconds))
            except BaseException as exc:
                stream.close()
                if isinstance(exc, (OSError, dp.ProtocolError)):
                    raise self._failure(exc) from None
                raise
        return stream

    def open_idle(self, timeout: float) -> int:
        """Open connections until :attr:`connections` are idle (a batch's parts then find theirs
        ready: over TLS a connection opened inside a call's deadline spends part of it on the
        handshake); how many were opened.  A failure stops it quietly (the calls will see)."""
        with self._lock:
            want = self.connections - len(self._idle)
        opened = []
        try:
            for _ in range(max(0, want)):
                opened.append(self._open(timeout))
        except errors.KvpoolError:
            pass
        for stream in opened:
            self._give(stream)
        return len(opened)

    def _present_ticket(self, stream: Stream, ticket: bytes) -> None:
        """Bind a new plaintext connection to this session's tenant (raises the node's refusal)."""
        stream.send([*dp.encode_request(dp.OP_HELLO, 0, base64.b64encode(ticket), b"", flags=dp.FLAG_TICKET)])
        head = bytearray(dp.RESPONSE_SIZE)
        stream.recv_exact(head)
        resp = dp.decode_response(head)
        msg = bytearray(resp.msg_len)
        if msg:
            stream.recv_exact(msg)
        if resp.status != errors.SESSION_OK:
            raise errors.from_session_status(resp.status, msg.decode("utf-8", "replace"))

    def _failure(self, exc: BaseException) -> errors.KvpoolError:
        """The error a broken exchange raises: a stall is a missed deadline."""
        what = f"data session to {self.address}: {type(exc).__name__}: {exc}"
        if isinstance(exc, STALL_ERRORS):
            return errors.DeadlineExceeded(what)
        return errors.Unavailable(what)

    def _give(self, stream: Stream) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(stream)
                return
        stream.close()

    def _call(self, fn: Callable[[Stream, int], Any], timeout: float | None = None) -> Any:
        """Run one exchange on a pooled connection (``timeout``: its stall timeout); once more on
        a fresh one if a reused connection turned out dead before the node answered (it may have
        closed it idle) — never after a stall: that node is hung, asking again waits again."""
        for attempt in (0, 1):
            stream, reused = self._take(timeout)
            mark = stream.received
            try:
                result = fn(stream, next(self._ids) & 0xFFFFFFFF)
            except errors.KvpoolError:
                self._give(stream)  # an error status: the stream is in sync
                raise
            except (OSError, dp.ProtocolError) as exc:
                stream.close()
                if (attempt == 0 and reused and stream.received == mark and isinstance(exc, OSError)
                        and not isinstance(exc, STALL_ERRORS)):
                    continue
                raise self._failure(exc) from None
            except BaseException:
                stream.close()
                raise
            self._give(stream)
            return result
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _parallel(self, parts: list[range], fn: Callable[[range], None]) -> None:
        """``fn`` over the parts: the first on this thread, the others on the pool's; the first
        failure is raised once every part has stopped (none still writes a caller's buffer)."""
        if len(parts) <= 1 or self._pool is None:
            for p in parts:
                fn(p)
            return
        futs = [self._pool.submit(fn, p) for p in parts[1:]]
        failures: list[BaseException] = []
        try:
            fn(parts[0])
        except BaseException as exc:
            failures.append(exc)
        for f in futs:
            try:
                f.result()
            except BaseException as exc:
                failures.append(exc)
        if failures:
            raise failures[0]
