#!/usr/bin/env python3
"""Scale-up without a cold pool (issue 8 part 1): hit rate before, during and after a node add,
and the warm-up push (time, bytes, its cost to serving).

    python bench/scale_up.py [--keys N] [--value-kib K] [--stores S] [--rate MIB] [--rounds R] [--json PATH]

One round, on a ``kvpool.LocalCluster`` of S store nodes and three sidecars:

1. a writer puts the working set (N blocks of K KiB, write-through); reader A (the default
   transition window: falls back to previous owners and copies over) reads it: **before**;
2. one more store node joins the ring (``add_store``): reader A keeps reading: **during**
   (its first passes fall back; copy-over moves what it finds); reader B, which never falls
   back (``--transition-seconds 0``), reads a second set that A never touches: what the pool
   would serve at the new owners without any rebalance (**cold**);
3. the previous owners push the moved blocks (``Warm``) at the bound ``--rate`` MiB/s while A
   keeps reading (**serving during the push**: pass time vs before), then unbounded for the
   record; reader B reads everything: **after** (no fallback at all).

A pass drops the reader's local copies first, so every hit is a pool hit. Numbers are medians
over rounds; nothing here fails on a number.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import KiB, MiB, ensure_kvpool_importable  # noqa: E402

ensure_kvpool_importable()

from kvpool.apps.cluster import LocalCluster  # noqa: E402
from kvpool.core.ring import owners  # noqa: E402
from kvpool.wire.counters import SidecarCounter  # noqa: E402


def _pass(c: Any, keys: list[bytes], size: int, batch: int = 64) -> tuple[float, float]:
    """(hit rate, seconds) of one read pass over ``keys`` from the pool."""
    c.remove(keys)
    bufs = [bytearray(size) for _ in range(batch)]
    hits = 0
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        part = keys[i:i + batch]
        got = c.get_into(part, bufs[:len(part)])
        hits += sum(1 for s in got if s >= 0)
    return hits / len(keys), time.perf_counter() - t0


def _wait_warm(lc: LocalCluster, new: str, timeout: float = 600.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = [v for k, v in lc.warm_status().items() if k != new]
        if all(v.state == "done" for v in st):
            return st
        if time.monotonic() > deadline:
            raise RuntimeError("warm-up did not finish")
        time.sleep(0.02)


def push_while_reading(lc: LocalCluster, new: str, rate: int, read: Any) -> tuple[float, list[Any], list[float]]:
    """Warm-up push to ``new`` at ``rate`` B/s (0: unbounded) while ``read()`` passes run; (push
    seconds, the previous owners' statuses, pass times during the push)."""
    served: list[float] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            served.append(read())

    th = threading.Thread(target=reader)
    th.start()
    try:
        t0 = time.monotonic()
        lc.warm([new], deadline_seconds=600, max_bytes_per_second=rate)
        st = _wait_warm(lc, new)
        took = time.monotonic() - t0
    finally:
        stop.set()
        th.join()
    return took, st, served


def one_round(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    size = args.value_kib * KiB
    n = args.keys
    hot = [rng.randbytes(32) for _ in range(n)]
    other = [rng.randbytes(32) for _ in range(n)]
    local = max(64 * MiB, 2 * n * size + 32 * MiB)
    out: dict[str, Any] = {}
    with LocalCluster(stores=args.stores, sidecars=1, store_bytes=max(256 * MiB, 4 * n * size),
                      local_bytes=local) as lc:
        with lc.connect(0) as w:
            payload = [rng.randbytes(size) for _ in range(64)]
            for i in range(0, n, 64):
                w.put(hot[i:i + 64], payload[:len(hot[i:i + 64])])
                w.put(other[i:i + 64], payload[:len(other[i:i + 64])])
            while w.stats().pending_pool_bytes:
                time.sleep(0.01)
        lc.add_sidecar(local_bytes=local)
        lc.add_sidecar(local_bytes=local, extra_args=["--transition-seconds", "0"])
        with lc.connect(1) as a, lc.connect(2) as b:
            before = [_pass(a, hot, size) for _ in range(3)]
            out["before_hit"] = statistics.median(h for h, _ in before)
            out["before_pass_s"] = statistics.median(t for _, t in before)

            lc.add_store()
            new = lc.store_ids[-1]
            ids = lc.store_ids
            own = owners(b"".join(hot + other), ids)[:, 0]
            out["moved_fraction"] = float((own == len(ids) - 1).mean())
            during = [_pass(a, hot, size) for _ in range(3)]
            out["during_hit"] = min(h for h, _ in during)
            out["during_pass_s"] = statistics.median(t for _, t in during)
            t0 = time.monotonic()
            while (c := dict(a.stats().counters)).get(SidecarCounter.POOL_COPYOVER_QUEUED, 0) > (
                    c.get(SidecarCounter.POOL_COPYOVER_WRITTEN, 0) + c.get(SidecarCounter.POOL_COPYOVER_PRESENT, 0)
                    + c.get(SidecarCounter.POOL_COPYOVER_FAILED, 0)):
                time.sleep(0.01)
            out["copyover_written"] = c.get(SidecarCounter.POOL_COPYOVER_WRITTEN, 0)
            out["copyover_settle_s"] = time.monotonic() - t0
            out["cold_hit"] = _pass(b, other, size)[0]  # at the owners, no fallback, no push yet

            # The push at a bound, with A reading all along.
            out["push_s"], st, served = push_while_reading(lc, new, int(args.rate * MiB),
                                                           lambda: _pass(a, hot, size)[1])
            out["push_moved_objects"] = sum(v.moved_objects for v in st)
            out["push_moved_bytes"] = sum(v.moved_bytes for v in st)
            out["push_skipped_objects"] = sum(v.skipped_objects for v in st)
            out["push_failed_objects"] = sum(v.failed_objects for v in st)
            out["push_mib_s"] = out["push_moved_bytes"] / MiB / out["push_s"] if out["push_s"] else 0.0
            out["serving_pass_s_during_push"] = statistics.median(served) if served else float("nan")
            out["serving_passes_during_push"] = len(served)
            after = [_pass(b, hot + other, size) for _ in range(2)]
            out["after_hit"] = min(h for h, _ in after)

        # The same push unbounded, on a fresh node add (no reads in between: nothing copied over).
        with lc.connect(0) as w2:
            extra = [rng.randbytes(32) for _ in range(n)]
            payload = [rng.randbytes(size) for _ in range(64)]
            for i in range(0, n, 64):
                w2.put(extra[i:i + 64], payload[:len(extra[i:i + 64])])
            while w2.stats().pending_pool_bytes:
                time.sleep(0.01)
        lc.add_store()
        new2 = lc.store_ids[-1]
        with lc.connect(1) as a2:
            out["unbounded_push_s"], st2, served2 = push_while_reading(lc, new2, 0, lambda: _pass(a2, hot, size)[1])
        out["serving_pass_s_during_unbounded_push"] = statistics.median(served2) if served2 else float("nan")
        out["serving_passes_during_unbounded_push"] = len(served2)
        out["unbounded_push_moved_bytes"] = sum(v.moved_bytes for v in st2)
        out["unbounded_push_moved_objects"] = sum(v.moved_objects for v in st2)
        out["unbounded_push_mib_s"] = (out["unbounded_push_moved_bytes"] / MiB / out["unbounded_push_s"]
                                       if out["unbounded_push_s"] else 0.0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1024, help="blocks in the working set (and in each other set)")
    ap.add_argument("--value-kib", type=int, default=64)
    ap.add_argument("--stores", type=int, default=3, help="store nodes before the add")
    ap.add_argument("--rate", type=float, default=16.0, help="warm-up bound per previous owner, MiB/s")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    rounds = [one_round(args, seed) for seed in range(args.rounds)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"scale-up {args.stores}->{args.stores + 1} nodes, {args.keys} x {args.value_kib} KiB working set, "
          f"{args.rounds} round(s), medians")
    print(f"  moved to the new node:          {med['moved_fraction']:.1%} of the keys")
    print(f"  hit rate before / during / after: {med['before_hit']:.3f} / {med['during_hit']:.3f} / "
          f"{med['after_hit']:.3f}   (no rebalance, at the owners: {med['cold_hit']:.3f})")
    print(f"  read pass before / during:      {med['before_pass_s'] * 1e3:.1f} / {med['during_pass_s'] * 1e3:.1f} ms")
    print(f"  copy-over: {med['copyover_written']:.0f} blocks written, settled {med['copyover_settle_s'] * 1e3:.0f} ms "
          f"after the last read")
    print(f"  push at {args.rate:g} MiB/s: {med['push_moved_objects']:.0f} objects, "
          f"{med['push_moved_bytes'] / MiB:.1f} MiB in {med['push_s']:.2f} s ({med['push_mib_s']:.1f} MiB/s), "
          f"{med['push_skipped_objects']:.0f} skipped (copied over already), {med['push_failed_objects']:.0f} failed")
    print(f"  serving during the push:        pass {med['serving_pass_s_during_push'] * 1e3:.1f} ms "
          f"({med['serving_pass_s_during_push'] / med['before_pass_s']:.2f}x before, "
          f"{med['serving_passes_during_push']:.0f} passes)")
    print(f"  push unbounded: {med['unbounded_push_moved_objects']:.0f} objects, "
          f"{med['unbounded_push_moved_bytes'] / MiB:.1f} MiB in {med['unbounded_push_s']:.2f} s "
          f"({med['unbounded_push_mib_s']:.1f} MiB/s); serving pass "
          f"{med['serving_pass_s_during_unbounded_push'] * 1e3:.1f} ms "
          f"({med['serving_pass_s_during_unbounded_push'] / med['before_pass_s']:.2f}x before, "
          f"{med['serving_passes_during_unbounded_push']:.0f} passes)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds, "median": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
