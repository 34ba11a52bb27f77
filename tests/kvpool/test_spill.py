"""The pure decisions of kvpool.core.spill: a read's overflow layout, a put batch's next round."""

from __future__ import annotations

import pytest

from kvpool.core import spill
from kvpool.wire.proto import store_pb2 as pb

OK, NO_SPACE, EXISTS, LARGE = pb.OK, pb.NO_SPACE, pb.ALREADY_EXISTS, pb.TOO_LARGE


def test_layout_packs_aligned_and_never_overlaps() -> None:
    offsets, total = spill.layout([100, 64, 1, 4096])
    assert offsets == [0, 128, 192, 256] and total == 256 + 4096
    for (a, sa), b in zip(zip(offsets, [100, 64, 1, 4096], strict=True), offsets[1:] + [total], strict=True):
        assert a % spill.ALIGN == 0 and a + sa <= b


def test_layout_edges() -> None:
    assert spill.layout([]) == ([], 1)  # a region is never empty
    assert spill.layout([0, 0]) == ([0, 0], 1)
    assert spill.layout([3, 5], align=1) == ([0, 3], 8)
    with pytest.raises(ValueError):
        spill.layout([1], align=48)
    with pytest.raises(ValueError):
        spill.layout([-1])


def test_next_round_asks_again_only_what_had_no_room() -> None:
    # Items 0..5 of a batch; this round asked 1, 2, 4, 5: 1 reserved, 2 and 5 had no room, 4 exists.
    assert spill.next_round([1, 2, 4, 5], [OK, NO_SPACE, EXISTS, NO_SPACE]) == [2, 5]
    assert spill.next_round(range(3), [OK, OK, OK]) == []
    # TOO_LARGE never fits: not asked again.
    assert spill.next_round([0, 1], [OK, LARGE]) == []


def test_next_round_stops_when_a_round_reserved_nothing() -> None:
    # Nothing reserved: nothing was freed for another round (the tier is pinned full).
    assert spill.next_round([3, 4], [NO_SPACE, NO_SPACE]) == []
    assert spill.next_round([3, 4], [EXISTS, NO_SPACE]) == []
    with pytest.raises(ValueError):
        spill.next_round([1, 2], [OK])


def test_stash_is_bounded_and_hands_each_object_out_once() -> None:
    from kvpool.sidecar.landing import SpillStash

    stash = SpillStash(max_bytes=100, ttl=60.0)
    a = stash.reserve(60)
    assert a is not None and stash.reserve(50) is None  # over the budget while a is promised
    a[:] = 7
    stash.put(pb.BLOCK, b"k" * 32, a)
    assert stash.take(pb.STATE, b"k" * 32) is None  # another kind, another object
    got = stash.take(pb.BLOCK, b"k" * 32)
    assert got is not None and bytes(got) == b"\x07" * 60
    assert stash.take(pb.BLOCK, b"k" * 32) is None and stash.bytes == 0
    b = stash.reserve(100)
    assert b is not None
    stash.drop(b)  # its object did not arrive
    assert stash.bytes == 0


def test_stash_drops_what_nobody_takes() -> None:
    from kvpool.sidecar.landing import SpillStash

    stash = SpillStash(max_bytes=100, ttl=0.0)
    buf = stash.reserve(80)
    assert buf is not None
    stash.put(pb.BLOCK, b"k" * 32, buf)
    assert stash.reserve(80) is not None  # the expired one made room
    assert len(stash) == 0
