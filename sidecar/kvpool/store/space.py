"""What a store node keeps and what it lets go: DRAM eviction, TTL expiry and quota trims.

A part of :class:`~kvpool.store.node.StoreNode`, called under the node's index lock.  The choice
of victims is :func:`kvpool.arena.eviction.choose_victims` and the quota rules are
:mod:`kvpool.store.quota` (both pure); this module applies them: an expired victim is dropped,
another is demoted by the tier chain (or dropped when there is no tier below).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from kvpool.arena.allocator import ExtentAllocator, OutOfSpace
from kvpool.arena.eviction import choose_victims, is_expired
from kvpool.arena.index import ARENA, BLOCK, COMMITTED, STATE, ArenaIndex
from kvpool.core.ring import Ring
from kvpool.store.gone import Gone
from kvpool.store.quota import Held, trim_to_share
from kvpool.store.settings import NodeConfig
from kvpool.store.tenants import Tenant, Tenants
from kvpool.tiers.chain import TierChain, TieredEntry
from kvpool.wire.counters import MissReason, StoreCounter

_WHY = {StoreCounter.EXPIRED: MissReason.EXPIRED, StoreCounter.EVICTED: MissReason.EVICTED,
        StoreCounter.EVICTED_QUOTA: MissReason.QUOTA}
"""The miss reason a later lookup of an object dropped for each counter gets."""


def owned_mask(ring: Ring, node_id: str, entries: Sequence[TieredEntry]) -> list[bool]:
    """Whether ``node_id`` owns each of ``entries`` under ``ring``: a block when it is one of the
    key's write owners, a state object (single-copy) when it is the primary owner.  A draining
    node, or one the ring leaves out, owns nothing."""
    owned = [False] * len(entries)
    for kind in (BLOCK, STATE):
        idx = [i for i, e in enumerate(entries) if e.kind == kind]
        if idx:
            got = ring.write_owned(node_id, [entries[i].key for i in idx], 1 if kind == STATE else None)
            for i, o in zip(idx, got.tolist(), strict=True):
                owned[i] = o
    return owned


class Space:
    """Eviction and expiry of one node's objects (see the module docstring)."""

    def __init__(self, cfg: NodeConfig, index: ArenaIndex, tenants: Tenants, chain: TierChain | None,
                 counters: Counter[str], discard: Callable[[TieredEntry], None], gone: Gone) -> None:
        self.cfg = cfg
        self.gone = gone
        self.index = index
        self.tenants = tenants
        self.chain = chain
        self.counters = counters
        self._discard = discard
        self.dram: ExtentAllocator = index.alloc(ARENA)

    def _drop(self, e: TieredEntry, why: StoreCounter) -> None:
        """Forget ``e``, count it under ``why`` (its tenant's too) and remember why it went."""
        self._discard(e)
        self.tenants[e.tenant].count(self.counters, why)
        self.gone.note(e.tenant, e.key, _WHY[why])

    def ttl(self, e: TieredEntry) -> float:
        return self.tenants.ttl(e.tenant, e.traffic_class, self.cfg.ttl_seconds, self.cfg.default_ttl)

    def expired(self, e: TieredEntry, now: float) -> bool:
        return is_expired(e, now, {e.traffic_class: self.ttl(e)}, 0.0)

    def pending(self) -> int:
        """DRAM bytes on their way down (still allocated; freed when their copies land)."""
        return self.chain.pending_bytes if self.chain is not None else 0

    def dram_victims(self, need: int, now: float, expire_all: bool) -> list[TieredEntry]:
        self.index.settle_pins()
        entries = self.index.lru(ARENA)
        if not self.tenants.any_ttl_overrides():
            plan = choose_victims(entries, need, now, self.cfg.ttl_seconds, self.cfg.default_ttl,
                                  expire_all=expire_all)
            return plan.victims  # type: ignore[return-value]
        # Some tenant overrides the pool's TTLs: decide expiry per object (tenant + class), then
        # plain LRU for the rest (an empty TTL map never expires anything).
        expired: list[TieredEntry] = []
        rest: list[TieredEntry] = []
        freed = 0
        for e in entries:
            assert isinstance(e, TieredEntry)
            if e.pins or e.inflight:
                continue
            if (expire_all or freed < need) and self.expired(e, now):
                expired.append(e)
                freed += e.size
            else:
                rest.append(e)
        plan = choose_victims(rest, max(0, need - freed), now, {}, 0.0, expire_all=False)
        return expired + plan.victims  # type: ignore[operator]

    def evict_dram(self, need: int, now: float, expire_all: bool = True) -> int:
        """Drop expired victims, start the demotion of the others (or drop them without a tier
        below); the DRAM bytes freed now (a demotion frees its bytes when its copy lands)."""
        freed = 0
        for e in self.dram_victims(need, now, expire_all):
            if self.expired(e, now):
                self._drop(e, StoreCounter.EXPIRED)
            elif e.kind == BLOCK and self.chain is not None and self.chain.plan_demotion(e):
                continue
            else:
                self._drop(e, StoreCounter.EVICTED)
            freed += e.size
        return freed

    def alloc_dram(self, size: int, now: float) -> int:
        try:
            return self.dram.alloc(size)
        except OutOfSpace:
            pass
        if self.pending():
            # Demotions are on their way (a slow disk, or room made for another writer): more of
            # them would free nothing now and only push hot objects down.  This write sheds.
            raise OutOfSpace("DRAM full while demotions are in flight")
        # A full or fragmented arena: evict LRU objects (in batches of what this one needs) until a
        # contiguous extent appears or nothing evictable is left.  Free bytes alone are not enough.
        need = self.dram.rounded(size)
        while True:
            freed = self.evict_dram(need, now, expire_all=False)
            try:
                return self.dram.alloc(size)
            except OutOfSpace:
                if freed == 0:
                    raise
                need *= 2  # geometric: a badly fragmented arena costs O(log n) passes, not O(n)

    def _held(self) -> list[TieredEntry]:
        """Committed objects with an extent here (below first, then DRAM), pins settled."""
        self.index.settle_pins()
        return [e for lv in reversed(self.index.ordered_levels()) for e in self.index.lru(lv)]  # type: ignore[misc]

    def _own(self, tid: str) -> list[TieredEntry]:
        return [e for e in self._held() if e.tenant == tid]

    def evict_tenant(self, t: Tenant, need: int, now: float) -> int:
        """Quota with eviction: drop the tenant's own least recently used objects; bytes freed."""
        own = self._own(t.tenant_id)
        own.sort(key=lambda e: e.last_access)
        plan = choose_victims(own, need, now, {}, 0.0, expire_all=False)
        for c in plan.victims:
            self._drop(c, StoreCounter.EVICTED_QUOTA)  # type: ignore[arg-type]
        return plan.freed_bytes

    def fit_shares(self, ring: Ring, node_id: str) -> None:
        """After a ring change: each tenant's share under the new ring; a tenant now over its
        share here drops what :func:`kvpool.store.quota.trim_to_share` picks (objects this node
        no longer owns first), so a scale-up does not let the pool hold the old shares plus the
        new node's."""
        over = self.tenants.reshare(ring)
        me = ring.member(node_id)
        # A draining node (or one the ring left out) owns nothing and takes no writes: what it
        # holds is on its way to the owners (the drain), not to be dropped here.
        if me is None or me.state != "active":
            return
        for t in over:
            mine = [e for e in self._own(t.tenant_id) if e.state == COMMITTED and not e.pins and not e.inflight]
            owned = owned_mask(ring, node_id, mine)
            held = [Held(e.size, e.last_access, o) for e, o in zip(mine, owned, strict=True)]
            for i in trim_to_share(t.used_bytes, t.share_bytes, held, t.evict_own_on_quota):
                self._drop(mine[i], StoreCounter.EVICTED_QUOTA)

    def expire(self, now: float) -> int:
        """Drop every expired object with an extent; how many."""
        n = 0
        for e in self._held():
            if not e.pins and not e.inflight and self.expired(e, now):
                self._drop(e, StoreCounter.EXPIRED)
                n += 1
        return n
