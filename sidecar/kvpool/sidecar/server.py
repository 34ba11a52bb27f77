"""The sidecar process (`kvpool sidecar`): serves the engine's client over a unix socket.

It owns the local tier (a shared-memory arena the client maps), asks the pool for what is not
local (one batched call per owner, all owners concurrently), fetches misses straight into the
arena, and writes through to the pool in the background (or back, on local eviction).  The
tenant and its token come from the command line / mounted credentials, never from the client.
SIGTERM: stop accepting, flush what exists only locally, exit 0.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import grpc
import numpy as np

from kvpool.core import errors, ranges
from kvpool.core.checksum import checksum
from kvpool.core.deadlines import Deadlines
from kvpool.core.keys import KEY_BYTES
from kvpool.core.retry import DONE, REFUSED, UNREACHABLE, RetryQueue, drain_pause, outcome, retried
from kvpool.core.units import parse_bytes
from kvpool.core.version import __version__
from kvpool.pool import routing
from kvpool.pool.fanout import Pool
from kvpool.sidecar import journal, metrics
from kvpool.sidecar.copyover import CopyOver
from kvpool.sidecar.handoff import HandoffService
from kvpool.sidecar.journal import PersistentArena
from kvpool.sidecar.landing import ArenaLanding, BufferLanding, Landing, SpillStash
from kvpool.sidecar.local_tier import LocalEntry, LocalLease, LocalTier
from kvpool.sidecar.session_server import FastSessionServer
from kvpool.transfer.copier import Copier
from kvpool.wire import grpc_status
from kvpool.wire.kv_events import MEDIUM_LOCAL, EventPublisher, EventsConfig, add_event_args, events_config
from kvpool.wire.proto import sidecar_pb2 as spb
from kvpool.wire.proto import sidecar_pb2_grpc as spbg
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.sidecar_frames import socket_path as fast_socket_path

T = TypeVar("T")
log = logging.getLogger("kvpool.sidecar")

_UNBOUNDED = (1 << 64) - 1
"""Size to check a non-local object's ranges against: only their shape (its owner knows the size)."""


@dataclass
class SidecarConfig:
    """Settings of one sidecar."""

    socket: str
    """Path of the unix socket the client connects to; the arena file is created beside it."""
    pool: list[str]
    """Seed addresses of store nodes (empty: local tier only)."""
    local_bytes: int = 256 << 20
    tenant_id: str = "default"
    token: str = ""
    write_back: bool = False
    """Blocks reach the pool on local eviction instead of right after the put."""
    drain_seconds: float = 20.0
    ring_poll_seconds: float = 5.0
    """Ask the nodes for the ring at least this often (one GetRing per node, concurrently)."""
    lease_ms: int = 10000
    """Lease of a match or read when the client asks for none."""
    max_lease_ms: int = 60000
    """Longest lease a client may ask for (a lease pins local-tier space)."""
    max_pending_bytes: int = 0
    """Write-through backlog above which new pool writes are shed (0: a quarter of the local tier)."""
    metrics_port: int = 0
    arena_dir: str = ""
    events: EventsConfig | None = None
    """Publish the local tier's stored/removed events for KV-aware routers (``kvpool.wire.kv_events``)."""
    handoff_listen: str = ""
    """``host:port`` of the transfer port that exports state objects to decode sidecars (prefill →
    decode handoff); "" exports none (records then send the decode side to the pool)."""
    handoff_advertise: str = ""
    """The address decode sidecars reach that port at (default: the bound address)."""
    handoff_key: bytes = b""
    """Secret signing handoff records, shared by the tenant's sidecars (default: the tenant token)."""
    max_handoff_hold_ms: int = 120_000
    """Longest a state object stays exported (the export pins local-tier space)."""
    transition_seconds: float = 600.0
    """How long after a ring change reads that miss look where keys used to live (``Pool``)."""
    copy_over_bytes: int = -1
    """Bound of the copy-over queue (blocks found at a previous owner, written to the new one):
    -1 an eighth of the local tier, 0 off."""
    max_registered_bytes: int = 1 << 40
    """Client memory (``Client.alloc_buffer``) the sidecar maps at most, over all connections; a
    registration beyond it is refused (the client then reads through the arena)."""
    pool_write_retries: int = 10
    """Retries of a write-through block, or of an evicted object's copy, whose pool write failed
    for a passing reason (busy or unreachable owner, another writer's reservation, ...:
    ``kvpool.core.retry``), with doubling delays (0.2 s up to 5 s: about 30 s in all); then it
    is counted as dropped (a block stays local-only, a copy is lost)."""
    match_deadline_ms: int = 100
    """Deadline of a match or exists at one store node (``--match-deadline-ms``): a node that
    has not answered by then is given up for this call (its keys are misses) and is suspect."""
    read_deadline_ms: int = 100
    """Base deadline of a read from one store node (``--read-deadline-ms``): until the node says
    what it sends, and then plus the payload at ``read_bytes_per_second``."""
    read_bytes_per_second: int = 100_000_000
    """Bandwidth floor a read's payload is given time for (``--read-bytes-per-second``)."""
    probe_deadline_ms: int = 1000
    """How long a probe of a suspect node waits (``--probe-deadline-ms``; in the background)."""
    suspect_backoff_ms: int = 1000
    """Back-off after a failed probe before the next one (doubling up to 8x;
    ``--suspect-backoff-ms``).  The first probe goes out right after the failure."""

    def deadlines(self) -> Deadlines:
        """The pool's per-call deadlines (:class:`kvpool.core.deadlines.Deadlines`)."""
        return Deadlines(self.match_deadline_ms / 1000.0, self.read_deadline_ms / 1000.0,
                         float(self.read_bytes_per_second), self.probe_deadline_ms / 1000.0)


class ReadResult(NamedTuple):
    codes: list[pb.Code]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    lease_id: int
    lease_expires_unix_ms: int
    local_hits: int
    pool_hits: int


@dataclass
class _MatchLease:
    local_lease: int
    pool_leases: list[tuple[str, int]]
    expires: float


def _verdict(got: dict[int, int]) -> dict[int, pb.Code]:
    """A pool write's codes (:meth:`Sidecar._push`) as a put's answer: UNAVAILABLE where no
    owner was reached."""
    return {k: pb.UNAVAILABLE if c == UNREACHABLE else grpc_status.as_code(c) for k, c in got.items()}


def _take_verdict(codes: list[pb.Code], entries: Sequence[LocalEntry | None], verdict: dict[int, pb.Code]) -> None:
    """Answer, for each object committed here, the pool's verdict (UNAVAILABLE for one without)."""
    for i, e in enumerate(entries):
        if codes[i] == pb.OK and e is not None:
            codes[i] = verdict.get(id(e), pb.UNAVAILABLE)


