"""Byte ranges of stored objects (sparse reads): normalisation, validation and layout, no I/O.

A ranged read asks, per key, for a list of ``(offset, length)`` pairs of the object's bytes;
the answer is those bytes back to back, in the order asked (overlaps and any order allowed).
The same rules hold at every hop — client, sidecar, store node — so they live here once:

* a key's ranges are its ``count`` pairs, ``1 <= count <= max_ranges``;
* every length is at least 1 and every range lies inside the object
  (``offset + length <= size``, computed without overflow: offsets and lengths are u64 on the wire,
  so a hostile ``-1`` arrives as 2**64-1 and is simply out of bounds);
* the bytes of one call are bounded: keys are admitted in order while their bytes fit
  ``max_bytes``; a key that does not fit is INVALID (the ones after it may still fit).

A key that breaks a rule is INVALID on its own; the others of the batch are served.  Ranges are
carried as ``(m, 2)`` ``uint64`` arrays (offset, length) with a ``counts`` array saying how many
belong to each key, in key order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpool.core.errors import Code

MAX_RANGES_PER_KEY = 4096
"""Ranges of one key in one call (16 KiB ranges cover a 64 MiB object)."""
MAX_RANGES_PER_FRAME = 1 << 18
"""Ranges of one data-session frame (4 MiB of descriptors): more is a broken or hostile peer,
and the frame is refused as a whole (the node will not read that much to find out)."""
DEFAULT_MAX_BYTES = 256 << 20
"""Bytes one ranged read may move by default (node and sidecar)."""

Pairs = npt.NDArray[np.uint64]
_U64 = np.dtype("<u8")
_EMPTY = np.zeros((0, 2), _U64)


def normalize(ranges: Any) -> tuple[Pairs, str]:
    """Caller input (a sequence of ``(offset, length)`` or an ``(m, 2)`` array) as a ``uint64``
    array, and why it is invalid ("" when it is not): negative numbers, non-integers and a wrong
    shape are refused here, before anything is sent."""
    try:
        arr = np.asarray(ranges)
    except (TypeError, ValueError) as exc:
        return _EMPTY, f"ranges are not (offset, length) pairs: {exc}"
    if arr.size == 0:
        return _EMPTY, "no ranges"
    if arr.ndim != 2 or arr.shape[1] != 2:
        return _EMPTY, f"ranges must be (offset, length) pairs, got shape {arr.shape}"
    if arr.dtype.kind not in "iu":
        return _EMPTY, f"range offsets and lengths must be integers, got {arr.dtype}"
    if arr.dtype.kind == "i" and (arr < 0).any():
        return _EMPTY, "negative range offset or length"
    if arr.dtype.kind == "u" and arr.dtype.itemsize > 8:
        return _EMPTY, "range values wider than 64 bits"
    return np.ascontiguousarray(arr, _U64), ""


def check(pairs: Pairs, size: int, max_ranges: int = MAX_RANGES_PER_KEY) -> str:
    """Why the ranges of one object of ``size`` bytes cannot be served ("" when they can)."""
    m = len(pairs)
    if m == 0:
        return "no ranges"
    if m > max_ranges:
        return f"{m} ranges for one key (at most {max_ranges})"
    off, ln = pairs[:, 0], pairs[:, 1]
    if (ln == 0).any():
        return "zero-length range"
    # size - min(off, size) never wraps, so the comparison cannot overflow either.
    bad = (off > size) | (ln > np.uint64(size) - np.minimum(off, np.uint64(size)))
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        return f"range {j} ({int(off[j])}, {int(ln[j])}) is outside the {size}-byte object"
    return ""


def total_bytes(pairs: Pairs) -> int:
    return int(pairs[:, 1].sum(dtype=np.uint64)) if len(pairs) else 0


def starts(pairs: Pairs) -> npt.NDArray[np.int64]:
    """Where each range begins in the back-to-back answer of its key."""
    out = np.zeros(len(pairs), np.int64)
    if len(pairs) > 1:
        np.cumsum(pairs[:-1, 1].astype(np.int64), out=out[1:])
    return out


def bounds(counts: Sequence[int] | npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    """Index of each key's first range (and one past the last) in the flat pairs array."""
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(np.asarray(counts, np.int64), out=out[1:])
    return out


