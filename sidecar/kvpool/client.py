"""What an engine imports: ``kvpool.connect(address) -> Client``.

The client talks gRPC to its sidecar over a unix socket for metadata (the hot calls — match,
read, write, release — over the binary fast session beside it, :mod:`kvpool.fast_client`, when
the sidecar has one) and maps the sidecar's shared-memory arena for bytes: ``get`` returns
views into the arena (zero copy, valid while their lease holds), ``put`` costs one copy into
it.  Thread-safe; a context manager.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import grpc

from . import errors
from .fast_client import Copier, FastSession
from .keys import pack_keys as _pack_keys
from .planning import HitPlan, plan_hit
from .proto import sidecar_pb2 as spb
from .proto import sidecar_pb2_grpc as spbg
from .proto import store_pb2 as pb
from .sidecar.fast_protocol import socket_path as fast_socket_path
from .store.tiers import checksum
from .store_client import as_bytes_view

Buffer = Any


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """Keys as one blob; a key of the wrong length is an :class:`~kvpool.errors.InvalidArgument`."""
    try:
        return _pack_keys(keys)
    except errors.InvalidArgument:
        raise
    except (ValueError, TypeError) as exc:
        raise errors.InvalidArgument(str(exc)) from None


class Blocks(list[memoryview]):
    """Views into the sidecar's arena, pinned by one lease until :meth:`release` or its expiry."""

    def __init__(self, views: list[memoryview], client: Client, lease_id: int) -> None:
        super().__init__(views)
        self.lease_id = lease_id
        self._client = client

    def release(self) -> None:
        if self.lease_id:
            self._client.release(self.lease_id)
            self.lease_id = 0

    def __enter__(self) -> Blocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Client:
    """A connection to one sidecar."""

    def __init__(self, address: str, block_tokens: int = 128, timeout: float = 30.0,
                 lease_ms: int = 10000, fast: bool | None = None) -> None:
        if not address.startswith("unix://"):
            raise errors.InvalidArgument(f"sidecar address must be unix:///path, got {address!r}")
        self.address = address
        self.block_tokens = block_tokens
        self.timeout = timeout
        self.lease_ms = lease_ms
        self._channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                                ("grpc.max_send_message_length", 64 << 20)])
        self._stub = spbg.SidecarStub(self._channel)
        hello = self._rpc(self._stub.Hello, pb.Empty())
        self.tenant_id = hello.tenant_id
        fd = os.open(hello.arena_path, os.O_RDWR)
        try:
            # MAP_POPULATE: map every page now instead of faulting 4 KiB at a time on first use.
            self._mmap = mmap.mmap(fd, hello.arena_bytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                   mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._arena = memoryview(self._mmap)
        self._arena_ro = self._arena.toreadonly()
        self._closed = False
        self._lock = threading.Lock()
        self._pending_matches: OrderedDict[bytes, int] = OrderedDict()  # first key → match lease
        self.max_pending_matches = 1024
        self._inflight: set[Any] = set()
        self._copier = Copier()
        self._fast: FastSession | None = None
        if fast is None:
            fast = os.environ.get("KVPOOL_FAST_SESSION", "1") != "0"
        if fast:
            try:
                self._fast = FastSession(fast_socket_path(address[len("unix://"):]), self.tenant_id,
                                         hello.arena_bytes, timeout)
            except (OSError, errors.KvpoolError):
                self._fast = None  # an older sidecar, or none beside this socket: gRPC only

    @property
    def fast_session(self) -> bool:
        """Whether the hot calls go over the fast session (else all over gRPC)."""
        return self._fast is not None

    def _rpc(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None

    # -- matching -----------------------------------------------------------------------------

    def match(self, keys: Sequence[bytes], lease_ms: int | None = None) -> int:
        """Blocks matched from the start (local tier or pool); pinned until ``get`` or the lease ends.

        The pin is remembered by the first key: a following :meth:`get` of keys starting with
        the same key consumes it (so matched blocks do not stay pinned for the whole lease).
        """
        n, lease_id = self.match_lease(keys, lease_ms)
        if lease_id:
            with self._lock:
                old = self._pending_matches.pop(keys[0], 0)
                self._pending_matches[keys[0]] = lease_id
                stale = [self._pending_matches.popitem(last=False)[1]
                         for _ in range(len(self._pending_matches) - self.max_pending_matches)]
            for lid in ([old] if old else []) + stale:
                self.release(lid)
        return n

    def match_lease(self, keys: Sequence[bytes], lease_ms: int | None = None) -> tuple[int, int]:
        """Like :meth:`match`, also returning the lease id (pass it to :meth:`get` or :meth:`release`)."""
        if not keys:
            return 0, 0
        if self._fast is not None:
            prefix, _, lease_id = self._fast.match(pack_keys(keys), lease_ms or self.lease_ms)
            return prefix, lease_id
        r = self._rpc(self._stub.Match, spb.MatchRequest(keys=pack_keys(keys), lease_ms=lease_ms or self.lease_ms))
        return r.prefix, r.lease_id

    def _consume_match(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        with self._lock:
            return self._pending_matches.pop(keys[0], 0)

    # -- reading ------------------------------------------------------------------------------

    def get(self, keys: Sequence[bytes], lease_id: int = 0, kind: int = pb.BLOCK) -> Blocks:
        """Views of the objects (equal to what was put); raises NotFound if any key is absent."""
        if not keys:
            return Blocks([], self, 0)
        if not lease_id and kind == pb.BLOCK:
            lease_id = self._consume_match(keys)
        r = self._read(pack_keys(keys), lease_id, kind)
        codes = list(r.codes)
        if any(c != pb.OK for c in codes):
            if r.lease_id:
                self.release(r.lease_id)
            missing = [i for i, c in enumerate(codes) if c != pb.OK]
            raise errors.NotFound(f"{len(missing)} of {len(keys)} keys not present (first at index {missing[0]})")
        ro = self._arena_ro
        views = [ro[o:o + s] for o, s in zip(r.offsets, r.sizes, strict=True)]
        return Blocks(views, self, r.lease_id)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[int]:
        """Copy objects into caller buffers; per-item sizes, -1 where absent (no exception)."""
        if len(keys) != len(buffers):
            raise errors.InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        r = self._read(pack_keys(keys), self._consume_match(keys), pb.BLOCK)
        out = []
        try:
            pairs = []
            for c, o, s, b in zip(r.codes, r.offsets, r.sizes, buffers, strict=True):
                if c != pb.OK:
                    out.append(-1)
                    continue
                dst = as_bytes_view(b)
                if len(dst) < s:
                    raise errors.InvalidArgument(f"buffer of {len(dst)} bytes for an object of {s}")
                pairs.append((self._arena[o:o + s], dst[:s]))
                out.append(s)
            self._copier.copy(pairs)  # one memcpy per object, a big batch over two threads
        finally:
            if r.lease_id:
                self._release_async(r.lease_id)
        return out

    def _read(self, keys: bytes, lease_id: int, kind: int) -> Any:
        """One Read (fast session or gRPC): codes, offsets, sizes, lease_id."""
        if self._fast is not None:
            return self._fast.read(keys, kind, self.lease_ms, lease_id)
        return self._rpc(self._stub.Read, spb.ReadRequest(keys=keys, lease_id=lease_id, kind=kind,
                                                          lease_ms=self.lease_ms))

    def _release_async(self, lease_id: int) -> None:
        """Drop a lease without waiting for the answer: the copy is done, so the caller need not
        pay a second round trip (~0.3-1 ms); a lost release expires with the lease."""
        if self._closed:
            return
        if self._fast is not None:
            try:
                self._fast.release([lease_id], wait=False)
                return
            except errors.KvpoolError:
                pass  # the gRPC path below
        fut = self._stub.Release.future(spb.LeaseRequest(lease_ids=[lease_id]), timeout=self.timeout)
        with self._lock:
            self._inflight.add(fut)  # a collected future cancels its call
        fut.add_done_callback(self._forget)

    def _forget(self, fut: Any) -> None:
        with self._lock:
            self._inflight.discard(fut)

    def release(self, lease_id: int) -> None:
        if lease_id and not self._closed:
            if self._fast is not None:
                self._fast.release([lease_id])
                return
            self._rpc(self._stub.Release, spb.LeaseRequest(lease_ids=[lease_id]))

    # -- writing ------------------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], values: Sequence[Buffer], traffic_class: str = "chatbot",
            kind: int = pb.BLOCK) -> list[int]:
        """Store objects: visible locally at once, written to the pool by the sidecar; per-item codes."""
        if len(keys) != len(values):
            raise errors.InvalidArgument(f"{len(keys)} keys but {len(values)} values")
        if not keys:
            return []
        views = [as_bytes_view(v) for v in values]
        blob, sizes = pack_keys(keys), [len(v) for v in views]
        if self._fast is not None:
            codes, offsets, rid = self._fast.write_start(blob, sizes, kind, traffic_class)
        else:
            start = self._rpc(self._stub.WriteStart, spb.WriteStartRequest(
                keys=blob, sizes=sizes, traffic_class=traffic_class, kind=kind))
            codes, offsets, rid = list(start.codes), list(start.offsets), start.reservation_id
        if not rid:
            return codes
        sums = [0] * len(keys)
        arena = self._arena
        for i, c in enumerate(codes):
            if c == pb.OK:
                off = offsets[i]
                arena[off:off + len(views[i])] = views[i]
                sums[i] = checksum(views[i])
        if self._fast is not None:
            final = self._fast.write_commit(rid, sums)
        else:
            final = list(self._rpc(self._stub.WriteCommit, spb.WriteCommitRequest(reservation_id=rid,
                                                                                  checksums=sums)).codes)
        for i, c in enumerate(codes):
            if c == pb.OK:
                codes[i] = final[i]
        return codes

    def remove(self, keys: Sequence[bytes], kind: int = pb.BLOCK) -> list[int]:
        return list(self._rpc(self._stub.Remove, pb.RemoveRequest(keys=pack_keys(keys), kind=kind)).codes)

    # -- state objects ------------------------------------------------------------------------

    def _check_position(self, position: int) -> None:
        if position <= 0 or position % self.block_tokens:
            raise errors.InvalidArgument(
                f"state attach position {position} must be a positive multiple of {self.block_tokens}")

    def put_state(self, key: bytes, position: int, value: Buffer) -> int:
        """Store a state object keyed by the block key at its attach position (host memory only)."""
        self._check_position(position)
        return self.put([key], [value], kind=pb.STATE)[0]

    def get_state(self, key: bytes, position: int) -> memoryview | None:
        """The state object at ``position`` (a copy-free view, pinned for the lease), or None."""
        self._check_position(position)
        try:
            return self.get([key], kind=pb.STATE)[0]
        except errors.NotFound:
            return None

    def has_states(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        r = self._rpc(self._stub.Match, spb.MatchRequest(keys=pack_keys(keys), per_key=True, kind=pb.STATE))
        return [b == 1 for b in r.present]

    def plan(self, prompt_tokens: int, keys: Sequence[bytes], window_tokens: int = 128,
             rollback_tokens: int = 6) -> HitPlan:
        """Match + state lookup + :func:`~kvpool.planning.plan_hit` in one call (DESIGN §5)."""
        b = self.block_tokens
        matched = self.match(keys) if keys else 0
        positions: list[int] = []
        if window_tokens:
            cap = max(0, prompt_tokens - max(1, window_tokens + rollback_tokens))
            l1 = (min(matched * b, cap) // b) * b
            cands = [p for p in (l1, l1 - b) if p > 0 and p // b - 1 < len(keys)]
            if cands:
                have = self.has_states([keys[p // b - 1] for p in cands])
                positions = [p for p, h in zip(cands, have, strict=True) if h]
        return plan_hit(prompt_tokens, matched * b, positions, b, window_tokens, rollback_tokens)

    # -- misc ---------------------------------------------------------------------------------

    def stats(self) -> spb.SidecarStats:
        return self._rpc(self._stub.Stats, pb.Empty())

    def flush(self, timeout_ms: int = 10000) -> spb.FlushReply:
        return self._rpc(self._stub.Flush, spb.FlushRequest(timeout_ms=timeout_ms))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._fast is not None:
            self._fast.close()
        self._copier.close()
        self._channel.close()
        try:
            self._arena_ro.release()
            self._arena.release()
            self._mmap.close()
        except BufferError:
            pass  # views handed out are still alive; the mapping goes with them

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(address: str, block_tokens: int = 128, timeout: float = 30.0) -> Client:
    """Connect to a sidecar at ``unix:///path/to/sidecar.sock``."""
    return Client(address, block_tokens=block_tokens, timeout=timeout)
