"""Extent allocator over one preallocated region (a DRAM arena or an SSD slot file).

Pure bookkeeping, no I/O: offsets and lengths in ``align``-byte units.  Best fit over a sorted
list of free extents, with coalescing of neighbours on free, so that mixed object sizes (a
111 KiB MLA block beside a 4 MiB dense block) do not waste a power-of-two slab each.
All methods are O(log n) plus a list insertion; n is the number of free extents.
"""

from __future__ import annotations

import bisect


class OutOfSpace(Exception):
    """No free extent is large enough (the caller evicts, then retries)."""


class ExtentAllocator:
    """Allocate ``[offset, offset + size)`` extents of a region of ``capacity`` bytes."""

    def __init__(self, capacity: int, align: int = 4096) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError("align must be a power of two")
        self.align = align
        self.capacity = (capacity // align) * align
        if self.capacity <= 0:
            raise ValueError(f"capacity {capacity} is smaller than one {align}-byte unit")
        self._by_size: list[tuple[int, int]] = [(self.capacity, 0)]  # sorted (size, offset)
        self._start: dict[int, int] = {0: self.capacity}  # offset -> size of free extent
        self._end: dict[int, int] = {self.capacity: 0}    # end -> offset of free extent
        self._allocated: dict[int, int] = {}               # offset -> size
        self.used = 0

    @classmethod
    def with_allocated(cls, capacity: int, align: int, extents: list[tuple[int, int]]) -> ExtentAllocator:
        """An allocator whose ``extents`` ((offset, size), sorted by offset, aligned, disjoint)
        are allocated and the gaps between them free (an adopted arena's, in one pass)."""
        a = cls(capacity, align)
        a._by_size, a._start, a._end = [], {}, {}
        pos = 0
        for off, size in extents:
            if off % align or off < pos or off + size > a.capacity:
                raise ValueError(f"extent {off}+{size} is not aligned, sorted and inside the region")
            if off > pos:
                a._start[pos], a._end[off] = off - pos, pos
                a._by_size.append((off - pos, pos))
            a._allocated[off] = a.rounded(size)
            a.used += a.rounded(size)
            pos = off + a.rounded(size)
        if pos < a.capacity:
            a._start[pos], a._end[a.capacity] = a.capacity - pos, pos
            a._by_size.append((a.capacity - pos, pos))
        a._by_size.sort()
        return a

    def rounded(self, size: int) -> int:
        return max(self.align, -(-size // self.align) * self.align)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def alloc(self, size: int) -> int:
        """Offset of a new extent of at least ``size`` bytes; raises :class:`OutOfSpace`."""
        if size <= 0:
            raise ValueError("size must be positive")
        need = self.rounded(size)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            raise OutOfSpace(f"no free extent of {need} bytes (largest {self.largest_free})")
        ext_size, off = self._by_size.pop(i)
        del self._start[off]
        del self._end[off + ext_size]
        if ext_size > need:
            self._add_free(off + need, ext_size - need)
        self._allocated[off] = need
        self.used += need
        return off

    def free(self, offset: int) -> None:
        size = self._allocated.pop(offset, None)
        if size is None:
            raise ValueError(f"offset {offset} is not allocated")
        self.used -= size
        # Coalesce with the free neighbours on either side.
        left = self._end.get(offset)
        if left is not None:
            lsize = self._start[left]
            self._remove_free(left, lsize)
            offset, size = left, size + lsize
        right_size = self._start.get(offset + size)
        if right_size is not None:
            self._remove_free(offset + size, right_size)
            size += right_size
        self._add_free(offset, size)

    def size_of(self, offset: int) -> int:
        return self._allocated[offset]

    def _add_free(self, off: int, size: int) -> None:
        bisect.insort(self._by_size, (size, off))
        self._start[off] = size
        self._end[off + size] = off

    def _remove_free(self, off: int, size: int) -> None:
        i = bisect.bisect_left(self._by_size, (size, off))
        assert self._by_size[i] == (size, off)
        self._by_size.pop(i)
        del self._start[off]
        del self._end[off + size]

    def check(self) -> None:
        """Invariants (for tests): free + allocated extents tile the region exactly."""
        spans = sorted([(o, s) for o, s in self._start.items()] + list(self._allocated.items()))
        pos = 0
        for o, s in spans:
            assert o == pos, f"gap or overlap at {pos} (next extent at {o})"
            pos = o + s
        assert pos == self.capacity
        assert sum(self._allocated.values()) == self.used
        assert sorted(self._by_size) == self._by_size
