"""Client side of the sidecar fast session (:mod:`kvpool.sidecar.fast_protocol`), and the
arena→caller copy of ``get_into``.

:class:`FastSession` keeps a few unix-socket connections to the sidecar's ``<socket>.fast``
(one per thread calling at the same time, at most ``max_connections``; more callers wait for
one), each greeted with the tenant the client expects.  Every call is one frame out and one
frame in; a release after a finished copy is one frame out and none in.  A connection that
breaks or sends a frame that does not parse is closed and the call raises
:class:`~kvpool.errors.Unavailable` (the caller's gRPC path is still there).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from concurrent import futures
from typing import Any, NamedTuple

import numpy as np

from . import errors
from .sidecar import fast_protocol as fp
from .transfer._sockio import recv_exact, send_buffers


class ReadReply(NamedTuple):
    codes: list[int]
    offsets: list[int]
    sizes: list[int]
    lease_id: int
    local_hits: int
    pool_hits: int


class _Conn:
    def __init__(self, path: str, timeout: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.header = bytearray(fp.RESPONSE_SIZE)
        self.next_id = 1

    def call(self, op: int, **kw: Any) -> tuple[fp.Response, bytearray]:
        rid = self.next_id
        self.next_id = (rid + 1) & 0xFFFFFFFF
        send_buffers(self.sock, fp.encode_request(op, rid, **kw))  # type: ignore[arg-type]
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


class FastSession:
    """Connections to one sidecar's fast session."""

    def __init__(self, path: str, tenant: str, arena_bytes: int, timeout: float = 30.0,
                 max_connections: int = 8) -> None:
        self.path = path
        self.tenant = tenant
        self.arena_bytes = arena_bytes
        self.timeout = timeout
        self.max_connections = max_connections
        self._idle: list[_Conn] = []
        self._open = 0
        self._cond = threading.Condition()
        self._closed = False
        self._pid = os.getpid()
        self._put_back(self._connect())  # fails here (no such socket, wrong tenant) or never

    def _connect(self) -> _Conn:
        conn = _Conn(self.path, self.timeout)
        try:
            conn.call(fp.OP_HELLO, text=self.tenant.encode())
        except BaseException:
            conn.close()
            raise
        with self._cond:
            self._open += 1
        return conn

    def _take(self) -> _Conn:
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
                if self._idle:
                    return self._idle.pop()
                if self._open < self.max_connections:
                    self._open += 1  # reserved; _connect counts it again
                    break
                self._cond.wait()
        try:
            conn = self._connect()
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
            self._idle.append(conn)
            self._cond.notify()

    def _drop(self, conn: _Conn) -> None:
        conn.close()
        with self._cond:
            self._open -= 1
            self._cond.notify()

    def call(self, op: int, **kw: Any) -> tuple[fp.Response, bytearray]:
        try:
            conn = self._take()
        except OSError as exc:
            raise errors.Unavailable(f"fast session to {self.path}: {exc}") from None
        try:
            out = conn.call(op, **kw)
        except errors.KvpoolError:
            self._put_back(conn)  # a refused call: the stream is still in step
            raise
        except (OSError, fp.ProtocolError) as exc:
            self._drop(conn)
            raise errors.Unavailable(f"fast session to {self.path}: {exc}") from None
        except BaseException:
            self._drop(conn)  # interrupted mid-frame: the stream is out of step
            raise
        self._put_back(conn)
        return out

    # -- the calls ----------------------------------------------------------------------------

    def match(self, keys: bytes, lease_ms: int, local_only: bool = False) -> tuple[int, int, int]:
        """(prefix, local prefix, lease id)."""
        r, _ = self.call(fp.OP_MATCH, keys=keys, lease_ms=lease_ms,
                         flags=fp.FLAG_LOCAL_ONLY if local_only else 0)
        return r.prefix, r.local, r.ref

    def read(self, keys: bytes, kind: int, lease_ms: int, match_lease: int = 0,
             releases: list[int] | None = None) -> ReadReply:
        r, body = self.call(fp.OP_READ, keys=keys, kind=kind, lease_ms=lease_ms, ref=match_lease,
                            releases=releases)
        t = fp.decode_table(r, body, self.arena_bytes)
        if len(t.codes) != len(keys) // 32:
            raise errors.Unavailable("fast session: READ reply for another number of keys")
        return ReadReply(t.codes, t.offsets, t.sizes, r.ref, r.prefix, r.local)

    def write_start(self, keys: bytes, sizes: list[int], kind: int,
                    traffic_class: str) -> tuple[list[int], list[int], int]:
        """(codes, arena offsets, reservation id)."""
        r, body = self.call(fp.OP_WRITE_START, keys=keys, kind=kind, text=traffic_class.encode(),
                            values=np.asarray(sizes, np.uint64))
        t = fp.decode_table(r, body, self.arena_bytes)
        for c, o, s in zip(t.codes, t.offsets, sizes, strict=True):
            if c == 0 and o + s > self.arena_bytes:
                raise errors.Unavailable("fast session: reservation outside the arena")
        return t.codes, t.offsets, r.ref

    def write_commit(self, reservation_id: int, checksums: list[int]) -> list[int]:
        r, body = self.call(fp.OP_WRITE_COMMIT, ref=reservation_id, values=np.asarray(checksums, np.uint64))
        return fp.decode_table(r, body, self.arena_bytes).codes

    def release(self, lease_ids: list[int], wait: bool = True) -> None:
        """Drop leases; ``wait=False`` sends the frame and returns (no reply comes)."""
        for i in range(0, len(lease_ids), fp.MAX_RELEASES):
            self.call(fp.OP_RELEASE, releases=lease_ids[i:i + fp.MAX_RELEASES],
                      flags=0 if wait else fp.FLAG_NO_REPLY)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for c in idle:
            c.close()


# -- copying out of the arena -----------------------------------------------------------------

PARALLEL_COPY_BYTES = 4 << 20
"""Batches at least this large are copied by two threads (numpy releases the GIL while it
copies): one thread's memcpy of cold 1 MiB objects runs at ~6-10 GB/s here, two at ~1.7x."""
CHUNK_BYTES = 1 << 20


class Copier:
    """Copies (source, destination) view pairs; a big batch is cut into ~1 MiB chunks that the
    calling thread and one helper thread take in turn.  The caller never waits for a helper
    that has not started (a busy machine: it copies everything itself, as if alone), only for
    the one chunk a running helper holds."""

    def __init__(self) -> None:
        self._helper: futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _take(chunks: list[tuple[memoryview, memoryview]], turn: Any) -> None:
        n = len(chunks)
        while True:
            i = next(turn)  # itertools.count: one atomic step under the GIL
            if i >= n:
                return
            src, dst = chunks[i]
            np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))

    def copy(self, pairs: list[tuple[memoryview, memoryview]]) -> None:
        total = sum(s.nbytes for s, _ in pairs)
        if total < PARALLEL_COPY_BYTES:
            self._take(pairs, itertools.count())  # alone: every pair in turn
            return
        chunks = [(src[at:at + CHUNK_BYTES], dst[at:at + CHUNK_BYTES])
                  for src, dst in pairs for at in range(0, src.nbytes, CHUNK_BYTES)]
        with self._lock:
            if self._helper is None:
                self._helper = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-copy")
            helper = self._helper
        turn = itertools.count()
        fut = helper.submit(self._take, chunks, turn)
        try:
            self._take(chunks, turn)
        finally:
            if not fut.cancel():
                fut.result()

    def close(self) -> None:
        with self._lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=True)
