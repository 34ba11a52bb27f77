"""Tier moves of a store node in-process (``kvpool.tiers.chain``): a demotion in flight keeps its
object readable from DRAM and is undone when the object is read or removed meanwhile; a read of
an object on a stalled disk is a miss within its bound.  The disk is slowed by the tier's
fault hook (a file holding the seconds each SSD I/O sleeps)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvpool.core.checksum import checksum
from kvpool.core.errors import Code
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS
from kvpool.store.node import NodeConfig, StoreNode
from kvpool.tiers.base import Location
from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB = 1 << 10
T = "default"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[StoreNode]:
    n = StoreNode(NodeConfig(node_id="d", shm_dir=str(tmp_path), dram_bytes=1 << 20, ssd_path=str(tmp_path / "ssd"),
                             ssd_bytes=8 << 20, fault_tier_delay_file=str(tmp_path / "delay"),
                             tier_read_seconds=10.0, demote_wait_seconds=10.0))  # each test sets its bound
    yield n
    n.close()


def _slow(node: StoreNode, seconds: float) -> None:
    Path(node.cfg.fault_tier_delay_file).write_text(str(seconds))


def _put(node: StoreNode, key: bytes, value: bytes) -> None:
    codes, offs, toks, rid = node.put_start(T, [key], [len(value)], DEFAULT_TRAFFIC_CLASS, pb.BLOCK)
    assert codes == [pb.OK]
    e = node.acquire("write", offs[0], len(value), toks[0])
    assert e is not None
    node.dram.view[offs[0]:offs[0] + len(value)] = value
    node.release_guard(e)
    assert node.put_commit(T, rid, [checksum(value)]) == [pb.OK]


def _read(node: StoreNode, key: bytes) -> bytes | None:
    codes, found = node.read_pin(T, [key])
    e = found[0]
    try:
        return bytes(node.dram.slice(e.offset, e.size)) if codes == [pb.OK] and e is not None else None
    finally:
        node.read_unpin(found)


def _demote(node: StoreNode, key: bytes) -> None:
    assert node.demote(T, [key]) == 1


def _entry(node: StoreNode, key: bytes) -> Any:
    e = node.entries(T, [key])[0]
    assert e is not None
    return e


def _settled(node: StoreNode, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not node.settled():
        assert time.monotonic() < deadline, "demotions never finished"
        time.sleep(0.01)


def test_a_demotion_lands_and_the_object_comes_back_byte_exact(node: StoreNode) -> None:
    k, v = b"a" * 32, bytes(range(256)) * 256
    _put(node, k, v)
    used = node.dram.alloc.used
    _demote(node, k)
    _settled(node)
    assert node.where(T, k) == "ssd" and node.dram.alloc.used == used - node.dram.alloc.rounded(len(v))
    assert node.counters[StoreCounter.DEMOTED] == 1
    assert _read(node, k) == v
    assert node.where(T, k) == "dram" and node.counters[StoreCounter.PROMOTED] == 1 and node.tier("ssd").alloc.used == 0


def test_an_object_being_demoted_stays_readable_and_a_read_keeps_it_in_dram(node: StoreNode) -> None:
    k, v = b"b" * 32, b"x" * (64 * KiB)
    _put(node, k, v)
    _slow(node, 0.3)
    _demote(node, k)
    e = _entry(node, k)
    assert e.moving and e.inflight == 1
    # Never chosen twice while its copy is on the way.
    assert e not in node._space.dram_victims(1 << 30, time.time(), True)
    codes, found = node.read_pin(T, [k])  # a read from DRAM, held across the copy's end
    assert codes == [pb.OK] and bytes(node.dram.slice(found[0].offset, len(v))) == v  # type: ignore[union-attr]
    _settled(node)
    node.read_unpin(found)
    assert node.where(T, k) == "dram" and node.counters[StoreCounter.DEMOTIONS_ABANDONED] == 1
    assert node.tier("ssd").alloc.used == 0
    assert _read(node, k) == v


def test_an_object_removed_while_it_is_demoted_leaves_nothing_behind(node: StoreNode) -> None:
    k, v = b"c" * 32, b"y" * (64 * KiB)
    _put(node, k, v)
    _slow(node, 0.3)
    _demote(node, k)
    assert node.remove(T, [k]) == [pb.OK]
    assert _read(node, k) is None
    _settled(node)
    assert node.dram.alloc.used == 0 and node.tier("ssd").alloc.used == 0


def test_a_read_from_a_stalled_disk_is_a_miss_within_its_bound_and_lands_later(node: StoreNode) -> None:
    k, v = b"d" * 32, b"z" * (64 * KiB)
    _put(node, k, v)
    _demote(node, k)
    _settled(node)
    node.cfg.tier_read_seconds = 0.2
    _slow(node, 1.0)
    t0 = time.monotonic()
    assert _read(node, k) is None  # the SSD read takes 1 s, the read waits 0.2 s
    assert time.monotonic() - t0 < 0.8
    # DRAM hits meanwhile are not held up by the stalled read.
    k2, v2 = b"e" * 32, b"w" * 4096
    _put(node, k2, v2)
    t0 = time.monotonic()
    assert _read(node, k2) == v2
    assert time.monotonic() - t0 < 0.5  # the stalled SSD read still has ~0.8 s to go
    Path(node.cfg.fault_tier_delay_file).unlink()
    deadline = time.monotonic() + 5
    while node.where(T, k) != "dram":  # the copy started while stalled still lands
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert _read(node, k) == v


def test_a_write_sheds_rather_than_waits_for_a_stalled_disk(node: StoreNode) -> None:
    vals = [bytes([i]) * (128 * KiB) for i in range(7)]
    for i, v in enumerate(vals):
        _put(node, bytes([i]) * 32, v)
    node.cfg.demote_wait_seconds = 0.05
    _slow(node, 2.0)
    t0 = time.monotonic()
    codes, _, _, rid = node.put_start(T, [b"n" * 32, b"m" * 32], [256 * KiB, 256 * KiB], DEFAULT_TRAFFIC_CLASS,
                                      pb.BLOCK)
    assert time.monotonic() - t0 < 1.0  # demote_wait_seconds (0.05 s), not the disk's 2 s
    assert pb.NO_SPACE in codes
    if rid:
        node.put_revoke(T, rid)
    for i, v in enumerate(vals):  # everything is still readable from DRAM meanwhile
        assert _read(node, bytes([i]) * 32) == v


def test_a_push_batch_gets_all_its_objects_whichever_tier_they_are_in(node: StoreNode) -> None:
    """The drain's batched read: objects on the SSD come up without pushing the batch's DRAM
    objects down (each of 7 x 128 KiB; the arena holds about 7)."""
    vals = {bytes([i]) * 32: bytes([i]) * (128 * KiB) for i in range(14)}
    for k, v in vals.items():
        _put(node, k, v)
    _settled(node)
    for k in list(vals)[10:]:
        assert _read(node, k) == vals[k]  # the batch's DRAM objects are now the least recently used
    keys = list(vals)[3:10]  # some demoted, some still in DRAM
    assert {node.where(T, k) for k in keys} == {"dram", "ssd"}
    got: dict[bytes, bytes] = {}

    def sink(held: list[Any], views: list[memoryview]) -> None:
        got.update((e.key, bytes(v)) for e, v in zip(held, views, strict=True))
    entries = [_entry(node, k) for k in keys]
    assert node.read_objects(entries, sink) == len(keys)
    assert got == {k: vals[k] for k in keys}


def test_a_full_ssd_moves_only_what_the_new_object_needs_to_the_shared_fs(tmp_path: Path) -> None:
    # ssd_alloc making room: the coldest SSD objects go to the shared filesystem until the new
    # extent (plus 5% headroom) is freed, not every object the SSD holds.
    n = StoreNode(NodeConfig(node_id="f", shm_dir=str(tmp_path), dram_bytes=1 << 20, ssd_path=str(tmp_path / "ssd"),
                             ssd_bytes=256 * KiB, sharedfs_path=str(tmp_path / "fs"),
                             tier_read_seconds=10.0, demote_wait_seconds=10.0))
    try:
        keys = [bytes([65 + i]) * 32 for i in range(5)]
        for i, k in enumerate(keys[:4]):
            _put(n, k, bytes([i]) * (64 * KiB))
            _demote(n, k)
            _settled(n)
        assert [n.where(T, k) for k in keys[:4]] == ["ssd"] * 4
        _put(n, keys[4], b"\x09" * (64 * KiB))
        _demote(n, keys[4])
        _settled(n)
        tiers = [n.where(T, k) for k in keys[:4]]
        assert tiers.count("sharedfs") == 2 and tiers.count("ssd") == 2, tiers
    finally:
        n.close()


def test_demotions_a_put_needs_hold_the_lock_only_to_mark_and_flip(node: StoreNode) -> None:
    """A put that needs room plans the demotions of many objects (as many as the watermark
    needs): their disk writes run off the index lock.  While one of them is blocked in the
    disk (deterministically, not a sleep), DRAM hits, matches, stats and other writes all
    complete, and the put itself returns within its wait bound."""
    vals = {bytes([i]) * 32: bytes([i]) * (128 * KiB) for i in range(7)}  # the arena holds about 7
    for k, v in vals.items():
        _put(node, k, v)
    ssd = node.tier("ssd")
    entered, release = threading.Event(), threading.Event()
    write = ssd.write_batch

    def blocked_write(locs: Sequence[Location], srcs: Sequence[memoryview]) -> list[Code]:
        entered.set()
        assert release.wait(60), "the test never released the disk"
        return write(locs, srcs)

    ssd.write_batch = blocked_write
    node.cfg.demote_wait_seconds = 0.2
    try:
        t0 = time.monotonic()
        codes, _, _, rid = node.put_start(T, [b"n" * 32, b"m" * 32], [256 * KiB, 256 * KiB], DEFAULT_TRAFFIC_CLASS,
                                      pb.BLOCK)
        assert time.monotonic() - t0 < 3.0  # its wait bound (0.2 s), not the blocked disk
        assert entered.wait(10), "no demotion reached the disk"
        assert node.counters[StoreCounter.DEMOTED] == 0  # the copy is stuck in the disk: nothing flipped yet
        for k, v in vals.items():  # every object, those being demoted too, is a DRAM hit
            t0 = time.monotonic()
            assert _read(node, k) == v
            assert time.monotonic() - t0 < 1.0
        assert node.exists(T, list(vals))[0] == len(vals)
        assert node.stats()["node_id"] == "d"
        if rid:
            node.put_revoke(T, rid)
        assert set(codes) <= {pb.OK, pb.NO_SPACE}
    finally:
        release.set()
    _settled(node)
    assert all(_read(node, k) == v for k, v in vals.items())
