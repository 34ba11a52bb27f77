"""What the pool holds of a batch of keys: the matched prefix (pinned) and per-key presence.

Both ask every owner at once (:meth:`Pool.exists_many`, one batched EXISTS per node) and look
further only for what is missing, in the rounds of :func:`kvpool.pool.routing.rounds`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from kvpool.pool.fanout import Pool


@dataclass
class PoolMatch:
    prefix: int                       # global leading run of present keys (from `start`)
    leases: list[tuple[str, int]] = field(default_factory=list)  # (node id, lease id)


def match(pool: Pool, key_array: npt.NDArray[Any], lease_ms: int) -> PoolMatch:
    """Longest prefix of ``key_array`` present in the pool (see :func:`_match`); asked again
    when the ring moved since it was routed (a node told of a newer one on the way, and the
    background refresh learnt it within :attr:`Pool.catch_up_seconds`)."""
    epoch = pool.ring.epoch
    m = _match(pool, key_array, lease_ms)
    if m.prefix < len(key_array) and pool.catch_up(epoch, pool.catch_up_seconds):
        pool.release(m.leases)
        m = _match(pool, key_array, lease_ms)
    return m


def _match(pool: Pool, key_array: npt.NDArray[Any], lease_ms: int) -> PoolMatch:
    """Longest prefix of ``key_array`` present in the pool, pinned at each node.

    Each owner is asked for the leading run of *its* keys (prefix_only + pin): the global
    prefix ends at the earliest first miss among the owners.  When a fallback exists (a
    draining node, or the owners of earlier ring epochs) the keys from that first miss
    on are asked per key of their owners and fallbacks in one more concurrent round.
    """
    n = len(key_array)
    routes = pool.route(key_array)
    if not routes:
        return PoolMatch(0)
    first_miss = n
    leases: list[tuple[str, int]] = []
    for nid, idx, reply in pool.exists_many(key_array, [(nid, idx, True) for nid, idx in routes.items()],
                                            True, lease_ms):
        run = reply.prefix if reply is not None else 0
        if reply is not None and reply.lease_id:
            leases.append((nid, reply.lease_id))
        if run < len(idx):
            first_miss = min(first_miss, int(idx[run]))
    prefix = first_miss
    if prefix < n:
        tail = key_array[prefix:]
        fbs = pool.fallbacks(tail)
        if fbs:
            present = np.zeros(len(tail), dtype=bool)
            calls = [(nid, idx, False) for nid, idx in pool.route(tail).items()]
            calls += [(nid, idx, True) for fb in fbs for nid, idx in fb.items()]
            for nid, idx, reply in pool.exists_many(tail, calls, False, lease_ms):
                if reply is None:
                    continue
                if reply.lease_id:
                    leases.append((nid, reply.lease_id))
                got = reply.present
                present[idx[:len(got)][got[:len(idx)]]] = True
            misses = np.flatnonzero(~present)
            prefix += int(misses[0]) if len(misses) else len(tail)
    return PoolMatch(prefix, leases)


def present(pool: Pool, key_array: npt.NDArray[Any], kind: int) -> npt.NDArray[np.bool_]:
    """Per-key presence at the owners, then (under a newer ring, at the fallbacks) for what is
    still missing."""
    found = np.zeros(len(key_array), dtype=bool)
    for _, routes in pool.rounds(key_array, kind, lambda: ~found):
        calls = [(nid, idx, False) for nid, idx in routes.items() if len(idx)]
        for _, idx, reply in pool.exists_many(key_array, calls, False, 0, kind):
            if reply is not None:
                got = reply.present
                found[idx[:len(got)][got[:len(idx)]]] = True
    return found
