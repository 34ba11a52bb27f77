"""Routing of the sidecar's pool view: grouping by owner, the read fallbacks during ring
transitions (pure), and which failures mark a node down."""

from __future__ import annotations

import random
import socket
from typing import Any

import grpc
import numpy as np
import pytest

from kvpool.core import errors
from kvpool.core.ring import Member, Ring, owners, weights
from kvpool.pool.fanout import node_is_down
from kvpool.pool.node_client import StoreClient
from kvpool.pool.routing import fallback_routes, group_by_owner
from kvpool.wire.proto import store_pb2 as pb


def _keys(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(32 * n)


def _ring(epoch: int, *ids: str, draining: tuple[str, ...] = ()) -> Ring:
    return Ring(epoch, tuple(Member(i, f"addr-{i}", "draining" if i in draining else "active") for i in ids))


def _where(routes: list[dict[str, np.ndarray]], n: int) -> list[list[str]]:
    """Per key, the fallback nodes in the order they are asked."""
    out: list[list[str]] = [[] for _ in range(n)]
    for r in routes:
        for nid, idx in r.items():
            for i in idx.tolist():
                out[i].append(nid)
    return out


def test_group_by_owner_partitions_in_order() -> None:
    own = np.array([2, 0, 2, 1, 0, 2])
    g = group_by_owner(own, ["a", "b", "c"])
    assert {k: v.tolist() for k, v in g.items()} == {"a": [1, 4], "b": [3], "c": [0, 2, 5]}
    assert group_by_owner(np.array([], dtype=np.intp), ["a"]) == {}


@pytest.mark.parametrize("members", [1, 4, 16, 17, 40])
def test_group_by_owner_is_the_same_partition_for_any_ring_size(members: int) -> None:
    """A few members take one comparison pass each, many take a sort: the same answer."""
    ids = [f"n{i}" for i in range(members)]
    own = np.random.default_rng(members).integers(0, members, 5000)
    g = group_by_owner(own, ids)
    assert sorted(g) == sorted({ids[j] for j in own.tolist()})
    for nid, idx in g.items():
        assert idx.tolist() == [i for i, j in enumerate(own.tolist()) if ids[j] == nid]


def test_no_fallback_in_a_steady_ring(rng: random.Random) -> None:
    assert fallback_routes(_keys(rng, 100), _ring(1, "a", "b", "c")) == []
    assert fallback_routes(b"", _ring(1, "a")) == []
    assert fallback_routes(_keys(rng, 3), Ring(1)) == []


def test_draining_member_is_asked_for_the_keys_it_held(rng: random.Random) -> None:
    blob = _keys(rng, 400)
    ring = _ring(2, "a", "b", "c", draining=("c",))
    where = _where(fallback_routes(blob, ring), 400)
    held = ring.read_fallbacks(blob)
    for i, fb in enumerate(where):
        assert fb == (["c"] if ring.members[held[i]].id == "c" else [])
    assert any(where)


def test_scale_up_falls_back_to_the_previous_owner(rng: random.Random) -> None:
    blob = _keys(rng, 400)
    old, new = _ring(1, "a", "b"), _ring(2, "a", "b", "c")
    where = _where(fallback_routes(blob, new, old), 400)
    before = owners(blob, ["a", "b"])[:, 0]
    after = owners(blob, ["a", "b", "c"])[:, 0]
    for i in range(400):
        if after[i] == 2:  # moved to c: read where it was written
            assert where[i] == [["a", "b"][before[i]]]
        else:
            assert where[i] == []


def test_ranks_find_objects_behind_skipped_epochs(rng: random.Random) -> None:
    """Objects written at any earlier size of a growing ring are found by the ranked fallbacks
    of the current ring alone (a sidecar that never saw the epochs in between)."""
    ids = [f"s{i}" for i in range(5)]
    blob = _keys(rng, 300)
    for size in range(1, 5):
        written_at = owners(blob, ids[:size])[:, 0]
        where = _where(fallback_routes(blob, _ring(9, *ids), ranks=4), 300)
        primary = owners(blob, ids)[:, 0]
        for i in range(300):
            home = ids[written_at[i]]
            assert home == ids[primary[i]] or home in where[i]
    # Ranks follow the rendezvous weights.
    w = weights(blob, ids)
    second = np.argsort(w, axis=1)[:, -2]
    where = _where(fallback_routes(blob, _ring(9, *ids), ranks=1), 300)
    assert [x[0] for x in where] == [ids[j] for j in second.tolist()]


def test_each_fallback_asks_a_new_node(rng: random.Random) -> None:
    blob = _keys(rng, 300)
    ring = _ring(3, "a", "b", "c", "d", draining=("d",))
    routes = fallback_routes(blob, ring, [_ring(2, "a", "b", "d"), _ring(1, "a")], ranks=2)
    primary = owners(blob, ["a", "b", "c"])[:, 0]
    for i, fb in enumerate(_where(routes, 300)):
        asked = [["a", "b", "c"][primary[i]], *fb]
        assert len(asked) == len(set(asked))


@pytest.mark.parametrize("exc,down", [
    (errors.Unavailable("gone"), True),
    (errors.KvpoolError("?"), True),
    (OSError("reset"), True),
    (errors.InvalidArgument("bad kind"), False),
    (errors.Unauthenticated("token"), False),
    (errors.NoSpace("full"), False),
])
def test_only_transport_failures_mark_a_node_down(exc: BaseException, down: bool) -> None:
    assert node_is_down(exc) is down


def test_rpc_status_decides_down(shared: Any, rng: random.Random) -> None:
    """Real failed calls: a refused request leaves the node up, an unreachable node is down."""
    with StoreClient(shared.stores[0]) as c:
        with pytest.raises(grpc.RpcError) as bad:
            c.stub.Remove(pb.RemoveRequest(keys=b"x" * 33), timeout=10)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and not node_is_down(bad.value)
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]  # bound, never listening: connections are refused
        with StoreClient(f"127.0.0.1:{port}", timeout=5) as c, pytest.raises(grpc.RpcError) as gone:
            c.stub.Remove(pb.RemoveRequest(keys=b""), timeout=5)
    assert gone.value.code() == grpc.StatusCode.UNAVAILABLE and node_is_down(gone.value)


