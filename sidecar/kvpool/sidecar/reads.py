"""The sidecar's read side: match, read, read into the caller's memory, ranged reads.

Shared by both front ends: the fast session's match, read and read-into, the gRPC servicer's
probe and ranged reads (the handoff reads through :meth:`Reads.read_keys` too).
Local hits are pinned under a lease in the lookup itself; misses are fetched from their owners
by the :class:`~kvpool.sidecar.fetch.Fetcher` into fresh arena extents (a fetch is also a
promotion) or into the caller's registered buffers.  A match pins what it found, locally and at
the store nodes, under one *match lease* (:class:`MatchLeases`); the read that follows drops the
match's pool lease at each node in the same round trip as its read there.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import numpy as np

from kvpool.core import ranges
from kvpool.core.errors import Code
from kvpool.pool.fanout import Pool
from kvpool.sidecar import journal, metrics
from kvpool.sidecar.estimates import ReadMeter
from kvpool.sidecar.fetch import Fetcher
from kvpool.sidecar.landing import ArenaLanding, BufferLanding, SpillStash
from kvpool.sidecar.local_tier import LocalEntry, LocalTier
from kvpool.transfer.copier import Copier
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

_UNBOUNDED = (1 << 64) - 1
"""Size to check a non-local object's ranges against: only their shape (its owner knows the size)."""


class ReadResult(NamedTuple):
    codes: list[pb.Code]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    lease_id: int
    local_hits: int
    pool_hits: int


class RangeResult(NamedTuple):
    codes: list[pb.Code]
    sizes: list[int]
    offsets: list[int]
    """Arena offset of each range, in the request's order (0 for a key not OK)."""
    lease_id: int
    lease_expires_unix_ms: int
    local_hits: int
    pool_hits: int
    pool_bytes: int


@dataclass
class _MatchLease:
    local_lease: int
    pool_leases: list[tuple[str, int]]
    expires: float


class MatchLeases:
    """What each match lease pins: a local-tier lease and a pool lease per node.  Thread-safe."""

    def __init__(self, local: LocalTier, pool: Pool) -> None:
        self.local, self.pool = local, pool
        self._lock = threading.Lock()
        self._leases: dict[int, _MatchLease] = {}
        # Match lease ids start at a random base, as the local tier's: an id a client kept from
        # a previous life (or of the other kind) names nothing here.
        self._ids = itertools.count(journal.new_id() >> 2)

    def open(self, local_lease: int, pool_leases: list[tuple[str, int]], lease_ms: int) -> int:
        """A new match lease over these pins: its id."""
        lease_id = next(self._ids)
        with self._lock:
            self._leases[lease_id] = _MatchLease(local_lease, pool_leases, time.time() + lease_ms / 1000.0)
        return lease_id

    def release(self, lease_id: int) -> None:
        """Drop match lease ``lease_id`` (and every expired one)."""
        ml, expired = self._pop(lease_id)
        for m in ([ml] if ml else []) + expired:
            self._release(m)

    def _pop(self, lease_id: int) -> tuple[_MatchLease | None, list[_MatchLease]]:
        """The match lease ``lease_id`` (None if it is gone) and every expired one, forgotten."""
        with self._lock:
            ml = self._leases.pop(lease_id, None) if lease_id else None
            now = time.time()
            stale = [k for k, v in self._leases.items() if v.expires < now]
            expired = [self._leases.pop(k) for k in stale]
        return ml, expired

    def _release(self, m: _MatchLease, dropped: dict[str, int] | None = None) -> None:
        """Release what ``m`` pins, except the pool leases a read already dropped."""
        if m.local_lease:
            self.local.release([m.local_lease])
        left = [(nid, lid) for nid, lid in m.pool_leases if (dropped or {}).get(nid) != lid]
        if left:
            self.pool.release(left)

    @contextlib.contextmanager
    def superseded(self, match_lease: int) -> Iterator[dict[str, int]]:
        """The match lease a read supersedes: its pool lease at each node (node id -> lease id)
        is dropped by the read of that node, in the same round trip (the read pins what it
        sends); the reads take their entries from the dict, and what none took is released after."""
        ml, expired = self._pop(match_lease)
        drop = dict(reversed(ml.pool_leases)) if ml else {}
        offered = dict(drop)
        try:
            yield drop
        finally:
            taken = {nid: lid for nid, lid in offered.items() if nid not in drop}
            for m in ([ml] if ml else []) + expired:
                self._release(m, taken)


