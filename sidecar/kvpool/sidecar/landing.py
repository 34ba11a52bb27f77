"""Where a sidecar's pool read lands: fresh arena extents, or the caller's registered buffers.

:meth:`Sidecar._fetch_missing` asks the owners, then the owners under a newer ring, then the
fallbacks (draining node, earlier epochs), and hands every object to a :class:`Landing` the
moment its owner has said its size.  Two kinds:

* :class:`ArenaLanding` (``get``, ``get_into`` of plain buffers): a fresh extent of the local
  tier per object, so a fetch is also a promotion; the object is published (and pinned by the
  read's lease) once its checksum has been verified.  A key that a concurrent call is landing
  right now is taken from that call once it commits (a bounded wait).  An object the arena has
  no room for — every extent is pinned (views the engine still holds, the read's own objects) or
  it is larger than the whole tier — is not dropped: it is listed in ``no_room`` with its size,
  the read answers NO_SPACE for it, and the client reads it into memory of its own (a
  one-call region, ``READ_INTO``): the matched prefix stays readable whatever holds the arena.
  Meanwhile its bytes wait in a :class:`SpillStash`, so that second read copies them instead
  of fetching them from the pool again (measured: 1 MiB in 16 objects with a pinned-full tier,
  4.2 ms with a second fetch, 3.0–3.3 ms from the stash; 1.6–1.9 ms when the arena has room).
* :class:`BufferLanding` (``get_into`` of buffers the client allocated with ``alloc_buffer``):
  the bytes go straight into the caller's memory, as Mooncake's ``batch_get_into`` does, and
  the local tier is left as it was — a read-through for engines that keep their own host cache.
  It saves the arena→caller copy and lands in memory the caller reuses (cache-warm) instead of
  in a fresh arena extent.

The fetch threads call ``dest``/``landed``/``failed`` concurrently, each for its own indices.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpool.sidecar.local_tier import LocalEntry, LocalLease, LocalTier
from kvpool.wire.proto import store_pb2 as pb


class Landing:
    """What every landing keeps: per key index of the call, what landed there (None: nothing
    yet), and the indices that were given a destination and have neither landed nor failed."""

    def __init__(self, found: list[Any]) -> None:
        self.found = found
        self.pending: set[int] = set()
        self.no_room: dict[int, int] = {}
        """Key index -> size of an object its owner has but this landing had no room for (the
        read answers NO_SPACE and the size: the caller fetches it into memory of its own)."""
        self.why: dict[int, pb.Code] = {}
        """Key index -> why a node asked for it did not deliver it, when not because the node
        lacks it: UNAVAILABLE (the node missed its deadline, was cut off, down or skipped as
        suspect) or CHECKSUM (its bytes failed verification).  The read answers that code for
        a key found nowhere else, not NOT_FOUND: the pool may well hold it (the first reason
        sticks; a later round that finds the key wins)."""

    def dest(self, i: int, size: int) -> memoryview | None:
        """Memory for object ``i`` of ``size`` bytes (None: skip it; its code becomes INVALID)."""
        raise NotImplementedError

    def landed(self, i: int, checksum: int) -> int:
        """Object ``i`` arrived whole and verified; 1 if it counts as a pool hit."""
        raise NotImplementedError

    def failed(self, i: int) -> None:
        """Object ``i`` was given a destination but did not arrive (its bytes there are garbage)."""
        self.pending.discard(i)

    def undelivered(self, i: int, code: pb.Code) -> None:
        """A node asked for object ``i`` did not deliver it for ``code``'s reason (:attr:`why`)."""
        self.why.setdefault(i, code)

    def code(self, i: int) -> pb.Code:
        """The code of object ``i`` found nowhere: :attr:`why`'s, else NOT_FOUND."""
        return self.why.get(i, pb.NOT_FOUND)

    def found_elsewhere(self, indices: list[int]) -> None:
        """Objects found at a fallback, not at their owner under the current ring."""

    def settle(self) -> int:
        """After the rounds: pool hits that came some other way (0 by default)."""
        return 0

    def duplicate(self, i: int, j: int) -> int:
        """Key ``i`` is the same as key ``j`` of the same call (fetched once): 1 if ``i`` is now a hit."""
        raise NotImplementedError


