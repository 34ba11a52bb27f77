"""Scale-up without a cold pool (issue 8 part 1), on real processes.

A warm working set is read from a pool of two store nodes; a third joins the ring.  Reads that
miss at the new owner fall back to the previous owner and copy the block over; the previous owners
push the rest (warm-up); a reader that never falls back then finds every key at its owner.
"""

from __future__ import annotations

import random
from typing import Any

from kvpool.apps.cluster import LocalCluster
from kvpool.core.ring import owners
from kvpool.pool.node_client import StoreClient
from kvpool.wire.counters import SidecarCounter, total
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


def _hit_rate(c: Any, keys: list[bytes], values: list[bytes]) -> float:
    """Pool hit rate of one pass: local copies dropped first, so every hit comes from the pool."""
    c.remove(keys)
    assert c.stats().local_objects == 0
    hits = 0
    for i in range(0, len(keys), 64):
        bufs = [bytearray(len(v)) for v in values[i:i + 64]]
        sizes = c.get_into(keys[i:i + 64], bufs)
        for size, buf, v in zip(sizes, bufs, values[i:i + 64], strict=True):
            if size >= 0:
                assert size == len(v)
                assert bytes(buf) == v  # never another object's bytes
                hits += 1
    return hits / len(keys)


def _moved_to(keys: list[bytes], ids: list[str], new: str) -> list[bytes]:
    own = owners(b"".join(keys), ids)[:, 0]
    return [k for k, o in zip(keys, own.tolist(), strict=True) if ids[o] == new]


def test_adding_a_node_keeps_the_warm_working_set_hitting(h: Any, rng: random.Random) -> None:
    with LocalCluster(stores=2, sidecars=1, store_bytes=64 * MiB, local_bytes=16 * MiB) as lc:
        hot = h.keys(rng, 192)
        hot_v = h.values(rng, [rng.randrange(1, 16 * KiB) for _ in hot])
        cold = h.keys(rng, 192)
        cold_v = h.values(rng, [rng.randrange(1, 16 * KiB) for _ in cold])
        with lc.connect(0) as w:
            for i in range(0, len(hot), 64):
                assert w.put(hot[i:i + 64] + cold[i:i + 64], hot_v[i:i + 64] + cold_v[i:i + 64]) == [pb.OK] * 128
            h.wait_for(lambda: w.stats().pending_pool_bytes == 0, what="write-through backlog")
        lc.add_sidecar()  # reader A: falls back during a ring transition (the default)
        with lc.connect(1) as a:
            before = _hit_rate(a, hot, hot_v)
            assert before == 1.0

            new_addr = lc.add_store()  # a new ring epoch with store-2
            new = lc.store_ids[-1]
            moved_hot, moved_cold = _moved_to(hot, lc.store_ids, new), _moved_to(cold, lc.store_ids, new)
            assert moved_hot and moved_cold
            # Keep reading: the first pass may still go by the old ring (the reader learns the new
            # one from the nodes' answers); the next ones miss at the new owner and fall back.
            during = [_hit_rate(a, hot, hot_v)]
            h.wait_for(lambda: a.stats().ring_epoch == lc.epoch, what="the reader on the new ring")
            during += [_hit_rate(a, hot, hot_v) for _ in range(2)]  # every moved key falls back at least once
            assert min(during) >= before, f"hit rate dropped on the node add: before {before:.3f}, during {during}"
            # Each fallback hit is copied to the new owner off the read path, once.
            done = (SidecarCounter.POOL_COPYOVER_WRITTEN, SidecarCounter.POOL_COPYOVER_PRESENT,
                    SidecarCounter.POOL_COPYOVER_FAILED)
            h.wait_for(lambda: (c := h.counters(a)).get(SidecarCounter.POOL_COPYOVER_QUEUED_BYTES, 0) == 0
                       and total(c, done) == c.get(SidecarCounter.POOL_COPYOVER_QUEUED, 0), what="copy-over")
            copied = h.counters(a)
            assert copied.get(SidecarCounter.POOL_COPYOVER_WRITTEN, 0) == len(moved_hot), str(sorted(copied.items()))
            assert copied.get(SidecarCounter.POOL_COPYOVER_FAILED, 0) == 0, copied
            with StoreClient(new_addr) as fresh:
                assert fresh.exists(moved_hot, prefix_only=False).present == [True] * len(moved_hot)
                assert fresh.exists(moved_cold, prefix_only=False).present == [False] * len(moved_cold)

        # Reader B never falls back (no transition window): what it finds, it finds at the owner.
        lc.add_sidecar(extra_args=["--transition-seconds", "0"])
        with lc.connect(2) as b:
            cold_before_push = _hit_rate(b, cold, cold_v)
            expect = 1 - len(moved_cold) / len(cold)
            assert abs(cold_before_push - expect) < 1e-9, (cold_before_push, expect)  # the moved ones are cold

            # The previous owners push what the new node now owns, hottest first.
            lc.warm([new], deadline_seconds=60)

            def finished() -> list[Any] | None:
                prev = [v for k, v in lc.warm_status().items() if k != new]
                return prev if all(v.state == "done" for v in prev) else None
            prev = h.wait_for(finished, what="warm-up push")
            assert sum(v.failed_objects for v in prev) == 0 and sum(v.remaining_objects for v in prev) == 0
            assert sum(v.skipped_objects for v in prev) == len(moved_hot)  # copied over already: not re-sent
            assert sum(v.moved_objects for v in prev) == len(moved_cold)
            with StoreClient(new_addr) as fresh:
                assert fresh.exists(moved_hot + moved_cold, prefix_only=False).present == [True] * (
                    len(moved_hot) + len(moved_cold))

            after = _hit_rate(b, hot + cold, hot_v + cold_v)
            assert after >= before, (f"hit rate after the push {after:.3f} < before {before:.3f} "
                                     f"(cold set before the push: {cold_before_push:.3f})")
            assert h.counters(b).get(SidecarCounter.POOL_COPYOVER_QUEUED, 0) == 0  # no fallback was needed
