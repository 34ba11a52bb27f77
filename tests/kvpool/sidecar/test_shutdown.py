"""What exists only in a sidecar reaches the pool: state objects and write-back blocks are
flushed on SIGTERM (and write-back blocks on local eviction), so another sidecar then hits them.
The flush tries a write that failed for a passing reason again until its deadline."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
from collections.abc import Iterator
from typing import Any

from kvpool.apps.cluster import LocalCluster, Proc
from kvpool.core.keys import KeySpace
from kvpool.core.ring import owners
from kvpool.pool.node_client import StoreClient
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
B = 128


def _sigterm(proc: Proc) -> dict[str, int]:
    """SIGTERM a sidecar, expect a clean exit and return its FLUSHED line's numbers."""
    proc.popen.send_signal(signal.SIGTERM)
    return _flushed(proc)


def _flushed(proc: Proc) -> dict[str, int]:
    """A stopping sidecar's FLUSHED line's numbers, once it has exited cleanly."""
    assert proc.popen.wait(timeout=90) == 0
    assert proc.reader is not None
    proc.reader.join(timeout=10)
    lines = [ln for ln in proc.lines if ln.startswith("FLUSHED")]
    assert len(lines) == 1, proc.lines
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", lines[0])}


def test_sigterm_flushes_state_objects_for_another_sidecar(shared: LocalCluster, h: Any, rng: random.Random) -> None:
    ks = KeySpace(model="shutdown-test", block_tokens=B)
    prompt = 8 * B + 50          # cap = L - 134 = 940 → L1 = 896 (7 blocks); state attaches at 896
    sessions = []
    lc = shared
    w = lc.sidecars.index(lc.add_sidecar())  # the sidecar that will be stopped
    with lc.connect(w) as a:
        for _ in range(5):
            tokens = [rng.randrange(32000) for _ in range(prompt)]
            keys = ks.block_keys(tokens)
            blocks = h.values(rng, [20 * KiB] * len(keys))
            state = rng.randbytes(rng.randrange(100 * KiB, 300 * KiB))
            assert a.put(keys, blocks) == [pb.OK] * len(keys)
            assert a.put_state(keys[6], 7 * B, state) == pb.OK
            assert bytes(a.get_state(keys[6], 7 * B) or b"") == state
            sessions.append((keys, blocks, state))
        h.wait_for(lambda: a.stats().pending_pool_bytes == 0, what="write-through backlog")
    with lc.connect(1) as b:
        # Blocks went through to the pool; state objects stay in the writer's host memory.
        keys0 = sessions[0][0]
        assert b.match(keys0) == len(keys0)
        assert b.has_states([keys0[6]]) == [False]
        before = b.plan(prompt, keys0)
        assert (before.hit_tokens, before.state_position) == (6 * B, None)  # falls back a block

    flushed = _sigterm(lc.sidecar_procs[w])
    assert flushed["objects"] == 5 and flushed["dropped"] == 0
    assert flushed["bytes"] == sum(len(s) for _, _, s in sessions)

    with lc.connect(1) as b:
        for keys, blocks, state in sessions:
            plan = b.plan(prompt, keys)
            assert (plan.hit_tokens, plan.state_position, plan.compute_tokens) == (7 * B, 7 * B, prompt - 7 * B)
            got = b.get_state(keys[6], 7 * B)
            assert got is not None and bytes(got) == state
            with b.get(keys[:7]) as blk:
                assert [bytes(v) for v in blk] == blocks[:7]
        assert b.stats().counters[SidecarCounter.READ_HITS_POOL] >= 5


def test_write_back_reaches_the_pool_on_eviction_and_on_sigterm(shared: LocalCluster, h: Any,
                                                                 rng: random.Random) -> None:
    lc = shared
    w = lc.sidecars.index(lc.add_sidecar(local_bytes=1 * MiB, extra_args=["--write-back"]))
    written: list[tuple[bytes, bytes]] = []
    with lc.connect(w) as a, lc.connect(1) as b:
        first = h.keys(rng, 16)
        fvals = h.values(rng, [16 * KiB] * 16)
        assert a.put(first, fvals) == [pb.OK] * 16
        written += zip(first, fvals, strict=True)
        # Write-back: nothing went to the pool yet.
        assert a.stats().pending_pool_bytes == 0
        assert b.match(first) == 0
        # Fill the local tier three times over: the first blocks are evicted, and pushed.
        for _ in range(12):
            ks, vs = h.keys(rng, 16), h.values(rng, [16 * KiB] * 16)
            assert a.put(ks, vs) == [pb.OK] * 16
            written += zip(ks, vs, strict=True)
        st = a.stats()
        assert st.counters[SidecarCounter.EVICTED] > 0 and st.local_used_bytes <= st.local_capacity_bytes
        h.wait_for(lambda: a.stats().pending_pool_bytes == 0, what="evicted blocks to be written")
        assert b.match(first) == 16
        with b.get(first) as got:
            assert [bytes(v) for v in got] == fvals
        still_local = a.stats().local_objects
        assert still_local > 0

    flushed = _sigterm(lc.sidecar_procs[w])
    assert flushed["dropped"] == 0 and 0 < flushed["objects"] <= still_local

    with lc.connect(1) as b:
        keys = [k for k, _ in written]
        for i in range(0, len(keys), 16):  # batches that fit b's 1 MiB tier
            with b.get(keys[i:i + 16]) as got:
                assert [bytes(v) for v in got] == [v for _, v in written[i:i + 16]]


