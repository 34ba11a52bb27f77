"""Client side of the sidecar fast session (:mod:`kvpool.wire.sidecar_frames`): the one wire of
the hot calls (match, read, read into registered memory, write, write from it, release).

:class:`FastSession` keeps a few unix-socket connections to the sidecar's ``<socket>.fast``
(one per thread calling at the same time, at most ``max_connections``; more callers wait for
one), each greeted with the tenant the client expects.  Every call is one frame out and one
frame in; a release after a finished copy is one frame out and none in.  A connection that
breaks or sends a frame that does not parse is closed and the call raises
:class:`~kvpool.core.errors.Unavailable` (the next call opens another connection).  Every call has a
bound (``timeout``, per call or the session's): one that passes it raises
:class:`~kvpool.core.errors.DeadlineExceeded` and its connection is closed (a late answer would put the
stream out of step); the next call opens another, greeted within the same bound.

Sidecar lives: every connection's HELLO reply names the sidecar's incarnation.  A connection to
another life than the one the session holds (the sidecar was restarted) calls ``on_new_life``
before it is used (the client remaps its arena and forgets the old life's leases there) and is
refused if the client does not move to it; idle connections of a previous life are dropped.  A
call whose frame could not even be sent (the sidecar of an idle connection died) is sent once
more on a new connection: nothing of it reached the sidecar.  Each call's result is returned
with the incarnation of the connection that answered it, for the client's last check.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np

from kvpool.core import breaker, errors
from kvpool.transfer import memfd
from kvpool.transfer._sockio import recv_exact, send_buffers, send_with_fd
from kvpool.wire import sidecar_frames as fp
from kvpool.wire.proto import store_pb2 as pb

T = TypeVar("T")


class RegistrationRefused(errors.KvpoolError):
    """The sidecar would not map a region (over its limit, or not a sealed memfd): ``cause``."""

    def __init__(self, region_id: int, cause: errors.KvpoolError) -> None:
        super().__init__(f"region {region_id} not registered: {cause}")
        self.region_id = region_id
        self.cause = cause


class ReadReply(NamedTuple):
    codes: list[int]
    offsets: list[int]
    sizes: list[int]
    lease_id: int
    local_hits: int
    pool_hits: int
    incarnation: int
    """The sidecar life whose arena the offsets are in."""


class _NotSent(Exception):
    """The request frame could not be written (the connection was already dead)."""

    def __init__(self, exc: OSError) -> None:
        super().__init__(str(exc))
        self.exc = exc


class _Conn:
    def __init__(self, path: str, timeout: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.timeout = timeout
        self.sock.connect(path)
        self.header = bytearray(fp.RESPONSE_SIZE)
        self.next_id = 1
        self.incarnation = 0
        """The sidecar life at the other end (its HELLO reply)."""
        self.fresh = True
        """Not used for a call yet (a failure to send on it is not a dead idle connection)."""
        self.registered: set[int] = set()
        """Ids of the client's regions this connection's sidecar side has mapped."""

    def bound(self, seconds: float) -> None:
        """The bound of the next calls on this connection (until changed)."""
        if seconds != self.timeout:
            self.sock.settimeout(seconds)
            self.timeout = seconds

    def call(self, op: int, fd: int | None = None, **kw: Any) -> tuple[fp.Response, bytearray]:
        """One exchange, within the connection's bound (:meth:`bound`)."""
        rid = self.next_id
        self.next_id = (rid + 1) & 0xFFFFFFFF
        frame = fp.encode_request(op, rid, **kw)
        try:
            if fd is None:
                send_buffers(self.sock, frame)
            else:
                send_with_fd(self.sock, frame, fd)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _NotSent(exc) from None
        if kw.get("flags", 0) & fp.FLAG_NO_REPLY:
            return fp.Response(op, 0, 0, rid, 0, 0, 0, 0, 0), bytearray()
        view = memoryview(self.header)
        recv_exact(self.sock, view)
        resp = fp.decode_response(view)
        if resp.request_id != rid or resp.op != op:
            raise fp.ProtocolError(f"reply {resp.request_id}/{resp.op} to request {rid}/{op}")
        msg = b""
        if resp.msg_len:
            buf = bytearray(resp.msg_len)
            recv_exact(self.sock, memoryview(buf))
            msg = bytes(buf)
        if resp.status:
            raise errors.from_session_status(resp.status, msg.decode("utf-8", "replace"))
        body = bytearray(resp.body_bytes())
        if body:
            recv_exact(self.sock, memoryview(body))
        return resp, body

    def close(self) -> None:
        self.sock.close()

    def __del__(self) -> None:
        self.sock.close()  # a client dropped without close(): no unclosed-socket warning


