"""Server side of the client↔sidecar fast session (:mod:`kvpool.wire.sidecar_frames`).

A unix socket beside the gRPC one; one thread per connection (a client opens one per thread
that calls at the same time, so a handful), at most ``max_connections``.  Each connection
receives into one buffer of its own, grown to the largest frame it has seen and never beyond
the protocol's limits (no unbounded queue: the next frame is read only after the reply to the
previous one is sent).  The calls are the sidecar's own (:meth:`Reads.match_keys`,
:meth:`Reads.read_keys`, :meth:`Puts.write_start`, …); the hot calls have no other wire (the gRPC
front end, :mod:`kvpool.sidecar.grpc_server`, serves the cold ones).

A connection also holds the memory regions its client registered (REGISTER: a sealed memfd
passed with the header, :mod:`kvpool.transfer.memfd`), for READ_INTO to land objects in; they
are unmapped when the connection ends.  Their bytes count against the sidecar's
``max_registered_bytes``.

The tenant is the sidecar's; a connection must say HELLO with the tenant it expects before
anything else, and a HELLO naming another tenant is refused — a client pointed at the wrong
pod's socket learns it at once instead of reading another tenant's objects.  The HELLO reply
names this sidecar's incarnation and arena generation: a client that knew another life remaps
and forgets that life's leases before it uses the connection.  A frame that does
not parse closes that connection only.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

import numpy as np

from kvpool.core import errors
from kvpool.core.keys import KEY_BYTES
from kvpool.sidecar.config import SidecarConfig
from kvpool.sidecar.puts import Puts
from kvpool.sidecar.reads import Reads
from kvpool.sidecar.status import Greeting
from kvpool.transfer import memfd
from kvpool.transfer._sockio import close_fds, recv_exact, recv_with_fds, send_buffers
from kvpool.wire import sidecar_frames as fp
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.sidecar.fast")


class FastSessionServer:
    """Accepts fast-session connections for one sidecar: its calls go to ``reads`` and ``puts``."""

    def __init__(self, path: str, cfg: SidecarConfig, reads: Reads, puts: Puts, greeting: Greeting,
                 max_connections: int = 64) -> None:
        self.path = path
        self.cfg, self.reads, self.puts, self.greeting = cfg, reads, puts, greeting
        self.max_connections = max_connections
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self.registered_bytes = 0
        """Bytes of client memory mapped by all connections (guarded by ``_lock``)."""
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None

    def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)  # a stale socket of a previous life
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        sock.listen(64)
        self._listener = sock
        self._acceptor = threading.Thread(target=self._accept_loop, name="fast-accept", daemon=True)
        self._acceptor.start()

    def stop(self) -> None:
        self._stop.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._acceptor is not None:
            self._acceptor.join(timeout=2)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def registration_room(self) -> int:
        """Bytes of client memory that may still be mapped (``max_registered_bytes`` over all
        connections)."""
        with self._lock:
            return self.cfg.max_registered_bytes - self.registered_bytes

    def count_registered(self, nbytes: int) -> None:
        """A connection mapped (> 0) or unmapped (< 0) ``nbytes`` of client memory."""
        with self._lock:
            self.registered_bytes += nbytes

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if len(self._conns) >= self.max_connections:
                    conn.close()  # the client's call fails Unavailable (there is no other wire)
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._serve_conn, args=(conn,), name="fast-conn", daemon=True).start()

    def _serve_conn(self, conn: socket.socket) -> None:
        try:
            _Connection(self, conn).run(self._stop)
        except (ConnectionError, OSError):
            pass  # the client went away
        except fp.ProtocolError as exc:
            log.warning("fast session: closing a connection after a bad frame: %s", exc)
        except Exception:
            log.exception("fast session: connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()


class _Connection:
    """One client connection: frames in, sidecar calls, frames out."""

    def __init__(self, server: FastSessionServer, conn: socket.socket) -> None:
        self.server = server
        self.cfg, self.reads, self.puts = server.cfg, server.reads, server.puts
        self.lease_ms, self.max_lease_ms = server.cfg.lease_ms, server.cfg.max_lease_ms
        self.conn = conn
        self.greeted = False
        self.regions: dict[int, memfd.Region] = {}
        self._header = bytearray(fp.REQUEST_SIZE)
        self._body = bytearray(64 * KEY_BYTES)

    def _body_view(self, n: int) -> memoryview:
        """A view of ``n`` bytes of this connection's receive buffer (grown, never shrunk; the
        header check bounds ``n`` to a few MB)."""
        if len(self._body) < n:
            self._body = bytearray(n)
        return memoryview(self._body)[:n]

    def run(self, stopping: threading.Event) -> None:
        try:
            self._run(stopping)
        finally:
            self._drop_regions()

    def _run(self, stopping: threading.Event) -> None:
        header = memoryview(self._header)
        while not stopping.is_set():
            fds = recv_with_fds(self.conn, header)
            if fds is None:
                return
            try:
                req = fp.decode_request(header)
                if fds and (req.op != fp.OP_REGISTER or len(fds) != 1):
                    raise fp.ProtocolError("a descriptor came with a frame other than REGISTER")
                body = self._body_view(req.body_bytes())
                if len(body):
                    recv_exact(self.conn, body)
                parsed = fp.decode_request_body(req, body)
                reply = self._serve(req, parsed, fds)
            finally:
                # What a REGISTER did not take: a frame that broke before it got there, or a
                # refused call (each descriptor held here is client memory kept alive).
                close_fds(fds)
            if reply is not None:
                send_buffers(self.conn, reply)

    def _register(self, region_id: int, fd: int | None) -> None:
        """Map a client's region (REGISTER); ``fd`` is consumed in every case."""
        if fd is None:
            raise errors.InvalidArgument("REGISTER carries the region's descriptor")
        try:
            region = memfd.adopt(fd, self.server.registration_room())
        except memfd.TooLarge as exc:
            raise errors.NoSpace(f"client memory over --max-registered-bytes: {exc}") from None
        except (ValueError, OSError) as exc:
            raise errors.InvalidArgument(f"cannot register that memory: {exc}") from None
        self.server.count_registered(region.size)
        old = self.regions.pop(region_id, None)
        self.regions[region_id] = region
        if old is not None:
            self._unmap(old)

    def _unmap(self, region: memfd.Region) -> None:
        region.close()
        self.server.count_registered(-region.size)

    def _drop_named(self, region_ids: list[int]) -> None:
        """Unmap the regions of a transient READ_INTO (the client made them for that call)."""
        for rid in set(region_ids):
            region = self.regions.pop(rid, None)
            if region is not None:
                self._unmap(region)

    def _drop_regions(self) -> None:
        regions, self.regions = list(self.regions.values()), {}
        for r in regions:
            self._unmap(r)

    def _targets(self, values: np.ndarray, n: int) -> list[memoryview]:
        """The caller's spans of a READ_INTO, as views of its regions (refused when a span names
        a region this connection does not hold or reaches past its end)."""
        ids, offsets, lengths = values[:n].tolist(), values[n:2 * n].tolist(), values[2 * n:].tolist()
        out = []
        for rid, off, length in zip(ids, offsets, lengths, strict=True):
            region = self.regions.get(rid)
            if region is None:
                raise errors.InvalidArgument(f"region {rid} is not registered on this connection")
            if off > region.size or length > region.size - off:
                raise errors.InvalidArgument(f"span {off}+{length} outside region {rid} of {region.size} bytes")
            out.append(region.view[off:off + length])
        return out

    def _serve(self, req: fp.Request, body: fp.RequestBody, fds: list[int]) -> list[bytes | memoryview] | None:
        """One call; a REGISTER takes its descriptor out of ``fds`` (the caller closes the rest)."""
        try:
            if req.op == fp.OP_HELLO:
                if body.text and body.text != self.cfg.tenant_id:
                    raise errors.PermissionDenied(
                        f"this sidecar serves tenant {self.cfg.tenant_id!r}, not {body.text!r}")
                self.greeted = True
                g = self.server.greeting
                return [fp.encode_hello(req.request_id, g.incarnation, g.arena_generation, g.arena_bytes)]
            if not self.greeted:
                raise errors.Unauthenticated("fast session: HELLO first")
            if body.releases:
                self.reads.release_leases(body.releases)
            if req.op == fp.OP_RELEASE:
                return None if req.flags & fp.FLAG_NO_REPLY else [fp.encode_response(fp.OP_RELEASE, req.request_id)]
            if req.op == fp.OP_REGISTER:
                self._register(req.ref, fds.pop() if fds else None)
                return [fp.encode_response(fp.OP_REGISTER, req.request_id)]
            lease_ms = min(req.lease_ms or self.lease_ms, self.max_lease_ms)
            if req.op == fp.OP_MATCH:
                arr = np.frombuffer(body.keys, dtype=f"V{KEY_BYTES}")
                prefix, local, lease_id = self.reads.match_keys(arr, lease_ms, bool(req.flags & fp.FLAG_LOCAL_ONLY))
                return [fp.encode_response(fp.OP_MATCH, req.request_id, req.items, prefix=prefix, local=local,
                                           ref=lease_id)]
            if req.op == fp.OP_READ:
                kind = self._kind(req.kind)
                arr = np.frombuffer(body.keys, dtype=f"V{KEY_BYTES}")
                r = self.reads.read_keys(arr.tolist(), arr, kind, lease_ms, req.ref,
                                         local_only=bool(req.flags & fp.FLAG_LOCAL_ONLY))
                return [fp.encode_response(fp.OP_READ, req.request_id, req.items, prefix=r.local_hits,
                                           local=r.pool_hits, ref=r.lease_id),
                        fp.encode_table(r.codes, r.offsets, r.sizes)]
            if req.op == fp.OP_READ_INTO:
                kind = self._kind(req.kind)
                assert body.values is not None
                arr = np.frombuffer(body.keys, dtype=f"V{KEY_BYTES}")
                try:
                    dests = self._targets(body.values, req.items)
                    codes, sizes, local_hits, pool_hits = self.reads.read_into(arr.tolist(), arr, kind, dests,
                                                                               req.ref)
                    del dests  # no view of a region outlives the call (the region may be unmapped next)
                finally:
                    if req.flags & fp.FLAG_TRANSIENT:
                        self._drop_named(body.values[:req.items].tolist())
                return [fp.encode_response(fp.OP_READ_INTO, req.request_id, req.items, prefix=local_hits,
                                           local=pool_hits),
                        fp.encode_table(codes, sizes)]
            if req.op == fp.OP_WRITE_FROM:
                kind = self._kind(req.kind)
                assert body.values is not None
                n = req.items
                keys = np.frombuffer(body.keys, dtype=f"V{KEY_BYTES}").tolist()
                try:
                    srcs = self._targets(body.values[:3 * n], n)
                    pool_codes = self.puts.write_from(keys, srcs, body.values[3 * n:].tolist(), kind, body.text)
                    del srcs  # no view of a region outlives the call
                finally:
                    if req.flags & fp.FLAG_TRANSIENT:
                        self._drop_named(body.values[:n].tolist())
                return [fp.encode_response(fp.OP_WRITE_FROM, req.request_id, n), fp.encode_table(pool_codes)]
            if req.op == fp.OP_WRITE_START:
                kind = self._kind(req.kind)
                assert body.values is not None
                keys = np.frombuffer(body.keys, dtype=f"V{KEY_BYTES}").tolist()
                codes, entries, rid = self.puts.write_start(keys, body.values.tolist(), kind, body.text)
                return [fp.encode_response(fp.OP_WRITE_START, req.request_id, req.items, ref=rid),
                        fp.encode_table(codes, [e.offset if e else 0 for e in entries])]
            assert req.op == fp.OP_WRITE_COMMIT and body.values is not None
            codes = self.puts.write_commit(req.ref, body.values.tolist(),
                                           req.lease_ms if req.flags & fp.FLAG_POOL_WAIT else 0)
            return [fp.encode_response(fp.OP_WRITE_COMMIT, req.request_id, req.items), fp.encode_table(codes)]
        except errors.KvpoolError as exc:  # refused: a session status (the connection stays open)
            if req.flags & fp.FLAG_NO_REPLY:
                return None
            return [fp.encode_response(req.op, req.request_id, req.items, status=errors.session_status_for(exc),
                                       message=str(exc))]

    @staticmethod
    def _kind(kind: int) -> int:
        if kind not in (pb.BLOCK, pb.STATE):
            raise errors.InvalidArgument(f"unknown object kind {kind}")
        return kind
