"""The local tier under pressure (LRU eviction, pinned views stay valid, data still readable
from the pool) and the sidecar's Prometheus endpoint."""

from __future__ import annotations

import random
import re
import socket
import urllib.request
from typing import Any

from kvpool.core import errors
from kvpool.core.retry import UNREACHABLE
from kvpool.wire.counters import SidecarCounter, is_sidecar_counter, pool_write_failed
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


def test_eviction_under_pressure_keeps_capacity_and_data(shared: Any, h: Any, rng: random.Random) -> None:
    addr = shared.add_sidecar(local_bytes=4 * MiB)
    i = shared.sidecars.index(addr)
    with shared.connect(i) as c:
        cap = c.stats().local_capacity_bytes
        assert 4 * MiB <= cap < 5 * MiB
        written: list[tuple[bytes, bytes]] = []
        pinned_keys = h.keys(rng, 4)
        pinned_vals = h.values(rng, [64 * KiB] * 4)
        assert c.put(pinned_keys, pinned_vals) == [pb.OK] * 4
        with c.get(pinned_keys) as pinned:  # held across the pressure below
            while sum(len(v) for _, v in written) < 3 * cap:
                ks = h.keys(rng, 8)
                vs = h.values(rng, [rng.randrange(1, 96 * KiB) for _ in ks])
                assert c.put(ks, vs) == [pb.OK] * 8
                written += zip(ks, vs, strict=True)
                st = c.stats()
                assert st.local_used_bytes <= st.local_capacity_bytes
            # Pinned views were never evicted, so their bytes never changed under us.
            assert [bytes(v) for v in pinned] == pinned_vals
        st = c.stats()
        assert st.counters[SidecarCounter.EVICTED] > 0 and st.local_used_bytes <= st.local_capacity_bytes
        h.wait_for(lambda: c.stats().pending_pool_bytes == 0, what="write-through backlog")
        assert st.counters.get(pool_write_failed(UNREACHABLE), 0) == 0
        # Everything is still readable: what was evicted comes back from the pool.
        before = h.counters(c)
        keys = [k for k, _ in written]
        assert c.match(keys[:16]) == 16
        for j in range(0, len(keys), 16):
            with c.get(keys[j:j + 16]) as got:
                assert [bytes(v) for v in got] == [v for _, v in written[j:j + 16]]
        after = h.counters(c)
        assert after[SidecarCounter.READ_HITS_POOL] > before.get(SidecarCounter.READ_HITS_POOL, 0)
        assert c.stats().local_used_bytes <= cap


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(kvpool_[a-zA-Z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_prometheus_endpoint_serves_kvpool_series(shared: Any, h: Any, rng: random.Random) -> None:
    port = _free_port()
    addr = shared.add_sidecar(local_bytes=8 * MiB, extra_args=["--metrics-port", str(port)])
    with shared.connect(shared.sidecars.index(addr)) as c, shared.connect(0) as other:
        keys = h.keys(rng, 10)
        values = h.values(rng, [10 * KiB] * 10)
        assert other.put(keys[5:], values[5:]) == [pb.OK] * 5  # in the pool, not local here
        h.wait_for(lambda: other.stats().pending_pool_bytes == 0, what="write-through backlog")
        assert c.put(keys[:5], values[:5]) == [pb.OK] * 5
        h.wait_for(lambda: c.stats().pending_pool_bytes == 0, what="write-through backlog")
        assert c.match(keys) == 10
        with c.get(keys) as got:
            assert [bytes(v) for v in got] == values
        st = c.stats()
        m = _scrape(port)
    t = 'tenant="default"'
    assert m[f"kvpool_lookup_blocks_total{{{t}}}"] == 10
    assert m[f'kvpool_hit_blocks_total{{{t},tier="local"}}'] == 5
    assert m[f'kvpool_hit_blocks_total{{{t},tier="pool"}}'] == 5
    assert m[f'kvpool_read_blocks_total{{{t},tier="local"}}'] == 5
    assert m[f'kvpool_read_blocks_total{{{t},tier="pool"}}'] == 5
    assert m[f"kvpool_read_bytes_total{{{t}}}"] == sum(map(len, values))
    assert m[f"kvpool_put_bytes_total{{{t}}}"] == sum(map(len, values[:5]))
    assert m[f"kvpool_pool_bytes_out_total{{{t}}}"] == sum(map(len, values[:5]))
    assert m[f"kvpool_pool_bytes_in_total{{{t}}}"] == sum(map(len, values[5:]))
    for op in ("match", "read", "put"):
        assert m[f'kvpool_op_seconds_count{{op="{op}"}}'] >= 1
        assert f'kvpool_op_seconds_bucket{{le="+Inf",op="{op}"}}' in m
    assert m["kvpool_local_capacity_bytes"] == st.local_capacity_bytes
    assert m["kvpool_local_used_bytes"] == st.local_used_bytes > 0
    assert m["kvpool_local_objects"] == 10
    assert m["kvpool_pool_nodes_up"] == 2
    assert m["kvpool_ring_epoch"] == st.ring_epoch
    assert m["kvpool_pool_errors_total"] == 0
    assert "kvpool_local_evictions_total" in m
    # No per-key labels anywhere: a handful of series, whatever the number of keys; the Stats
    # counters (kvpool_sidecar_events) are one series per name of the schema.
    events = [k for k in m if k.startswith("kvpool_sidecar_events")]
    assert all(is_sidecar_counter(re.sub(r'.*event="([^"]+)".*', r"\1", k)) for k in events), events
    assert len(m) - len(events) < 90


def test_concurrent_reads_and_writes_under_pressure_never_see_wrong_bytes(shared: Any, h: Any,
                                                                          rng: random.Random) -> None:
    """Readers and writers race on a small local tier: lookups, promotions from the pool and
    evictions interleave, and every view handed out holds exactly its object's bytes."""
    import concurrent.futures as cf
    import threading

    addr = shared.add_sidecar(local_bytes=2 * MiB)
    i = shared.sidecars.index(addr)
    lock = threading.Lock()
    written: list[tuple[bytes, bytes]] = []
    seed_keys = h.keys(rng, 64)
    seed_vals = h.values(rng, [rng.randrange(1, 48 * KiB) for _ in seed_keys])
    with shared.connect(0) as other:  # in the pool only: reads promote them into the small tier
        assert other.put(seed_keys, seed_vals) == [pb.OK] * 64
        h.wait_for(lambda: other.stats().pending_pool_bytes == 0, what="write-through backlog")
    written += zip(seed_keys, seed_vals, strict=True)
    wrong: list[bytes] = []

    def writer(seed: int) -> None:
        r = random.Random(seed)
        with shared.connect(i) as c:
            for _ in range(25):
                ks = [r.randbytes(32) for _ in range(6)]
                vs = [r.randbytes(r.randrange(1, 200 * KiB)) for _ in ks]
                codes = c.put(ks, vs)
                with lock:
                    written.extend((k, v) for k, v, code in zip(ks, vs, codes, strict=True) if code == pb.OK)

    def reader(seed: int) -> int:
        r = random.Random(seed)
        hits = 0
        with shared.connect(i) as c:
            for _ in range(60):
                with lock:
                    batch = r.sample(written, 6)
                bufs = [bytearray(200 * KiB) for _ in batch]
                sizes = c.get_into([k for k, _ in batch], bufs)
                for (k, v), n, b in zip(batch, sizes, bufs, strict=True):
                    if n >= 0:
                        hits += 1
                        if bytes(b[:n]) != v:
                            wrong.append(k)
                try:
                    with c.get([k for k, _ in batch]) as views:
                        for (k, v), view in zip(batch, views, strict=True):
                            if bytes(view) != v:
                                wrong.append(k)
                except errors.NotFound:
                    pass  # written by a writer, not in the pool yet, evicted locally: a miss
        return hits

    with cf.ThreadPoolExecutor(6) as ex:
        ws = [ex.submit(writer, 1000 + j) for j in range(2)]
        rs = [ex.submit(reader, 2000 + j) for j in range(4)]
        for f in ws:
            f.result()
        hits = sum(f.result() for f in rs)
    assert not wrong
    assert hits > 0
    with shared.connect(i) as c:
        st = c.stats()
        assert st.counters[SidecarCounter.EVICTED] > 0 and st.local_used_bytes <= st.local_capacity_bytes
        assert shared.sidecar_procs[i].popen.poll() is None
