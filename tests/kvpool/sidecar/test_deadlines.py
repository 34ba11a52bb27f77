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
import threading
import time
from typing import Any

import pytest

from kvpool.apps.cluster import LocalCluster
from kvpool.client.client import Client
from kvpool.client.session import PROBE_SECONDS
from kvpool.core import errors
from kvpool.core.deadlines import ClientDeadlines
from kvpool.core.ring import owners
from kvpool.pool.data_client import DataSession
from kvpool.pool.node_client import StoreClient
from kvpool.transfer.testing import CuttingProxy
from kvpool.wire import store_frames as dp
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

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


def _stop(h: Any, pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped (the signal takes effect asynchronously)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    h.wait_for(stopped, timeout=10, what=f"process {pid} to stop")


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
            _stop(h, pid)
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
                assert st[SidecarCounter.POOL_DEADLINE_MISSES] >= 1
                skipped = st[SidecarCounter.POOL_CALLS_SKIPPED]
                # The node is suspect now: the next calls do not wait for it at all.
                n, took = _timed(c.match, dead[44:60])
                assert n == 0 and took <= MATCH_BOUND
                with c.get(live[44:60]) as got:
                    assert [bytes(v) for v in got] == [expect[k] for k in live[44:60]]
                st2 = h.counters(c)
                assert st2[SidecarCounter.POOL_CALLS_SKIPPED] > skipped
                # Asked again and again while it is stopped, it costs a deadline at most once per
                # back-off period (probes run beside the calls, not in them).
                t0 = time.monotonic()
                for i in range(10):
                    assert c.match(dead[60 + i:61 + i]) == 0
                assert time.monotonic() - t0 <= 10 * MATCH_BOUND
                assert st2[SidecarCounter.READ_HITS_POOL] - st[SidecarCounter.READ_HITS_POOL] == 16
            finally:
                os.kill(pid, signal.SIGCONT)
            # Running again: a probe lets it back in, and its keys hit again.
            h.wait_for(lambda: c.match(dead[70:80]) == 10, timeout=60, what="the node to be let back in")
            with c.get(dead[80:90]) as got:
                assert [bytes(v) for v in got] == [expect[k] for k in dead[80:90]]
            assert h.counters(c)[SidecarCounter.POOL_PROBES_OK] >= 1


def test_undelivered_reads_are_unavailable_not_not_found(h: Any, rng: random.Random) -> None:
    """Issue 24: ``kvpool demo`` under load failed a cell on a ``get`` right after its match,
    NotFound (NOT_FOUND) for blocks the match had pinned: the pool read missed its deadline (a
    slow part becomes misses) and the sidecar answered NOT_FOUND as if the pool had lost them.
    A block a node did not deliver (deadline passed, node suspect) is UNAVAILABLE; NOT_FOUND
    stays for what the pool does not hold."""
    with LocalCluster(stores=2, sidecars=2, store_bytes=64 * MiB, local_bytes=16 * MiB) as lc:
        keys = h.keys(rng, 96)
        values = h.values(rng, [8 * KiB] * len(keys))
        with lc.connect(0) as w:
            assert w.put(keys, values) == [pb.OK] * len(keys)
            h.wait_for(lambda: w.stats().pending_pool_bytes == 0, what="write-through backlog")
        victim = 1
        live, dead = _split(lc, keys, victim)
        absent = _split(lc, h.keys(rng, 16), victim)[0][:1]  # owned by the live node, never written
        assert len(live) >= 20 and len(dead) >= 20 and absent
        with lc.connect(1) as c:  # nothing local: every hit is a pool hit
            batch = live[:8] + dead[:8]
            n, lease = c.match_lease(batch)
            assert n == 16 and lease
            _stop(h, lc.store_pids[victim])
            try:
                got, took = _timed(lambda: c.get_many(batch + absent, lease_id=lease))
                with got:
                    assert got.codes == [pb.OK] * 8 + [pb.UNAVAILABLE] * 8 + [pb.NOT_FOUND]
                    assert [bytes(v) for v in got.views[:8]] == [values[keys.index(k)] for k in live[:8]]
                assert took <= MATCH_BOUND, took
                assert h.counters(c)[SidecarCounter.POOL_DEADLINE_MISSES] >= 1
                # Suspect now: its keys are not asked for at all, and say so too.
                with c.get_many(dead[8:12] + live[8:10]) as got:
                    assert got.codes == [pb.UNAVAILABLE] * 4 + [pb.OK] * 2
                with pytest.raises(errors.NotFound, match="UNAVAILABLE"):
                    c.get(dead[12:14])
                with pytest.raises(errors.NotFound, match="NOT_FOUND"):
                    c.get(live[14:16] + absent)
            finally:
                os.kill(lc.store_pids[victim], signal.SIGCONT)


def test_stopped_node_keys_are_read_at_replicas(h: Any, rng: random.Random) -> None:
    """With replication 2 a stopped node's keys are not even misses: match and get find them at
    the other replica, within the bound."""
    with LocalCluster(stores=2, sidecars=2, store_bytes=64 * MiB, local_bytes=16 * MiB, replication=2) as lc:
        keys = h.keys(rng, 64)
        values = h.values(rng, [8 * KiB] * len(keys))
        with lc.connect(0) as w:
            assert w.put(keys, values) == [pb.OK] * len(keys)
            h.wait_for(lambda: w.stats().pending_pool_bytes == 0, what="write-through backlog")
        pid = lc.store_pids[1]
        with lc.connect(1) as c:
            assert c.match(keys[:2]) == 2
            _stop(h, pid)
            try:
                for batch in (keys[2:34], keys[34:64]):
                    n, took = _timed(c.match, batch)
                    assert n == len(batch) and took <= MATCH_BOUND, (n, took)
                    got, took = _timed(c.get, batch)
                    with got:
                        assert [bytes(v) for v in got] == [values[keys.index(k)] for k in batch]
                    assert took <= MATCH_BOUND, took
                assert h.counters(c)[SidecarCounter.POOL_CALLS_SKIPPED] > 0
            finally:
                os.kill(pid, signal.SIGCONT)


def test_read_cut_mid_batch_serves_what_arrived_verified(h: Any, rng: random.Random) -> None:
    """Item 4 at the data session: the node's reply is cut inside the 11th object's payload.
    On 633cc92 the whole read raised Unavailable (nothing served)."""
    size = 64 * KiB
    with LocalCluster(stores=1, sidecars=0, store_bytes=64 * MiB) as lc:
        keys = h.keys(rng, 32)
        values = h.values(rng, [size] * len(keys))
        with StoreClient(lc.stores[0]) as sc:
            assert sc.put(keys, values) == [pb.OK] * len(keys)
            host, port = sc.health().transfer_address.rsplit(":", 1)
        # The read's connection is the proxy's first; its reply is the GET's header and table,
        # then the payloads back to back.  Cut 10.5 objects into the payload: 10 arrive whole,
        # the 11th is torn.  (The request, of 32 keys, is far below the cut.)  Over TLS the
        # bytes counted are records (+0.2%), so the cut still lands inside the 11th object.
        head = dp.RESPONSE_SIZE + 17 * len(keys)  # header, then code + size + checksum per key
        proxy = CuttingProxy(f"{host}:{port}", lambda i: head + 10 * size + size // 2 if i == 0 else None)
        ds = DataSession(proxy.address, timeout=10.0, connections=1, tls=lc.client_tls)
        try:
            out = [bytearray(size) for _ in keys]
            r = ds.read(b"".join(keys), lambda i, n: memoryview(out[i]))
        finally:
            ds.close()
            proxy.close()
        assert isinstance(r.error, errors.Unavailable)
        assert r.codes[:10] == [pb.OK] * 10
        assert [bytes(b) for b in out[:10]] == values[:10]
        assert r.codes[10:] == [pb.LEASE_EXPIRED] * 22  # the torn one too: never served


def test_store_killed_mid_get_counts_only_what_was_delivered(h: Any, rng: random.Random) -> None:
    """Item 4 at the sidecar: a node killed during a large two-node get.  Per-item results, every
    byte served is the object's, and the hit counters count exactly the objects delivered."""
    size = 256 * KiB
    with LocalCluster(stores=2, sidecars=2, store_bytes=128 * MiB, local_bytes=96 * MiB) as lc:
        keys = h.keys(rng, 160)
        values = h.values(rng, [size] * len(keys))
        expect = dict(zip(keys, values, strict=True))
        with lc.connect(0) as w:
            for i in range(0, len(keys), 40):
                assert w.put(keys[i:i + 40], values[i:i + 40]) == [pb.OK] * 40
            h.wait_for(lambda: w.stats().pending_pool_bytes == 0, timeout=60, what="write-through backlog")
        live, dead = _split(lc, keys, 1)
        with lc.connect(1) as c:
            before = h.counters(c)
            bufs = [bytearray(size) for _ in keys]
            result: list[Any] = []
            t = threading.Thread(target=lambda: result.append(c.get_into(keys, bufs)))
            t.start()
            time.sleep(0.01)
            os.kill(lc.store_pids[1], signal.SIGKILL)
            t.join(timeout=60)
            assert not t.is_alive()
            sizes = result[0]
            after = h.counters(c)
        served = [i for i, s in enumerate(sizes) if s != -1]
        assert all(sizes[i] == size and bytes(bufs[i]) == expect[keys[i]] for i in served)
        assert {keys[i] for i in served} >= set(live)  # the live node's objects all came
        assert after[SidecarCounter.READ_HITS_POOL] - before.get(SidecarCounter.READ_HITS_POOL, 0) == len(served)
        assert after.get(SidecarCounter.READ_HITS_LOCAL, 0) == before.get(SidecarCounter.READ_HITS_LOCAL, 0)
        misses = after.get(SidecarCounter.READ_MISSES, 0) - before.get(SidecarCounter.READ_MISSES, 0)
        assert misses == len(keys) - len(served)


def test_client_calls_are_bounded(h: Any, rng: random.Random) -> None:
    """A sidecar that does not answer (stopped) costs each client call its bound, and the client
    is usable once it runs again."""
    with LocalCluster(stores=1, sidecars=1, store_bytes=16 * MiB, local_bytes=16 * MiB) as lc:
        keys = h.keys(rng, 8)
        values = h.values(rng, [4 * KiB] * len(keys))
        bounds = ClientDeadlines(match_seconds=0.3, read_seconds=0.5, other_seconds=5.0)
        with Client(lc.sidecars[0], deadlines=bounds) as c:
            assert c.put(keys, values) == [pb.OK] * len(keys)
            pid = lc.sidecar_pids[0]
            _stop(h, pid)
            try:
                # The first call waits out its bound ...
                t0 = time.monotonic()
                with pytest.raises(errors.DeadlineExceeded):
                    c.match(keys)
                took = time.monotonic() - t0
                assert 0.3 <= took + 0.05 and took <= 0.3 + MATCH_BOUND, took
                # ... and then the client's breaker fails calls after one short probe (a new
                # connection's greeting, PROBE_SECONDS), not after each call's bound again.
                for call in (lambda: c.get_into(keys, [bytearray(4 * KiB)] * 8), lambda: c.match(keys)):
                    t0 = time.monotonic()
                    with pytest.raises(errors.Unavailable):
                        call()
                    assert time.monotonic() - t0 <= PROBE_SECONDS + MATCH_BOUND
            finally:
                os.kill(pid, signal.SIGCONT)
            # The client's breaker lets calls through again once a probe call is answered
            # (within its back-off, at most 1 s after the sidecar resumed).
            h.wait_for(lambda: _matched(c, keys) == len(keys), timeout=10, what="calls to go through again")
            with c.get(keys) as got:
                assert [bytes(v) for v in got] == values


def _matched(c: Client, keys: list[bytes]) -> int:
    """``c.match(keys)``, or -1 while the client's breaker still fails calls at once."""
    try:
        return c.match(keys)
    except errors.Unavailable:
        return -1