def test_catch_up_counts_a_ring_the_background_refresh_learnt_after_the_callers_round() -> None:
    """A reply told of epoch 2 and the refresh loop learnt it before the caller asked: the caller,
    who routed under epoch 1, must still route again (it used to get False and keep its misses)."""
    from kvpool.pool.fanout import Pool

    pool = Pool([])  # no seeds: nothing is asked at construction
    try:
        pool.set_ring(_ring(1, "a", "b"))
        routed = pool.ring.epoch
        pool._note_epoch(2)                # a node answered for epoch 2 ...
        pool.set_ring(_ring(2, "a", "b", "c"))  # ... and the refresh loop learnt it first
        assert pool.catch_up(routed) is True
        assert pool.catch_up() is False    # nothing newer than the current ring
        assert pool.catch_up(pool.ring.epoch) is False
    finally:
        pool.close()


def test_a_ring_is_visible_only_once_each_of_its_members_has_a_client() -> None:
    """Whoever routes by a new ring the moment it is accepted (a writer woken by catch_up, which
    takes no pool lock) must find a client for every member: before, a member that had just
    joined had none yet, and its share of a write failed UNREACHABLE and waited for a backoff
    (``test_stale_ring_write``, more often over TLS)."""
    from kvpool.pool.fanout import Pool

    pool = Pool([])
    seen: list[set[str]] = []
    accept = pool.view.accept

    def watching(ring: Ring) -> bool:
        seen.append(set(pool.nodes))  # the nodes a router finds at the instant the ring shows
        return accept(ring)

    pool.view.accept = watching  # type: ignore[method-assign]
    try:
        pool.set_ring(_ring(1, "a", "b"))
        pool.set_ring(_ring(2, "a", "b", "c"))
        assert [s >= {"a", "b"} for s in seen] == [True, True] and "c" in seen[1]
        assert set(pool.nodes) == {"a", "b", "c"}
    finally:
        pool.close()


def test_a_newer_epoch_is_learnt_in_the_background_and_a_caller_waits_for_it_bounded() -> None:
    """A node names epoch 2: the refresh runs on the pool's threads (no GetRing on the caller's
    thread); a caller's catch-up waits for it at most its bound (a read: one lookup's deadline)
    and sheds past it, and routes again once it landed."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from kvpool.pool.routing import RingView

    release, asked = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        view: RingView

        def refresh() -> None:  # a node that is slow to answer GetRing
            asked.set()
            release.wait(10)
            view.accept(_ring(2, "a", "b", "c"))

        view = RingView(refresh, pool.submit)
        view.accept(_ring(1, "a", "b"))
        view.note_epoch(2)
        view.note_epoch(2)  # one refresh at a time
        assert asked.wait(10) and view.refresh_needed.is_set()
        t0 = time.monotonic()
        assert view.catch_up(1) is False  # no wait: its misses stay misses this time
        assert view.catch_up(1, wait_seconds=0.05) is False  # a hung refresh costs the bound, no more
        assert time.monotonic() - t0 < 1.0
        release.set()
        assert view.catch_up(1, wait_seconds=10) is True  # the writer routes again under epoch 2
        assert view.ring.epoch == 2 and view.catch_up(2) is False and not view.refresh_needed.is_set()
        assert view.history[0].epoch == 1 and view.in_transition


def test_rounds_route_again_under_a_newer_ring_then_fall_back_for_what_is_missing() -> None:
    from kvpool.pool.routing import RingView, rounds

    rng = random.Random(5)
    arr = np.frombuffer(_keys(rng, 64), dtype="V32")
    view = RingView(lambda: None, lambda fn: None, transition_seconds=60)
    view.accept(_ring(1, "a", "b"))
    missing = np.ones(64, dtype=bool)
    seen: list[tuple[bool, dict[str, np.ndarray]]] = []
    for fallback, routes in rounds(view, arr, pb.BLOCK, lambda: missing.copy()):
        seen.append((fallback, routes))
        if len(seen) == 1:
            view.accept(_ring(2, "a", "b", "c"))  # learnt meanwhile (by the background refresh)
            missing[::2] = False                   # half was found at the epoch-1 owners
    assert [f for f, _ in seen[:2]] == [False, False]
    again = np.sort(np.concatenate(list(seen[1][1].values())))
    assert again.tolist() == list(range(1, 64, 2))  # only what was missing, under epoch 2's owners
    assert all(f for f, _ in seen[2:]) and seen[2:], "the epoch-1 owners are asked as fallbacks"
