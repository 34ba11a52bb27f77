"""ArenaIndex (``kvpool.arena.index``), pure: the entry state machine, two-phase writes, leases
and reservations with expiry, lazy pins, per-level LRU, tokens and who frees a dead extent."""

from __future__ import annotations

import pytest

from kvpool.arena.allocator import ExtentAllocator
from kvpool.arena.index import (
    BLOCK,
    COMMITTED,
    DEAD,
    RESERVED,
    STATE,
    ArenaIndex,
    Entry,
    State,
    index_key,
)
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS

A = 4096
T = "t"


def _index(pins_hold: bool = False, levels: int = 1) -> tuple[ArenaIndex, list[ExtentAllocator]]:
    allocs = [ExtentAllocator(64 * A, A) for _ in range(levels)]
    return ArenaIndex(allocs, pins_hold_extent=pins_hold), allocs


def _reserve(idx: ArenaIndex, alloc: ExtentAllocator, key: bytes, kind: int = BLOCK, tenant: str = T) -> Entry:
    e = Entry(key, tenant, kind, DEFAULT_TRAFFIC_CLASS, 100, alloc.alloc(100))
    idx.reserve(e)
    return e


def test_the_states_are_one_set_of_names() -> None:
    assert [s.name for s in State] == ["RESERVED", "COMMITTING", "COMMITTED", "DEAD"]
    assert len({int(s) for s in State}) == 4
    assert index_key(b"k", BLOCK) != index_key(b"k", STATE)


def test_a_reserved_entry_is_found_but_never_matched_until_published() -> None:
    idx, [alloc] = _index()
    e = _reserve(idx, alloc, b"a" * 32)
    assert idx.get(T, e.key, BLOCK) is e and e.state == RESERVED
    assert idx.committed(T, e.key, BLOCK) is None
    assert idx.match_blocks(T, [e.key]) == [None] and idx.count() == 0
    idx.publish(e, now=5.0)
    assert e.state == COMMITTED and e.last_access == 5.0
    assert idx.match_blocks(T, [e.key, b"x" * 32]) == [e, None]
    assert idx.lookup(T, [e.key], BLOCK) == [e] and idx.lru() == [e]
    assert idx.block_keys(T) == [e.key] and idx.block_keys("other") == []


def test_partitions_and_kinds_keep_objects_apart() -> None:
    idx, [alloc] = _index()
    b = _reserve(idx, alloc, b"k" * 32, BLOCK)
    s = _reserve(idx, alloc, b"k" * 32, STATE)
    o = _reserve(idx, alloc, b"k" * 32, BLOCK, tenant="u")
    for e in (b, s, o):
        idx.publish(e, 1.0)
    assert idx.lookup(T, [b.key], BLOCK) == [b] and idx.lookup(T, [b.key], STATE) == [s]
    assert idx.lookup("u", [b.key], BLOCK) == [o] and idx.lookup("u", [b.key], STATE) == [None]
    assert idx.match_blocks(T, [b.key]) == [b]  # state objects never count as a match


def test_forget_frees_at_once_unless_a_transfer_holds_the_extent() -> None:
    idx, [alloc] = _index()
    e = _reserve(idx, alloc, b"a" * 32)
    idx.publish(e, 1.0)
    idx.hold([e])
    idx.forget(e)
    assert e.state == DEAD and idx.get(T, e.key, BLOCK) is None and idx.count() == 0
    assert alloc.used == A  # still in flight
    idx.release_inflight(e)
    assert alloc.used == 0 and e.offset == -1


def test_pins_hold_the_extent_only_where_the_owner_says_so() -> None:
    for pins_hold, used_after_forget in ((True, A), (False, 0)):
        idx, [alloc] = _index(pins_hold)
        e = _reserve(idx, alloc, b"a" * 32)
        idx.publish(e, 1.0)
        lease = idx.new_lease([e], expires=10.0)
        idx.forget(e)
        assert alloc.used == used_after_forget
        idx.drop_lease(lease)
        assert alloc.used == 0 and e.pins == 0


