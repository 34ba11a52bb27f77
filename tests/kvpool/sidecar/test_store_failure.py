"""kill -9 of a store node under load: no wrong bytes, the sidecars stay up and keep serving,
the lost keys become counted misses, and a republished ring sends writes to the live node."""

from __future__ import annotations

import os
import random
import signal
import threading
from typing import Any

from kvpool.apps.cluster import LocalCluster
from kvpool.core import errors
from kvpool.core.ring import owners
from kvpool.pool.node_client import StoreClient
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


def _owner(lc: LocalCluster, keys: list[bytes], ids: list[str]) -> list[str]:
    return [ids[i] for i in owners(b"".join(keys), ids)[:, 0].tolist()]


def test_kill_store_under_load(h: Any, rng: random.Random) -> None:
    # Sidecar 1 reads with a small local tier, so most reads go to the pool again and again.
    with LocalCluster(stores=2, sidecars=1, store_bytes=64 * MiB, local_bytes=16 * MiB) as lc:
        lc.add_sidecar(local_bytes=1 * MiB)  # sidecar 1
        keys = h.keys(rng, 240)
        values = h.values(rng, [rng.randrange(1, 24 * KiB) for _ in keys])
        expect = dict(zip(keys, values, strict=True))
        with lc.connect(0) as w:
            for i in range(0, len(keys), 40):
                assert w.put(keys[i:i + 40], values[i:i + 40]) == [pb.OK] * 40
            h.wait_for(lambda: w.stats().pending_pool_bytes == 0, what="write-through backlog")

        victim, survivor = 1, 0
        ok_gets, misses, wrong, failures = [0], [0], [], []
        gets_done = threading.Semaphore(0)
        stop = threading.Event()
        lock = threading.Lock()

        def reader(seed: int) -> None:
            r = random.Random(seed)
            with lc.connect(1) as c:
                while not stop.is_set():
                    batch = r.sample(keys, 6)
                    try:
                        n = c.match(batch)
                        assert 0 <= n <= len(batch)
                        with c.get(batch) as got:
                            for k, v in zip(batch, got, strict=True):
                                if bytes(v) != expect[k]:
                                    with lock:
                                        wrong.append(k)
                        with lock:
                            ok_gets[0] += 1
                    except errors.NotFound:
                        with lock:
                            misses[0] += 1
                    except Exception as exc:  # anything else reaching the engine is a bug
                        with lock:
                            failures.append(repr(exc))
                    gets_done.release()

        def writer(seed: int) -> None:
            r = random.Random(seed)
            with lc.connect(0) as c:
                while not stop.is_set():
                    ks = [r.randbytes(32) for _ in range(4)]
                    try:
                        codes = c.put(ks, [r.randbytes(r.randrange(1, 8 * KiB)) for _ in ks])
                        if any(x != pb.OK for x in codes):
                            with lock:
                                failures.append(f"put codes {codes}")
                    except Exception as exc:
                        with lock:
                            failures.append(repr(exc))

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
        threads += [threading.Thread(target=writer, args=(100 + i,)) for i in range(2)]
        for t in threads:
            t.start()
        try:
            for _ in range(40):  # some load before the crash...
                assert gets_done.acquire(timeout=60)
            os.kill(lc.store_pids[victim], signal.SIGKILL)
            lc.store_procs[victim].popen.wait()
            for _ in range(150):  # ...and plenty after it
                assert gets_done.acquire(timeout=60)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert not wrong, f"{len(wrong)} reads returned wrong bytes"
        assert not failures, failures[:5]
        assert ok_gets[0] > 0 and misses[0] > 0
        assert all(p.popen.poll() is None for p in lc.sidecar_procs)

        ids = lc.store_ids
        own = _owner(lc, keys, ids)
        with lc.connect(1) as c:
            st = h.counters(c)
            assert st[SidecarCounter.READ_MISSES] > 0 and st[SidecarCounter.POOL_ERRORS] > 0
            # Keys of the live node are all still readable; those of the dead one are misses.
            alive = [k for k, o in zip(keys, own, strict=True) if o == ids[survivor]]
            assert len(alive) > 50
            for i in range(0, len(alive), 20):  # batches that fit the reader's 1 MiB tier
                with c.get(alive[i:i + 20]) as got:
                    assert [bytes(v) for v in got] == [expect[k] for k in alive[i:i + 20]]
            dead = [k for k, o in zip(keys, own, strict=True) if o == ids[victim]]
            assert c.get_into(dead, [bytearray(24 * KiB) for _ in dead]).count(-1) > 0

        # The operator's job: a ring without the dead node.  The sidecars learn it from any
        # node's reply and write everything to the live node from then on.
        epoch = lc.publish_ring()
        with lc.connect(0) as w, lc.connect(1) as r2:
            h.wait_for(lambda: w.match(keys[:1]) is not None and w.stats().ring_epoch == epoch,
                       what="the sidecar to learn the new ring epoch")
            # Blocks whose write-through failed while their owner was dead were kept local-only,
            # and are written again under the new ring.
            assert h.counters(w)[SidecarCounter.POOL_WRITES_RETRIED] > 0
            h.wait_for(lambda: h.counters(w)[SidecarCounter.LOCAL_ONLY_OBJECTS] == 0
                       and w.stats().pending_pool_bytes == 0,
                       timeout=60, what="failed writes to be retried under the new ring")
            fresh = h.keys(rng, 64)
            fvalues = h.values(rng, [4 * KiB] * 64)
            assert w.put(fresh, fvalues) == [pb.OK] * 64
            h.wait_for(lambda: w.stats().pending_pool_bytes == 0, what="write-through backlog")
            with StoreClient(lc.stores[survivor]) as live:
                assert live.exists(fresh, prefix_only=False).present == [True] * 64
            assert r2.match(fresh) == 64
            with r2.get(fresh) as got:
                assert [bytes(v) for v in got] == fvalues
        assert all(p.popen.poll() is None for p in lc.sidecar_procs)

        # Now the whole pool dies.  A sidecar stopped with local-only state objects reports them
        # dropped, and still exits cleanly within its drain deadline.
        os.kill(lc.store_pids[survivor], signal.SIGKILL)
        lc.store_procs[survivor].popen.wait()
        with lc.connect(0) as w:
            for k in h.keys(rng, 3):
                assert w.put_state(k, 128, rng.randbytes(10 * KiB)) == pb.OK
            with w.get(fresh[:4]) as got:  # and the local tier still serves
                assert [bytes(v) for v in got] == fvalues[:4]
        proc = lc.sidecar_procs[0]
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=60) == 0
        assert proc.reader is not None
        proc.reader.join(timeout=10)
        flushed = [ln for ln in proc.lines if ln.startswith("FLUSHED")]
        assert len(flushed) == 1, proc.lines
        got = dict(kv.split("=") for kv in flushed[0].split()[1:])
        # Exactly the 3 states: every block had reached the pool before it died.
        assert (got["objects"], got["dropped"]) == ("0", "3"), flushed
