"""Where a sidecar's pool read lands: fresh arena extents, or the caller's registered buffers.

:meth:`Sidecar._fetch_missing` asks the owners, then the owners under a newer ring, then the
fallbacks (draining node, earlier epochs), and hands every object to a :class:`Landing` the
moment its owner has said its size.  Two kinds:

* :class:`ArenaLanding` (``get``, ``get_into`` of plain buffers): a fresh extent of the local
  tier per object, so a fetch is also a promotion; the object is published (and pinned by the
  read's lease) once its checksum has been verified.  A key that a concurrent call is landing
  right now is taken from that call once it commits (a bounded wait).
* :class:`BufferLanding` (``get_into`` of buffers the client allocated with ``alloc_buffer``):
  the bytes go straight into the caller's memory, as Mooncake's ``batch_get_into`` does, and
  the local tier is left as it was — a read-through for engines that keep their own host cache.
  It saves the arena→caller copy and lands in memory the caller reuses (cache-warm) instead of
  in a fresh arena extent.

The fetch threads call ``dest``/``landed``/``failed`` concurrently, each for its own indices.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..proto import store_pb2 as pb
from .local_tier import LocalEntry, LocalLease, LocalTier


class Landing:
    """What every landing keeps: per key index of the call, what landed there (None: nothing
    yet), and the indices that were given a destination and have neither landed nor failed."""

    def __init__(self, found: list[Any]) -> None:
        self.found = found
        self.pending: set[int] = set()

    def dest(self, i: int, size: int) -> memoryview | None:
        """Memory for object ``i`` of ``size`` bytes (None: skip it; its code becomes INVALID)."""
        raise NotImplementedError

    def landed(self, i: int, checksum: int) -> int:
        """Object ``i`` arrived whole and verified; 1 if it counts as a pool hit."""
        raise NotImplementedError

    def failed(self, i: int) -> None:
        """Object ``i`` was given a destination but did not arrive (its bytes there are garbage)."""
        self.pending.discard(i)

    def found_elsewhere(self, indices: list[int]) -> None:
        """Objects found at a fallback, not at their owner under the current ring."""

    def settle(self) -> int:
        """After the rounds: pool hits that came some other way (0 by default)."""
        return 0

    def duplicate(self, i: int, j: int) -> int:
        """Key ``i`` is the same as key ``j`` of the same call (fetched once): 1 if ``i`` is now a hit."""
        raise NotImplementedError


class ArenaLanding(Landing):
    """Fetches land in fresh extents of the local tier and are published there (promotion)."""

    def __init__(self, local: LocalTier, keys: list[bytes], kind: int, lease: LocalLease,
                 found: list[LocalEntry | None], offer: Callable[[list[LocalEntry]], None] | None,
                 wait_seconds: float) -> None:
        super().__init__(found)
        self.local, self.keys, self.kind, self.lease = local, keys, kind, lease
        self.offer = offer
        """Where objects found at a fallback go to reach their new owner (copy-over), or None."""
        self.wait_seconds = wait_seconds
        self.entries: dict[int, LocalEntry] = {}
        self.contended: list[int] = []

    def dest(self, i: int, size: int) -> memoryview | None:
        why, e = self.local.reserve_one(self.keys[i], size, self.kind)
        if why in (pb.IN_FLIGHT, pb.ALREADY_EXISTS):
            self.contended.append(i)  # another call is landing the same object right now
        if e is None:
            return None
        self.entries[i] = e
        self.pending.add(i)
        return self.local.view(e)

    def landed(self, i: int, checksum: int) -> int:
        self.pending.discard(i)
        e = self.entries.pop(i)
        self.local.insert_fetched(e, checksum, self.lease)
        self.found[i] = e
        return 1

    def failed(self, i: int) -> None:
        super().failed(i)
        e = self.entries.pop(i, None)
        if e is not None:
            self.local.abandon(e)

    def found_elsewhere(self, indices: list[int]) -> None:
        if self.offer is not None and self.kind == pb.BLOCK:
            moved = [self.found[i] for i in indices]
            self.offer([e for e in moved if e is not None])

    def settle(self) -> int:
        """Objects a concurrent call was landing in the arena: take them once committed (a
        bounded wait; a fetch that fails leaves them missing)."""
        got = 0
        wait = 0.0005
        deadline = time.monotonic() + self.wait_seconds
        todo = [i for i in self.contended if self.found[i] is None]
        while todo:
            ents, pending = self.local.pin_into(self.lease, [self.keys[i] for i in todo], self.kind)
            for i, e in zip(todo, ents, strict=True):
                if e is not None:
                    self.found[i] = e
                    got += 1
            todo = [i for i in todo if self.found[i] is None]
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(wait)
            wait = min(wait * 2, 0.02)
        return got

    def duplicate(self, i: int, j: int) -> int:
        e = self.found[j]
        if e is None:
            return 0
        self.found[i] = e
        return 1


class BufferLanding(Landing):
    """Fetches land in the caller's buffers (``dests[i]``, None where the caller gave none);
    ``found[i]`` becomes the object's size.  An object larger than its buffer is skipped and
    listed in ``too_small`` (its size in ``sizes``)."""

    def __init__(self, dests: Sequence[memoryview | None], found: list[int | None]) -> None:
        super().__init__(found)
        self.dests = dests
        self.sizes: dict[int, int] = {}
        self.too_small: set[int] = set()

    def dest(self, i: int, size: int) -> memoryview | None:
        d = self.dests[i]
        self.sizes[i] = size
        if d is None or d.nbytes < size:
            self.too_small.add(i)
            return None
        self.pending.add(i)
        return d[:size]

    def landed(self, i: int, checksum: int) -> int:
        self.pending.discard(i)
        self.found[i] = self.sizes[i]
        return 1

    def duplicate(self, i: int, j: int) -> int:
        size = self.found[j]
        d = self.dests[i]
        if size is None:
            return 0
        if d is None or d.nbytes < size:
            self.sizes[i] = size
            self.too_small.add(i)
            return 0
        src = self.dests[j]
        assert src is not None
        np.copyto(np.frombuffer(d, np.uint8, size), np.frombuffer(src, np.uint8, size))
        self.found[i] = size
        return 1
