"""Retries of pool writes that failed for a passing reason (pure: no I/O, no clock).

A pool write can fail without the ring changing: the owner was busy or unreachable for a
moment (a timeout, a reset connection, a node in its down backoff), another writer held a
reservation for the key (IN_FLIGHT: two sidecars storing the same shared prefix), the
reservation lapsed under load (LEASE_EXPIRED) or the node could not free space yet (NO_SPACE).
Such a block would stay local-only until its eviction, so the sidecar's pool writer tries it
again a bounded number of times with growing delays.  So does it for the copy of an object
evicted from the local tier (write-back or local-only): that copy is then its only bytes.  What
the pool refuses for good (quota, tenant, malformed, too large) is never tried again.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

from kvpool.core.errors import Code

UNREACHABLE = -1
"""Per-item result of a pool write whose owner could not be reached (not a store code)."""

DONE, RETRY, REFUSED = "done", "retry", "refused"

_DONE = frozenset({Code.OK, Code.ALREADY_EXISTS})
_PASSING = frozenset({UNREACHABLE, Code.IN_FLIGHT, Code.LEASE_EXPIRED, Code.NO_SPACE, Code.CHECKSUM,
                      # A stale ring that one catch-up did not fix yet (the new one is on its way).
                      Code.DRAINING, Code.WRONG_OWNER})


def outcome(code: int) -> str:
    """What a pool write's per-item code means for the block: DONE (the pool holds it), RETRY
    (a passing failure: try again later) or REFUSED (the pool will not take it: do not)."""
    if code in _DONE:
        return DONE
    return RETRY if code in _PASSING else REFUSED


def retried(code: int, pooled: bool, copy: bool, block: bool, write_back: bool) -> bool:
    """Whether the pool writer tries a failed write again (``code``: its per-item result): a
    passing failure of an evicted object's copy (``copy``: the only bytes left, of any kind, under
    either write policy) or of a write-through block (``block`` and not ``write_back``) still in
    the local tier.  Write-back blocks and state objects still local wait for eviction or drain."""
    if pooled or outcome(code) != RETRY:
        return False
    return copy or (block and not write_back)


def delay(attempt: int, base: float, cap: float) -> float:
    """Seconds to wait before retry number ``attempt`` (1, 2, ...): doubling from ``base``, at most ``cap``."""
    return min(cap, base * (1 << min(attempt - 1, 30)))


def drain_pause(attempt: int, left: float) -> float:
    """Seconds the drain (SIGTERM's flush) waits before its round number ``attempt`` + 1 after
    a round with passing failures: doubling from 50 ms up to 1 s (a node's down backoff), never
    past the deadline, ``left`` seconds away."""
    return max(0.0, min(delay(attempt, 0.05, 1.0), left))


E = TypeVar("E", bound=Hashable)


class RetryQueue(Generic[E]):
    """Blocks waiting for another pool write, each due at its own time; bounded in bytes.

    :meth:`schedule` refuses a block tried ``max_attempts`` times already or one that does not
    fit (the caller counts it as dropped: a block still local stays local-only, so eviction or
    the drain still hands it over; an evicted copy is lost).  Not thread-safe: the caller holds
    its lock.
    """

    def __init__(self, max_attempts: int, max_bytes: int, base: float = 0.2, cap: float = 5.0) -> None:
        self.max_attempts, self.max_bytes = max_attempts, max_bytes
        self.base, self.cap = base, cap
        self.bytes = 0
        self._heap: list[tuple[float, int, E, int]] = []  # (due, tie-break, block, size)
        self._attempts: dict[E, int] = {}  # block → retries scheduled so far (while it is in play)
        self._waiting: set[E] = set()
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, block: E, size: int, now: float) -> bool:
        """Queue ``block`` for another write (no-op True if it waits already); False: dropped."""
        if block in self._waiting:
            return True
        n = self._attempts.get(block, 0) + 1
        if n > self.max_attempts or self.bytes + size > self.max_bytes:
            self._attempts.pop(block, None)
            return False
        self._attempts[block] = n
        self._waiting.add(block)
        self.bytes += size
        heapq.heappush(self._heap, (now + delay(n, self.base, self.cap), next(self._seq), block, size))
        return True

    def settle(self, block: E) -> None:
        """``block`` reached the pool or was refused for good (or left the local tier): forget it."""
        if block not in self._waiting:
            self._attempts.pop(block, None)

    def next_due(self) -> float | None:
        """When the earliest waiting block is due (None: none waits)."""
        return self._heap[0][0] if self._heap else None

    def take_due(self, now: float, limit: int) -> list[tuple[E, int]]:
        """Up to ``limit`` (block, size) pairs due by ``now``, earliest first; they stop waiting
        (their attempt counts stay until :meth:`settle` or the next :meth:`schedule`)."""
        out: list[tuple[E, int]] = []
        while self._heap and self._heap[0][0] <= now and len(out) < limit:
            _, _, block, size = heapq.heappop(self._heap)
            self._waiting.discard(block)
            self.bytes -= size
            out.append((block, size))
        return out
