"""The one module that talks to store nodes: their admin gRPC API (kvpool/proto/store.proto).

The operator is a client of that API like any other (STYLE 3): it imports the generated stubs,
never the store's internals. Calls carry the pool's admin token and a short deadline; a node that
does not answer is reported as such (``NodeUnreachable``) and the planners decide what that means.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import grpc

from kvpool.core.ring import Ring
from kvpool.wire.convert import ring_to_pb
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.proto import store_pb2_grpc as pbg

from .drain import NodeDrainStatus
from .rebalance import NodeWarmStatus
from .reconcile import Policy
from .status import NodeStats, TenantUsage
from .tenancy import NodeTenant

_OPTIONS = [("grpc.enable_http_proxy", 0), ("grpc.max_receive_message_length", 16 << 20)]
_PER_NODE_TIERS = ("dram", "ssd")  # a shared filesystem is one for all nodes: not per-node capacity


class NodeUnreachable(Exception):
    def __init__(self, address: str, detail: str) -> None:
        super().__init__(f"store node {address}: {detail}")
        self.address = address


class Nodes:
    """Channels to store nodes, reused across reconciles (thread-safe)."""

    def __init__(self, timeout: float = 5.0) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, Any]] = {}

    def _stub(self, address: str) -> Any:
        with self._lock:
            got = self._channels.get(address)
            if got is None:
                ch = grpc.insecure_channel(address, options=_OPTIONS)
                got = self._channels[address] = (ch, pbg.StoreStub(ch))
            return got[1]

    def forget(self, keep: Iterable[str]) -> None:
        """Close channels to addresses no longer in any ring."""
        keep_set = set(keep)
        with self._lock:
            for addr in [a for a in self._channels if a not in keep_set]:
                self._channels.pop(addr)[0].close()

    def close(self) -> None:
        self.forget(())

    def _call(self, address: str, method: str, request: Any, token: str) -> Any:
        md = (("authorization", f"Bearer {token}"),) if token else ()
        try:
            return getattr(self._stub(address), method)(request, timeout=self.timeout, metadata=md)
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            raise NodeUnreachable(address, f"{method}: {code.name if code else 'error'} {err.details() or ''}".strip()
                                  ) from None

    # -- calls ------------------------------------------------------------------------------

    def stats(self, address: str, token: str) -> NodeStats:
        r = self._call(address, "Stats", pb.Empty(), token)
        tiers = [t for t in r.tiers if t.name in _PER_NODE_TIERS]
        return NodeStats(
            node_id=r.node_id, epoch=r.epoch, capacity_bytes=sum(t.capacity_bytes for t in tiers),
            used_bytes=sum(t.used_bytes for t in tiers), hit_blocks=r.hit_blocks, lookup_blocks=r.lookup_blocks,
            draining=r.draining, counters=dict(r.counters),
            tenants=tuple(TenantUsage(t.tenant_id, t.used_bytes, t.quota_bytes, t.objects, dict(t.counters))
                          for t in r.tenants))

    def set_ring(self, address: str, token: str, ring: Ring) -> None:
        self._call(address, "SetRing", ring_to_pb(ring), token)

    def configure(self, address: str, token: str, policy: Policy, tenants: Iterable[NodeTenant]) -> None:
        """Pool TTLs and watermarks, and the admitted tenants (replace: others are revoked)."""
        self._call(address, "SetPolicy", pb.PolicyRequest(
            ttl_seconds={k: int(v) for k, v in policy.ttl_seconds.items()},
            high_watermark=policy.high_watermark, low_watermark=policy.low_watermark), token)
        self._call(address, "SetTenants", pb.SetTenantsRequest(replace=True, tenants=[
            pb.TenantConfig(tenant_id=t.tenant_id, token=t.token, salt=t.salt, quota_bytes=t.quota_bytes,
                            ttl_seconds={k: int(v) for k, v in t.ttl_seconds.items()},
                            evict_own_on_quota=t.evict_own_on_quota) for t in tenants]), token)

    def drain(self, address: str, token: str, ring: Ring, deadline_unix_ms: int,
              max_bytes_per_second: int = 0) -> NodeDrainStatus:
        r = self._call(address, "Drain", pb.DrainRequest(ring=ring_to_pb(ring), deadline_unix_ms=deadline_unix_ms,
                                                         max_bytes_per_second=max_bytes_per_second), token)
        return drain_status_from_pb(r)

    def drain_status(self, address: str, token: str) -> NodeDrainStatus:
        return drain_status_from_pb(self._call(address, "GetDrainStatus", pb.Empty(), token))

    def warm(self, address: str, token: str, ring: Ring, added: Iterable[str], deadline_unix_ms: int,
             max_bytes_per_second: int = 0, fraction: float = 0.0, removed: Iterable[str] = ()) -> NodeWarmStatus:
        """Ask a previous owner to push its hottest objects now owned by ``added``, and the blocks
        that lost a copy with ``removed`` (left without a drain) to their next owners
        (idempotent per epoch)."""
        return warm_status_from_pb(self._call(address, "Warm", pb.WarmRequest(
            ring=ring_to_pb(ring), added=list(added), deadline_unix_ms=deadline_unix_ms,
            max_bytes_per_second=max_bytes_per_second, fraction=fraction, removed=list(removed)), token))

    def warm_status(self, address: str, token: str) -> NodeWarmStatus:
        return warm_status_from_pb(self._call(address, "GetWarmStatus", pb.Empty(), token))


def drain_status_from_pb(r: Any) -> NodeDrainStatus:
    return NodeDrainStatus(state=r.state or "idle", moved_objects=r.moved_objects, moved_bytes=r.moved_bytes,
                           dropped_objects=r.dropped_objects, dropped_bytes=r.dropped_bytes,
                           remaining_objects=r.remaining_objects, deadline_unix_ms=r.deadline_unix_ms, epoch=r.epoch)


def warm_status_from_pb(r: Any) -> NodeWarmStatus:
    return NodeWarmStatus(state=r.state or "idle", planned_objects=r.planned_objects, planned_bytes=r.planned_bytes,
                          moved_objects=r.moved_objects, moved_bytes=r.moved_bytes, skipped_objects=r.skipped_objects,
                          skipped_bytes=r.skipped_bytes, failed_objects=r.failed_objects,
                          remaining_objects=r.remaining_objects, deadline_unix_ms=r.deadline_unix_ms, epoch=r.epoch)
