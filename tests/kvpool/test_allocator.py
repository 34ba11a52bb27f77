"""Extent allocator: tiling invariants under random workloads, coalescing, errors."""

import random

import pytest

from kvpool.arena.allocator import ExtentAllocator, OutOfSpace


def test_alloc_free_coalesce() -> None:
    a = ExtentAllocator(16 * 4096)
    offs = [a.alloc(4096) for _ in range(16)]
    assert sorted(offs) == [i * 4096 for i in range(16)]
    with pytest.raises(OutOfSpace):
        a.alloc(1)
    for o in offs[::2]:
        a.free(o)
    with pytest.raises(OutOfSpace):
        a.alloc(8192)  # fragmented: no two adjacent free units
    for o in offs[1::2]:
        a.free(o)
    a.check()
    assert a.alloc(16 * 4096) == 0  # fully coalesced


def test_rounding_and_best_fit() -> None:
    a = ExtentAllocator(1 << 20)
    x = a.alloc(100)
    assert a.size_of(x) == 4096
    big = a.alloc(300_000)
    small = a.alloc(4096)
    a.free(x)  # a 4 KiB hole at 0
    a.free(big)  # a large hole
    assert a.alloc(4000) == x  # best fit takes the small hole
    a.free(small)
    a.check()


def test_random_workload_invariants() -> None:
    rng = random.Random(7)
    a = ExtentAllocator(64 << 20)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and (rng.random() < 0.45 or a.free_bytes < 8 << 20):
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            size = rng.choice([1, 4096, 111 * 1024, 128 * 1024, 1 << 20, 4 << 20]) + rng.randrange(0, 1000)
            try:
                off = a.alloc(size)
            except OutOfSpace:
                continue
            # No overlap with any live extent.
            for o in live:
                assert off + a.size_of(off) <= o or o + a.size_of(o) <= off
            live[off] = size
    a.check()
    assert a.used == sum(a.size_of(o) for o in live)


def test_errors() -> None:
    a = ExtentAllocator(8192)
    with pytest.raises(ValueError):
        a.free(0)
    with pytest.raises(ValueError):
        a.alloc(0)
    with pytest.raises(ValueError):
        ExtentAllocator(100)
    with pytest.raises(ValueError):
        ExtentAllocator(8192, align=3000)
