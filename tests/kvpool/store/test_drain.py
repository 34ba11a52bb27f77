"""Drain between two real nodes: ring via SetRing (admin), objects pushed to the new owner."""

from __future__ import annotations

import base64
import random
import time
from typing import Any

import pytest

from kvpool.core import errors
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB = 1 << 10
ADMIN = "admin-secret"
TENANTS = [{"tenantId": "alpha", "token": "tok-alpha", "salt": base64.b64encode(b"sa").decode()}]


def _ring(epoch: int, a: Any, b: Any, a_state: str = "active") -> pb.Ring:
    return pb.Ring(epoch=epoch, members=[
        pb.RingMember(id=a.node_id, address=a.address, state=a_state, transfer_address=a.transfer_address),
        pb.RingMember(id=b.node_id, address=b.address, state="active", transfer_address=b.transfer_address)])


@pytest.fixture(scope="module")
def nodes(module_stores: Any) -> Any:
    spec = {"dram": "16MiB", "tenants": TENANTS, "admin_token": ADMIN}
    return module_stores.start_many({"store-a": spec, "store-b": spec, "store-d": spec,
                                     "store-e": spec, "store-f": spec, "store-g": spec, "store-h": spec})


def test_drain_moves_every_object_to_the_new_owner(nodes: Any, h: Any, rng: random.Random) -> None:
    a, b = nodes["store-a"], nodes["store-b"]
    for n in (a, b):
        assert n.admin(ADMIN).set_ring(_ring(1, a, b)).epoch == 1
    # Objects of two tenants (the open default one and alpha), block and state kinds.
    ca, cal = a.client(), a.client("tok-alpha")
    keys = h.rand_keys(rng, 40)
    vals = h.rand_values(rng, [rng.choice([1, 4 * KiB, 128 * KiB, 200 * KiB]) for _ in keys])
    assert ca.put(keys[:20], vals[:20]) == [pb.OK] * 20
    assert cal.put(keys[20:36], vals[20:36]) == [pb.OK] * 16
    assert cal.put(keys[36:], vals[36:], kind=pb.STATE) == [pb.OK] * 4
    with pytest.raises(errors.PermissionDenied):
        a.admin("tok-alpha").drain(_ring(2, a, b, "draining"), int(time.time() * 1000) + 30000)
    st = a.admin(ADMIN).drain(_ring(2, a, b, "draining"), int(time.time() * 1000) + 30000)
    assert st.state in ("running", "done") and st.epoch == 2
    # While draining, the leaving node takes no new writes.
    assert ca.put(h.rand_keys(rng, 1), [b"new"]) == [pb.DRAINING]
    done = h.wait_for(lambda: (s := a.admin(ADMIN).drain_status()).state == "done" and s, 30, what="drain")
    assert done.moved_objects == 40 and done.dropped_objects == 0 and done.remaining_objects == 0
    assert done.moved_bytes == sum(len(v) for v in vals)
    # Everything is readable at the target, byte-exact, in the right tenant and kind.
    cb, cbl = b.client(), b.client("tok-alpha")
    assert [bytes(g) if g is not None else None for g in cb.get(keys[:20])] == vals[:20]
    assert [bytes(g) if g is not None else None for g in cbl.get(keys[20:36])] == vals[20:36]
    assert [bytes(g) if g is not None else None for g in cbl.get(keys[36:], kind=pb.STATE)] == vals[36:]
    assert cb.exists(keys[20:36], prefix_only=False).present == [False] * 16  # not leaked to default
    assert b.client(ADMIN).stats().counters[StoreCounter.STORED] == 40
    # Calling Drain again for the same epoch is idempotent (an operator restart resumes).
    again = a.admin(ADMIN).drain(_ring(2, a, b, "draining"), int(time.time() * 1000) + 30000)
    assert again.state == "done" and again.moved_objects == 40


def test_drain_to_a_dead_target_counts_drops(nodes: Any, h: Any, rng: random.Random) -> None:
    b, d = nodes["store-b"], nodes["store-d"]
    cb = b.client()
    keys = h.rand_keys(rng, 6)
    assert cb.put(keys, h.rand_values(rng, [4 * KiB] * 6)) == [pb.OK] * 6
    total = sum(t.objects for t in b.client(ADMIN).stats().tenants)
    d.kill()
    b.admin(ADMIN).drain(_ring(5, b, d, "draining"), int(time.time() * 1000) + 20000)
    done = h.wait_for(lambda: (s := b.admin(ADMIN).drain_status()).state == "done" and s, 60, what="drain")
    assert done.epoch == 5 and done.moved_objects == 0 and done.dropped_objects == total
    assert b.client().health().ok
    # The objects are still on the leaving node (a drop is counted, never silent).
    assert cb.exists(keys).prefix == 6


