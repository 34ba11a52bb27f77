"""Restoring replication R after an active member left the ring without a drain (a dead node):
the plan (each block that lost a copy gets one push, from its first surviving previous owner, to
its owner that was not one before) and the push between real store processes."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

from kvpool.core.ring import Member, Ring, owners, removed_members
from kvpool.store.warm import plan_warm, warm_targets
from kvpool.wire.proto import store_pb2 as pb

KiB = 1 << 10
ADMIN = "admin-secret"


def _ring(epoch: int, *ids: str, replicas: int = 1, draining: tuple[str, ...] = ()) -> Ring:
    return Ring(epoch, tuple(Member(i, f"addr-{i}", "draining" if i in draining else "active") for i in ids),
                replicas=replicas)


def _pushes(blob: bytes, before: list[str], ring: Ring, added: list[str], removed: list[str],
            r_before: int) -> list[list[tuple[str, str]]]:
    """Per key, the (holder, target) pushes when every previous owner holds the key."""
    n = len(blob) // 32
    active = [m.id for m in ring.active]
    previous = owners(blob, before, r_before).tolist()
    out: list[list[tuple[str, str]]] = [[] for _ in range(n)]
    for holder in active:
        if holder not in before:
            continue
        t = warm_targets(blob, ring, added, holder, removed)
        assert t.shape == (n, min(ring.replicas, len(active)))
        for i, row in enumerate(t.tolist()):
            if before.index(holder) in previous[i]:  # only a previous owner holds the key
                out[i] += [(holder, active[j]) for j in row if j >= 0]
    return out


def test_a_removed_owner_is_replaced_by_one_push_from_the_first_surviving_owner(rng: random.Random) -> None:
    before = ["a", "b", "c", "d"]
    blob = rng.randbytes(32 * 800)
    ring = _ring(3, "a", "b", "c", replicas=2)
    pushes = _pushes(blob, before, ring, [], ["d"], 2)
    prev = owners(blob, before, 2).tolist()
    now = owners(blob, ["a", "b", "c"], 2).tolist()
    lost = 0
    for i in range(800):
        if 3 in prev[i]:  # "d" held a copy: one push, from the other previous owner, to the new one
            lost += 1
            survivor = before[next(j for j in prev[i] if j != 3)]
            new_owner = ["a", "b", "c"][next(j for j in now[i] if before[j] != survivor)]
            assert pushes[i] == [(survivor, new_owner)]
        else:
            assert pushes[i] == []
    assert 300 < lost < 500  # about half the keys had "d" among their 2 owners of 4


def test_two_removed_owners_at_once_with_r3(rng: random.Random) -> None:
    before = ["a", "b", "c", "d", "e"]
    blob = rng.randbytes(32 * 800)
    ring = _ring(4, "a", "b", "c", replicas=3)
    pushes = _pushes(blob, before, ring, [], ["d", "e"], 3)
    prev = owners(blob, before, 3).tolist()
    for i in range(800):
        gone = sum(j >= 3 for j in prev[i])
        survivors = [before[j] for j in prev[i] if j < 3]  # in weight order
        assert len(pushes[i]) == gone
        assert {h for h, _ in pushes[i]} <= {survivors[0]}
        assert {t for _, t in pushes[i]} == {"a", "b", "c"} - set(survivors)


def test_added_and_removed_in_one_epoch(rng: random.Random) -> None:
    before = ["a", "b", "c", "d"]
    blob = rng.randbytes(32 * 800)
    ring = _ring(5, "a", "b", "c", "e", replicas=2)
    pushes = _pushes(blob, before, ring, ["e"], ["d"], 2)
    prev = owners(blob, before, 2).tolist()
    now = owners(blob, ["a", "b", "c", "e"], 2).tolist()
    for i in range(800):
        old = {before[j] for j in prev[i]}
        new = {["a", "b", "c", "e"][j] for j in now[i]}
        first_survivor = next(before[j] for j in prev[i] if before[j] != "d")
        assert sorted(pushes[i]) == sorted((first_survivor, t) for t in new - old)


def test_r1_only_a_stray_copy_is_pushed_and_an_owner_pushes_nothing(rng: random.Random) -> None:
    blob = rng.randbytes(32 * 400)
    ring = _ring(2, "a", "b", "c")
    prev = owners(blob, ["a", "b", "c", "d"], 1)[:, 0].tolist()
    now = ring.owners_of(blob).tolist()
    for holder, h in (("a", 0), ("b", 1)):
        t = warm_targets(blob, ring, [], holder, ["d"])
        for i, row in enumerate(t.tolist()):
            if prev[i] == 3 and now[i] != h:  # the owner died: a copy held anywhere else goes to the new one
                assert row == [now[i]]
            else:  # the owner did not change (or the holder is the new owner): nothing to push
                assert row == [-1]


def test_plan_and_removed_members(rng: random.Random) -> None:
    blob = rng.randbytes(32 * 300)
    ring = _ring(3, "a", "b", replicas=2)
    order = plan_warm(blob, list(range(300)), [1] * 300, ring, [], holder="a", removed=["c"])
    t = warm_targets(blob, ring, [], "a", ["c"])
    assert sorted(order.tolist()) == [i for i in range(300) if (t[i] >= 0).any()]
    assert order.tolist() == sorted(order.tolist(), reverse=True)  # hottest (latest access) first
    assert len(plan_warm(blob, [0.0] * 300, [1] * 300, ring, [], holder="a")) == 0
    assert len(plan_warm(blob, [0.0] * 300, [1] * 300, ring, [], holder="a", removed=["a"])) == 0  # not gone
    # Removed: active before, no member after.  A drained member was draining, a draining one is
    # still a member: neither lost a copy.
    assert removed_members(_ring(1, "a", "b", "c"), _ring(2, "a", "b")) == ["c"]
    assert removed_members(_ring(1, "a", "b", "c", draining=("c",)), _ring(2, "a", "b")) == []
    assert removed_members(_ring(1, "a", "b", "c"), _ring(2, "a", "b", "c", draining=("c",))) == []
    assert removed_members(None, _ring(1, "a")) == []


def _pb_ring(epoch: int, nodes: Any, replicas: int) -> pb.Ring:
    return pb.Ring(epoch=epoch, replicas=replicas, members=[
        pb.RingMember(id=n.node_id, address=n.address, transfer_address=n.transfer_address, state="active")
        for n in nodes])


def test_a_dead_owner_copy_is_restored_so_a_second_death_loses_nothing(stores: Any, h: Any,
                                                                       rng: random.Random) -> None:
    """R=2 over 3 stores; one dies and leaves the ring; the push restores the lost copies; then a
    second original owner dies and every block is still read, byte-exact, from the last one."""
    spec = {"dram": "32MiB", "admin_token": ADMIN}
    nodes = list(stores.start_many({f"rr-{n}": spec for n in "abc"}).values())
    ids = [n.node_id for n in nodes]
    ring1 = _pb_ring(1, nodes, 2)
    for n in nodes:
        n.admin(ADMIN).set_ring(ring1)
    keys = h.rand_keys(rng, 90)
    vals = h.rand_values(rng, [rng.randrange(1, 48 * KiB) for _ in keys])
    top = owners(b"".join(keys), ids, 2).tolist()
    for j, n in enumerate(nodes):  # each block at its 2 owners, as the sidecars write it
        mine = [i for i in range(len(keys)) if j in top[i]]
        assert n.client().put([keys[i] for i in mine], [vals[i] for i in mine], epoch=1) == [pb.OK] * len(mine)
    # One block is at the new owner already (a reader copied it over): it costs no bytes.
    lost = [i for i in range(len(keys)) if 2 in top[i]]
    a, b, c = nodes
    pre = next(i for i in lost if 0 in top[i])  # at a and c: b is its new owner
    assert b.client().put([keys[pre]], [vals[pre]]) == [pb.OK]

    c.kill()
    ring2 = _pb_ring(2, [a, b], 2)
    deadline = int(time.time() * 1000) + 60_000
    for n in (a, b):
        n.admin(ADMIN).warm(ring2, [], deadline, removed=[c.node_id])
    done = [h.wait_for(lambda n=n: (s := n.admin(ADMIN).warm_status()).state == "done" and s, 60,
                       what="the push") for n in (a, b)]
    assert sum(d.moved_objects for d in done) == len(lost) - 1
    assert sum(d.skipped_objects for d in done) == 1
    assert sum(d.failed_objects + d.remaining_objects for d in done) == 0
    assert done[0].epoch == done[1].epoch == 2
    for n in (a, b):
        assert all(n.client().exists(keys, prefix_only=False).present), n.node_id

    a.kill()
    got = b.client().get(keys)
    assert [bytes(g) if g is not None else None for g in got] == vals
    assert np.all(np.asarray(b.client().exists(keys, prefix_only=False).present))
