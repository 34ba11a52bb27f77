"""The one Tier interface every place an object can live implements (the DRAM arena, the SSD
slot file, the shared filesystem, and any of them sealed at rest), and what the tiers below DRAM
share: injected faults for tests of slow disks.

Batch first, caller-owned buffers: a tier copies between its medium and the caller's
memoryviews, never allocating a buffer per object.  An object's life in a tier:

1. ``reserve(refs, sizes)``: room for each object, or None where there is none (NO_SPACE).  No
   I/O, so a caller may do it under its index lock (the plan step of a tier move).
2. ``write_batch(locations, sources)``: the copies, off any lock.
3. ``read_batch(locations, buffers)``: each buffer exactly the object's size; what comes back is
   verified (a checksum, or a sealed object's tag), so a damaged medium is CHECKSUM, never bytes.
4. ``free(locations)``: idempotent; no I/O in an addressed tier (see ``named``).

Per-item results are :class:`~kvpool.core.errors.Code` values: OK, NOT_FOUND (never written,
freed, not there), INVALID (a buffer of another size), CHECKSUM (damaged, or sealed under another
tenant, object or key), UNAVAILABLE (the medium failed).  A failed read zeroes its buffer: a
caller never sees bytes of another object, whatever it does with the buffer.

``locate(refs)`` finds objects by name: only a named tier (the shared filesystem) finds
anything, its files of other nodes and previous lives, checked by their header.  An addressed
tier (DRAM, SSD) starts empty and finds nothing: its objects are known by their locations only,
and a location of a previous life names nothing.

Thread safety: every call may come from any thread, concurrently, for different locations.

One conformance suite (``tests/kvpool/tiers/test_tier_conformance.py``) runs every
implementation.  Encryption at rest is a composition, :class:`kvpool.tiers.sealed.SealedTier`
around the tier it seals, and passes the same suite.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

# The interface's currency is defined with the arena (which implements the interface and sits
# below this layer); named here too, so that a tier's users import one module.
from kvpool.arena.extents import Location, ObjectRef
from kvpool.core.errors import Code

__all__ = ["Code", "FaultDelay", "Location", "ObjectRef", "Tier", "advance"]


@runtime_checkable
class Tier(Protocol):
    """A place objects live: see the module docstring for the contract."""

    @property
    def name(self) -> str:
        """``dram``, ``ssd``, ``sharedfs`` (the same for a sealed one)."""
        ...

    @property
    def named(self) -> bool:
        """Its objects are found by name (``locate``) and outlive this instance: the shared
        filesystem.  Its ``free`` removes files (I/O: never under an index lock).  An addressed
        tier's ``free`` does no I/O."""
        ...

    @property
    def capacity(self) -> int:
        """Bytes this tier may hold (0: unbounded, the shared filesystem's default)."""
        ...

    @property
    def used(self) -> int:
        """Bytes reserved now (rounded up to the tier's unit where it has one)."""
        ...

    def reserve(self, refs: Sequence[ObjectRef], sizes: Sequence[int]) -> list[Location | None]: ...

    def locate(self, refs: Sequence[ObjectRef], sealed: bool = False) -> list[Location | None]:
        """Objects already there by name (``sealed``: the sealed ones, else those in the clear)."""
        ...

    def write_batch(self, locs: Sequence[Location], srcs: Sequence[memoryview]) -> list[Code]: ...

    def read_batch(self, locs: Sequence[Location], dsts: Sequence[memoryview]) -> list[Code]: ...

    def free(self, locs: Sequence[Location]) -> None: ...

    def close(self) -> None: ...


class FaultDelay:
    """Test hook (fault injection): while the file at ``path`` exists, each SSD or shared-fs read,
    write, stat and removal first sleeps the seconds it holds (a float; unreadable or empty: none).

    Set by the store's ``--fault-tier-delay-file`` (or ``faultTierDelayFile``) only: it stands in
    for a slow or hung disk in tests, where no throttled device (dm-delay) or FUSE mount is at
    hand.  Unset, it costs one attribute test per I/O.
    """

    def __init__(self, path: str = "") -> None:
        self.path = path

    def __call__(self) -> None:
        if not self.path:
            return
        try:
            with open(self.path) as f:
                delay = float(f.read().strip() or 0)
        except (OSError, ValueError):
            return
        if delay > 0:
            time.sleep(delay)


def advance(bufs: list[bytes | memoryview], n: int) -> list[bytes | memoryview]:
    """Drop the first ``n`` bytes written by writev from a buffer list."""
    out: list[bytes | memoryview] = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(memoryview(b)[n:] if n else b)
        n = 0
    return out
