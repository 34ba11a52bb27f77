"""kvpool: a shared, tiered KV-cache pool for LLM inference (client library and data plane).

Engines import this package: keys (:class:`KeySpace`), hit planning (:func:`plan_hit`),
``connect()`` to a sidecar and ``LocalCluster`` for an embedded pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpool import _deps
from kvpool.core.keys import KeySpace, chain_keys
from kvpool.core.planning import (
    FetchDecision,
    HitPlan,
    kv_bytes_per_token,
    plan_hit,
    should_fetch,
    state_bytes,
    state_store_position,
)
from kvpool.core.ring import Member, Ring, owners
from kvpool.core.version import __version__ as __version__

if TYPE_CHECKING:  # the lazy names of __getattr__, typed for type checkers (no import at runtime)
    from kvpool.apps.cluster import LocalCluster
    from kvpool.client.client import connect

__all__ = [
    "FetchDecision", "HitPlan", "KeySpace", "LocalCluster", "Member", "Ring", "chain_keys",
    "connect", "kv_bytes_per_token", "owners", "plan_hit", "should_fetch", "state_bytes",
    "state_store_position",
]

# An engine image given the client by injection may lack grpcio/protobuf/xxhash: the copies beside
# the package fill in (kvpool/_deps.py); a regular install has none and this is one isdir.
_deps.provide()


def __getattr__(name: str) -> Any:
    # The client and the embedded cluster pull in grpc and subprocess machinery; load lazily so
    # that `import kvpool` stays cheap for engines that only compute keys.
    if name == "connect":
        from kvpool.client.client import connect
        return connect
    if name == "LocalCluster":
        from kvpool.apps.cluster import LocalCluster
        return LocalCluster
    raise AttributeError(name)
