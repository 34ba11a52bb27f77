"""What goes where when a batch does not fit the sidecar's local tier (pure: no I/O).

Two callers.  A read whose objects the arena has no room for (every extent pinned by views the
engine still holds, or an object larger than the tier) gets NO_SPACE rows with their sizes; the
client reads those objects into one region of its own memory, laid out by :func:`layout`.  A put
batch larger than the free local tier goes in rounds: each round reserves what fits, and a round
that left items out is written to the pool before it returns (its objects are then clean copies
the next round may evict); :func:`next_round` says what the next round asks for, and when to stop.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.core.errors import Code

ALIGN = 64
"""Start of each object in a spill region: cache-line aligned, so views of it copy at full speed."""


def layout(sizes: Sequence[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Offsets of objects of ``sizes`` packed back to back (each start aligned) and the bytes of
    the region that holds them (at least 1: a region is never empty)."""
    if align <= 0 or align & (align - 1):
        raise ValueError("align must be a positive power of two")
    offsets: list[int] = []
    at = 0
    for s in sizes:
        if s < 0:
            raise ValueError("negative object size")
        offsets.append(at)
        at = (at + s + align - 1) & ~(align - 1)
    return offsets, max(at, 1)


def next_round(asked: Sequence[int], codes: Sequence[int]) -> list[int]:
    """The items of a put batch to ask for in the next round: those of ``asked`` (batch indices)
    whose round codes (``codes[j]`` for ``asked[j]``) were NO_SPACE — none when the round
    reserved nothing (nothing was freed for the next one: the tier is pinned full, the answer
    stands)."""
    if len(asked) != len(codes):
        raise ValueError(f"{len(codes)} codes for {len(asked)} items")
    if not any(c == Code.OK for c in codes):
        return []
    return [i for i, c in zip(asked, codes, strict=True) if c == Code.NO_SPACE]
