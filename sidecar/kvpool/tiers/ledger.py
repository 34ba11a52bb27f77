"""The shared filesystem's side of the tier chain: which of its files a lookup may adopt.

Files of the per-key level outlive the node and are shared by all nodes: a lookup of an unknown
key reads their headers off the index lock (``TierChain.locate_files``, :class:`FsView`) and
adopts them under it.  A removed object's file is unlinked by the chain's background thread
(:class:`Unlink`, FIFO with the copies); until then, and for a header read before the unlink,
the file must not be adopted, or a removed object would come back (:class:`FsLedger`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from kvpool.arena.extents import Location, ObjectRef
from kvpool.tiers.base import Tier


@dataclass(frozen=True)
class FsView:
    """Shared-fs files of some keys located off the lock (key → its location), and when the
    locating started: a file unlinked after that is not adopted (:meth:`FsLedger.may_adopt`)."""

    found: dict[bytes, Location]
    since: float


@dataclass(frozen=True)
class Unlink:
    """The removal of an object's shared-fs file (queued, FIFO with the moves)."""

    loc: Location


class FsLedger:
    """Which files of the per-key level a lookup may adopt: not one whose unlink is on its way,
    nor one unlinked after the lookup started reading its header.  Called under the owner's lock."""

    def __init__(self) -> None:
        self._removing: Counter[tuple[str, bytes]] = Counter()
        """(tenant, key) of files whose unlink is on its way: never adopted meanwhile."""
        self._unlinked: dict[tuple[str, bytes], float] = {}
        """(tenant, key) → when its file was unlinked (monotonic), recent ones: a header read
        before that is stale."""
        self.horizon = 60.0
        """How long an unlink is remembered (a header is used within its read's bound)."""

    def removing(self, tenant: str, key: bytes) -> None:
        self._removing[(tenant, key)] += 1

    def unlinked(self, tenant: str, key: bytes) -> None:
        k = (tenant, key)
        self._removing[k] -= 1
        if self._removing[k] <= 0:
            del self._removing[k]
        now = self._unlinked[k] = time.monotonic()
        if len(self._unlinked) > 4096:
            self._unlinked = {x: t for x, t in self._unlinked.items() if t >= now - self.horizon}

    def may_adopt(self, tenant: str, key: bytes, since: float) -> bool:
        """Whether a file seen by a read that started at ``since`` may be adopted."""
        k = (tenant, key)
        return k not in self._removing and self._unlinked.get(k, -1.0) < since

    def busy(self) -> bool:
        return bool(self._removing)


def locate_into(fs: Tier, sealed: bool, refs: list[ObjectRef], prefix_only: bool,
                got: list[tuple[bytes, Location]]) -> None:
    """Append (key, location) of each of ``refs`` with a file in ``fs``, one at a time (with
    ``prefix_only`` up to the first without): the caller may stop waiting at any point and keep
    what was found by then."""
    for ref in refs:
        loc = fs.locate([ref], sealed)[0]
        if loc is None:
            if prefix_only:
                return
            continue
        got.append((ref.key, loc))
