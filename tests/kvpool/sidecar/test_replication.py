"""Replication R (``spec.storage.replication``, the ring's ``replicas``) on the data path: a block
is written to each of its R owners, and a read or match that misses at the primary (or finds it
down) asks the next replicas.  Routing and the write success rule are pure and tested without
processes; the loss of a store node is tested with real ones (SIGKILL)."""

from __future__ import annotations

import os
import random
import signal
from typing import Any

import numpy as np

from kvpool.apps.cluster import LocalCluster
from kvpool.core.retry import UNREACHABLE
from kvpool.core.ring import Member, Ring, owners
from kvpool.pool.node_client import StoreClient
from kvpool.pool.routing import fallback_routes, merge_replica_codes, write_routes
from kvpool.wire.counters import StoreCounter, pool_write_failed
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


def _ring(epoch: int, *ids: str, replicas: int = 1, draining: tuple[str, ...] = ()) -> Ring:
    return Ring(epoch, tuple(Member(i, f"addr-{i}", "draining" if i in draining else "active") for i in ids),
                replicas=replicas)


def _by_key(routes: dict[str, np.ndarray], n: int) -> list[set[str]]:
    out: list[set[str]] = [set() for _ in range(n)]
    for nid, idx in routes.items():
        assert list(idx) == sorted(idx)  # one batched call per node, keys in order
        for i in idx.tolist():
            out[i].add(nid)
    return out


def test_write_routes_send_each_key_to_its_top_r_owners_once_per_node(rng: random.Random) -> None:
    ids = ["a", "b", "c", "d"]
    blob = rng.randbytes(32 * 500)
    for r in (1, 2, 3):
        routes = write_routes(blob, ids, r)
        top = owners(blob, ids, r)
        assert _by_key(routes, 500) == [{ids[j] for j in row} for row in top.tolist()]
    # R=1 is the primary routing; R above the members is every member.
    assert _by_key(write_routes(blob, ids[:2], 5), 500) == [{"a", "b"}] * 500
    assert write_routes(b"", ids, 2) == {} and write_routes(blob, [], 2) == {}


def test_a_write_is_pooled_when_every_owner_that_answered_holds_it() -> None:
    ok, have, nsp, flight = pb.OK, pb.ALREADY_EXISTS, pb.NO_SPACE, pb.IN_FLIGHT
    assert merge_replica_codes([
        [ok, ok],                     # both took it
        [ok, UNREACHABLE],            # one owner down: pooled at the other
        [UNREACHABLE, have],          # primary down, the replica had it already
        [have, have],                 # nothing new anywhere
        [ok, nsp],                    # a replica refused: the write is retried (or given up) as a whole
        [flight, ok],                 # the first refusal decides
        [UNREACHABLE, UNREACHABLE],   # nobody answered
        [],                           # no owner at all
    ]) == [ok, ok, have, have, nsp, flight, UNREACHABLE, UNREACHABLE]


def test_reads_of_a_replicated_block_fall_back_to_the_next_replicas_in_rank_order(rng: random.Random) -> None:
    ids = ["a", "b", "c", "d"]
    blob = rng.randbytes(32 * 300)
    ranked = owners(blob, ids, 3)
    for r in (2, 3):
        routes = fallback_routes(blob, _ring(4, *ids, replicas=r))
        assert len(routes) == r - 1  # one more batched round per replica rank
        for rank, rt in enumerate(routes, start=1):
            assert _by_key(rt, 300) == [{ids[row[rank]]} for row in ranked.tolist()]
    # A single-copy state object, or R=1, has no replica to ask.
    assert fallback_routes(blob, _ring(4, *ids, replicas=3), replicated=False) == []
    assert fallback_routes(blob, _ring(4, *ids, replicas=1)) == []


def _stored(lc: LocalCluster, i: int) -> int:
    with lc.admin(lc.stores[i]) as c:
        return int(c.stats().counters[StoreCounter.STORED])


def test_replication_2_survives_the_sigkill_of_a_store_node(h: Any, rng: random.Random) -> None:
    with LocalCluster(stores=3, sidecars=2, store_bytes=64 * MiB, local_bytes=32 * MiB, replication=2) as lc:
        keys = h.keys(rng, 150)
        values = h.values(rng, [rng.randrange(1, 24 * KiB) for _ in keys])
        with lc.connect(0) as w:
            for i in range(0, len(keys), 30):
                assert w.put(keys[i:i + 30], values[i:i + 30]) == [pb.OK] * 30
            h.wait_for(lambda: w.stats().pending_pool_bytes == 0, 60, what="write-through backlog")
        # Every block is at exactly its two owners.
        assert sum(_stored(lc, i) for i in range(3)) == 2 * len(keys)
        top = owners(b"".join(keys), lc.store_ids, 2)
        for i, sid in enumerate(lc.store_ids):
            with StoreClient(lc.stores[i]) as c:  # the default tenant's view
                held = c.exists(keys, prefix_only=False).present
            assert list(held) == [bool(i in row) for row in top.tolist()], sid

        victim = 1
        os.kill(lc.store_pids[victim], signal.SIGKILL)
        lc.store_procs[victim].popen.wait(30)
        primary_lost = sum(1 for row in top.tolist() if row[0] == victim)
        assert primary_lost > 0  # the test means something: some primaries are gone

        with lc.connect(1) as r:  # a sidecar that holds nothing locally
            assert r.match(keys) == len(keys)
            for i in range(0, len(keys), 50):
                with r.get(keys[i:i + 50]) as got:
                    assert [bytes(v) for v in got] == values[i:i + 50]

            # New writes while the node is down are pooled at the owner that answered, and are
            # found by the other sidecar.
            more = h.keys(rng, 60)
            vals = h.values(rng, [rng.randrange(1, 16 * KiB) for _ in more])
            with lc.connect(0) as w:
                assert w.put(more, vals) == [pb.OK] * len(more)
                h.wait_for(lambda: w.stats().pending_pool_bytes == 0, 60, what="write-through backlog")
                assert h.counters(w).get(pool_write_failed(UNREACHABLE), 0) == 0
            assert r.match(more) == len(more)
            with r.get(more) as got:
                assert [bytes(v) for v in got] == vals