class Reads:
    """Match and read calls of one sidecar; thread-safe."""

    def __init__(self, local: LocalTier, pool: Pool, fetcher: Fetcher, counters: Any, tenant_id: str,
                 lease_ms: int, stash: SpillStash, offer: Callable[[list[LocalEntry]], None] | None,
                 meter: ReadMeter | None = None) -> None:
        self.local, self.pool, self.fetcher, self.counters = local, pool, fetcher, counters
        self.meter = meter or ReadMeter()
        """Pool and local read bandwidth and match time, measured (the engines' fetch-or-recompute inputs)."""
        self.tenant_id = tenant_id
        self.lease_ms = lease_ms
        """Lease of the local hits of a ``read_into`` while they are copied out."""
        self.stash = stash
        self.offer = offer
        """Where blocks found at a fallback go to reach their new owner (copy-over), or None."""
        self.match_leases = MatchLeases(local, pool)
        self._copier = Copier()  # local hits of read_into, arena -> the caller's registered buffers
        self.max_range_bytes = min(ranges.DEFAULT_MAX_BYTES, local.capacity // 2)
        """Bytes one ranged read may ask for (the pool's ranges need scratch space in the arena)."""

    def close(self) -> None:
        self._copier.close()

    # -- match --------------------------------------------------------------------------------

    def match_keys(self, arr: np.ndarray, lease_ms: int, local_only: bool = False) -> tuple[int, int, int]:
        """The longest present prefix of the keys ``arr`` (32-byte voids; local tier, then
        pool), pinned under one lease: (prefix, local prefix, lease id or 0)."""
        t0 = time.perf_counter()
        n_local, local_lease = self.local.match_prefix(arr, lease_ms)
        prefix = n_local
        pool_leases: list[tuple[str, int]] = []
        if n_local < len(arr) and self.pool.enabled and not local_only:
            pm = self.pool.match(arr[n_local:], lease_ms)
            prefix += pm.prefix
            pool_leases = pm.leases
        lease_id = 0
        if prefix:
            lease_id = self.match_leases.open(local_lease.lease_id if local_lease else 0, pool_leases, lease_ms)
        elif pool_leases:
            self.pool.release(pool_leases)
        took = time.perf_counter() - t0
        metrics.record_match(self.tenant_id, len(arr), n_local, prefix - n_local, took)
        self.meter.lookup(took)
        self.counters[SidecarCounter.MATCH_CALLS] += 1
        self.counters[SidecarCounter.LOOKUP_BLOCKS] += len(arr)
        self.counters[SidecarCounter.HIT_BLOCKS_LOCAL] += n_local
        self.counters[SidecarCounter.HIT_BLOCKS_POOL] += prefix - n_local
        return prefix, n_local, lease_id

    def probe(self, keys: list[bytes], arr: np.ndarray, kind: int) -> np.ndarray:
        """Which of ``keys`` are present, here or in the pool (booleans; nothing pinned)."""
        found, _ = self.local.lookup(keys, kind)
        present = np.array([e is not None for e in found], dtype=bool)
        missing = np.flatnonzero(~present)
        if len(missing) and self.pool.enabled:
            present[missing] = self.pool.present(arr[missing], kind)
        return present

    def release_leases(self, lease_ids: list[int]) -> None:
        """Drop match and read leases (unknown or expired ids are ignored)."""
        for lid in lease_ids:
            self.match_leases.release(lid)
        self.local.release(lease_ids)

    def release_reads(self, lease_ids: list[int]) -> None:
        """Drop read leases (of ranged reads whose copies the client has done)."""
        self.local.release(lease_ids)

    # -- read ---------------------------------------------------------------------------------

    def read_keys(self, keys: list[bytes], arr: np.ndarray, kind: int, lease_ms: int,
                  match_lease: int = 0, local_only: bool = False) -> ReadResult:
        """Local hits and pool fetches of ``keys`` as arena extents under one read lease (which
        also drops the match lease ``match_lease``).  ``local_only``: local hits only, the rest
        NOT_FOUND and not counted (the client reads them otherwise: into its registered memory)."""
        t0 = time.perf_counter()
        # The lease pins local hits in the lookup itself and fetched objects as they land, so
        # nothing handed to the client can be evicted (and its extent reused) under it.
        found, lease = self.local.lookup(keys, kind, lease_ms)
        assert lease is not None
        local_found = [e is not None for e in found]
        local_hits = sum(local_found)
        missing = [i for i, e in enumerate(found) if e is None]
        pool_hits = 0
        land: ArenaLanding | None = None
        fetch_seconds = 0.0
        try:
            with self.match_leases.superseded(match_lease) as drop:
                if missing and self.pool.enabled and not local_only:
                    land = ArenaLanding(self.local, keys, kind, lease, found, self.offer, self.pool.rpc_timeout,
                                        self.stash)
                    t_fetch = time.perf_counter()
                    pool_hits = self.fetcher.fetch_missing(keys, arr, missing, land, kind, lease_ms, drop)
                    fetch_seconds = time.perf_counter() - t_fetch
        except BaseException:
            self.local.release([lease.lease_id])
            raise
        if not lease.entries:
            self.local.release([lease.lease_id])
        n = len(keys)
        codes, offsets, sizes, sums = [pb.NOT_FOUND] * n, [0] * n, [0] * n, [0] * n
        for i, e in enumerate(found):
            if e is not None:
                codes[i], offsets[i], sizes[i], sums[i] = pb.OK, e.offset, e.size, e.checksum
            elif land is not None:
                codes[i] = land.code(i)  # UNAVAILABLE / CHECKSUM: in the pool, not delivered
        moved = sum(sizes)
        spilled = 0
        if land is not None and land.no_room:
            # In the pool but no room here (the arena is pinned full, or the object is larger
            # than the tier): NO_SPACE and its size, so the client reads it into its own memory
            # (READ_INTO, counted there: here it is neither a hit nor a miss).
            for i, size in land.no_room.items():
                if found[i] is None:
                    codes[i], sizes[i] = pb.NO_SPACE, size
                    spilled += 1
            self.counters[SidecarCounter.READ_NO_ROOM] += spilled
        fetched = sum(e.size for e, was in zip(found, local_found, strict=True) if e is not None and not was)
        self.meter.pool_read(fetched, fetch_seconds)
        self._count_read(local_hits if local_only else n - spilled, local_hits, pool_hits, moved, fetched, t0)
        return ReadResult(codes, offsets, sizes, sums, lease.lease_id if lease.entries else 0, local_hits, pool_hits)

    def read_into(self, keys: list[bytes], arr: np.ndarray, kind: int, dests: Sequence[memoryview],
                  match_lease: int = 0) -> tuple[list[pb.Code], list[int], int, int]:
        """``keys`` into the caller's registered buffers ``dests`` (fast session only): local hits
        copied out of the arena, misses fetched from their owners straight into the buffers
        (:class:`BufferLanding`: the local tier is left as it was).  Per-item codes (INVALID: the
        buffer is smaller than the object) and sizes, local hits, pool hits."""
        t0 = time.perf_counter()
        n = len(keys)
        found, lease = self.local.lookup(keys, kind, self.lease_ms)
        assert lease is not None
        codes: list[pb.Code] = [pb.NOT_FOUND] * n
        sizes = [0] * n
        pairs = []
        try:
            for i, e in enumerate(found):
                if e is None:
                    continue
                if dests[i].nbytes < e.size:
                    codes[i], sizes[i] = pb.INVALID, e.size
                    continue
                codes[i], sizes[i] = pb.OK, e.size
                pairs.append((self.local.view(e), dests[i][:e.size]))
            t_copy = time.perf_counter()
            self._copier.copy(pairs)
            self.meter.local_read(sum(dst.nbytes for _, dst in pairs), time.perf_counter() - t_copy)
        finally:
            self.local.release([lease.lease_id])
        local_hits = len(pairs)
        missing = [i for i, e in enumerate(found) if e is None]
        pool_hits = 0
        if missing and len(self.stash):
            # Objects a READ just fetched but had no room for (its NO_SPACE rows): copied from
            # the stash, not fetched from the pool a second time.
            missing, pool_hits = self._from_stash(keys, kind, dests, missing, codes, sizes)
        with self.match_leases.superseded(match_lease) as drop:
            if missing and self.pool.enabled:
                landed: list[int | None] = [None] * n
                land = BufferLanding(dests, landed)
                t_fetch = time.perf_counter()
                pool_hits += self.fetcher.fetch_missing(keys, arr, missing, land, kind, self.lease_ms, drop)
                self.meter.pool_read(sum(landed[i] or 0 for i in missing), time.perf_counter() - t_fetch)
                for i in missing:
                    size = landed[i]
                    if size is not None:
                        codes[i], sizes[i] = pb.OK, size
                    elif i in land.too_small:
                        codes[i], sizes[i] = pb.INVALID, land.sizes[i]
                    else:
                        codes[i] = land.code(i)
        moved = sum(sizes)
        from_pool = moved - sum(src.nbytes for src, _ in pairs)
        self._count_read(n, local_hits, pool_hits, moved, from_pool, t0)
        return codes, sizes, local_hits, pool_hits

    def _from_stash(self, keys: list[bytes], kind: int, dests: Sequence[memoryview], missing: list[int],
                    codes: list[pb.Code], sizes: list[int]) -> tuple[list[int], int]:
        """Copy the stashed ones of ``missing`` into their buffers (codes and sizes set): the
        keys still missing, and how many were copied."""
        pairs: list[tuple[memoryview, memoryview]] = []
        left: list[int] = []
        for i in missing:
            buf = self.stash.take(kind, keys[i])
            if buf is None:
                left.append(i)
            elif dests[i].nbytes < buf.nbytes:
                codes[i], sizes[i] = pb.INVALID, buf.nbytes
            else:
                codes[i], sizes[i] = pb.OK, buf.nbytes
                pairs.append((buf.data, dests[i][:buf.nbytes]))
        self._copier.copy(pairs)
        self.counters[SidecarCounter.READ_STASH_HITS] += len(pairs)
        return left, len(pairs)

    def _count_read(self, n: int, local_hits: int, pool_hits: int, moved: int, from_pool: int, t0: float) -> None:
        """A read's metrics and counters (``moved`` bytes handed over, ``from_pool`` of them fetched)."""
        metrics.record_read(self.tenant_id, n, local_hits, pool_hits, moved, time.perf_counter() - t0, from_pool)
        self.counters[SidecarCounter.READ_BLOCKS] += n
        self.counters[SidecarCounter.READ_HITS_LOCAL] += local_hits
        self.counters[SidecarCounter.READ_HITS_POOL] += pool_hits
        self.counters[SidecarCounter.READ_MISSES] += n - local_hits - pool_hits
        self.counters[SidecarCounter.RESTORED_BYTES_LOCAL] += moved - from_pool
        self.counters[SidecarCounter.RESTORED_BYTES_POOL] += from_pool

    # -- ranged read --------------------------------------------------------------------------

    def read_ranges(self, keys: list[bytes], arr: np.ndarray, kind: int, counts: Sequence[int], flat: ranges.Pairs,
                    lease_ms: int, verify_object: bool) -> RangeResult:
        """Byte ranges of objects (:mod:`kvpool.core.ranges`; ``counts[i]`` ranges of key ``i``,
        all of them in ``flat``): a local object's ranges are pointed at in place (the client
        copies only them); a missing object's ranges are read from its owner — those bytes only —
        into a scratch extent of the arena that the lease holds and its end frees: the object is
        never pulled whole, nor cached here."""
        n = len(keys)
        per_key = ranges.split(counts, flat)
        found, lease = self.local.lookup(keys, kind, lease_ms)
        assert lease is not None
        # Local objects are checked against their size here; for the others only the shape and
        # the byte budget (the owner checks the bounds: it knows the size).
        sizes = [e.size if e is not None else 0 for e in found]
        bound = [s if e is not None else _UNBOUNDED for s, e in zip(sizes, found, strict=True)]
        # Codes are plain ints at runtime: the pure rule speaks errors.Code, the reply pb.Code.
        codes = cast("list[pb.Code]", ranges.plan(cast("list[Code]", [pb.OK] * n), bound, per_key,
                                                  ranges.MAX_RANGES_PER_KEY, self.max_range_bytes))
        local_hits = sum(1 for e, c in zip(found, codes, strict=True) if e is not None and c == pb.OK)
        todo = [i for i in range(n) if found[i] is None and codes[i] == pb.OK]
        where: dict[int, LocalEntry] = {}
        try:
            if todo and self.pool.enabled:
                where = self.fetcher.fetch_ranges(arr, todo, per_key, codes, sizes, kind, lease, verify_object)
            else:
                for i in todo:
                    codes[i] = pb.NOT_FOUND
        except BaseException:
            self.local.release([lease.lease_id])
            raise
        offsets = np.zeros(len(flat), np.uint64)
        at = ranges.bounds(counts)
        pool_bytes = local_bytes = 0
        for i in range(n):
            if codes[i] != pb.OK:
                continue
            pairs = per_key[i]
            e = found[i]
            if e is not None:
                offsets[at[i]:at[i + 1]] = np.uint64(e.offset) + pairs[:, 0]
                local_bytes += ranges.total_bytes(pairs)
            else:
                offsets[at[i]:at[i + 1]] = ranges.starts(pairs).astype(np.uint64) + np.uint64(where[i].offset)
                pool_bytes += ranges.total_bytes(pairs)
        if not lease.entries:
            self.local.release([lease.lease_id])
        pool_hits = len(where)
        self.counters[SidecarCounter.RANGE_READS] += n
        self.counters[SidecarCounter.RANGE_HITS_LOCAL] += local_hits
        self.counters[SidecarCounter.RANGE_HITS_POOL] += pool_hits
        self.counters[SidecarCounter.RANGE_BYTES_LOCAL] += local_bytes
        self.counters[SidecarCounter.RANGE_BYTES_POOL] += pool_bytes
        return RangeResult(codes, sizes, offsets.tolist(), lease.lease_id if lease.entries else 0,
                           int(lease.expires * 1000) if lease.entries else 0, local_hits, pool_hits, pool_bytes)
