#!/usr/bin/env python3
"""Sparse reads (issue 8 part 4): parts of a 4 MiB object against the whole of it.

    python bench/sparse.py [--quick] [--reps N] [--rounds N] [--chunk BYTES] [--json PATH]

A sparse-attention step reads a few top-k entries of a sequence's KV instead of its whole
prefix.  Here one object of ``--size`` bytes (4 MiB) is cut into ``--chunk`` (16 KiB) entries
and each timed read asks for a fresh random 1 %, 10 % or 100 % of them (scattered, sorted), by
three paths, each against the whole-object read of the same path:

- **store**: ``StoreClient.read_ranges`` straight to the owner store node's data session, into
  a preallocated buffer (whole: ``StoreClient.read`` of the object);
- **sidecar_remote**: ``Client.get_ranges_into`` through a sidecar that does not hold the
  object: the sidecar reads the ranges from the owner into scratch space, the client copies
  them out (whole: ``Client.get_into`` of the object, removed from that sidecar's local tier
  untimed after each rep so that every whole read comes from the pool);
- **sidecar_local**: ``Client.get_ranges_into`` through the sidecar that holds the object in its
  local tier (whole: ``Client.get_into``).

"wire bytes/op" is what the store nodes sent per read, from their ``range_bytes_sent`` counter
(whole reads: the object's size, or 0 when served locally).  Times are per read; the table gives
the median and p99 over all reps of all rounds (rounds interleave the paths).  Everything runs
on 127.0.0.1 (a ``kvpool.LocalCluster``: 2 store nodes, 2 sidecars); numbers only, no pass/fail.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import KiB, MiB, ensure_kvpool_importable  # noqa: E402

ensure_kvpool_importable()

import numpy as np  # noqa: E402

from kvpool.apps.cluster import LocalCluster  # noqa: E402
from kvpool.core.ring import owners  # noqa: E402
from kvpool.pool.node_client import StoreClient  # noqa: E402
from kvpool.wire.counters import StoreCounter  # noqa: E402
from kvpool.wire.proto import store_pb2 as pb  # noqa: E402

FRACTIONS = (0.01, 0.10, 1.00)


def topk(rng: random.Random, size: int, chunk: int, fraction: float) -> list[tuple[int, int]]:
    """A fresh scattered top-k of the object's ``chunk``-byte entries (sorted by offset)."""
    slots = size // chunk
    k = max(1, round(slots * fraction))
    return [(s * chunk, chunk) for s in sorted(rng.sample(range(slots), k))]


def sent(lc: LocalCluster) -> int:
    total = 0
    for addr in lc.stores:
        with lc.admin(addr) as c:
            total += int(c.stats().counters[StoreCounter.RANGE_BYTES_SENT])
    return total


def measure(fn: Callable[[int], Any], reps: int, warmup: int = 2,
            after: Callable[[], Any] | None = None) -> list[float]:
    """Times of ``reps`` calls (after ``warmup`` untimed ones); ``after`` runs untimed after each."""
    out = []
    for i in range(-warmup, reps):
        t0 = time.perf_counter()
        fn(i)
        dt = time.perf_counter() - t0
        if after is not None:
            after()
        if i >= 0:
            out.append(dt)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer reps (a smoke run)")
    ap.add_argument("--reps", type=int, default=100, help="timed reads per cell and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", type=int, default=4 * MiB)
    ap.add_argument("--chunk", type=int, default=16 * KiB)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    reps = 10 if args.quick else args.reps
    rounds = 1 if args.quick else args.rounds
    size, chunk = args.size, args.chunk
    times: dict[tuple[str, str], list[float]] = {}
    wire: dict[tuple[str, str], list[float]] = {}
    with LocalCluster(stores=2, sidecars=2, store_bytes=256 * MiB, local_bytes=128 * MiB) as lc:
        a, b = lc.connect(0), lc.connect(1)
        try:
            key = random.Random(1).randbytes(32)
            value = np.random.default_rng(1).integers(0, 256, size, np.uint8).tobytes()
            assert a.put([key], [value]) == [pb.OK]
            deadline = time.monotonic() + 30
            while a.stats().pending_pool_bytes and time.monotonic() < deadline:
                time.sleep(0.01)
            owner = lc.stores[int(owners(key, lc.store_ids)[0, 0])]
            store = StoreClient(owner)
            out = np.zeros(size, np.uint8)
            mv = memoryview(out.data)
            rng = random.Random(7)

            def check(pairs: list[tuple[int, int]], got: memoryview) -> None:
                want = b"".join(value[o:o + n] for o, n in pairs)
                if bytes(got[:len(want)]) != want:
                    raise AssertionError("a ranged read returned other bytes")

            for rnd in range(rounds):
                for path in ("store", "sidecar_remote", "sidecar_local"):
                    for fraction in (*FRACTIONS, None):
                        label = f"{fraction:.0%}" if fraction is not None else "whole"
                        plans = [topk(rng, size, chunk, fraction or 1.0) for _ in range(reps + 2)]

                        def one(i: int, path: str = path, fraction: float | None = fraction,
                                plans: list[list[tuple[int, int]]] = plans) -> None:
                            pairs = plans[i]
                            if fraction is None:
                                if path == "store":
                                    r = store.read([key], lambda _i, _s: mv)
                                    ok = r.codes == [pb.OK]
                                elif path == "sidecar_remote":
                                    ok = b.get_into([key], [out]) == [size]
                                else:
                                    ok = a.get_into([key], [out]) == [size]
                            elif path == "store":
                                ok = store.read_ranges([key], [pairs], [mv]).codes == [pb.OK]
                            else:
                                ok = (b if path == "sidecar_remote" else a).get_ranges_into(
                                    [key], [pairs], [out]) == [pb.OK]
                            if not ok:
                                raise AssertionError(f"{path} {fraction} read failed")

                        drop = (lambda: b.remove([key])) if path == "sidecar_remote" and fraction is None else None
                        one(0)
                        if drop:
                            drop()
                        check(plans[0] if fraction is not None else [(0, size)], mv)
                        s0 = sent(lc)
                        t = measure(one, reps, after=drop)
                        moved = (sent(lc) - s0) / (reps + 2)  # 2 warm-up reads
                        if fraction is None:
                            moved = float(size) if path != "sidecar_local" else 0.0
                        times.setdefault((path, label), []).extend(t)
                        wire.setdefault((path, label), []).append(moved)
                print(f"round {rnd + 1}/{rounds} done", file=sys.stderr, flush=True)
            store.close()
        finally:
            a.close()
            b.close()
    rows = []
    for (path, label), t in times.items():
        med = statistics.median(t)
        whole = statistics.median(times[(path, "whole")])
        rows.append({"path": path, "read": label, "wire_bytes_per_op": statistics.median(wire[(path, label)]),
                     "p50_ms": med * 1e3, "p99_ms": float(np.percentile(t, 99)) * 1e3,
                     "time_vs_whole": med / whole, "reps": len(t)})
    print(f"\nsparse reads of one {size // MiB} MiB object in {chunk // KiB} KiB entries "
          f"(median of {rows[0]['reps']} reads per cell)")
    print(f"{'path':16} {'read':>6} {'wire bytes/op':>14} {'p50 ms':>8} {'p99 ms':>8} {'vs whole':>9}")
    for r in rows:
        print(f"{r['path']:16} {r['read']:>6} {r['wire_bytes_per_op']:>14,.0f} {r['p50_ms']:>8.3f} "
              f"{r['p99_ms']:>8.3f} {r['time_vs_whole']:>9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"size": size, "chunk": chunk, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
