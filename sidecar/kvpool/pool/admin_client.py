"""Client of one store node's admin API (``StoreAdmin`` in ``store.proto``), for the operator,
``LocalCluster`` and tests: the ring, the tenants and the pool policy a node serves, and its push
jobs (drain, warm-up).

Every call carries the pool's admin token; a node refuses it otherwise.  The node-wide ``Stats``
(every tenant's usage) is a ``StoreData`` call that the admin token also opens: it is here too,
so that the operator holds one client per node.  Replies come back as the domain's types
(:mod:`kvpool.wire.convert`); failures as the exception tree (:mod:`kvpool.wire.grpc_status`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import grpc

from kvpool.core.push_status import DrainStatus, WarmStatus
from kvpool.core.ring import Ring
from kvpool.wire import grpc_status
from kvpool.wire.convert import drain_status_from_pb, ring_from_pb, ring_to_pb, warm_status_from_pb
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.proto import store_pb2_grpc as pbg
from kvpool.wire.tls import TlsConfig
from kvpool.wire.tls import channel as tls_channel
from kvpool.wire.tls import resolve as resolve_tls

_CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0), ("grpc.max_receive_message_length", 16 << 20)]


class AdminClient:
    """Thread-safe admin client of one store node."""

    def __init__(self, address: str, token: str = "", timeout: float = 10.0,
                 tls: TlsConfig | bool | None = None) -> None:
        """``token``: the pool's admin token ("" for a node started without one, which then
        takes admin calls that carry no token).  ``tls``: the channel's TLS configuration (None:
        this process's; False: plaintext); a node serving TLS takes admin calls only from the
        operator's certificate."""
        self.address = address
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = tls_channel(address, resolve_tls(tls, address), _CHANNEL_OPTIONS)
        self._admin = pbg.StoreAdminStub(self._channel)
        self._data = pbg.StoreDataStub(self._channel)

    def _rpc(self, method: Any, request: Any) -> Any:
        # Any: the generated gRPC stubs are untyped; callers cast the reply to its message.
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise grpc_status.from_rpc_error(err) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- ring, tenants, policy --------------------------------------------------------------

    def set_ring(self, ring: Ring | pb.Ring) -> Ring:
        """Publish ``ring`` to the node; the ring it serves afterwards (a newer one it had stays)."""
        msg = ring_to_pb(ring) if isinstance(ring, Ring) else ring
        return ring_from_pb(cast(pb.Ring, self._rpc(self._admin.SetRing, msg)))

    def set_tenants(self, tenants: Sequence[pb.TenantConfig], replace: bool = False) -> None:
        """Admit ``tenants`` (``replace``: and revoke every tenant not listed)."""
        self._rpc(self._admin.SetTenants, pb.SetTenantsRequest(tenants=list(tenants), replace=replace))

    def set_policy(self, ttl_seconds: Mapping[str, int] | None = None, high_watermark: float = 0.0,
                   low_watermark: float = 0.0) -> None:
        """The pool's TTLs per traffic class and DRAM watermarks (0: the node's own)."""
        self._rpc(self._admin.SetPolicy, pb.PolicyRequest(ttl_seconds=dict(ttl_seconds or {}),
                                                          high_watermark=high_watermark, low_watermark=low_watermark))

    # -- push jobs --------------------------------------------------------------------------

    def drain(self, ring: Ring | pb.Ring, deadline_unix_ms: int, max_bytes_per_second: int = 0) -> DrainStatus:
        """Start (or resume, for the same epoch) pushing this node's objects to ``ring``'s owners."""
        msg = ring_to_pb(ring) if isinstance(ring, Ring) else ring
        request = pb.DrainRequest(ring=msg, deadline_unix_ms=deadline_unix_ms,
                                  max_bytes_per_second=max_bytes_per_second)
        return drain_status_from_pb(self._rpc(self._admin.Drain, request))

    def drain_status(self) -> DrainStatus:
        return drain_status_from_pb(self._rpc(self._admin.GetDrainStatus, pb.Empty()))

    def warm(self, ring: Ring | pb.Ring, added: Sequence[str], deadline_unix_ms: int = 0,
             max_bytes_per_second: int = 0, fraction: float = 0.0, removed: Sequence[str] = ()) -> WarmStatus:
        """Start (idempotent per epoch) pushing the hottest objects now owned by ``added`` to them,
        and the blocks that lost a copy with ``removed`` (active before, gone without a drain) to
        their next owners."""
        msg = ring_to_pb(ring) if isinstance(ring, Ring) else ring
        request = pb.WarmRequest(ring=msg, added=list(added), deadline_unix_ms=deadline_unix_ms,
                                 max_bytes_per_second=max_bytes_per_second, fraction=fraction,
                                 removed=list(removed))
        return warm_status_from_pb(self._rpc(self._admin.Warm, request))

    def warm_status(self) -> WarmStatus:
        return warm_status_from_pb(self._rpc(self._admin.GetWarmStatus, pb.Empty()))

    # -- observation ------------------------------------------------------------------------

    def stats(self) -> pb.StatsReply:
        """The node's counters, tiers and every tenant's usage."""
        return cast(pb.StatsReply, self._rpc(self._data.Stats, pb.Empty()))
