#!/usr/bin/env python3
"""The SSD tier with and without encryption at rest (issue 8 part 3).

    python bench/ssd_tier.py [--quick] [--rounds N] [--json PATH]

Two levels, both plain and encrypted, interleaved round by round (medians reported):

- **tier**: in this process, the store node's own code path below DRAM for one object at a time:
  ``write_batch`` then ``read_batch`` of an ``SsdTier`` (plain) or of a ``SealedTier`` around
  it (encrypted: sealed on the way in, opened on the way out), as the tier chain calls them.
  Plus the AES-GCM seal/open alone (memory to memory), the ceiling of the encrypted path.
- **node**: a real ``kvpool store`` process (small DRAM arena, large SSD tier, with or without
  ``--master-key-file``) and this process as its client: puts that demote (every object but the
  last few goes to the SSD) and gets, oldest first, that promote each object back.

The slot file lives in the work directory (``--dir``, default a temporary directory on /tmp):
on this machine a virtio disk through the page cache, so the numbers are the CPU cost of the
path (copies, AES-GCM, syscalls), not the device.  GB/s = 10^9 bytes of payload per second.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import KiB, MiB, Procs, ensure_kvpool_importable, free_port, python_env  # noqa: E402

ensure_kvpool_importable()

from kvpool.tiers.atrest import AtRest, sealed_size  # noqa: E402
from kvpool.tiers.base import Code, ObjectRef, Tier  # noqa: E402
from kvpool.tiers.sealed import SealedTier  # noqa: E402
from kvpool.tiers.ssd import SsdTier  # noqa: E402
from kvpool.wire.counters import StoreCounter  # noqa: E402

MASTER = os.urandom(32).hex().encode()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def tier_round(work: Path, size: int, total: int, encrypted: bool) -> dict[str, float]:
    """One pass of write-all then read-all through an SsdTier (sealed: a ``SealedTier`` around
    it), one object per batch as the store node's tier chain moves them; GB/s of each phase."""
    n = max(4, total // size)
    stored = sealed_size(size) if encrypted else size
    ssd = SsdTier(str(work / ("tier-enc" if encrypted else "tier-plain")), n * (stored + 8192), f"b{size}")
    tier: Tier = SealedTier(ssd, AtRest(MASTER)) if encrypted else ssd
    try:
        src = memoryview(os.urandom(size))
        key = os.urandom(32)
        locs = [loc for loc in tier.reserve([ObjectRef("tenant", key + i.to_bytes(4, "little")) for i in range(n)],
                                            [size] * n) if loc is not None]
        if len(locs) != n:
            raise AssertionError("the slot file has no room")
        t0 = time.perf_counter()
        for loc in locs:
            if tier.write_batch([loc], [src]) != [Code.OK]:
                raise AssertionError("a write failed")
        t_write = time.perf_counter() - t0
        dst = memoryview(bytearray(size))
        t0 = time.perf_counter()
        for loc in locs:
            if tier.read_batch([loc], [dst]) != [Code.OK]:
                raise AssertionError("a read failed (a sealed object that did not open?)")
        t_read = time.perf_counter() - t0
        if bytes(dst) != bytes(src):
            raise AssertionError("read back other bytes")
        return {"write": _gbps(n * size, t_write), "read": _gbps(n * size, t_read)}
    finally:
        tier.close()


def aead_round(size: int, total: int) -> dict[str, float]:
    """AES-GCM alone, memory to memory, into reused buffers (as the node does)."""
    n = max(4, total // size)
    at = AtRest(MASTER)
    src = memoryview(os.urandom(size))
    key = os.urandom(32)
    out = at.scratch(sealed_size(size))
    t0 = time.perf_counter()
    for i in range(n):
        at.seal("tenant", key, 0, i, src, out)
    t_seal = time.perf_counter() - t0
    blob = bytes(out)
    dst = memoryview(bytearray(size))
    t0 = time.perf_counter()
    for _ in range(n):
        if not at.open_into("tenant", key, 0, n - 1, blob, dst):
            raise AssertionError("a sealed object did not open")
    t_open = time.perf_counter() - t0
    return {"seal": _gbps(n * size, t_seal), "open": _gbps(n * size, t_open)}


def node_round(procs: Procs, work: Path, size: int, total: int, encrypted: bool) -> dict[str, float]:
    """Puts that demote to the SSD tier and gets that promote back, through a real store node."""
    from kvpool.pool.node_client import StoreClient
    from kvpool.wire.proto import store_pb2 as pb

    n = max(16, total // size)
    batch = max(1, min(8, (4 * MiB) // size))
    tag = f"{'enc' if encrypted else 'plain'}-{size}"
    ssd_dir = work / f"node-{tag}"
    argv = [sys.executable, "-m", "kvpool", "store", "--listen", f"127.0.0.1:{free_port()}", "--transfer-port", "0",
            "--node-id", f"bench-{tag}", "--dram", str(max(8 * MiB, 4 * batch * size)),
            "--ssd-path", str(ssd_dir), "--ssd", str(2 * n * (sealed_size(size) + 8192))]
    if encrypted:
        key_file = work / "master.key"
        key_file.write_bytes(MASTER)
        argv += ["--master-key-file", str(key_file)]
    with procs.scope() as scope:
        node = scope.start(f"store-{tag}", argv, env=python_env(), ready_line="READY", timeout=120)
        address = (node.ready_line or "").split()[1]
        keys = [os.urandom(32) for _ in range(n)]
        val = os.urandom(size)
        with StoreClient(address) as c:
            t0 = time.perf_counter()
            for i in range(0, n, batch):
                codes = c.put(keys[i:i + batch], [val] * len(keys[i:i + batch]))
                if any(code != pb.OK for code in codes):
                    raise AssertionError(f"put failed: {codes}")
            t_put = time.perf_counter() - t0
            demoted = c.stats().counters[StoreCounter.DEMOTED]
            bufs = [memoryview(bytearray(size)) for _ in range(batch)]
            t0 = time.perf_counter()
            for i in range(0, n, batch):
                ks = keys[i:i + batch]
                got = c.get_into(ks, bufs[:len(ks)])
                if any(code != pb.OK for code in got):
                    raise AssertionError(f"get failed: {got}")
            t_get = time.perf_counter() - t0
            st = c.stats().counters
            if bytes(bufs[0]) != val:
                raise AssertionError("read back other bytes")
            if encrypted and st.get(StoreCounter.SEALED, 0) < demoted:
                raise AssertionError("the encrypted node did not seal what it demoted")
        shutil.rmtree(ssd_dir, ignore_errors=True)
    return {"put+demote": _gbps(n * size, t_put), "get+promote": _gbps(n * size, t_get),
            "demoted_fraction": demoted / n, "promoted_fraction": st.get(StoreCounter.PROMOTED, 0) / n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller totals, fewer sizes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the slot files go (default: a temp dir on /tmp)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sizes = [128 * KiB, 1 * MiB, 4 * MiB] if not args.quick else [1 * MiB]
    tier_total = (64 if args.quick else 256) * MiB
    node_total = (64 if args.quick else 256) * MiB
    work = Path(tempfile.mkdtemp(prefix="kvpool-bench-ssd-", dir=args.dir))
    procs = Procs(work)
    rows: dict[str, list[dict[str, float]]] = {}
    try:
        for r in range(args.rounds):
            for size in sizes:
                rows.setdefault(f"aead {size // KiB}KiB", []).append(aead_round(size, tier_total))
                for enc in (False, True):
                    name = f"{'encrypted' if enc else 'plain'} {size // KiB}KiB"
                    rows.setdefault(f"tier {name}", []).append(tier_round(work, size, tier_total, enc))
                    rows.setdefault(f"node {name}", []).append(node_round(procs, work, size, node_total, enc))
            print(f"[bench] round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    med: dict[str, dict[str, float]] = {
        k: {m: statistics.median(v[m] for v in vs) for m in vs[0]} for k, vs in rows.items()}
    print(f"{'row':<28} {'metric':<18} {'GB/s (median)':>14} {'enc/plain':>10}")
    for k, ms in med.items():
        for m, v in ms.items():
            ratio = ""
            if k.startswith(("tier encrypted", "node encrypted")) and not m.endswith("fraction"):
                plain = med[k.replace("encrypted", "plain")][m]
                ratio = f"{v / plain:.2f}"
            print(f"{k:<28} {m:<18} {v:>14.3f} {ratio:>10}")
    if args.json:
        doc: dict[str, Any] = {"rounds": args.rounds, "quick": args.quick, "medians": med, "raw": rows,
                               "cpus": os.cpu_count(), "doc": __doc__}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
