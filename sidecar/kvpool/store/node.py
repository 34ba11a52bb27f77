"""The store node: a composition of its arena index, tier chain, tenants, space, reads and writes.

This module is transport-free: the gRPC services (``data_service.py``, ``admin_service.py``) adapt protobuf to these
methods, and the data session (``data_session.py``) moves bytes into the offsets they hand out
and out of the objects it holds in flight, each write under :meth:`StoreNode.acquire` (so an
expired reservation is never written).  One lock guards the index and is shared by the parts;
no bytes are copied and no tier below DRAM is read or written while holding it (moves between
tiers: :mod:`kvpool.tiers.chain`, which holds it only to mark and to flip).

Parts: :class:`~kvpool.arena.index.ArenaIndex` (entries, leases, reservations, LRU, tokens),
:class:`~kvpool.tiers.chain.TierChain` (DRAM → SSD → shared fs), :class:`~kvpool.store.tenants.Tenants`,
:class:`~kvpool.store.space.Space` (eviction, expiry, quota trims),
:class:`~kvpool.store.reads.Reads` (lookups and pinned reads) and
:class:`~kvpool.store.writes.Writes` (two-phase writes).  Each tenant has its own partition of
the index, so the same key of two tenants names two different objects.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvpool.arena.dram import DramTier
from kvpool.arena.index import ARENA, COMMITTED, RESERVED, ArenaIndex, Lease
from kvpool.core.errors import InvalidArgument
from kvpool.core.ring import Ring, stale_wrong_owner
from kvpool.core.sizing import payload_arena_bytes
from kvpool.store.gone import Gone
from kvpool.store.reads import Reads, check_kind
from kvpool.store.settings import NodeConfig as NodeConfig
from kvpool.store.space import Space, owned_mask
from kvpool.store.tenants import DEFAULT_TENANT as DEFAULT_TENANT
from kvpool.store.tenants import Tenant as Tenant
from kvpool.store.tenants import Tenants
from kvpool.store.writes import Writes
from kvpool.tiers.atrest import AtRest
from kvpool.tiers.base import FaultDelay, Tier
from kvpool.tiers.chain import TierChain, TieredEntry
from kvpool.tiers.sealed import SealedTier
from kvpool.tiers.sharedfs import SharedFsTier
from kvpool.tiers.ssd import SsdTier
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

Entry = TieredEntry


class StoreNode:
    """One shard of the pool (see the module docstring): the public API of the store, whose
    parts share one index lock that only this composition creates."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        # dram_bytes is a payload capacity: that much fits before eviction starts at the high watermark.
        self.dram = DramTier(payload_arena_bytes(cfg.dram_bytes, cfg.high_watermark), cfg.shm_dir, label=cfg.node_id)
        fault = FaultDelay(cfg.fault_tier_delay_file)
        below: list[SsdTier | SharedFsTier] = []  # the chain's order: SSD, then the shared filesystem
        if cfg.ssd_path and cfg.ssd_bytes:
            below.append(SsdTier(cfg.ssd_path, cfg.ssd_bytes, cfg.node_id, fault=fault))
        if cfg.sharedfs_path:
            below.append(SharedFsTier(cfg.sharedfs_path, fault=fault))
        self._below = below
        self.at_rest = AtRest(cfg.master_key, cfg.previous_master_keys) if cfg.master_key else None
        # Encryption at rest is the tiers' business: each level below DRAM sealed as a whole.
        at_rest = self.at_rest
        self._sealed = [SealedTier(t, at_rest) for t in below] if at_rest is not None else []
        levels: list[Tier] = list(self._sealed) if self._sealed else list(below)
        self.events: Any = None  # a kvpool.wire.kv_events.EventPublisher, set by the service when configured
        self._lock = threading.RLock()
        # The index frees the arena's extents; the chain frees those below through their tiers.
        self._index = ArenaIndex([self.dram.alloc] + [None] * len(levels), pins_hold_extent=False,
                                 ordered=[True] + [not t.named for t in levels])
        self.tenants = Tenants(cfg.open_tenancy)
        self.counters: Counter[str] = Counter()
        self.ring = Ring(epoch=0)
        self.draining = False
        # Objects held but not owned under self.ring, found at each ring change (writes after it
        # go to their owners); discarded ones (DEAD) are left out when counted.
        self._foreign: list[Entry] = []
        # This life of the node (its leases' and reservations' ids start at a random base too:
        # ArenaIndex).
        self.incarnation = 1 + secrets.randbits(62)
        # Moves between tiers, outside the lock; None without a tier below DRAM (evictions drop).
        self.chain = TierChain(self, self._index, self._lock, self.dram, levels) if below else None
        gone = Gone(cfg.gone_keys)  # why a key is not here (the miss reasons of lookups)
        self._space = Space(cfg, self._index, self.tenants, self.chain, self.counters, self.discard, gone)
        self._reads = Reads(cfg, self._lock, self._index, self.tenants, self.chain, self.dram,
                            self.counters, self._sweep, gone)
        self._writes = Writes(cfg, self._lock, self._index, self.tenants, self._space, self.chain, self.dram,
                              self.counters, self.discard, self._published, self._sweep)

    # ------------------------------------------------------------------ tenancy, policy, keys

    def authenticate(self, token: str) -> str | None:
        """Tenant id for a token; None when the token is unknown (the caller refuses)."""
        return self.tenants.authenticate(token)

    def set_tenants(self, configs: Sequence[Tenant], replace: bool = False) -> None:
        with self._lock:
            self.tenants.set(configs, replace, self.ring)

    def set_policy(self, ttl: dict[str, float], high: float, low: float) -> None:
        with self._lock:
            if ttl:
                self.cfg.ttl_seconds = dict(ttl)
            if 0 < low < high <= 1:
                self.cfg.high_watermark, self.cfg.low_watermark = high, low

    def set_master_keys(self, current: bytes, previous: Sequence[bytes]) -> None:
        """A rotation: seal under ``current`` from now on, open what any of the keys sealed."""
        if self.at_rest is None:
            raise ValueError("this node does not encrypt at rest: it has no master key to rotate")
        # Seals and opens run off the lock (the sealed tiers): set_keys swaps whole maps, so each
        # sees the old keys or the new ones.
        self.at_rest.set_keys(current, previous)
        with self._lock:
            self.counters[StoreCounter.MASTER_KEY_RELOADS] += 1

    # ------------------------------------------------------------------ what the parts ask (ChainOwner)

    def count(self, what: StoreCounter, tenant: str = "") -> None:
        """Add one to a counter (and to ``tenant``'s, when given)."""
        with self._lock:
            if tenant:
                self.tenants[tenant].count(self.counters, what)
            else:
                self.counters[what] += 1

    def fs_salt(self, tenant: str) -> bytes:
        return self.tenants.fs_salt(tenant)

    def account(self, tenant: str, delta_bytes: int) -> None:
        self.tenants[tenant].used_bytes += delta_bytes

    def evict_dram(self, need: int, now: float, expire_all: bool = True) -> int:
        return self._space.evict_dram(need, now, expire_all)

    def alloc_dram(self, size: int, now: float) -> int:
        return self._space.alloc_dram(size, now)

    def _published(self, e: Entry) -> None:
        if e.kind == pb.BLOCK and self.events is not None and e.tenant == self.cfg.events_tenant:
            self.events.stored(e.key)

    def discard(self, e: Entry) -> None:
        """Forget an object everywhere and free its space (caller holds the lock)."""
        was_committed = e.state == COMMITTED
        if was_committed and self.events is not None and e.kind == pb.BLOCK and e.tenant == self.cfg.events_tenant:
            self.events.removed(e.key)
        t = self.tenants[e.tenant]
        if e.offset >= 0 if self.chain is None else self.chain.in_quota(e):
            t.used_bytes -= e.size
        self._index.forget(e)  # in flight (a transfer holds the guard): its release frees the extent
        if self.chain is not None:
            # Its copies below go too (a file unlinked off the lock; meanwhile no lookup adopts
            # it), or the next lookup would bring a removed object back.
            self.chain.forget(e)
        if was_committed:
            t.objects -= 1

    def _sweep(self, now: float) -> None:
        """Drop expired leases and reservations.  Lock held."""
        dropped, expired = self._index.sweep(now)
        if dropped:
            self.counters[StoreCounter.LEASES_EXPIRED] += dropped
        for e in expired:
            self.discard(e)  # type: ignore[arg-type]
            self.counters[StoreCounter.RESERVATIONS_EXPIRED] += 1

    # ------------------------------------------------------------------ lookups

    def exists(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK, prefix_only: bool = True,
               pin: bool = False, lease_ms: int = 0) -> tuple[int, bytes, Lease[Entry] | None]:
        """Longest present prefix and per-key presence; optionally pin the prefix."""
        return self._reads.exists(tenant, keys, kind, prefix_only, pin, lease_ms)

    def where(self, tenant: str, key: bytes, kind: int = pb.BLOCK) -> str | None:
        """Name of the tier holding ``key`` (None: not held here)."""
        with self._lock:
            e = self._index.committed(tenant, key, kind)
            return None if e is None else self.chain.name(e.tier) if self.chain is not None else self.dram.name

    def entries(self, tenant: str, keys: Sequence[bytes], kind: int = pb.BLOCK) -> list[Entry | None]:
        """The committed objects of ``keys`` (None where absent): for :meth:`read_objects`."""
        with self._lock:
            return [self._index.committed(tenant, k, kind) for k in keys]  # type: ignore[misc]

    # ------------------------------------------------------------------ writes (store.writes)

    def put_start(self, tenant: str, keys: list[bytes], sizes: Sequence[int], traffic_class: str,
                  kind: int, timeout_ms: int = 0, epoch: int = 0) -> tuple[list[pb.Code], list[int], list[int], int]:
        """Reserve space for each item: per-item codes, offsets, tokens and a reservation id.

        ``epoch``: the ring epoch the caller routed by (0: unknown); under an older one than
        this node's, the keys this node does not own are WRONG_OWNER (:func:`stale_wrong_owner`).
        """
        if len(keys) != len(sizes):
            raise InvalidArgument(f"{len(keys)} keys but {len(sizes)} sizes")
        check_kind(kind)
        # Outside the lock (the ring is replaced whole, never changed in place); when the
        # caller routed by our epoch (or knows none) this is one comparison.
        foreign = stale_wrong_owner(self.ring, self.node_id, epoch, keys, single_copy=kind == pb.STATE)
        if foreign is not None and not foreign.any():
            foreign = None
        return self._writes.start(tenant, keys, sizes, traffic_class, kind, timeout_ms, foreign,
                                  lambda: self.draining)

    def put_commit(self, tenant: str, reservation_id: int, checksums: Sequence[int]) -> list[pb.Code]:
        """Commit a reservation: per-item codes (LEASE_EXPIRED for the whole of one that expired
        or was revoked)."""
        return self._writes.commit(tenant, reservation_id, checksums)

    def put_revoke(self, tenant: str, reservation_id: int) -> None:
        self._writes.revoke(tenant, reservation_id)

    # ------------------------------------------------------------------ reads

    def read_pin(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK,
                 drop_lease_id: int = 0, whole: bool = True) -> tuple[list[pb.Code], list[Entry | None]]:
        """Committed objects of ``keys``, promoted to DRAM and held in flight for a transfer on the
        caller's own connection, until :meth:`read_unpin`
        (:meth:`Reads.read_pin <kvpool.store.reads.Reads.read_pin>`; ``whole``: the objects are
        sent whole, counted in ``bytes_sent``; a ranged read counts what it sends itself)."""
        return self._reads.read_pin(tenant, keys, kind, drop_lease_id, whole)

    def read_unpin(self, found: Sequence[Entry | None]) -> None:
        self._reads.read_unpin(found)

    def note_range_read(self, keys: int, served: int, nbytes: int, tenant: str) -> None:
        """Count a ranged read: keys asked, keys served, bytes of ranges sent (``range_bytes_sent``:
        what a sparse read moved, to compare with the objects' sizes; ``tenant``'s too)."""
        with self._lock:
            self.counters[StoreCounter.RANGE_READS] += keys
            self.counters[StoreCounter.RANGE_HITS] += served
            self.tenants[tenant].count(self.counters, StoreCounter.RANGE_BYTES_SENT, nbytes)

    def release(self, lease_ids: Sequence[int], tenant: str | None = None, incarnation: int = 0) -> None:
        """Drop leases of ``tenant``; ``incarnation``: the life that issued them (0: unchecked),
        another life's release drops nothing."""
        if incarnation and incarnation != self.incarnation:
            return
        with self._lock:
            self._index.release(lease_ids, tenant)

    def remove(self, tenant: str, keys: list[bytes], kind: int = pb.BLOCK) -> list[pb.Code]:
        check_kind(kind)
        with self._lock:
            self._sweep(time.time())
            self._index.settle_pins()
            codes: list[pb.Code] = []
            for e in self._index.lookup(tenant, keys, kind):
                if e is None:
                    codes.append(pb.NOT_FOUND)
                elif e.pins:
                    codes.append(pb.IN_FLIGHT)
                else:
                    self.discard(e)  # type: ignore[arg-type]
                    self.counters[StoreCounter.REMOVED] += 1
                    codes.append(pb.OK)
            return codes

    # ------------------------------------------------------------------ guard of writes in place

    def acquire(self, op: str, offset: int, length: int, token: int) -> Entry | None:
        """Admit a write into a reserved slot (the data session's PUT; the transfer Guard's
        shape): only ``op`` "write", with the token of a live reservation, in its bounds.  The
        entry is marked in flight so eviction and frees leave it alone until
        :meth:`release_guard`.  Reads never come through here: the data session holds what it
        sends in flight itself (:meth:`read_pin`)."""
        if op != "write":
            return None
        now = time.time()
        with self._lock:
            e = self._index.by_token(token)
            if e is None or e.state != RESERVED or e.expires < now or e.tier != ARENA \
                    or not (e.offset <= offset and offset + length <= e.offset + e.size):
                return None
            e.inflight += 1
            return e  # type: ignore[return-value]

    def release_guard(self, e: Entry) -> None:
        with self._lock:
            self._index.release_inflight(e)
            self._writes.write_ended(e)  # a commit may be waiting for this write

    # ------------------------------------------------------------------ expiry, ring, drain feed, stats

    def expire_sweep(self) -> int:
        """Drop every expired object (timer-driven, so expired objects do not wait for pressure)."""
        now = time.time()
        with self._lock:
            self._sweep(now)
            return self._space.expire(now)

    def demote(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Start moving these DRAM blocks one tier down now (as eviction would); how many started."""
        with self._lock:
            found = [self._index.committed(tenant, k, pb.BLOCK) for k in keys]
            started = sum(1 for e in found if isinstance(e, Entry) and e.tier == ARENA and not e.moving
                          and self.chain is not None and self.chain.plan_demotion(e))
            self.counters[StoreCounter.DEMOTIONS_REQUESTED] += started
            return started

    def tier(self, name: str) -> Any:
        """The tier called ``name`` ("dram", "ssd", "sharedfs"), None when this node has none."""
        return next((t for t in (self.dram, *self._below) if t.name == name), None)

    def live_tokens(self) -> int:
        """Write tokens alive (of reservations; a test of the books: none once all are gone)."""
        with self._lock:
            return self._index.token_count()

    def settled(self) -> bool:
        """No tier move or file removal queued or under way."""
        return self.chain is None or self.chain.idle()

    def set_ring(self, ring: Ring) -> Ring:
        with self._lock:
            changed = ring.epoch != self.ring.epoch
            if ring.epoch >= self.ring.epoch:
                self.ring = ring
                me = ring.member(self.node_id)
                self.draining = me is not None and me.state == "draining"
                self._space.fit_shares(ring, self.node_id)
            current = self.ring
            held: list[Entry] = []
            if changed and current is ring:
                self._foreign = []
                held = self._index.all_committed()  # type: ignore[assignment]
        if held:
            # Hashing every key is left off the lock; a newer ring meanwhile redoes it.
            foreign = [e for e, o in zip(held, owned_mask(ring, self.node_id, held), strict=True) if not o]
            with self._lock:
                if self.ring is ring:
                    self._foreign = foreign
        return current

    def foreign_bytes(self) -> int:
        """Bytes on this node's own tiers (DRAM, SSD) of objects it does not own under its ring.

        The walk over the list runs off the lock: right after a scale-up the list can be half the
        node's objects, and every scrape and operator Stats call asks; a gauge may lag by an object
        that moves meanwhile, a data-path call must not wait for it."""
        with self._lock:
            foreign = self._foreign
            named = {i + 1 for i, t in enumerate(self._below) if t.named}
        alive = [e for e in foreign if e.state == COMMITTED]
        total = sum(e.size for e in alive if e.tier not in named)
        with self._lock:
            if self._foreign is foreign:  # a newer ring may have replaced it meanwhile
                self._foreign = alive
        return total

    def objects_hottest_first(self) -> Iterator[Entry]:
        """Committed objects, most recently used first (the drain order)."""
        with self._lock:
            items: list[Entry] = self._index.all_committed()  # type: ignore[assignment]
        items.sort(key=lambda e: e.last_access, reverse=True)
        return iter(items)

    def read_objects(self, entries: Sequence[Entry], sink: Callable[[list[Entry], list[memoryview]], None]) -> int:
        """Hand several objects' bytes to ``sink`` at once (a batched push), each held in flight
        while it runs; objects gone or not promotable meanwhile are left out.  How many were."""
        return self._reads.read_objects(entries, sink)

    def stats(self) -> dict[str, object]:
        with self._lock:
            self._sweep(time.time())
            levels = [self.dram, *self._below]
            out: dict[str, object] = {
                "node_id": self.node_id, "epoch": self.ring.epoch, "draining": self.draining,
                "incarnation": self.incarnation,
                "tiers": [(t.name, t.capacity, t.used, self._index.count(i))
                          for i, t in enumerate(levels) if not t.named],
                "tenants": self.tenants.rows(),
                "counters": self._counters(),
                "configured": self.tenants.configured(),
                "leases": self._index.lease_count(),
                "reservations": self._index.reservation_count(),
            }
        out["foreign_bytes"] = self.foreign_bytes()
        return out

    def _counters(self) -> dict[str, int]:
        """The node's counters, with the sealed tiers' opens under a previous master key (the
        tiers count them: a read's blobs are opened inside ``read_batch``).  Lock held."""
        out = dict(self.counters)
        key = StoreCounter.AT_REST_PREVIOUS_KEY_OPENS
        previous = sum(t.counters[key] for t in self._sealed)
        if previous:
            out[key] = out.get(key, 0) + previous
        return out

    def events_snapshot(self) -> tuple[list[bytes], list[tuple[int, bytes]]]:
        """The events tenant's committed blocks and the events not yet published, taken together."""
        with self._lock:
            keys = self._index.block_keys(self.cfg.events_tenant)
            return keys, self.events.take_pending() if self.events is not None else []

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        if self.chain is not None:
            self.chain.close()
        self.dram.close()
        for t in self._below:
            t.close()
