"""What an engine imports: ``kvpool.connect(address) -> Client``.

The client talks gRPC to its sidecar over a unix socket for metadata (the hot calls — match,
read, write, release — over the binary fast session beside it, :mod:`kvpool.client.session`, when
the sidecar has one) and maps the sidecar's shared-memory arena for bytes: ``get`` returns
views into the arena (zero copy, valid while their lease holds), ``put`` costs one copy into
it; ``get_ranges`` reads only byte ranges of an object (sparse attention's top-k entries)
without the rest of it moving anywhere.  Thread-safe; a context manager.

Sidecar restarts: the sidecar's HELLO names its life (incarnation) and its arena's generation.
Offsets are turned into views only with the mapping of the life that gave them: a reply of
another life first makes the client say Hello again, remap the arena if its generation changed,
and forget the old life's pending match leases (:meth:`Client._on_new_life`); a gRPC call names
the life it was made for and the sidecar refuses it if that is not its own.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Self, cast

import grpc
import numpy as np

from kvpool.client.session import FastSession, RegistrationRefused
from kvpool.core import errors, ranges, spill
from kvpool.core import handoff_record as _ho
from kvpool.core.checksum import checksum
from kvpool.core.deadlines import ClientDeadlines
from kvpool.core.keys import pack_keys as _pack_keys
from kvpool.core.planning import HitPlan, plan_hit, state_store_position
from kvpool.pool.node_client import as_bytes_view
from kvpool.transfer import memfd
from kvpool.transfer.copier import Copier
from kvpool.wire import grpc_status
from kvpool.wire.proto import sidecar_pb2 as spb
from kvpool.wire.proto import sidecar_pb2_grpc as spbg
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.sidecar_frames import socket_path as fast_socket_path

Buffer = Any
log = logging.getLogger("kvpool.client.client")


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """Keys as one blob; a key of the wrong length is an :class:`~kvpool.core.errors.InvalidArgument`."""
    try:
        return _pack_keys(keys)
    except errors.InvalidArgument:
        raise
    except (ValueError, TypeError) as exc:
        raise errors.InvalidArgument(str(exc)) from None


def _leading_ok(codes: Sequence[int]) -> int:
    """How many codes from the start are OK (a prefix ends at the first that is not)."""
    return next((i for i, c in enumerate(codes) if c != pb.OK), len(codes))


class _Leased:
    """What holds one sidecar lease: released once, by :meth:`release`, the ``with`` block's end
    or the lease's expiry."""

    lease_id: int
    _client: Client

    def release(self) -> None:
        if self.lease_id:
            self._client.release(self.lease_id)
            self.lease_id = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Blocks(_Leased, list[memoryview]):
    """Views of objects, pinned by one lease until :meth:`release` or its expiry: into the
    sidecar's arena, or (objects the arena had no room for) into memory of this client's own,
    which lives as long as the views."""

    def __init__(self, views: list[memoryview], client: Client, lease_id: int) -> None:
        super().__init__(views)
        self.lease_id = lease_id
        self._client = client


class HandoffResult(_Leased):
    """What the decode side has after :meth:`Client.accept_handoff`: the plan, the blocks and
    the state (views into the arena, pinned until :meth:`release` or the lease's end), where the
    state came from, and timings (seconds).  Its own lease is the state's."""

    def __init__(self, record: _ho.HandoffRecord, plan: HitPlan, blocks: Blocks, block_codes: list[int],
                 state: memoryview | None, state_outcome: _ho.StateOutcome, state_detail: str,
                 state_lease_id: int, client: Client, blocks_local_seconds: float, state_seconds: float,
                 total_seconds: float, pool_hits: int, local_hits: int) -> None:
        self.record = record
        self.plan = plan
        self.blocks = blocks
        """Views of the record's leading local blocks, in order (all of them when none is missing)."""
        self.block_codes = block_codes
        self.state = state
        self.state_outcome = state_outcome
        self.state_detail = state_detail
        self.blocks_local_seconds = blocks_local_seconds
        """Sidecar time from the accept to every block local."""
        self.state_seconds = state_seconds
        self.total_seconds = total_seconds
        """Client time of the whole call."""
        self.pool_hits = pool_hits
        self.local_hits = local_hits
        self.lease_id = state_lease_id
        self._client = client

    @property
    def local_blocks(self) -> int:
        """Leading blocks of the record that are local now."""
        return _leading_ok(self.block_codes)

    @property
    def missing_blocks(self) -> int:
        return sum(c != pb.OK for c in self.block_codes)

    @property
    def complete(self) -> bool:
        """Every block local, and the state too when the record names one."""
        return not self.missing_blocks and self.state_outcome not in (_ho.StateOutcome.EXPIRED,
                                                                     _ho.StateOutcome.GONE)

    def release(self) -> None:
        self.blocks.release()
        super().release()


class Reads(_Leased):
    """The answer of :meth:`Client.get_many`: per key its code (OK, NOT_FOUND, ...) and a view
    of the object (None where the code is not OK), the views held by one lease until
    :meth:`release` or its expiry (as :class:`Blocks`)."""

    def __init__(self, codes: list[int], views: list[memoryview | None], client: Client, lease_id: int) -> None:
        self.codes, self.views = codes, views
        self.lease_id = lease_id
        self._client = client

    @property
    def prefix(self) -> int:
        """How many keys from the start were read (what an engine can use of a matched prefix)."""
        return _leading_ok(self.codes)


class RangeReads(_Leased):
    """The answer of :meth:`Client.get_ranges_many`: per key its code, the object's size and
    views of its ranges in the sidecar's arena (None where the code is not OK), all held by one
    lease until :meth:`release` or its expiry."""

    def __init__(self, codes: list[int], sizes: list[int], views: list[list[memoryview] | None], client: Client,
                 lease_id: int) -> None:
        self.codes, self.sizes, self.views = codes, sizes, views
        self.lease_id = lease_id
        self._client = client


