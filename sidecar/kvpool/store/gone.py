"""Why a key is not here: a bounded memory of the keys a store node dropped or refused recently.

A lookup that finds nothing asks :meth:`Gone.reason` whether the key was evicted, expired,
refused or evicted for its tenant's quota, or dropped for a failed checksum, so the miss-reason
counter (``kvpool_store_miss_blocks``, :class:`~kvpool.wire.counters.MissReason`) can say more than
"absent".  Bounded (oldest forgotten first: a key dropped long ago is "absent"), keyed by tenant
and key (the same key of two tenants names two objects).  No lock of its own: the node calls it
under its index lock.  Only drops and the misses of lookups touch it, never a hit.
"""

from __future__ import annotations

from kvpool.wire.counters import MissReason

DEFAULT_CAPACITY = 65536
"""Keys remembered (about 10 MiB of dict at 32-byte keys)."""


class Gone:
    """Recently dropped or refused keys → why (see the module docstring)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = max(0, capacity)
        self._why: dict[tuple[str, bytes], MissReason] = {}

    def note(self, tenant: str, key: bytes, reason: MissReason) -> None:
        """Remember that ``key`` of ``tenant`` went (or was refused) for ``reason``."""
        if not self.capacity:
            return
        why = self._why
        k = (tenant, key)
        why.pop(k, None)  # re-inserted: the newest again
        why[k] = reason
        if len(why) > self.capacity:
            del why[next(iter(why))]  # dicts keep insertion order: the oldest

    def reason(self, tenant: str, key: bytes) -> MissReason:
        """Why ``key`` is not here: what was noted, else :attr:`MissReason.ABSENT`."""
        return self._why.get((tenant, key), MissReason.ABSENT)

    def __len__(self) -> int:
        return len(self._why)
