"""A tenant's quota over the whole pool, kept by the store nodes without an allocator (pure).

``quotaBytes`` is the tenant's limit for the pool, in logical bytes: an object counts once
however many replicas the ring keeps of it.  No node sees the pool, so each store node admits
a tenant's writes up to its *share* of that limit, derived from the ring every node already
receives (members, states, replication R)::

    share = ceil(quota x min(R, n) / n)        n = active members

Rendezvous hashing spreads a tenant's keys evenly over the active members, and each key is
written to min(R, n) of them, so the shares add up to the quota times the copies kept: the
pool holds at most ``quota`` logical bytes (physical bytes / R).  Shares are recomputed on every
ring change: after a node is lost the survivors' shares grow; after a scale-up they shrink, and
a node over its new share first drops the tenant's objects it no longer owns (the new owner
holds, or will be warmed with, the hot ones), then, with ``evict_own_on_quota``, the tenant's
least recently used ones, and refuses new writes until it is under its share again.

The cost of having no allocator on the data path: a tenant may be refused a little *before*
its pool-wide usage reaches the quota (one node's share fills while another's still has room);
the limit itself is never exceeded by more than the rounding of the shares, except right after
a scale-up without ``evict_own_on_quota`` by the deviation of the kept objects from an even
spread.  Nothing here does I/O; the store node (:mod:`kvpool.store.node`) applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvpool.core.ring import Ring


def quota_share(quota_bytes: int, replicas: int, active_members: int) -> int:
    """One store node's share of a tenant's pool quota: ``ceil(quota x min(R, n) / n)``.

    0 stays 0 (no quota).  A node that knows no ring (``active_members`` 0: a standalone node,
    or before the operator's first SetRing) is the whole pool and admits the whole quota."""
    if quota_bytes <= 0:
        return 0
    if active_members <= 0:
        return quota_bytes
    copies = max(1, min(replicas, active_members))
    return -(-quota_bytes * copies // active_members)


def ring_share(quota_bytes: int, ring: Ring) -> int:
    """:func:`quota_share` under ``ring`` (its replication and its active members)."""
    return quota_share(quota_bytes, ring.replicas, len(ring.active))


def pool_usage(physical_bytes: int, replicas: int, members: int) -> int:
    """A tenant's pool usage in the unit of its quota (logical bytes) from the bytes its objects
    take on all nodes: each block is kept min(R, n) times.  Rounded up: a usage at the limit
    never reads under it."""
    copies = max(1, min(replicas, members)) if members > 0 else 1
    return -(-physical_bytes // copies)


class Held(NamedTuple):
    """One object a node holds for a tenant, as the trim after a ring change sees it."""

    size: int
    last_access: float
    owned: bool
    """Whether this node is still one of its write owners under the new ring."""


def trim_to_share(used_bytes: int, share_bytes: int, held: Sequence[Held], evict_own: bool) -> list[int]:
    """Which of ``held`` (indices) a node over its new share drops: the objects it no longer owns
    first, least recently used first, then (only with ``evict_own``) its own ones in the same
    order, until the tenant's usage here is within ``share_bytes``.  Nothing when it already is
    (or there is no quota: share 0).  Objects not listed (pinned, in flight) are never chosen;
    what cannot be freed stays, and the node refuses the tenant's writes until it is under."""
    if not share_bytes or used_bytes <= share_bytes:
        return []
    need = used_bytes - share_bytes
    order = sorted(range(len(held)), key=lambda i: (held[i].owned, held[i].last_access))
    out: list[int] = []
    for i in order:
        if need <= 0 or (held[i].owned and not evict_own):
            break
        out.append(i)
        need -= held[i].size
    return out