class _Arena:
    """The client's mapping of the sidecar's arena, for the offsets of one sidecar life."""

    __slots__ = ("incarnation", "generation", "path", "nbytes", "mmap", "rw", "ro")

    def __init__(self, incarnation: int, generation: int, path: str, nbytes: int, mm: mmap.mmap,
                 rw: memoryview, ro: memoryview) -> None:
        self.incarnation, self.generation, self.path, self.nbytes = incarnation, generation, path, nbytes
        self.mmap, self.rw, self.ro = mm, rw, ro

    @classmethod
    def map(cls, hello: spb.HelloReply) -> _Arena:
        fd = os.open(hello.arena_path, os.O_RDWR)
        try:
            # MAP_POPULATE: map every page now instead of faulting 4 KiB at a time on first use.
            mm = mmap.mmap(fd, hello.arena_bytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        rw = memoryview(mm)
        return cls(hello.incarnation, hello.arena_generation, hello.arena_path, hello.arena_bytes, mm, rw,
                   rw.toreadonly())

    def same_arena(self, hello: spb.HelloReply) -> bool:
        """Whether ``hello`` names the arena this maps (a sidecar that adopted it)."""
        return bool(self.generation) and (hello.arena_generation, hello.arena_path, hello.arena_bytes) == \
            (self.generation, self.path, self.nbytes)

    def close(self) -> None:
        try:
            self.ro.release()
            self.rw.release()
            self.mmap.close()
        except BufferError:
            pass  # views handed out are still alive; the mapping goes with them


class Client:
    """A connection to one sidecar."""

    def __init__(self, address: str, block_tokens: int = 128, timeout: float = 30.0,
                 lease_ms: int = 10000, fast: bool | None = None, deadlines: ClientDeadlines | None = None) -> None:
        """``timeout``: the bound of every call without one of its own; ``deadlines``: the bounds
        of match, get and put (default :class:`~kvpool.core.deadlines.ClientDeadlines`: 0.8 s each, a
        ``get_into`` 1 s more per 100 MB of its buffers).  A
        call past its bound raises :class:`~kvpool.core.errors.DeadlineExceeded`; the client stays
        usable."""
        if not address.startswith("unix://"):
            raise errors.InvalidArgument(f"sidecar address must be unix:///path, got {address!r}")
        self.address = address
        self.block_tokens = block_tokens
        self.timeout = timeout
        self.deadlines = deadlines or ClientDeadlines(other_seconds=timeout)
        self.lease_ms = lease_ms
        self._channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                                ("grpc.max_send_message_length", 64 << 20)])
        self._stub = spbg.SidecarStub(self._channel)
        hello = self._hello()
        self.tenant_id = hello.tenant_id
        self.handoff_address = hello.handoff_address
        """Where this sidecar exports state objects to decode sidecars ("" when it does not)."""
        self.instance_id = hello.instance_id
        self._map = _Arena.map(hello)
        self._life_lock = threading.Lock()
        self.restarts_seen = 0
        """Sidecar lives after the first this client moved to (restarts it noticed)."""
        self._pool_behind = hello.pool_nodes > 0
        """Whether the sidecar has a pool to stream a put batch larger than its tier to."""
        self._closed = False
        self._lock = threading.Lock()
        self._pending_matches: OrderedDict[bytes, int] = OrderedDict()  # first key → match lease
        self.max_pending_matches = 1024
        self._inflight: set[Any] = set()
        self._done_range_leases: list[int] = []  # see _range_lease_done
        self._copier = Copier()
        self._regions: dict[int, memfd.Region] = {}  # alloc_buffer's memory, by region id
        self._region_starts: list[tuple[int, int]] = []  # (address, region id), sorted
        self._region_ids = itertools.count(1)
        self._unregistrable: set[int] = set()  # regions the sidecar refused to map
        self._fast: FastSession | None = None
        self._read_into_ok = True
        """Whether the sidecar takes READ_INTO (an older one does not: get_into then copies)."""
        if fast is None:
            fast = os.environ.get("KVPOOL_FAST_SESSION", "1") != "0"
        if fast:
            try:
                self._fast = FastSession(fast_socket_path(address[len("unix://"):]), self.tenant_id,
                                         hello.arena_bytes, timeout, incarnation=hello.incarnation,
                                         on_new_life=self._on_new_life)
                self._fast.arena_bytes = self._map.nbytes  # a life met while it said HELLO may have remapped
            except (OSError, errors.KvpoolError):
                self._fast = None  # an older sidecar, or none beside this socket: gRPC only

    @property
    def fast_session(self) -> bool:
        """Whether the hot calls go over the fast session (else all over gRPC)."""
        return self._fast is not None

    @property
    def _arena(self) -> memoryview:
        return self._map.rw

    @property
    def _arena_ro(self) -> memoryview:
        return self._map.ro

    def _hello(self) -> spb.HelloReply:
        try:
            return cast(spb.HelloReply, self._stub.Hello(pb.Empty(), timeout=self.timeout))
        except grpc.RpcError as err:
            raise grpc_status.from_rpc_error(err) from None

    def _on_new_life(self, seen: int = -1) -> int:
        """The sidecar is another life than the one this client holds (``seen``; -1: a call was
        refused for it): say Hello again, remap the arena unless the new life adopted the same
        one, forget the old life's pending match leases.  Returns the incarnation now held."""
        with self._life_lock:
            old = self._map
            if seen == old.incarnation:
                return seen  # another thread moved to it already
            hello = self._hello()
            if hello.tenant_id != self.tenant_id:
                raise errors.PermissionDenied(f"the sidecar at {self.address} now serves tenant "
                                              f"{hello.tenant_id!r}, not {self.tenant_id!r}")
            if hello.incarnation == old.incarnation:
                return old.incarnation
            new = _Arena(hello.incarnation, old.generation, old.path, old.nbytes, old.mmap, old.rw, old.ro) \
                if old.same_arena(hello) else _Arena.map(hello)
            with self._lock:
                self._pending_matches.clear()  # leases of a dead process
                self._done_range_leases = []
            if self._fast is not None:
                self._fast.arena_bytes = new.nbytes
            self._map = new
            self.restarts_seen += 1
            self.instance_id = hello.instance_id
            self.handoff_address = hello.handoff_address
            log.warning("kvpool: the sidecar at %s was restarted; %s", self.address,
                        "it kept the arena" if new.mmap is old.mmap else "the arena was remapped")
            return new.incarnation

    def _life(self, incarnation: int) -> _Arena:
        """The mapping for offsets given by sidecar life ``incarnation`` (moving to that life if
        it is newer); SidecarRestarted if this client cannot hold it."""
        m = self._map
        if m.incarnation == incarnation:
            return m
        self._on_new_life(incarnation)
        m = self._map
        if m.incarnation != incarnation:
            raise errors.SidecarRestarted(f"the sidecar at {self.address} changed lives during the call")
        return m

    def _rpc(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        # Any: the generated gRPC stubs are untyped; callers returning the reply cast it to its message.
        return self._rpc_life(method, request, timeout)[0]

    def _rpc_life(self, method: Any, request: Any, timeout: float | None = None) -> tuple[Any, _Arena]:
        """One gRPC call made for the sidecar life this client holds, and that life's mapping;
        a call refused because the sidecar is another life is made again, once, after moving
        to the new life.  ``timeout``: the call's bound (default: the client's ``timeout``)."""
        for attempt in range(2):
            m = self._map
            try:
                return method(request, timeout=timeout or self.timeout,
                              metadata=((errors.INCARNATION_METADATA, str(m.incarnation)),)), m
            except grpc.RpcError as err:
                exc = grpc_status.from_rpc_error(err)
                if not isinstance(exc, errors.SidecarRestarted) or attempt:
                    raise exc from None
            self._on_new_life()
        raise AssertionError("not reached")

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
        bound = self.deadlines.match_seconds
        if self._fast is not None:
            prefix, _, lease_id = self._fast.match(pack_keys(keys), lease_ms or self.lease_ms, timeout=bound)
            return prefix, lease_id
        r = self._rpc(self._stub.Match, spb.MatchRequest(keys=pack_keys(keys), lease_ms=lease_ms or self.lease_ms),
                      bound)
        return r.prefix, r.lease_id

    def _consume_match(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        with self._lock:
            return self._pending_matches.pop(keys[0], 0)

    # -- reading ------------------------------------------------------------------------------

    def get(self, keys: Sequence[bytes], lease_id: int = 0, kind: int = pb.BLOCK) -> Blocks:
        """Views of the objects (equal to what was put), all or nothing: raises NotFound if any
        key is absent (neither in the local tier nor in the pool; the views read are released).
        :meth:`get_many` answers per key instead.

        An object the pool holds but the local tier has no room for (every extent pinned, or it
        is larger than the tier) is read into memory of this client's own, so a matched prefix
        stays readable (fast session; over gRPC only, such an object counts as absent)."""
        if not keys:
            return Blocks([], self, 0)
        if not lease_id and kind == pb.BLOCK:
            lease_id = self._consume_match(keys)
        r, m = self._read(pack_keys(keys), lease_id, kind)
        codes = list(r.codes)
        ro = m.ro
        if any(c != pb.OK for c in codes):
            views = self._spilled(keys, codes, r, m, kind)
            if any(c != pb.OK for c in codes):
                if r.lease_id:
                    self.release(r.lease_id)
                missing = [i for i, c in enumerate(codes) if c != pb.OK]
                raise errors.NotFound(f"{len(missing)} of {len(keys)} keys not present (first at index "
                                      f"{missing[0]}: {errors.code_name(codes[missing[0]])})")
            return Blocks([v for v in views if v is not None], self, r.lease_id)  # all OK: every one
        return Blocks([ro[o:o + s] for o, s in zip(r.offsets, r.sizes, strict=True)], self, r.lease_id)

    def get_many(self, keys: Sequence[bytes], lease_id: int = 0, kind: int = pb.BLOCK) -> Reads:
        """Per-key reads: what is present comes back as views (as :meth:`get`), what is truly
        gone as its code (NOT_FOUND; NO_SPACE only where the object could be read neither into
        the arena nor into this client's memory) — one missing object never fails the others.
        ``Reads.prefix`` is the leading run read, what an engine loads of a matched prefix."""
        if not keys:
            return Reads([], [], self, 0)
        if not lease_id and kind == pb.BLOCK:
            lease_id = self._consume_match(keys)
        r, m = self._read(pack_keys(keys), lease_id, kind)
        codes = list(r.codes)
        views = self._spilled(keys, codes, r, m, kind)
        return Reads(codes, views, self, r.lease_id)

    def _spilled(self, keys: Sequence[bytes], codes: list[int], r: Any, m: _Arena,
                 kind: int) -> list[memoryview | None]:
        """Views of a READ's objects: in the arena where it answered OK; its NO_SPACE rows (in
        the pool, no room in the arena) read now into one region of this client's memory, made
        for that read (:func:`kvpool.core.spill.layout`) — ``codes`` is updated in place.  ``m``: the
        arena mapping of the sidecar life that answered the READ."""
        ro = m.ro
        views: list[memoryview | None] = [ro[o:o + s] if c == pb.OK else None
                                          for c, o, s in zip(codes, r.offsets, r.sizes, strict=True)]
        spill_at = [i for i, c in enumerate(codes) if c == pb.NO_SPACE]
        if not spill_at or self._fast is None or not self._read_into_ok:
            return views
        sizes = [int(r.sizes[i]) for i in spill_at]
        offsets, total = spill.layout(sizes)
        region = memfd.create(total, "kvpool-spill")
        rid = next(self._region_ids)
        n = len(spill_at)
        targets = np.array([rid] * n + offsets + sizes, np.uint64)
        try:
            got, got_sizes = self._fast.read_into(pack_keys([keys[i] for i in spill_at]), kind, targets,
                                                  {rid: region}, transient=True,
                                                  timeout=self.deadlines.read_bound(total))
        except (RegistrationRefused, errors.Unavailable) as exc:
            log.warning("kvpool: %d objects with no room in the local tier not read: %s", n, exc)
            region.close()
            return views
        finally:
            if region.fd is not None:
                os.close(region.fd)  # the sidecar has unmapped it: the views keep the mapping
                region.fd = None
        mem = memoryview(region.mapping).toreadonly()
        for j, i in enumerate(spill_at):
            codes[i] = got[j]
            if got[j] == pb.OK:
                views[i] = mem[offsets[j]:offsets[j] + got_sizes[j]]
        return views

    def alloc_buffer(self, nbytes: int) -> np.ndarray:
        """Memory the sidecar can write into: ``get_into`` of buffers inside it lands the pool's
        bytes there directly, as Mooncake's registered buffers do (no arena→caller copy; the
        local tier is left as it was — a read-through, for engines with a host cache of their
        own), and copies local hits into it in the sidecar.  A uint8 array of ``nbytes``
        (zero-filled, its pages populated), shareable by slicing; :meth:`free_buffer` returns it.
        The memory is a sealed memfd the sidecar maps when first used (``kvpool.transfer.memfd``)."""
        region = memfd.create(nbytes, "kvpool-client-buffer")
        with self._lock:
            rid = next(self._region_ids)
            self._regions[rid] = region
            self._region_starts = sorted(self._region_starts + [(region.address, rid)])
        return np.frombuffer(region.mapping, np.uint8)

    def free_buffer(self, buffer: Buffer) -> None:
        """Give back memory from :meth:`alloc_buffer` (the sidecar unmaps it; arrays of it that
        are still alive keep it mapped here until they go)."""
        extent = memfd.writable_extent(buffer)
        rid = self._region_of(*extent) if extent is not None else None
        if rid is None:
            raise errors.InvalidArgument("not a buffer from alloc_buffer of this client")
        with self._lock:
            region = self._regions.pop(rid)
            self._region_starts = [(a, r) for a, r in self._region_starts if r != rid]
            self._unregistrable.discard(rid)
        if self._fast is not None:
            self._fast.forget_region(rid)
        region.close()

    def is_registered(self, buffer: Buffer) -> bool:
        """Whether ``get_into`` lands pool bytes in ``buffer`` directly (it lies in memory from
        :meth:`alloc_buffer` that the sidecar has not refused)."""
        extent = memfd.writable_extent(buffer)
        rid = self._region_of(*extent) if extent is not None else None
        return rid is not None and rid not in self._unregistrable

    def _region_of(self, addr: int, nbytes: int) -> int | None:
        """The id of the registered region that holds all of ``nbytes`` at ``addr``, or None."""
        if nbytes == 0:
            return None
        starts = self._region_starts
        at = bisect.bisect_right(starts, (addr, 1 << 62)) - 1
        if at < 0:
            return None
        base, rid = starts[at]
        region = self._regions.get(rid)
        if region is None or addr + nbytes > base + region.size:
            return None
        return rid

    def _registered_spans(self, buffers: Sequence[Buffer]) -> np.ndarray | None:
        """READ_INTO targets (region ids, offsets, lengths: u64 × n each) when every buffer lies
        inside memory from :meth:`alloc_buffer`; None otherwise.  About a microsecond a buffer
        (the read of 16 objects spent ~70 us here when it built two views of each)."""
        n = len(buffers)
        ids, offsets, lengths = [0] * n, [0] * n, [0] * n
        regions = self._regions
        for i, b in enumerate(buffers):
            extent = memfd.writable_extent(b)
            if extent is None:
                return None
            addr, nbytes = extent
            rid = self._region_of(addr, nbytes)
            if rid is None or rid in self._unregistrable:
                return None
            ids[i], offsets[i], lengths[i] = rid, addr - regions[rid].address, nbytes
        return np.array(ids + offsets + lengths, np.uint64)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[int]:
        """Copy objects into caller buffers; per-item sizes, -1 where absent (no exception).
        Buffers inside memory from :meth:`alloc_buffer` get the pool's bytes directly."""
        if len(keys) != len(buffers):
            raise errors.InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        if self._fast is not None and self._regions and self._read_into_ok:
            spans = self._registered_spans(buffers)
            if spans is not None:
                try:
                    return self._get_into_registered(keys, buffers, spans)
                except RegistrationRefused as exc:
                    # The sidecar keeps its memory limits: this region is read into through
                    # the arena from now on (one copy more), not refused on every call.
                    log.warning("kvpool: %s; reads into it go through the arena", exc)
                    with self._lock:
                        self._unregistrable.add(exc.region_id)
                except errors.Unavailable:
                    # An older sidecar (no READ_INTO) or a broken connection: the arena path
                    # below says which; an older sidecar is not asked again.
                    self._read_into_ok = self._fast_session_supports_read_into()
        r, m = self._read(pack_keys(keys), self._consume_match(keys), pb.BLOCK)
        arena = m.rw
        out = []
        try:
            codes = list(r.codes)
            # Objects the arena had no room for come through memory of this client's (one copy more).
            spilled = self._spilled(keys, codes, r, m, pb.BLOCK) if pb.NO_SPACE in codes else None
            pairs = []
            for i, (c, o, s, b) in enumerate(zip(codes, r.offsets, r.sizes, buffers, strict=True)):
                if c != pb.OK:
                    out.append(-1)
                    continue
                src = arena[o:o + s] if spilled is None or r.codes[i] == pb.OK else spilled[i]
                assert src is not None
                s = len(src)
                dst = as_bytes_view(b)
                if len(dst) < s:
                    raise errors.InvalidArgument(f"buffer of {len(dst)} bytes for an object of {s}")
                pairs.append((src, dst[:s]))
                out.append(s)
            self._copier.copy(pairs)  # one memcpy per object, a big batch over two threads
        finally:
            if r.lease_id:
                self._release_async(r.lease_id)
        return out

    def _get_into_registered(self, keys: Sequence[bytes], buffers: Sequence[Buffer], spans: np.ndarray) -> list[int]:
        assert self._fast is not None
        with self._lock:
            regions = dict(self._regions)
        n = len(keys)
        codes, sizes = self._fast.read_into(pack_keys(keys), pb.BLOCK, spans, regions, self._consume_match(keys),
                                            timeout=self.deadlines.read_bound(int(spans[2 * n:].sum())))
        out = []
        for i, (c, size) in enumerate(zip(codes, sizes, strict=True)):
            if c == pb.INVALID:
                raise errors.InvalidArgument(f"buffer of {as_bytes_view(buffers[i]).nbytes} bytes for an object "
                                             f"of {size}")
            out.append(size if c == pb.OK else -1)
        return out

    def _fast_session_supports_read_into(self) -> bool:
        """Whether the sidecar answers READ_INTO (an older one closes the connection on it)."""
        assert self._fast is not None
        try:
            self._fast.read_into(b"", pb.BLOCK, np.zeros(0, np.uint64), {})
        except errors.Unavailable:
            return False
        return True

    # -- sparse reading -----------------------------------------------------------------------

    def _read_ranges(self, keys: Sequence[bytes], per_key: Sequence[Any], kind: int, verify_object: bool
                     ) -> tuple[Any, list[tuple[ranges.Pairs, Any]], list[ranges.Pairs], _Arena]:
        """The ReadRanges call; ranges refused here (negative, not integers, wrong shape) are
        sent as none, so the sidecar answers INVALID for them.  Returns the reply, the ranges sent
        (coalesced, with each asked range's merged index), the ranges asked, normalised, and the
        mapping the offsets are in."""
        if len(keys) != len(per_key):
            raise errors.InvalidArgument(f"{len(keys)} keys but {len(per_key)} range lists")
        pairs = [ranges.normalize(r)[0] for r in per_key]
        merged = [ranges.coalesce(p) for p in pairs]  # abutting ranges as one: fewer to move and copy
        counts, blob = ranges.encode([m for m, _ in merged])
        with self._lock:
            done, self._done_range_leases = self._done_range_leases, []
        r, m = self._rpc_life(self._stub.ReadRanges, spb.ReadRangesRequest(
            keys=pack_keys(keys), counts=counts.tolist(), ranges=blob, kind=grpc_status.as_kind(kind),
            lease_ms=self.lease_ms, verify_object=verify_object, release_lease_ids=done), self.deadlines.read_seconds)
        return r, merged, pairs, m

    def _range_lease_done(self, lease_id: int) -> None:
        """A ranged read's lease whose bytes were copied out: dropped by the next ranged read in
        its own call (no second round trip per read), or, past a few, in one release now; one
        that no call follows ends with its lease (``lease_ms``)."""
        with self._lock:
            self._done_range_leases.append(lease_id)
            if len(self._done_range_leases) < 16:
                return
            done, self._done_range_leases = self._done_range_leases, []
        self._release_many_async(done)

    def get_ranges_many(self, keys: Sequence[bytes], per_key: Sequence[Any], kind: int = pb.BLOCK,
                        verify_object: bool = False) -> RangeReads:
        """Sparse read of several objects: for each key a list of ``(offset, length)`` byte
        ranges; per key a code (OK, NOT_FOUND, INVALID for ranges it cannot serve, ...) and, where
        OK, views of exactly those ranges in the arena (zero copy; held by the lease).  Only the
        ranges move: from the local tier in place, or from the owner node into scratch space
        (the object is not pulled into the local tier)."""
        if not keys:
            return RangeReads([], [], [], self, 0)
        r, merged, pairs, life = self._read_ranges(keys, per_key, kind, verify_object)
        ro = life.ro
        views: list[list[memoryview] | None] = []
        at = 0
        for c, p, (m, group) in zip(r.codes, pairs, merged, strict=True):
            if c == pb.OK:
                # An asked range sits in its merged range at its distance from the merged start.
                base = np.asarray(r.offsets[at:at + len(m)], np.int64)[group]
                where = (base + (p[:, 0].astype(np.int64) - m[group, 0].astype(np.int64))).tolist()
                views.append([ro[o:o + n] for o, n in zip(where, p[:, 1].tolist(), strict=True)])
            else:
                views.append(None)
            at += len(m)
        return RangeReads(list(r.codes), list(r.sizes), views, self, r.lease_id)

    def get_ranges(self, key: bytes, per_range: Any, kind: int = pb.BLOCK) -> Blocks:
        """Views of byte ranges ``[(offset, length), ...]`` of one object (see
        :meth:`get_ranges_many`); raises NotFound if absent, InvalidArgument for ranges it
        cannot serve (out of bounds, zero length, too many)."""
        arr, why = ranges.normalize(per_range)
        if why:
            raise errors.InvalidArgument(why)
        got = self.get_ranges_many([key], [arr], kind)
        code, size = got.codes[0], got.sizes[0]
        views = got.views[0]
        if code != pb.OK or views is None:
            got.release()
            if code == pb.INVALID and size:
                raise errors.InvalidArgument(f"ranges cannot be served from the {size}-byte object: "
                                             + (ranges.check(arr, size) or "too many bytes in one read"))
            raise errors.error_for_code(code, f"ranged read of the key: {errors.code_name(code)}")
        return Blocks(views, self, got.lease_id)

    def get_ranges_into(self, keys: Sequence[bytes], per_key: Sequence[Any], buffers: Sequence[Buffer],
                        kind: int = pb.BLOCK) -> list[int]:
        """Copy only the byte ranges of each object, back to back in the order asked, into the
        caller's ``buffers``; per-key codes (a buffer smaller than its ranges is INVALID and its
        key is not asked for)."""
        if len(keys) != len(buffers) or len(keys) != len(per_key):
            raise errors.InvalidArgument(f"{len(keys)} keys, {len(per_key)} range lists, {len(buffers)} buffers")
        if not keys:
            return []
        dsts = [as_bytes_view(b) for b in buffers]
        norm = [ranges.normalize(r)[0] for r in per_key]
        small = [dsts[i].nbytes < ranges.total_bytes(p) for i, p in enumerate(norm)]
        ask = [i for i in range(len(keys)) if not small[i]]
        codes: list[int] = [pb.INVALID] * len(keys)
        if not ask:
            return codes
        r, merged, _, life = self._read_ranges([keys[i] for i in ask], [per_key[i] for i in ask], kind, False)
        try:
            arena = life.rw
            pairs: list[tuple[memoryview, memoryview]] = []
            at = 0
            for j, i in enumerate(ask):
                m = merged[j][0]  # the same back-to-back bytes as the ranges asked
                codes[i] = r.codes[j]
                if r.codes[j] == pb.OK:
                    dst, pos = dsts[i], 0
                    for o, n in zip(r.offsets[at:at + len(m)], m[:, 1].tolist(), strict=True):
                        pairs.append((arena[o:o + n], dst[pos:pos + n]))
                        pos += n
                at += len(m)
            self._copier.copy(pairs)  # as get_into: one pass, big batches on two threads
        finally:
            if r.lease_id:
                self._range_lease_done(r.lease_id)
        return codes

    def _read(self, keys: bytes, lease_id: int, kind: int) -> tuple[Any, _Arena]:
        """One Read (fast session or gRPC): (codes, offsets, sizes, lease_id), and the mapping
        of the sidecar life whose arena the offsets are in."""
        bound = self.deadlines.read_seconds
        if self._fast is not None:
            r = self._fast.read(keys, kind, self.lease_ms, lease_id, timeout=bound)
            return r, self._life(r.incarnation)
        return self._rpc_life(self._stub.Read, spb.ReadRequest(keys=keys, lease_id=lease_id,
                                                               kind=grpc_status.as_kind(kind), lease_ms=self.lease_ms),
                              bound)

    def _release_async(self, lease_id: int) -> None:
        """Drop a lease without waiting for the answer: the copy is done, so the caller need not
        pay a second round trip (~0.3-1 ms); a lost release expires with the lease."""
        self._release_many_async([lease_id])

    def _release_many_async(self, lease_ids: list[int]) -> None:
        if self._closed or not lease_ids:
            return
        if self._fast is not None:
            try:
                self._fast.release(list(lease_ids), wait=False)
                return
            except errors.KvpoolError:
                pass  # the gRPC path below
        fut = self._stub.Release.future(spb.LeaseRequest(lease_ids=lease_ids), timeout=self.timeout)
        with self._lock:
            self._inflight.add(fut)  # a collected future cancels its call
        fut.add_done_callback(self._forget)

    def _forget(self, fut: Any) -> None:
        with self._lock:
            self._inflight.discard(fut)

    def release(self, lease_id: int) -> None:
        """Drop a lease, within the write bound.  A sidecar that does not answer in time (hung,
        restarting) is not an error here: the lease ends by itself at its expiry, and raising
        would fail the engine's ``with`` block after its read had succeeded."""
        if lease_id and not self._closed:
            bound = self.deadlines.write_seconds
            try:
                if self._fast is not None:
                    self._fast.release([lease_id], timeout=bound)
                    return
                self._rpc(self._stub.Release, spb.LeaseRequest(lease_ids=[lease_id]), bound)
            except errors.Unavailable as exc:  # DeadlineExceeded too
                log.debug("kvpool: lease %d not released (it expires by itself): %s", lease_id, exc)

    # -- writing ------------------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], values: Sequence[Buffer], traffic_class: str = "chatbot",
            kind: int = pb.BLOCK, wait: bool = False, wait_seconds: float = 5.0) -> list[int]:
        """Store objects: visible locally at once, written to the pool by the sidecar; per-item codes.

        By default the codes are the local tier's and the pool write follows in the background
        (its refusals show only in counters).  ``wait=True``: the sidecar writes the objects to
        the pool before answering, and the code of each object stored locally is the pool's
        verdict — OK (or ALREADY_EXISTS), QUOTA_EXCEEDED, NO_SPACE, TOO_LARGE, ... or UNAVAILABLE
        when no owner took it within ``wait_seconds`` (it may still arrive; refused or not, the
        object stays readable from the local tier).  An object not stored locally keeps the
        local code (ALREADY_EXISTS: it was there before; IN_FLIGHT, INVALID, ...).

        A batch larger than the free local tier goes in rounds (:func:`kvpool.core.spill.next_round`):
        each round reserves what fits, and the sidecar writes a round that left items out to the
        pool before answering its commit, so the next round can evict those clean copies — the
        rest of the batch streams through the local tier to the pool.  What the tier cannot take
        even then (everything in it pinned; TOO_LARGE: larger than the tier) goes to the pool
        straight from the client's memory (fast session), its code the pool's.  With no pool
        behind the sidecar, what does not fit stays NO_SPACE (nowhere to stream to: a later round
        would only evict the batch's own objects)."""
        bound = min(self.timeout, self.deadlines.other_seconds)
        if wait and not 0 < wait_seconds < bound:
            raise errors.InvalidArgument(
                f"wait_seconds must be > 0 and under the client's bound on a write ({bound}s), got {wait_seconds}")
        wait_ms = max(1, int(wait_seconds * 1000)) if wait else 0
        if len(keys) != len(values):
            raise errors.InvalidArgument(f"{len(keys)} keys but {len(values)} values")
        if not keys:
            return []
        views = [as_bytes_view(v) for v in values]
        start, codes = self._put_round(keys, views, traffic_class, kind, wait_ms)
        todo = spill.next_round(range(len(keys)), start) if self._pool_behind and pb.NO_SPACE in start else []
        while todo:
            start, got = self._put_round([keys[i] for i in todo], [views[i] for i in todo], traffic_class, kind,
                                         wait_ms)
            for i, c in zip(todo, got, strict=True):
                codes[i] = c
            todo = spill.next_round(todo, start)
        if self._pool_behind and self._fast is not None and (pb.NO_SPACE in codes or pb.TOO_LARGE in codes):
            self._put_from_memory(keys, values, views, codes, traffic_class, kind)
        return codes

    def _put_from_memory(self, keys: Sequence[bytes], values: Sequence[Buffer], views: list[memoryview],
                         codes: list[int], traffic_class: str, kind: int) -> None:
        """The objects of a put the local tier could not take (NO_SPACE: every extent pinned;
        TOO_LARGE: larger than the tier) go to the pool straight from this client's memory
        (WRITE_FROM): from the caller's own buffers when they lie in :meth:`alloc_buffer` memory
        (no copy), else from a region made for this call; their codes become the pool's."""
        fast = self._fast
        assert fast is not None
        left = [i for i, c in enumerate(codes) if c in (pb.NO_SPACE, pb.TOO_LARGE)]
        sizes = [len(views[i]) for i in left]
        n = len(left)
        spans = self._registered_spans([values[i] for i in left]) if self._regions else None
        region: memfd.Region | None = None
        if spans is not None:
            with self._lock:
                regions = dict(self._regions)
        else:
            offsets, total = spill.layout(sizes)
            region = memfd.create(total, "kvpool-put")
            rid = next(self._region_ids)
            self._copier.copy([(views[i], region.view[o:o + s]) for i, o, s in zip(left, offsets, sizes, strict=True)])
            spans = np.array([rid] * n + offsets + sizes, np.uint64)
            regions = {rid: region}
        try:
            got = fast.write_from(pack_keys([keys[i] for i in left]), kind, traffic_class, spans,
                                  [checksum(views[i]) for i in left], regions, transient=region is not None)
        except (RegistrationRefused, errors.Unavailable) as exc:
            log.warning("kvpool: %d objects with no room in the local tier not written to the pool: %s", n, exc)
            return
        finally:
            if region is not None:
                region.close()
        for i, c in zip(left, got, strict=True):
            codes[i] = c

    def _put_round(self, keys: Sequence[bytes], views: list[memoryview], traffic_class: str,
                   kind: int, wait_ms: int = 0) -> tuple[list[int], list[int]]:
        """One WriteStart, copy and WriteCommit: the reservation's codes and the final codes
        (with ``wait_ms``: the pool's, :meth:`put`)."""
        blob, sizes = pack_keys(keys), [len(v) for v in views]
        bound = self.deadlines.write_seconds
        if self._fast is not None:
            codes, offsets, rid, life = self._fast.write_start(blob, sizes, kind, traffic_class, timeout=bound)
            m = self._life(life)
        else:
            start, m = self._rpc_life(self._stub.WriteStart, spb.WriteStartRequest(
                keys=blob, sizes=sizes, traffic_class=traffic_class, kind=grpc_status.as_kind(kind)), bound)
            codes, offsets, rid = list(start.codes), list(start.offsets), start.reservation_id
        reserved = list(codes)
        if not rid:
            return reserved, codes
        sums = [0] * len(keys)
        arena = m.rw
        ok = [i for i, c in enumerate(codes) if c == pb.OK]
        # numpy's copy, not a memoryview slice assignment: into fresh (cold) arena extents the
        # latter ran at half the speed (16 MiB: 3.8 vs 1.8 ms here); big batches over two threads.
        self._copier.copy([(views[i], arena[offsets[i]:offsets[i] + len(views[i])]) for i in ok])
        for i in ok:
            sums[i] = checksum(views[i])
        # A commit the sidecar answers from its local tier is quick; one that waits for the pool
        # (wait=True, or a round that left items out: the sidecar writes it to the pool first).
        if wait_ms or pb.NO_SPACE in reserved:
            bound = min(self.timeout, self.deadlines.other_seconds)
        if self._fast is not None:
            final = self._fast.write_commit(rid, sums, m.incarnation, wait_ms, timeout=bound)
        else:
            final = list(self._rpc(self._stub.WriteCommit, spb.WriteCommitRequest(
                reservation_id=rid, checksums=sums, pool_wait_ms=wait_ms), bound).codes)
        for i, c in enumerate(codes):
            if c == pb.OK:
                codes[i] = final[i]
        return reserved, codes

    def remove(self, keys: Sequence[bytes], kind: int = pb.BLOCK) -> list[int]:
        request = pb.RemoveRequest(keys=pack_keys(keys), kind=grpc_status.as_kind(kind))
        return list(self._rpc(self._stub.Remove, request).codes)

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
        """Match + state lookup + :func:`~kvpool.core.planning.plan_hit` in one call (DESIGN §5)."""
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

    # -- prefill → decode handoff -------------------------------------------------------------

    def publish_prefill(self, keys: Sequence[bytes], prompt_tokens: int, state_position: int | None = None,
                        hold_ms: int = 30_000, record_ttl_ms: int = 600_000,
                        timeout_ms: int = 10_000) -> _ho.HandoffRecord:
        """Prefill side: hand a finished prefill to a decode instance (:mod:`kvpool.core.handoff_record`).

        Makes sure every block of ``keys`` (the prompt's full blocks) is in the pool, writing
        what is only local and waiting for the commits (``timeout_ms``); keeps the state object
        at ``state_position`` (default: the store position ``floor((L − 1) / B) × B`` of DESIGN
        §5; 0: none) exportable from this sidecar for ``hold_ms``; returns the signed record
        (``.to_bytes()`` / ``.to_json()`` for the engines' channel), accepted for ``record_ttl_ms``.
        Raises NotFound when a block is neither local nor in the pool.  A state object that does
        not exist is not an error: the record then sends the decode side to the bounded replay.
        """
        if state_position is None:
            state_position = state_store_position(prompt_tokens, self.block_tokens) or 0
            if state_position // self.block_tokens > len(keys):
                state_position = 0
        elif state_position:
            self._check_position(state_position)
        r = self._rpc(self._stub.PublishPrefill, spb.PublishPrefillRequest(
            keys=pack_keys(keys), prompt_tokens=prompt_tokens, block_tokens=self.block_tokens,
            state_position=state_position, hold_ms=hold_ms, record_ttl_ms=record_ttl_ms, timeout_ms=timeout_ms))
        if r.code != pb.OK:
            raise errors.error_for_code(r.code, r.message)
        return _ho.from_bytes(r.record)

    def accept_handoff(self, record: _ho.HandoffRecord | bytes | str, window_tokens: int = 128,
                       rollback_tokens: int = 6, lease_ms: int | None = None) -> HandoffResult:
        """Decode side: land a prefill's blocks (from the pool) and state (point to point from
        the prefill sidecar, else the pool) in this sidecar; the plan says what to compute.

        Raises WrongTenant, HandoffInvalid (altered, forged, malformed) or HandoffExpired for a
        record that may not be used.  Otherwise never raises for what is missing: blocks the
        pool no longer holds are per-block codes (the plan covers the local prefix only), and a
        state object that is gone gives the bounded replay of the hit rule
        (:func:`kvpool.core.handoff_record.plan_handoff`).
        """
        t0 = time.perf_counter()
        blob = record.to_bytes() if isinstance(record, _ho.HandoffRecord) else \
            _ho.parse(record).to_bytes() if isinstance(record, str) else bytes(record)
        r, m = self._rpc_life(self._stub.AcceptHandoff, spb.AcceptHandoffRequest(
            record=blob, lease_ms=lease_ms or self.lease_ms))
        if r.code != pb.OK:
            raise errors.error_for_code(r.code, r.message)
        rec = _ho.from_bytes(blob)
        codes = list(r.codes)
        ro = m.ro
        n = _leading_ok(codes)
        blocks = Blocks([ro[o:o + s] for o, s in zip(r.offsets[:n], r.sizes[:n], strict=True)], self, r.lease_id)
        outcome = _ho.StateOutcome(r.state)
        state_ok = outcome in (_ho.StateOutcome.PEER, _ho.StateOutcome.POOL, _ho.StateOutcome.LOCAL)
        state = ro[r.state_offset:r.state_offset + r.state_size] if state_ok else None
        res = HandoffResult(rec, HitPlan(0, 0, None, 0, 0, 0), blocks, codes, state, outcome, r.state_detail,
                            r.state_lease_id, self, r.blocks_us / 1e6, r.state_us / 1e6, 0.0, r.pool_hits,
                            r.local_hits)
        res.plan = _ho.plan_handoff(rec, res.local_blocks, state_ok, window_tokens, rollback_tokens)
        res.total_seconds = time.perf_counter() - t0
        return res

    # -- misc ---------------------------------------------------------------------------------

    def stats(self) -> spb.SidecarStats:
        return cast(spb.SidecarStats, self._rpc(self._stub.Stats, pb.Empty()))

    def flush(self, timeout_ms: int = 10000) -> spb.FlushReply:
        # Bounded by the flush's own deadline (the sidecar keeps trying until then), plus slack.
        return cast(spb.FlushReply, self._rpc(self._stub.Flush, spb.FlushRequest(timeout_ms=timeout_ms),
                                              max(self.timeout, timeout_ms / 1000 + 5)))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            done, self._done_range_leases = self._done_range_leases, []
        if done:
            try:
                self._rpc(self._stub.Release, spb.LeaseRequest(lease_ids=done))
            except errors.KvpoolError:
                pass  # they expire with their leases
        with self._lock:
            self._closed = True
        if self._fast is not None:
            self._fast.close()
        self._copier.close()
        with self._lock:
            regions, self._regions, self._region_starts = list(self._regions.values()), {}, []
        for region in regions:
            region.close()
        self._channel.close()
        self._map.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(address: str, block_tokens: int = 128, timeout: float = 30.0,
            deadlines: ClientDeadlines | None = None) -> Client:
    """Connect to a sidecar at ``unix:///path/to/sidecar.sock`` (``timeout``, ``deadlines``: the
    calls' bounds, see :class:`Client`)."""
    return Client(address, block_tokens=block_tokens, timeout=timeout, deadlines=deadlines)
