"""A write-through pool write that fails for a passing reason, with no ring change, is tried
again until the block reaches the pool; one tried too often is counted as dropped and stays
local-only (handed over at eviction or drain).  So is the copy of an object evicted from the
local tier (its only bytes), within the backlog's bound: beyond it the copy is counted as
dropped.  Real store and sidecar processes: the failures are provoked for real (another
writer's reservation, a stopped store node)."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.apps.cluster import LocalCluster
from kvpool.core.errors import Code
from kvpool.core.retry import DONE, REFUSED, RETRY, UNREACHABLE, RetryQueue, delay, drain_pause, outcome, retried
from kvpool.pool.node_client import StoreClient
from kvpool.wire.counters import SidecarCounter, pool_write_failed
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
CLUSTER = dict(stores=1, sidecars=1, store_bytes=64 * MiB, local_bytes=16 * MiB)


IN_FLIGHT = pool_write_failed(Code.IN_FLIGHT)


def _count(h: Any, client: Any, name: str) -> int:
    return h.counters(client).get(name, 0)


@pytest.fixture
def held(module_cluster: LocalCluster, h: Any, rng: random.Random) -> Iterator[tuple[bytes, bytes, Any]]:
    """A key another writer holds a reservation for (a data-session PUT whose payload never comes),
    its value, and a function letting go of that reservation."""
    key, value = h.keys(rng, 1)[0], rng.randbytes(8 * KiB)
    held = h.HeldReservation(module_cluster.stores[0], key, len(value))
    try:
        yield key, value, held.let_go
    finally:
        held.let_go()


def test_a_block_another_writer_holds_reaches_the_pool_once_it_lets_go(
        module_cluster: LocalCluster, h: Any, held: tuple[bytes, bytes, Any]) -> None:
    key, value, let_go = held
    with module_cluster.connect(0) as c:
        in_flight, writes = _count(h, c, IN_FLIGHT), _count(h, c, SidecarCounter.POOL_WRITES)
        assert c.put([key], [value]) == [pb.OK]
        h.wait_for(lambda: _count(h, c, IN_FLIGHT) > in_flight, what="the IN_FLIGHT refusal")
        assert c.stats().pending_pool_bytes > 0  # the retry is part of the backlog
        let_go()
        # No ring change happens: only the writer's own retry can bring the block to the pool.
        h.wait_for(lambda: c.stats().pending_pool_bytes == 0 and _count(h, c, SidecarCounter.LOCAL_ONLY_OBJECTS) == 0,
                   timeout=20, what="the retried pool write")
        assert _count(h, c, SidecarCounter.POOL_WRITES) == writes + 1
        assert _count(h, c, SidecarCounter.POOL_WRITES_DROPPED) == 0
    with StoreClient(module_cluster.stores[0]) as node:
        assert [bytes(v) if v is not None else None for v in node.get([key])] == [value]


def test_a_block_tried_too_often_is_counted_dropped_and_stays_local(
        module_cluster: LocalCluster, h: Any, held: tuple[bytes, bytes, Any]) -> None:
    key, value, _ = held
    module_cluster.add_sidecar(extra_args=["--pool-write-retries", "2"])
    with module_cluster.connect(len(module_cluster.sidecars) - 1) as c:
        assert c.put([key], [value]) == [pb.OK]
        h.wait_for(lambda: _count(h, c, SidecarCounter.POOL_WRITES_DROPPED) == 1, what="the block to be dropped")
        counters = h.counters(c)
        assert counters[IN_FLIGHT] == 3  # the first write and its two retries
        assert counters[SidecarCounter.LOCAL_ONLY_OBJECTS] == 1 and counters.get(SidecarCounter.POOL_WRITES, 0) == 0
        assert c.stats().pending_pool_bytes == 0  # given up: no longer part of the backlog


def test_a_block_written_while_its_node_is_stopped_reaches_the_pool_after(h: Any, rng: random.Random) -> None:
    with LocalCluster(stores=1, sidecars=1, store_bytes=64 * MiB, local_bytes=16 * MiB) as lc, lc.connect(0) as c:
        keys = h.keys(rng, 4)
        values = h.values(rng, [16 * KiB] * 4)
        pid = lc.store_pids[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            assert c.put(keys, values) == [pb.OK] * 4
            # The pool write times out (the node answers nothing): a failure with no ring change.
            h.wait_for(lambda: c.stats().counters.get(SidecarCounter.POOL_ERRORS, 0) > 0,
                       what="the timed-out pool write")
        finally:
            os.kill(pid, signal.SIGCONT)
        h.wait_for(lambda: c.stats().pending_pool_bytes == 0 and _count(h, c, SidecarCounter.LOCAL_ONLY_OBJECTS) == 0,
                   timeout=40, what="the retried pool write")
        assert _count(h, c, SidecarCounter.POOL_WRITES) == 4
        with StoreClient(lc.stores[0]) as node:
            assert [bytes(v) if v is not None else None for v in node.get(keys)] == values


def test_an_evicted_copy_another_writer_holds_reaches_the_pool_once_it_lets_go(
        module_cluster: LocalCluster, h: Any, held: tuple[bytes, bytes, Any], rng: random.Random) -> None:
    key, value, let_go = held
    module_cluster.add_sidecar(local_bytes=MiB, extra_args=["--write-back"])
    with module_cluster.connect(len(module_cluster.sidecars) - 1) as c:
        assert c.put([key], [value]) == [pb.OK]
        # Fill the local tier half again: the block (the least recently used) is evicted and its
        # copy, the only bytes left, is written to the pool, where the other writer holds the key.
        for _ in range(6):
            assert c.put(h.keys(rng, 16), h.values(rng, [16 * KiB] * 16)) == [pb.OK] * 16
        h.wait_for(lambda: _count(h, c, IN_FLIGHT) > 0, what="the IN_FLIGHT refusal of the copy")
        # Everything else evicted is in the pool; the copy waits for its retry, part of the backlog.
        h.wait_for(lambda: c.stats().pending_pool_bytes == len(value), what="the copy waiting in the backlog")
        let_go()
        with StoreClient(module_cluster.stores[0]) as node:
            h.wait_for(lambda: node.get([key])[0] is not None, timeout=40, what="the retried copy")
            assert [bytes(v) if v is not None else None for v in node.get([key])] == [value]
        h.wait_for(lambda: c.stats().pending_pool_bytes == 0, what="the backlog to drain")
        assert _count(h, c, SidecarCounter.POOL_WRITES_DROPPED) == 0


def test_evicted_copies_beyond_the_backlog_bound_are_counted_dropped_the_others_reach_the_pool(
        h: Any, rng: random.Random) -> None:
    n = 160  # 2.5 MiB through a 1 MiB local tier: about 100 blocks evicted while the node is stopped
    with LocalCluster(stores=1, sidecars=1, store_bytes=64 * MiB, local_bytes=MiB, write_back=True) as lc, \
            lc.connect(0) as c:
        keys, values = h.keys(rng, n), h.values(rng, [16 * KiB] * n)
        pid = lc.store_pids[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            for i in range(0, n, 16):  # never waits for the stopped node
                assert c.put(keys[i:i + 16], values[i:i + 16]) == [pb.OK] * 16
            # The copies' writes time out or find the node down: a passing failure each.  A quarter
            # of the local tier of them wait for a retry; those beyond are dropped, and counted.
            h.wait_for(lambda: _count(h, c, SidecarCounter.POOL_WRITES_DROPPED) > 0, timeout=60,
                       what="copies beyond the backlog bound to be dropped")
        finally:
            os.kill(pid, signal.SIGCONT)
        h.wait_for(lambda: c.stats().pending_pool_bytes == 0, timeout=90, what="the retried copies")
        counters = h.counters(c)
        with StoreClient(lc.stores[0]) as node:
            stored = [v is not None for v in node.get(keys)]
        # No evicted block is lost silently: it is in the pool or counted as dropped.  (A write
        # that timed out may still land when the node resumes: dropped and yet stored, so >=.)
        assert sum(stored) + counters[SidecarCounter.POOL_WRITES_DROPPED] >= counters[SidecarCounter.EVICTED] > 0
        assert sum(stored) >= 16  # the copies that fit the bound (256 KiB) made it


# -- the pure decisions ---------------------------------------------------------------------------


def test_outcomes_of_pool_write_codes() -> None:
    assert {outcome(c) for c in (pb.OK, pb.ALREADY_EXISTS)} == {DONE}
    assert {outcome(c) for c in (-1, pb.IN_FLIGHT, pb.LEASE_EXPIRED, pb.NO_SPACE, pb.DRAINING)} == {RETRY}
    assert {outcome(c) for c in (pb.QUOTA_EXCEEDED, pb.WRONG_TENANT, pb.INVALID, pb.TOO_LARGE)} == {REFUSED}


def test_which_failed_writes_are_retried() -> None:
    refusals = (pb.QUOTA_EXCEEDED, pb.WRONG_TENANT, pb.INVALID, pb.TOO_LARGE)
    # A write-through block still local: passing failures only, never under write-back (it waits
    # for eviction or the drain), never a state object (the same).
    assert retried(pb.IN_FLIGHT, pooled=False, copy=False, block=True, write_back=False)
    assert not retried(pb.IN_FLIGHT, pooled=False, copy=False, block=True, write_back=True)
    assert not retried(pb.IN_FLIGHT, pooled=False, copy=False, block=False, write_back=False)
    # An evicted copy (its only bytes): every passing failure, any kind, either policy.
    for code in (UNREACHABLE, pb.IN_FLIGHT, pb.NO_SPACE, pb.LEASE_EXPIRED):
        assert all(retried(code, False, True, block, wb) for block in (True, False) for wb in (True, False))
    # Refusals are final; done is done, and so is what the pool holds meanwhile.
    assert not any(retried(c, False, True, True, False) for c in refusals + (pb.OK, pb.ALREADY_EXISTS))
    assert not retried(UNREACHABLE, pooled=True, copy=True, block=True, write_back=False)


def test_retry_queue_backs_off_bounds_bytes_and_gives_up() -> None:
    assert [delay(n, 0.1, 0.5) for n in (1, 2, 3, 4, 60)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    q: RetryQueue[str] = RetryQueue(max_attempts=2, max_bytes=100, base=1.0, cap=10.0)
    assert q.schedule("a", 60, now=0.0) and q.schedule("a", 60, now=0.0)  # waiting already: once
    assert not q.schedule("b", 41, now=0.0)  # does not fit
    assert q.bytes == 60 and len(q) == 1 and q.next_due() == 1.0
    assert q.take_due(0.5, 10) == [] and q.take_due(1.0, 10) == [("a", 60)] and q.bytes == 0
    assert q.schedule("a", 60, now=1.0) and q.next_due() == 3.0  # the second retry waits twice as long
    assert q.take_due(3.0, 10) == [("a", 60)]
    assert not q.schedule("a", 60, now=3.0)  # tried twice again: given up
    q.settle("a")
    assert q.schedule("a", 60, now=4.0) and q.next_due() == 5.0  # a new failure after that starts afresh


def test_the_drain_pauses_briefly_and_never_past_its_deadline() -> None:
    assert [drain_pause(n, 60.0) for n in (1, 2, 3, 5, 6, 40)] == [0.05, 0.1, 0.2, 0.8, 1.0, 1.0]
    assert drain_pause(6, 0.3) == 0.3 and drain_pause(1, -1.0) == 0.0