class SpillStash:
    """Objects a read fetched that the arena had no room for, kept a moment for the client's
    READ_INTO that follows the NO_SPACE rows: it takes them from here (a copy in this process)
    instead of fetching them from the pool a second time.  Bounded in bytes; an object not taken
    within ``ttl`` seconds (a read no READ_INTO follows: the handoff's, or a client's whose
    READ_INTO failed) is dropped.  Keyed by
    (kind, key): objects are immutable, and a stashed one was verified against its checksum
    before it was put here.  Thread-safe."""

    def __init__(self, max_bytes: int, ttl: float = 2.0) -> None:
        self.max_bytes, self.ttl = max_bytes, ttl
        self.bytes = 0
        """Held and promised (reserved for a landing that has not ended yet)."""
        self._lock = threading.Lock()
        self._held: OrderedDict[tuple[int, bytes], tuple[float, npt.NDArray[np.uint8]]] = OrderedDict()

    def reserve(self, size: int) -> npt.NDArray[np.uint8] | None:
        """A buffer for one object (None: over the budget); :meth:`put` or :meth:`drop` it."""
        with self._lock:
            self._expire(time.monotonic())
            if self.bytes + size > self.max_bytes:
                return None
            self.bytes += size
        return np.empty(size, np.uint8)

    def drop(self, buf: npt.NDArray[np.uint8]) -> None:
        """A reserved buffer whose object did not arrive."""
        with self._lock:
            self.bytes -= buf.nbytes

    def put(self, kind: int, key: bytes, buf: npt.NDArray[np.uint8]) -> None:
        with self._lock:
            old = self._held.pop((kind, key), None)
            if old is not None:
                self.bytes -= old[1].nbytes
            self._held[(kind, key)] = (time.monotonic() + self.ttl, buf)

    def take(self, kind: int, key: bytes) -> npt.NDArray[np.uint8] | None:
        """The stashed object (gone from the stash), or None."""
        with self._lock:
            got = self._held.pop((kind, key), None)
            if got is None:
                return None
            self.bytes -= got[1].nbytes
            return got[1]

    def __len__(self) -> int:
        return len(self._held)

    def _expire(self, now: float) -> None:
        while self._held:
            k, (until, buf) = next(iter(self._held.items()))
            if until > now:
                return
            del self._held[k]
            self.bytes -= buf.nbytes


class ArenaLanding(Landing):
    """Fetches land in fresh extents of the local tier and are published there (promotion).
    An object the arena has no room for lands in ``stash`` when it has room (:class:`SpillStash`)."""

    def __init__(self, local: LocalTier, keys: list[bytes], kind: int, lease: LocalLease,
                 found: list[LocalEntry | None], offer: Callable[[list[LocalEntry]], None] | None,
                 wait_seconds: float, stash: SpillStash | None = None) -> None:
        super().__init__(found)
        self.local, self.keys, self.kind, self.lease = local, keys, kind, lease
        self.stash = stash
        self.stashed: dict[int, npt.NDArray[np.uint8]] = {}
        self.offer = offer
        """Where objects found at a fallback go to reach their new owner (copy-over), or None."""
        self.wait_seconds = wait_seconds
        self.entries: dict[int, LocalEntry] = {}
        self.contended: list[int] = []
        self.full_at: int | None = None
        """Smallest size the arena had no room for during this read (None: none yet)."""

    def dest(self, i: int, size: int) -> memoryview | None:
        if self.full_at is not None and size >= self.full_at:
            # No room for a smaller one a moment ago: not another walk of the whole LRU (under
            # the tier's lock) per object of a read the pinned arena cannot take.
            return self._no_room(i, size)
        why, e = self.local.reserve_one(self.keys[i], size, self.kind)
        if why in (pb.IN_FLIGHT, pb.ALREADY_EXISTS):
            self.contended.append(i)  # another call is landing the same object right now
        elif why in (pb.NO_SPACE, pb.TOO_LARGE):
            if why == pb.NO_SPACE:
                self.full_at = size if self.full_at is None else min(self.full_at, size)
            return self._no_room(i, size)
        if e is None:
            return None
        self.entries[i] = e
        self.pending.add(i)
        return self.local.view(e)

    def _no_room(self, i: int, size: int) -> memoryview | None:
        """The owner has object ``i`` but the arena cannot take it: the caller reads it into its
        own memory next; meanwhile it lands in the stash, if that has room (else it is skipped,
        and the caller's read fetches it again)."""
        self.no_room[i] = size
        buf = self.stash.reserve(size) if self.stash is not None else None
        if buf is None:
            return None
        self.stashed[i] = buf
        self.pending.add(i)
        return buf.data

    def landed(self, i: int, checksum: int) -> int:
        self.pending.discard(i)
        buf = self.stashed.pop(i, None)
        if buf is not None:
            assert self.stash is not None
            self.stash.put(self.kind, self.keys[i], buf)
            return 0  # a hit of the caller's read that takes it
        e = self.entries.pop(i)
        self.local.insert_fetched(e, checksum, self.lease)
        self.found[i] = e
        return 1

    def failed(self, i: int) -> None:
        super().failed(i)
        buf = self.stashed.pop(i, None)
        if buf is not None:
            assert self.stash is not None
            self.stash.drop(buf)
            self.no_room.pop(i, None)  # it did not arrive: a miss like any other
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
            if j in self.no_room:
                self.no_room[i] = self.no_room[j]
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