def _logged_or_gone(proc: Proc, text: str) -> bool:
    """Whether ``proc`` has logged ``text`` (on stderr) or exited."""
    with open(proc.log_path) as f:
        return text in f.read() or proc.popen.poll() is not None


def test_sigterm_flush_waits_out_a_store_node_stopped_for_a_moment(h: Any, rng: random.Random) -> None:
    with LocalCluster(stores=1, sidecars=1, store_bytes=64 * MiB, local_bytes=16 * MiB, write_back=True,
                      drain_seconds=60) as lc:
        keys, values = h.keys(rng, 8), h.values(rng, [16 * KiB] * 8)
        state = rng.randbytes(200 * KiB)
        with lc.connect(0) as a:
            assert a.put(keys, values) == [pb.OK] * 8  # write-back: local-only until the flush
            assert a.put_state(keys[3], 4 * B, state) == pb.OK
        proc, store = lc.sidecar_procs[0], lc.store_pids[0]
        os.kill(store, signal.SIGSTOP)
        try:
            proc.popen.send_signal(signal.SIGTERM)
            # The flush's first write times out at the stopped node (a passing failure) ...
            h.wait_for(lambda: _logged_or_gone(proc, "not written for a passing reason"), timeout=60,
                       what="the failed first write")
        finally:
            os.kill(store, signal.SIGCONT)
        # ... and is tried again until the node answers, well before the drain deadline.
        assert _flushed(proc) == {"objects": 9, "bytes": 8 * 16 * KiB + len(state), "dropped": 0}
        assert _stored(lc, keys) == values and _stored(lc, [keys[3]], pb.STATE) == [state]


@contextlib.contextmanager
def _held(lc: LocalCluster, key: bytes, size: int, h: Any) -> Iterator[None]:
    """Another writer's reservation of ``key`` at its owner (a data-session PUT whose payload never
    comes), let go on leaving."""
    held = h.HeldReservation(lc.stores[owners(key, lc.store_ids)[0, 0]], key, size)
    try:
        yield
    finally:
        held.let_go()


def _stored(lc: LocalCluster, keys: list[bytes], kind: int = pb.BLOCK) -> list[bytes | None]:
    """What the owners of ``keys`` hold for them (None: nothing)."""
    out: list[bytes | None] = []
    for key in keys:
        with StoreClient(lc.stores[owners(key, lc.store_ids)[0, 0]]) as node:
            out += [bytes(v) if v is not None else None for v in node.get([key], kind)]
    return out


def _stop_once_retrying(h: Any, proc: Proc) -> None:
    """SIGTERM a sidecar and wait until its flush has met a passing failure (or it exited)."""
    proc.popen.send_signal(signal.SIGTERM)
    h.wait_for(lambda: _logged_or_gone(proc, "trying again until the deadline"), timeout=60,
               what="the flush's first round")


def test_sigterm_flush_retries_an_object_another_writer_holds_until_it_lets_go(
        shared: LocalCluster, h: Any, rng: random.Random) -> None:
    lc = shared
    w = lc.sidecars.index(lc.add_sidecar(extra_args=["--write-back", "--drain-seconds", "60"]))
    proc = lc.sidecar_procs[w]
    [key], [value] = h.keys(rng, 1), h.values(rng, [32 * KiB])
    with _held(lc, key, len(value), h):
        with lc.connect(w) as a:
            assert a.put([key], [value]) == [pb.OK]  # write-back: local-only until the flush
        # The flush's write meets the reservation (IN_FLIGHT, a passing failure) ...
        _stop_once_retrying(h, proc)
    # ... and its next round, after the other writer let go, writes the block.
    assert _flushed(proc) == {"objects": 1, "bytes": len(value), "dropped": 0}
    assert _stored(lc, [key]) == [value]


def test_sigterm_flush_writes_the_evicted_copies_waiting_for_a_retry(
        shared: LocalCluster, h: Any, rng: random.Random) -> None:
    """An evicted block's copy waiting out its retry's backoff is written by the flush, not lost."""
    lc = shared
    w = lc.sidecars.index(lc.add_sidecar(local_bytes=MiB, extra_args=["--write-back", "--drain-seconds", "60"]))
    proc = lc.sidecar_procs[w]
    [key], [value] = h.keys(rng, 1), h.values(rng, [8 * KiB])
    with _held(lc, key, len(value), h):
        with lc.connect(w) as a:
            assert a.put([key], [value]) == [pb.OK]
            for _ in range(6):  # evicts the block: its copy meets the reservation and waits
                assert a.put(h.keys(rng, 16), h.values(rng, [16 * KiB] * 16)) == [pb.OK] * 16
            h.wait_for(lambda: a.stats().pending_pool_bytes == len(value), what="the copy waiting for a retry")
        _stop_once_retrying(h, proc)
    flushed = _flushed(proc)
    assert flushed["dropped"] == 0 and flushed["objects"] > 1  # the copy and the blocks still local
    assert _stored(lc, [key]) == [value]
