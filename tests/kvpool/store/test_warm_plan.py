"""Which objects a previous owner pushes on scale-up, in which order (pure)."""

from __future__ import annotations

import random

import numpy as np

from kvpool.core.ring import Member, Ring, owners
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS
from kvpool.store.push import pace_delay
from kvpool.store.warm import added_members, plan_warm


def _ring(epoch: int, *ids: str) -> Ring:
    return Ring(epoch, tuple(Member(i, f"{i}:1") for i in ids))


def _keys(n: int, seed: int = 7) -> list[bytes]:
    r = random.Random(seed)
    return [r.randbytes(32) for _ in range(n)]


def test_only_objects_owned_by_an_added_member_move_hottest_first() -> None:
    keys = _keys(400)
    blob = b"".join(keys)
    ring = _ring(2, "a", "b", "c")
    la = np.arange(400, dtype=np.float64)  # key i last used at time i: the later, the hotter
    order = plan_warm(blob, la, [100] * 400, ring, ["c"])
    own = owners(blob, ["a", "b", "c"])[:, 0]
    assert set(order.tolist()) == set(np.flatnonzero(own == 2).tolist())
    assert 80 < len(order) < 190  # about a third moved, the rest stays
    assert list(la[order]) == sorted(la[order], reverse=True)
    # Rendezvous: what moved to c had the same owner under the old ring as now among a and b.
    old = owners(blob, ["a", "b"])[:, 0]
    stay = np.flatnonzero(own != 2)
    assert (own[stay] == old[stay]).all()


def test_a_fraction_keeps_only_the_hottest_bytes() -> None:
    keys = _keys(300)
    blob = b"".join(keys)
    ring = _ring(3, "a", "b")
    la = np.random.default_rng(1).random(300)
    sizes = [1000] * 300
    everything = plan_warm(blob, la, sizes, ring, ["b"])
    part = plan_warm(blob, la, sizes, ring, ["b"], fraction=0.25)
    assert len(part) == len(everything) // 4
    assert part.tolist() == everything[:len(part)].tolist()  # the hottest, in the same order
    assert plan_warm(blob, la, sizes, ring, ["b"], fraction=1.0).tolist() == everything.tolist()


def test_nothing_moves_without_added_members_or_objects() -> None:
    ring = _ring(2, "a", "b")
    assert len(plan_warm(b"", [], [], ring, ["b"])) == 0
    assert len(plan_warm(b"".join(_keys(10)), [0.0] * 10, [1] * 10, ring, [])) == 0
    assert len(plan_warm(b"".join(_keys(10)), [0.0] * 10, [1] * 10, ring, ["zz"])) == 0


def test_added_members_are_the_new_active_ones() -> None:
    assert added_members(_ring(1, "a", "b"), _ring(2, "a", "b", "c", "d")) == ["c", "d"]
    assert added_members(_ring(1, "a", "b"), _ring(2, "a")) == []
    assert added_members(None, _ring(1, "a")) == ["a"]
    draining = Ring(3, (Member("a", "a:1"), Member("b", "b:1", "draining")))
    assert added_members(_ring(2, "a"), draining) == []


def test_the_push_is_paced_by_the_drain_bound() -> None:
    # 10 MiB pushed at 5 MiB/s must take 2 s: after 0.5 s the pusher waits 1.5 s.
    assert pace_delay(10 << 20, 0.5, 5 << 20) == 1.5


class _E:
    def __init__(self, size: int, tenant: str = "t", tclass: str = DEFAULT_TRAFFIC_CLASS, kind: int = 0) -> None:
        self.size, self.tenant, self.traffic_class, self.kind = size, tenant, tclass, kind


def test_batches_split_by_target_tenant_class_kind_count_and_bytes() -> None:
    from kvpool.store.push import batches

    es = [_E(10), _E(10), _E(10, tenant="u"), _E(10, tenant="u"), _E(10, tclass="agent"), _E(50), _E(10)]
    got = batches(es, [0, 0, 0, 0, 0, 1, 1], max_objects=16, max_bytes=55)
    assert [(t, [es.index(e) for e in run]) for t, run in got] == [(0, [0, 1]), (0, [2, 3]), (0, [4]), (1, [5]),
                                                                    (1, [6])]
    assert [len(r) for _, r in batches([_E(1)] * 40, [0] * 40, max_objects=16)] == [16, 16, 8]
    assert [len(r) for _, r in batches([_E(100)] * 3, [0] * 3, max_bytes=10)] == [1, 1, 1]  # one alone may exceed
    assert batches([], []) == []
    # The drain moves state objects too: a put carries one kind (the two blocks apart from the
    # state objects between them still share a batch).
    mixed = [_E(1), _E(1, kind=1), _E(1, kind=1), _E(1)]
    assert [[mixed.index(e) for e in r] for _, r in batches(mixed, [0] * 4)] == [[0, 3], [1, 2]]


def test_a_push_interleaving_its_owners_goes_out_in_full_batches() -> None:
    from kvpool.store.push import batches

    es = [_E(10) for _ in range(96)]
    got = batches(es, [0, 1, 2] * 32, max_objects=16)
    # Runs of neighbours would be 96 puts of one object; grouped, 6 of 16, hottest batch first.
    assert [(t, len(r)) for t, r in got] == [(0, 16), (1, 16), (2, 16)] * 2
    assert [es.index(e) for e in got[0][1]] == list(range(0, 48, 3))


def test_grouping_moves_no_object_further_than_the_window() -> None:
    from kvpool.store.push import batches

    r = random.Random(3)
    n, window = 3000, 64
    es = [_E(r.choice([1, 100, 900]), tenant=r.choice("tu"), kind=r.choice([0, 0, 0, 1])) for _ in range(n)]
    targets = [r.randrange(5) for _ in range(n)]
    got = batches(es, targets, max_objects=16, max_bytes=2000, window=window)
    place = {id(e): i for i, e in enumerate(es)}
    flat = [place[id(e)] for _, run in got for e in run]
    assert sorted(flat) == list(range(n))  # every object once
    # Out at most a window after its place, or before it.
    assert all(abs(pos - i) <= window for pos, i in enumerate(flat))
    firsts = []
    for t, run in got:
        idx = [place[id(e)] for e in run]
        assert idx == sorted(idx) and len(run) <= 16
        assert len({(targets[i], es[i].tenant, es[i].kind) for i in idx}) == 1 and targets[idx[0]] == t
        assert sum(e.size for e in run) <= 2000 or len(run) == 1
        firsts.append(idx[0])
    assert firsts == sorted(firsts)  # batches in the order of their hottest object
    # Far fewer puts than runs of neighbours would make (about one object each here).
    runs = 1 + sum(1 for i in range(1, n) if (targets[i], es[i].tenant, es[i].kind)
                   != (targets[i - 1], es[i - 1].tenant, es[i - 1].kind))
    assert len(got) < runs / 3


def test_a_cold_straggler_waits_no_longer_than_the_window() -> None:
    from kvpool.store.push import batches

    es = [_E(1) for _ in range(202)]
    got = batches(es, [0] + [1] * 200 + [0], max_objects=16, window=128)
    # The hottest object, alone with its owner, goes first once the walk is a window past it,
    # ahead of the full batches that waited behind it; the other object of its owner comes
    # too late to join it.
    assert [es.index(e) for e in got[0][1]] == [0]
    assert [len(r) for t, r in got if t == 1] == [16] * 12 + [8]
    assert [es.index(e) for e in got[-1][1]] == [201]
