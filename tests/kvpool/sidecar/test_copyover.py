"""The copy-over queue: which fallback hits are queued, deduplicated, shed (pure), and the worker."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvpool.sidecar.copyover import CopyOver, admit
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb


def test_admit_drops_duplicates_and_sheds_over_the_bound() -> None:
    o = admit([b"a", b"b", b"a", b"c", b"d"], [10, 10, 10, 10, 10], {b"c"}, 0, 25)
    assert o.take == (0, 1)  # a, b fit; a again and c (queued) are duplicates; d is over the bound
    assert o.duplicate == 2 and o.shed == 1
    assert admit([b"x"], [100], set(), 0, 99).take == ()  # larger than the bound: never fits
    assert admit([b"x"], [10], set(), 95, 100).shed == 1  # the queue is full: shed, never block


@dataclass
class _E:
    key: bytes
    size: int
    kind: int = pb.BLOCK


def test_the_worker_writes_each_block_once_and_releases_its_pin() -> None:
    counters: Counter[str] = Counter()
    gate = threading.Event()
    written: list[list[bytes]] = []
    released: list[int] = []

    def pin(entries: list[Any]) -> tuple[list[Any], Any]:
        n = len(released)
        return entries, lambda: released.append(n)

    def put(entries: list[Any]) -> list[int]:
        gate.wait(10)
        written.append([e.key for e in entries])
        return [pb.OK if e.key != b"have" else pb.ALREADY_EXISTS for e in entries]

    co = CopyOver(pin, put, counters, max_bytes=100)
    try:
        co.offer([_E(b"a", 10), _E(b"have", 10), _E(b"s", 10, pb.STATE)])  # a state object is never copied
        co.offer([_E(b"a", 10), _E(b"b", 10)])  # a is queued or in flight: only b goes
        assert co.queued_bytes == 30
        gate.set()
        deadline = threading.Event()
        for _ in range(200):
            if co.idle and co.queued_bytes == 0:
                break
            deadline.wait(0.01)
        assert co.idle and co.queued_bytes == 0
        assert sorted(k for batch in written for k in batch) == [b"a", b"b", b"have"]
        assert counters[SidecarCounter.POOL_COPYOVER_WRITTEN] == 2
        assert counters[SidecarCounter.POOL_COPYOVER_PRESENT] == 1
        assert counters[SidecarCounter.POOL_COPYOVER_DUPLICATE] == 1 and len(released) == 2
    finally:
        co.close()
