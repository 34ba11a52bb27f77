"""The engine-facing remote read (issue 21 §4): 16 x 1 MiB read through each engine integration's
own load function into that engine's buffers, beside the direct store read it is held to.

- ``kvpool_store_direct`` / get: the floor of any sidecar read: the measuring process reads the
  same kind of batch (16 x 1 MiB that sidecar A put) straight from the store nodes that own the
  keys with ``StoreClient.get_into`` into its own buffers, one call per owner, all owners at once
  (the ring's routing, as the sidecar fans out), no sidecar in between;
- ``<integration>`` / remote_load: bench/integration_worker.py in the engine's venv (each engine
  has its own, with torch: ``tools/engines.sh --python ENGINE``) stores 16 fresh objects per
  repetition through sidecar A with the integration's save call, waits for A's write-through,
  and times the integration's load call on sidecar B, whose local tier does not hold them: the
  bytes come from the store nodes into the engine's KV buffers.  The note gives the load
  function, the engine's version and B's pool/local hit counts.

Both carry ``cpu_s_per_gb`` (``common.CpuMeter`` over the timed batches): the direct read counts
this process and the store nodes; an integration's counts the engine process (the worker), both
sidecars and the store nodes.

Each is measured on a fresh ``kvpool.LocalCluster`` of 4 store nodes and 2 sidecars (blocks of
16 tokens), one at a time: no integration's leftovers (B's arena filled by earlier loads) weigh
on the next.  A missing venv or a worker that fails gives an ``UNAVAILABLE`` row saying why.

Adding an integration: a class in bench/integration_worker.py (``BENCHES``) and one
:class:`Integration` line in :data:`INTEGRATIONS`; its row and ratios follow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from bench import kvpool_sidecar
from bench.common import (
    REPO_ROOT,
    Context,
    CpuMeter,
    MiB,
    Row,
    cluster_security,
    engine_python,
    ensure_kvpool_importable,
    keys32,
    pattern,
    row_from_times,
    source_root,
    timed_cpu,
    touched,
    unavailable,
    with_cpu,
)

DIRECT = "kvpool_store_direct"
OP = "remote_load"
VALUE, BATCH = MiB, 16
STORES = 4
BLOCK_TOKENS = 16
"""Tokens per block/page/chunk of the worker's engines (32 layers x 8 KV heads x 64 x fp16: 1 MiB)."""
WORKER = REPO_ROOT / "bench" / "integration_worker.py"
WORKER_TIMEOUT = 900.0


@dataclasses.dataclass(frozen=True)
class Integration:
    name: str
    """Row system and ratio prefix."""
    bench: str
    """The worker's bench (integration_worker.BENCHES)."""
    engine: str
    """The engine whose venv the worker runs in (tools/engines.sh --python ENGINE)."""
    load: str
    """The load function timed, for the row's note."""
    module: str
    """The integration's module under kvpool/integrations/ (a checkout without it: a row saying so)."""


INTEGRATIONS = (
    Integration("vllm_connector", "vllm", "vllm",
                "KVPoolConnector start_load_kv + wait_for_layer_load (worker side) into the paged KV cache", "vllm"),
    Integration("sglang_hicache", "sglang", "sglang",
                "KVPoolHiCacheStorage.batch_get_v1 into the MHATokenToKVPoolHost pages", "sglang"),
    Integration("lmcache_connector", "lmcache", "lmcache",
                "KVPoolRemoteConnector.batched_get into LMCache local CPU memory objects", "lmcache"),
    Integration("vllm_tier", "vllm_tier", "vllm",
                "KVPoolSecondaryTier.submit_load until get_finished_jobs reports it, into vLLM's CPU-tier rows",
                "vllm_tier"),
)


