"""The copies of the tier chain's moves (``kvpool.tiers.chain``): what runs without the index
lock, between a mark and its flip, through the Tier protocol only.

A move down reads its source — a zero-copy view of the arena's extent, or ``read_batch`` of the
level it leaves — and writes it with ``write_batch`` (a named level's file is reserved here, on
the chain's one thread, after any earlier unlink of the same key).  A move up reads straight
into its new arena extent.  A sealed level seals and opens inside its own calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.arena.allocator import ExtentAllocator, OutOfSpace
from kvpool.arena.dram import DramTier
from kvpool.arena.extents import Location, ObjectRef
from kvpool.arena.index import ARENA, Entry
from kvpool.core.checksum import checksum
from kvpool.core.errors import Code
from kvpool.tiers.base import Tier

log = logging.getLogger("kvpool.store")

IDLE, DEMOTING, PROMOTING = 0, 1, 2
"""``TieredEntry.moving``: what a planned move is doing to the entry."""


class TieredEntry(Entry):
    """An entry of an arena with levels below it."""

    __slots__ = ("moving", "below", "fs")

    def __init__(self, key: bytes, tenant: str, kind: int, traffic_class: str, size: int) -> None:
        super().__init__(key, tenant, kind, traffic_class, size)
        self.moving = IDLE
        """A move in progress (DEMOTING / PROMOTING)."""
        self.below: Location | None = None
        """Its place in the level it lives at, below the arena (``tier`` > 0)."""
        self.fs: Location | None = None
        """Its file in the named level, when one exists (removed with the object; it stays
        there, immutable, when the object is promoted)."""


@dataclass
class Move:
    """A planned move of one object between two levels (see ``kvpool.tiers.chain``)."""

    entry: TieredEntry
    src: int
    dst: int
    src_loc: Location | None = None
    """Where the object is read from below the arena (taken at the mark: a removal may clear
    the entry's meanwhile)."""
    offset: int = -1
    """Destination extent in the arena (a promotion)."""
    loc: Location | None = None
    """Destination below the arena: reserved at the mark (addressed) or by the copy (named)."""
    reused: bool = False
    """The named level's file was there already (an object promoted from it): nothing written."""
    code: int = Code.OK
    started: float = field(default_factory=time.monotonic)
    guarded: bool = False
    """A named destination whose object was removed meanwhile: already marked removing."""
    done: threading.Event = field(default_factory=threading.Event)


def fits(alloc: ExtentAllocator, sizes: Sequence[int]) -> bool:
    """Whether extents of ``sizes`` could be allocated now (a trial, undone).  Lock held."""
    if alloc.largest_free >= sum(sizes):
        return True
    got: list[int] = []
    try:
        for size in sizes:
            got.append(alloc.alloc(size))
        return True
    except OutOfSpace:
        return False
    finally:
        for off in got:
            alloc.free(off)


def copy_down(m: Move, arena: DramTier, levels: Sequence[Tier], sealed: bool, ref: ObjectRef) -> None:
    """Read the object (a view of the arena, or ``read_batch`` of its level) and write it to
    ``levels[m.dst]`` (``ref``: its name there; ``sealed``: that level is).  No lock held: the
    source is held by the mark (``inflight`` or ``pins``); the outcome is ``m.code``."""
    e = m.entry
    src: memoryview
    if m.src == ARENA:
        src = arena.slice(e.offset, e.size)
    else:
        src = memoryview(bytearray(e.size))
        assert m.src_loc is not None
        m.code = levels[m.src].read_batch([m.src_loc], [src])[0]
        if m.code != Code.OK:
            return
    dst = levels[m.dst]
    if m.loc is None:  # a named level: its file is reserved here, after any earlier unlink of the key
        if e.fs is not None:  # promoted from there: its (immutable) file may still be there
            there = dst.locate([e.fs.ref], sealed)[0]
            if there is not None:
                m.loc, m.reused = there, True
                return
        m.loc = dst.reserve([ref], [e.size])[0]
        if m.loc is None:
            m.code = Code.NO_SPACE
            return
    m.code = dst.write_batch([m.loc], [src])[0]


def read_up(m: Move, arena: DramTier, src: Tier, verify: bool) -> tuple[int, int]:
    """Read a promotion's object from ``src`` into its arena extent: a code and, with ``verify``,
    the checksum of what arrived (else, or unless OK, -1).  No lock held: the extent is the
    move's alone until its flip."""
    dst = arena.slice(m.offset, m.entry.size)
    try:
        code = src.read_batch([m.src_loc], [dst])[0] if m.src_loc is not None else Code.NOT_FOUND
    except Exception as exc:  # noqa: BLE001 - an unreadable copy is a miss, never a crash
        log.warning("promotion read failed: %s", exc)
        return Code.NOT_FOUND, -1
    return code, checksum(dst) if code == Code.OK and verify else -1
