"""A sidecar that writes by a stale ring (DESIGN §6): the node answers WRONG_OWNER for the keys it
no longer owns, the sidecar learns the ring from that answer and writes them to their owner in
the same push, where another sidecar reads them."""

from __future__ import annotations

import random
from typing import Any

from kvpool.apps.cluster import LocalCluster
from kvpool.core.errors import Code
from kvpool.core.ring import owners
from kvpool.pool.node_client import StoreClient
from kvpool.wire.counters import SidecarCounter, StoreCounter, pool_write_failed
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


def _refused(lc: LocalCluster, i: int) -> int:
    with lc.admin(lc.stores[i]) as c:
        return int(c.stats().counters[StoreCounter.REFUSED_WRONG_OWNER])


def test_a_write_by_a_stale_ring_lands_at_the_owner_of_the_new_one(h: Any, rng: random.Random) -> None:
    with LocalCluster(stores=1, sidecars=2, store_bytes=64 * MiB, local_bytes=16 * MiB) as lc:
        with lc.connect(0) as w:
            assert w.stats().ring_epoch == lc.epoch == 1
            keys: list[bytes] = []
            values: list[bytes] = []
            # A store joins (a new epoch at the nodes) and the writer puts at once, before its
            # periodic ring poll (every 5 s) can tell it: it routes everything to store-0.  Should
            # the poll win that race, the write is not stale: try with the next store.
            for _ in range(3):
                lc.add_store()
                batch = h.keys(rng, 64)
                keys += batch
                values += h.values(rng, [rng.randrange(1, 16 * KiB) for _ in batch])
                assert w.put(batch, values[-64:]) == [pb.OK] * 64
                h.wait_for(lambda: w.stats().pending_pool_bytes == 0, 60, what="write-through backlog")
                if _refused(lc, 0):
                    break
            assert _refused(lc, 0) > 0, "store-0 never saw a write routed by a stale ring"
            assert w.stats().ring_epoch == lc.epoch
            # Re-routed within the push that was refused: no write waits for a retry, none failed.
            counters = h.counters(w)
            assert not counters.get(SidecarCounter.POOL_WRITES_BACKOFF)
            assert not counters.get(pool_write_failed(Code.WRONG_OWNER))
            assert counters[SidecarCounter.POOL_WRITES] == len(keys)

        # Every object is at its owner under the newest ring (where no fallback is needed).
        by_owner = owners(b"".join(keys), lc.store_ids)[:, 0].tolist()
        for i, addr in enumerate(lc.stores):
            mine = [k for k, o in zip(keys, by_owner, strict=True) if o == i]
            with StoreClient(addr) as c:
                assert c.exists(mine, prefix_only=False).present == [True] * len(mine), lc.store_ids[i]
        with lc.connect(1) as r:  # another sidecar, nothing local: every byte from the pool
            assert r.match(keys) == len(keys)
            for i in range(0, len(keys), 64):
                with r.get(keys[i:i + 64]) as got:
                    assert [bytes(v) for v in got] == values[i:i + 64]
