"""What exists only in a sidecar reaches the pool: state objects and write-back blocks are
flushed on SIGTERM (and write-back blocks on local eviction), so another sidecar then hits them."""

from __future__ import annotations

import random
import re
import signal
from typing import Any

from kvpool.keys import KeySpace
from kvpool.local import LocalCluster, Proc
from kvpool.proto import store_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
B = 128


def _sigterm(proc: Proc) -> dict[str, int]:
    """SIGTERM a sidecar, expect a clean exit and return its FLUSHED line's numbers."""
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=60) == 0
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
        assert b.stats().counters["read_hits_pool"] >= 5


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
        assert st.counters["evicted"] > 0 and st.local_used_bytes <= st.local_capacity_bytes
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
