"""Encryption at rest as a tier: :class:`SealedTier` seals each object on its way into the tier
it wraps and opens it on its way out; ``kvpool.tiers.atrest`` holds the keys and the format."""

from __future__ import annotations

import secrets
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace

from kvpool.arena.extents import Location, ObjectRef, zero
from kvpool.core.errors import Code
from kvpool.tiers.atrest import OVERHEAD, AtRest, sealed_size
from kvpool.tiers.base import Tier
from kvpool.wire.counters import StoreCounter

SCRATCH_BYTES = 16 << 20
"""Blobs of one call pass through a scratch buffer of about this much per thread (more for an
object larger than that): a fresh multi-MiB buffer per object costs a page fault per 4 KiB."""


class SealedTier:
    """A :class:`~kvpool.tiers.base.Tier` whose objects are sealed per tenant in the tier below
    (AES-256-GCM, :class:`~kvpool.tiers.atrest.AtRest`).

    Its locations carry the plaintext's size and the generation the object was sealed under (a
    fresh random one per reservation); the tier below sees the same location with the blob's
    size.  A blob that does not open — tampered, truncated, sealed for another tenant, object,
    kind or generation, or under a master key this node does not hold — reads CHECKSUM, its
    buffer zeroed.  DRAM is never sealed: see ``kvpool.arena.dram.DramTier``.

    Thread-safe: blobs pass through a scratch buffer per thread; :class:`AtRest` is shared.
    """

    def __init__(self, inner: Tier, at_rest: AtRest) -> None:
        self.inner = inner
        self.at_rest = at_rest
        self._local = threading.local()
        self._count_lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        """``at_rest_auth_failures`` (blobs read that did not open) and
        ``at_rest_previous_key_opens`` (opened under a previous master key: due for rotation)."""

    def __repr__(self) -> str:
        return f"SealedTier({self.inner.name}, {self.at_rest!r})"

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def named(self) -> bool:
        return self.inner.named

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def used(self) -> int:
        return self.inner.used

    def reserve(self, refs: Sequence[ObjectRef], sizes: Sequence[int]) -> list[Location | None]:
        if any(s < 0 for s in sizes):
            raise ValueError("object sizes must not be negative")
        below = self.inner.reserve(refs, [sealed_size(s) for s in sizes])
        return [None if b is None else replace(b, size=s, sealed=True, generation=secrets.randbits(63))
                for b, s in zip(below, sizes, strict=True)]

    def locate(self, refs: Sequence[ObjectRef], sealed: bool = True) -> list[Location | None]:
        """The sealed objects of ``refs`` below (``sealed`` is moot: every object here is)."""
        return [None if b is None or b.size < OVERHEAD else replace(b, size=b.size - OVERHEAD)
                for b in self.inner.locate(refs, sealed=True)]

    def write_batch(self, locs: Sequence[Location], srcs: Sequence[memoryview]) -> list[Code]:
        codes = [Code.INVALID] * len(locs)
        todo = [i for i, (loc, src) in enumerate(zip(locs, srcs, strict=True)) if loc.sealed and len(src) == loc.size]
        for chunk, blobs in self._chunks(locs, todo):
            for i, blob in zip(chunk, blobs, strict=True):
                ref = locs[i].ref
                self.at_rest.seal(ref.tenant, ref.key, ref.kind, locs[i].generation, srcs[i], blob)
            for i, code in zip(chunk, self.inner.write_batch([_below(locs[i]) for i in chunk], blobs), strict=True):
                codes[i] = code
        return codes

    def read_batch(self, locs: Sequence[Location], dsts: Sequence[memoryview]) -> list[Code]:
        codes = [Code.INVALID] * len(locs)
        todo = [i for i, (loc, dst) in enumerate(zip(locs, dsts, strict=True)) if loc.sealed and len(dst) == loc.size]
        for i in set(range(len(locs))) - set(todo):
            zero(dsts[i])
        for chunk, blobs in self._chunks(locs, todo):
            got = self.inner.read_batch([_below(locs[i]) for i in chunk], blobs)
            failed = previous = 0
            for i, blob, code in zip(chunk, blobs, got, strict=True):
                loc = locs[i]
                if code == Code.OK:
                    if not self.at_rest.open_into(loc.ref.tenant, loc.ref.key, loc.ref.kind, loc.generation,
                                                  blob, dsts[i]):
                        code, failed = Code.CHECKSUM, failed + 1
                    elif not self.at_rest.sealed_with_current(blob):
                        previous += 1
                if code != Code.OK:
                    zero(dsts[i])  # (open_into leaves it as it was for a key it does not hold)
                codes[i] = code
            if failed or previous:
                with self._count_lock:
                    self.counters[StoreCounter.AT_REST_AUTH_FAILURES] += failed
                    self.counters[StoreCounter.AT_REST_PREVIOUS_KEY_OPENS] += previous
        return codes

    def free(self, locs: Sequence[Location]) -> None:
        self.inner.free([_below(loc) for loc in locs])

    def close(self) -> None:
        self.inner.close()

    def _chunks(self, locs: Sequence[Location], todo: list[int]) -> Iterator[tuple[list[int], list[memoryview]]]:
        """``todo`` in runs whose blobs fit the scratch buffer, each with a view per blob."""
        start = 0
        while start < len(todo):
            end, total = start + 1, sealed_size(locs[todo[start]].size)
            while end < len(todo) and total + sealed_size(locs[todo[end]].size) <= SCRATCH_BYTES:
                total += sealed_size(locs[todo[end]].size)
                end += 1
            scratch = self._scratch(total)
            blobs, pos = [], 0
            for i in todo[start:end]:
                n = sealed_size(locs[i].size)
                blobs.append(scratch[pos:pos + n])
                pos += n
            yield todo[start:end], blobs
            start = end

    def _scratch(self, n: int) -> memoryview:
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._local.buf = bytearray(-(-n // (1 << 20)) << 20)
        return memoryview(buf)[:n]


def _below(loc: Location) -> Location:
    """The location in the tier below: the same, with the sealed blob's size."""
    return replace(loc, size=sealed_size(loc.size))
