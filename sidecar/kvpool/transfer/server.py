"""TCP server side of the transfer engine: serves a :class:`SegmentRegistry` to peers.

One thread per connection; each handles a pipelined stream of requests in order. Payload is
``recv_into`` straight into the segment (write) or ``sendmsg`` straight from it (read).
A bad magic/version closes only that connection; every other problem is a per-request status,
and a write whose request is refused still has its payload consumed so the stream stays in sync
(unless its length exceeds ``max_request_bytes``, which is treated as a broken stream).

A connection whose first four bytes are the magic of a registered *session* (``sessions=``) is
handed to that session's handler for its whole life instead, as a :class:`~kvpool.transfer.stream.Stream`
(the store's one-round-trip data calls use this; see :mod:`kvpool.wire.store_frames`).

With ``tls`` every connection is a TLS server first (the handshake within ``io_timeout``), the
client's certificate required and verified against the pool's CA bundle; ``peer_check`` (the
peer's :class:`~kvpool.core.pki.Identity`) can refuse a verified peer before it sends a byte
(a handoff export serves only its tenant's sidecars).  A TLS connection cannot be peeked at, so
the session magic is read off every connection and handed to the session (or the transfer
loop) as its first bytes.
"""

from __future__ import annotations

import collections
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.transfer import _sockio
from kvpool.transfer.protocol import (
    OP_WRITE,
    REQUEST_SIZE,
    ProtocolError,
    RequestHeader,
    check_bounds,
    decode_request,
    encode_response,
)
from kvpool.transfer.segment import Guard, Op, SegmentRegistry
from kvpool.transfer.status import TransferCode
from kvpool.transfer.stream import Stream
from kvpool.wire.frames import MAGIC_BYTES
from kvpool.wire.tls import TlsConfig, peer_identity

if TYPE_CHECKING:
    from kvpool.core.pki import Identity

SessionHandler = Callable[[Stream, threading.Event], None]
"""Serves one session connection until it ends (returns, or raises ``ProtocolError`` /
``OSError``); the event is set when the server stops (handlers check it between frames)."""

log = logging.getLogger(__name__)

_DISCARD_BYTES = 256 * 1024


