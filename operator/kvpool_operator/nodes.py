"""The one module that talks to store nodes: their admin API (``StoreAdmin`` in store.proto), through
:class:`kvpool.pool.admin_client.AdminClient`.

The operator is a client of that API like any other (STYLE 3): it uses the data plane's admin client,
never the store's internals. Calls carry the pool's admin token and a short deadline; a node that
does not answer (or refuses) is reported as such (``NodeUnreachable``) and the planners decide what
that means.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from kvpool.core.errors import KvpoolError
from kvpool.core.push_status import DrainStatus, WarmStatus
from kvpool.core.ring import Ring
from kvpool.pool.admin_client import AdminClient
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.tls import TlsConfig

from .reconcile import Policy
from .status import NodeStats, TenantUsage
from .tenancy import NodeTenant

_PER_NODE_TIERS = ("dram", "ssd")  # a shared filesystem is one for all nodes: not per-node capacity
T = TypeVar("T")


class NodeUnreachable(Exception):
    def __init__(self, address: str, detail: str) -> None:
        super().__init__(f"store node {address}: {detail}")
        self.address = address


class Nodes:
    """Admin clients of store nodes, reused across reconciles (thread-safe)."""

    def __init__(self, timeout: float = 5.0) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._clients: dict[str, tuple[str, TlsConfig | None, Any, AdminClient]] = {}
        """address -> (the admin token its client carries, its TLS configuration, the files it
        was built from, the client)"""
        self._tls: dict[str, TlsConfig] = {}
        """address -> the operator's client certificate for the pool of that node"""

    def use_tls(self, addresses: Iterable[str], cfg: TlsConfig) -> None:
        """Call these nodes with ``cfg`` (the operator's certificate of their pool, the pool's CA
        bundle, the name their certificate serves): kvpool_operator.pool_tls."""
        with self._lock:
            for a in addresses:
                self._tls[a] = cfg

    def _client(self, address: str, token: str) -> AdminClient:
        with self._lock:
            got = self._clients.get(address)
            tls = self._tls.get(address)
            # A gRPC channel keeps the credentials it was made with: after a renewal or a CA
            # rotation rewrote the files, a reconnect would present the old certificate and
            # trust only the old bundle, so the client is made again.
            files = tls.read() if tls is not None else None
            # A new node, the pool's admin token rotated, the pool turned TLS on, or new files.
            if got is None or got[0] != token or got[1] != tls or got[2] != files:
                if got is not None:
                    got[3].close()
                got = self._clients[address] = (token, tls, files, AdminClient(address, token, self.timeout, tls))
            return got[3]

    def forget(self, keep: Iterable[str]) -> None:
        """Close the clients of addresses no longer in any ring."""
        keep_set = set(keep)
        with self._lock:
            for addr in [a for a in self._clients if a not in keep_set]:
                self._clients.pop(addr)[3].close()
            for addr in [a for a in self._tls if a not in keep_set]:
                del self._tls[addr]

    def close(self) -> None:
        self.forget(())

    def _call(self, address: str, token: str, method: str, call: Callable[[AdminClient], T]) -> T:
        try:
            return call(self._client(address, token))
        except KvpoolError as exc:
            raise NodeUnreachable(address, f"{method}: {type(exc).__name__} {exc}".strip()) from None

    # -- calls ------------------------------------------------------------------------------

    def stats(self, address: str, token: str) -> NodeStats:
        r = self._call(address, token, "Stats", lambda c: c.stats())
        tiers = [t for t in r.tiers if t.name in _PER_NODE_TIERS]
        return NodeStats(
            node_id=r.node_id, epoch=r.epoch, capacity_bytes=sum(t.capacity_bytes for t in tiers),
            used_bytes=sum(t.used_bytes for t in tiers), hit_blocks=r.hit_blocks, lookup_blocks=r.lookup_blocks,
            draining=r.draining, counters=dict(r.counters), foreign_bytes=r.foreign_bytes,
            tenants=tuple(TenantUsage(t.tenant_id, t.used_bytes, t.quota_bytes, t.objects, dict(t.counters))
                          for t in r.tenants))

    def set_ring(self, address: str, token: str, ring: Ring) -> None:
        self._call(address, token, "SetRing", lambda c: c.set_ring(ring))

    def configure(self, address: str, token: str, policy: Policy, tenants: Iterable[NodeTenant]) -> None:
        """Pool TTLs and watermarks, and the admitted tenants (replace: others are revoked)."""
        self._call(address, token, "SetPolicy", lambda c: c.set_policy(
            {k: int(v) for k, v in policy.ttl_seconds.items()}, policy.high_watermark, policy.low_watermark))
        configs = [pb.TenantConfig(tenant_id=t.tenant_id, token=t.token, salt=t.salt, quota_bytes=t.quota_bytes,
                                   ttl_seconds={k: int(v) for k, v in t.ttl_seconds.items()},
                                   evict_own_on_quota=t.evict_own_on_quota) for t in tenants]
        self._call(address, token, "SetTenants", lambda c: c.set_tenants(configs, replace=True))

    def drain(self, address: str, token: str, ring: Ring, deadline_unix_ms: int,
              max_bytes_per_second: int = 0) -> DrainStatus:
        return self._call(address, token, "Drain", lambda c: c.drain(ring, deadline_unix_ms, max_bytes_per_second))

    def drain_status(self, address: str, token: str) -> DrainStatus:
        return self._call(address, token, "GetDrainStatus", lambda c: c.drain_status())

    def warm(self, address: str, token: str, ring: Ring, added: Iterable[str], deadline_unix_ms: int,
             max_bytes_per_second: int = 0, fraction: float = 0.0, removed: Iterable[str] = ()) -> WarmStatus:
        """Ask a previous owner to push its hottest objects now owned by ``added``, and the blocks
        that lost a copy with ``removed`` (left without a drain) to their next owners
        (idempotent per epoch)."""
        return self._call(address, token, "Warm", lambda c: c.warm(
            ring, list(added), deadline_unix_ms, max_bytes_per_second, fraction, list(removed)))

    def warm_status(self, address: str, token: str) -> WarmStatus:
        return self._call(address, token, "GetWarmStatus", lambda c: c.warm_status())