def ratios() -> dict[str, tuple[str, tuple[str, str], tuple[str, str], str, str]]:
    """The issue's two targets per integration, in run.py's ratio table format."""
    out: dict[str, tuple[str, tuple[str, str], tuple[str, str], str, str]] = {}
    for it in INTEGRATIONS:
        out[f"{it.name}_read_vs_direct_store"] = (
            "throughput", (it.name, OP), (DIRECT, "get"), ">= 0.8",
            f"remote read through {it.load} / StoreClient.get_into from the client process, "
            "straight from the owning store nodes")
        out[f"{it.name}_read_vs_mooncake_tcp"] = (
            "throughput", (it.name, OP), ("mooncake_tcp", "get"), ">= 1.5",
            f"remote read through {it.load} / Mooncake over TCP batch_get_into")
        out[f"{it.name}_read_cpu_vs_direct_store"] = (
            "cpu", (it.name, OP), (DIRECT, "get"), "",
            "CPU s/GB of the engine process, both sidecars and the store nodes over the remote read / "
            "those of the client process and the store nodes over the direct store read")
    return out


def measure(ctx: Context) -> list[Row]:
    try:
        ensure_kvpool_importable()
        import kvpool
    except Exception as e:
        return [unavailable(DIRECT, f"kvpool not importable ({type(e).__name__}: {e})")]
    rows: list[Row] = []
    try:
        with _cluster(kvpool, ctx) as cluster:
            rows.append(_direct_row(ctx, kvpool, cluster))
    except Exception as e:
        rows.append(unavailable(DIRECT, f"{type(e).__name__}: {e}", "get"))
    for it in INTEGRATIONS:
        rows.append(integration_row(ctx, kvpool, it))
        r = rows[-1]
        ctx.log(f"[integrations] {it.name}: " + (f"{r.gbps:.2f} GB/s" if r.gbps else r.note.splitlines()[0]))
    return rows


