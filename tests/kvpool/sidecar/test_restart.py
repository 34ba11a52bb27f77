"""A sidecar restart (SIGKILL, then a new process on the same socket and arena directory: what a
pod's native sidecar with ``restartPolicy: Always`` goes through) never hands a client another
object's bytes, and keeps the pod's cache: the new sidecar adopts the arena and its journal,
checks every object, and resumes writing what exists only here to the pool."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvpool.apps.cluster import LocalCluster
from kvpool.client.client import Client
from kvpool.core import errors
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


def _wrong(client: Any, keys: list[bytes], values: list[bytes]) -> tuple[int, int, int]:
    """(right, wrong, errors) of reading each key alone, in reverse order (so a new sidecar's
    extents differ from the old ones), by ``get`` then ``get_into``."""
    right = wrong = failed = 0
    for k, v in zip(reversed(keys), reversed(values), strict=True):
        try:
            with client.get([k]) as got:
                ok = bytes(got[0]) == v
            right += ok
            wrong += not ok
        except errors.KvpoolError:
            failed += 1
        buf = np.zeros(len(v) + 16, np.uint8)
        try:
            size = client.get_into([k], [buf])[0]
        except errors.KvpoolError:
            failed += 1
            continue
        if size < 0:
            failed += 1
        elif size == len(v) and buf[:size].tobytes() == v:
            right += 1
        else:
            wrong += 1
    return right, wrong, failed


@pytest.mark.parametrize("kill", [True, False], ids=["sigkill", "sigterm"])
def test_old_client_never_reads_another_objects_bytes_after_a_restart(kill: bool, rng: random.Random,
                                                                      h: Any) -> None:
    """Finding 1: the client kept its mapping of the dead sidecar's arena and applied the new
    sidecar's offsets to it (32 of 32 objects came back with other objects' bytes).  A clean
    stop (SIGTERM: the drain, then the same files) is a restart too."""
    with LocalCluster(stores=1, sidecars=1, local_bytes=16 * MiB) as lc:
        keys = [rng.randbytes(32) for _ in range(32)]
        values = [rng.randbytes(64 * KiB) for _ in keys]
        c = Client(lc.sidecars[0])
        try:
            assert c.put(keys, values) == [pb.OK] * len(keys)
            assert [bytes(v) for v in c.get(keys)] == values
            # In the pool too: a new sidecar can fetch what it did not keep.
            h.wait_for(lambda: c.stats().pending_pool_bytes == 0, 30, what="write-through")
            lc.restart_sidecar(0, kill=kill)
            right, wrong, failed = _wrong(c, keys, values)
            assert wrong == 0, f"{wrong} reads returned other bytes ({right} right, {failed} errors)"
            # Not even an error: a frame that could not be sent on a dead connection is sent again.
            assert (right, failed) == (2 * len(keys), 0)
            right, wrong, failed = _wrong(c, keys, values)
            assert (wrong, failed) == (0, 0) and right == 2 * len(keys)
            assert c.restarts_seen == 1
            st = h.counters(c)
            assert st[SidecarCounter.RESTART_ADOPTED_OBJECTS] == len(keys)  # served from the kept arena
            assert st.get(SidecarCounter.RESTART_RESUMED_POOL_WRITES, 0) == 0  # the journal knew they were in the pool
            # A put through the old client lands where the new sidecar reads it.
            more = [rng.randbytes(32) for _ in range(8)]
            more_values = [rng.randbytes(48 * KiB) for _ in more]
            assert c.put(more, more_values) == [pb.OK] * len(more)
            with lc.connect() as fresh:
                assert [bytes(v) for v in fresh.get(more)] == more_values
        finally:
            c.close()


def _log(lc: LocalCluster, i: int) -> str:
    """Everything sidecar ``i`` logged, over all its lives."""
    d = os.path.dirname(lc.sidecars[i][len("unix://"):])
    out = []
    for n in sorted(os.listdir(d)):
        if n.endswith(".log"):
            with open(os.path.join(d, n)) as f:
                out.append(f.read())
    return "".join(out)


def _view_offset(c: Any, view: memoryview) -> int:
    base = np.frombuffer(c._arena_ro, np.uint8).ctypes.data
    return int(np.frombuffer(view, np.uint8).ctypes.data - base)


def test_write_back_blocks_and_state_survive_a_sigkill_and_reach_the_pool(rng: random.Random, h: Any) -> None:
    """Finding 5: a crash lost the pod's whole local tier, write-back blocks and state objects
    included.  Now the new sidecar adopts the arena: at least 90 % of the objects are served
    from it without a pool read; what was never committed, or whose bytes no longer match their
    checksum, is dropped; what exists only here is written to the pool afterwards."""
    with LocalCluster(stores=1, sidecars=1, local_bytes=16 * MiB, write_back=True) as lc:
        keys = [rng.randbytes(32) for _ in range(96)]
        values = [rng.randbytes(32 * KiB) for _ in keys]
        state_key, state = rng.randbytes(32), rng.randbytes(300 * KiB)
        c = lc.connect()
        try:
            assert c.put(keys, values) == [pb.OK] * len(keys)
            assert c.put_state(state_key, 128, state) == pb.OK
            assert h.counters(c).get(SidecarCounter.LOCAL_ONLY_OBJECTS, 0) == len(keys) + 1  # write-back: only here
            # A write the crash interrupts: reserved, bytes copied, never committed.
            torn_key = rng.randbytes(32)
            codes, offsets, rid, _ = c._fast.write_start(torn_key, [64 * KiB], pb.BLOCK, "chatbot")
            assert rid and codes == [pb.OK]
            c._arena[offsets[0]:offsets[0] + 64 * KiB] = rng.randbytes(64 * KiB)
            # A committed object whose bytes a stray writer changed: its checksum fails.
            with c.get([keys[0]]) as got:
                off = _view_offset(c, got[0])
            c._arena[off] ^= 0xFF
            lc.restart_sidecar(0, kill=True)
            before = h.counters(c)
            # 95 good blocks, the state object
            assert before.get(SidecarCounter.RESTART_ADOPTED_OBJECTS, 0) == len(keys)
            assert f"adopted={len(keys)} dropped=2" in lc.sidecar_procs[0].ready_line
            assert before[SidecarCounter.RESTART_DROPPED_CHECKSUM] == 1
            assert before[SidecarCounter.RESTART_DROPPED_UNCOMMITTED] == 1
            # Never the changed bytes, never the uncommitted write: misses (the pool has neither).
            with pytest.raises(errors.NotFound):
                c.get([keys[0]])
            with pytest.raises(errors.NotFound):
                c.get([torn_key])
            assert c.get_state(state_key, 128) is not None
            assert bytes(c.get_state(state_key, 128) or b"") == state
            got = c.get(keys[1:])
            assert [bytes(v) for v in got] == values[1:]
            got.release()
            after = h.counters(c)
            local = after[SidecarCounter.READ_HITS_LOCAL] - before.get(SidecarCounter.READ_HITS_LOCAL, 0)
            pool = after[SidecarCounter.READ_HITS_POOL] - before.get(SidecarCounter.READ_HITS_POOL, 0)
            assert local >= 0.9 * (len(keys) + 1) and pool == 0, (local, pool)
            # What exists only here still goes to the pool (write-back: on flush / drain).
            assert after[SidecarCounter.LOCAL_ONLY_OBJECTS] == len(keys)
            flushed = c.flush(timeout_ms=30_000)
            assert flushed.dropped_objects == 0 and flushed.flushed_objects == len(keys)
            other = lc.add_sidecar()
            with lc.connect(lc.sidecars.index(other)) as d:
                assert [bytes(v) for v in d.get(keys[1:])] == values[1:]
                assert h.counters(d)[SidecarCounter.READ_HITS_POOL] == len(keys) - 1
                assert bytes(d.get_state(state_key, 128) or b"") == state
        finally:
            c.close()


def test_write_through_blocks_not_yet_in_the_pool_are_written_after_a_restart(rng: random.Random, h: Any) -> None:
    """Blocks put while the pool was unreachable (a stopped store node) and the sidecar then
    killed: the new sidecar writes them to the pool (the write-behind queue) once it is back."""
    with LocalCluster(stores=1, sidecars=1, local_bytes=16 * MiB) as lc:
        keys = [rng.randbytes(32) for _ in range(16)]
        values = [rng.randbytes(32 * KiB) for _ in keys]
        store = lc.store_procs[0].popen
        c = lc.connect()
        try:
            os.kill(store.pid, signal.SIGSTOP)
            try:
                assert c.put(keys, values) == [pb.OK] * len(keys)
                lc.restart_sidecar(0, kill=True)
            finally:
                os.kill(store.pid, signal.SIGCONT)
            h.wait_for(lambda: c.stats().pending_pool_bytes == 0, 60, what="the write-behind backlog")
            other = lc.add_sidecar()
            with lc.connect(lc.sidecars.index(other)) as d:
                assert d.match(keys) == len(keys)  # in the pool
                assert [bytes(v) for v in d.get(keys)] == values
                assert h.counters(d)[SidecarCounter.READ_HITS_POOL] == len(keys)
            st = h.counters(c)
            assert st[SidecarCounter.RESTART_RESUMED_POOL_WRITES] == len(keys)
            assert st[SidecarCounter.POOL_WRITES] >= len(keys)
        finally:
            c.close()


def test_a_kill_during_writes_loses_only_those_writes(rng: random.Random, h: Any) -> None:
    """A writer keeps putting while the sidecar is SIGKILLed: afterwards every key it was told
    OK for (before the kill or after) is served with its bytes, and no key with other bytes;
    what the kill interrupted is lost (a miss), nothing else."""
    with LocalCluster(stores=0, sidecars=1, local_bytes=32 * MiB) as lc:
        c = lc.connect()
        acked: dict[bytes, bytes] = {}
        tried: dict[bytes, bytes] = {}
        stop = threading.Event()

        def writer() -> None:
            while not stop.is_set() and len(tried) < 1000:  # 16 MiB: nothing is evicted
                ks = [rng.randbytes(32) for _ in range(4)]
                vs = [rng.randbytes(16 * KiB) for _ in ks]
                tried.update(zip(ks, vs, strict=True))
                try:
                    codes = c.put(ks, vs)
                except errors.KvpoolError:
                    time.sleep(0.05)  # the sidecar is down: try again soon
                    continue
                acked.update((k, v) for k, v, code in zip(ks, vs, codes, strict=True) if code == pb.OK)

        t = threading.Thread(target=writer)
        t.start()
        try:
            h.wait_for(lambda: len(acked) >= 200, 60, what="some writes")
            lc.restart_sidecar(0, kill=True)
            before = len(acked)
            h.wait_for(lambda: len(acked) >= before + 40 or len(tried) >= 1000, 60, what="writes after the restart")
            assert len(acked) >= before + 40  # the writer's client carries on with the new life
            stop.set()
            t.join(timeout=60)
            assert not t.is_alive()
            with lc.connect() as fresh:
                wrong = lost_acked = 0
                for k, v in tried.items():
                    try:
                        with fresh.get([k]) as got:
                            wrong += bytes(got[0]) != v
                    except errors.NotFound:
                        lost_acked += k in acked
                assert (wrong, lost_acked) == (0, 0)
                assert h.counters(fresh)[SidecarCounter.RESTART_ADOPTED_OBJECTS] >= 200
        finally:
            stop.set()
            c.close()


@pytest.mark.parametrize("change", ["local-bytes", "tenant"])
def test_a_restart_with_another_configuration_starts_empty_and_says_why(change: str, rng: random.Random,
                                                                          h: Any) -> None:
    with LocalCluster(stores=1, sidecars=1, local_bytes=16 * MiB) as lc:
        keys = [rng.randbytes(32) for _ in range(8)]
        values = [rng.randbytes(32 * KiB) for _ in keys]
        c = lc.connect()
        try:
            assert c.put(keys, values) == [pb.OK] * len(keys)
            h.wait_for(lambda: c.stats().pending_pool_bytes == 0, 60, what="write-through")
            if change == "local-bytes":
                lc.restart_sidecar(0, kill=True, local_bytes=24 * MiB)
                why = "local tier size changed"
            else:
                lc.restart_sidecar(0, kill=True, extra_args=["--tenant", "someone-else"])
                why = "tenant changed"
            assert f"local tier not adopted, starting empty: {why}" in _log(lc, 0)
            assert "reset=1" in lc.sidecar_procs[0].ready_line
            if change == "tenant":
                with pytest.raises(errors.PermissionDenied):
                    c.get(keys)
                return
            st = h.counters(c)
            assert st[SidecarCounter.RESTART_ARENA_RESET] == 1
            assert st.get(SidecarCounter.RESTART_ADOPTED_OBJECTS, 0) == 0
            assert c.stats().local_objects == 0
            # The old client remapped the new arena: the pool's copies, right bytes.
            assert [bytes(v) for v in c.get(keys)] == values
            assert c.restarts_seen == 1
        finally:
            c.close()
