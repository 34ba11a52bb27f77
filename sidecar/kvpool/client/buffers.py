"""Registered memory: the client's own regions the sidecar may map and move bytes into or out of.

``Client.alloc_buffer`` hands out memory the sidecar can write into (``get_into`` of buffers inside
it lands the pool's bytes there directly, as Mooncake's registered buffers do) and read from
(a put's objects the local tier has no room for go to the pool straight from it).  Each region is
a sealed memfd (:mod:`kvpool.transfer.memfd`) the sidecar maps when a call first names it; a call
names a buffer by (region id, offset, length).  One-call regions (a spill of a read, a put's copy)
are made here too, with ids of the same sequence.  Thread-safe.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.client.keys import pack_keys
from kvpool.client.session import FastSession, RegistrationRefused
from kvpool.core import errors, spill
from kvpool.core.buffers import Buffer, as_bytes_view
from kvpool.core.checksum import checksum
from kvpool.core.deadlines import ClientDeadlines
from kvpool.transfer import memfd
from kvpool.transfer.copier import Copier
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger("kvpool.client.buffers")


class Regions:
    """The client's registered regions, by id, and the ones the sidecar refused to map."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[int, memfd.Region] = {}
        self._starts: list[tuple[int, int]] = []  # (address, region id), sorted
        self._ids = itertools.count(1)
        self._refused: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self._regions)

    def alloc(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` (zero-filled, its pages populated) in a new region."""
        region = memfd.create(nbytes, "kvpool-client-buffer")
        with self._lock:
            rid = next(self._ids)
            self._regions[rid] = region
            self._starts = sorted(self._starts + [(region.address, rid)])
        return np.frombuffer(region.mapping, np.uint8)

    def free(self, buffer: Buffer) -> int:
        """Close the region of ``buffer`` (arrays of it still alive keep it mapped); its id."""
        extent = memfd.writable_extent(buffer)
        rid = self.region_of(*extent) if extent is not None else None
        if rid is None:
            raise errors.InvalidArgument("not a buffer from alloc_buffer of this client")
        with self._lock:
            region = self._regions.pop(rid)
            self._starts = [(a, r) for a, r in self._starts if r != rid]
            self._refused.discard(rid)
        region.close()
        return rid

    def transient(self, nbytes: int, name: str) -> tuple[int, memfd.Region]:
        """A region for one call (the caller closes it), with an id no registered region has."""
        return next(self._ids), memfd.create(nbytes, name)

    def refused(self, region_id: int) -> None:
        """The sidecar would not map this region: calls go through the arena for it from now on."""
        with self._lock:
            self._refused.add(region_id)

    def is_registered(self, buffer: Buffer) -> bool:
        extent = memfd.writable_extent(buffer)
        rid = self.region_of(*extent) if extent is not None else None
        return rid is not None and rid not in self._refused

    def snapshot(self) -> dict[int, memfd.Region]:
        """The registered regions by id, as they are now (for a call that may map them)."""
        with self._lock:
            return dict(self._regions)

    def region_of(self, addr: int, nbytes: int) -> int | None:
        """The id of the registered region that holds all of ``nbytes`` at ``addr``, or None."""
        if nbytes == 0:
            return None
        starts = self._starts
        at = bisect.bisect_right(starts, (addr, 1 << 62)) - 1
        if at < 0:
            return None
        base, rid = starts[at]
        region = self._regions.get(rid)
        if region is None or addr + nbytes > base + region.size:
            return None
        return rid

    def spans(self, buffers: Sequence[Buffer]) -> np.ndarray | None:
        """READ_INTO / WRITE_FROM targets (region ids, offsets, lengths: u64 × n each) when every
        buffer lies inside registered memory the sidecar has not refused; None otherwise.  About
        a microsecond a buffer (the read of 16 objects spent ~70 us here when it built two views
        of each)."""
        n = len(buffers)
        ids, offsets, lengths = [0] * n, [0] * n, [0] * n
        regions = self._regions
        for i, b in enumerate(buffers):
            extent = memfd.writable_extent(b)
            if extent is None:
                return None
            addr, nbytes = extent
            rid = self.region_of(addr, nbytes)
            if rid is None or rid in self._refused:
                return None
            ids[i], offsets[i], lengths[i] = rid, addr - regions[rid].address, nbytes
        return np.array(ids + offsets + lengths, np.uint64)

    def close(self) -> None:
        with self._lock:
            regions, self._regions, self._starts = list(self._regions.values()), {}, []
        for region in regions:
            region.close()


# -- the calls that move bytes through the client's own memory ----------------------------------

def read_spilled(fast: FastSession, regions: Regions, keys: Sequence[bytes], codes: list[int], r: Any,
                 ro: memoryview, kind: int, deadlines: ClientDeadlines) -> list[memoryview | None]:
    """Views of a READ's objects: in the arena where it answered OK; its NO_SPACE rows (in
    the pool, no room in the arena) read now into one region of this client's memory, made
    for that read (:func:`kvpool.core.spill.layout`) — ``codes`` is updated in place.  ``ro``: the
    arena of the sidecar life that answered the READ."""
    views: list[memoryview | None] = [ro[o:o + s] if c == pb.OK else None
                                      for c, o, s in zip(codes, r.offsets, r.sizes, strict=True)]
    spill_at = [i for i, c in enumerate(codes) if c == pb.NO_SPACE]
    if not spill_at:
        return views
    sizes = [int(r.sizes[i]) for i in spill_at]
    offsets, total = spill.layout(sizes)
    rid, region = regions.transient(total, "kvpool-spill")
    n = len(spill_at)
    targets = np.array([rid] * n + offsets + sizes, np.uint64)
    try:
        got, got_sizes = fast.read_into(pack_keys([keys[i] for i in spill_at]), kind, targets, {rid: region},
                                        transient=True, timeout=deadlines.read_bound(total))
    except (RegistrationRefused, errors.Unavailable) as exc:
        log.warning("kvpool: %d objects with no room in the local tier not read: %s", n, exc)
        region.close()
        return views
    finally:
        if region.fd is not None:
            os.close(region.fd)  # the sidecar has unmapped it: the views keep the mapping
            region.fd = None
    mem = memoryview(region.mapping).toreadonly()
    for j, i in enumerate(spill_at):
        codes[i] = got[j]
        if got[j] == pb.OK:
            views[i] = mem[offsets[j]:offsets[j] + got_sizes[j]]
    return views


def read_into_registered(fast: FastSession, regions: Regions, keys: Sequence[bytes], buffers: Sequence[Buffer],
                         spans: np.ndarray, match_lease: int, deadlines: ClientDeadlines) -> list[int]:
    """``get_into`` of buffers that all lie in registered memory (``spans``: their targets):
    the sidecar lands the pool's bytes there directly; per-item sizes, -1 where absent."""
    n = len(keys)
    codes, sizes = fast.read_into(pack_keys(keys), pb.BLOCK, spans, regions.snapshot(), match_lease,
                                  timeout=deadlines.read_bound(int(spans[2 * n:].sum())))
    out = []
    for i, (c, size) in enumerate(zip(codes, sizes, strict=True)):
        if c == pb.INVALID:
            raise errors.InvalidArgument(f"buffer of {as_bytes_view(buffers[i]).nbytes} bytes for an object "
                                         f"of {size}")
        out.append(size if c == pb.OK else -1)
    return out


def write_from_memory(fast: FastSession, regions: Regions, copier: Copier, keys: Sequence[bytes],
                      values: Sequence[Buffer], views: list[memoryview], codes: list[int], traffic_class: str,
                      kind: int) -> None:
    """The objects of a put the local tier could not take (NO_SPACE: every extent pinned;
    TOO_LARGE: larger than the tier) go to the pool straight from this client's memory
    (WRITE_FROM): from the caller's own buffers when they lie in registered memory
    (no copy), else from a region made for this call; their codes become the pool's."""
    left = [i for i, c in enumerate(codes) if c in (pb.NO_SPACE, pb.TOO_LARGE)]
    sizes = [len(views[i]) for i in left]
    n = len(left)
    spans = regions.spans([values[i] for i in left]) if regions else None
    region: memfd.Region | None = None
    if spans is not None:
        targets = regions.snapshot()
    else:
        offsets, total = spill.layout(sizes)
        rid, region = regions.transient(total, "kvpool-put")
        copier.copy([(views[i], region.view[o:o + s]) for i, o, s in zip(left, offsets, sizes, strict=True)])
        spans = np.array([rid] * n + offsets + sizes, np.uint64)
        targets = {rid: region}
    try:
        got = fast.write_from(pack_keys([keys[i] for i in left]), kind, traffic_class, spans,
                              [checksum(views[i]) for i in left], targets, transient=region is not None)
    except (RegistrationRefused, errors.Unavailable) as exc:
        log.warning("kvpool: %d objects with no room in the local tier not written to the pool: %s", n, exc)
        return
    finally:
        if region is not None:
            region.close()
    for i, c in zip(left, got, strict=True):
        codes[i] = c