def split(counts: Sequence[int] | npt.NDArray[Any], pairs: Pairs) -> list[Pairs]:
    """The flat pairs array cut into each key's ranges (views, no copy)."""
    b = bounds(counts)
    if int(b[-1]) != len(pairs):
        raise ValueError(f"counts name {int(b[-1])} ranges, {len(pairs)} given")
    return [pairs[b[i]:b[i + 1]] for i in range(len(counts))]


_COALESCE_LIMIT = 1 << 40
"""Ranges with offsets or lengths past this are never merged (sums of them could wrap u64); the
node refuses them anyway (no object is that large)."""


def coalesce(pairs: Pairs) -> tuple[Pairs, npt.NDArray[np.intp]]:
    """Runs of abutting ranges (each starting where the one before it ends) as one range, and
    the index of the merged range each input range fell into.  The back-to-back bytes are the
    same, so a buffer laid out for the input serves the merged ranges unchanged; a top-k of
    neighbouring entries then costs one range (one iovec, one checksum) instead of many.  The
    per-key range limit then counts merged ranges."""
    m = len(pairs)
    # A zero length is left for the node to refuse (merged away it would be served), and so
    # are values that could wrap.
    if m <= 1 or (pairs > _COALESCE_LIMIT).any() or (pairs[:, 1] == 0).any():
        return pairs, np.arange(m, dtype=np.intp)
    off, ln = pairs[:, 0], pairs[:, 1]
    brk = np.ones(m, dtype=bool)
    brk[1:] = off[1:] != off[:-1] + ln[:-1]
    if brk.all():
        return pairs, np.arange(m, dtype=np.intp)
    first = np.flatnonzero(brk)
    merged = np.empty((len(first), 2), _U64)
    merged[:, 0] = off[first]
    merged[:, 1] = np.add.reduceat(ln, first)
    return merged, np.cumsum(brk, dtype=np.intp) - 1


def plan(codes: Sequence[Code], sizes: Sequence[int], per_key: Sequence[Pairs],
         max_ranges: int = MAX_RANGES_PER_KEY, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Code]:
    """Per-key codes of a ranged read: the lookup's code where it failed (NOT_FOUND, ...), else
    INVALID for ranges that break a rule or do not fit the byte budget, else OK."""
    out = list(codes)
    left = max_bytes
    for i, (code, size, pairs) in enumerate(zip(codes, sizes, per_key, strict=True)):
        if code != Code.OK:
            continue
        if check(pairs, size, max_ranges):
            out[i] = Code.INVALID
            continue
        need = total_bytes(pairs)
        if need > left:
            out[i] = Code.INVALID
            continue
        left -= need
    return out


def encode(per_key: Sequence[Pairs]) -> tuple[npt.NDArray[np.uint32], bytes]:
    """Counts (u32 per key) and the packed little-endian (offset, length) pairs."""
    counts = np.fromiter((len(p) for p in per_key), np.uint32, len(per_key))
    blob = b"".join(np.ascontiguousarray(p, _U64).tobytes() for p in per_key if len(p))
    return counts, blob


def decode(counts: Sequence[int] | npt.NDArray[Any], blob: bytes | bytearray | memoryview) -> Pairs:
    """The flat ``(m, 2)`` pairs of a packed blob whose length must match ``counts``."""
    m = int(np.asarray(counts, np.int64).sum()) if len(counts) else 0
    if len(blob) != 16 * m:
        raise ValueError(f"{len(blob)} bytes of ranges for {m} ranges")
    return np.frombuffer(blob, _U64, 2 * m).reshape(m, 2)
