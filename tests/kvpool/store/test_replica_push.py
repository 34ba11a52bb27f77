"""Store-side pushes with replication R: a drain sends each block to every one of its owners in
the new ring (a state object to its primary only), a warm-up sends each block once to its added
owners; and a newer Drain supersedes one still running by an older ring."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

from kvpool.core.ring import Member, Ring, owners
from kvpool.store.push import replica_pushes
from kvpool.store.warm import plan_warm, warm_targets
from kvpool.wire.proto import store_pb2 as pb

KiB = 1 << 10
ADMIN = "admin-secret"


def _ring(epoch: int, *ids: str, replicas: int = 1) -> Ring:
    return Ring(epoch, tuple(Member(i, f"addr-{i}") for i in ids), replicas=replicas)


def test_write_owners_are_the_top_r_active_members(rng: random.Random) -> None:
    blob = rng.randbytes(32 * 200)
    ring = Ring(3, (Member("a", "x"), Member("b", "x", "draining"), Member("c", "x"), Member("d", "x")), replicas=2)
    assert ring.write_owners(blob).tolist() == owners(blob, ["a", "c", "d"], 2).tolist()
    assert ring.write_owners(blob)[:, 0].tolist() == ring.owners_of(blob).tolist()
    assert Ring(1, (Member("a", "x", "draining"),), replicas=2).write_owners(blob).shape == (200, 0)


def test_replica_pushes_send_a_block_to_each_owner_and_a_state_object_to_its_primary() -> None:
    own = np.array([[2, 0], [1, 2], [0, 1]])
    assert replica_pushes(own, [False, True, False]) == ([0, 0, 1, 2, 2], [2, 0, 1, 0, 1])
    assert replica_pushes(own[:, :1], [False] * 3) == ([0, 1, 2], [2, 1, 0])
    assert replica_pushes(np.zeros((0, 2), dtype=np.intp), []) == ([], [])


def test_warm_with_replicas_pushes_each_block_once_to_its_added_owners(rng: random.Random) -> None:
    ids = ["a", "b", "c", "d"]
    blob = rng.randbytes(32 * 600)
    new = _ring(2, *ids, replicas=2)
    ranked = owners(blob, ids, 4).tolist()
    pushes: list[list[tuple[str, str]]] = [[] for _ in range(600)]
    previous = owners(blob, ids[:3], 2).tolist()  # before "d" was added
    for holder in ids[:3]:
        t = warm_targets(blob, new, ["d"], holder)
        assert t.shape == (600, 2)
        for i, row in enumerate(t.tolist()):
            if ids.index(holder) in previous[i]:  # only a previous owner holds the object
                pushes[i] += [(holder, ids[j]) for j in row if j >= 0]
    for i in range(600):
        if 3 in ranked[i][:2]:  # "d" is one of its owners now: exactly one push, from the first previous owner
            assert pushes[i] == [(ids[previous[i][0]], "d")]
        else:
            assert pushes[i] == []
    # R=1: every holder pushes what an added member owns (as before replication).
    one = warm_targets(blob, _ring(2, *ids), ["d"], "b")
    assert one[:, 0].tolist() == [3 if r[0] == 3 else -1 for r in ranked]
    order = plan_warm(blob, list(range(600)), [1] * 600, new, ["d"], holder="a")
    assert sorted(order.tolist()) == [i for i in range(600) if (warm_targets(blob, new, ["d"], "a")[i] >= 0).any()]


def _pb_ring(epoch: int, nodes: Any, draining: Any = (), replicas: int = 1) -> pb.Ring:
    return pb.Ring(epoch=epoch, replicas=replicas, members=[
        pb.RingMember(id=n.node_id, address=n.address, transfer_address=n.transfer_address,
                      state="draining" if n in draining else "active") for n in nodes])


def test_drain_with_replication_2_fills_every_owner(stores: Any, h: Any, rng: random.Random) -> None:
    spec = {"dram": "32MiB", "admin_token": ADMIN}
    x, *rest = stores.start_many({f"store-{n}": spec for n in "xpqr"}).values()
    keys = h.rand_keys(rng, 60)
    vals = h.rand_values(rng, [rng.randrange(1, 32 * KiB) for _ in keys])
    assert x.client().put(keys, vals) == [pb.OK] * len(keys)
    state_key = h.rand_keys(rng, 1)
    assert x.client().put(state_key, [b"state"], kind=pb.STATE) == [pb.OK]
    ids = [n.node_id for n in rest]
    top = owners(b"".join(keys), ids, 2).tolist()
    # One replica holds some objects already (it costs no bytes: counted as moved all the same).
    have = [i for i in range(0, 60, 3)]
    holder = rest[top[have[0]][1]]
    pre = [i for i in have if rest[top[i][1]] is holder]
    assert holder.client().put([keys[i] for i in pre], [vals[i] for i in pre]) == [pb.OK] * len(pre)

    ring = _pb_ring(2, [x, *rest], draining=[x], replicas=2)
    x.admin(ADMIN).drain(ring, int(time.time() * 1000) + 60_000)
    done = h.wait_for(lambda: (s := x.admin(ADMIN).drain_status()).state == "done" and s, 60, what="drain")
    assert done.moved_objects == 61 and done.dropped_objects == 0 and done.remaining_objects == 0
    for j, n in enumerate(rest):
        present = n.client().exists(keys, prefix_only=False).present
        assert list(present) == [j in row for row in top], n.node_id
        got = n.client().get([k for k, row in zip(keys, top, strict=True) if j in row])
        assert [bytes(g) if g is not None else None for g in got] == [v for v, row in zip(vals, top, strict=True)
                                                                     if j in row]
    # The state object keeps one copy, at its primary.
    primary = owners(b"".join(state_key), ids, 1)[0, 0]
    for j, n in enumerate(rest):
        assert list(n.client().exists(state_key, prefix_only=False, kind=pb.STATE).present) == [j == primary]


def test_a_newer_drain_supersedes_one_still_running(stores: Any, h: Any, rng: random.Random) -> None:
    spec = {"dram": "32MiB", "admin_token": ADMIN}
    a, b, c = stores.start_many({f"store-{n}": spec for n in "abc"}).values()
    keys = h.rand_keys(rng, 40)
    vals = h.rand_values(rng, [64 * KiB] * len(keys))
    assert a.client().put(keys, vals) == [pb.OK] * len(keys)

    def at(n: Any) -> int:
        return sum(n.client().exists(keys, prefix_only=False).present)

    deadline = int(time.time() * 1000) + 120_000
    # Epoch 1 drains to b at 256 KiB/s: ~10 s for the 2.5 MiB.
    first = a.admin(ADMIN).drain(_pb_ring(1, [a, b], draining=[a]), deadline, max_bytes_per_second=256 * KiB)
    assert first.epoch == 1
    h.wait_for(lambda: at(b) > 0, 30, what="the first drain's first push")
    # Epoch 2 drains to c instead (b left the ring), unpaced.
    second = a.admin(ADMIN).drain(_pb_ring(2, [a, c], draining=[a]), deadline)
    assert second.epoch == 2 and second.state == "running"
    done = h.wait_for(lambda: (s := a.admin(ADMIN).drain_status()).state == "done" and s, 60, what="drain")
    assert done.epoch == 2 and done.moved_objects == len(keys) and done.dropped_objects == 0
    assert at(c) == len(keys)
    # The older drain stopped: nothing more reaches b (it would for ~10 s at its pace).
    before = at(b)
    assert before < len(keys)
    time.sleep(1.5)
    assert at(b) == before
    # A late call for the older epoch changes nothing.
    late = a.admin(ADMIN).drain(_pb_ring(1, [a, b], draining=[a]), deadline, max_bytes_per_second=256 * KiB)
    assert late.epoch == 2 and late.state == "done"
    time.sleep(1.0)
    assert at(b) == before and a.admin(ADMIN).drain_status().epoch == 2


def test_a_ring_that_makes_the_node_active_again_cancels_its_drain(stores: Any, h: Any, rng: random.Random) -> None:
    """The operator calls a scale-down off by publishing a ring in which the draining node is
    active again: its drain stops (what it pushed stays, as extra copies), and says so."""
    spec = {"dram": "32MiB", "admin_token": ADMIN}
    a, b = stores.start_many({f"store-{n}": spec for n in "ab"}).values()
    keys = h.rand_keys(rng, 40)
    assert a.client().put(keys, h.rand_values(rng, [64 * KiB] * len(keys))) == [pb.OK] * len(keys)

    def at(n: Any) -> int:
        return sum(n.client().exists(keys, prefix_only=False).present)

    deadline = int(time.time() * 1000) + 120_000
    a.admin(ADMIN).drain(_pb_ring(1, [a, b], draining=[a]), deadline, max_bytes_per_second=256 * KiB)
    h.wait_for(lambda: at(b) > 0, 30, what="the drain's first push")
    # A ring without the node does not stop it (the operator removes a drained node mid-push).
    a.admin(ADMIN).set_ring(_pb_ring(2, [b]))
    assert a.admin(ADMIN).drain_status().state == "running"
    a.admin(ADMIN).set_ring(_pb_ring(3, [a, b]))
    h.wait_for(lambda: a.admin(ADMIN).drain_status().state == "cancelled", 30, what="the drain to stop")
    before = at(b)
    assert before < len(keys)
    time.sleep(1.5)  # at its pace the drain would push ~6 more objects meanwhile
    assert at(b) == before and at(a) == len(keys)
