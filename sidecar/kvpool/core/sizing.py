"""How big the memory files of a tier are (pure): what the processes create and what the
operator sizes a pod's memory-backed volume for, so the two cannot disagree.

A DRAM arena holds ``payload`` bytes below its high watermark, so it is larger than the payload;
a sidecar's local tier adds its journal (one slot per allocation unit, ``kvpool.sidecar.journal``)
beside the arena in the same shared-memory volume.  A memory-backed emptyDir smaller than what
lives in it gets the pod evicted (or SIGBUS on a page fault) on a real kubelet.
"""

from __future__ import annotations

ALIGN = 4096
"""Allocation unit of the arenas (bytes)."""
JOURNAL_HEADER_BYTES = 4096
JOURNAL_SLOT_BYTES = 96
"""One journal slot per allocation unit (``kvpool.sidecar.journal.SLOT``: a test checks they agree)."""
LOCAL_HIGH_WATERMARK = 0.95
"""The sidecar local tier's high watermark."""


def payload_arena_bytes(payload: int, high_watermark: float, align: int = ALIGN) -> int:
    """Arena size so that ``payload`` bytes fit below the high watermark."""
    raw = int(payload / high_watermark) + align
    return -(-raw // align) * align


def journal_bytes(arena_bytes: int, align: int = ALIGN) -> int:
    """Size of the journal of an arena of ``arena_bytes``."""
    return JOURNAL_HEADER_BYTES + (arena_bytes // align) * JOURNAL_SLOT_BYTES


def sidecar_shm_bytes(local_bytes: int) -> int:
    """What a sidecar with a local tier of ``local_bytes`` keeps in its shared-memory volume:
    the arena and its journal (the fast session's sockets are files of no size)."""
    arena = payload_arena_bytes(local_bytes, LOCAL_HIGH_WATERMARK)
    return arena + journal_bytes(arena)


def store_shm_bytes(dram_bytes: int, high_watermark: float) -> int:
    """What a store node keeps in its shared-memory volume: its DRAM arena."""
    return payload_arena_bytes(dram_bytes, high_watermark)
