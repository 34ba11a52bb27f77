"""Transfer requests and the pure planning of how a batch is cut into wire slices.

Slicing is what lets one large request use all K connections of a peer: a request is cut into
page-aligned pieces of at most ``slice_bytes`` that connection workers take from a shared queue.
When a batch is small compared to K × ``slice_bytes`` the pieces shrink (never below
``min_slice``) so every connection still gets a share.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.transfer.protocol import OPS, U64_MAX
from kvpool.transfer.segment import Op, validate_segment_name

PAGE = 4096


# Not frozen (a frozen dataclass pays object.__setattr__ per field, and requests are built per
# object on the hot path); treat instances as immutable all the same.
@dataclass(slots=True, eq=False)
class TransferRequest:
    """One byte move between caller-owned ``local`` memory and a peer's segment.

    ``read`` copies ``remote_segment[remote_offset : remote_offset + length]`` into ``local``;
    ``write`` copies ``local`` there. ``local`` must be a contiguous buffer of exactly ``length``
    bytes (writable for a read) and must stay untouched until the request's status is final.
    ``token`` is passed to the remote segment's guard (the store's lease/generation check).
    After a failed read the contents of ``local`` are undefined; after a failed write, so are
    the remote bytes (the store revokes such a reservation rather than committing it).
    """

    op: Op
    local: memoryview
    remote_segment: str
    remote_offset: int
    length: int
    token: int = 0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be 'read' or 'write', not {self.op!r}")
        view = self.local if isinstance(self.local, memoryview) else memoryview(self.local)
        if not view.c_contiguous:
            raise ValueError("local buffer must be contiguous")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.nbytes != self.length:
            raise ValueError(f"local buffer has {view.nbytes} bytes, request length is {self.length}")
        if self.op == "read" and view.readonly:
            raise ValueError("local buffer of a read must be writable")
        if not 0 <= self.remote_offset <= U64_MAX or self.length < 0:
            raise ValueError("remote_offset/length out of range")
        if not 0 <= self.token <= U64_MAX:
            raise ValueError("token must fit in 64 bits")
        if self.remote_segment not in _VALID_NAMES:
            validate_segment_name(self.remote_segment)
            if len(_VALID_NAMES) < 1024:  # the same few names recur; bounded all the same
                _VALID_NAMES.add(self.remote_segment)
        self.local = view


_VALID_NAMES: set[str] = set()


@dataclass(slots=True)  # not frozen: built per slice, and a frozen __init__ is slower
class SlicePlan:
    """A piece of request ``index``: bytes ``[start, start + length)`` of it."""

    index: int
    start: int
    length: int


def slice_size(total_bytes: int, connections: int, slice_bytes: int, min_slice: int) -> int:
    """The piece size for a batch of ``total_bytes`` over ``connections`` streams."""
    if slice_bytes <= 0 or connections <= 0:
        raise ValueError("slice_bytes and connections must be positive")
    per_connection = -(-total_bytes // connections)
    size = min(slice_bytes, max(min_slice, per_connection))
    return max(PAGE, -(-size // PAGE) * PAGE)


def split(length: int, size: int) -> list[tuple[int, int]]:
    """``(start, length)`` pieces of a request longer than ``size``: equal multiples of a page
    (the last takes the remainder), so no tiny tail costs a whole round trip on its own."""
    pieces = -(-length // size)
    piece = -(-length // pieces)
    piece = -(-piece // PAGE) * PAGE
    return [(start, min(piece, length - start)) for start in range(0, length, piece)]


def plan_slices(lengths: list[int], connections: int, slice_bytes: int, min_slice: int = 64 * 1024) -> list[SlicePlan]:
    """Cut requests of the given lengths into pieces (zero-length requests get none)."""
    size = slice_size(sum(lengths), connections, slice_bytes, min_slice)
    plan: list[SlicePlan] = []
    for index, length in enumerate(lengths):
        if length <= 0:
            continue
        if length <= size:
            plan.append(SlicePlan(index, 0, length))
        else:
            plan.extend(SlicePlan(index, start, n) for start, n in split(length, size))
    return plan
