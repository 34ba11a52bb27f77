"""SSD and shared-filesystem tiers of real nodes: demotion, promotion, corruption, restarts."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


def _read_all(c: Any, keys: list[bytes], batch: int = 4) -> list[bytes | None]:
    out: list[bytes | None] = []
    for i in range(0, len(keys), batch):
        out += [bytes(g) if g is not None else None for g in c.get(keys[i:i + batch])]
    return out


@pytest.fixture(scope="module")
def nodes(module_stores: Any) -> Any:
    fs = module_stores.tmp / "sharedfs"
    return module_stores.start_many({
        "ssd": {"dram": "2MiB", "ssd": "64MiB"}, "ssdfull": {"dram": "1MiB", "ssd": "3MiB"},
        "fs_a": {"dram": "1MiB", "sharedfs": fs}, "fs_b": {"dram": "4MiB", "sharedfs": fs},
        "fs_fresh": {"dram": "4MiB", "sharedfs": fs}})


def test_ssd_demotion_and_promotion_are_byte_exact(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["ssd"]
    c = node.client()
    sizes = [rng.choice([1, 4 * KiB, 100 * KiB, 256 * KiB, 513 * KiB, rng.randint(1, 300 * KiB)]) for _ in range(60)]
    keys = h.rand_keys(rng, len(sizes))
    vals = h.rand_values(rng, sizes)
    for i in range(0, len(keys), 5):
        assert c.put(keys[i:i + 5], vals[i:i + 5]) == [pb.OK] * len(keys[i:i + 5])
    st = c.stats()
    assert st.counters[StoreCounter.DEMOTED] > 0
    assert st.counters.get(StoreCounter.EVICTED, 0) == 0  # demote before drop: the SSD has room for all
    assert h.stats_tier(st, "ssd").used_bytes > 0
    assert h.stats_tier(st, "dram").used_bytes <= h.stats_tier(st, "dram").capacity_bytes
    # Everything is still matched (tiers below DRAM count)...
    assert c.exists(keys).prefix == len(keys)
    # ...and reads back byte-exact, oldest first (so every read promotes from the SSD).
    assert _read_all(c, keys) == vals
    st = c.stats()
    assert st.counters[StoreCounter.PROMOTED] > 0
    assert st.counters.get(StoreCounter.CHECKSUM_FAILURES, 0) == 0
    # A second pass in another order still agrees (promotion demoted others in turn).
    order = list(range(len(keys)))
    rng.shuffle(order)
    assert _read_all(c, [keys[i] for i in order], batch=3) == [vals[i] for i in order]


def test_ssd_full_drops_the_coldest_and_never_returns_wrong_bytes(nodes: Any, h: Any, rng: random.Random) -> None:
    node = nodes["ssdfull"]
    c = node.client()
    size = 200 * KiB
    keys = h.rand_keys(rng, 40)
    vals = h.rand_values(rng, [size] * 40)
    for i in range(0, 40, 4):
        assert c.put(keys[i:i + 4], vals[i:i + 4]) == [pb.OK] * 4
    st = c.stats()
    assert st.counters[StoreCounter.DEMOTED] > 0 and st.counters[StoreCounter.EVICTED] > 0
    ssd = h.stats_tier(st, "ssd")
    assert ssd.used_bytes <= ssd.capacity_bytes
    got = _read_all(c, keys, batch=2)
    assert got[-1] == vals[-1]
    for g, v in zip(got, vals, strict=True):
        assert g is None or g == v
    assert sum(g is not None for g in got) >= 10


def test_restart_never_serves_stale_bytes(stores: Any, h: Any, rng: random.Random, tmp_path: Path) -> None:
    ssd_dir = tmp_path / "ssd"
    node = stores.start("1MiB", ssd="16MiB", ssd_path=ssd_dir, node_id="store-r")
    c = node.client()
    size = 128 * KiB
    keys = h.rand_keys(rng, 24)
    old = h.rand_values(rng, [size] * 24)
    for i in range(0, 24, 4):
        assert c.put(keys[i:i + 4], old[i:i + 4]) == [pb.OK] * 4
    assert c.stats().counters[StoreCounter.DEMOTED] > 0
    node.kill()  # crash: no shutdown code runs
    for attempt in range(2):
        node = stores.start("1MiB", ssd="16MiB", ssd_path=ssd_dir, node_id="store-r")
        c = node.client()
        assert c.exists(keys, prefix_only=False).present == [False] * 24
        assert c.get(keys[:8]) == [None] * 8
        st = c.stats()
        assert h.stats_tier(st, "ssd").used_bytes == 0
        # New bytes under the same keys are served as written, never the previous life's.
        new = h.rand_values(rng, [size] * 24)
        for i in range(0, 24, 4):
            assert c.put(keys[i:i + 4], new[i:i + 4]) == [pb.OK] * 4
        assert _read_all(c, keys) == new
        if attempt == 0:
            assert node.stop() == 0  # and a clean shutdown followed by a restart
        old = new


def test_second_node_on_a_live_ssd_path_refuses_to_start(stores: Any, h: Any, rng: random.Random,
                                                          tmp_path: Path) -> None:
    ssd_dir = tmp_path / "ssd-shared"
    node = stores.start("1MiB", ssd="8MiB", ssd_path=ssd_dir, node_id="store-x")
    c = node.client()
    keys = h.rand_keys(rng, 12)
    vals = h.rand_values(rng, [200 * KiB] * 12)
    for i in range(0, 12, 4):
        assert c.put(keys[i:i + 4], vals[i:i + 4]) == [pb.OK] * 4
    assert c.stats().counters[StoreCounter.DEMOTED] > 0
    with pytest.raises(RuntimeError, match="in use by another store node"):
        stores.start("1MiB", ssd="8MiB", ssd_path=ssd_dir, node_id="store-x")
    # The first node's SSD objects were not truncated away.
    assert _read_all(c, keys) == vals


def _payload_files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file() and not p.name.startswith(".tmp")]


def _files_when_flipped(c: Any, shared: Path) -> tuple[list[Path], int]:
    """The shared-fs files and the ``demoted`` counter, once they agree (bounded): a demotion's
    file appears at its rename, off the node's lock, and is counted at the flip that follows."""
    deadline = time.monotonic() + 30
    while True:
        files = _payload_files(shared)
        demoted = int(c.stats().counters[StoreCounter.DEMOTED])
        if len(files) == demoted or time.monotonic() > deadline:
            return files, demoted
        time.sleep(0.02)


