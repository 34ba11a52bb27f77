"""A store node whose disk stalls (issue 19): DRAM hits stay fast, the stalled objects are misses.

The disk (the SSD tier, or the shared-filesystem tier) is slowed by the node's fault-injection
hook (``--fault-tier-delay-file``: every read, write, stat and removal of the tier sleeps the
seconds the file holds) — device-mapper (dm-delay) is not in this kernel and no FUSE library is
installed, so a throttled device is not at hand here.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.wire.counters import StoreCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
DELAY = 2.0
"""Seconds each SSD I/O sleeps while the disk is stalled."""


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))]


@pytest.mark.parametrize("tier", ["ssd", "sharedfs"])
def test_stalled_disk_never_stalls_dram_hits(stores: Any, h: Any, rng: random.Random, tmp_path: Path,
                                             tier: str) -> None:
    delay_file = tmp_path / "tier-delay"
    below: dict[str, Any] = {"ssd": "64MiB"} if tier == "ssd" else {"sharedfs": tmp_path / "fs"}
    node = stores.start("4MiB", **below, extra=["--fault-tier-delay-file", str(delay_file)],
                        config={"tierReadSeconds": 0.25, "demoteWaitSeconds": 0.5})  # the defaults
    c = node.client()
    # Cold objects, most of them demoted to the SSD (the disk is fast for now).
    cold = h.rand_keys(rng, 32)
    cold_vals = h.rand_values(rng, [256 * KiB] * 32)
    for i in range(0, 32, 4):
        assert c.put(cold[i:i + 4], cold_vals[i:i + 4]) == [pb.OK] * 4
    h.wait_for(lambda: c.stats().counters[StoreCounter.DEMOTED] >= 12, what="demotions to the tier below")
    # Hot objects: written last and read all along, so they stay in DRAM.
    hot = h.rand_keys(rng, 16)
    hot_vals = h.rand_values(rng, [16 * KiB] * 16)
    assert c.put(hot, hot_vals) == [pb.OK] * 16
    assert [bytes(v) if v is not None else None for v in c.get(hot)] == hot_vals

    delay_file.write_text(str(DELAY))  # the disk hangs: each of its reads or writes takes 2 s
    stop = threading.Event()
    wrong: list[str] = []
    cold_lat: list[float] = []
    cold_misses = [0]
    put_lat: list[float] = []

    def writer() -> None:  # keeps the node demoting (each demotion now sleeps in the disk)
        wc = node.client()
        n = 0
        while not stop.is_set():
            keys = h.rand_keys(random.Random(n), 2)
            t0 = time.monotonic()
            codes = wc.put(keys, [bytes([n % 251]) * (256 * KiB)] * 2)
            put_lat.append(time.monotonic() - t0)
            assert set(codes) <= {pb.OK, pb.NO_SPACE}, codes
            n += 1

    def cold_reader() -> None:  # asks for objects that are on the stalled disk
        rc = node.client()
        for i in range(len(cold)):
            if stop.is_set():
                break
            t0 = time.monotonic()
            got = rc.get([cold[i]])[0]
            cold_lat.append(time.monotonic() - t0)
            if got is None:
                cold_misses[0] += 1
            elif bytes(got) != cold_vals[i]:
                wrong.append(f"cold {i}")

    threads = [threading.Thread(target=writer), threading.Thread(target=cold_reader)]
    for t in threads:
        t.start()
    hot_lat: list[float] = []
    match_lat: list[float] = []
    try:
        end = time.monotonic() + 3 * DELAY
        j = 0
        while time.monotonic() < end:
            k = j % len(hot)
            t0 = time.monotonic()
            got = c.get([hot[k]])[0]
            hot_lat.append(time.monotonic() - t0)
            if got is None or bytes(got) != hot_vals[k]:
                wrong.append(f"hot {k}: {'miss' if got is None else 'wrong bytes'}")
            t0 = time.monotonic()
            assert c.exists(hot).prefix == len(hot)
            match_lat.append(time.monotonic() - t0)
            j += 1
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    delay_file.unlink()
    print(f"{tier}: DRAM get p99 {_p99(hot_lat) * 1e3:.1f} ms max {max(hot_lat) * 1e3:.1f} ms (n={len(hot_lat)}); "
          f"match p99 {_p99(match_lat) * 1e3:.1f} ms max {max(match_lat) * 1e3:.1f} ms; "
          f"stalled gets max {max(cold_lat) * 1e3:.0f} ms, misses {cold_misses[0]}/{len(cold_lat)}; "
          f"puts max {max(put_lat) * 1e3:.0f} ms (n={len(put_lat)})")
    assert not wrong, wrong
    assert not any(t.is_alive() for t in threads)
    # DRAM hits and matches never waited for the disk (each SSD I/O took 2 s meanwhile).
    assert _p99(hot_lat) < 0.05, f"DRAM get p99 {_p99(hot_lat):.3f} s"
    assert _p99(match_lat) < 0.05, f"match p99 {_p99(match_lat):.3f} s"
    assert max(hot_lat) < DELAY / 2 and max(match_lat) < DELAY / 2
    # The objects on the stalled disk became misses within the node's read bound (0.25 s),
    # and writes that needed demotions shed within theirs (0.5 s), with generous margins.
    assert cold_misses[0] >= 1
    assert max(cold_lat) < 1.0, f"a stalled read took {max(cold_lat):.2f} s"
    assert max(put_lat) < 1.5, f"a put took {max(put_lat):.2f} s"
    # Once the disk is back, every object is there, byte-exact (the stalled copies completed).
    h.wait_for(lambda: all(g is not None for g in c.get(cold[:1])), timeout=3 * DELAY, what="disk back")
    got_all = []
    for i in range(0, len(cold), 2):
        deadline = time.monotonic() + 4 * DELAY
        while True:  # a copy started while the disk hung may still be finishing
            got = c.get(cold[i:i + 2])
            if all(g is not None for g in got) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        got_all += [bytes(g) if g is not None else None for g in got]
    assert got_all == cold_vals
