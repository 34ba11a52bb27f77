"""Where an object lives in a tier (:class:`Location`), and the bookkeeping that lets an
addressed tier — the DRAM arena, the SSD slot file — refuse a stale location instead of
reading whatever now occupies its extent (:class:`ExtentTable`).

The types are the currency of the Tier interface (``kvpool.tiers.base.Tier``); they sit in the
arena layer because the DRAM arena implements that interface and may not import upwards.
No I/O here: the tiers do the copies (:class:`ExtentTier` decides per item whether a copy may
happen and whether what was read is what was written).
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.arena.allocator import ExtentAllocator, OutOfSpace
from kvpool.core.checksum import checksum
from kvpool.core.errors import Code


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """What an object is, wherever it lives."""

    tenant: str
    key: bytes
    kind: int = 0
    salt: bytes = b""
    """Key of the object's shared-filesystem file name (the store node's per-tenant salt, which
    mixes in the tenant id: two tenants must never name the same file)."""


@dataclass(frozen=True, slots=True)
class Location:
    """One object in one tier: returned by ``Tier.reserve`` or ``Tier.locate``, given back to
    ``write_batch``, ``read_batch`` and ``free``.  A value: holding one keeps nothing alive."""

    ref: ObjectRef
    size: int
    """Bytes a write stores and a read returns here (sealed tiers: the plaintext's, above the
    wrapper; the blob's, in the tier below it)."""
    offset: int = -1
    """Extent of an addressed tier (DRAM, SSD); -1 in a named tier (shared fs) or when empty."""
    serial: int = 0
    """The reservation this location is, in an addressed tier: a location freed (or of another
    tier, or of the tier's previous life) names no live serial and reads NOT_FOUND."""
    sealed: bool = False
    """The object is sealed (``kvpool.tiers.sealed``): its tag vouches for it (a shared-fs file
    carries the sealed header, with no checksum of the blob)."""
    generation: int = 0
    """The generation a sealed object was sealed under (part of its associated data)."""


class _Slot:
    __slots__ = ("ref", "offset", "size", "checksum")

    def __init__(self, ref: ObjectRef, offset: int, size: int) -> None:
        self.ref = ref
        self.offset = offset
        self.size = size
        self.checksum = -1  # -1: reserved, never written (XXH3-64 values are >= 0)


class ExtentTable:
    """The live objects of one addressed tier: reservation serial → object, extent, size and
    checksum.  A location must name all of them to be read: a forged or stale one is NOT_FOUND.

    Serials start at a random base per table, so a location of a previous life (or of another
    tier) matches nothing here.  Thread-safe: one lock, held for the dict and the allocator
    only, never for a copy.  ``alloc`` returns the tier's allocator (read on each use: an
    adopted arena replaces it).
    """

    def __init__(self, alloc: Callable[[], ExtentAllocator]) -> None:
        self._alloc = alloc
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._serials = itertools.count(1 + secrets.randbits(62))

    def reserve(self, refs: Sequence[ObjectRef], sizes: Sequence[int]) -> list[Location | None]:
        """An extent for each object that fits (None: no room, NO_SPACE); empty objects take
        none.  Nothing is copied: cheap enough to call under an index lock."""
        out: list[Location | None] = []
        with self._lock:
            alloc = self._alloc()
            for ref, size in zip(refs, sizes, strict=True):
                if size < 0:
                    raise ValueError(f"object size {size} is negative")
                offset = -1
                if size:
                    if alloc.rounded(size) > alloc.capacity:
                        out.append(None)
                        continue
                    try:
                        offset = alloc.alloc(size)
                    except OutOfSpace:
                        out.append(None)
                        continue
                serial = next(self._serials)
                self._slots[serial] = _Slot(ref, offset, size)
                out.append(Location(ref, size, offset, serial))
        return out

    def free(self, locs: Sequence[Location]) -> None:
        """Release the extents of ``locs``; a location not live (freed already, never
        reserved here) is ignored."""
        with self._lock:
            alloc = self._alloc()
            for loc in locs:
                slot = self._slots.get(loc.serial)
                if slot is None or slot.offset != loc.offset:
                    continue
                del self._slots[loc.serial]
                if slot.offset >= 0:
                    alloc.free(slot.offset)

    def _live(self, loc: Location, n: int) -> tuple[Code, _Slot | None]:
        slot = self._slots.get(loc.serial)
        if slot is None or slot.offset != loc.offset or slot.ref != loc.ref:
            return Code.NOT_FOUND, None
        if n != slot.size or loc.size != slot.size:
            return Code.INVALID, None
        return Code.OK, slot

    def may_write(self, loc: Location, n: int) -> Code:
        """Whether ``n`` bytes may be written at ``loc`` (OK, NOT_FOUND, INVALID size)."""
        with self._lock:
            return self._live(loc, n)[0]

    def written(self, loc: Location, csum: int) -> Code:
        """Record what was written at ``loc``; NOT_FOUND when it was freed during the write."""
        with self._lock:
            code, slot = self._live(loc, loc.size)
            if slot is not None:
                slot.checksum = csum
            return code

    def expected(self, loc: Location, n: int) -> tuple[Code, int]:
        """Whether ``n`` bytes may be read from ``loc``, and the checksum they must have."""
        with self._lock:
            code, slot = self._live(loc, n)
            if slot is not None and slot.checksum < 0:
                return Code.NOT_FOUND, -1  # reserved, never written
            return code, slot.checksum if slot is not None else -1

    def still(self, loc: Location, csum: int) -> bool:
        """Whether ``loc`` still holds what it held when ``expected`` said ``csum``."""
        with self._lock:
            slot = self._slots.get(loc.serial)
            return slot is not None and slot.offset == loc.offset and slot.checksum == csum


def zero(dst: memoryview) -> None:
    """Clear a caller's buffer after a failed read: it never holds bytes of another object."""
    if len(dst):
        dst[:] = bytes(len(dst))


class ExtentTier:
    """The Tier calls of a tier carved into extents by :attr:`alloc` (the DRAM arena, the SSD
    slot file): a subclass gives the copies, :meth:`_put` and :meth:`_get`, and calls
    :meth:`_init_table` once its allocator exists.  Its objects are known by location only: it
    starts empty, and ``locate`` finds nothing."""

    alloc: ExtentAllocator
    _table: ExtentTable
    named = False

    def _init_table(self) -> None:
        self._table = ExtentTable(lambda: self.alloc)

    def _put(self, offset: int, src: memoryview) -> None:
        raise NotImplementedError

    def _get(self, offset: int, dst: memoryview) -> None:
        raise NotImplementedError

    @property
    def used(self) -> int:
        return self.alloc.used

    def reserve(self, refs: Sequence[ObjectRef], sizes: Sequence[int]) -> list[Location | None]:
        return self._table.reserve(refs, sizes)

    def locate(self, refs: Sequence[ObjectRef], sealed: bool = False) -> list[Location | None]:
        return [None] * len(refs)

    def free(self, locs: Sequence[Location]) -> None:
        self._table.free(locs)

    def write_batch(self, locs: Sequence[Location], srcs: Sequence[memoryview]) -> list[Code]:
        """Copy each of ``srcs`` to its location and record its checksum; per-item codes: OK,
        NOT_FOUND (not reserved, or freed), INVALID (not the reserved size), UNAVAILABLE (the
        copy failed: an I/O error)."""
        codes: list[Code] = []
        for loc, src in zip(locs, srcs, strict=True):
            code = self._table.may_write(loc, len(src))
            if code == Code.OK:
                try:
                    if len(src):
                        self._put(loc.offset, src)
                except OSError:
                    code = Code.UNAVAILABLE
                else:
                    code = self._table.written(loc, checksum(src))
            codes.append(code)
        return codes

    def read_batch(self, locs: Sequence[Location], dsts: Sequence[memoryview]) -> list[Code]:
        """Copy each location into its caller buffer (exactly its size) and verify it; per-item
        codes: OK, NOT_FOUND (never written, freed — also while it was read), INVALID (buffer
        size), CHECKSUM (not what was written: a damaged medium), UNAVAILABLE (I/O error).  On
        any code but OK the buffer is zeroed."""
        codes: list[Code] = []
        for loc, dst in zip(locs, dsts, strict=True):
            code, want = self._table.expected(loc, len(dst))
            if code == Code.OK:
                try:
                    if len(dst):
                        self._get(loc.offset, dst)
                except OSError:
                    code = Code.UNAVAILABLE
                else:
                    if not self._table.still(loc, want):
                        code = Code.NOT_FOUND  # freed (and maybe reused) while it was read
                    elif checksum(dst) != want:
                        code = Code.CHECKSUM
            if code != Code.OK:
                zero(dst)
            codes.append(code)
        return codes
