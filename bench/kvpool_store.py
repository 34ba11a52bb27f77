"""kvpool's store node, measured the way Mooncake is: one node started with
`python -m kvpool store --listen 127.0.0.1:PORT --dram BYTES` (ready when it prints
`READY <address>`), the benchmark process as its client (`kvpool.pool.node_client.StoreClient`):
put (fresh keys every repetition: a repeated put of a committed key is a no-op), get_into
preallocated buffers, exists of 8192 present keys.

Same treatment as Mooncake: the same capacity (common.pool_bytes), the DRAM tier filled to
85 % once and emptied before measuring (pages touched), and each put rep's keys removed
(untimed) before the next. Without a `remove` in the client the node gets room for every put
instead and the pre-touch is skipped (the row note says so).

If `kvpool.pool.node_client` cannot be imported yet, the rows say "not available yet".

The transport security is a mode (`bench/run.py --kvpool-tls plain,tls,tls-plain-data`, each mode
its own node, measured in the same run): `plain` (system `kvpool_store`: no TLS), `tls` (system
`kvpool_store_tls`: mutual TLS on gRPC and on the data session, a throw-away CA) and
`tls-plain-data` (system `kvpool_store_tls_plaindata`: TLS on gRPC, the data session opted out
with `--plaintext-data-session`, its connections opened by tickets).
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from typing import Any

import numpy as np

from bench.common import (
    EXISTS_KEYS,
    PLAIN,
    TLS_MODES,
    Context,
    CpuMeter,
    GiB,
    MiB,
    Row,
    ensure_kvpool_importable,
    free_port,
    keys32,
    pattern,
    per_tls_mode,
    pool_bytes,
    python_env,
    row_from_times,
    size_label,
    touched,
    unavailable,
    with_cpu,
)

SYSTEM = "kvpool_store"
TLS_OPS: dict[str, tuple[str, ...]] = {"put": ("throughput", "cpu"), "get": ("throughput", "cpu"),
                                       "exists": ("time",)}
"""The ops whose cost per transport-security mode ``bench/run.py`` sets against plain, and how."""


def tls_files(ctx: Context) -> tuple[list[str], Any]:
    """A throw-away CA's node flags and the benchmark client's TLS configuration (operator
    identity), in the work directory; made once per run."""
    from kvpool.core import pki
    from kvpool.wire import tls

    d = ctx.work_dir / "tls"
    if not (d / "ca.pem").exists():
        ca = pki.make_ca("kvpool bench CA", days=2)
        tls.write_dir(str(d / "node"), pki.issue(ca, pki.node("bench"), dns=["localhost"], ips=["127.0.0.1"]),
                      ca.cert_pem)
        tls.write_dir(str(d / "client"), pki.issue(ca, pki.operator()), ca.cert_pem)
        (d / "ca.pem").write_bytes(ca.cert_pem)
    return ["--tls-dir", str(d / "node")], tls.TlsConfig.from_dir(str(d / "client"))


def item_ok(status: Any) -> bool:
    """Per-item status of the store client, whatever its exact type turns out to be: None,
    True, 0, an 'ok' string, an enum named OK, or an object with a true `.ok`."""
    if status is None or status is True:
        return True
    if status is False:
        return False
    ok = getattr(status, "ok", None)
    if isinstance(ok, bool):
        return ok
    name = getattr(status, "name", None)
    if isinstance(name, str):
        return name.upper() in ("OK", "SUCCESS")
    if isinstance(status, str):
        return status.upper() in ("OK", "SUCCESS")
    if isinstance(status, int):
        return status == 0
    return bool(status)


def bad_items(statuses: Any, seen: Counter[str] | None = None) -> int:
    """How many items failed; their statuses are counted into `seen` (for the row note)."""
    if statuses is None:
        return 0
    bad = [s for s in statuses if not item_ok(s)]
    if seen is not None:
        seen.update(_status_name(s) for s in bad)
    return len(bad)


def _status_name(status: Any) -> str:
    try:
        from kvpool.wire.proto import store_pb2 as pb  # the store's status enum, when it is there
        return str(pb.Code.Name(status))
    except Exception:
        return str(getattr(status, "name", status))


def _failures_note(n: int, seen: Counter[str]) -> str:
    if not n:
        return ""
    return f"; {n} item failures ({', '.join(f'{k} x{c}' for k, c in seen.most_common())})"


def import_client() -> Any:
    ensure_kvpool_importable()
    import kvpool.pool.node_client as mod
    return mod


def dram_bytes(ctx: Context, can_remove: bool) -> int:
    """With remove: the peers' capacity. Without: room for every put rep (fresh keys, none
    removed), the exists keys and headroom, so no eviction happens while measuring."""
    if can_remove:
        return pool_bytes(ctx.plan)
    need = ctx.plan.total_put_bytes() + EXISTS_KEYS * 4096
    return int(min(12 * GiB, max(512 * MiB, need * 1.25 + 256 * MiB)))


def measure(ctx: Context) -> list[Row]:
    """Every transport-security mode of ``ctx.kvpool_tls`` (default: plain), one node each."""
    return per_tls_mode(ctx, lambda mode: measure_mode(ctx, mode))


def measure_mode(ctx: Context, mode: str = PLAIN) -> list[Row]:
    tls_mode = TLS_MODES[mode]
    system = tls_mode.system(SYSTEM)
    try:
        mod = import_client()
    except Exception as e:
        return [unavailable(system, f"not available yet (import kvpool.pool.node_client failed: "
                                    f"{type(e).__name__}: {e})")]
    try:
        with ctx.procs.scope() as procs:
            port = free_port()
            can_remove = hasattr(mod.StoreClient, "remove")
            dram = dram_bytes(ctx, can_remove)
            flags: list[str] = []
            client_kw: dict[str, Any] = {}
            if tls_mode.tls:
                flags, client_kw["tls"] = tls_files(ctx)
                flags += tls_mode.store_flags
            node = procs.start(
                f"kvpool-store-{mode}",
                [sys.executable, "-m", "kvpool", "store", "--listen", f"127.0.0.1:{port}",
                 "--transfer-port", "0", "--dram", str(dram), *flags],
                env=python_env(), ready_line="READY", timeout=120)
            # "READY <address> [more fields]": the address is the first word after READY.
            words = (node.ready_line or "").split()
            address = words[1] if len(words) > 1 else f"127.0.0.1:{port}"
            client = mod.StoreClient(address, **client_kw)
            try:
                return _measure(ctx, client, dram, can_remove, node.pid, system)
            finally:
                client.close()
    except Exception as e:
        return [unavailable(system, f"{type(e).__name__}: {e}")]


def _pretouch(ctx: Context, client: Any, dram: int, src: np.ndarray) -> None:
    """Fill 85 % of the DRAM tier with 1 MiB objects once, then remove them (as for Mooncake)."""
    v, nb = MiB, min(16, src.nbytes // MiB)
    vals = [src[j * v:(j + 1) * v].data for j in range(nb)]
    t0 = time.perf_counter()
    written: list[bytes] = []
    for i in range(int(dram * 0.85) // (v * nb)):
        keys = keys32(f"kvpool-fill-{i}", nb)
        client.put(keys, vals)
        written += keys
    for i in range(0, len(written), 512):
        client.remove(written[i:i + 512])
    ctx.log(f"[kvpool_store] DRAM tier pre-touched ({dram // MiB} MiB) in "
            f"{time.perf_counter() - t0:.1f}s")


def _measure(ctx: Context, client: Any, dram: int, can_remove: bool, node_pid: int,
             system: str = SYSTEM) -> list[Row]:
    plan = ctx.plan
    rows: list[Row] = []
    src = touched(plan.max_batch_bytes, 1)
    dst = touched(plan.max_batch_bytes, 0)
    if can_remove:
        _pretouch(ctx, client, dram, src)
    note_dram = f"--dram {dram // MiB} MiB" + ("" if can_remove else ", no remove: no pre-touch")
    for v, nb in plan.cells():
        reps = plan.reps(v, nb)
        pattern(src[:v * nb], nb + v // MiB)
        vals = [src[j * v:(j + 1) * v].data for j in range(nb)]
        outs = [dst[j * v:(j + 1) * v].data for j in range(nb)]
        keys: list[bytes] = []
        times: list[float] = []
        failures = 0
        seen: Counter[str] = Counter()
        total = plan.warmup + reps
        roles = {"client": [os.getpid()], "store": [node_pid]}
        meter = CpuMeter(roles)
        for i in range(total):
            keys = keys32(f"kvpool-{v}-{nb}-{i}", nb)
            if i >= plan.warmup:
                meter.start()
            t0 = time.perf_counter()
            st = client.put(keys, vals)
            dt = time.perf_counter() - t0
            if i >= plan.warmup:
                meter.stop()
                times.append(dt)
            failures += bad_items(st, seen)
            if can_remove and i != total - 1:
                client.remove(keys)  # untimed: keep the tier from filling up
        rows.append(with_cpu(row_from_times(system, "put", v, nb, times,
                                            note=note_dram + _failures_note(failures, seen)), meter, v * nb * reps))
        dst[:v * nb].fill(0)
        times = []
        failures = 0
        seen = Counter()
        meter = CpuMeter(roles)
        for i in range(total):
            if i >= plan.warmup:
                meter.start()
            t0 = time.perf_counter()
            st = client.get_into(keys, outs)
            dt = time.perf_counter() - t0
            if i >= plan.warmup:
                meter.stop()
                times.append(dt)
            failures += bad_items(st, seen)
        ok = np.array_equal(dst[:v * nb], src[:v * nb])
        rows.append(with_cpu(row_from_times(system, "get", v, nb, times,
                                            note="get_into" + _failures_note(failures, seen)
                                            + ("" if ok else "; VERIFY FAILED")), meter, v * nb * reps))
        ctx.log(f"[kvpool_store] {size_label(v)} x {nb}: put {rows[-2].gbps:.2f} "
                f"get {rows[-1].gbps:.2f} GB/s")

    keys = keys32("kvpool-exists", EXISTS_KEYS)
    ev, eb = 4096, 512
    small = [src[j * ev:(j + 1) * ev].data for j in range(eb)]
    for i in range(0, EXISTS_KEYS, eb):
        st = client.put(keys[i:i + eb], small)
        if bad_items(st):
            raise RuntimeError(f"put of the exists keys failed for {bad_items(st)} items")
    absent = keys32("kvpool-absent", EXISTS_KEYS)
    for op, ks, want in (("exists", keys, EXISTS_KEYS), ("exists_absent", absent, 0)):
        times = []
        res: Any = None
        for i in range(plan.warmup + plan.exists_reps):
            t0 = time.perf_counter()
            res = client.exists(ks)
            dt = time.perf_counter() - t0
            if i >= plan.warmup:
                times.append(dt)
        prefix = getattr(res, "prefix", None)
        present = getattr(res, "present", None)
        note = "exists (prefix + per-key)"
        if prefix != want or (present is not None and sum(map(bool, present)) != want):
            note += f"; WRONG ANSWER prefix={prefix}"
        rows.append(row_from_times(system, op, None, EXISTS_KEYS, times, note=note,
                                   with_bytes=False))
    return rows
