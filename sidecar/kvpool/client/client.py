"""What an engine imports: ``kvpool.connect(address) -> Client``.

The client makes the hot calls — match, read, write, release — over the sidecar's binary fast
session (:mod:`kvpool.client.session`, one unix socket beside the gRPC one), the cold ones
(Hello, Probe, Stats, Flush, Remove, ranged reads, handoff) over gRPC, and maps the sidecar's
shared-memory arena for bytes: ``get`` returns views into the arena (zero copy, valid while
their lease holds), ``put`` costs one copy into it; ``get_ranges`` reads only byte ranges of an
object (sparse attention's top-k entries) without the rest of it moving anywhere.  Thread-safe; a context manager.

Sidecar restarts: a reply of another sidecar life first moves the client to it (Hello again,
remap the arena if it changed, forget the old life's pending match leases:
:mod:`kvpool.client.link`), so offsets become views only with the mapping of the life that gave
them.

Modules: :mod:`~kvpool.client.session` (the fast session), :mod:`~kvpool.client.link` (the
sidecar life, gRPC), :mod:`~kvpool.client.buffers` (registered memory), :mod:`~kvpool.client.writes`
(put rounds), :mod:`~kvpool.client.ranged` (ranged reads), :mod:`~kvpool.client.results` (leased
views).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from kvpool.client import handoff
from kvpool.client.arena import ArenaMap
from kvpool.client.buffers import Regions, read_into_registered, read_spilled, write_from_memory
from kvpool.client.keys import pack_keys
from kvpool.client.link import SidecarLink
from kvpool.client.ranged import RangedReads
from kvpool.client.results import Blocks, HandoffResult, RangeReads, Reads
from kvpool.client.session import FastSession, RegistrationRefused
from kvpool.client.writes import Reservation, put_rounds, reserve
from kvpool.core import errors
from kvpool.core import handoff_record as _ho
from kvpool.core.buffers import Buffer, as_bytes_view
from kvpool.core.deadlines import ClientDeadlines
from kvpool.core.planning import HitPlan, plan_hit
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS
from kvpool.transfer.copier import Copier
from kvpool.wire import grpc_status
from kvpool.wire.frames import ProtocolError
from kvpool.wire.proto import sidecar_pb2 as spb
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.sidecar_frames import socket_path as fast_socket_path

log = logging.getLogger("kvpool.client.client")


class Client:
    """A connection to one sidecar."""

    def __init__(self, address: str, block_tokens: int = 128, timeout: float = 30.0,
                 lease_ms: int = 10000, deadlines: ClientDeadlines | None = None) -> None:
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
        self._link = SidecarLink(address, timeout, self._moved)
        hello = self._link.hello_reply
        self.tenant_id = hello.tenant_id
        self._pool_behind = hello.pool_nodes > 0
        """Whether the sidecar has a pool to stream a put batch larger than its tier to."""
        self._closed = False
        self._lock = threading.Lock()
        self._pending_matches: OrderedDict[bytes, int] = OrderedDict()  # first key → match lease
        self.max_pending_matches = 1024
        self._copier = Copier()
        self._ranged = RangedReads(
            lambda request: self._link.call_life(self._link.stub.ReadRanges, request, self.deadlines.read_seconds),
            self._release_many_async, self._copier, lease_ms)
        self._regions = Regions()
        """Registered memory (:meth:`alloc_buffer`) and one-call regions (:mod:`kvpool.client.buffers`)."""
        try:
            self._fast = FastSession(fast_socket_path(address[len("unix://"):]), self.tenant_id,
                                     hello.arena_bytes, timeout, incarnation=hello.incarnation,
                                     on_new_life=self._link.move)
        except BaseException as exc:
            self._link.close()
            if isinstance(exc, (OSError, ProtocolError)):
                raise errors.Unavailable(f"no fast session beside {address}: {exc}") from None
            raise
        self._fast.arena_bytes = self._link.map.nbytes  # a life met while it said HELLO may have remapped

    @property
    def handoff_address(self) -> str:
        """Where this sidecar exports state objects to decode sidecars ("" when it does not)."""
        return self._link.hello_reply.handoff_address

    @property
    def instance_id(self) -> str:
        return self._link.hello_reply.instance_id

    @property
    def restarts_seen(self) -> int:
        """Sidecar lives after the first this client moved to (restarts it noticed)."""
        return self._link.restarts_seen

    @property
    def _arena(self) -> memoryview:
        return self._link.map.rw

    @property
    def _arena_ro(self) -> memoryview:
        return self._link.map.ro

    def _moved(self, hello: spb.HelloReply, new: ArenaMap) -> None:
        """The link moved to a new sidecar life: the old life's pending match leases are gone."""
        with self._lock:
            self._pending_matches.clear()
        self._ranged.take_done()
        if hasattr(self, "_fast"):  # not while the fast session's first greeting is under way
            self._fast.arena_bytes = new.nbytes

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
        return self.match_local(keys, lease_ms)[::2]  # (prefix, lease id)

    def match_local(self, keys: Sequence[bytes], lease_ms: int | None = None) -> tuple[int, int, int]:
        """:meth:`match_lease` and the local tier's share of the prefix: (prefix, local prefix, lease id)."""
        return self._fast.match(pack_keys(keys), lease_ms or self.lease_ms,
                                timeout=self.deadlines.match_seconds) if keys else (0, 0, 0)

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
        stays readable."""
        if not keys:
            return Blocks([], self, 0)
        if not lease_id and kind == pb.BLOCK:
            lease_id = self._consume_match(keys)
        r, m = self._read(pack_keys(keys), lease_id, kind)
        codes = list(r.codes)
        ro = m.ro
        if any(c != pb.OK for c in codes):
            views = read_spilled(self._fast, self._regions, keys, codes, r, m.ro, kind, self.deadlines)
            if any(c != pb.OK for c in codes):
                if r.lease_id:
                    self.release(r.lease_id)
                missing = [i for i, c in enumerate(codes) if c != pb.OK]
                raise errors.NotFound(f"{len(missing)} of {len(keys)} keys not present (first at index "
                                      f"{missing[0]}: {errors.code_name(codes[missing[0]])})")
            return Blocks([v for v in views if v is not None], self, r.lease_id)  # all OK: every one
        return Blocks([ro[o:o + s] for o, s in zip(r.offsets, r.sizes, strict=True)], self, r.lease_id)

    def get_many(self, keys: Sequence[bytes], lease_id: int = 0, kind: int = pb.BLOCK,
                 local_only: bool = False) -> Reads:
        """Per-key reads: what is present comes back as views (as :meth:`get`), the rest as its
        code (NOT_FOUND: not in the pool; UNAVAILABLE: a store node missed its deadline; NO_SPACE
        only where it fits neither the arena nor this client's memory); none fails the others.
        ``Reads.prefix`` is the leading run read, what an engine loads of a matched prefix.
        ``local_only``: the arena's objects only, the others NOT_FOUND and fetched nowhere."""
        if not keys:
            return Reads([], [], self, 0)
        if not lease_id and kind == pb.BLOCK and not local_only:
            lease_id = self._consume_match(keys)
        r, m = self._read(pack_keys(keys), lease_id, kind, local_only)
        codes = list(r.codes)
        views = read_spilled(self._fast, self._regions, keys, codes, r, m.ro, kind, self.deadlines)
        return Reads(codes, views, self, r.lease_id)

    def alloc_buffer(self, nbytes: int) -> np.ndarray:
        """Memory the sidecar can write into: ``get_into`` of buffers inside it lands the pool's
        bytes there directly, as Mooncake's registered buffers do (no arena→caller copy; the
        local tier is left as it was — a read-through, for engines with a host cache of their
        own), and copies local hits into it in the sidecar.  A uint8 array of ``nbytes``
        (zero-filled, its pages populated), shareable by slicing; :meth:`free_buffer` returns it.
        The memory is a sealed memfd the sidecar maps when first used (``kvpool.transfer.memfd``)."""
        return self._regions.alloc(nbytes)

    def free_buffer(self, buffer: Buffer) -> None:
        """Give back memory from :meth:`alloc_buffer` (the sidecar unmaps it; arrays of it that
        are still alive keep it mapped here until they go)."""
        self._fast.forget_region(self._regions.free(buffer))

    def is_registered(self, buffer: Buffer) -> bool:
        """Whether ``get_into`` lands pool bytes in ``buffer`` directly (it lies in memory from
        :meth:`alloc_buffer` that the sidecar has not refused)."""
        return self._regions.is_registered(buffer)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[int]:
        """Copy objects into caller buffers; per-item sizes, -1 where absent (no exception).
        Buffers inside memory from :meth:`alloc_buffer` get the pool's bytes directly."""
        if len(keys) != len(buffers):
            raise errors.InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        if self._regions:
            spans = self._regions.spans(buffers)
            if spans is not None:
                try:
                    return read_into_registered(self._fast, self._regions, keys, buffers, spans,
                                                self._consume_match(keys), self.deadlines)
                except RegistrationRefused as exc:
                    # The sidecar keeps its memory limits: this region is read into through
                    # the arena from now on (one copy more), not refused on every call.
                    log.warning("kvpool: %s; reads into it go through the arena", exc)
                    self._regions.refused(exc.region_id)
        r, m = self._read(pack_keys(keys), self._consume_match(keys), pb.BLOCK)
        arena = m.rw
        out = []
        try:
            codes = list(r.codes)
            # Objects the arena had no room for come through memory of this client's (one copy more).
            spilled = read_spilled(self._fast, self._regions, keys, codes, r, m.ro, pb.BLOCK, self.deadlines) \
                if pb.NO_SPACE in codes else None
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

    # -- sparse reading -----------------------------------------------------------------------

    def get_ranges_many(self, keys: Sequence[bytes], per_key: Sequence[Any], kind: int = pb.BLOCK,
                        verify_object: bool = False) -> RangeReads:
        """Sparse read of several objects: for each key a list of ``(offset, length)`` byte
        ranges; per key a code (OK, NOT_FOUND, INVALID for ranges it cannot serve, ...) and, where
        OK, views of exactly those ranges in the arena (zero copy; held by the lease).  Only the
        ranges move: from the local tier in place, or from the owner node into scratch space
        (the object is not pulled into the local tier)."""
        return self._ranged.many(self, keys, per_key, kind, verify_object)

    def get_ranges(self, key: bytes, per_range: Any, kind: int = pb.BLOCK) -> Blocks:
        """Views of byte ranges ``[(offset, length), ...]`` of one object (see
        :meth:`get_ranges_many`); raises NotFound if absent, InvalidArgument for ranges it
        cannot serve (out of bounds, zero length, too many)."""
        return self._ranged.one(self, key, per_range, kind)

    def get_ranges_into(self, keys: Sequence[bytes], per_key: Sequence[Any], buffers: Sequence[Buffer],
                        kind: int = pb.BLOCK) -> list[int]:
        """Copy only the byte ranges of each object, back to back in the order asked, into the
        caller's ``buffers``; per-key codes (a buffer smaller than its ranges is INVALID and its
        key is not asked for)."""
        return self._ranged.into(keys, per_key, buffers, kind)

    def _read(self, keys: bytes, lease_id: int, kind: int, local_only: bool = False) -> tuple[Any, ArenaMap]:
        """One READ: (codes, offsets, sizes, lease_id), and the mapping of the sidecar life whose
        arena the offsets are in."""
        r = self._fast.read(keys, kind, self.lease_ms, lease_id, None, self.deadlines.read_seconds, local_only)
        return r, self._link.life(r.incarnation)

    def _release_async(self, lease_id: int) -> None:
        """Drop a lease without waiting for the answer: the copy is done, so the caller need not
        pay a second round trip (~0.3-1 ms); a lost release expires with the lease."""
        self._release_many_async([lease_id])

    def _release_many_async(self, lease_ids: list[int]) -> None:
        if self._closed or not lease_ids:
            return
        try:
            self._fast.release(list(lease_ids), wait=False)
        except errors.KvpoolError as exc:  # a broken connection: the leases expire by themselves
            log.debug("kvpool: %d leases not released (they expire by themselves): %s", len(lease_ids), exc)

    def release(self, lease_id: int) -> None:
        """Drop a lease, within the write bound.  A sidecar that does not answer in time (hung,
        restarting) is not an error here: the lease ends by itself at its expiry, and raising
        would fail the engine's ``with`` block after its read had succeeded."""
        if lease_id and not self._closed:
            bound = self.deadlines.write_seconds
            try:
                self._fast.release([lease_id], timeout=bound)
            except errors.Unavailable as exc:  # DeadlineExceeded too
                log.debug("kvpool: lease %d not released (it expires by itself): %s", lease_id, exc)

    # -- writing ------------------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], values: Sequence[Buffer], traffic_class: str = DEFAULT_TRAFFIC_CLASS,
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
        codes = put_rounds(self._fast, self._link.life, self._copier, keys, views, traffic_class, kind, wait_ms,
                           self._pool_behind, self.deadlines.write_seconds, bound)
        if self._pool_behind and (pb.NO_SPACE in codes or pb.TOO_LARGE in codes):
            write_from_memory(self._fast, self._regions, self._copier, keys, values, views, codes, traffic_class,
                              kind)
        return codes

    def reserve(self, keys: Sequence[bytes], sizes: Sequence[int], traffic_class: str = DEFAULT_TRAFFIC_CLASS,
                kind: int = pb.BLOCK) -> Reservation:
        """A put without its copy: fill the reserved arena extents, then commit (:class:`Reservation`)."""
        return reserve(self._fast, self._link.life, keys, sizes, traffic_class, kind, self.deadlines, self.timeout)

    def remove(self, keys: Sequence[bytes], kind: int = pb.BLOCK) -> list[int]:
        request = pb.RemoveRequest(keys=pack_keys(keys), kind=grpc_status.as_kind(kind))
        return list(self._link.call(self._link.stub.Remove, request).codes)

    # -- state objects ------------------------------------------------------------------------

    def _check_position(self, position: int) -> None:
        handoff.check_position(position, self.block_tokens)

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
        r = self._link.call(self._link.stub.Probe, spb.ProbeRequest(keys=pack_keys(keys), kind=pb.STATE))
        return [b == 1 for b in r.present]

    def plan(self, prompt_tokens: int, keys: Sequence[bytes], window_tokens: int = 128,
             rollback_tokens: int = 6) -> HitPlan:
        """Match + state lookup + :func:`~kvpool.core.planning.plan_hit` in one call (DESIGN §5)."""
        b = self.block_tokens
        matched = self.match(keys) if keys else 0
        cands = handoff.state_candidates(prompt_tokens, matched * b, len(keys), b, window_tokens, rollback_tokens)
        have = self.has_states([keys[p // b - 1] for p in cands]) if cands else []
        positions = [p for p, h in zip(cands, have, strict=True) if h]
        return plan_hit(prompt_tokens, matched * b, positions, b, window_tokens, rollback_tokens)

    # -- prefill → decode handoff -------------------------------------------------------------

    def publish_prefill(self, keys: Sequence[bytes], prompt_tokens: int, state_position: int | None = None,
                        hold_ms: int = 30_000, record_ttl_ms: int = 600_000,
                        timeout_ms: int = 10_000) -> _ho.HandoffRecord:
        """Prefill side: hand a finished prefill to a decode instance; the signed record
        (:func:`kvpool.client.handoff.publish_prefill`)."""
        return handoff.publish_prefill(self._link, self.block_tokens, keys, prompt_tokens, state_position, hold_ms,
                                       record_ttl_ms, timeout_ms)

    def accept_handoff(self, record: _ho.HandoffRecord | bytes | str, window_tokens: int = 128,
                       rollback_tokens: int = 6, lease_ms: int | None = None) -> HandoffResult:
        """Decode side: land a prefill's blocks and state in this sidecar; the plan says what to
        compute (:func:`kvpool.client.handoff.accept_handoff`)."""
        return handoff.accept_handoff(self._link, self, record, window_tokens, rollback_tokens,
                                      lease_ms or self.lease_ms)

    # -- misc ---------------------------------------------------------------------------------

    def stats(self) -> spb.SidecarStats:
        return cast(spb.SidecarStats, self._link.call(self._link.stub.Stats, pb.Empty()))

    def flush(self, timeout_ms: int = 10000) -> spb.FlushReply:
        # Bounded by the flush's own deadline (the sidecar keeps trying until then), plus slack.
        return cast(spb.FlushReply, self._link.call(self._link.stub.Flush, spb.FlushRequest(timeout_ms=timeout_ms),
                                              max(self.timeout, timeout_ms / 1000 + 5)))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            done = self._ranged.take_done()
        if done:
            try:
                self._fast.release(done, timeout=self.deadlines.write_seconds)
            except errors.KvpoolError:
                pass  # they expire with their leases
        with self._lock:
            self._closed = True
        self._fast.close()
        self._copier.close()
        self._regions.close()
        self._link.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(address: str, block_tokens: int = 128, timeout: float = 30.0,
            deadlines: ClientDeadlines | None = None) -> Client:
    """Connect to a sidecar at ``unix:///path/to/sidecar.sock`` (``timeout``, ``deadlines``: the
    calls' bounds, see :class:`Client`)."""
    return Client(address, block_tokens=block_tokens, timeout=timeout, deadlines=deadlines)
