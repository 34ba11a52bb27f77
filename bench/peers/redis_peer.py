"""Redis as a peer: Debian `redis-server` with persistence off on 127.0.0.1, client `redis`
with the `hiredis` parser.

Batches: put = pipelined SET (plain SET for a batch of one), get = MGET (GET for one).
Exists of 8192 keys two ways, labelled: a pipeline of one EXISTS per key (a per-key answer, what
a longest-prefix match needs) and one variadic EXISTS (returns only a count).
"""

from __future__ import annotations

import shutil
from typing import Any

import numpy as np

from bench.common import (
    EXISTS_KEYS,
    Context,
    Row,
    free_port,
    keys32,
    pattern,
    row_from_times,
    timed,
    touched,
    unavailable,
)

SYSTEM = "redis"


def _start(ctx: Context) -> tuple[Any, int]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not installed (run bench/setup.sh)")
    import redis  # noqa: F401  (fail early with a clear reason)

    port = free_port()
    ctx.procs.start(
        "redis-server",
        [exe, "--save", "", "--appendonly", "no", "--port", str(port), "--bind", "127.0.0.1",
         "--dir", str(ctx.work_dir), "--protected-mode", "no"],
        ready_port=port, timeout=30)
    return redis, port


def measure(ctx: Context) -> list[Row]:
    try:
        with ctx.procs.scope():
            redis, port = _start(ctx)
            return _measure(ctx, redis, port)
    except Exception as e:  # a peer that cannot run is reported, never fatal
        return [unavailable(SYSTEM, f"{type(e).__name__}: {e}")]


def _measure(ctx: Context, redis: Any, port: int) -> list[Row]:
    from redis.utils import HIREDIS_AVAILABLE

    plan = ctx.plan
    r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=120)
    parser = "hiredis" if HIREDIS_AVAILABLE else "python parser (hiredis missing)"
    rows: list[Row] = []
    src = touched(plan.max_batch_bytes, 1)
    try:
        r.ping()
        for v, nb in plan.cells():
            reps = plan.reps(v, nb)
            keys = keys32(f"redis-{v}-{nb}", nb)
            pattern(src[:v * nb], nb)
            vals = [src[j * v:(j + 1) * v].data for j in range(nb)]

            def put(i: int, keys: list[bytes] = keys, vals: list[memoryview] = vals) -> None:
                if len(keys) == 1:
                    r.set(keys[0], vals[0])
                    return
                p = r.pipeline(transaction=False)
                for k, val in zip(keys, vals, strict=True):
                    p.set(k, val)
                p.execute()

            # First put pass is untimed: it makes the server's memory hot (PEERS.md).
            put(-1)
            t = timed(put, reps, warmup=plan.warmup)
            rows.append(row_from_times(SYSTEM, "put", v, nb, t,
                                       note="SET" if nb == 1 else "pipelined SET"))

            got: list[Any] = []

            def get(i: int, keys: list[bytes] = keys, got: list[Any] = got) -> None:
                if len(keys) == 1:
                    got[:] = [r.get(keys[0])]
                else:
                    got[:] = r.mget(keys)
            t = timed(get, reps, warmup=plan.warmup)
            ok = all(g is not None and len(g) == v and
                     np.array_equal(np.frombuffer(g, np.uint8), src[j * v:(j + 1) * v])
                     for j, g in enumerate(got))
            note = ("GET" if nb == 1 else "MGET") + ("" if ok else "; VERIFY FAILED")
            rows.append(row_from_times(SYSTEM, "get", v, nb, t, note=note))
            r.delete(*keys)

        # exists of 8192 present keys
        keys = keys32("redis-exists", EXISTS_KEYS)
        p = r.pipeline(transaction=False)
        for k in keys:
            p.set(k, b"x" * 64)
        p.execute()

        answers: list[Any] = []

        def ex_pipe(i: int) -> None:
            p = r.pipeline(transaction=False)
            for k in keys:
                p.exists(k)
            answers[:] = p.execute()
        t = timed(ex_pipe, plan.exists_reps, warmup=plan.warmup)
        note = "pipeline of EXISTS per key (per-key answer)"
        if sum(answers) != EXISTS_KEYS:
            note += f"; WRONG ANSWER {sum(answers)}"
        rows.append(row_from_times(SYSTEM, "exists_pipeline", None, EXISTS_KEYS, t,
                                   note=note, with_bytes=False))

        count: list[int] = [0]

        def ex_var(i: int) -> None:
            count[0] = r.exists(*keys)
        t = timed(ex_var, plan.exists_reps, warmup=plan.warmup)
        rows.append(row_from_times(SYSTEM, "exists_variadic", None, EXISTS_KEYS, t,
                                   note=f"one EXISTS k1..k8192: count only ({count[0]})",
                                   with_bytes=False))
    finally:
        r.close()
    if not HIREDIS_AVAILABLE:
        for row in rows:
            row.note += f"; {parser}"
    return rows
