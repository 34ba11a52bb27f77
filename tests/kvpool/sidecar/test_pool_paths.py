"""The sidecar's pool traffic over the store nodes' data session: the bytes and answers, and a read
that follows a match drops the match's pins at the store nodes in its own round trip."""

from __future__ import annotations

import random
import signal
from typing import Any

import numpy as np

from kvpool.apps.cluster import LocalCluster
from kvpool.core.keys import KEY_BYTES
from kvpool.core.ring import owners
from kvpool.pool.fanout import Pool
from kvpool.pool.node_client import StoreClient
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


def _settled(h: Any, client: Any) -> None:
    h.wait_for(lambda: client.stats().pending_pool_bytes == 0, what="write-through backlog to drain")


def _by_node(lc: Any, keys: list[bytes]) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {}
    for k, i in zip(keys, owners(b"".join(keys), lc.store_ids)[:, 0].tolist(), strict=True):
        out.setdefault(lc.stores[i], []).append(k)
    return out


def test_remote_reads_and_matches(shared: LocalCluster, h: Any, rng: random.Random) -> None:
    with shared.connect(0) as a, shared.connect(1) as b:
        sizes = [1, 4095, 64 * KiB, MiB, 3 * MiB + 5, 17] * 3
        keys = h.keys(rng, len(sizes))
        values = h.values(rng, sizes)
        assert a.put(keys, values) == [pb.OK] * len(keys)
        _settled(h, a)
        before = h.counters(b)
        assert b.match(keys + h.keys(rng, 1)) == len(keys)
        bufs = [np.zeros(s, np.uint8) for s in sizes]
        assert b.get_into(keys, bufs) == sizes
        assert [x.tobytes() for x in bufs] == values
        assert h.counters(b)[SidecarCounter.READ_HITS_POOL] - before.get(SidecarCounter.READ_HITS_POOL, 0) == len(keys)
        # A miss in the middle: the prefix stops there, the rest of the batch is still read.
        gap = keys[:4] + h.keys(rng, 1) + keys[4:8]
        assert b.match(gap) == 4


def test_a_match_over_each_node_s_receive_window_answers_and_pins(shared: LocalCluster, h: Any,
                                                                   rng: random.Random) -> None:
    """Thousands of keys per node: each EXISTS is over the node's receive window (the sidecar
    starts every node's request, then sends the rests, then collects); the prefix stops at a
    miss deep in the batch and the matched keys are pinned at their nodes."""
    n = 12000
    keys = _pooled_keys(shared, h, rng, n)
    with shared.connect(1) as b:
        assert b.match(keys) == n
        assert b.match(keys[:9000] + h.keys(rng, 1) + keys[9000:]) == 9000
        n_pinned, lease = b.match_lease(keys)
        assert n_pinned == n and lease
        groups = _by_node(shared, keys)
        address = next(iter(groups))
        with StoreClient(address) as node:
            assert set(node.remove(groups[address][:50])) == {pb.IN_FLIGHT}
        b.release(lease)


def test_a_read_after_a_match_drops_its_pins_at_the_nodes(shared: LocalCluster, h: Any, rng: random.Random) -> None:
    with shared.connect(0) as a, shared.connect(1) as b:
        keys = h.keys(rng, 12)
        assert a.put(keys, h.values(rng, [8 * KiB] * 12)) == [pb.OK] * 12
        _settled(h, a)
        groups = _by_node(shared, keys)
        assert b.match(keys) == 12  # pinned at each store node by the match's pool leases
        with StoreClient(next(iter(groups))) as node:
            assert pb.IN_FLIGHT in node.remove(groups[next(iter(groups))])
        # That remove refused every pinned key and changed nothing; the read consumes the match.
        with b.get(keys) as got:
            assert len(got) == 12
        for address, ks in groups.items():
            with StoreClient(address) as node:
                assert node.remove(ks) == [pb.OK] * len(ks)


