"""Copier.copy_hashed: every copy exact and every checksum that of its copy, on each of its
paths (a small batch on the caller's thread, a big one over two threads, one big object)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.core.checksum import checksum
from kvpool.transfer.copier import PARALLEL_COPY_BYTES, Copier

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize("sizes", [
    [4 * KiB, 100 * KiB + 3, 1],            # under PARALLEL_COPY_BYTES: the caller alone
    [MiB] * 16,                              # over it: two threads, one object each in turn
    [3 * MiB + 7, 5 * KiB, 2 * MiB, 1],      # mixed sizes over two threads
    [PARALLEL_COPY_BYTES + 4097],            # one big object: chunked copy, then its hash
])
def test_copies_are_exact_and_each_checksum_is_its_copys(sizes: list[int]) -> None:
    rng = np.random.default_rng(len(sizes))
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dsts = [np.zeros(n, np.uint8) for n in sizes]
    copier = Copier()
    try:
        sums = copier.copy_hashed([(memoryview(s), memoryview(d)) for s, d in zip(srcs, dsts, strict=True)])
    finally:
        copier.close()
    for s, d, h in zip(srcs, dsts, sums, strict=True):
        assert np.array_equal(s, d)
        assert h == checksum(memoryview(s))


def test_an_empty_batch_has_no_checksums() -> None:
    assert Copier().copy_hashed([]) == []