def test_sharedfs_round_trip_across_nodes_and_corruption_is_a_miss(nodes: Any, module_stores: Any, h: Any,
                                                                   rng: random.Random) -> None:
    shared = module_stores.tmp / "sharedfs"
    a = nodes["fs_a"]
    ca = a.client()
    size = 128 * KiB
    keys = h.rand_keys(rng, 24)
    vals = h.rand_values(rng, [size] * 24)
    for i in range(0, 24, 4):
        assert ca.put(keys[i:i + 4], vals[i:i + 4]) == [pb.OK] * 4
    files, demoted = _files_when_flipped(ca, shared)
    assert demoted > 0
    assert len(files) == demoted
    # Names are keyed hashes: the directory does not reveal the keys.
    names = " ".join(str(p) for p in files)
    assert not any(k.hex()[:16] in names for k in keys)
    # The node reads its demoted objects back byte-exact (promotion from the shared tier)...
    assert _read_all(ca, keys) == vals
    # ...and so does another node that never saw them (the tier is shared).
    b = nodes["fs_b"]
    cb = b.client()
    got_b = _read_all(cb, keys)
    on_fs = [i for i, g in enumerate(got_b) if g is not None]
    assert len(on_fs) == len(_payload_files(shared)) > 0
    assert all(got_b[i] == vals[i] for i in on_fs)
    # Damage every file: a flipped payload byte (header intact), a truncation after the header,
    # or garbage instead of a header.
    flipped = truncated = 0
    for i, p in enumerate(sorted(_payload_files(shared))):
        raw = bytearray(p.read_bytes())
        if i % 3 == 0:
            raw[-1] ^= 0xFF
            flipped += 1
        elif i % 3 == 1:
            raw = raw[:40]
            truncated += 1
        else:
            raw = bytearray(os.urandom(10))
        p.write_bytes(bytes(raw))
    assert flipped > 0 and truncated > 0
    fresh = nodes["fs_fresh"]  # started before, but has never looked at these keys
    cf = fresh.client()
    # A flipped payload byte hides behind an intact header (found, then refused by its read); a
    # truncated file or a garbage header is not even found (``Tier.locate`` checks the length).
    assert cf.exists(keys, prefix_only=False).present.count(True) == flipped
    got = _read_all(cf, keys)
    assert got == [None] * 24, "a damaged shared-fs object must be a miss"
    st = cf.stats()
    assert st.counters[StoreCounter.CHECKSUM_FAILURES] == flipped
    # A miss, and forgotten: the next lookup does not trust the file again.
    assert cf.exists(keys, prefix_only=False).present == [False] * 24