def test_drain_never_moves_a_revoked_tenant_into_the_open_partition(nodes: Any, h: Any, rng: random.Random) -> None:
    e, f = nodes["store-e"], nodes["store-f"]
    keys = h.rand_keys(rng, 5)
    assert e.client("tok-alpha").put(keys, h.rand_values(rng, [4 * KiB] * 5)) == [pb.OK] * 5
    e.admin(ADMIN).set_tenants([], replace=True)  # alpha's token is revoked on the leaving node
    e.admin(ADMIN).drain(_ring(7, e, f, "draining"), int(time.time() * 1000) + 20000)
    done = h.wait_for(lambda: (s := e.admin(ADMIN).drain_status()).state == "done" and s, 30, what="drain")
    assert done.moved_objects == 0 and done.dropped_objects == 5
    assert f.client().exists(keys, prefix_only=False).present == [False] * 5
    assert f.client("tok-alpha").exists(keys, prefix_only=False).present == [False] * 5


def test_drain_bandwidth_bound_paces_the_push(nodes: Any, h: Any, rng: random.Random) -> None:
    a, b = nodes["store-g"], nodes["store-h"]
    for n in (a, b):
        n.admin(ADMIN).set_ring(_ring(20, a, b))
    keys = h.rand_keys(rng, 24)
    vals = h.rand_values(rng, [64 * KiB] * len(keys))  # 1.5 MiB
    assert a.client().put(keys, vals) == [pb.OK] * len(keys)
    rate = 1 << 20  # 1 MiB/s: the push cannot finish in under ~1.4 s (the first object goes at once)
    start = time.monotonic()
    a.admin(ADMIN).drain(_ring(21, a, b, "draining"), int(time.time() * 1000) + 30000, max_bytes_per_second=rate)
    mid = h.wait_for(lambda: (s := a.admin(ADMIN).drain_status()).moved_objects > 0 and s, 30, what="first push")
    assert mid.state == "running"  # a bound leaves the drain observable while it runs
    done = h.wait_for(lambda: (s := a.admin(ADMIN).drain_status()).state == "done" and s, 30, what="drain")
    elapsed = time.monotonic() - start
    assert done.moved_objects == len(keys) and done.dropped_objects == 0
    # A lower bound only (pacing cannot make it faster, a slow machine only slower).
    assert elapsed >= (sum(map(len, vals)) - 64 * KiB) / rate * 0.95, elapsed
    assert [bytes(g) if g is not None else None for g in b.client().get(keys)] == vals


def test_a_drain_cut_by_its_deadline_moved_the_hottest_and_counts_the_rest(
        stores: Any, h: Any, rng: random.Random) -> None:
    """Batches gather one owner's objects from a window of the hottest-first order: when the
    deadline cuts the drain, what moved is the hottest part (up to that window) and every object
    is counted once, moved or dropped."""
    spec = {"dram": "48MiB", "admin_token": ADMIN}
    a, *targets = stores.start_many({f"store-{n}": spec for n in "pqrs"}).values()
    members = [pb.RingMember(id=n.node_id, address=n.address, transfer_address=n.transfer_address)
               for n in targets]
    ca = a.client()
    keys = h.rand_keys(rng, 960)
    for i in range(0, len(keys), 16):  # the later written, the hotter
        assert ca.put(keys[i:i + 16], h.rand_values(rng, [8 * KiB] * 16)) == [pb.OK] * 16
        time.sleep(0.002)
    ring = pb.Ring(epoch=3, members=[pb.RingMember(id=a.node_id, address=a.address, state="draining",
                                                   transfer_address=a.transfer_address), *members])
    # 7.5 MiB at 1 MiB/s cannot be done by a deadline 3 s away (and the first batch goes at once).
    a.admin(ADMIN).drain(ring, int(time.time() * 1000) + 3000, max_bytes_per_second=1 << 20)
    done = h.wait_for(lambda: (s := a.admin(ADMIN).drain_status()).state == "done" and s, 60, what="drain")
    assert done.moved_objects > 0 and done.dropped_objects > 0 and done.remaining_objects == 0
    assert done.moved_objects + done.dropped_objects == len(keys)
    assert done.moved_bytes + done.dropped_bytes == len(keys) * 8 * KiB
    present = [n.client().exists(keys, prefix_only=False).present for n in targets]
    at_targets = [sum(p[i] for p in present) for i in range(len(keys))]
    assert sum(at_targets) == done.moved_objects and max(at_targets) == 1
    moved = [i for i, there in enumerate(at_targets) if there]
    hottest_first = len(keys) - 1 - min(moved)  # places behind the hottest object of the coldest moved
    assert hottest_first < done.moved_objects + 128 + 16  # the window, and a put's objects share a time
