"""The local tier's journal decisions, without processes: which slots a restarted sidecar may
adopt (:func:`plan_adoption`), when a journal is not adopted at all (:func:`layout_mismatch`),
the allocator rebuilt from adopted extents, and a tier adopting what a previous one left."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from kvpool.arena.allocator import ExtentAllocator
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS
from kvpool.sidecar import journal as j
from kvpool.sidecar.local_tier import LocalTier
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

A = 4096


def _slots(n: int, records: list[tuple[int, int, int, int, bytes]]) -> np.ndarray:
    """(slot, offset, size, state, key) records in a table of ``n`` slots."""
    s = np.zeros(n, j.SLOT)
    for slot, off, size, state, key in records:
        s[slot]["offset"], s[slot]["size"], s[slot]["state"] = off, size, state
        s[slot]["key"] = np.frombuffer(key.ljust(32, b"\0"), "V32")[0]
    return s


def test_plan_keeps_coherent_commits_and_drops_the_rest() -> None:
    s = _slots(16, [
        (0, 0, 5000, j.COMMITTED, b"a"),        # two units: 0-1
        (2, 2 * A, 100, j.RESERVED, b"b"),      # a write that never committed
        (3, 3 * A, 100, j.COMMITTED, b"c"),
        (4, 5 * A, 100, j.COMMITTED, b"d"),     # offset is not its slot's
        (6, 6 * A, 3 * A, j.COMMITTED, b"e"),   # 6-8, overlaps f
        (8, 8 * A, 100, j.COMMITTED, b"f"),
        (10, 10 * A, 100, j.COMMITTED, b"g"),   # the same key twice: neither
        (11, 11 * A, 100, j.COMMITTED, b"g"),
        (12, 12 * A, 0, j.COMMITTED, b"h"),     # empty
        (13, 13 * A, 4 * A, j.COMMITTED, b"i"),  # past the end of a 16-unit arena
        (14, 14 * A, 100, 7, b"j"),             # unknown state
    ])
    s[15]["kind"] = 9
    s[15]["offset"], s[15]["size"], s[15]["state"] = 15 * A, 10, j.COMMITTED  # unknown kind
    p = j.plan_adoption(s, A, 16 * A)
    assert p.candidates.tolist() == [0, 3]
    assert p.reserved.tolist() == [2]
    assert p.incoherent.tolist() == [4, 6, 8, 10, 11, 12, 13, 14, 15]


def test_plan_of_an_empty_journal_adopts_nothing() -> None:
    p = j.plan_adoption(np.zeros(8, j.SLOT), A, 8 * A)
    assert len(p.candidates) == len(p.reserved) == len(p.incoherent) == 0


def test_layout_mismatch_says_why() -> None:
    want = j.Layout(64 * A, A, "t1")
    head = want.header(12345)
    assert j.layout_mismatch(head, want, 64 * A) == ""
    assert "tenant changed: 't1' -> 't2'" in j.layout_mismatch(head, j.Layout(64 * A, A, "t2"), 64 * A)
    assert "local tier size changed" in j.layout_mismatch(head, j.Layout(128 * A, A, "t1"), 128 * A)
    assert "arena layout changed" in j.layout_mismatch(head, j.Layout(64 * A, 2 * A, "t1"), 64 * A)
    assert "arena file is" in j.layout_mismatch(head, want, 32 * A)
    assert j.layout_mismatch(b"nope" + head[4:], want, 64 * A) == "not a journal"
    assert "truncated" in j.layout_mismatch(head[:10], want, 64 * A)
    assert j.layout_mismatch(want.header(0), want, 64 * A)  # generation 0 is never written


def test_allocator_rebuilt_from_adopted_extents() -> None:
    a = ExtentAllocator.with_allocated(16 * A, A, [(0, 5000), (3 * A, A), (10 * A, 6 * A)])
    a.check()
    assert a.used == 2 * A + A + 6 * A
    assert a.largest_free == 6 * A  # units 4 .. 10 (and 2 .. 3)
    assert a.alloc(6 * A) == 4 * A and a.alloc(A) == 2 * A
    with pytest.raises(ValueError):
        ExtentAllocator.with_allocated(16 * A, A, [(A, A), (0, A)])  # not sorted
    with pytest.raises(ValueError):
        ExtentAllocator.with_allocated(16 * A, A, [(100, A)])  # not aligned


def test_a_tier_adopts_what_the_previous_one_left(tmp_path: Path) -> None:
    rng = random.Random(5)
    sock = str(tmp_path / "s.sock")
    t = LocalTier(1 << 20, str(tmp_path), socket_path=sock, tenant="t")
    keys = [rng.randbytes(32) for _ in range(6)]
    vals = [rng.randbytes(rng.randrange(1, 20_000)) for _ in keys]
    codes, entries, rid = t.reserve(keys, [len(v) for v in vals], pb.BLOCK, DEFAULT_TRAFFIC_CLASS)
    assert codes == [pb.OK] * 6
    for e, v in zip(entries, vals, strict=True):
        assert e is not None
        t.view(e)[:] = v
    from kvpool.core.checksum import checksum
    t.commit(rid, [checksum(v) for v in vals], dirty=True)
    t.remove([keys[5]], pb.BLOCK)
    _, [half], rid2 = t.reserve([rng.randbytes(32)], [5000], pb.STATE, "")  # never committed
    assert half is not None
    generation = t.arena.generation  # type: ignore[union-attr]
    t.arena.close()  # the process dies: nothing else is written (the lock goes with it)
    t2 = LocalTier(1 << 20, str(tmp_path), socket_path=sock, tenant="t")
    assert t2.arena.generation == generation  # type: ignore[union-attr]
    kept, counts = t2.adopt(grace_ms=1)
    assert sorted(e.key for e in kept) == sorted(keys[:5])
    assert all(e.dirty and not e.pooled for e in kept)
    assert counts[SidecarCounter.RESTART_DROPPED_UNCOMMITTED] == 1
    assert counts[SidecarCounter.RESTART_DROPPED_OBJECTS] == 1
    found, _ = t2.lookup(keys, pb.BLOCK)
    assert [bytes(t2.view(e)) if e else None for e in found] == vals[:5] + [None]
    t2.arena.alloc.check()
    # The quarantined extent is in use until its time is up; the rest of the arena is free.
    assert t2.used == sum(t2.arena.alloc.rounded(len(v)) for v in vals[:5]) + t2.arena.alloc.rounded(5000)
    t2.close()
    # Another tenant: not adopted, a new arena (a new inode and generation).
    t3 = LocalTier(1 << 20, str(tmp_path), socket_path=sock, tenant="u")
    assert t3.arena.opened.reset_reason.startswith("tenant changed")  # type: ignore[union-attr]
    assert t3.arena.generation != generation  # type: ignore[union-attr]
    assert t3.adopt(grace_ms=1) == ([], {})
    t3.close()
    j.remove_files(str(tmp_path), sock)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("kvpool-sidecar-")]


def test_a_second_live_owner_is_refused(tmp_path: Path) -> None:
    sock = str(tmp_path / "s.sock")
    t = LocalTier(1 << 20, str(tmp_path), socket_path=sock, tenant="t")
    try:
        with pytest.raises(RuntimeError, match="another live sidecar"):
            LocalTier(1 << 20, str(tmp_path), socket_path=sock, tenant="t")
    finally:
        t.close()


def test_files_of_a_sidecar_that_cannot_come_back_are_swept(tmp_path: Path) -> None:
    """A sidecar killed with its test cluster leaves its arena in shared memory; the next
    sidecar starting in that directory removes it once the socket's directory is gone (never
    while a process holds it, never a pod's: its socket lives in the same directory)."""
    shm, gone, kept = tmp_path / "shm", tmp_path / "workdir-gone", tmp_path / "workdir-kept"
    for d in (shm, gone, kept):
        d.mkdir()
    alive = LocalTier(1 << 20, str(shm), socket_path=str(gone / "alive.sock"), tenant="t")
    for d in (gone, kept):
        LocalTier(1 << 20, str(shm), socket_path=str(d / "s.sock"), tenant="t").close()
    assert j.orphaned(j.Layout(A, A, "t").header(1, str(gone / "s.sock")), dir_exists=False)
    assert not j.orphaned(j.Layout(A, A, "t").header(1, str(gone / "s.sock")), dir_exists=True)
    assert not j.orphaned(j.Layout(A, A, "t").header(1), dir_exists=False)  # no socket recorded
    gone.rmdir()
    assert j.sweep_orphans(str(shm)) == 1
    left = sorted(os.listdir(shm))
    assert all(os.path.exists(p) for p in j.paths(str(shm), str(kept / "s.sock")))
    assert all(os.path.exists(p) for p in j.paths(str(shm), str(gone / "alive.sock")))  # its lock is held
    assert not any(os.path.exists(p) for p in j.paths(str(shm), str(gone / "s.sock"))), left
    alive.close()


def test_the_operator_sizes_the_volume_for_what_a_sidecar_creates(tmp_path: Path) -> None:
    """The files a persistent local tier creates in the shared-memory volume add up to exactly
    ``kvpool.core.sizing.sidecar_shm_bytes``, the number the operator's injection sizes the pod's
    memory-backed emptyDir by (a volume smaller than its files gets the pod evicted)."""
    from kvpool.core.sizing import sidecar_shm_bytes
    local = 8 << 20
    tier = LocalTier(local, str(tmp_path), socket_path=str(tmp_path / "kvpool.sock"), tenant="t")
    try:
        files = sum(p.stat().st_size for p in tmp_path.iterdir() if p.is_file())
        assert files == sidecar_shm_bytes(local)
    finally:
        tier.close()
