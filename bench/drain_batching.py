#!/usr/bin/env python3
"""A drain to several owners: how long a leaving node takes to push its objects, and in how many puts.

    python bench/drain_batching.py [--objects N] [--value-kib K] [--targets T] [--rounds R] [--json PATH]

A ``kvpool.LocalCluster`` of T + 1 store nodes and no sidecar.  Per round, with fresh keys: N
objects of K KiB are written to store-0 alone (epoch 0: no routing), store-0 is marked
draining in a new ring epoch, and the clock runs from its ``Drain`` call (unbounded, a far
deadline) until its status is done; every object must have moved.  Then the objects are removed
everywhere and store-0 is active again for the next round.  ``puts`` is how many batches the
push plan makes of that order (:func:`kvpool.store.push.batches`, hottest first, with its
defaults).  Numbers are medians over rounds; nothing here fails on a number.
"""

from __future__ import annotations

import argparse
import json
import random
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
from kvpool.core.ring import owners  # noqa: E402
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS  # noqa: E402
from kvpool.pool.node_client import StoreClient  # noqa: E402
from kvpool.store.push import batches  # noqa: E402
from kvpool.wire.proto import store_pb2 as pb  # noqa: E402


class _Obj:
    """What the push plan looks at (a stand-in for a node's entry)."""

    def __init__(self, size: int) -> None:
        self.size, self.tenant, self.traffic_class, self.kind = size, "default", DEFAULT_TRAFFIC_CLASS, pb.BLOCK


def _ring(lc: LocalCluster, epoch: int, draining: str) -> pb.Ring:
    return pb.Ring(epoch=epoch, replicas=1, members=[
        pb.RingMember(id=nid, address=addr, state="draining" if nid == draining else "active")
        for nid, addr in zip(lc.store_ids, lc.stores, strict=True)])


def one_round(lc: LocalCluster, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    size = args.value_kib * KiB
    keys = [rng.randbytes(32) for _ in range(args.objects)]
    payload = [rng.randbytes(size) for _ in range(16)]
    lc.publish_ring()  # every node active
    with StoreClient(lc.stores[0]) as c:
        for i in range(0, len(keys), 16):
            part = keys[i:i + 16]
            assert c.put(part, payload[:len(part)]) == [pb.OK] * len(part)
            time.sleep(0.001)  # distinct last-access times: a definite hottest-first order
    lc.publish_ring(draining=["store-0"])
    ring = _ring(lc, lc.epoch, "store-0")
    hot = keys[::-1]
    targets = owners(b"".join(hot), lc.store_ids[1:])[:, 0].tolist()
    puts = len(batches([_Obj(size) for _ in hot], targets))
    with lc.admin(lc.stores[0]) as admin:
        t0 = time.perf_counter()
        admin.drain(ring, int((time.time() + 600) * 1000))
        while (st := admin.drain_status()).state != "done" or st.epoch != lc.epoch:
            time.sleep(0.002)
        took = time.perf_counter() - t0
    if st.moved_objects != len(keys) or st.dropped_objects:
        raise RuntimeError(f"drain moved {st.moved_objects} of {len(keys)}, dropped {st.dropped_objects}")
    for addr in lc.stores:
        with StoreClient(addr) as c:
            c.remove(keys)
    return {"drain_s": took, "mib_s": len(keys) * size / MiB / took, "puts": puts,
            "objects_per_put": len(keys) / puts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=512)
    ap.add_argument("--value-kib", type=int, default=64)
    ap.add_argument("--targets", type=int, default=3, help="store nodes the drain pushes to")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    need = args.objects * args.value_kib * KiB
    with LocalCluster(stores=args.targets + 1, sidecars=0, store_bytes=max(64 * MiB, 3 * need)) as lc:
        one_round(lc, args, rng)  # untimed: connections, first touch of the arenas
        rounds = [one_round(lc, args, rng) for _ in range(args.rounds)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"drain of {args.objects} x {args.value_kib} KiB to {args.targets} owners, {args.rounds} rounds, medians: "
          f"{med['drain_s'] * 1e3:.0f} ms ({med['mib_s']:.0f} MiB/s), {med['puts']:.0f} puts "
          f"({med['objects_per_put']:.1f} objects each); all rounds (ms): "
          + ", ".join(f"{r['drain_s'] * 1e3:.0f}" for r in rounds))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds, "median": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
