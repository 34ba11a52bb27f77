#!/usr/bin/env python3
"""Prefill → decode handoff through the pool (issue 8 part 2).

    python bench/handoff.py [--quick] [--rounds N] [--blocks 64,512] [--json PATH]

A ``kvpool.LocalCluster`` of 4 store nodes and 2 sidecars (prefill, decode) on 127.0.0.1.
Per round and block count N (blocks of 256 KiB, plus one state object of 1,415,040 bytes, the
DESIGN §5 example), with fresh keys each time:

- **publish**: the prefill engine has put its blocks and its state (write-through on its way);
  ``publish_prefill`` until the record is back (every block committed in the pool, the state
  exported).
- **handoff**: ``accept_handoff(record bytes)`` on the decode side, from the call to its return,
  when every block is in the decode sidecar's local tier and the state object too (point to
  point from the prefill sidecar's transfer port) — "handoff to all blocks local".  Also the
  decode sidecar's own time for the blocks (``blocks_local``) and for the state (``state``).
- **pool_get** (baseline): the same N blocks of another prefill read by the decode engine with
  the ordinary ``match`` + ``get`` (pool to local tier + views), no handoff.

Medians over rounds; GB/s = 10^9 bytes of block payload per second of the median time.
Between rounds everything is removed (local tiers and store nodes), so every handoff moves all
bytes from the pool.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import KiB, MiB, ensure_kvpool_importable  # noqa: E402

ensure_kvpool_importable()

from kvpool.apps.cluster import LocalCluster  # noqa: E402
from kvpool.client.client import Client  # noqa: E402
from kvpool.core import handoff_record as ho  # noqa: E402
from kvpool.pool.node_client import StoreClient  # noqa: E402
from kvpool.wire.proto import store_pb2 as pb  # noqa: E402

BLOCK_BYTES = 256 * KiB
STATE_BYTES = 1_415_040
B = 128


def _keys(tag: str, n: int) -> list[bytes]:
    import hashlib
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def _settle(c: Client) -> None:
    deadline = time.monotonic() + 60
    while c.stats().pending_pool_bytes and time.monotonic() < deadline:
        time.sleep(0.005)


def _clean(lc: LocalCluster, clients: list[Client], keys: list[bytes], skey: bytes) -> None:
    for c in clients:
        c.remove(keys)
        c.remove([skey], kind=pb.STATE)
    for addr in lc.stores:
        with StoreClient(addr) as s:
            s.remove(keys)
            s.remove([skey], kind=pb.STATE)


def one_round(lc: LocalCluster, p: Client, d: Client, n: int, tag: str, values: list[memoryview],
              state: bytes) -> dict[str, float]:
    prompt = n * B + 40
    pos = ((prompt - 1) // B) * B
    keys = _keys(f"{tag}/h", n)
    skey = keys[pos // B - 1]
    assert p.put(keys, values) == [pb.OK] * n
    assert p.put_state(skey, pos, state) == pb.OK
    backlog = p.stats().pending_pool_bytes
    t0 = time.perf_counter()
    rec = p.publish_prefill(keys, prompt)
    t_publish = time.perf_counter() - t0
    wire = rec.to_bytes()
    t0 = time.perf_counter()
    res = d.accept_handoff(wire)
    t_handoff = time.perf_counter() - t0
    ok = (res.state_outcome == ho.StateOutcome.PEER and res.missing_blocks == 0
          and bytes(res.blocks[0]) == bytes(values[0]) and bytes(res.blocks[-1]) == bytes(values[-1])
          and res.state is not None and bytes(res.state) == state)
    out = {"publish_ms": t_publish * 1e3, "handoff_ms": t_handoff * 1e3,
           "blocks_local_ms": res.blocks_local_seconds * 1e3, "state_ms": res.state_seconds * 1e3,
           "record_bytes": float(len(wire)),
           "backlog_mib": backlog / MiB, "verified": float(ok)}
    res.release()
    _clean(lc, [p, d], keys, skey)
    # Baseline: the same amount through the ordinary read path (pool → decode local tier).
    keys = _keys(f"{tag}/g", n)
    assert p.put(keys, values) == [pb.OK] * n
    _settle(p)
    t0 = time.perf_counter()
    assert d.match(keys) == n
    with d.get(keys) as got:
        t_get = time.perf_counter() - t0
        out["verified"] *= float(bytes(got[-1]) == bytes(values[-1]))
    out["pool_get_ms"] = t_get * 1e3
    _clean(lc, [p, d], keys, keys[0])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 blocks only, 3 rounds")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--blocks", default="64,512")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    counts = [64] if args.quick else [int(x) for x in args.blocks.split(",")]
    rounds = 3 if args.quick else args.rounds
    most = max(counts) * BLOCK_BYTES
    rows: dict[int, list[dict[str, float]]] = {n: [] for n in counts}
    rng = os.urandom
    values = [memoryview(rng(BLOCK_BYTES)) for _ in range(max(counts))]
    state = rng(STATE_BYTES)
    load_before = os.getloadavg()
    with LocalCluster(stores=4, sidecars=2, store_bytes=most // 2 + 64 * MiB,
                      local_bytes=most + 64 * MiB) as lc:
        p, d = lc.connect(0), lc.connect(1)
        try:
            for n in counts:  # untimed warm-up: connections, arena pages, thread pools
                one_round(lc, p, d, n, f"warm{n}", values[:n], state)
            for r in range(rounds):
                for n in counts:
                    rows[n].append(one_round(lc, p, d, n, f"r{r}n{n}", values[:n], state))
                print(f"[bench] round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
        finally:
            p.close()
            d.close()
    med = {n: {m: statistics.median(v[m] for v in vs) for m in vs[0]} for n, vs in rows.items()}
    print(f"{'blocks':>6} {'MiB':>6} {'publish ms':>11} {'handoff ms':>11} {'GB/s':>6} {'blocks_local ms':>16} "
          f"{'state ms':>9} {'pool_get ms':>12} {'handoff/get':>12} {'record B':>9} {'verified':>8}")
    for n, m in med.items():
        mib = n * BLOCK_BYTES / MiB
        gbps = n * BLOCK_BYTES / (m["handoff_ms"] / 1e3) / 1e9
        print(f"{n:>6} {mib:>6.0f} {m['publish_ms']:>11.2f} {m['handoff_ms']:>11.2f} {gbps:>6.2f} "
              f"{m['blocks_local_ms']:>16.2f} {m['state_ms']:>9.2f} {m['pool_get_ms']:>12.2f} "
              f"{m['handoff_ms'] / m['pool_get_ms']:>12.2f} {m['record_bytes']:>9.0f} "
              f"{'yes' if all(v['verified'] for v in rows[n]) else 'NO':>8}")
    print(f"load average before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    if args.json:
        doc: dict[str, Any] = {"rounds": rounds, "block_bytes": BLOCK_BYTES, "state_bytes": STATE_BYTES,
                               "medians": {str(k): v for k, v in med.items()},
                               "raw": {str(k): v for k, v in rows.items()}, "cpus": os.cpu_count(),
                               "loadavg_before_after": [load_before[0], os.getloadavg()[0]], "doc": __doc__}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
