"""A put: the rounds of reserve, copy into the arena and commit over the fast session.

A batch larger than the free local tier goes in rounds (:func:`kvpool.core.spill.next_round`):
each round reserves what fits, and the sidecar writes a round that left items out to the pool
before answering its commit, so the next round can evict those clean copies.  One memcpy per
object into the arena (numpy's, big batches over two threads), its checksum hashed right after
its copy (:meth:`Copier.copy_hashed`).
:class:`Reservation` is the put without that copy: the caller writes the objects into the
reserved extents itself (an engine gathering its KV straight into the arena).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.client.arena import ArenaMap
from kvpool.client.keys import pack_keys
from kvpool.client.session import FastSession
from kvpool.core import errors, spill
from kvpool.core.checksum import checksum
from kvpool.core.deadlines import ClientDeadlines
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
    # latter ran at half the speed (16 MiB: 3.8 vs 1.8 ms here); big batches over two threads,
    # each object hashed right after its copy (the hashes overlap the other thread's copies).
    got = copier.copy_hashed([(views[i], arena[offsets[i]:offsets[i] + len(views[i])]) for i in ok])
    for i, h in zip(ok, got, strict=True):
        sums[i] = h
    # A commit the sidecar answers from its local tier is quick; one that waits for the pool
    # (wait=True, or a round that left items out: the sidecar writes it to the pool first).
    if wait_ms or pb.NO_SPACE in reserved:
        bound = pool_bound
    final = fast.write_commit(rid, sums, m.incarnation, wait_ms, timeout=bound)
    for i, c in enumerate(codes):
        if c == pb.OK:
            codes[i] = final[i]
    return reserved, codes


class Reservation:
    """Arena extents reserved for a put, which the caller fills in place, then :meth:`commit`
    (``Client.reserve``): the put's copy into the arena is the caller's own write (an engine
    gathers its KV straight into them).  ``codes``: the reservation's per-item codes; ``views``:
    a writable view of each item reserved (OK), None for the others (ALREADY_EXISTS: present
    already; NO_SPACE / TOO_LARGE: no room in the local tier, put them with ``Client.put``,
    which streams them to the pool; ...).  One commit; a reservation never committed lapses at
    the sidecar's reservation expiry (nothing becomes visible)."""

    def __init__(self, fast: FastSession, m: ArenaMap, codes: list[int], offsets: Sequence[int], sizes: list[int],
                 reservation_id: int, commit_bound: float) -> None:
        self.codes = list(codes)
        self.views: list[memoryview | None] = [m.rw[o:o + s] if c == pb.OK and reservation_id else None
                                               for c, o, s in zip(codes, offsets, sizes, strict=True)]
        self._fast, self._map, self._rid, self._bound = fast, m, reservation_id, commit_bound
        self._done = False

    def commit(self) -> list[int]:
        """Publish the filled items (their checksums hashed here, as ``put`` does): the final
        per-item codes (LEASE_EXPIRED for all when the sidecar restarted meanwhile)."""
        if self._done:
            raise RuntimeError("reservation committed twice")
        self._done = True
        if not self._rid:
            return list(self.codes)
        sums = [checksum(v) if v is not None else 0 for v in self.views]
        final = self._fast.write_commit(self._rid, sums, self._map.incarnation, 0, timeout=self._bound)
        return [f if c == pb.OK else c for c, f in zip(self.codes, final, strict=True)]


def reserve(fast: FastSession, life: Callable[[int], ArenaMap], keys: Sequence[bytes], sizes: Sequence[int],
            traffic_class: str, kind: int, deadlines: ClientDeadlines, timeout: float) -> Reservation:
    """One WRITE_START: the reservation to fill (``life``: the arena mapping of a sidecar life),
    bounded as a put is.  Its commit may write to the pool first when items were left out (the
    sidecar streams a round that did not fit), so it has a put's pool bound then."""
    write_bound, pool_bound = deadlines.write_seconds, min(timeout, deadlines.other_seconds)
    if len(keys) != len(sizes):
        raise errors.InvalidArgument(f"{len(keys)} keys but {len(sizes)} sizes")
    nbytes = [int(s) for s in sizes]
    codes, offsets, rid, inc = fast.write_start(pack_keys(keys), nbytes, kind, traffic_class, timeout=write_bound)
    bound = pool_bound if pb.NO_SPACE in codes else write_bound
    return Reservation(fast, life(inc), codes, offsets, nbytes, rid, bound)

