"""Mooncake Store as a peer (pip package `mooncake-transfer-engine-non-cuda`), protocol tcp, all
processes on 127.0.0.1 (MC_TCP_BIND_ADDRESS), the master embedding the HTTP metadata server.

Two modes, each with its own master:
- `tcp` ("over TCP"): an owner process contributes the global segment; the measuring process
  has no segment and uses batch_put_from / batch_get_into on buffers it registered, so every
  byte crosses loopback TCP.
- `shm` ("shared-memory client mode"): the standalone `mooncake_client` binary owns the
  segment; the measuring process attaches with setup_dummy and uses batch_put_from /
  batch_get_into on buffers from alloc_from_mem_pool (registered with register_buffer).

The measuring side runs in its own process (`python -m bench.peers.mooncake_peer bench ...`)
so Mooncake's threads, logs and any crash stay out of the runner. Before measuring, the
segment is filled once (and emptied) so its pages are touched, and the client's buffers are
written (PEERS.md: a fresh segment is ~5x slower).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import numpy as np  # noqa: E402

from bench.common import (  # noqa: E402
    EXISTS_KEYS,
    Context,
    CpuMeter,
    MiB,
    Plan,
    Row,
    free_port,
    keys32,
    pattern,
    pool_bytes,
    python_env,
    row_from_times,
    size_label,
    touched,
    unavailable,
    with_cpu,
)

PACKAGE = "mooncake-transfer-engine-non-cuda"
ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
SYSTEMS = {"tcp": "mooncake_tcp", "shm": "mooncake_shm"}


def package_dir() -> Path:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"python package {PACKAGE} not installed (run bench/setup.sh)")
    return Path(list(spec.submodule_search_locations)[0])


def binary(name: str) -> str:
    path = package_dir() / name
    if not path.exists():
        raise RuntimeError(f"{path} missing from {PACKAGE}")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return str(path)


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return "not installed"


# --------------------------------------------------------------------------------------------
# runner side


def measure(ctx: Context, modes: tuple[str, ...]) -> list[Row]:
    rows: list[Row] = []
    for mode in modes:
        try:
            rows += _measure_mode(ctx, mode)
        except Exception as e:  # a peer that cannot run is reported, never fatal
            rows.append(unavailable(SYSTEMS[mode], f"{type(e).__name__}: {e}"))
    return rows


def _measure_mode(ctx: Context, mode: str) -> list[Row]:
    plan = ctx.plan
    seg = pool_bytes(plan)
    env = dict(ENV)
    with ctx.procs.scope() as procs:
        rpc, http, metrics = free_port(), free_port(), free_port()
        master_proc = procs.start(
            f"mooncake-master-{mode}",
            [binary("mooncake_master"), "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
             "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
             "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"],
            env=env, ready_port=rpc, timeout=30)
        from bench.common import wait_port
        wait_port(http, 30)
        master = f"127.0.0.1:{rpc}"
        meta = f"http://127.0.0.1:{http}/metadata"
        bench_args = ["--mode", mode, "--master", master, "--meta", meta,
                      "--segment", str(seg)]
        if mode == "tcp":
            seg_proc = procs.start(
                "mooncake-owner",
                [sys.executable, "-m", "bench.peers.mooncake_peer", "owner", "--master", master,
                 "--meta", meta, "--segment", str(seg)],
                env={**env, **python_env()}, ready_line="READY", timeout=60)
        else:
            port = free_port()
            seg_proc = procs.start(
                "mooncake-client",
                [binary("mooncake_client"), "--host=127.0.0.1", f"--port={port}",
                 f"--master_server_address={master}", f"--metadata_server={meta}",
                 f"--global_segment_size={seg // MiB} MB", "--protocol=tcp"],
                env=env, ready_port=port, timeout=60)
            bench_args += ["--client", f"127.0.0.1:{port}"]
        # The measuring process counts its own CPU and theirs (cpu_s_per_gb of the rows).
        bench_args += ["--cpu-pids", f"master={master_proc.pid},segment={seg_proc.pid}"]
        out = ctx.work_dir / f"mooncake-{mode}.json"
        worker = procs.start(
            f"mooncake-bench-{mode}",
            [sys.executable, "-m", "bench.peers.mooncake_peer", "bench", *bench_args,
             "--plan", json.dumps(plan.to_json()), "--out", str(out)],
            env={**env, **python_env()})
        timeout = 240 if plan.quick else 900
        try:
            rc = worker.popen.wait(timeout)
        except Exception:
            raise TimeoutError(f"measuring process did not finish in {timeout}s:\n"
                               f"{worker.log_tail()}") from None
        time.sleep(0.2)
        if rc != 0 or not out.exists():
            raise RuntimeError(f"measuring process exited with {rc}:\n{worker.log_tail()}")
        data = json.loads(out.read_text())
        return [Row.from_json(r) for r in data["rows"]]


# --------------------------------------------------------------------------------------------
# owner process (tcp mode): contributes the segment, serves until terminated


def owner(master: str, meta: str, segment: int) -> None:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", meta, segment, 16 * MiB, "tcp", "", master)
    if rc != 0:
        print(f"setup failed: {rc}", flush=True)
        sys.exit(1)
    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True
    signal.signal(signal.SIGTERM, on_term)
    print("READY", flush=True)
    while not stop:
        time.sleep(0.2)
    store.close()


# --------------------------------------------------------------------------------------------
# measuring process


class _Buffers:
    """src and dst buffers of max-batch size, written once, registered with Mooncake."""

    def __init__(self, store: Any, mode: str, nbytes: int) -> None:
        self.nbytes = nbytes
        self._keep: list[Any] = []
        if mode == "shm":
            self.src = self._pool(store, nbytes)
            self.dst = self._pool(store, nbytes)
        else:
            self.src = touched(nbytes, 1)
            self.dst = touched(nbytes, 0)
        for buf in (self.src, self.dst):
            rc = store.register_buffer(buf.ctypes.data, nbytes)
            if rc != 0:
                raise RuntimeError(f"register_buffer failed: {rc}")
        self.src_ptr = int(self.src.ctypes.data)
        self.dst_ptr = int(self.dst.ctypes.data)

    def _pool(self, store: Any, nbytes: int) -> np.ndarray:
        ptr = store.alloc_from_mem_pool(nbytes)
        if not ptr:
            raise RuntimeError(f"alloc_from_mem_pool({nbytes}) failed")
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        arr.fill(0x11)  # touch every page
        return arr


def _hexkeys(prefix: str, n: int) -> list[str]:
    return [k.hex() for k in keys32(prefix, n)]


def bench(mode: str, master: str, meta: str, segment: int, client: str, plan: Plan,
          out: Path, cpu_pids: dict[str, list[int]] | None = None) -> None:
    from mooncake.store import MooncakeDistributedStore

    system = SYSTEMS[mode]
    roles = {"client": [os.getpid()], **(cpu_pids or {})}

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    store = MooncakeDistributedStore()
    if mode == "tcp":
        rc = store.setup("127.0.0.1", meta, 0, 16 * MiB, "tcp", "", master)
    else:
        rc = store.setup_dummy(2 * plan.max_batch_bytes + 64 * MiB, 16 * MiB, client)
    if rc != 0:
        raise RuntimeError(f"{'setup' if mode == 'tcp' else 'setup_dummy'} failed: {rc}")
    bufs = _Buffers(store, mode, plan.max_batch_bytes)
    rows: list[Row] = []

    # Touch the whole segment once: fill ~85 % of it with 1 MiB objects, then empty it.
    fill_v, fill_b = MiB, min(16, plan.max_batch_bytes // MiB)
    n_batches = int(segment * 0.85) // (fill_v * fill_b)
    t0 = time.perf_counter()
    for i in range(n_batches):
        ks = _hexkeys(f"fill-{i}", fill_b)
        store.batch_put_from(ks, [bufs.src_ptr + j * fill_v for j in range(fill_b)],
                             [fill_v] * fill_b)
    store.remove_all()
    log(f"segment pre-touched ({segment // MiB} MiB) in {time.perf_counter() - t0:.1f}s")

    for v, nb in plan.cells():
        reps = plan.reps(v, nb)
        pattern(bufs.src[:v * nb], nb + v // MiB)
        ptrs_src = [bufs.src_ptr + j * v for j in range(nb)]
        ptrs_dst = [bufs.dst_ptr + j * v for j in range(nb)]
        sizes = [v] * nb
        times: list[float] = []
        failures = 0
        keys: list[str] = []
        total = plan.warmup + reps
        meter = CpuMeter(roles)
        for i in range(total):
            keys = _hexkeys(f"{mode}-{v}-{nb}-{i}", nb)
            if i >= plan.warmup:
                meter.start()
            t0 = time.perf_counter()
            res = store.batch_put_from(keys, ptrs_src, sizes)
            dt = time.perf_counter() - t0
            if i >= plan.warmup:
                meter.stop()
                times.append(dt)
            failures += sum(1 for r in res if r != 0)
            if i != total - 1:
                store.batch_remove(keys)  # untimed: keep the segment from filling up
        note = "batch_put_from" + (f"; {failures} item failures" if failures else "")
        rows.append(with_cpu(row_from_times(system, "put", v, nb, times, note=note), meter, v * nb * reps))

        bufs.dst[:v * nb].fill(0)
        times = []
        failures = 0
        meter = CpuMeter(roles)
        for i in range(total):
            if i >= plan.warmup:
                meter.start()
            t0 = time.perf_counter()
            res = store.batch_get_into(keys, ptrs_dst, sizes)
            dt = time.perf_counter() - t0
            if i >= plan.warmup:
                meter.stop()
                times.append(dt)
            failures += sum(1 for r in res if r != v)
        ok = np.array_equal(bufs.dst[:v * nb], bufs.src[:v * nb])
        note = "batch_get_into" + (f"; {failures} item failures" if failures else "") + \
            ("" if ok else "; VERIFY FAILED")
        rows.append(with_cpu(row_from_times(system, "get", v, nb, times, note=note), meter, v * nb * reps))
        log(f"{size_label(v)} x {nb}: put {rows[-2].gbps:.2f} get {rows[-1].gbps:.2f} GB/s")

    # exists of 8192 present keys (4 KiB values), and of 8192 absent keys
    keys = _hexkeys(f"{mode}-exists", EXISTS_KEYS)
    ev, eb = 4096, 512
    for i in range(0, EXISTS_KEYS, eb):
        res = store.batch_put_from(keys[i:i + eb], [bufs.src_ptr + j * ev for j in range(eb)],
                                   [ev] * eb)
        if any(r != 0 for r in res):
            raise RuntimeError(f"put of exists keys failed: {set(res)}")
    absent = _hexkeys(f"{mode}-absent", EXISTS_KEYS)
    for op, ks, want in (("exists", keys, 1), ("exists_absent", absent, 0)):
        times = []
        wrong = 0
        for i in range(plan.warmup + plan.exists_reps):
            t0 = time.perf_counter()
            res = store.batch_is_exist(ks)
            dt = time.perf_counter() - t0
            wrong = sum(1 for r in res if r != want)
            if i >= plan.warmup:
                times.append(dt)
        note = "batch_is_exist" + (f"; {wrong} WRONG ANSWERS" if wrong else "")
        rows.append(row_from_times(system, op, None, EXISTS_KEYS, times, note=note,
                                   with_bytes=False))
    log(f"exists 8192: {rows[-2].p50_ms:.2f} ms")
    out.write_text(json.dumps({"rows": [r.to_json() for r in rows]}))
    store.close()


def parse_pids(text: str) -> dict[str, list[int]]:
    """'master=12,segment=34' → {'master': [12], 'segment': [34]}."""
    out: dict[str, list[int]] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        role, _, pid = part.partition("=")
        out.setdefault(role, []).append(int(pid))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("owner")
    b = sub.add_parser("bench")
    for p in (o, b):
        p.add_argument("--master", required=True)
        p.add_argument("--meta", required=True)
        p.add_argument("--segment", type=int, required=True)
    b.add_argument("--mode", choices=sorted(SYSTEMS), required=True)
    b.add_argument("--client", default="")
    b.add_argument("--plan", required=True)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--cpu-pids", default="", help="role=pid,... of the peer's other processes, whose CPU "
                   "the rows count beside this one's")
    args = ap.parse_args(argv)
    code = 0
    try:
        if args.cmd == "owner":
            owner(args.master, args.meta, args.segment)
        else:
            bench(args.mode, args.master, args.meta, args.segment, args.client,
                  Plan.from_json(json.loads(args.plan)), args.out, parse_pids(args.cpu_pids))
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Mooncake's background threads can keep the interpreter from exiting; leave at once.
    os._exit(code)


if __name__ == "__main__":
    main()