class Sidecar(spbg.SidecarServicer):
    def __init__(self, cfg: SidecarConfig) -> None:
        self.cfg = cfg
        arena_dir = cfg.arena_dir or os.path.dirname(os.path.abspath(cfg.socket))
        self.incarnation = journal.new_id()
        """This life's id: a client holding another's leases, reservations or offsets is refused."""
        self.local = LocalTier(cfg.local_bytes, arena_dir, label="sidecar", socket_path=cfg.socket,
                               tenant=cfg.tenant_id)
        self.local.on_evict = self._on_evict
        self.events = EventPublisher(cfg.events, MEDIUM_LOCAL, self.local.events_snapshot) if cfg.events else None
        self.local.events = self.events
        self.pool = Pool(cfg.pool, cfg.token, transition_seconds=cfg.transition_seconds, deadlines=cfg.deadlines(),
                         backoff=cfg.suspect_backoff_ms / 1000.0, max_backoff=8 * cfg.suspect_backoff_ms / 1000.0)
        self.pool.on_ring_change = self._ring_changed
        self.match_leases: dict[int, _MatchLease] = {}
        # Match lease ids start at a random base, as the local tier's: an id a client kept from
        # a previous life (or of the other kind) names nothing here.
        self._ids = itertools.count(journal.new_id() >> 2)
        self._lock = threading.Lock()
        self.pending: queue.Queue[tuple[list[LocalEntry], list[bytes] | None] | None] = queue.Queue()
        self.pending_bytes = 0
        self._deferred: collections.deque[LocalEntry] = collections.deque()
        self.deferred_bytes = 0
        self._pins: dict[int, int] = {}  # id(batch) → lease pinning it while the writer has it
        self._spilling: dict[int, float] = {}
        """Reservations of a put round that left items out (guarded by ``_lock``): written to the
        pool in their commit (:meth:`_commit_spilling`)."""
        self.max_pending = cfg.max_pending_bytes or self.local.capacity // 4
        self.counters = self.local.counters
        # Blocks waiting to be written again after a passing failure (guarded by ``_lock``);
        # bounded like the backlog they are part of.
        self.retries: RetryQueue[LocalEntry] = RetryQueue(cfg.pool_write_retries, self.max_pending)
        self._copies: dict[LocalEntry, bytes] = {}
        """Evicted objects waiting in ``retries`` → the copy of their bytes (the only one left)."""
        self._pusher = threading.Thread(target=self._push_loop, name="pool-writer", daemon=True)
        self._pusher.start()
        self._refresher = threading.Thread(target=self._refresh_loop, name="ring", daemon=True)
        self._stop = threading.Event()
        self._refresher.start()
        self._fetchers = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="fetch")
        self._copier = Copier()  # local hits of read_into, arena -> the caller's registered buffers
        secret = cfg.handoff_key or cfg.token.encode()
        if not secret and cfg.handoff_listen:
            log.warning("no handoff key and no tenant token: handoff records are checked for integrity, "
                        "not authenticity (give --handoff-key-file)")
        self.handoff = HandoffService(self, cfg.handoff_listen, cfg.handoff_advertise, secret,
                                      cfg.max_handoff_hold_ms)
        bound = self.local.capacity // 8 if cfg.copy_over_bytes < 0 else cfg.copy_over_bytes
        self.copy_over = CopyOver(self._pin_for_copy, self._copy_to_owner, self.counters, bound) if bound else None
        self.stash = SpillStash(min(64 << 20, max(self.local.capacity, 4 << 20)))
        """Objects a read had no room for in the arena, until the client's READ_INTO takes them."""
        self.max_range_bytes = min(ranges.DEFAULT_MAX_BYTES, self.local.capacity // 2)
        """Bytes one ranged read may ask for (the pool's ranges need scratch space in the arena)."""
        self.adopted = self._adopt()

    def _adopt(self) -> dict[str, int]:
        """Keep what a previous life left in the arena (a restart): adopted objects are served
        again, and those not yet in the pool are written there as before the crash."""
        arena = self.local.arena
        opened = arena.opened if isinstance(arena, PersistentArena) else None
        if opened is not None and opened.reset_reason:
            log.warning("local tier not adopted, starting empty: %s", opened.reset_reason)
            self.counters["restart_arena_reset"] += 1
        kept, counts = self.local.adopt(self.cfg.lease_ms)
        if opened is not None and opened.adopted_from:
            log.warning("local tier adopted from a previous life: %d objects (%d bytes) kept, %d dropped "
                        "(%d failed their checksum, %d uncommitted, %d incoherent)",
                        counts["restart_adopted_objects"], counts["restart_adopted_bytes"],
                        counts["restart_dropped_objects"], counts["restart_dropped_checksum"],
                        counts["restart_dropped_uncommitted"], counts["restart_dropped_incoherent"])
        if self.pool.enabled:
            # Write-through blocks the previous life had not written yet: queued again (write-back
            # blocks and state objects stay dirty: eviction and the drain hand them over).
            unsent = [e for e in kept if not e.pooled and not e.dirty]
            self.local.mark_dirty(unsent)
            if not self.cfg.write_back:
                self._defer([e for e in unsent if e.kind == pb.BLOCK])
            self.counters["restart_resumed_pool_writes"] += sum(1 for e in kept if not e.pooled)
        return counts

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _keys(blob: bytes, context: grpc.ServicerContext) -> tuple[list[bytes], np.ndarray]:
        if len(blob) % KEY_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"keys blob of {len(blob)} bytes is not a multiple of {KEY_BYTES}")
        arr = np.frombuffer(blob, dtype=f"V{KEY_BYTES}")
        return arr.tolist(), arr

    @staticmethod
    def _kind(kind: int, context: grpc.ServicerContext) -> int:
        if kind not in (pb.BLOCK, pb.STATE):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown object kind {kind}")
        return kind

    def _refresh_loop(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            # Match leases released with no frame to their node since: dropped now (their pins
            # hold objects against eviction until then).
            self.pool.flush_deferred(older_than=0.5)
            # Suspect nodes whose probe is due are probed even when no call goes their way.
            self.pool.probe_due()
            if self.pool.refresh_needed.wait(1.0) and not self._stop.is_set():
                try:
                    self.pool.refresh_ring()
                except Exception:
                    log.exception("ring refresh failed")
                last = time.monotonic()
            elif self.pool.enabled and (self.pool.nodes_up() < len(self.pool.nodes)
                                        or time.monotonic() - last >= self.cfg.ring_poll_seconds):
                # A node came back, or the ring changed where no reply of ours could tell (only
                # the dead node's keys were asked for, say): re-learn it now and then.
                try:
                    self.pool.refresh_ring()
                except Exception:
                    pass
                last = time.monotonic()

    # -- match --------------------------------------------------------------------------------

    def Hello(self, request: pb.Empty, context: grpc.ServicerContext) -> spb.HelloReply:
        return spb.HelloReply(arena_path=self.local.arena.path, arena_bytes=self.local.capacity,
                              tenant_id=self.cfg.tenant_id, version=__version__, ring_epoch=self.pool.ring.epoch,
                              pool_nodes=len(self.pool.nodes), handoff_address=self.handoff.address,
                              instance_id=self.handoff.instance, incarnation=self.incarnation,
                              arena_generation=self.arena_generation)

    @property
    def arena_generation(self) -> int:
        arena = self.local.arena
        return arena.generation if isinstance(arena, PersistentArena) else 0

    def Match(self, request: spb.MatchRequest, context: grpc.ServicerContext) -> spb.MatchReply:
        keys, arr = self._keys(request.keys, context)
        lease_ms = min(request.lease_ms or self.cfg.lease_ms, self.cfg.max_lease_ms)
        if request.per_key:
            return self._probe(keys, arr, self._kind(request.kind, context))
        prefix, n_local, lease_id = self.match_keys(arr, lease_ms, request.local_only)
        return spb.MatchReply(prefix=prefix, local_prefix=n_local, lease_id=lease_id)

    def match_keys(self, arr: np.ndarray, lease_ms: int, local_only: bool = False) -> tuple[int, int, int]:
        """The longest present prefix of the keys ``arr`` (32-byte voids; local tier, then
        pool), pinned under one lease: (prefix, local prefix, lease id or 0).  Shared by gRPC
        and the fast session."""
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
            lease_id = next(self._ids)
            with self._lock:
                self.match_leases[lease_id] = _MatchLease(local_lease.lease_id if local_lease else 0, pool_leases,
                                                          time.time() + lease_ms / 1000.0)
        elif pool_leases:
            self.pool.release(pool_leases)
        metrics.record_match(self.cfg.tenant_id, len(arr), n_local, prefix - n_local, time.perf_counter() - t0)
        self.counters["match_calls"] += 1
        self.counters["lookup_blocks"] += len(arr)
        self.counters["hit_blocks_local"] += n_local
        self.counters["hit_blocks_pool"] += prefix - n_local
        return prefix, n_local, lease_id

    def _probe(self, keys: list[bytes], arr: np.ndarray, kind: int) -> spb.MatchReply:
        found, _ = self.local.lookup(keys, kind)
        present = np.array([e is not None for e in found], dtype=bool)
        missing = np.flatnonzero(~present)
        if len(missing) and self.pool.enabled:
            present[missing] = self.pool.present(arr[missing], kind)
        return spb.MatchReply(present=present.astype(np.uint8).tobytes(), prefix=int(present.sum()))

    def _take_match_lease(self, lease_id: int) -> None:
        ml, expired = self._pop_match_leases(lease_id)
        for m in ([ml] if ml else []) + expired:
            self._release_match(m)

    def _pop_match_leases(self, lease_id: int) -> tuple[_MatchLease | None, list[_MatchLease]]:
        """The match lease ``lease_id`` (None if it is gone) and every expired one, forgotten."""
        with self._lock:
            ml = self.match_leases.pop(lease_id, None) if lease_id else None
            now = time.time()
            stale = [k for k, v in self.match_leases.items() if v.expires < now]
            expired = [self.match_leases.pop(k) for k in stale]
        return ml, expired

    def _release_match(self, m: _MatchLease, dropped: dict[str, int] | None = None) -> None:
        """Release what ``m`` pins, except the pool leases a read already dropped."""
        if m.local_lease:
            self.local.release([m.local_lease])
        left = [(nid, lid) for nid, lid in m.pool_leases if (dropped or {}).get(nid) != lid]
        if left:
            self.pool.release(left)

    def Release(self, request: spb.LeaseRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.release_leases(list(request.lease_ids))
        return pb.Empty()

    def release_leases(self, lease_ids: list[int]) -> None:
        """Drop match and read leases (unknown or expired ids are ignored)."""
        for lid in lease_ids:
            self._take_match_lease(lid)
        self.local.release(lease_ids)

    # -- read ---------------------------------------------------------------------------------

    def Read(self, request: spb.ReadRequest, context: grpc.ServicerContext) -> spb.ReadReply:
        keys, arr = self._keys(request.keys, context)
        kind = self._kind(request.kind, context)
        lease_ms = min(request.lease_ms or self.cfg.lease_ms, self.cfg.max_lease_ms)
        r = self.read_keys(keys, arr, kind, lease_ms, request.lease_id)
        return spb.ReadReply(codes=r.codes, offsets=r.offsets, sizes=r.sizes, checksums=r.checksums,
                             lease_id=r.lease_id, lease_expires_unix_ms=r.lease_expires_unix_ms,
                             local_hits=r.local_hits, pool_hits=r.pool_hits)

    def read_keys(self, keys: list[bytes], arr: np.ndarray, kind: int, lease_ms: int,
                  match_lease: int = 0) -> ReadResult:
        """Local hits and pool fetches of ``keys`` as arena extents under one read lease (which
        also drops the match lease ``match_lease``).  Shared by gRPC and the fast session."""
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
        try:
            with self._match_drops(match_lease) as drop:
                if missing and self.pool.enabled:
                    land = ArenaLanding(self.local, keys, kind, lease, found,
                                        self.copy_over.offer if self.copy_over is not None else None,
                                        self.pool.rpc_timeout, self.stash)
                    pool_hits = self._fetch_missing(keys, arr, missing, land, kind, lease_ms, drop)
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
            self.counters["read_no_room"] += spilled
        fetched = sum(e.size for e, was in zip(found, local_found, strict=True) if e is not None and not was)
        self._count_read(n - spilled, local_hits, pool_hits, moved, fetched, t0)
        return ReadResult(codes, offsets, sizes, sums, lease.lease_id if lease.entries else 0,
                          int(lease.expires * 1000) if lease.entries else 0, local_hits, pool_hits)

    @contextlib.contextmanager
    def _match_drops(self, match_lease: int) -> Iterator[dict[str, int]]:
        """The match lease a read supersedes: its pool lease at each node (node id -> lease id)
        is dropped by the read of that node, in the same round trip (the read pins what it
        sends); the reads take their entries from the dict, and what none took is released after."""
        ml, expired = self._pop_match_leases(match_lease)
        drop = dict(reversed(ml.pool_leases)) if ml else {}
        offered = dict(drop)
        try:
            yield drop
        finally:
            taken = {nid: lid for nid, lid in offered.items() if nid not in drop}
            for m in ([ml] if ml else []) + expired:
                self._release_match(m, taken)

    def read_into(self, keys: list[bytes], arr: np.ndarray, kind: int, dests: Sequence[memoryview],
                  match_lease: int = 0) -> tuple[list[pb.Code], list[int], int, int]:
        """``keys`` into the caller's registered buffers ``dests`` (fast session only): local hits
        copied out of the arena, misses fetched from their owners straight into the buffers
        (:class:`BufferLanding`: the local tier is left as it was).  Per-item codes (INVALID: the
        buffer is smaller than the object) and sizes, local hits, pool hits."""
        t0 = time.perf_counter()
        n = len(keys)
        found, lease = self.local.lookup(keys, kind, self.cfg.lease_ms)
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
            self._copier.copy(pairs)
        finally:
            self.local.release([lease.lease_id])
        local_hits = len(pairs)
        missing = [i for i, e in enumerate(found) if e is None]
        pool_hits = 0
        if missing and len(self.stash):
            # Objects a READ just fetched but had no room for (its NO_SPACE rows): copied from
            # the stash, not fetched from the pool a second time.
            missing, pool_hits = self._from_stash(keys, kind, dests, missing, codes, sizes)
        with self._match_drops(match_lease) as drop:
            if missing and self.pool.enabled:
                landed: list[int | None] = [None] * n
                land = BufferLanding(dests, landed)
                pool_hits += self._fetch_missing(keys, arr, missing, land, kind, self.cfg.lease_ms, drop)
                for i in missing:
                    size = landed[i]
                    if size is not None:
                        codes[i], sizes[i] = pb.OK, size
                    elif i in land.too_small:
                        codes[i], sizes[i] = pb.INVALID, land.sizes[i]
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
        self.counters["read_stash_hits"] += len(pairs)
        return left, len(pairs)

    def _count_read(self, n: int, local_hits: int, pool_hits: int, moved: int, from_pool: int, t0: float) -> None:
        """A read's metrics and counters (``moved`` bytes handed over, ``from_pool`` of them fetched)."""
        metrics.record_read(self.cfg.tenant_id, n, local_hits, pool_hits, moved, time.perf_counter() - t0, from_pool)
        self.counters["read_blocks"] += n
        self.counters["read_hits_local"] += local_hits
        self.counters["read_hits_pool"] += pool_hits
        self.counters["read_misses"] += n - local_hits - pool_hits

    def _fetch_missing(self, keys: list[bytes], arr: np.ndarray, missing: list[int], land: Landing, kind: int,
                       lease_ms: int, drop: dict[str, int]) -> int:
        """Fetch misses from their owners straight into where ``land`` puts them (fresh arena
        extents: promotion; or the caller's registered buffers); what the owners miss is looked
        for at the fallbacks (draining node, earlier ring epochs)."""
        # A key asked twice in one batch is fetched once.
        first: dict[bytes, int] = {}
        dups: list[tuple[int, int]] = []
        todo: list[int] = []
        for i in missing:
            j = first.setdefault(keys[i], i)
            if j == i:
                todo.append(i)
            else:
                dups.append((i, j))
        sub = arr[todo]
        found = land.found
        total = 0

        def still() -> np.ndarray:
            # An object with no room here was found all the same: not asked for again.
            return np.array([found[i] is None and i not in land.no_room for i in todo], dtype=bool)
        before = None  # what was missing when the fallback rounds began
        for fallback, routes in routing.rounds(self.pool.view, sub, kind, still, self.pool.catch_up_seconds):
            if fallback and before is None:
                before = still()
            total += self._fetch_round(todo, sub, land, kind, lease_ms, routes, drop)
        if before is not None:
            land.found_elsewhere([todo[j] for j in np.flatnonzero(before & ~still()).tolist()])
        total += land.settle()
        for i, j in dups:
            total += land.duplicate(i, j)
        return total

    def _fetch_round(self, todo: list[int], sub: np.ndarray, land: Landing, kind: int, lease_ms: int,
                     routes: dict[str, np.ndarray], drop: dict[str, int]) -> int:
        """One read per node of ``routes``, all concurrently; each object lands the moment the
        node has said its size (no second round trip), where ``land`` says.
        A node's read also drops the match lease ``drop`` holds for it (taken from ``drop``).
        Reads of several nodes each take one data connection: they already move in parallel, and
        cutting each over two more connections doubled the threads and their wake-ups for no
        more throughput on this kind of machine (measured: sidecar CPU per 16 MiB remote read
        13.1 -> 11.5 ms, wall 0.82x)."""
        jobs = [(nid, idx) for nid, idx in routes.items() if len(idx)]
        streams = 1 if len(jobs) > 1 else None

        def run(job: tuple[str, np.ndarray]) -> int:
            nid, idx = job
            mine = [todo[x] for x in idx.tolist()]  # this node's key indices, in its reply's order
            asked: list[int] = []

            def dest(j: int, size: int) -> memoryview | None:
                i = mine[j]
                asked.append(i)
                return land.dest(i, size)
            try:
                res = self.pool.read(nid, sub[idx], dest, kind, lease_ms, drop.pop(nid, 0), streams)
            except BaseException:
                for i in asked:
                    land.failed(i)
                raise
            got = 0
            for j, i in enumerate(mine):
                code = res.codes[j] if res is not None else pb.NOT_FOUND
                if code == pb.OK:
                    assert res is not None
                    got += land.landed(i, res.checksums[j])
                elif i in land.pending:
                    if code == pb.CHECKSUM:
                        self.counters["pool_checksum_failures"] += 1
                    self.counters["pool_fetch_failures"] += 1
                    land.failed(i)
            return got

        return self._run_jobs(run, jobs)

    def _run_jobs(self, run: Callable[[T], int | None], jobs: Sequence[T]) -> int:
        """Run one read per node: the first on this thread, the others on the fetchers (one
        thread handoff fewer per call); every read has stopped (none still lands bytes) before
        this returns.  The sum of the reads' results (None counts 0)."""
        futs = [self._fetchers.submit(run, job) for job in jobs[1:]]
        total = 0
        failure: BaseException | None = None
        try:
            if jobs:
                total += run(jobs[0]) or 0
        except BaseException as exc:
            failure = exc
        for f in futs:
            try:
                total += f.result() or 0
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return total

    # -- sparse read --------------------------------------------------------------------------

    def ReadRanges(self, request: spb.ReadRangesRequest, context: grpc.ServicerContext) -> spb.ReadRangesReply:
        """Byte ranges of objects (:mod:`kvpool.core.ranges`): a local object's ranges are pointed at
        in place (the client copies only them); a missing object's ranges are read from its owner
        — those bytes only — into a scratch extent of the arena that the lease holds and its end
        frees: the object is never pulled whole, nor cached here."""
        if request.release_lease_ids:  # the client's copies out of them are done
            self.local.release(list(request.release_lease_ids))
        keys, arr = self._keys(request.keys, context)
        kind = self._kind(request.kind, context)
        n = len(keys)
        if len(request.counts) != n:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{n} keys but {len(request.counts)} range counts")
        try:
            flat = ranges.decode(request.counts, request.ranges)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        per_key = ranges.split(request.counts, flat)
        lease_ms = min(request.lease_ms or self.cfg.lease_ms, self.cfg.max_lease_ms)
        found, lease = self.local.lookup(keys, kind, lease_ms)
        assert lease is not None
        # Local objects are checked against their size here; for the others only the shape and
        # the byte budget (the owner checks the bounds: it knows the size).
        sizes = [e.size if e is not None else 0 for e in found]
        bound = [s if e is not None else _UNBOUNDED for s, e in zip(sizes, found, strict=True)]
        codes = ranges.plan([pb.OK] * n, bound, per_key, ranges.MAX_RANGES_PER_KEY, self.max_range_bytes)
        local_hits = sum(1 for e, c in zip(found, codes, strict=True) if e is not None and c == pb.OK)
        todo = [i for i in range(n) if found[i] is None and codes[i] == pb.OK]
        where: dict[int, LocalEntry] = {}
        try:
            if todo and self.pool.enabled:
                where = self._fetch_ranges(keys, arr, todo, per_key, codes, sizes, kind, lease,
                                           request.verify_object)
            else:
                for i in todo:
                    codes[i] = pb.NOT_FOUND
        except BaseException:
            self.local.release([lease.lease_id])
            raise
        offsets = np.zeros(len(flat), np.uint64)
        at = ranges.bounds(request.counts)
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
        self.counters["range_reads"] += n
        self.counters["range_hits_local"] += local_hits
        self.counters["range_hits_pool"] += pool_hits
        self.counters["range_bytes_local"] += local_bytes
        self.counters["range_bytes_pool"] += pool_bytes
        return spb.ReadRangesReply(codes=codes, sizes=sizes, offsets=offsets.tolist(),
                                   lease_id=lease.lease_id if lease.entries else 0,
                                   lease_expires_unix_ms=int(lease.expires * 1000) if lease.entries else 0,
                                   local_hits=local_hits, pool_hits=pool_hits, pool_bytes=pool_bytes)

    def _fetch_ranges(self, keys: list[bytes], arr: np.ndarray, todo: list[int], per_key: list[ranges.Pairs],
                      codes: list[pb.Code], sizes: list[int], kind: int, lease: LocalLease,
                      verify_object: bool) -> dict[int, LocalEntry]:
        """Read the ranges of ``todo``'s objects from their owners (then the fallbacks, as whole
        reads do) into scratch extents; key index → its scratch for those that arrived."""
        scratch = self.local.scratch([ranges.total_bytes(per_key[i]) for i in todo], lease)
        have: dict[int, LocalEntry] = {}
        for i, e in zip(todo, scratch, strict=True):
            if e is None:
                codes[i] = pb.NO_SPACE
            else:
                have[i] = e
                codes[i] = pb.NOT_FOUND  # until an owner answers
        ask = [i for i in todo if i in have]
        sub = arr[ask]

        def run(job: tuple[str, np.ndarray]) -> None:
            nid, idx = job
            sel = [ask[int(j)] for j in idx]
            r = self.pool.read_ranges(nid, sub[idx], [per_key[i] for i in sel],
                                      [self.local.view(have[i]) for i in sel], kind, verify_object)
            if r is None:
                return
            for i, c, size in zip(sel, r.codes, r.sizes, strict=True):
                codes[i], sizes[i] = c, size  # only keys still NOT_FOUND are asked
                if c == pb.CHECKSUM:
                    self.counters["pool_checksum_failures"] += 1

        def round_(routes: dict[str, np.ndarray]) -> None:
            still = np.array([codes[i] == pb.NOT_FOUND for i in ask], dtype=bool)
            jobs = [(nid, idx[still[idx]]) for nid, idx in routes.items()]
            self._run_jobs(run, [j for j in jobs if len(j[1])])

        def missing() -> np.ndarray:
            return np.array([codes[i] == pb.NOT_FOUND for i in ask], dtype=bool)

        try:
            if ask:
                for _, routes in routing.rounds(self.pool.view, sub, kind, missing, self.pool.catch_up_seconds):
                    round_(routes)
        finally:
            for i, e in have.items():
                if not self.local.scratch_done(e, lease, keep=codes[i] == pb.OK) and codes[i] == pb.OK:
                    codes[i] = pb.LEASE_EXPIRED  # its scratch is gone: never point at a freed extent
        return {i: e for i, e in have.items() if codes[i] == pb.OK}

    # -- write --------------------------------------------------------------------------------

    def WriteStart(self, request: spb.WriteStartRequest, context: grpc.ServicerContext) -> spb.WriteStartReply:
        keys, _ = self._keys(request.keys, context)
        if len(request.sizes) != len(keys):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} keys but {len(request.sizes)} sizes")
        self._kind(request.kind, context)
        codes, entries, rid = self.write_start(keys, list(request.sizes), request.kind, request.traffic_class)
        return spb.WriteStartReply(codes=codes, offsets=[e.offset if e else 0 for e in entries], reservation_id=rid)

    def write_start(self, keys: list[bytes], sizes: list[int], kind: int,
                    traffic_class: str) -> tuple[list[pb.Code], list[LocalEntry | None], int]:
        """Reserve arena extents for a put: (codes, entries, reservation id).

        A batch larger than the free local tier (items left NO_SPACE) with a pool behind: its
        commit writes the reserved part to the pool before it answers (:meth:`write_commit`),
        so the client's next round (:meth:`Client.put`) can evict those clean copies and take
        their room — the batch streams through the tier instead of being refused."""
        codes, entries, rid = self.local.reserve(keys, sizes, kind, traffic_class or "chatbot")
        if rid and self.pool.enabled and pb.NO_SPACE in codes:
            now = time.monotonic()
            with self._lock:
                # Rounds never committed lapse with their reservation: forgotten here then.
                for old in [r for r, t in self._spilling.items() if t < now]:
                    del self._spilling[old]
                self._spilling[rid] = now + self.local.reservation_seconds
        return codes, entries, rid

    def WriteCommit(self, request: spb.WriteCommitRequest, context: grpc.ServicerContext) -> pb.CodesReply:
        try:
            return pb.CodesReply(codes=self.write_commit(request.reservation_id, list(request.checksums),
                                                         request.pool_wait_ms))
        except errors.InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # not reached: abort raises

    def write_commit(self, reservation_id: int, sums: list[int], pool_wait_ms: int = 0) -> list[pb.Code]:
        """Make a reservation's objects visible (and queue them for the pool): per-item codes.

        ``pool_wait_ms``: write them to the pool now and answer, for each object committed
        here, the pool's verdict (:meth:`_write_waited`) instead of the local tier's."""
        t0 = time.perf_counter()
        with self.local.lock:
            res = self.local.reservations.get(reservation_id)
            entries = list(res[1]) if res else []
        if res is None:
            return [pb.LEASE_EXPIRED] * len(sums)
        if len(sums) != len(entries):
            raise errors.InvalidArgument(f"{len(sums)} checksums for {len(entries)} items")
        for i, e in enumerate(entries):
            if e is not None and not sums[i]:
                sums[i] = checksum(self.local.view(e))
        with self._lock:
            spilling = self._spilling.pop(reservation_id, None) is not None
        if spilling:
            return self._commit_spilling(reservation_id, sums, t0, pool_wait_ms > 0)
        kind_state = any(e is not None and e.kind == pb.STATE for e in entries)
        # State objects are single-copy host-memory objects: only flushed on drain/eviction.
        dirty = self.cfg.write_back or kind_state or not self.pool.enabled
        through = self.pool.enabled and not dirty
        waited = pool_wait_ms > 0 and self.pool.enabled
        codes, done, pin = self.local.commit(reservation_id, sums, dirty=dirty and self.pool.enabled,
                                             pin_ms=600_000 if through or waited else 0)
        if pool_wait_ms > 0:
            # The pool's verdict was asked for; with no pool there is none to take the objects.
            verdict = self._write_waited(done, pin, pool_wait_ms / 1000.0) if pin is not None and waited else {}
            _take_verdict(codes, entries, verdict)
        elif pin is not None:
            self._enqueue(done, pin=pin)
        self.counters["put_blocks"] += len(done)
        metrics.record_put(self.cfg.tenant_id, sum(e.size for e in done), time.perf_counter() - t0)
        return codes

    def _commit_spilling(self, reservation_id: int, sums: list[int], t0: float, verdict: bool = False
                         ) -> list[pb.Code]:
        """Commit a round of a batch larger than the free local tier and write it to the pool
        now, from the arena (pinned meanwhile), on the caller's thread: when the client's next
        round asks, these are clean copies it may evict.  Whatever the write policy (the tier
        cannot keep the batch anyway); a write that failed leaves its objects local-only, handed
        over on eviction like any other (and retried, :meth:`_retry_later`).  ``verdict`` (a put
        with wait): the codes of the objects committed are the pool's."""
        with self.local.lock:
            res = self.local.reservations.get(reservation_id)
            entries = list(res[1]) if res else []
        codes, done, pin = self.local.commit(reservation_id, sums, dirty=True, pin_ms=600_000)
        pool_codes = self._push_pinned(done, pin, "a spilling put")
        self._retry_later(done, None, pool_codes)
        if verdict:
            _take_verdict(codes, entries, _verdict(pool_codes))
        self.counters["put_blocks"] += len(done)
        self.counters["put_spilled_rounds"] += 1
        metrics.record_put(self.cfg.tenant_id, sum(e.size for e in done), time.perf_counter() - t0)
        return codes

    def write_from(self, keys: list[bytes], srcs: Sequence[memoryview], sums: list[int], kind: int,
                   traffic_class: str) -> list[int]:
        """Write objects to the pool straight from the client's memory (fast session WRITE_FROM:
        the part of a put the local tier had no room for, everything in it pinned), on the
        caller's thread: per-item pool codes (OK for one the pool holds already; NO_SPACE where
        no owner could be reached — no copy is left here to try again with)."""
        if not self.pool.enabled:
            return [pb.NO_SPACE] * len(keys)
        todo = [i for i, (k, v) in enumerate(zip(keys, srcs, strict=True)) if len(k) == KEY_BYTES and v.nbytes]
        codes: list[int] = [pb.INVALID] * len(keys)
        for i in todo:
            if not sums[i]:
                sums[i] = checksum(srcs[i])
        got = self.pool.put([keys[i] for i in todo], [srcs[i] for i in todo], [sums[i] for i in todo],
                            traffic_class or "chatbot", kind) if todo else []
        for i, c in zip(todo, got, strict=True):
            codes[i] = pb.OK if c in (pb.OK, pb.ALREADY_EXISTS) else pb.NO_SPACE if c == UNREACHABLE else c
        ok = sum(1 for c in codes if c == pb.OK)
        self.counters["put_streamed"] += ok
        self.counters["pool_writes"] += ok
        return codes

    def _push_pinned(self, entries: list[LocalEntry], pin: LocalLease | None, what: str) -> dict[int, int]:
        """Write committed arena entries (pinned by ``pin``) to the pool now, then unpin them:
        id(entry) → the pool's code, missing for one not sent (the push raised)."""
        got: dict[int, int] = {}
        try:
            if entries:
                self._push(entries, None, got)
        except Exception:
            log.exception("pool write (%s) failed", what)
        finally:
            if pin is not None:
                self.local.release([pin.lease_id])
        return got

    def _write_waited(self, entries: list[LocalEntry], pin: LocalLease, seconds: float) -> dict[int, pb.Code]:
        """Write committed objects (pinned by ``pin``) to the pool on a thread of their own and
        wait for it at most ``seconds``: id(entry) → the pool's code, UNAVAILABLE for an object
        no owner took (down, unreachable) and missing for one whose write was still on its way
        at the deadline.  What happens after is what happens to any write-through: a passing
        failure is tried again later, a refusal leaves the object local-only."""
        got: dict[int, int] = {}
        verdict: dict[int, pb.Code] = {}
        lock = threading.Lock()
        finished = threading.Event()

        def run() -> None:
            try:
                got.update(self._push_pinned(entries, pin, "put with wait"))
            finally:
                with lock:  # all at once: a caller past its deadline sees none of it, never half
                    verdict.update(_verdict(got))
                finished.set()
            self._retry_later(entries, None, got)

        threading.Thread(target=run, name="kvpool-put-wait", daemon=True).start()
        finished.wait(seconds)
        with lock:
            return dict(verdict)

    def WriteRevoke(self, request: pb.PutRevokeRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.local.revoke(request.reservation_id)
        with self._lock:
            self._spilling.pop(request.reservation_id, None)
        return pb.Empty()

    def Remove(self, request: pb.RemoveRequest, context: grpc.ServicerContext) -> pb.CodesReply:
        keys, _ = self._keys(request.keys, context)
        return pb.CodesReply(codes=self.local.remove(keys, self._kind(request.kind, context)))

    def _enqueue(self, entries: list[LocalEntry], copies: list[bytes] | None = None,
                 pin: LocalLease | None = None) -> None:
        """Queue a batch for the pool writer: pinned arena entries (``pin``) or evicted copies."""
        size = sum(e.size for e in entries)
        if copies is None and self.pending_bytes + size > self.max_pending and self.pending_bytes > 0:
            # Shed rather than stall the engine: the blocks become local-only (handed over on
            # eviction and drain like write-back blocks) and the writer takes them up again
            # when the backlog has room.
            self.counters["pool_writes_shed"] += len(entries)
            self.local.mark_dirty(entries)
            with self._lock:
                self._deferred.extend(entries)
                self.deferred_bytes += size
            if pin is not None:
                self.local.release([pin.lease_id])
            return
        with self._lock:
            self.pending_bytes += size
        if copies is None:
            entries = list(entries)
            if pin is not None:
                self._pins[id(entries)] = pin.lease_id
            self.pending.put((entries, None))
        else:
            self.pending.put((entries, copies))

    def _on_evict(self, evicted: list[tuple[LocalEntry, bytes]]) -> None:
        if self.pool.enabled:
            self._enqueue([e for e, _ in evicted], [b for _, b in evicted])

    def _pin_for_copy(self, entries: list[LocalEntry]) -> tuple[list[LocalEntry], Any]:
        lease = self.local.lease(entries, 600_000)
        return list(lease.entries), lambda: self.local.release([lease.lease_id])

    def _copy_to_owner(self, entries: list[LocalEntry]) -> list[int]:
        """One pool write per traffic class to the current owners (the copy-over worker)."""
        codes = [UNREACHABLE] * len(entries)
        groups: dict[str, list[int]] = {}
        for i, e in enumerate(entries):
            groups.setdefault(e.traffic_class or "chatbot", []).append(i)
        for tclass, sel in groups.items():
            got = self.pool.put([entries[i].key for i in sel], [self.local.view(entries[i]) for i in sel],
                                [entries[i].checksum for i in sel], tclass, pb.BLOCK)
            for i, c in zip(sel, got, strict=True):
                codes[i] = c
        return codes

    def _ring_changed(self, ring: Any) -> None:
        """Write-through blocks whose pool write failed (their owner was unreachable) get another
        chance under the new ring; write-back blocks and state objects wait for eviction/drain."""
        if self.cfg.write_back:
            return
        self._defer([e for e in self.local.local_only() if e.kind == pb.BLOCK])

    def _defer(self, blocks: list[LocalEntry]) -> None:
        """Queue local-only write-through blocks for another pool write (once each)."""
        if not blocks:
            return
        with self._lock:
            queued = {id(e) for e in self._deferred}
            todo = [e for e in blocks if id(e) not in queued]
            self._deferred.extend(todo)
            self.deferred_bytes += sum(e.size for e in todo)
        self.counters["pool_writes_retried"] += len(todo)

    def _resume_deferred(self) -> None:
        """Queue deferred write-through blocks again while the backlog has room."""
        batch: list[LocalEntry] = []
        nbytes = 0
        with self._lock:
            while self._deferred and len(batch) < 64:
                e = self._deferred[0]
                if batch and self.pending_bytes + nbytes + e.size > self.max_pending:
                    break
                self._deferred.popleft()
                batch.append(e)
                nbytes += e.size
            # Moved from deferred to pending in one step: the backlog never reads 0 meanwhile.
            self.deferred_bytes -= nbytes
            self.pending_bytes += nbytes
        if not batch:
            return
        lease = self.local.lease([e for e in batch if e.dirty], 600_000)  # evicted ones went as copies
        with self._lock:
            self.pending_bytes -= nbytes - sum(e.size for e in lease.entries)
        if lease.entries:
            entries = list(lease.entries)
            self._pins[id(entries)] = lease.lease_id
            self.pending.put((entries, None))
        else:
            self.local.release([lease.lease_id])

    def _push_loop(self) -> None:
        """The pool writer (background thread): one queued batch after another; in between,
        deferred blocks and due retries are queued again."""
        while True:
            try:
                item = self.pending.get(timeout=0.1)
            except queue.Empty:
                self._resume_waiting()
                continue
            if item is None:
                return
            entries, copies = item
            codes: dict[int, int] = {}
            try:
                self._push(entries, copies, codes)
            except Exception:
                log.exception("pool write failed")
            finally:
                with self._lock:
                    self.pending_bytes -= sum(e.size for e in entries)
                lid = self._pins.pop(id(entries), None)
                if lid:
                    self.local.release([lid])
            self._retry_later(entries, copies, codes)
            if self.pending.empty():
                self._resume_waiting()
            else:
                self._resume_retries()  # due retries queue behind the batches already waiting

    def _resume_waiting(self) -> None:
        """Queue again what waits for the writer: deferred blocks (backlog room) and due retries."""
        if self._deferred:
            self._resume_deferred()
        self._resume_retries()

    def _retry_later(self, entries: list[LocalEntry], copies: list[bytes] | None, codes: dict[int, int]) -> None:
        """After a batch: schedule another write of each write-through block or evicted copy
        that failed for a passing reason (:func:`retry.retried`).  One tried too often, or not
        fitting the backlog, is counted as dropped: a block still local stays local-only (eviction
        or the drain hands it over), an evicted copy is lost."""
        scheduled = kept_local = lost = lost_bytes = 0
        now = time.monotonic()
        with self._lock:
            for i, e in enumerate(entries):
                copy = copies[i] if copies is not None else None
                # A block missing from ``codes`` was not sent (the push raised): try it again too.
                if not retried(codes.get(id(e), UNREACHABLE), e.pooled, copy is not None, e.kind == pb.BLOCK,
                               self.cfg.write_back):
                    self.retries.settle(e)
                elif self.retries.schedule(e, e.size, now):
                    scheduled += 1
                    if copy is not None:
                        self._copies[e] = copy
                elif copy is None:
                    kept_local += 1
                else:
                    lost += 1
                    lost_bytes += e.size
        if scheduled:
            self.counters["pool_writes_backoff"] += scheduled
        if kept_local or lost:
            self.counters["pool_writes_dropped"] += kept_local + lost
        if kept_local:
            log.warning("%d write-through blocks dropped after %d pool write retries (or for a full backlog): "
                        "they stay local-only", kept_local, self.retries.max_attempts)
        if lost:
            log.warning("%d evicted objects (%d bytes) lost: their pool write failed for a passing reason %d "
                        "times, or the backlog (%d bytes) had no room for their copies", lost, lost_bytes,
                        self.retries.max_attempts + 1, self.retries.max_bytes)

    def _resume_retries(self) -> None:
        """Queue the retries that are due: the evicted copies as one batch, the blocks still local
        and not pooled as one pinned batch."""
        now = time.monotonic()
        with self._lock:
            due = self.retries.next_due()
            if due is None or due > now:
                return
            taken = self.retries.take_due(now, 64)
            copied = [(e, self._copies.pop(e)) for e, _ in taken if e in self._copies]
            # Moved from the retries to pending in one step: the backlog never reads 0 meanwhile.
            self.pending_bytes += sum(size for _, size in taken)
        if copied:
            self.pending.put(([e for e, _ in copied], [c for _, c in copied]))
        in_copies = {id(e) for e, _ in copied}
        local = [e for e, _ in taken if id(e) not in in_copies]
        if not local:
            return
        live = [e for e in local if e.dirty and not e.pooled]
        lease = self.local.lease(live, 600_000)  # an evicted block went to the pool as a copy
        kept = {id(e) for e in lease.entries}
        with self._lock:
            self.pending_bytes -= sum(e.size for e in local if id(e) not in kept)
            for e in local:
                if id(e) not in kept:
                    self.retries.settle(e)
        if lease.entries:
            entries = list(lease.entries)
            self._pins[id(entries)] = lease.lease_id
            self.pending.put((entries, None))
        else:
            self.local.release([lease.lease_id])

    def backlog_bytes(self) -> int:
        """Bytes on their way to the pool: queued, deferred (shed) and waiting for a retry."""
        return max(self.pending_bytes + self.deferred_bytes + self.retries.bytes, 0)

    def _push(self, entries: list[LocalEntry], copies: list[bytes] | None,
              codes_out: dict[int, int] | None = None) -> tuple[int, int]:
        """Write a batch to the owners (never what the pool is known to hold); ok / failed counts
        (and, into ``codes_out``, id(entry) → the pool's code for each entry sent).

        An item refused because our ring is stale (DRAINING, WRONG_OWNER) is sent once more after
        learning the new ring; one that still failed stays local-only (dirty), so eviction or
        the drain at SIGTERM hands it over again (and the pool writer tries a write-through
        block again later if the failure was a passing one: :meth:`_retry_later`).
        """
        todo = [i for i, e in enumerate(entries) if not e.pooled]
        if not todo:
            return 0, 0
        epoch = self.pool.ring.epoch
        ok = failed = 0
        groups: dict[tuple[int, str], list[int]] = {}
        for i in todo:
            groups.setdefault((entries[i].kind, entries[i].traffic_class or "chatbot"), []).append(i)
        still_local: list[LocalEntry] = []
        journaled: list[LocalEntry] = []  # now in the pool: a restart need not send them again
        for (kind, traffic_class), sel in groups.items():
            codes: dict[int, int] = {}
            for attempt in range(2):
                views = [memoryview(copies[i]) if copies is not None else self.local.view(entries[i]) for i in sel]
                routed = self.pool.ring.epoch
                got = self.pool.put([entries[i].key for i in sel], views, [entries[i].checksum for i in sel],
                                    traffic_class, kind)
                codes.update(zip(sel, got, strict=True))
                stale = [i for i in sel if codes[i] in (pb.DRAINING, pb.WRONG_OWNER)]
                # A writer, not the engine's read path: it may wait (bounded) for the newer ring.
                if not stale or attempt or not self.pool.catch_up(routed, wait_seconds=self.pool.rpc_timeout):
                    break
                sel = stale
            for i, c in codes.items():
                if codes_out is not None:
                    codes_out[id(entries[i])] = c
                if c in (pb.OK, pb.ALREADY_EXISTS):
                    entries[i].pooled = True
                    entries[i].dirty = False
                    ok += 1
                    if copies is None:
                        journaled.append(entries[i])
                else:
                    failed += 1
                    name = "unreachable" if c == UNREACHABLE else pb.Code.Name(c).lower()
                    self.counters[f"pool_write_{name}"] += 1
                    if copies is None:
                        still_local.append(entries[i])
        self.local.note_flags(journaled)
        if still_local:
            self.local.mark_dirty(still_local)
            if self.pool.ring.epoch != epoch and not self.cfg.write_back:
                # The ring changed while this batch was on its way (to an owner that is gone):
                # the retry of :meth:`_ring_changed` may have missed it, so queue it again.
                self._defer([e for e in still_local if e.kind == pb.BLOCK])
        self.counters["pool_writes"] += ok
        metrics.POOL_BYTES_OUT.labels(self.cfg.tenant_id).inc(sum(entries[i].size for i in todo if entries[i].pooled))
        return ok, failed

    def Flush(self, request: spb.FlushRequest, context: grpc.ServicerContext) -> spb.FlushReply:
        flushed, nbytes, dropped = self.flush(request.timeout_ms / 1000.0 if request.timeout_ms else 10.0)
        return spb.FlushReply(flushed_objects=flushed, flushed_bytes=nbytes, dropped_objects=dropped)

    def flush(self, seconds: float) -> tuple[int, int, int]:
        """Push every local-only object to the pool within ``seconds``, hottest first: those in
        the local tier and the evicted copies waiting for a retry; (flushed, bytes, dropped).

        A write that fails for a passing reason (a node stopped for a moment, another writer's
        reservation) is tried again, in rounds with short growing pauses, until the deadline;
        what is not in the pool then, or what the pool refuses, is reported dropped (and logged).
        """
        deadline = time.monotonic() + seconds
        if not self.pool.enabled:
            return 0, 0, len(self.local.local_only())
        flushed = nbytes = lost = 0
        refused: set[int] = set()  # id of a local object the pool refused: not sent again
        copies: dict[LocalEntry, bytes] = {}
        rounds = 0  # rounds that had a passing failure
        while True:
            copies.update(self._take_retries())
            items = [e for e in self.local.local_only() if id(e) not in refused]
            if not items and not copies:
                if self.pending_bytes <= 0 or time.monotonic() >= deadline:
                    break
                time.sleep(0.01)  # the pool writer is still at the write-through backlog
                continue
            done, failed = self._flush_round(items, copies, refused, deadline)
            flushed += len(done)
            nbytes += sum(e.size for e in done)
            lost += sum(1 for e in failed if e in copies and outcome(failed[e]) == REFUSED)
            for e in done + [e for e in failed if outcome(failed[e]) == REFUSED]:
                copies.pop(e, None)
            passing = sum(1 for c in failed.values() if outcome(c) != REFUSED)
            left = deadline - time.monotonic()
            if passing and left > 0:
                if not rounds:
                    log.warning("flush: %d objects not written for a passing reason; trying again until the "
                                "deadline (%.1fs)", passing, left)
                rounds += 1
                time.sleep(drain_pause(rounds, left))
            elif left <= 0 or not passing and self.pending_bytes <= 0:
                break
        dropped = len(self.local.local_only()) + len(copies) + lost
        if dropped:
            log.warning("flush: %d local-only objects dropped: not in the pool by the deadline or refused by it",
                        dropped)
        return flushed, nbytes, dropped

    def _take_retries(self) -> dict[LocalEntry, bytes]:
        """Everything waiting for a retry, now (the drain does not wait out backoffs): the
        evicted objects' copies, handed to the caller; the blocks still local are left to the
        drain's pass over the local tier."""
        with self._lock:
            taken = self.retries.take_due(float("inf"), len(self.retries))
            for e, _ in taken:
                self.retries.settle(e)
            return {e: self._copies.pop(e) for e, _ in taken if e in self._copies}

    def _flush_round(self, items: list[LocalEntry], copies: dict[LocalEntry, bytes], refused: set[int],
                     deadline: float) -> tuple[list[LocalEntry], dict[LocalEntry, int]]:
        """One write of each local object ``items`` (pinned) and evicted copy, 16 at a time, none
        started past ``deadline``: (those the pool now holds, those that failed → their code); a
        refused local object's id goes into ``refused``."""
        done: list[LocalEntry] = []
        failed: dict[LocalEntry, int] = {}

        def write(batch: list[LocalEntry], data: list[bytes] | None) -> None:
            codes: dict[int, int] = {}
            try:
                self._push(batch, data, codes)
            except Exception:
                log.exception("flush: pool write failed")
            for e in batch:
                if id(e) not in codes and e.pooled:
                    continue  # the pool writer wrote it meanwhile
                code = codes.get(id(e), UNREACHABLE)
                if outcome(code) == DONE:
                    done.append(e)
                else:
                    failed[e] = code
                    if data is None and outcome(code) == REFUSED:
                        refused.add(id(e))

        for start in range(0, len(items), 16):
            if time.monotonic() >= deadline:
                return done, failed
            lease = self.local.lease(items[start:start + 16], 60_000)
            try:
                # Evicted meanwhile: already handed to the writer as copies (left out of the lease).
                write(list(lease.entries), None)
            finally:
                self.local.release([lease.lease_id])
        pairs = list(copies.items())
        for start in range(0, len(pairs), 16):
            if time.monotonic() >= deadline:
                break
            write([e for e, _ in pairs[start:start + 16]], [c for _, c in pairs[start:start + 16]])
        return done, failed

    def PublishPrefill(self, request: spb.PublishPrefillRequest,
                       context: grpc.ServicerContext) -> spb.PublishPrefillReply:
        return self.handoff.publish(request)

    def AcceptHandoff(self, request: spb.AcceptHandoffRequest,
                      context: grpc.ServicerContext) -> spb.AcceptHandoffReply:
        return self.handoff.accept(request, context)

    def Stats(self, request: pb.Empty, context: grpc.ServicerContext) -> spb.SidecarStats:
        counters = dict(self.counters)
        counters["pool_errors"] = self.pool.errors
        counters["pool_match_releases_sent"] = self.pool.releases_sent
        counters["pool_match_releases_carried"] = self.pool.releases_carried
        counters["pool_deadline_misses"] = self.pool.deadline_misses
        counters["pool_calls_skipped"] = self.pool.calls_skipped
        counters["pool_probes_ok"] = self.pool.probes_ok
        counters["pool_probes_failed"] = self.pool.probes_failed
        counters["local_only_objects"] = len(self.local.local_only())
        counters["ring_transition"] = int(self.pool.in_transition)
        if self.copy_over is not None:
            counters["pool_copyover_queued_bytes"] = self.copy_over.queued_bytes
        return spb.SidecarStats(counters=counters, local_capacity_bytes=self.local.capacity,
                                local_used_bytes=self.local.used, local_objects=len(self.local.lru),
                                ring_epoch=self.pool.ring.epoch, pool_nodes_up=self.pool.nodes_up(),
                                pending_pool_bytes=self.backlog_bytes())

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        self._stop.set()
        self.pending.put(None)
        self._pusher.join(timeout=5)
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        self._copier.close()
        self.handoff.close()
        if self.copy_over is not None:
            self.copy_over.close()
        self.pool.close()
        self.local.close()


def load_credentials(path: str) -> tuple[str, str]:
    """(tenant id, token) from a mounted credentials file: JSON {tenantId, token[, salt]}."""
    try:
        with open(path) as f:
            doc = json.load(f)
        return str(doc["tenantId"]), str(doc["token"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"kvpool sidecar: cannot read credentials {path}: {exc}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpool sidecar", description="Serve an engine's kvpool client")
    ap.add_argument("--socket", required=True, help="unix socket path (the arena is created beside it)")
    ap.add_argument("--pool", default="", help="comma-separated store node addresses (empty: local tier only)")
    ap.add_argument("--local", type=parse_bytes, default=256 << 20, help="local tier payload capacity")
    ap.add_argument("--tenant", default=None)
    ap.add_argument("--credentials", default=os.environ.get("KVPOOL_CREDENTIALS"))
    ap.add_argument("--token", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--write-back", action="store_true")
    ap.add_argument("--drain-seconds", type=float, default=20.0)
    ap.add_argument("--metrics-port", type=int, default=0)
    ap.add_argument("--transition-seconds", type=float, default=600.0,
                    help="after a ring change, look for missing keys at their previous owners this long")
    ap.add_argument("--copy-over-bytes", type=parse_bytes, default=-1,
                    help="bound of the queue copying blocks found at a previous owner to the new one "
                         "(default: an eighth of the local tier; 0: off)")
    ap.add_argument("--pool-write-retries", type=int, default=10,
                    help="retries of a write-through block or an evicted object's copy whose pool write failed "
                         "for a passing reason (with doubling delays), after which it is counted as dropped "
                         "(a block stays local-only, a copy is lost)")
    ap.add_argument("--max-registered-bytes", type=parse_bytes, default=1 << 40,
                    help="client memory (Client.alloc_buffer) mapped at most, over all clients; a "
                         "registration beyond it is refused and that client reads through the arena")
    ap.add_argument("--match-deadline-ms", type=_positive_int, default=100,
                    help="deadline of a match/exists at one store node; a node that misses it is skipped "
                         "(its keys are misses) until a probe lets it back in")
    ap.add_argument("--read-deadline-ms", type=_positive_int, default=100,
                    help="base deadline of a read from one store node (plus its payload at --read-bytes-per-second)")
    ap.add_argument("--read-bytes-per-second", type=parse_bytes, default=100_000_000,
                    help="bandwidth floor a read's payload gets time for (e.g. 100000000, 200MiB; 0: none)")
    ap.add_argument("--probe-deadline-ms", type=_positive_int, default=1000,
                    help="how long a background probe of a suspect store node waits for its answer")
    ap.add_argument("--suspect-backoff-ms", type=_positive_int, default=1000,
                    help="back-off between probes of a suspect store node (doubling up to 8x)")
    ap.add_argument("--log-level", default=os.environ.get("KVPOOL_LOG_LEVEL", "INFO"))
    ap.add_argument("--handoff-listen", default=os.environ.get("KVPOOL_HANDOFF_LISTEN", ""),
                    help="host:port exporting state objects to decode sidecars (prefill -> decode handoff)")
    ap.add_argument("--handoff-advertise", default=os.environ.get("KVPOOL_HANDOFF_ADVERTISE", ""),
                    help="address decode sidecars reach the handoff port at (default: the bound one)")
    ap.add_argument("--handoff-key-file", default=os.environ.get("KVPOOL_HANDOFF_KEY_FILE"),
                    help="secret that signs handoff records (default: the tenant token)")
    add_event_args(ap)
    ap.add_argument("--arena-dir", default="",
                    help="directory of the shared-memory arena (default: beside the socket); it must be "
                         "memory-backed (tmpfs), else every write to the arena dirties disk pages")
    return ap


def config_from_args(args: argparse.Namespace) -> SidecarConfig:
    tenant, token = "default", ""
    if args.credentials:
        tenant, token = load_credentials(args.credentials)
    if args.tenant:
        tenant = args.tenant
    if args.token:
        token = args.token
    key = b""
    if args.handoff_key_file:
        try:
            with open(args.handoff_key_file, "rb") as f:
                key = f.read().strip()
        except OSError as exc:
            raise SystemExit(f"kvpool sidecar: cannot read handoff key {args.handoff_key_file}: {exc}") from None
        if not key:
            raise SystemExit(f"kvpool sidecar: handoff key file {args.handoff_key_file} is empty")
    return SidecarConfig(socket=args.socket, pool=[a.strip() for a in args.pool.split(",") if a.strip()],
                         local_bytes=args.local, tenant_id=tenant, token=token, write_back=args.write_back,
                         drain_seconds=args.drain_seconds, metrics_port=args.metrics_port,
                         events=events_config(args), handoff_listen=args.handoff_listen,
                         handoff_advertise=args.handoff_advertise, handoff_key=key,
                         transition_seconds=args.transition_seconds, copy_over_bytes=args.copy_over_bytes,
                         arena_dir=args.arena_dir, pool_write_retries=args.pool_write_retries,
                         max_registered_bytes=args.max_registered_bytes, match_deadline_ms=args.match_deadline_ms,
                         read_deadline_ms=args.read_deadline_ms, read_bytes_per_second=args.read_bytes_per_second,
                         probe_deadline_ms=args.probe_deadline_ms, suspect_backoff_ms=args.suspect_backoff_ms)


class IncarnationCheck(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses a call that names another sidecar life (``kvpool-incarnation`` metadata) with
    ABORTED before it runs: its lease ids, reservation id or the offsets it will apply belong to
    a dead process.  A call without the metadata (Hello, an older client) is let through."""

    def __init__(self, incarnation: int) -> None:
        self.incarnation = str(incarnation)

        def refuse(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.ABORTED,
                          f"the sidecar was restarted (this life is {self.incarnation}): say Hello again")
        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        for key, value in details.invocation_metadata or ():
            if key == errors.INCARNATION_METADATA:
                if value != self.incarnation:
                    return self._refuse
                break
        return continuation(details)


def serve(cfg: SidecarConfig) -> int:
    if os.path.exists(cfg.socket):
        os.unlink(cfg.socket)  # a stale socket of a previous life
    sidecar = Sidecar(cfg)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="rpc"),
                         interceptors=[IncarnationCheck(sidecar.incarnation)],
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20)])
    spbg.add_SidecarServicer_to_server(sidecar, server)
    if server.add_insecure_port(f"unix://{cfg.socket}") == 0:
        raise SystemExit(f"kvpool sidecar: cannot listen on {cfg.socket}")
    server.start()
    # The hot calls' binary path beside the gRPC socket (kvpool.wire.sidecar_frames).
    fast = FastSessionServer(sidecar, fast_socket_path(cfg.socket))
    fast.start()
    if cfg.metrics_port:
        metrics.serve(cfg.metrics_port, sidecar)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"READY unix://{cfg.socket} arena={sidecar.local.arena.path} tenant={cfg.tenant_id} "
          f"pool={len(sidecar.pool.nodes)} incarnation={sidecar.incarnation} "
          f"adopted={sidecar.adopted.get('restart_adopted_objects', 0)} "
          f"dropped={sidecar.adopted.get('restart_dropped_objects', 0)}"
          + (" reset=1" if sidecar.counters["restart_arena_reset"] else "")
          + (f" events={sidecar.events.endpoint} replay={sidecar.events.replay_endpoint}" if sidecar.events else "")
          + (f" handoff={sidecar.handoff.address}" if sidecar.handoff.address else ""),
          flush=True)
    stop.wait()
    fast.stop()
    server.stop(grace=0.5).wait()  # stop accepting; in-flight calls finish
    t0 = time.time()
    flushed, nbytes, dropped = sidecar.flush(cfg.drain_seconds)
    log.info("sidecar stopping: flushed %d local-only objects (%d bytes) in %.2fs, dropped %d",
             flushed, nbytes, time.time() - t0, dropped)
    print(f"FLUSHED objects={flushed} bytes={nbytes} dropped={dropped}", flush=True)
    sidecar.close()
    try:
        os.unlink(cfg.socket)
    except FileNotFoundError:
        pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return serve(config_from_args(args))


if __name__ == "__main__":
    sys.exit(main())
