"""Byte-exact round trips through a real store node: every size, in batches, through both read paths."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
SIZES = [1, 4 * KiB, 128 * KiB, 1 * MiB, 4 * MiB]
ODD = [2, 4095, 4097, 131071, 131073, 1 * MiB - 1, 1 * MiB + 1, 3 * MiB + 12345]


@pytest.mark.parametrize("size", SIZES + ODD)
def test_single_object_round_trip(shared_store: Any, h: Any, rng: random.Random, size: int) -> None:
    c = shared_store.client()
    [key] = h.rand_keys(rng, 1)
    [value] = h.rand_values(rng, [size])
    assert c.put([key], [value]) == [pb.OK]
    assert c.exists([key]).prefix == 1
    [got] = c.get([key])
    assert got is not None and len(got) == size and bytes(got) == value
    # Same object through caller-owned buffers (the sidecar's path).
    buf = bytearray(size)
    assert c.get_into([key], [memoryview(buf)]) == [pb.OK]
    assert bytes(buf) == value


@pytest.mark.parametrize("size,count", [(1, 64), (4 * KiB, 64), (128 * KiB, 16), (1 * MiB, 16), (4 * MiB, 4)])
def test_batch_round_trip(shared_store: Any, h: Any, rng: random.Random, size: int, count: int) -> None:
    c = shared_store.client()
    keys = h.rand_keys(rng, count)
    values = h.rand_values(rng, [size] * count)
    assert c.put(keys, values) == [pb.OK] * count
    ex = c.exists(keys, prefix_only=False)
    assert ex.prefix == count and all(ex.present)
    got = c.get(keys)
    assert [bytes(g) if g is not None else None for g in got] == values
    # numpy destination buffers, read in reverse order (offsets are not assumed to be sequential).
    arrays = [np.zeros(size, dtype=np.uint8) for _ in range(count)]
    assert c.get_into(keys[::-1], arrays) == [pb.OK] * count
    for a, v in zip(arrays, values[::-1], strict=True):
        assert a.tobytes() == v


def test_mixed_sizes_in_one_batch(shared_store: Any, h: Any, rng: random.Random) -> None:
    c = shared_store.client()
    sizes = SIZES + ODD
    rng.shuffle(sizes)
    keys = h.rand_keys(rng, len(sizes))
    values = h.rand_values(rng, sizes)
    assert c.put(keys, values) == [pb.OK] * len(sizes)
    got = c.get(keys)
    assert [bytes(g) if g is not None else None for g in got] == values


def test_duplicate_put_is_a_cheap_no_op_and_keeps_the_first_bytes(shared_store: Any, h: Any,
                                                                   rng: random.Random) -> None:
    c = shared_store.client()
    keys = h.rand_keys(rng, 3)
    first = h.rand_values(rng, [1000, 2000, 3000])
    assert c.put(keys, first) == [pb.OK] * 3
    before = c.stats().counters[StoreCounter.DUPLICATES]
    # Committed objects are immutable: a second put of the same key does not replace them.
    assert c.put(keys, h.rand_values(rng, [1000, 2000, 3000])) == [pb.ALREADY_EXISTS] * 3
    assert c.stats().counters[StoreCounter.DUPLICATES] == before + 3
    assert [bytes(g) if g is not None else None for g in c.get(keys)] == first


def test_prefix_and_presence(shared_store: Any, h: Any, rng: random.Random) -> None:
    c = shared_store.client()
    keys = h.rand_keys(rng, 6)
    stored = [0, 1, 2, 4]
    assert c.put([keys[i] for i in stored], h.rand_values(rng, [100] * 4)) == [pb.OK] * 4
    full = c.exists(keys, prefix_only=False)
    assert full.prefix == 3
    assert full.present == [True, True, True, False, True, False]
    assert c.exists(keys).prefix == 3
    got = c.get(keys)
    assert [g is not None for g in got] == full.present
    codes = c.read(keys, lambda i, size: memoryview(bytearray(size))).codes
    assert codes == [pb.OK, pb.OK, pb.OK, pb.NOT_FOUND, pb.OK, pb.NOT_FOUND]


def test_remove_then_miss(shared_store: Any, h: Any, rng: random.Random) -> None:
    c = shared_store.client()
    keys = h.rand_keys(rng, 4)
    assert c.put(keys, h.rand_values(rng, [5000] * 4)) == [pb.OK] * 4
    assert c.remove(keys[:2]) == [pb.OK, pb.OK]
    assert c.remove(keys[:1]) == [pb.NOT_FOUND]
    assert c.exists(keys, prefix_only=False).present == [False, False, True, True]
    assert c.get(keys[:2]) == [None, None]
    # A removed key can be written again.
    v = h.rand_values(rng, [777])
    assert c.put(keys[:1], v) == [pb.OK]
    assert [bytes(g) for g in c.get(keys[:1]) if g is not None] == v


def test_state_objects_are_a_separate_kind(shared_store: Any, h: Any, rng: random.Random) -> None:
    c = shared_store.client()
    [key] = h.rand_keys(rng, 1)
    block, state = h.rand_values(rng, [4096, 9000])
    assert c.put([key], [block]) == [pb.OK]
    assert c.put([key], [state], kind=pb.STATE) == [pb.OK]
    assert [bytes(g) for g in c.get([key]) if g is not None] == [block]
    assert [bytes(g) for g in c.get([key], kind=pb.STATE) if g is not None] == [state]
