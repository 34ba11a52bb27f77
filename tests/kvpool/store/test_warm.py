"""Scale-up warm-up between real nodes: the previous owner pushes what the new node now owns."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from kvpool.core import errors
from kvpool.core.ring import owners
from kvpool.wire.proto import store_pb2 as pb

KiB = 1 << 10
ADMIN = "admin-secret"


def _ring(epoch: int, *nodes: Any) -> pb.Ring:
    return pb.Ring(epoch=epoch, members=[
        pb.RingMember(id=n.node_id, address=n.address, state="active", transfer_address=n.transfer_address)
        for n in nodes])


@pytest.fixture(scope="module")
def nodes(module_stores: Any) -> Any:
    spec = {"dram": "16MiB", "admin_token": ADMIN}
    return module_stores.start_many({"warm-a": spec, "warm-b": spec, "warm-c": spec, "warm-d": spec})


def test_warm_pushes_the_moved_objects_hottest_first_and_keeps_its_copies(nodes: Any, h: Any,
                                                                          rng: random.Random) -> None:
    a, b = nodes["warm-a"], nodes["warm-b"]
    for n in (a, b):
        n.admin(ADMIN).set_ring(_ring(1, a))
    keys = h.rand_keys(rng, 60)
    vals = h.rand_values(rng, [rng.choice([1, 4 * KiB, 64 * KiB]) for _ in keys])
    ca = a.client()
    assert ca.put(keys, vals) == [pb.OK] * 60
    state_key = h.rand_keys(rng, 1)
    assert ca.put(state_key, [b"state"], kind=pb.STATE) == [pb.OK]
    moved = [i for i, o in enumerate(owners(b"".join(keys), [a.node_id, b.node_id])[:, 0]) if o == 1]
    assert 10 < len(moved) < 50
    # The new node already holds one of them (a reader copied it over): it is skipped, not re-sent.
    assert b.client().put([keys[moved[0]]], [vals[moved[0]]]) == [pb.OK]
    ring = _ring(2, a, b)
    with pytest.raises(errors.PermissionDenied):
        a.admin().warm(ring, [b.node_id])
    st = a.admin(ADMIN).warm(ring, [b.node_id], int(time.time() * 1000) + 30000)
    assert st.state in ("running", "done") and st.epoch == 2
    done = h.wait_for(lambda: (s := a.admin(ADMIN).warm_status()).state == "done" and s, 30, what="warm-up")
    assert done.planned_objects == len(moved) and done.remaining_objects == 0 and done.failed_objects == 0
    assert done.moved_objects == len(moved) - 1 and done.skipped_objects == 1
    assert done.moved_bytes == sum(len(vals[i]) for i in moved[1:])
    got = b.client().get([keys[i] for i in moved])
    assert [bytes(g) if g is not None else None for g in got] == [vals[i] for i in moved]
    # Only moved blocks went: not the keys a still owns, not the state object.
    stay = [keys[i] for i in range(60) if i not in moved]
    assert b.client().exists(stay, prefix_only=False).present == [False] * len(stay)
    assert b.client().exists(state_key, prefix_only=False, kind=pb.STATE).present == [False]
    # The previous owner keeps its copies (readers falling back still find them).
    assert ca.exists(keys, prefix_only=False).present == [True] * 60
    # Idempotent per epoch: calling again reports the same finished push.
    again = a.admin(ADMIN).warm(ring, [b.node_id])
    assert again.state == "done" and again.moved_objects == done.moved_objects
    # Under the new ring (the warm-up's) those kept copies are foreign at a: evictable, not load
    # (what the operator's autoscaler leaves out); b owns all it holds, the reader's copy included.
    b.admin(ADMIN).set_ring(ring)
    state_at_b = owners(state_key[0], [a.node_id, b.node_id])[0, 0] == 1
    want = sum(len(vals[i]) for i in moved) + (len(b"state") if state_at_b else 0)
    assert a.admin(ADMIN).stats().foreign_bytes == want
    assert b.admin(ADMIN).stats().foreign_bytes == 0
    # What a drops stops counting; a draining node owns nothing.
    assert ca.remove([keys[moved[1]]]) == [pb.OK]
    assert a.admin(ADMIN).stats().foreign_bytes == want - len(vals[moved[1]])
    draining = _ring(3, a, b)
    draining.members[0].state = "draining"
    a.admin(ADMIN).set_ring(draining)
    held = sum(len(vals[i]) for i in range(60) if i != moved[1]) + len(b"state")
    assert a.admin(ADMIN).stats().foreign_bytes == held


def test_warm_bandwidth_bound_and_fraction(nodes: Any, h: Any, rng: random.Random) -> None:
    c, d = nodes["warm-c"], nodes["warm-d"]
    for n in (c, d):
        n.admin(ADMIN).set_ring(_ring(10, c))
    keys = h.rand_keys(rng, 64)
    vals = h.rand_values(rng, [64 * KiB] * len(keys))
    cc = c.client()
    for k, v in zip(keys, vals, strict=True):  # one at a time: the later, the hotter
        assert cc.put([k], [v]) == [pb.OK]
    moved = [i for i, o in enumerate(owners(b"".join(keys), [c.node_id, d.node_id])[:, 0]) if o == 1]
    half = len(moved) // 2
    rate = 1 << 20
    start = time.monotonic()
    c.admin(ADMIN).warm(_ring(11, c, d), [d.node_id], int(time.time() * 1000) + 30000, rate, fraction=0.5)
    mid = h.wait_for(lambda: (s := c.admin(ADMIN).warm_status()).moved_objects > 0 and s, 30, what="first push")
    assert mid.state == "running"  # bounded, the push stays observable
    done = h.wait_for(lambda: (s := c.admin(ADMIN).warm_status()).state == "done" and s, 30, what="warm-up")
    elapsed = time.monotonic() - start
    assert done.planned_objects == half and done.moved_objects == half
    assert elapsed >= (half - 1) * 64 * KiB / rate * 0.95, elapsed
    # The hottest half (the last written) went; the colder half did not.
    hot, cold = sorted(moved)[-half:], sorted(moved)[:-half]
    dc = d.client()
    assert dc.exists([keys[i] for i in hot], prefix_only=False).present == [True] * half
    assert dc.exists([keys[i] for i in cold], prefix_only=False).present == [False] * len(cold)
