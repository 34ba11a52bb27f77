"""The tenants of a store node: tokens, TTLs, quotas and this node's share of each quota.

Owns its state; no lock of its own: the node calls it under its index lock (``authenticate``
reads one dict lookup, safe without it).  What to evict for a quota is decided by the node's
space (:mod:`kvpool.store.space`); the shares and trims are the pure rules of
:mod:`kvpool.store.quota`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool.core.ring import Ring
from kvpool.store.quota import ring_share
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

DEFAULT_TENANT = "default"


@dataclass
class Tenant:
    tenant_id: str
    token: str = ""
    salt: bytes = b""
    quota_bytes: int = 0
    """The tenant's limit for the whole pool (logical bytes); 0 = none."""
    ttl_seconds: dict[str, float] = field(default_factory=dict)
    evict_own_on_quota: bool = False
    share_bytes: int = 0
    """What this node admits of the quota under its ring (:func:`kvpool.store.quota.ring_share`)."""
    used_bytes: int = 0
    objects: int = 0
    counters: Counter[str] = field(default_factory=Counter)

    def count(self, node: Counter[str], what: str, n: int = 1) -> None:
        """Add ``n`` to ``what`` (a :class:`StoreCounter` or a name of its families) in the node's
        counters and in this tenant's."""
        node[what] += n
        self.counters[what] += n


class Tenants:
    """Tenancy of one node: who a token is, and what each tenant may hold here."""

    def __init__(self, open_tenancy: bool) -> None:
        self.open_tenancy = open_tenancy
        """Calls without a token act as the default tenant (dev/local pools)."""
        self._by_id: dict[str, Tenant] = {DEFAULT_TENANT: Tenant(DEFAULT_TENANT)}
        self._by_token: dict[str, str] = {}

    def authenticate(self, token: str) -> str | None:
        """Tenant id for a token; None when the token is unknown (the caller refuses)."""
        if not token:
            return DEFAULT_TENANT if self.open_tenancy else None
        return self._by_token.get(token)

    def get(self, tid: str) -> Tenant | None:
        return self._by_id.get(tid)

    def __getitem__(self, tid: str) -> Tenant:
        """The tenant ``tid`` (created empty when unknown: objects of a revoked tenant stay)."""
        t = self._by_id.get(tid)
        if t is None:
            t = self._by_id[tid] = Tenant(tid)
        return t

    def values(self) -> list[Tenant]:
        return list(self._by_id.values())

    def with_tokens(self) -> bool:
        """Whether any tenant has a token (a multi-tenant node)."""
        return bool(self._by_token)

    def configured(self) -> frozenset[str]:
        """The tenants configured here: the ones holding a token, and the default tenant (the
        metrics' ``tenant`` label takes only these; any other id is folded into one value)."""
        return frozenset({DEFAULT_TENANT, *self._by_token.values()})

    def token_holders(self) -> int:
        """How many tenants hold a token on this node (0 under open tenancy)."""
        return len(self._by_token)

    def any_ttl_overrides(self) -> bool:
        return any(t.ttl_seconds for t in self._by_id.values())

    def set(self, configs: Sequence[Tenant], replace: bool, ring: Ring) -> None:
        listed = {c.tenant_id for c in configs}
        if replace:
            for tid in list(self._by_id):
                if tid not in listed and tid != DEFAULT_TENANT:
                    self._revoke(tid)
        for c in configs:
            t = self[c.tenant_id]
            if t.token and t.token != c.token:
                self._by_token.pop(t.token, None)
            t.token, t.salt, t.quota_bytes = c.token, c.salt, c.quota_bytes
            t.share_bytes = ring_share(c.quota_bytes, ring)
            t.ttl_seconds = dict(c.ttl_seconds)
            t.evict_own_on_quota = c.evict_own_on_quota
            if c.token:
                self._by_token[c.token] = c.tenant_id

    def _revoke(self, tid: str) -> None:
        t = self._by_id[tid]
        self._by_token.pop(t.token, None)
        t.token = ""
        # Objects stay until evicted, but nobody can reach them any more without a token.

    def ttl(self, tid: str, traffic_class: str, pool_ttl: dict[str, float], default: float) -> float:
        """Time to live of an object of ``tid`` and ``traffic_class``: the tenant's own, else the pool's."""
        t = self._by_id.get(tid)
        if t is not None and traffic_class in t.ttl_seconds:
            return t.ttl_seconds[traffic_class]
        return pool_ttl.get(traffic_class, default)

    def fs_salt(self, tid: str) -> bytes:
        """Key of the shared-fs file names of a tenant.  The tenant id is always mixed in: two
        tenants configured without a salt must still never name (and so read) each other's files."""
        return b"kvpool-tenant\0" + tid.encode() + b"\0" + self[tid].salt

    def reshare(self, ring: Ring) -> list[Tenant]:
        """Each tenant's share under ``ring``; the tenants now over their share here."""
        over = []
        for t in self._by_id.values():
            t.share_bytes = ring_share(t.quota_bytes, ring)
            if t.share_bytes and t.used_bytes > t.share_bytes:
                over.append(t)
        return over

    def admit(self, t: Tenant, sizes: Sequence[int], codes: list[pb.Code], counters: Counter[str],
              evict_own: Callable[[Tenant, int], int]) -> None:
        """Refuse (QUOTA_EXCEEDED) the items that would take ``t`` past this node's share of its
        pool quota (:mod:`kvpool.store.quota`), evicting its own objects first (``evict_own``:
        bytes to free → bytes freed) when it asked."""
        limit = t.share_bytes
        if not limit:
            return
        want = t.used_bytes
        evictable = t.evict_own_on_quota
        for i, size in enumerate(sizes):
            if codes[i] != pb.OK:
                continue
            if want + size > limit and evictable and size <= limit:
                if not evict_own(t, want + size - limit):
                    evictable = False  # nothing of its own left to evict: stop scanning for this batch
                want = t.used_bytes + sum(s for j, s in enumerate(sizes[:i]) if codes[j] == pb.OK)
            if want + size > limit:
                codes[i] = pb.QUOTA_EXCEEDED
                t.count(counters, StoreCounter.REFUSED_QUOTA)
                continue
            want += size

    def rows(self) -> list[tuple[str, int, int, int, dict[str, int], int]]:
        """Per tenant, for Stats: id, used bytes, quota, objects, counters, share."""
        return [(t.tenant_id, t.used_bytes, t.quota_bytes, t.objects, dict(t.counters), t.share_bytes)
                for t in self._by_id.values()]
