"""Client of one store node: one wire for data (the data session), StoreData gRPC for cold calls.

Used by the sidecar (one per store node), by the drain (node → node) and by benchmarks.  Every
call carries the tenant's token; every read is verified against the blob's checksum, so a slot
recycled under a stale lease can never hand back another object's bytes.

Reads, writes, ranged reads, existence checks and short releases go over the node's data session
(:mod:`kvpool.pool.data_client`, one round trip each on the transfer port), found once with a
``HELLO`` on the transfer address the node's Health names; gRPC carries the rest (Health,
Stats, Remove, GetRing, releases of more than a few leases; the admin calls are
:class:`~kvpool.pool.admin_client.AdminClient`'s).  Every node serves its session; one
that cannot be reached raises :class:`~kvpool.core.errors.Unavailable`, and the next call asks
the node again where it is (a restarted node may listen on another transfer port).

Given a :class:`~kvpool.pool.rdma_path.LocalRdma` with a device, reads and writes go one-sided
over RDMA to a node that has one (:mod:`kvpool.pool.rdma_path`); what that path cannot bring,
whole and verified, is read over the data session in the same call, and a write it cannot
finish is made over the data session.

The calls an engine waits for (exists, read, ranged read, the sidecar's probe) take a per-call
``timeout`` (the sidecar's :class:`~kvpool.core.deadlines.Deadlines`): armed on the data connection,
or passed to gRPC; a node that misses it raises :class:`~kvpool.core.errors.DeadlineExceeded`, and the
session is kept (a hung node is not a restarted one: asking where its session is would wait too).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc

from kvpool.core import errors, ranges
from kvpool.core.buffers import Buffer, as_bytes_view
from kvpool.core.keys import KEY_BYTES, pack_keys
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS
from kvpool.pool.data_client import DataSession, Dest, ExistsReply, PendingExists, ReadResult
from kvpool.pool.rdma_path import LocalRdma, RdmaPath, RdmaReadResult, merge
from kvpool.wire import grpc_status
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.proto import store_pb2_grpc as pbg
from kvpool.wire.tls import TlsConfig, TlsError
from kvpool.wire.tls import channel as tls_channel
from kvpool.wire.tls import resolve as resolve_tls

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.enable_http_proxy", 0),
    ("grpc.keepalive_time_ms", 20000),
]

TLS_CHECK_SECONDS = 1.0
"""How often a client looks whether its TLS files changed (:meth:`StoreClient.stub`)."""


@dataclass(frozen=True)
class ExistsResult:
    prefix: int
    present: list[bool]
    lease_id: int
    epoch: int


class StoreClient:
    """Thread-safe client of one store node."""

    def __init__(self, address: str, token: str = "", timeout: float = 10.0, verify: bool = True,
                 data_connections: int = 2, rdma: LocalRdma | None = None,
                 tls: TlsConfig | bool | None = None) -> None:
        """``tls``: the TLS configuration of both wires (None: this process's,
        :func:`kvpool.wire.tls.current`; False: plaintext)."""
        self.address = address
        self.tls = resolve_tls(tls, address)
        self.timeout = timeout
        self.verify = verify
        self._token = token
        self._data_connections = data_connections
        self._session: DataSession | None = None
        self._closed = False
        self._session_lock = threading.Lock()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel_lock = threading.Lock()
        self._tls_stamp = self.tls.stamp() if self.tls is not None else ()
        self._tls_check_at = time.monotonic() + TLS_CHECK_SECONDS
        self._channel = tls_channel(address, self.tls, _CHANNEL_OPTIONS)
        self._stub = pbg.StoreDataStub(self._channel)
        self.rdma = RdmaPath(rdma, self._stub, self._metadata, address, min(timeout, 5.0)) if rdma else None
        """Reads one-sided over RDMA where both sides have a device (:mod:`kvpool.pool.rdma_path`)."""
        self.epoch_seen = 0
        self.incarnation = 0
        """The node's life as its last reply that carries one said (HELLO, gRPC replies): a
        change means it restarted, and its leases and reservations of before are gone."""

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def stub(self) -> Any:
        """The StoreData stub, of a channel whose credentials are the TLS files' current ones."""
        if self.tls is not None and time.monotonic() >= self._tls_check_at:
            self._refresh_channel()
        return self._stub

    def _refresh_channel(self) -> None:
        """A gRPC channel keeps the certificate and bundle it was made with: after a rotation
        (files rewritten in place) its next reconnect (a node restarted with a certificate from
        the new CA, or trusting only it) would fail verification.  When the files changed, new
        calls go on a new channel; the old one is closed once the calls on it are past their
        deadline.  Checked at most every :data:`TLS_CHECK_SECONDS` (three ``stat``), on gRPC's
        cold calls only: the data session's new connections read the files themselves."""
        assert self.tls is not None
        with self._channel_lock:
            if time.monotonic() < self._tls_check_at:
                return  # another thread checked
            self._tls_check_at = time.monotonic() + TLS_CHECK_SECONDS
            try:
                stamp = self.tls.stamp()
                if stamp == self._tls_stamp or self._closed:
                    return
                fresh = tls_channel(self.address, self.tls, _CHANNEL_OPTIONS)
            except TlsError:
                return  # mid-swap past the read's bound, or gone: keep the channel, look again later
            self._tls_stamp = stamp
            old, self._channel = self._channel, fresh
            self._stub = pbg.StoreDataStub(fresh)
        if self.rdma is not None:
            self.rdma.stub = self._stub
        closer = threading.Timer(self.timeout + 1.0, old.close)
        closer.daemon = True
        closer.start()

    def _rpc(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        # Any: the generated gRPC stubs are untyped; callers returning the reply cast it to its message.
        try:
            reply = method(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise grpc_status.from_rpc_error(err) from None
        self._seen(getattr(reply, "epoch", 0))
        self.incarnation = getattr(reply, "incarnation", 0) or self.incarnation
        return reply

    def session(self, timeout: float | None = None) -> DataSession:
        """The node's data session, opened by the first call that needs it (within ``timeout``);
        a node that cannot be reached raises :class:`~kvpool.core.errors.Unavailable` and is asked
        again by the next call."""
        ds = self._session
        if ds is not None:
            return ds
        with self._session_lock:
            if self._closed:
                raise errors.Unavailable(f"store client of {self.address} closed")
            if self._session is None:
                self._session = self._open_session(timeout)
            return self._session

    def _open_session(self, timeout: float | None = None) -> DataSession:
        seconds = min(timeout or self.timeout, 5.0)
        health = self.health(seconds)
        address = health.transfer_address
        # A node whose data session is plaintext (a trusted network's opt-out) is told so over the
        # (TLS) control channel; each data connection then opens with a ticket from it, and no
        # frame carries the token.
        plain = health.data_session_plaintext
        try:
            ds = DataSession(address, self._token, self.timeout, self._data_connections,
                             tls=None if plain else self.tls, ticket=self._data_ticket if plain else None)
        except ValueError as exc:
            raise errors.Unavailable(f"store node {self.address}: bad transfer address {address!r}: {exc}") from None
        try:
            self._seen(ds.hello(seconds))
        except BaseException:
            ds.close()
            raise
        self.incarnation = ds.incarnation or self.incarnation
        return ds

    @contextlib.contextmanager
    def _session_call(self, ds: DataSession) -> Iterator[None]:
        """An unreachable session is forgotten, so the next call asks the node again where it
        serves one (a node restarted on another transfer port)."""
        try:
            yield
        except errors.DeadlineExceeded:
            raise  # hung, not restarted elsewhere: the session stays
        except errors.Unavailable:
            with self._session_lock:
                if self._session is ds:
                    self._session = None
            ds.close()
            raise

    def _data_ticket(self, timeout: float) -> bytes:
        """A one-use ticket for one plaintext data connection (:mod:`kvpool.core.tickets`)."""
        return bytes(self._rpc(self.stub.DataTicket, pb.Empty(), timeout).ticket)

    def _seen(self, epoch: int) -> None:
        if epoch > self.epoch_seen:
            self.epoch_seen = epoch

    def close(self) -> None:
        with self._session_lock:
            self._closed = True
            if self._session is not None:
                self._session.close()
        if self.rdma is not None:
            self.rdma.close()
        with self._channel_lock:
            self._channel.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- metadata ---------------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes], pin: bool = False, lease_ms: int = 0, prefix_only: bool = True,
               kind: int = pb.BLOCK, epoch: int = 0) -> ExistsResult:
        r = self.exists_array(pack_keys(keys), pin, lease_ms, prefix_only, kind, epoch)
        return ExistsResult(r.prefix, r.present.tolist(), r.lease_id, r.epoch)

    def exists_array(self, keys: bytes, pin: bool = False, lease_ms: int = 0, prefix_only: bool = True,
                     kind: int = pb.BLOCK, epoch: int = 0, timeout: float | None = None) -> ExistsReply:
        """:meth:`exists` of packed keys, presence as a numpy array (the sidecar's match path)."""
        ds = self.session(timeout)
        with self._session_call(ds):
            r = ds.exists(keys, kind, prefix_only, pin, lease_ms if pin else 0, epoch, timeout=timeout)
        self._seen(r.epoch)
        return r

    def exists_array_begin(self, keys: bytes, pin: bool = False, lease_ms: int = 0, prefix_only: bool = True,
                           kind: int = pb.BLOCK, epoch: int = 0, drop_lease: int = 0, timeout: float | None = None
                           ) -> PendingExists:
        """:meth:`exists_array` in parts (:meth:`DataSession.exists_begin`: the request started
        now, ``flush()`` sends its rest, calling the result collects the answer, waiting at most
        its argument in seconds, default ``timeout``).
        ``drop_lease``: a lease of this node dropped before the lookup, in the same frame."""
        ds = self.session(timeout)
        with self._session_call(ds):
            pending = ds.exists_begin(keys, kind, prefix_only, pin, lease_ms if pin else 0, epoch, drop_lease,
                                      timeout)

        def done(left: float | None = None) -> ExistsReply:
            with self._session_call(ds):
                r = pending(left)
            self._seen(r.epoch)
            return r
        return PendingExists(done, pending.flush)

    def release(self, lease_ids: Sequence[int], timeout: float | None = None) -> None:
        ids = [i for i in lease_ids if i]
        if len(ids) <= 4:
            # One short frame each on the data session (~0.1 ms) instead of a gRPC call (~1 ms).
            ds = self.session(timeout)
            with self._session_call(ds):
                for lid in ids:
                    ds.exists(b"", drop_lease=lid, timeout=timeout)
            return
        if ids:
            self._rpc(self.stub.Release, pb.ReleaseRequest(lease_ids=ids), timeout)

    def probe(self, timeout: float) -> int:
        """One small call answered by the node itself (a data-session HELLO): its ring epoch.
        The sidecar's probe of a suspect node."""
        ds = self.session(timeout)
        with self._session_call(ds):
            epoch = ds.hello(timeout)
        self._seen(epoch)
        return epoch

    def remove(self, keys: Sequence[bytes], kind: int = pb.BLOCK) -> list[int]:
        request = pb.RemoveRequest(keys=pack_keys(keys), kind=grpc_status.as_kind(kind))
        return list(self._rpc(self.stub.Remove, request).codes)

    def stats(self) -> pb.StatsReply:
        return cast(pb.StatsReply, self._rpc(self.stub.Stats, pb.Empty()))

    def health(self, timeout: float = 2.0) -> pb.HealthReply:
        return cast(pb.HealthReply, self._rpc(self.stub.Health, pb.Empty(), timeout))

    # -- writes -----------------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], values: Sequence[Buffer], traffic_class: str = DEFAULT_TRAFFIC_CLASS,
            kind: int = pb.BLOCK, epoch: int = 0, checksums: Sequence[int] | None = None,
            timeout_ms: int = 0) -> list[int]:
        """Store objects (two-phase); per-item codes (OK, ALREADY_EXISTS, QUOTA_EXCEEDED, ...).

        ``timeout_ms`` bounds the reservation (the node's default when 0): if this process dies
        between reserve and commit, the space comes back after that long.
        """
        if len(keys) != len(values):
            raise errors.InvalidArgument(f"{len(keys)} keys but {len(values)} values")
        views = [as_bytes_view(v) for v in values]
        if self.rdma is not None:
            done = self.rdma.write(pack_keys(keys), views, checksums, traffic_class, kind, timeout_ms, epoch)
            if done is not None:
                self._seen(done[1])
                return done[0]
        ds = self.session()
        with self._session_call(ds):
            codes, seen = ds.put(pack_keys(keys), views, checksums, traffic_class, kind, timeout_ms, epoch)
        self._seen(seen)
        return codes

    # -- reads ------------------------------------------------------------------------------

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview], kind: int = pb.BLOCK) -> list[pb.Code]:
        """Read objects into caller-owned buffers; per-item codes (NOT_FOUND, CHECKSUM, ...)."""
        views = [as_bytes_view(b) for b in buffers]
        return self.read(keys, lambda i, size: views[i], kind).codes

    def read(self, keys: Sequence[bytes] | bytes, dest: Dest, kind: int = pb.BLOCK, lease_id: int = 0,
             streams: int | None = None, timeout: float | None = None,
             bytes_per_second: float = 0.0) -> ReadResult:
        """Read objects into the memory ``dest(i, size)`` hands out once each size is known (None:
        skip it, the item's code is then INVALID); per-item codes, sizes and checksums.
        ``lease_id``: a match lease of this node the read supersedes (dropped by it); ``streams``:
        data connections to cut the batch over; ``timeout`` and ``bytes_per_second``: the read's
        deadline (:meth:`DataSession.read`: a read cut in the middle returns what arrived, with
        ``error`` set)."""
        blob = keys if isinstance(keys, bytes) else pack_keys(keys)
        if self.rdma is not None:
            first = self.rdma.read(blob, dest, kind, lease_id, timeout)
            if first is not None:
                return self._finish_rdma(first, blob, dest, kind, streams, timeout, bytes_per_second)
        return self._read_tcp(blob, dest, kind, lease_id, streams, timeout, bytes_per_second)

    def _read_tcp(self, blob: bytes, dest: Dest, kind: int, lease_id: int, streams: int | None,
                  timeout: float | None, bytes_per_second: float) -> ReadResult:
        ds = self.session(timeout)
        with self._session_call(ds):
            r = ds.read(blob, dest, kind, lease_id, self.verify, self.epoch_seen, streams, timeout,
                        bytes_per_second)
        self._seen(r.epoch)
        return r

    def _finish_rdma(self, first: RdmaReadResult, blob: bytes, dest: Dest, kind: int, streams: int | None,
                     timeout: float | None, bytes_per_second: float) -> ReadResult:
        """A one-sided read's result, with what it could not bring re-read over the data session
        into the buffers ``dest`` gave it already."""
        self._seen(first.epoch)
        if not first.redo:
            return ReadResult(first.codes, first.sizes, first.checksums, first.epoch)
        redo = first.redo

        def again(j: int, size: int) -> memoryview | None:
            buf = first.buffers.get(redo[j])
            return buf if buf is not None and buf.nbytes >= size else dest(redo[j], size)
        sub = b"".join(blob[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in redo)
        r = self._read_tcp(sub, again, kind, 0, streams, timeout, bytes_per_second)
        merge(first, r.codes, r.sizes, r.checksums)
        return ReadResult(first.codes, first.sizes, first.checksums, max(first.epoch, r.epoch), r.error)

    def read_ranges(self, keys: Sequence[bytes] | bytes, per_key: Sequence[Any], buffers: Sequence[memoryview | None],
                    kind: int = pb.BLOCK, lease_id: int = 0, verify_object: bool = False,
                    timeout: float | None = None) -> ReadResult:
        """Sparse read: only the byte ranges ``per_key[i]`` (``(offset, length)`` pairs) of each
        object, back to back into ``buffers[i]``; per-item codes (INVALID for ranges that break a
        rule of :mod:`kvpool.core.ranges` or a buffer too small, NOT_FOUND, CHECKSUM) and the objects'
        sizes."""
        blob = keys if isinstance(keys, bytes) else pack_keys(keys)
        n = len(blob) // KEY_BYTES
        if len(per_key) != n or len(buffers) != n:
            raise errors.InvalidArgument(f"{n} keys, {len(per_key)} range lists, {len(buffers)} buffers")
        pairs: list[ranges.Pairs] = []
        bad: list[int] = []
        for i, rs in enumerate(per_key):
            arr, why = ranges.normalize(rs)
            pairs.append(arr)
            if why:
                bad.append(i)  # refused here: sent as no buffer, so never asked for
        ds = self.session(timeout)
        refused = set(bad)
        bufs = [None if i in refused else (as_bytes_view(b) if b is not None else None)
                for i, b in enumerate(buffers)]
        with self._session_call(ds):
            r = ds.read_ranges(blob, pairs, bufs, kind, lease_id, self.verify, verify_object, self.epoch_seen,
                               timeout)
        self._seen(r.epoch)
        return r

    def get_ranges(self, key: bytes, per_range: Any, kind: int = pb.BLOCK) -> bytearray | None:
        """Convenience sparse read of one object (tests, tools): its ranges back to back, None if
        absent; :class:`~kvpool.core.errors.InvalidArgument` for ranges it cannot serve."""
        arr, why = ranges.normalize(per_range)
        if why:
            raise errors.InvalidArgument(why)
        out = bytearray(ranges.total_bytes(arr))
        r = self.read_ranges([key], [arr], [memoryview(out)], kind)
        code = r.codes[0]
        if code == pb.NOT_FOUND:
            return None
        if code != pb.OK:
            raise errors.error_for_code(code, f"ranged read: {errors.code_name(code)}"
                                        + (f" (object of {r.sizes[0]} bytes)" if r.sizes[0] else ""))
        return out

    def get(self, keys: Sequence[bytes], kind: int = pb.BLOCK) -> list[bytearray | None]:
        """Convenience read into fresh buffers (tests, tools); None for misses."""
        fresh: dict[int, bytearray] = {}

        def dest(i: int, size: int) -> memoryview:
            fresh[i] = bytearray(size)
            return memoryview(fresh[i])
        codes = self.read(keys, dest, kind).codes
        return [fresh[i] if c == pb.OK else None for i, c in enumerate(codes)]

    # -- ring -------------------------------------------------------------------------------

    def get_ring(self) -> pb.Ring:
        return cast(pb.Ring, self._rpc(self.stub.GetRing, pb.Empty()))

    def get_ring_future(self, timeout: float) -> Any:
        """GetRing sent now, its answer a gRPC future (``.result()``: the ``pb.Ring``, or the
        :class:`grpc.RpcError`): many nodes asked at once (:func:`kvpool.pool.fanout.newest_ring`)."""
        return self.stub.GetRing.future(pb.Empty(), timeout=timeout, metadata=self._metadata)