@contextlib.contextmanager
def _cluster(kvpool: Any, ctx: Context) -> Iterator[Any]:
    """A fresh pool with room for every batch of one measurement (fresh keys each repetition)."""
    need = (ctx.plan.warmup + ctx.plan.reps(VALUE, BATCH)) * VALUE * BATCH
    store = max(256 * MiB, -(-2 * need // STORES // (64 * MiB)) * 64 * MiB)
    with kvpool.LocalCluster(stores=STORES, sidecars=2, block_tokens=BLOCK_TOKENS, store_bytes=store,
                             local_bytes=256 * MiB, **cluster_security(ctx)) as cluster:
        yield cluster


def _direct_row(ctx: Context, kvpool: Any, cluster: Any) -> Row:
    """StoreClient.get_into from this process, one call per owning node, the owners concurrently."""
    from kvpool.core.ring import owners
    from kvpool.pool.node_client import StoreClient
    from kvpool.pool.routing import group_by_owner
    from kvpool.wire.convert import ring_from_pb
    from kvpool.wire.proto import store_pb2 as pb

    src = touched(VALUE * BATCH, 1)
    pattern(src, BATCH + 3)
    dst = touched(VALUE * BATCH, 0)
    keys = keys32("direct-store-read", BATCH)
    a = kvpool.connect(cluster.sidecars[0])
    try:
        a.put(keys, [src[j * VALUE:(j + 1) * VALUE].data for j in range(BATCH)])
        if not kvpool_sidecar.wait_written_through(a):  # the sidecar rows' own wait
            raise TimeoutError("sidecar A's write-through of the batch did not drain")
    finally:
        a.close()
    clients = {addr: StoreClient(addr) for addr in cluster.stores}
    try:
        ring = ring_from_pb(clients[cluster.stores[0]].get_ring())
        active = list(ring.active)
        routes = group_by_owner(owners(keys, [m.id for m in active])[:, 0], [m.id for m in active])
        by_id = {m.id: m.address for m in active}
        calls = [(clients[by_id[nid]], [keys[i] for i in idx], [dst[i * VALUE:(i + 1) * VALUE].data for i in idx])
                 for nid, idx in routes.items()]
        # CPU of the processes the read involves: this one (the client) and the store nodes.
        meter = CpuMeter({"client": [os.getpid()], "store": list(cluster.store_pids)})
        failed: list[int] = []
        with ThreadPoolExecutor(len(calls)) as threads:
            def read(_i: int) -> None:
                codes = [c for f in [threads.submit(cl.get_into, k, b) for cl, k, b in calls] for c in f.result()]
                failed.append(sum(1 for c in codes if c != pb.OK))

            times = timed_cpu(read, ctx.plan.reps(VALUE, BATCH), meter, ctx.plan.warmup)
    finally:
        for c in clients.values():
            c.close()
    note = (f"StoreClient.get_into from this process, {len(calls)} owning nodes concurrently, "
            "the same keys each rep (A put them)" + (f"; {sum(failed)} item failures" if sum(failed) else ""))
    if not np.array_equal(dst, src):
        note += "; VERIFY FAILED"
    return with_cpu(row_from_times(DIRECT, "get", VALUE, BATCH, times, note=note), meter, VALUE * BATCH * len(times))


def integration_row(ctx: Context, kvpool: Any, it: Integration) -> Row:
    if not os.path.exists(os.path.join(source_root(), "kvpool", "integrations", f"{it.module}.py")):
        return unavailable(it.name, f"not available yet (no kvpool.integrations.{it.module} in this checkout)", OP)
    py = engine_python(it.engine)
    if py is None:
        return unavailable(it.name, f"venv-{it.engine} is not built (bash tools/engines.sh {it.engine})", OP)
    try:
        with _cluster(kvpool, ctx) as cluster:
            out = _run_worker(ctx, py, it, cluster)
    except Exception as e:
        return unavailable(it.name, f"{type(e).__name__}: {e}", OP)
    if "error" in out:
        return unavailable(it.name, f"worker in venv-{it.engine}: {out['error']}", OP)
    note = (f"{it.load}; {out['version']}; B's pool hits {out['pool_hits']}, local hits {out['local_hits']}"
            + (f"; {out['failures']} item failures" if out["failures"] else "")
            + (f"; VERIFY FAILED: {out['verify']}" if out["verify"] else ""))
    row = row_from_times(it.name, OP, VALUE, BATCH, out["times"], note=note)
    row.cpu_s_per_gb, row.cpu_split = out.get("cpu_s_per_gb"), out.get("cpu_split")  # the worker's CpuMeter
    return row


def _run_worker(ctx: Context, py: str, it: Integration, cluster: Any) -> dict[str, Any]:
    """Run the worker in the engine's venv (its own process group, killed with the runner); its
    RESULT line."""
    env = {"PYTHONPATH": source_root(), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    roles = {"sidecar": list(cluster.sidecar_pids), "store": list(cluster.store_pids)}
    argv = [py, str(WORKER), it.bench, "--writer", cluster.sidecars[0], "--reader", cluster.sidecars[1],
            "--reps", str(ctx.plan.reps(VALUE, BATCH)), "--warmup", str(ctx.plan.warmup), "--roles", json.dumps(roles)]
    # The venvs hold no kvpool of their own: this checkout's (PYTHONPATH replaced, not extended).
    proc = ctx.procs.start(f"integration-{it.name}", argv, env=env, cwd=REPO_ROOT)
    try:
        proc.popen.wait(WORKER_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"worker still running after {WORKER_TIMEOUT:.0f}s:\n{proc.log_tail()}") from None
    finally:
        ctx.procs.stop(proc)
    deadline = time.monotonic() + 5.0  # the log's last lines are copied by a thread: let it catch up
    while True:
        for line in reversed(proc.log.read_text(errors="replace").splitlines()):
            if line.startswith("RESULT "):
                result: dict[str, Any] = json.loads(line[len("RESULT "):])
                return result
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    raise RuntimeError(f"worker exited {proc.popen.returncode} without a RESULT line:\n{proc.log_tail()}")