def test_a_released_match_drops_its_pins_with_the_next_frame_to_each_node(
        shared: LocalCluster, h: Any, rng: random.Random) -> None:
    """A match released without a read: its pool leases ride on the next frame to their nodes (no
    release round trip), and no pin is left behind."""
    with shared.connect(0) as a, shared.connect(1) as b:
        keys = h.keys(rng, 12)
        assert a.put(keys, h.values(rng, [8 * KiB] * 12)) == [pb.OK] * 12
        _settled(h, a)
        groups = _by_node(shared, keys)
        assert len(groups) == 2  # both nodes hold some: the next match asks both
        n, lease = b.match_lease(keys)
        assert n == 12 and lease
        before = h.counters(b)
        b.release(lease)
        assert b.match(keys) == 12  # carries the first match's drops; pins its own lease
        with b.get(keys) as got:    # the read drops the second match's pins
            assert len(got) == 12
        after = h.counters(b)
        sent = after[SidecarCounter.POOL_MATCH_RELEASES_SENT] - before[SidecarCounter.POOL_MATCH_RELEASES_SENT]
        carried = after[SidecarCounter.POOL_MATCH_RELEASES_CARRIED] - before[SidecarCounter.POOL_MATCH_RELEASES_CARRIED]
        assert (sent, carried) == (0, len(groups))
        for address, ks in groups.items():
            with StoreClient(address) as node:
                h.wait_for(lambda node=node, ks=ks: node.remove(ks) == [pb.OK] * len(ks),  # type: ignore[misc]
                           timeout=10, what="the released match's pins to go")


def test_a_released_match_that_no_frame_follows_still_drops_its_pins(shared: LocalCluster, h: Any,
                                                                     rng: random.Random) -> None:
    """A drop waiting for a frame that never comes is sent by the sidecar's background loop
    within about a second, long before the lease (a minute here) would run out."""
    with shared.connect(0) as a, shared.connect(1) as b:
        keys = h.keys(rng, 6)
        assert a.put(keys, h.values(rng, [4 * KiB] * 6)) == [pb.OK] * 6
        _settled(h, a)
        n, lease = b.match_lease(keys, lease_ms=60_000)
        assert n == 6
        b.release(lease)
        for address, ks in _by_node(shared, keys).items():
            with StoreClient(address) as node:
                h.wait_for(lambda node=node, ks=ks: pb.IN_FLIGHT not in node.remove(ks),  # type: ignore[misc]
                           timeout=30, what="the deferred drop to be flushed")  # < the 60 s lease


def _pins_go(h: Any, lc: Any, keys: list[bytes], what: str) -> None:
    """Wait until no key of ``keys`` is pinned at its node any more (then they are removed)."""
    for address, ks in _by_node(lc, keys).items():
        with StoreClient(address) as node:
            h.wait_for(lambda node=node, ks=ks: pb.IN_FLIGHT not in node.remove(ks),
                       timeout=30, what=what)  # < the 60 s lease


def _pooled_keys(lc: LocalCluster, h: Any, rng: random.Random, n: int) -> list[bytes]:
    with lc.connect(0) as a:
        keys: list[bytes] = h.keys(rng, n)
        assert a.put(keys, h.values(rng, [4 * KiB] * n)) == [pb.OK] * n
        _settled(h, a)
    return keys


def test_closing_the_pool_sends_the_match_lease_drops_it_deferred(shared: LocalCluster, h: Any,
                                                                   rng: random.Random) -> None:
    """A match released just before the pool closes: its drops wait for frames to their nodes
    that will never come; :meth:`Pool.close` sends them, so the pins do not outlive the sidecar
    until their leases (a minute here) run out."""
    keys = _pooled_keys(shared, h, rng, 8)
    pool = Pool(shared.stores)
    try:
        m = pool.match(np.frombuffer(b"".join(keys), dtype=f"V{KEY_BYTES}"), lease_ms=60_000)
        assert m.prefix == 8 and len(m.leases) == len(_by_node(shared, keys))
        pool.release(m.leases)
        assert pool.releases_sent == 0  # deferred: each waits for the next frame to its node
    finally:
        pool.close()
    _pins_go(h, shared, keys, "the deferred drops sent at close")


def test_a_sidecar_stopped_right_after_a_release_drops_the_pool_pins(shared: LocalCluster, h: Any,
                                                                     rng: random.Random) -> None:
    """The same through a sidecar process: SIGTERM right after the client released its match, before
    the background loop sent the deferred drops (it waits half a second for a frame to carry them)."""
    keys = _pooled_keys(shared, h, rng, 8)
    w = shared.sidecars.index(shared.add_sidecar())
    with shared.connect(w) as b:
        n, lease = b.match_lease(keys, lease_ms=60_000)
        assert n == 8
        b.release(lease)
    proc = shared.sidecar_procs[w]
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=60) == 0
    _pins_go(h, shared, keys, "the deferred drops sent at the sidecar's close")
