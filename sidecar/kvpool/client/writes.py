"""A put: the rounds of reserve, copy into the arena and commit over the fast session.

A batch larger than the free local tier goes in rounds (:func:`kvpool.core.spill.next_round`):
each round reserves what fits, and the sidecar writes a round that left items out to the pool
before answering its commit, so the next round can evict those clean copies.  One memcpy per
object into the arena (numpy's, big batches over two threads), its checksum hashed beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.client.arena import ArenaMap
from kvpool.client.keys import pack_keys
from kvpool.client.session import FastSession
from kvpool.core import spill
from kvpool.core.checksum import checksum
from kvpool.transfer.copier import Copier
from kvpool.wire.proto import store_pb2 as pb


def put_rounds(fast: FastSession, life: Callable[[int], ArenaMap], copier: Copier, keys: Sequence[bytes],
               views: list[memoryview], traffic_class: str, kind: int, wait_ms: int, pool_behind: bool,
               write_bound: float, pool_bound: float) -> list[int]:
    """Per-item codes of a put in rounds (``life``: the arena mapping of a sidecar life, moving
    to it; ``pool_behind``: the sidecar has a pool to stream what does not fit to; the bounds:
    of a round, and of a commit that waits for the pool)."""
    start, codes = _put_round(fast, life, copier, keys, views, traffic_class, kind, wait_ms, write_bound, pool_bound)
    todo = spill.next_round(range(len(keys)), start) if pool_behind and pb.NO_SPACE in start else []
    while todo:
        start, got = _put_round(fast, life, copier, [keys[i] for i in todo], [views[i] for i in todo],
                                traffic_class, kind, wait_ms, write_bound, pool_bound)
        for i, c in zip(todo, got, strict=True):
            codes[i] = c
        todo = spill.next_round(todo, start)
    return codes


def _put_round(fast: FastSession, life: Callable[[int], ArenaMap], copier: Copier, keys: Sequence[bytes],
               views: list[memoryview], traffic_class: str, kind: int, wait_ms: int, write_bound: float,
               pool_bound: float) -> tuple[list[int], list[int]]:
    """One WRITE_START, copy and WRITE_COMMIT: the reservation's codes and the final codes
    (with ``wait_ms``: the pool's)."""
    blob, sizes = pack_keys(keys), [len(v) for v in views]
    bound = write_bound
    codes, offsets, rid, inc = fast.write_start(blob, sizes, kind, traffic_class, timeout=bound)
    m = life(inc)
    reserved = list(codes)
    if not rid:
        return reserved, codes
    sums = [0] * len(keys)
    arena = m.rw
    ok = [i for i, c in enumerate(codes) if c == pb.OK]
    # numpy's copy, not a memoryview slice assignment: into fresh (cold) arena extents the
    # latter ran at half the speed (16 MiB: 3.8 vs 1.8 ms here); big batches over two threads.
    copier.copy([(views[i], arena[offsets[i]:offsets[i] + len(views[i])]) for i in ok])
    for i in ok:
        sums[i] = checksum(views[i])
    # A commit the sidecar answers from its local tier is quick; one that waits for the pool
    # (wait=True, or a round that left items out: the sidecar writes it to the pool first).
    if wait_ms or pb.NO_SPACE in reserved:
        bound = pool_bound
    final = fast.write_commit(rid, sums, m.incarnation, wait_ms, timeout=bound)
    for i, c in enumerate(codes):
        if c == pb.OK:
            codes[i] = final[i]
    return reserved, codes
