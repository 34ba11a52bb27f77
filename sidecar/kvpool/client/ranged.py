"""Ranged reads: only byte ranges of objects (sparse attention's top-k entries), over gRPC.

The sidecar serves the ranges of an object from its local tier in place, or fetches just those
ranges from the owner node into scratch space (the object is not pulled into the local tier);
the client sees views of them in the arena, or copies them into its own buffers.  Abutting
ranges travel as one (:func:`kvpool.core.ranges.coalesce`).  A read's lease, once its bytes are
copied out, rides on the next ranged read's request (no second round trip per read).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.client.arena import ArenaMap
from kvpool.client.keys import pack_keys
from kvpool.client.results import Blocks, RangeReads
from kvpool.core import errors, ranges
from kvpool.core.buffers import Buffer, as_bytes_view
from kvpool.transfer.copier import Copier
from kvpool.wire import grpc_status
from kvpool.wire.proto import sidecar_pb2 as spb
from kvpool.wire.proto import store_pb2 as pb

if TYPE_CHECKING:
    from kvpool.client.client import Client



class RangedReads:
    """The client's ranged reads; thread-safe.  ``call`` makes the ReadRanges call for the
    sidecar life the client holds (the reply and that life's mapping); ``release_many`` drops
    leases without waiting."""

    def __init__(self, call: Callable[[spb.ReadRangesRequest], tuple[Any, ArenaMap]],
                 release_many: Callable[[list[int]], None], copier: Copier, lease_ms: int) -> None:
        self._call, self._release_many, self._copier, self._lease_ms = call, release_many, copier, lease_ms
        self._lock = threading.Lock()
        self._done: list[int] = []
        """Leases of reads whose bytes were copied out, to drop with the next read."""

    def take_done(self) -> list[int]:
        """The leases waiting to be dropped (the caller drops them: a read, the close)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def _read(self, keys: Sequence[bytes], per_key: Sequence[Any], kind: int, verify_object: bool
                     ) -> tuple[Any, list[tuple[ranges.Pairs, Any]], list[ranges.Pairs], ArenaMap]:
        """The ReadRanges call; ranges refused here (negative, not integers, wrong shape) are
        sent as none, so the sidecar answers INVALID for them.  Returns the reply, the ranges sent
        (coalesced, with each asked range's merged index), the ranges asked, normalised, and the
        mapping the offsets are in."""
        if len(keys) != len(per_key):
            raise errors.InvalidArgument(f"{len(keys)} keys but {len(per_key)} range lists")
        pairs = [ranges.normalize(r)[0] for r in per_key]
        merged = [ranges.coalesce(p) for p in pairs]  # abutting ranges as one: fewer to move and copy
        counts, blob = ranges.encode([m for m, _ in merged])
        r, m = self._call(spb.ReadRangesRequest(
            keys=pack_keys(keys), counts=counts.tolist(), ranges=blob, kind=grpc_status.as_kind(kind),
            lease_ms=self._lease_ms, verify_object=verify_object, release_lease_ids=self.take_done()))
        return r, merged, pairs, m

    def _lease_done(self, lease_id: int) -> None:
        """A ranged read's lease whose bytes were copied out: dropped by the next ranged read in
        its own call (no second round trip per read), or, past a few, in one release now; one
        that no call follows ends with its lease (``lease_ms``)."""
        with self._lock:
            self._done.append(lease_id)
            if len(self._done) < 16:
                return
            done, self._done = self._done, []
        self._release_many(done)

    def many(self, client: Client, keys: Sequence[bytes], per_key: Sequence[Any], kind: int = pb.BLOCK,
             verify_object: bool = False) -> RangeReads:
        """Sparse read of several objects: for each key a list of ``(offset, length)`` byte
        ranges; per key a code (OK, NOT_FOUND, INVALID for ranges it cannot serve, ...) and, where
        OK, views of exactly those ranges in the arena (zero copy; held by the lease).  Only the
        ranges move: from the local tier in place, or from the owner node into scratch space
        (the object is not pulled into the local tier)."""
        if not keys:
            return RangeReads([], [], [], client, 0)
        r, merged, pairs, life = self._read(keys, per_key, kind, verify_object)
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
        return RangeReads(list(r.codes), list(r.sizes), views, client, r.lease_id)

    def one(self, client: Client, key: bytes, per_range: Any, kind: int = pb.BLOCK) -> Blocks:
        """Views of byte ranges ``[(offset, length), ...]`` of one object (see
        :meth:`many`); raises NotFound if absent, InvalidArgument for ranges it
        cannot serve (out of bounds, zero length, too many)."""
        arr, why = ranges.normalize(per_range)
        if why:
            raise errors.InvalidArgument(why)
        got = self.many(client, [key], [arr], kind)
        code, size = got.codes[0], got.sizes[0]
        views = got.views[0]
        if code != pb.OK or views is None:
            got.release()
            if code == pb.INVALID and size:
                raise errors.InvalidArgument(f"ranges cannot be served from the {size}-byte object: "
                                             + (ranges.check(arr, size) or "too many bytes in one read"))
            raise errors.error_for_code(code, f"ranged read of the key: {errors.code_name(code)}")
        return Blocks(views, client, got.lease_id)

    def into(self, keys: Sequence[bytes], per_key: Sequence[Any], buffers: Sequence[Buffer],
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
        r, merged, _, life = self._read([keys[i] for i in ask], [per_key[i] for i in ask], kind, False)
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
                self._lease_done(r.lease_id)
        return codes
