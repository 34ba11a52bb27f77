"""The caller's ring epoch at real nodes (DESIGN §6): a write routed by an older ring than the
node's is refused WRONG_OWNER for the keys the node does not own, over the data session and over
gRPC alike; node-to-node pushes (drain) are not refused for a ring the target has moved past."""

from __future__ import annotations

import random
import time
from typing import Any

from kvpool.core.ring import owners
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB = 1 << 10
ADMIN = "admin-secret"


def _ring(epoch: int, *members: tuple[Any, str]) -> pb.Ring:
    return pb.Ring(epoch=epoch, members=[
        pb.RingMember(id=n.node_id, address=n.address, state=state, transfer_address=n.transfer_address)
        for n, state in members])


def _set_ring(ring: pb.Ring, *nodes: Any) -> None:
    for n in nodes:
        assert n.admin(ADMIN).set_ring(ring).epoch == ring.epoch


def test_a_put_routed_by_a_stale_epoch_is_refused_for_the_keys_the_node_does_not_own(
        stores: Any, h: Any, rng: random.Random) -> None:
    a, b = stores.start_many({"store-a": {"admin_token": ADMIN}, "store-b": {"admin_token": ADMIN}}).values()
    _set_ring(_ring(1, (a, "active")), a, b)
    ca = a.client()
    held = h.rand_keys(rng, 8)  # written at epoch 1, when a owned everything
    assert ca.put(held, [b"old"] * 8, epoch=1) == [pb.OK] * 8
    _set_ring(_ring(2, (a, "active"), (b, "active")), a, b)

    keys = held + h.rand_keys(rng, 56)
    mine = [o == 0 for o in owners(b"".join(keys), [a.node_id, b.node_id])[:, 0].tolist()]
    assert 8 < sum(mine) < 56
    vals = h.rand_values(rng, [rng.randrange(1, 8 * KiB) for _ in keys])
    # A writer still at epoch 1 sends everything to a: b's keys come back WRONG_OWNER (those a
    # still holds from epoch 1 too), a's own are written (or already there) as before.
    codes = ca.put(keys, vals, epoch=1)
    assert codes == [(pb.ALREADY_EXISTS if i < 8 else pb.OK) if m else pb.WRONG_OWNER for i, m in enumerate(mine)]
    assert ca.epoch_seen == 2  # the answer names the ring to learn
    new = [i for i in range(8, 64) if mine[i]]
    assert [bytes(v) if v is not None else None for v in ca.get([keys[i] for i in new])] == [vals[i] for i in new]
    refused = [keys[i] for i in range(8, 64) if not mine[i]]
    assert ca.exists(refused, prefix_only=False).present == [False] * len(refused)
    assert a.client(ADMIN).stats().counters[StoreCounter.REFUSED_WRONG_OWNER] == 64 - sum(mine)

    # Routed by the node's own epoch, by a newer one (the node is behind), or by none (a caller
    # that knows no ring): taken as before.
    for epoch in (2, 3, 0):
        more = h.rand_keys(rng, 16)
        assert ca.put(more, [b"v"] * 16, epoch=epoch) == [pb.OK] * 16
    # b, at the newest epoch too, takes its keys from the writer that learnt the ring.
    cb = b.client()
    assert cb.put(refused, [vals[keys.index(k)] for k in refused], epoch=2) == [pb.OK] * len(refused)


def test_a_drain_push_is_taken_by_a_target_that_moved_past_the_drain_ring(
        stores: Any, h: Any, rng: random.Random) -> None:
    """The operator removes the leaving node (a newer epoch) while its last pushes, routed by the
    drain ring, are on their way: the active members, and so every owner, are the same in both
    rings, so none of those pushes is refused."""
    spec = {"admin_token": ADMIN}
    a, b, c = stores.start_many({"store-a": spec, "store-b": spec, "store-c": spec}).values()
    _set_ring(_ring(1, (a, "active"), (b, "active"), (c, "active")), a, b, c)
    ca = a.client()
    keys = h.rand_keys(rng, 96)
    vals = h.rand_values(rng, [rng.randrange(1, 16 * KiB) for _ in keys])
    assert ca.put(keys, vals) == [pb.OK] * 96  # epoch 0: a takes them all
    _set_ring(_ring(3, (b, "active"), (c, "active")), b, c)  # a is gone from the targets' ring
    drain = _ring(2, (a, "draining"), (b, "active"), (c, "active"))
    a.admin(ADMIN).drain(drain, int(time.time() * 1000) + 60_000)
    done = h.wait_for(lambda: (s := a.admin(ADMIN).drain_status()).state == "done" and s, 60, what="drain")
    assert done.moved_objects == 96 and done.dropped_objects == 0
    for n in (b, c):
        assert n.client(ADMIN).stats().counters[StoreCounter.REFUSED_WRONG_OWNER] == 0
    got = {}
    for n in (b, c):
        for k, v in zip(keys, n.client().get(keys), strict=True):
            if v is not None:
                got[k] = bytes(v)
    assert got == dict(zip(keys, vals, strict=True))