class TransferServer:
    """Serves the segments of ``registry`` over TCP.

    ``io_timeout`` bounds how long a peer may stall *inside* a request (a half-sent header or
    payload, an unread response) before its connection is dropped — so a stalled peer cannot pin
    a guarded slot forever. Idle connections between requests are kept indefinitely, and so is
    one whose first four bytes (the magic that picks its protocol) are not all there yet: nothing
    is held for it.
    ``max_connections`` caps open connections (one thread each); beyond it new ones are closed at
    once. ``max_request_bytes`` is the largest refused write whose payload is still drained to
    keep the stream usable; a longer one means a broken or hostile peer and closes the connection.
    """

    def __init__(
        self,
        registry: SegmentRegistry,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        io_timeout: float = 30.0,
        max_connections: int = 1024,
        max_request_bytes: int = 1 << 30,
        sessions: Mapping[bytes, SessionHandler] | None = None,
        tls: TlsConfig | None = None,
        peer_check: Callable[[Identity | None], bool] | None = None,
    ) -> None:
        self.registry = registry
        self._tls = tls
        self._peer_check = peer_check
        self._host = host
        self._port = port
        self._io_timeout = io_timeout
        self._max_connections = max_connections
        self._max_request_bytes = max_request_bytes
        self._sessions = dict(sessions or {})
        if any(len(m) != 4 for m in self._sessions):
            raise ValueError("session magics are 4 bytes")
        self._listener: socket.socket | None = None
        self._address: str | None = None
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._stopping = threading.Event()
        self._stats_lock = threading.Lock()
        self._stats: collections.Counter[str] = collections.Counter()  # of closed connections
        self._live: dict[socket.socket, collections.Counter[str]] = {}  # written by their threads only

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> TransferServer:
        if self._listener is not None:
            raise RuntimeError("server already started")
        listener = socket.create_server((self._host, self._port), backlog=128, reuse_port=False)
        self._listener = listener
        host, port = listener.getsockname()[:2]
        self._address = f"{host}:{port}"
        self._stopping.clear()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"kvpool-transfer-accept-{self.address}", daemon=True
        )
        self._accept_thread.start()
        return self

    @property
    def address(self) -> str:
        """``host:port`` bound (kept after :meth:`stop`); with a wildcard host, advertise the
        pod's own address to peers instead."""
        if self._address is None:
            raise RuntimeError("server not started")
        return self._address

    @property
    def connection_count(self) -> int:
        with self._lock:
            return len(self._connections)

    def stats(self) -> dict[str, int]:
        """Counters: ``connections`` (open now), ``accepted``, ``refused_connections``,
        ``protocol_errors``, ``requests_ok``, ``requests_<error>``, ``bytes_sent``, ``bytes_received``."""
        with self._lock:
            live = list(self._live.values())
        with self._stats_lock:
            total = collections.Counter(self._stats)
        for counts in live:
            total.update(dict.copy(counts))  # dict.copy is atomic under the GIL; iteration is not
        result = dict(total)
        result["connections"] = len(live)
        return result

    def _count(self, counts: collections.Counter[str]) -> None:
        with self._stats_lock:
            self._stats.update(counts)

    def drop_connections(self) -> int:
        """Cut every open connection (peers reconnect and retry on their own); returns how many.

        For a node that must stop serving in-flight transfers at once (e.g. before remapping a
        segment) and for fault injection in tests.
        """
        with self._lock:
            sockets = list(self._connections)
        for sock in sockets:
            _sockio.shutdown(sock)
        return len(sockets)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, cut every connection, and join the threads."""
        self._stopping.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            # shutdown() wakes the thread blocked in accept() on Linux; close() alone may not.
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout)
            self._accept_thread = None
        with self._lock:
            connections = list(self._connections.items())
        for sock, _ in connections:
            _sockio.shutdown(sock)
        for _, thread in connections:
            thread.join(timeout)

    def __enter__(self) -> TransferServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- connection handling -----------------------------------------------------------------

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                sock, peer = listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                # e.g. EMFILE or ECONNABORTED: keep serving the others, without spinning
                time.sleep(0.05)
                continue
            with self._lock:
                too_many = len(self._connections) >= self._max_connections
                if not too_many:
                    thread = threading.Thread(
                        target=self._serve, args=(sock,), name=f"kvpool-transfer-conn-{peer}", daemon=True
                    )
                    self._connections[sock] = thread
            self._count(collections.Counter(refused_connections=1) if too_many else collections.Counter(accepted=1))
            if too_many:
                log.warning(
                    "transfer server %s: refusing %s, %d connections open", self.address, peer, self._max_connections
                )
                sock.close()
                continue
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        # Per-connection counters: only this thread writes them (no lock on the hot path);
        # stats() reads them, and they are folded into the totals when the connection ends.
        counts: collections.Counter[str] = collections.Counter()
        with self._lock:
            self._live[sock] = counts
        try:
            _sockio.tune(sock)
            if self._tls is None:
                conn = self._plain(sock)
            else:
                tls = self._tls_socket(sock, counts)
                if tls is None:
                    return
                sock = conn = tls  # it took the descriptor over (the plain one is detached)
                if not self._handshake(tls, counts):
                    return
            head = b""
            handler = None
            if self._sessions:
                handler, head = self._session_for(conn)
            if handler is not None:
                counts["sessions"] += 1
                handler(Stream(conn, head), self._stopping)
            else:
                self._serve_stream(conn, counts, head)
        except (ConnectionError, TimeoutError, OSError) as exc:
            if not self._stopping.is_set():
                log.debug("transfer connection closed: %s", exc)
        except ProtocolError as exc:
            counts["protocol_errors"] += 1
            log.info("transfer connection dropped: %s", exc)
        except Exception:  # never let one peer take the server down
            log.exception("transfer connection failed")
        finally:
            with self._lock:
                self._connections.pop(sock, None)
                self._live.pop(sock, None)
            self._count(counts)
            _sockio.shutdown(sock)
            sock.close()

    def _rekey(self, old: socket.socket, new: socket.socket) -> None:
        """``new`` (a TLS socket over ``old``'s descriptor) is the connection from now on: what
        :meth:`drop_connections` and :meth:`stop` shut down (the detached ``old`` shuts nothing)."""
        with self._lock:
            self._connections[new] = self._connections.pop(old)
            self._live[new] = self._live.pop(old)

    def _plain(self, sock: socket.socket) -> socket.socket:
        _sockio.set_stall_timeout(sock, self._io_timeout)
        return sock

    def _tls_socket(self, sock: socket.socket, counts: collections.Counter[str]) -> ssl.SSLSocket | None:
        """``sock`` as the server side of a TLS connection, its handshake still to do (None:
        refused, counted and logged); it takes ``sock``'s place (:meth:`_rekey`)."""
        assert self._tls is not None
        sock.settimeout(self._io_timeout)  # the handshake's deadline (a Python one: see _sockio)
        try:
            conn = self._tls.server_context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:
            counts["tls_refused"] += 1
            log.info("transfer server %s: TLS refused: %s", self.address, exc)
            return None
        self._rekey(sock, conn)
        return conn

    def _handshake(self, conn: ssl.SSLSocket, counts: collections.Counter[str]) -> bool:
        """The TLS handshake of ``conn`` and the peer check (False: refused, counted and logged;
        :meth:`_serve` closes it)."""
        try:
            conn.do_handshake()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError: no or a bad certificate
            counts["tls_refused"] += 1
            log.info("transfer server %s: TLS handshake refused: %s", self.address, exc)
            return False
        if self._peer_check is not None:
            peer = peer_identity(conn)
            if not self._peer_check(peer):
                counts["peers_refused"] += 1
                log.info("transfer server %s: peer %s refused", self.address, peer)
                return False
        _sockio.set_stall_timeout(conn, self._io_timeout)
        return True

    def _session_for(self, sock: socket.socket) -> tuple[SessionHandler | None, bytes]:
        """The first bytes of a connection: a registered session's magic, or the transfer
        protocol (``None``; it validates its own magic).  Read off the connection (a TLS one
        cannot be peeked at; a plain one the same way, so both keep what came) and returned, for
        the reader of the stream to see first.  A client slow or idle before its first frame is
        waited for as between requests, and the bytes of the magic that came before a stall are
        kept: starting over lost them, and the rest was misread as another protocol."""
        buf = bytearray(MAGIC_BYTES)
        view = memoryview(buf)
        got = 0
        while got < MAGIC_BYTES and not self._stopping.is_set():
            try:
                n = sock.recv_into(view[got:])
            except _sockio.STALL_ERRORS:
                continue  # re-check the stop flag; what came stays in buf
            if n == 0:
                break  # EOF (after a short stream, the transfer loop's read ends it)
            got += n
        head = bytes(buf[:got])
        return (self._sessions.get(head) if got == MAGIC_BYTES else None), head

    def _serve_stream(self, sock: socket.socket, counts: collections.Counter[str], head: bytes = b"") -> None:
        header = bytearray(REQUEST_SIZE)
        header_view = memoryview(header)
        scratch: memoryview | None = None
        while not self._stopping.is_set():
            try:
                if head:  # the connection's first bytes, read while looking for a session
                    header_view[:len(head)] = head
                    got, head = len(head), b""
                else:
                    got = sock.recv_into(header_view)
            except _sockio.STALL_ERRORS:
                continue  # idle between requests is fine; re-check the stop flag
            if got == 0:
                return  # clean EOF between requests
            if got < REQUEST_SIZE:
                _sockio.recv_exact(sock, header_view[got:])
            req = decode_request(header)
            admitted = self._admit(req)

            if isinstance(admitted, _Refusal):
                if req.op == OP_WRITE:
                    # the payload is already on its way: consume it to keep the stream in sync
                    if req.length > self._max_request_bytes:
                        raise ProtocolError(f"write of {req.length} bytes exceeds the request limit")
                    if scratch is None:
                        scratch = memoryview(bytearray(_DISCARD_BYTES))
                    _sockio.discard(sock, req.length, scratch)
                counts["requests_" + admitted.code.name.lower()] += 1  # before the peer can see it
                sock.sendall(encode_response(admitted.code, req.request_id, 0, admitted.message))
                continue

            target, guard, handle = admitted
            try:
                if req.op == OP_WRITE:
                    _sockio.recv_exact(sock, target)
                    counts["bytes_received"] += req.length
                else:
                    counts["bytes_sent"] += req.length  # counted as it starts: the peer may be faster
                    _sockio.send_all(sock, encode_response(TransferCode.OK, req.request_id, req.length), target)
            finally:
                target.release()
                if guard is not None:
                    _release(guard, handle)
            counts["requests_ok"] += 1
            if req.op == OP_WRITE:
                # Acknowledged only after the guard is released: a writer that sees OK and commits
                # never finds its slot still held by this transfer.
                sock.sendall(encode_response(TransferCode.OK, req.request_id))

    def _admit(self, req: RequestHeader) -> tuple[memoryview, Guard | None, object | None] | _Refusal:
        """Resolve the segment, check bounds, ask the guard: the target bytes or why not."""
        entry = self.registry.lookup(req.segment)
        if entry is None:
            return _Refusal(TransferCode.NO_SEGMENT, f"no segment {req.segment!r}")
        segment, guard = entry
        try:
            view = segment.view
        except ValueError:
            return _Refusal(TransferCode.NO_SEGMENT, f"segment {req.segment!r} is closed")
        why = check_bounds(req.offset, req.length, view.nbytes)
        if why is not None:
            return _Refusal(TransferCode.OUT_OF_BOUNDS, why)
        handle: object | None = None
        if guard is not None:
            op: Op = "write" if req.op == OP_WRITE else "read"
            try:
                handle = guard.acquire(op, req.offset, req.length, req.token)
            except Exception as exc:  # a broken guard refuses; it does not kill the stream
                log.exception("guard of segment %r raised", req.segment)
                return _Refusal(TransferCode.LEASE_INVALID, f"guard error: {exc}")
            if handle is None:
                return _Refusal(TransferCode.LEASE_INVALID, "guard refused the request")
        return view[req.offset : req.offset + req.length], guard, handle


@dataclass(frozen=True, slots=True)
class _Refusal:
    code: TransferCode
    message: str


def _release(guard: Guard, handle: object | None) -> None:
    try:
        guard.release(handle)
    except Exception:
        log.exception("guard release raised")

