"""Store-node incarnations (issue 19): a node restarted on the same address is another life, and
nothing a client holds from the previous life — a match lease, a deferred release — is ever taken
for one of the new life's (a reservation cannot outlive its life: a data-session PUT is one
connection, which the restart breaks).  Each test SIGKILLs the node between the two halves of a call pair and
restarts it on the same control and transfer ports, as a pod's restart does."""

from __future__ import annotations

import random
import socket
from typing import Any

import numpy as np

from kvpool.core import errors
from kvpool.core.keys import KEY_BYTES
from kvpool.pool.fanout import Pool
from kvpool.pool.node_client import StoreClient
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB = 1 << 10


def _same_address() -> list[str]:
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ["--listen", f"127.0.0.1:{ports[0]}", "--transfer-port", str(ports[1])]


def test_a_match_lease_of_the_previous_life_never_drops_another(stores: Any, h: Any, rng: random.Random) -> None:
    """A releases a match lease after the restart (over its data session, which reconnects to the
    new life on its own): the new life's lease of B, issued meanwhile, keeps B's prefix pinned."""
    listen = _same_address()
    first = stores.start("1MiB", extra=listen)
    a = StoreClient(first.address)
    b = c = None
    try:
        keys_a = h.rand_keys(rng, 2)
        assert a.put(keys_a, [b"a" * 4096] * 2) == [pb.OK] * 2
        lease_a = a.exists(keys_a, pin=True, lease_ms=30_000).lease_id
        assert lease_a
        first.kill()
        second = stores.start("1MiB", extra=listen)
        b, c = StoreClient(second.address), StoreClient(second.address)
        keys_b = h.rand_keys(rng, 4)
        vals_b = h.rand_values(rng, [64 * KiB] * 4)
        assert b.put(keys_b, vals_b) == [pb.OK] * 4
        m = b.exists(keys_b, pin=True, lease_ms=30_000)
        assert m.prefix == 4 and m.lease_id
        try:
            a.release([lease_a])  # the old life's lease, sent to the new life
        except errors.Unavailable:
            a.release([lease_a])  # the dead connection cost one call; the next goes through
        # Fill the arena: every unpinned object is evicted; B's pinned prefix must stay.
        for i in range(16):
            c.put(h.rand_keys(random.Random(i), 2), [bytes([i]) * (128 * KiB)] * 2)
        assert c.stats().counters[StoreCounter.EVICTED] > 0
        got = b.get(keys_b)
        assert [bytes(g) if g is not None else None for g in got] == vals_b
    finally:
        for cl in (a, b, c):
            if cl is not None:
                cl.close()


def _pool_match(stores: Any, h: Any, rng: random.Random) -> tuple[Any, Any, Any, list[str]]:
    listen = _same_address()
    first = stores.start("8MiB", extra=listen)
    keys = h.rand_keys(rng, 4)
    assert first.client().put(keys, [b"p" * 4096] * 4) == [pb.OK] * 4
    pool = Pool([first.address])
    arr = np.frombuffer(b"".join(keys), dtype=f"V{KEY_BYTES}")
    m = pool.match(arr, lease_ms=60_000)
    assert m.prefix == 4 and len(m.leases) == 1
    pool.release(m.leases)  # deferred: it waits for the next frame to the node
    assert pool.releases_sent == 0 and pool.leases.deferred
    return pool, first, arr, listen


def test_a_deferred_release_of_this_life_is_carried_by_the_next_frame(stores: Any, h: Any,
                                                                       rng: random.Random) -> None:
    pool, _, arr, _ = _pool_match(stores, h, rng)  # the control: no restart, the drop goes out
    try:
        assert pool.match(arr, lease_ms=1000).prefix == 4
        assert pool.releases_carried == 1 and not pool.leases.deferred
    finally:
        pool.close()


def test_the_pool_drops_a_deferred_release_of_a_node_that_failed(stores: Any, h: Any, rng: random.Random) -> None:
    pool, first, arr, listen = _pool_match(stores, h, rng)
    try:
        first.kill()
        assert pool.match(arr, lease_ms=1000).prefix == 0  # the node is down: misses, and its lease died
        assert not pool.leases.deferred
        stores.start("8MiB", extra=listen)
        assert pool.flush_deferred() == 0 and pool.releases_sent == 0
    finally:
        pool.close()


def test_the_pool_never_sends_a_release_to_the_next_life(stores: Any, h: Any, rng: random.Random) -> None:
    pool, first, arr, listen = _pool_match(stores, h, rng)
    try:
        [node] = pool.nodes.values()
        before = node.client.incarnation
        assert before
        first.kill()
        stores.start("8MiB", extra=listen)
        node.client.health()  # any reply of the new life tells its incarnation
        assert node.client.incarnation not in (0, before)
        pool.flush_deferred()  # due, but of the previous life: dropped, not sent
        assert pool.releases_sent == 0 and pool.releases_carried == 0 and not pool.leases.deferred
    finally:
        pool.close()
