"""Deadlines and the circuit breaker on real processes (issue 19, finding 2 and item 4).

A store node that is stopped (SIGSTOP: a hung VM, a long GC pause) must cost the engine at most
one call's deadline: ``match`` and ``get`` of keys over both nodes come back within a bound with
the live node's keys as hits and the stopped node's as misses, later calls skip the suspect node
at once, and once it runs again a probe lets it back in.  A node killed in the middle of a large
read gives per-item codes: what arrived verified is served, the rest are misses, and the hit
counters count only what was delivered.
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

from kvpool.local import LocalCluster
from kvpool.proto import store_pb2 as pb
from kvpool.ring import owners

KiB, MiB = 1 << 10, 1 << 20

MATCH_BOUND = 1.0
"""Seconds a match or get may take while a node is stopped: the default deadlines are ~100 ms
(match) and 100 ms + bytes / 200 MB/s (read); the rest is margin for a loaded 2-core machine."""


def _split(lc: LocalCluster, keys: list[bytes], victim: int) -> tuple[list[bytes], list[bytes]]:
    """(keys owned by the other node, keys owned by node ``victim``), in ``keys``' order."""
    ids = lc.store_ids
    own = owners(b"".join(keys), ids)[:, 0].tolist()
    live = [k for k, o in zip(keys, own, strict=True) if o != victim]
    dead = [k for k, o in zip(keys, own, strict=True) if o == victim]
    return live, dead


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def test_stopped_store_node_costs_one_deadline(h: Any, rng: random.Random) -> None:
    """Finding 2: on 633cc92 the first match with a node stopped took ~10 s."""
    with LocalCluster(stores=2, sidecars=2, store_bytes=64 * MiB, local_bytes=16 * MiB) as lc:
        keys = h.keys(rng, 256)
        values = h.values(rng, [8 * KiB] * len(keys))
        expect = dict(zip(keys, values, strict=True))
        with lc.connect(0) as w:
            assert w.put(keys, values) == [pb.OK] * len(keys)
            h.wait_for(lambda: w.stats().pending_pool_bytes == 0, what="write-through backlog")
        victim = 1
        live, dead = _split(lc, keys, victim)
        assert len(live) >= 95 and len(dead) >= 95
        pid = lc.store_pids[victim]
        with lc.connect(1) as c:  # sidecar 1 has none of the keys locally: every hit is a pool hit
            assert c.match(live[:4] + dead[:4]) == 8  # both nodes serve; sessions are open
            os.kill(pid, signal.SIGSTOP)
            try:
                # The live node's keys first: the prefix ends where the stopped node's begin.
                n, took = _timed(c.match, live[4:24] + dead[4:24])
                assert took <= MATCH_BOUND, f"match took {took:.2f}s with a node stopped"
                assert n == 20
                bufs = [bytearray(8 * KiB) for _ in range(40)]
                mixed = [k for pair in zip(live[24:44], dead[24:44], strict=True) for k in pair]
                sizes, took = _timed(c.get_into, mixed, bufs)
                assert took <= MATCH_BOUND, f"get_into took {took:.2f}s with a node stopped"
                gone = set(dead)
                for k, s, b in zip(mixed, sizes, bufs, strict=True):
                    if k in gone:
                        assert s == -1
                    else:
                        assert s == 8 * KiB and bytes(b) == expect[k]
                st = h.counters(c)
                assert st["pool_deadline_misses"] >= 1
                skipped = st["pool_calls_skipped"]
                # The node is suspect now: the next calls do not wait for it at all.
                n, took = _timed(c.match, dead[44:60])
                assert n == 0 and took <= MATCH_BOUND
                with c.get(live[44:60]) as got:
                    assert [bytes(v) for v in got] == [expect[k] for k in live[44:60]]
                st2 = h.counters(c)
                assert st2["pool_calls_skipped"] > skipped
                # Asked again and again while it is stopped, it costs a deadline at most once per
                # back-off period (probes run beside the calls, not in them).
                t0 = time.monotonic()
                for i in range(10):
                    assert c.match(dead[60 + i:61 + i]) == 0
                assert time.monotonic() - t0 <= 10 * MATCH_BOUND
                assert st2["read_hits_pool"] - st["read_hits_pool"] == 16
            finally:
                os.kill(pid, signal.SIGCONT)
            # Running again: a probe lets it back in, and its keys hit again.
            h.wait_for(lambda: c.match(dead[70:80]) == 10, timeout=60, what="the node to be let back in")
            with c.get(dead[80:90]) as got:
                assert [bytes(v) for v in got] == [expect[k] for k in dead[80:90]]
            assert h.counters(c)["pool_probes_ok"] >= 1