PROBE_SECONDS = 0.1
"""How long a probe waits for a suspect sidecar's greeting (a healthy one greets in well under 1 ms)."""
_SIDECAR_BREAKER = breaker.Policy(backoff_seconds=0.1, max_backoff_seconds=1.0)
"""A suspect sidecar is probed again 0.1 s after a failed probe, doubling up to 1 s: an engine's
calls fail at once for at most about a second after its sidecar resumes."""


class FastSession:
    """Connections to one sidecar's fast session."""

    def __init__(self, path: str, tenant: str, arena_bytes: int, timeout: float = 30.0,
                 max_connections: int = 8, incarnation: int = 0,
                 on_new_life: Callable[[int], int] | None = None) -> None:
        self.incarnation = incarnation
        """The sidecar life the session serves (its HELLO's incarnation)."""
        self.on_new_life = on_new_life
        """Called with the incarnation of a connection to another life; returns the one the
        caller now holds (its own, when it moved to the new life)."""
        self.path = path
        self.tenant = tenant
        self.arena_bytes = arena_bytes
        self.timeout = timeout
        self.max_connections = max_connections
        self._idle: list[_Conn] = []
        self._open = 0
        self._forgotten: set[int] = set()
        """Regions freed while a connection that mapped them was busy: it is dropped when it is
        put back (the sidecar unmaps a connection's regions when it closes)."""
        self._cond = threading.Condition()
        self._closed = False
        self._pid = os.getpid()
        self._health = breaker.Health()
        """The sidecar's circuit breaker (guarded by ``_cond``): after a call missed its bound
        (a hung sidecar: SIGSTOP, a long pause), calls fail at once instead of each waiting out
        its bound, until one let through as the probe is answered (``kvpool.core.breaker``)."""
        self._put_back(self._connect())  # fails here (no such socket, wrong tenant) or never

    def _connect(self, timeout: float | None = None) -> _Conn:
        """A new connection, greeted within ``timeout`` (the bound of the call that needs it)."""
        conn = _Conn(self.path, timeout or self.timeout)
        try:
            resp, body = conn.call(fp.OP_HELLO, text=self.tenant.encode())
            conn.incarnation = fp.decode_hello(resp, body)[0]
            if conn.incarnation != self.incarnation and self.on_new_life is not None:
                self.incarnation = self.on_new_life(conn.incarnation)
            if conn.incarnation != self.incarnation:
                raise errors.SidecarRestarted(f"fast session to {self.path}: the sidecar is life "
                                              f"{conn.incarnation}, this client holds {self.incarnation}")
        except _NotSent as exc:
            conn.close()
            raise exc.exc from None
        except BaseException:
            conn.close()
            raise
        with self._cond:
            self._open += 1
        return conn

    def _take(self, timeout: float | None = None) -> _Conn:
        with self._cond:
            if self._pid != os.getpid():
                # A forked child (engines fork workers): the connections it inherited are its
                # parent's streams; frames from both would interleave.  Start afresh.
                self._pid = os.getpid()
                for c in self._idle:
                    c.close()  # the child's copy of the descriptor only
                self._idle, self._open = [], 0
            while True:
                if self._closed:
                    raise errors.Unavailable("fast session closed")
                while self._idle and self._idle[-1].incarnation != self.incarnation:
                    self._idle.pop().close()  # of a previous life: its sidecar is gone
                    self._open -= 1
                if self._idle:
                    return self._idle.pop()
                if self._open < self.max_connections:
                    self._open += 1  # reserved; _connect counts it again
                    break
                self._cond.wait()
        try:
            conn = self._connect(timeout)
        finally:
            with self._cond:
                self._open -= 1
                self._cond.notify()
        return conn

    def _put_back(self, conn: _Conn) -> None:
        with self._cond:
            if self._closed:
                conn.close()
                return
            if not conn.registered.isdisjoint(self._forgotten):
                self._open -= 1
                self._cond.notify()
                conn.close()
                return
            self._idle.append(conn)
            self._cond.notify()

    def forget_region(self, region_id: int) -> None:
        """A region was freed: close the connections that mapped it (idle ones now, busy ones
        when they come back), so the sidecar unmaps it."""
        with self._cond:
            drop = [c for c in self._idle if region_id in c.registered]
            self._idle = [c for c in self._idle if region_id not in c.registered]
            self._open -= len(drop)
            self._forgotten.add(region_id)
            self._cond.notify_all()
        for c in drop:
            c.close()

    def _drop(self, conn: _Conn) -> None:
        conn.close()
        with self._cond:
            self._open -= 1
            self._cond.notify()

    def call(self, op: int, timeout: float | None = None, **kw: Any) -> tuple[fp.Response, bytearray]:
        """One exchange, bounded by ``timeout`` (default: the session's)."""
        bound = timeout or self.timeout
        return self._on_connection(lambda conn: conn.call(op, **kw), bound)[0]

    def _on_connection(self, exchange: Callable[[_Conn], T], timeout: float | None = None) -> tuple[T, int]:
        """Run ``exchange`` on a connection of the pool (a new one greeted within ``timeout``):
        its result and the connection's sidecar incarnation.  A connection whose stream may be
        out of step afterwards is dropped (and the call raises :class:`~kvpool.core.errors.Unavailable`,
        or :class:`~kvpool.core.errors.DeadlineExceeded` past the bound); one that was dead before the
        frame left (an idle connection to a sidecar that died) is replaced once."""
        self._admit()
        try:
            out = self._exchange(exchange, timeout)
        except errors.DeadlineExceeded:
            self._judge(False, False)
            raise
        self._judge(True, False)
        return out

    def _admit(self) -> None:
        """Let a call go to the sidecar; raises Suspect (an Unavailable, at once) when the sidecar
        is suspect: another call is probing it, its back-off runs, or this call's probe failed."""
        if self._health.state is breaker.State.CLOSED:
            return  # the hot path: no lock, no clock (a call racing a failure just goes)
        with self._cond:
            admission = breaker.admit(self._health, time.monotonic())
            if admission is breaker.Admission.CALL:
                return
            if admission is breaker.Admission.SKIP:
                raise errors.Suspect(f"fast session to {self.path}: the sidecar missed a call's bound and has "
                                     "not answered since (calls fail at once until a probe is answered)")
            self._health = breaker.probe_started(self._health)
        answered = self._probe()
        self._judge(answered, True)
        if not answered:
            raise errors.Suspect(f"fast session to {self.path}: the sidecar missed a call's bound and did not "
                                 f"greet a probe within {PROBE_SECONDS}s (calls fail at once until it does)")

    def _probe(self) -> bool:
        """Whether a suspect sidecar greets a new connection within :data:`PROBE_SECONDS`; the
        connection then serves the calls that follow.  A short greeting, not the engine's call,
        is the probe: a hung sidecar then costs a call its bound once, not once per probe."""
        try:
            conn = self._connect(PROBE_SECONDS)
        except (OSError, errors.KvpoolError):  # TimeoutError too
            return False
        self._put_back(conn)
        return True

    def _judge(self, answered: bool, probe: bool) -> None:
        if answered and not probe and self._health.failures == 0:
            return  # healthy and answered: nothing to record (the hot path)
        with self._cond:
            if answered:
                self._health = breaker.on_success(self._health)
            else:
                self._health = breaker.on_failure(self._health, time.monotonic(), _SIDECAR_BREAKER, probe)

    def _exchange(self, exchange: Callable[[_Conn], T], timeout: float | None) -> tuple[T, int]:
        for _ in range(2):
            try:
                conn = self._take(timeout)
            except TimeoutError:
                raise errors.DeadlineExceeded(
                    f"fast session to {self.path}: no greeting within the call's bound") from None
            except OSError as exc:
                raise errors.Unavailable(f"fast session to {self.path}: {exc}") from None
            fresh, conn.fresh = conn.fresh, False
            try:
                conn.bound(timeout or self.timeout)  # every exchange has its bound, whatever ran before
                out = exchange(conn)
            except _NotSent as exc:
                self._drop(conn)
                if fresh:
                    raise errors.Unavailable(f"fast session to {self.path}: {exc}") from None
                continue  # nothing reached the sidecar: once more on a new connection
            except errors.KvpoolError:
                self._put_back(conn)  # a refused call: the stream is still in step
                raise
            except TimeoutError:
                self._drop(conn)  # the answer may still come: this stream is out of step
                raise errors.DeadlineExceeded(
                    f"fast session to {self.path}: no answer within the call's bound") from None
            except (OSError, fp.ProtocolError) as exc:
                self._drop(conn)
                raise errors.Unavailable(f"fast session to {self.path}: {exc}") from None
            except BaseException:
                self._drop(conn)  # interrupted mid-frame: the stream is out of step
                raise
            self._put_back(conn)
            return out, conn.incarnation
        raise errors.Unavailable(f"fast session to {self.path}: connections keep breaking")

    # -- the calls ----------------------------------------------------------------------------

    def match(self, keys: bytes, lease_ms: int, local_only: bool = False,
              timeout: float | None = None) -> tuple[int, int, int]:
        """(prefix, local prefix, lease id)."""
        r, _ = self.call(fp.OP_MATCH, keys=keys, lease_ms=lease_ms,
                         flags=fp.FLAG_LOCAL_ONLY if local_only else 0, timeout=timeout)
        return r.prefix, r.local, r.ref

    def read(self, keys: bytes, kind: int, lease_ms: int, match_lease: int = 0,
             releases: list[int] | None = None, timeout: float | None = None, local_only: bool = False) -> ReadReply:
        """``local_only``: the local tier's objects only (nothing is fetched from the pool)."""
        bound = timeout or self.timeout
        (r, body), inc = self._on_connection(lambda conn: conn.call(
            fp.OP_READ, keys=keys, kind=kind, lease_ms=lease_ms, ref=match_lease, releases=releases,
            flags=fp.FLAG_LOCAL_ONLY if local_only else 0), bound)
        t = fp.decode_table(r, body, self.arena_bytes)
        if len(t.codes) != len(keys) // 32:
            raise errors.Unavailable("fast session: READ reply for another number of keys")
        return ReadReply(t.codes, t.offsets, t.sizes, r.ref, r.prefix, r.local, inc)

    def read_into(self, keys: bytes, kind: int, targets: np.ndarray, regions: dict[int, memfd.Region],
                  match_lease: int = 0, transient: bool = False,
                  timeout: float | None = None) -> tuple[list[int], list[int]]:
        """(codes, sizes) of objects read into spans of registered regions: ``targets`` is the
        region ids, then the offsets, then the lengths (u64 × n each).  A region this connection
        has not passed to the sidecar yet is registered first (one more round trip, once).
        ``transient``: the regions are for this call only (the sidecar unmaps them after it)."""
        n = len(keys) // 32
        named = set(targets[:n].tolist())

        def exchange(conn: _Conn) -> tuple[list[int], list[int]]:
            try:
                self._register(conn, named, regions)
                r, body = conn.call(fp.OP_READ_INTO, keys=keys, kind=kind, ref=match_lease, values=targets,
                                    flags=fp.FLAG_TRANSIENT if transient else 0)
                return fp.decode_sizes(r, body)
            finally:
                if transient:
                    conn.registered -= named
        bound = timeout or self.timeout
        (codes, sizes), _ = self._on_connection(exchange, bound)
        if len(codes) != n:
            raise errors.Unavailable("fast session: READ_INTO reply for another number of keys")
        return codes, sizes

    def write_from(self, keys: bytes, kind: int, traffic_class: str, targets: np.ndarray, checksums: list[int],
                   regions: dict[int, memfd.Region], transient: bool = False) -> list[int]:
        """Per-item pool codes of objects written to the pool straight from spans of registered
        regions (``targets``: region ids, offsets, lengths, u64 × n each), as :meth:`read_into`
        names them; ``transient``: the regions are for this call only."""
        n = len(keys) // 32
        named = set(targets[:n].tolist())

        def exchange(conn: _Conn) -> list[int]:
            try:
                self._register(conn, named, regions)
                r, body = conn.call(fp.OP_WRITE_FROM, keys=keys, kind=kind, text=traffic_class.encode(),
                                    values=np.concatenate([targets, np.asarray(checksums, np.uint64)]),
                                    flags=fp.FLAG_TRANSIENT if transient else 0)
                return fp.decode_table(r, body, self.arena_bytes).codes
            finally:
                if transient:
                    conn.registered -= named
        codes, _ = self._on_connection(exchange)
        if len(codes) != n:
            raise errors.Unavailable("fast session: WRITE_FROM reply for another number of keys")
        return codes

    @staticmethod
    def _register(conn: _Conn, named: set[int], regions: dict[int, memfd.Region]) -> None:
        """Pass the regions of ``named`` this connection has not mapped yet to the sidecar."""
        for rid in named - conn.registered:
            region = regions[rid]
            if region.fd is None:
                raise errors.InvalidArgument(f"region {rid} was freed")
            try:
                conn.call(fp.OP_REGISTER, fd=region.fd, ref=rid)
            except errors.KvpoolError as exc:
                raise RegistrationRefused(rid, exc) from None
            conn.registered.add(rid)

    def write_start(self, keys: bytes, sizes: list[int], kind: int, traffic_class: str,
                    timeout: float | None = None) -> tuple[list[int], list[int], int, int]:
        """(codes, arena offsets, reservation id, the incarnation whose arena the offsets are in)."""
        bound = timeout or self.timeout
        (r, body), inc = self._on_connection(lambda conn: conn.call(
            fp.OP_WRITE_START, keys=keys, kind=kind, text=traffic_class.encode(),
            values=np.asarray(sizes, np.uint64)), bound)
        t = fp.decode_table(r, body, self.arena_bytes)
        for c, o, s in zip(t.codes, t.offsets, sizes, strict=True):
            if c == 0 and o + s > self.arena_bytes:
                raise errors.Unavailable("fast session: reservation outside the arena")
        return t.codes, t.offsets, r.ref, inc

    def write_commit(self, reservation_id: int, checksums: list[int], incarnation: int = 0,
                     pool_wait_ms: int = 0, timeout: float | None = None) -> list[int]:
        """Per-item codes; a reservation of another life than ``incarnation`` (when given) is
        not sent: LEASE_EXPIRED for all (its sidecar is gone).  With ``pool_wait_ms`` the codes
        are the pool's verdict (``FLAG_POOL_WAIT``)."""

        def exchange(conn: _Conn) -> list[int]:
            if incarnation and conn.incarnation != incarnation:
                return [pb.LEASE_EXPIRED] * len(checksums)
            r, body = conn.call(fp.OP_WRITE_COMMIT, ref=reservation_id, values=np.asarray(checksums, np.uint64),
                                flags=fp.FLAG_POOL_WAIT if pool_wait_ms else 0, lease_ms=pool_wait_ms)
            return fp.decode_table(r, body, self.arena_bytes).codes
        bound = timeout or self.timeout
        return self._on_connection(exchange, bound)[0]

    def release(self, lease_ids: list[int], wait: bool = True, timeout: float | None = None) -> None:
        """Drop leases; ``wait=False`` sends the frame and returns (no reply comes)."""
        for i in range(0, len(lease_ids), fp.MAX_RELEASES):
            self.call(fp.OP_RELEASE, releases=lease_ids[i:i + fp.MAX_RELEASES],
                      flags=0 if wait else fp.FLAG_NO_REPLY, timeout=timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for c in idle:
            c.close()
