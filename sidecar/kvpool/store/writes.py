"""Two-phase writes of a store node: reserve → commit or revoke (the data session's PUT).

A part of :class:`~kvpool.store.node.StoreNode`, sharing its index lock: admission (ownership,
size, duplicates, quota), room in DRAM (the tier chain's demotions, waited for with the lock
released), extents and write tokens; then the commit, whose bytes are verified outside the lock
on multi-tenant nodes before they become visible.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvpool.arena.allocator import OutOfSpace
from kvpool.arena.dram import DramTier
from kvpool.arena.eviction import watermark_need
from kvpool.arena.index import COMMITTED, COMMITTING, RESERVED, ArenaIndex, Reservation
from kvpool.core.checksum import checksum
from kvpool.core.errors import InvalidArgument
from kvpool.store.settings import NodeConfig
from kvpool.store.space import Space
from kvpool.store.tenants import Tenants
from kvpool.tiers.chain import TierChain, TieredEntry
from kvpool.wire.counters import MissReason, StoreCounter
from kvpool.wire.proto import store_pb2 as pb


class Writes:
    """Reservations and commits of one node (see the module docstring)."""

    def __init__(self, cfg: NodeConfig, lock: threading.RLock, index: ArenaIndex, tenants: Tenants, space: Space,
                 chain: TierChain | None, dram: DramTier, counters: Counter[str],
                 discard: Callable[[TieredEntry], None], published: Callable[[TieredEntry], None],
                 sweep: Callable[[float], None]) -> None:
        self.cfg = cfg
        self._lock = lock
        self._released = threading.Condition(lock)
        """Signalled when a reserved slot's write ends (a commit may be waiting for it)."""
        self.index = index
        self.tenants = tenants
        self.space = space
        self.chain = chain
        self.dram = dram
        self.counters = counters
        self._discard = discard
        self._published = published
        self._sweep = sweep

    def start(self, tenant: str, keys: list[bytes], sizes: Sequence[int], traffic_class: str, kind: int,
              timeout_ms: int, foreign: npt.NDArray[np.bool_] | None, draining: Callable[[], bool]
              ) -> tuple[list[pb.Code], list[int], list[int], int]:
        """Reserve space for each item (``StoreNode.put_start``); ``foreign``: the keys refused
        as WRONG_OWNER, ``draining``: asked under the lock."""
        now = time.time()
        codes = [pb.OK] * len(keys)
        offsets = [0] * len(keys)
        tokens = [0] * len(keys)
        entries: list[TieredEntry | None] = [None] * len(keys)
        if self.chain is not None:
            self._make_room(tenant, keys, sizes, kind)
        alloc = self.dram.alloc
        with self._lock:
            self._sweep(now)
            if draining():
                return [pb.DRAINING] * len(keys), offsets, tokens, 0
            if foreign is not None:
                self.counters[StoreCounter.REFUSED_WRONG_OWNER] += int(foreign.sum())
            t = self.tenants[tenant]
            seen: set[bytes] = set()
            olds = self.index.get_many(tenant, keys, kind)
            for i, (k, size, old) in enumerate(zip(keys, sizes, olds, strict=True)):
                if foreign is not None and foreign[i]:
                    codes[i] = pb.WRONG_OWNER  # even when held here: its owner is where readers look
                elif size <= 0 or len(k) != 32:
                    codes[i] = pb.INVALID
                elif size > self.cfg.max_object_bytes or alloc.rounded(size) > self.dram.capacity:
                    codes[i] = pb.TOO_LARGE
                elif k in seen:
                    codes[i] = pb.INVALID  # duplicate key inside one batch
                elif old is not None and old.state == COMMITTED:
                    codes[i] = pb.ALREADY_EXISTS
                    old.last_access = now
                    self.counters[StoreCounter.DUPLICATES] += 1
                elif old is not None:
                    codes[i] = pb.IN_FLIGHT
                else:
                    seen.add(k)
            self.tenants.admit(t, sizes, codes, self.counters,
                               lambda tt, need: self.space.evict_tenant(tt, need, now))
            if pb.QUOTA_EXCEEDED in codes:  # a later lookup of these misses for the quota
                for k, c in zip(keys, codes, strict=True):
                    if c == pb.QUOTA_EXCEEDED:
                        self.space.gone.note(tenant, k, MissReason.QUOTA)
            # Batch admission: make room once for the whole batch (watermarks), then allocate.
            incoming = sum(alloc.rounded(s) for s, c in zip(sizes, codes, strict=True) if c == pb.OK)
            need = watermark_need(alloc.used - self.space.pending(), incoming, self.dram.capacity,
                                  self.cfg.high_watermark, self.cfg.low_watermark)
            if need:
                self.space.evict_dram(need, now)
            evictable = True
            expires = now + (min(timeout_ms / 1000.0, self.cfg.reservation_seconds_max) if timeout_ms
                             else self.cfg.reservation_seconds)
            for i, (k, size) in enumerate(zip(keys, sizes, strict=True)):
                if codes[i] != pb.OK:
                    continue
                try:
                    # Once eviction found nothing to free, the rest of the batch only tries the
                    # free list: a huge batch against a pinned arena must not cost items x objects.
                    off = self.space.alloc_dram(size, now) if evictable else alloc.alloc(size)
                except OutOfSpace:
                    evictable = False
                    codes[i] = pb.NO_SPACE
                    t.count(self.counters, StoreCounter.REFUSED_SPACE)
                    self.space.gone.note(tenant, k, MissReason.EVICTED)  # no room, as an eviction
                    continue
                e = TieredEntry(k, tenant, kind, traffic_class, size)
                e.offset = off
                e.expires = expires
                self.index.bind_token(e)
                self.index.reserve(e)
                t.used_bytes += size
                offsets[i], tokens[i], entries[i] = off, e.token, e
            rid = 0
            if any(e is not None for e in entries):
                rid = self.index.open_reservation(tenant, entries, expires)  # type: ignore[arg-type]
            return codes, offsets, tokens, rid

    def _make_room(self, tenant: str, keys: list[bytes], sizes: Sequence[int], kind: int) -> None:
        """Before a write reserves: start the demotions its new objects need, then wait for them
        at most ``demote_wait_seconds`` with the lock released (``TierChain.make_room``).  The
        reservation that follows takes what fits; the rest is NO_SPACE."""
        chain = self.chain
        assert chain is not None
        with self._lock:
            cap = min(self.cfg.max_object_bytes, self.dram.capacity)
            rounded = self.dram.alloc.rounded
            olds = self.index.get_many(tenant, keys, kind)
            sizes_new = [rounded(s) for s, old in zip(sizes, olds, strict=True) if 0 < s <= cap and old is None]
        if sizes_new:
            chain.make_room(sizes_new, time.monotonic() + self.cfg.demote_wait_seconds,
                            self.cfg.high_watermark, self.cfg.low_watermark)

    def write_ended(self, e: TieredEntry) -> None:
        """A write into ``e``'s slot ended (the guard's release): wake a commit waiting for it.
        Lock held."""
        if e.inflight == 0 and e.state == RESERVED:
            self._released.notify_all()

    def _verify(self) -> bool:
        v = self.cfg.verify_on_commit
        return self.tenants.with_tokens() if v is None else v

    def commit(self, tenant: str, reservation_id: int, checksums: Sequence[int]) -> list[pb.Code]:
        """Commit a reservation (``StoreNode.put_commit``)."""
        now = time.time()
        with self._lock:
            self._sweep(now)
            if not self.index.issued(reservation_id):
                raise InvalidArgument(f"reservation {reservation_id} was never issued by this life of the node")
            res = self.index.reservation(reservation_id)
            if res is None or res.tenant != tenant:
                return [pb.LEASE_EXPIRED] * max(len(checksums), 1)
            n = len(res.entries)
            if len(checksums) != n:
                raise InvalidArgument(f"{len(checksums)} checksums for {n} items")
            # A transport may report a write complete a moment before it releases the guard (the
            # response and the release race); give in-flight writes a short grace to finish.
            deadline = time.monotonic() + self.cfg.commit_grace_seconds
            while any(e is not None and e.state == RESERVED and e.inflight for e in res.entries):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._released.wait(left)
            if self.index.reservation(reservation_id) is not res:
                return [pb.LEASE_EXPIRED] * n  # a concurrent commit, revoke or expiry took it
            # From here the reservation is this call's: a concurrent commit sees it gone.
            self.index.close_reservation(reservation_id)
            codes = [pb.OK] * n
            todo: list[int] = []
            for i, e in enumerate(res.entries):
                if e is None:
                    codes[i] = pb.INVALID
                    continue
                if e.state != RESERVED or self.index.by_token(e.token) is not e:
                    codes[i] = pb.LEASE_EXPIRED
                    continue
                if e.inflight:
                    # A write still in flight at commit means the writer did not wait: refuse.
                    self._discard(e)  # type: ignore[arg-type]
                    codes[i] = pb.LEASE_EXPIRED
                    continue
                e.state = COMMITTING  # the guard refuses further writes from now on
                todo.append(i)
            if not self._verify():
                self._finish(res, todo, checksums, codes, None, now)
                return codes
            # Keeps the extents allocated while they are hashed without the lock.
            self.index.hold(res.entries[i] for i in todo)  # type: ignore[misc]
        # Hash outside the lock: a 4 MiB object must not stall every other call of the node.
        sums: dict[int, int] = {}
        for i in todo:
            e = res.entries[i]
            assert e is not None
            sums[i] = checksum(self.dram.slice(e.offset, e.size))
        with self._lock:
            for i in todo:
                e = res.entries[i]
                assert e is not None
                self.index.release_inflight(e)
            self._finish(res, todo, checksums, codes, sums, time.time())
        return codes

    def _finish(self, res: Reservation, todo: list[int], checksums: Sequence[int], codes: list[pb.Code],
                sums: dict[int, int] | None, now: float) -> None:
        stored = nbytes = 0  # counted once for the batch (a reservation's objects are all res.tenant's)
        for i in todo:
            e = res.entries[i]
            assert isinstance(e, TieredEntry)
            if e.state != COMMITTING:  # discarded meanwhile (e.g. the tenant was revoked)
                codes[i] = pb.LEASE_EXPIRED
                continue
            if sums is not None and sums[i] != checksums[i]:
                self._discard(e)
                codes[i] = pb.CHECKSUM
                self.tenants[e.tenant].count(self.counters, StoreCounter.CHECKSUM_FAILURES)
                continue
            e.checksum = int(checksums[i])
            self.index.publish(e, now)
            self._published(e)
            stored += 1
            nbytes += e.size
        if stored:
            t = self.tenants[res.tenant]
            t.objects += stored
            t.count(self.counters, StoreCounter.STORED, stored)
            t.count(self.counters, StoreCounter.STORED_BYTES, nbytes)

    def revoke(self, tenant: str, reservation_id: int) -> None:
        with self._lock:
            res = self.index.reservation(reservation_id)
            if res is None or res.tenant != tenant:
                return
            self.index.close_reservation(reservation_id)
            for e in res.entries:
                if e is not None and e.state == RESERVED:
                    self._discard(e)  # type: ignore[arg-type]
                    self.counters[StoreCounter.REVOKED] += 1
