"""Batch order of a put's parts (kvpool.core.put_order) and its order tickets: no I/O."""

from __future__ import annotations

import threading
import time

import pytest

from kvpool.core.put_order import PutOrder
from kvpool.wire import store_frames as dp


def test_tickets_round_trip_and_nonsense_is_unordered() -> None:
    for batch, part, parts in ((1, 0, 2), ((1 << 48) - 1, 6, 7), (12345, 254, 255)):
        assert dp.split_ticket(dp.order_ticket(batch, part, parts)) == (batch, part, parts)
    assert dp.split_ticket(0) is None
    assert dp.split_ticket(5 << 16 | 2 << 8 | 2) is None  # part past the count
    assert dp.split_ticket(2 << 8 | 1) is None  # no batch
    for bad in ((0, 0, 2), (1 << 48, 0, 2), (1, 2, 2), (1, 0, 256)):
        with pytest.raises(ValueError):
            dp.order_ticket(*bad)


def test_part_k_waits_for_every_earlier_part() -> None:
    order = PutOrder(wait_seconds=5)
    got: list[str] = []

    def part(k: int) -> None:
        assert order.wait_turn("t", 9, k)
        got.append(f"start{k}")
        order.reserved("t", 9, k, 3)

    threads = [threading.Thread(target=part, args=(k,)) for k in (2, 1)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    assert got == []  # neither 1 nor 2 may start before 0
    part(0)
    for t in threads:
        t.join(5)
    assert got == ["start0", "start1", "start2"]
    assert len(order) == 0  # the last part forgot the batch
    assert order.waited_out == 0


def test_part_two_is_not_released_by_part_one_alone() -> None:
    order = PutOrder(wait_seconds=0.05)
    order.reserved("t", 1, 1, 3)  # part 1 reserved (it waited out), part 0 never came
    assert not order.wait_turn("t", 1, 2)
    assert order.waited_out == 1
    assert order.wait_turn("t", 1, 0)  # part 0 never waits


def test_tenants_and_batches_are_apart() -> None:
    order = PutOrder(wait_seconds=0.05)
    order.reserved("alpha", 3, 0, 2)
    assert order.wait_turn("alpha", 3, 1)
    assert not order.wait_turn("beta", 3, 1)  # another tenant's batch of the same number
    assert not order.wait_turn("alpha", 4, 1)


def test_batches_whose_last_part_never_comes_are_forgotten() -> None:
    order = PutOrder(wait_seconds=0.01, keep_seconds=0.05)
    for b in range(1, 101):
        order.reserved("t", b, 0, 2)
    assert len(order) == 100
    time.sleep(0.08)
    order.reserved("t", 1000, 0, 2)
    assert len(order) == 1