def test_reservations_expire_by_the_heap_and_hand_back_what_is_still_reserved() -> None:
    idx, [alloc] = _index()
    a, b = _reserve(idx, alloc, b"a" * 32), _reserve(idx, alloc, b"b" * 32)
    rid = idx.open_reservation(T, [a, None, b], expires=10.0)
    assert idx.issued(rid) and not idx.issued(rid + 1)
    assert idx.reservation(rid) is not None
    idx.publish(a, 1.0)  # committed meanwhile: not handed back
    assert idx.sweep(9.9) == (0, [])
    assert idx.sweep(10.0) == (0, [b])
    assert idx.reservation(rid) is None and idx.close_reservation(rid) is None


def test_a_closed_reservation_is_taken_exactly_once() -> None:
    idx, [alloc] = _index()
    rid = idx.open_reservation(T, [_reserve(idx, alloc, b"a" * 32)], expires=10.0)
    assert idx.close_reservation(rid) is not None
    assert idx.close_reservation(rid) is None
    assert idx.sweep(11.0) == (0, [])  # its heap entry names nothing any more


def test_leases_expire_release_per_tenant_and_count_lazy_pins_only_when_asked() -> None:
    idx, [alloc] = _index()
    e = _reserve(idx, alloc, b"a" * 32)
    idx.publish(e, 1.0)
    lazy = idx.new_lease([e], expires=5.0, tenant=T, lazy=True)
    assert e.pins == 0  # recorded, not counted
    idx.settle_pins()
    assert e.pins == 1
    eager = idx.new_lease([e], expires=7.0, tenant=T)
    assert e.pins == 2
    idx.release([eager.lease_id], tenant="someone-else")
    assert e.pins == 2 and idx.live(eager)
    assert idx.sweep(5.0) == (1, []) and e.pins == 1 and not idx.live(lazy)
    idx.release([eager.lease_id], tenant=T)
    assert e.pins == 0 and idx.lease(eager.lease_id) is None
    # A lazy lease released before anything settled leaves no pin behind.
    third = idx.new_lease([e], expires=9.0, lazy=True)
    idx.drop_lease(third)
    idx.settle_pins()
    assert e.pins == 0


def test_write_tokens_die_with_their_entry() -> None:
    idx, [alloc] = _index()
    e = _reserve(idx, alloc, b"a" * 32)
    tok = idx.bind_token(e)
    assert tok and idx.by_token(tok) is e and idx.token_count() == 1
    idx.publish(e, 1.0)
    idx.forget(e)
    assert idx.by_token(tok) is None and idx.token_count() == 0


def test_each_level_has_its_own_lru_and_a_move_frees_the_old_extent() -> None:
    idx, (dram, ssd) = _index(levels=2)
    a, b = _reserve(idx, dram, b"a" * 32), _reserve(idx, dram, b"b" * 32)
    idx.publish(a, 1.0)
    idx.publish(b, 2.0)
    assert idx.lru(0) == [a, b]
    idx.touch(a, 3.0)
    assert idx.lru(0) == [b, a] and a.last_access == 3.0
    idx.move(a, 1, ssd.alloc(100))
    assert a.tier == 1 and idx.lru(0) == [b] and idx.lru(1) == [a]
    assert dram.used == A and ssd.used == A
    idx.forget(a)
    assert ssd.used == 0 and idx.count(1) == 0


def test_ids_start_at_a_random_base() -> None:
    one, _ = _index()
    two, _ = _index()
    assert abs(one.next_id() - two.next_id()) > 1 << 20


def test_adopt_indexes_a_committed_object_without_an_lru_on_a_level_without_extents() -> None:
    idx = ArenaIndex([ExtentAllocator(64 * A, A), None], pins_hold_extent=False)
    e = Entry(b"f" * 32, T, BLOCK, "", 100)
    e.state, e.tier = COMMITTED, 1
    idx.adopt(e)
    assert idx.match_blocks(T, [e.key]) == [e] and idx.count(1) == 0
    with pytest.raises(AssertionError):
        idx.alloc(1)
