"""Adding store nodes keeps all data readable: a key whose owner moved is read from where it
was written (the owner under an earlier ring epoch) until it is moved; new writes go to the new owner."""

from __future__ import annotations

import random
from typing import Any

from kvpool.apps.cluster import LocalCluster
from kvpool.core.ring import owners
from kvpool.pool.node_client import StoreClient
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
B = 128


def _owners(keys: list[bytes], ids: list[str]) -> list[str]:
    return [ids[i] for i in owners(b"".join(keys), ids)[:, 0].tolist()]


def _read_all(h: Any, c: Any, keys: list[bytes], values: list[bytes]) -> None:
    assert c.match(keys) == len(keys)
    for i in range(0, len(keys), 64):
        with c.get(keys[i:i + 64]) as got:
            assert [bytes(v) for v in got] == values[i:i + 64]


def test_adding_store_nodes_keeps_all_data_readable(h: Any, rng: random.Random) -> None:
    with LocalCluster(stores=1, sidecars=2, store_bytes=64 * MiB, local_bytes=8 * MiB) as lc:
        keys = h.keys(rng, 256)
        values = h.values(rng, [rng.randrange(1, 16 * KiB) for _ in keys])
        state_key, state = keys[7], rng.randbytes(50 * KiB)
        with lc.connect(0) as w:
            for i in range(0, len(keys), 64):
                assert w.put(keys[i:i + 64], values[i:i + 64]) == [pb.OK] * 64
            assert w.put_state(state_key, 8 * B, state) == pb.OK
            assert w.flush().dropped_objects == 0
            h.wait_for(lambda: w.stats().pending_pool_bytes == 0, what="write-through backlog")

        # Scale up: a new ring epoch with store-1; about half the keys now belong to it, which
        # holds none of them.
        lc.add_store()
        moved = [k for k, o in zip(keys, _owners(keys, lc.store_ids), strict=True) if o == "store-1"]
        assert 64 < len(moved) < 192
        with StoreClient(lc.stores[1]) as fresh:
            assert not any(fresh.exists(moved, prefix_only=False).present)

        with lc.connect(1) as r:  # an empty local tier: everything comes from the pool
            _read_all(h, r, keys, values)
            # Every read hit at the old owner, whose replies name the newer epoch: the sidecar
            # learns the ring from them (in the background: the reads never waited for it).
            h.wait_for(lambda: r.stats().ring_epoch == lc.epoch, what="the sidecar learning the new ring")
            _read_all(h, r, keys, values)
            assert r.has_states([state_key]) == [True]
            assert bytes(r.get_state(state_key, 8 * B) or b"") == state

            # New writes go to their owner under the new ring.
            new_keys = h.keys(rng, 64)
            new_values = h.values(rng, [4 * KiB] * 64)
            assert r.put(new_keys, new_values) == [pb.OK] * 64
            h.wait_for(lambda: r.stats().pending_pool_bytes == 0, what="write-through backlog")
            by_owner = _owners(new_keys, lc.store_ids)
            for i, addr in enumerate(lc.stores):
                mine = [k for k, o in zip(new_keys, by_owner, strict=True) if o == lc.store_ids[i]]
                assert mine
                with StoreClient(addr) as c:
                    assert c.exists(mine, prefix_only=False).present == [True] * len(mine)

        # A second scale-up before anything moved: objects are up to two epochs behind.
        lc.add_store()
        with lc.connect(1) as r:  # saw epochs 1 → 2 → 3
            # Drop its local copies so that every read goes to the pool.
            assert r.remove(keys) == [pb.OK] * len(keys)
            assert r.remove(new_keys) == [pb.OK] * len(new_keys)
            assert r.remove([state_key], kind=pb.STATE) == [pb.OK]
            assert r.stats().local_objects == 0
            _read_all(h, r, keys, values)
            _read_all(h, r, new_keys, new_values)
            assert r.stats().ring_epoch == lc.epoch
            assert bytes(r.get_state(state_key, 8 * B) or b"") == state
        # A sidecar started now (an engine pod scheduled after the scale-ups) never saw the
        # earlier epochs at all.
        late = lc.sidecars.index(lc.add_sidecar())
        with lc.connect(late) as r3:
            _read_all(h, r3, keys, values)
            _read_all(h, r3, new_keys, new_values)
            assert bytes(r3.get_state(state_key, 8 * B) or b"") == state
        with lc.connect(0) as w:  # the writer, whose local tier holds part of the keys
            _read_all(h, w, keys, values)
