#!/usr/bin/env python3
"""kvpool benchmark runner: side-by-side throughput and latency on 127.0.0.1.

    python bench/run.py --suite store|sidecar [--quick] [--json PATH] [--only SYSTEMS]
                        [--rounds N] [--kvpool-tls plain,tls,tls-plain-data]

Starts every server it needs, stops everything it started (also on exceptions, Ctrl-C and
SIGTERM; children also die with the runner if it is killed), prints one table (system x op x
value size x batch: GB/s of the median batch, p50 and p99 latency per batch) and the ratios,
and writes the rows, the ratios and how they were measured as JSON.

A system that cannot run (not installed, fails to start, kvpool not written yet) gets a row
that says why; the rest of the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import ceilings, integrations, kvpool_sidecar, kvpool_store  # noqa: E402
from bench.common import (  # noqa: E402
    EXISTS_KEYS,
    PLAIN,
    TLS_MODES,
    Context,
    MiB,
    Plan,
    Procs,
    Row,
    cpu_busy,
    size_label,
    unavailable,
    wait_idle,
)
from bench.peers import mooncake_peer, redis_peer  # noqa: E402

Step = Callable[[Context], list[Row]]

# system-group name -> (step, systems it produces); run in this order
STORE_STEPS: list[tuple[str, Step]] = [
    ("memcpy", ceilings.memcpy_rows),
    ("network", ceilings.network_rows),
    ("redis", redis_peer.measure),
    ("mooncake", lambda ctx: mooncake_peer.measure(ctx, ("tcp",))),
    ("kvpool", kvpool_store.measure),
]
SIDECAR_STEPS: list[tuple[str, Step]] = [
    ("memcpy", ceilings.memcpy_rows),
    ("network", ceilings.network_rows),
    ("redis", redis_peer.measure),
    ("mooncake", lambda ctx: mooncake_peer.measure(ctx, ("tcp", "shm"))),
    ("kvpool", kvpool_sidecar.measure),
    ("integrations", integrations.measure),  # each engine integration's own load, in its venv
]

# name -> (kind, numerator (system, op), denominator (system, op), target, explanation)
# kind "throughput": numerator GB/s / denominator GB/s (> 1: kvpool moves bytes faster).
# kind "time": numerator p50 / denominator p50 (< 1: kvpool answers sooner).
# kind "cpu": numerator cpu_s_per_gb / denominator cpu_s_per_gb (< 1: kvpool spends less CPU).
R = tuple[str, tuple[str, str], tuple[str, str], str, str]
STORE_RATIOS: dict[str, R] = {
    "get_vs_tcp2_ceiling": ("throughput", ("kvpool_store", "get"), ("tcp_stream_2conn", "get"),
                            ">= 0.8", "kvpool get_into / raw Python TCP, 2 streams"),
    "put_vs_tcp2_ceiling": ("throughput", ("kvpool_store", "put"), ("tcp_stream_2conn", "put"),
                            ">= 0.8", "kvpool put / raw Python TCP, 2 streams"),
    "exists8192_vs_mooncake": ("time", ("kvpool_store", "exists"), ("mooncake_tcp", "exists"),
                               "<= 0.25", "kvpool exists(8192 present keys) / Mooncake "
                               "batch_is_exist(8192 present keys)"),
    # informational (issue 21 replaced the >= 2.5x Mooncake targets by the TCP ceiling's)
    "get_vs_mooncake_tcp": ("throughput", ("kvpool_store", "get"), ("mooncake_tcp", "get"),
                            "", "kvpool get_into / Mooncake batch_get_into over TCP"),
    "put_vs_mooncake_tcp": ("throughput", ("kvpool_store", "put"), ("mooncake_tcp", "put"),
                            "", "kvpool put / Mooncake batch_put_from over TCP"),
    "get_cpu_vs_tcp2_ceiling": ("cpu", ("kvpool_store", "get"), ("tcp_stream_2conn", "get"), "",
                                "CPU s/GB of the client and the store node over a get / "
                                "those of the 2-stream TCP ceiling's two processes"),
    "put_cpu_vs_tcp2_ceiling": ("cpu", ("kvpool_store", "put"), ("tcp_stream_2conn", "put"), "",
                                "CPU s/GB of the client and the store node over a put / "
                                "those of the 2-stream TCP ceiling's two processes"),
    "mooncake_tcp_get_cpu_vs_tcp2_ceiling": ("cpu", ("mooncake_tcp", "get"), ("tcp_stream_2conn", "get"),
                                             "", "peer context: Mooncake's CPU s/GB over a get "
                                             "(client, master, segment owner) / the TCP ceiling's"),
    "get_vs_redis": ("throughput", ("kvpool_store", "get"), ("redis", "get"), "",
                     "kvpool get_into / Redis MGET"),
    "put_vs_redis": ("throughput", ("kvpool_store", "put"), ("redis", "put"), "",
                     "kvpool put / Redis pipelined SET"),
    "exists8192_vs_redis_pipeline": ("time", ("kvpool_store", "exists"),
                                     ("redis", "exists_pipeline"), "",
                                     "kvpool exists / Redis pipeline of EXISTS per key"),
    "mooncake_tcp_get_vs_tcp2_ceiling": ("throughput", ("mooncake_tcp", "get"),
                                         ("tcp_stream_2conn", "get"), "",
                                         "peer context: Mooncake get / 2-stream TCP"),
    "mooncake_tcp_put_vs_tcp2_ceiling": ("throughput", ("mooncake_tcp", "put"),
                                         ("tcp_stream_2conn", "put"), "",
                                         "peer context: Mooncake put / 2-stream TCP (a put target of "
                                         "2.5x Mooncake is reachable only below 0.4)"),
    "tcp4_vs_tcp2_get_ceiling": ("throughput", ("tcp_stream_4conn", "get"), ("tcp_stream_2conn", "get"), "",
                                 "ceiling context: 4 streams / 2 streams on this machine's cores"),
}
SIDECAR_RATIOS: dict[str, R] = {
    "local_get_vs_mooncake_shm": ("throughput", ("kvpool_sidecar", "local_get"),
                                  ("mooncake_shm", "get"), ">= 1.5",
                                  "kvpool local-hit get (views copied into caller buffers) / "
                                  "Mooncake shared-memory client batch_get_into"),
    "remote_get_vs_mooncake_tcp": ("throughput", ("kvpool_sidecar", "remote_get"),
                                   ("mooncake_tcp", "get"), ">= 1.5",
                                   "kvpool get_into through a sidecar whose local tier lacks the "
                                   "keys, into registered caller buffers (alloc_buffer) / Mooncake "
                                   "over TCP batch_get_into into registered buffers"),
    "match8192_4nodes_vs_mooncake": ("time", ("kvpool_sidecar", "match"),
                                     ("mooncake_tcp", "exists"), "<= 0.25",
                                     "kvpool match(8192 keys held by 4 store nodes) / "
                                     "Mooncake batch_is_exist(8192 present keys)"),
    "remote_get_cpu_vs_tcp2_ceiling": ("cpu", ("kvpool_sidecar", "remote_get"),
                                       ("tcp_stream_2conn", "get"), "<= 1.5",
                                       "CPU s/GB of every kvpool process (client, sidecars, store "
                                       "nodes) over the remote get / those of the 2-stream TCP "
                                       "ceiling's client and server"),
    "put_vs_mooncake_shm": ("throughput", ("kvpool_sidecar", "put"), ("mooncake_shm", "put"),
                            ">= 1.0", "kvpool A.put back to back (the write-through of the batches "
                            "before in flight) / Mooncake shm batch_put_from"),
    "put_drained_vs_mooncake_shm": ("throughput", ("kvpool_sidecar", "put_drained"),
                                    ("mooncake_shm", "put"), ">= 1.0",
                                    "kvpool A.put with no write-through in flight / Mooncake shm "
                                    "batch_put_from"),
    # informational
    "local_get_zero_copy_vs_mooncake_shm": ("throughput", ("kvpool_sidecar",
                                                           "local_get_zero_copy"),
                                            ("mooncake_shm", "get"), "",
                                            "kvpool local-hit get returning views, no copy"),
    "remote_get_zero_copy_vs_mooncake_tcp": ("throughput", ("kvpool_sidecar", "remote_get_zero_copy"),
                                             ("mooncake_tcp", "get"), "",
                                             "kvpool remote get returning views of the sidecar's arena "
                                             "(no copy into caller buffers) / Mooncake over TCP"),
    "remote_get_promote_vs_mooncake_tcp": ("throughput", ("kvpool_sidecar", "remote_get_promote"),
                                           ("mooncake_tcp", "get"), "",
                                           "kvpool remote get_into of plain caller buffers: the fetch "
                                           "lands in the sidecar's arena (promoted to its local tier) "
                                           "and is copied out / Mooncake over TCP"),
    "remote_get_1node_vs_mooncake_tcp": ("throughput", ("kvpool_sidecar", "remote_get_1node"),
                                         ("mooncake_tcp", "get"), "",
                                         "the remote get from a pool of one store node (Mooncake's "
                                         "peer has one segment owner) / Mooncake over TCP"),
    "local_get_vs_memcpy": ("throughput", ("kvpool_sidecar", "local_get"), ("memcpy", "copy"),
                            "", "kvpool local-hit get / numpy memcpy of the same batch"),
    "remote_get_vs_redis": ("throughput", ("kvpool_sidecar", "remote_get"), ("redis", "get"),
                            "", "kvpool remote get / Redis MGET"),
    "mooncake_tcp_get_cpu_vs_tcp2_ceiling": ("cpu", ("mooncake_tcp", "get"), ("tcp_stream_2conn", "get"),
                                             "", "peer context: Mooncake's CPU s/GB over a TCP get "
                                             "(client, master, segment owner) / the TCP ceiling's"),
    "remote_get_cpu_vs_mooncake_tcp": ("cpu", ("kvpool_sidecar", "remote_get"), ("mooncake_tcp", "get"),
                                       "", "CPU s/GB of the kvpool remote get / Mooncake's over TCP"),
    "put_cpu_vs_mooncake_shm": ("cpu", ("kvpool_sidecar", "put"), ("mooncake_shm", "put"), "",
                                "CPU s/GB of the back-to-back put (its write-through included) / "
                                "Mooncake shm put's (client, master, mooncake_client)"),
    "put_drained_cpu_vs_mooncake_shm": ("cpu", ("kvpool_sidecar", "put_drained"), ("mooncake_shm", "put"),
                                        "", "CPU s/GB of the put with nothing in flight / Mooncake "
                                        "shm put's"),
    **integrations.ratios(),  # <integration>_read_vs_direct_store, <integration>_read_vs_mooncake_tcp
}
MODE_OPS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "store": (kvpool_store.SYSTEM, kvpool_store.TLS_OPS),
    "sidecar": (kvpool_sidecar.SYSTEM, kvpool_sidecar.TLS_OPS),
}
"""suite -> kvpool's plain system in it and the ops each transport-security mode is set against
plain on (:func:`mode_ratios`)."""
RATIO_CELL = (MiB, 16)
RATIOS_DOC = {
    "_convention": "Every ratio is kvpool over the peer (*_vs_plain: kvpool in a transport-security "
                   "mode over kvpool without TLS), both measured in this run, 1 MiB "
                   "values in batches of 16 (exists/match: 8192 keys). Throughput ratios "
                   "(get_*, put_*, local_get_*, remote_get_*) are kvpool GB/s / peer GB/s of "
                   "the median batch, so > 1 means kvpool is faster. Time ratios "
                   "(exists8192_*, match8192_*) are kvpool p50 time / peer p50 time, so < 1 "
                   "means kvpool is faster. CPU ratios (*_cpu_*) are kvpool cpu_s_per_gb / the "
                   "other's (CPU seconds of every process of the system per 1e9 bytes of the timed "
                   "batches), so < 1 means kvpool spends less CPU. null: one side was not measured "
                   "(see ratios_missing). Ratios named mooncake_* are peer context (Mooncake over a "
                   "ceiling), not kvpool over a peer.",
}


def mode_ratios(system: str, ops: dict[str, tuple[str, ...]], modes: tuple[str, ...]) -> dict[str, R]:
    """Ratios of each transport-security mode of ``modes`` to plain (both in ``modes``; none
    otherwise), per op of ``ops`` and kind: ``<tag>_<op>_vs_plain`` (GB/s),
    ``<tag>_<op>_cpu_vs_plain`` (CPU s/GB), ``<tag>_<op>8192_vs_plain`` (p50 time), e.g.
    ``tls_remote_get_vs_plain``.  Each is taken within a round, as every ratio is."""
    if PLAIN not in modes:
        return {}
    how = {"throughput": ("", "GB/s"), "cpu": ("_cpu", "CPU s/GB"), "time": ("8192", "p50 time of 8192 keys")}
    table: dict[str, R] = {}
    for mode in modes:
        if mode == PLAIN:
            continue
        tls = TLS_MODES[mode]
        for op, kinds in ops.items():
            for kind in kinds:
                suffix, what = how[kind]
                table[f"{tls.tag}_{op}{suffix}_vs_plain"] = (
                    kind, (tls.system(system), op), (system, op), "",
                    f"{system} {op} {what} with {tls.text} ({mode}) / without TLS (plain), same round")
    return table


def ratio_values(rows: list[Row], table: dict[str, R]) -> tuple[dict[str, float | None],
                                                                 dict[str, str]]:
    """Each ratio of `table` from one round's rows; why a ratio could not be computed."""
    def cell(system: str, op: str, kind: str) -> Row | None:
        for r in rows:
            if r.system != system or r.op != op or r.status == "unavailable":
                continue
            if kind == "time" and r.batch == EXISTS_KEYS:
                return r
            if kind in ("throughput", "cpu") and (r.value_size, r.batch) == RATIO_CELL:
                return r
        return None

    def find(system: str, op: str, kind: str) -> Row | None:
        r = cell(system, op, kind)
        return r if r is not None and r.status == "ok" else None

    def why(system: str, op: str, kind: str) -> str:
        r = cell(system, op, kind)
        return f"{system}/{op} " + ("not measured" if r is None else "had errors")

    values: dict[str, float | None] = {}
    missing: dict[str, str] = {}
    for name, (kind, num, den, _target, _text) in table.items():
        a, b = find(*num, kind), find(*den, kind)
        value: float | None = None
        if a is None or b is None:
            missing[name] = ", ".join(why(*side, kind) for side, r in
                                      ((num, a), (den, b)) if r is None)
        elif kind == "throughput" and a.gbps and b.gbps:
            value = a.gbps / b.gbps
        elif kind == "time" and a.p50_ms and b.p50_ms:
            value = a.p50_ms / b.p50_ms
        elif kind == "cpu" and a.cpu_s_per_gb and b.cpu_s_per_gb:
            value = a.cpu_s_per_gb / b.cpu_s_per_gb
        elif kind == "cpu":
            missing[name] = "cpu_s_per_gb not measured"
        values[name] = value
    return values, missing


def ratios_doc(table: dict[str, R], rounds: int) -> dict[str, str]:
    doc = dict(RATIOS_DOC)
    if rounds > 1:
        doc["_rounds"] = (f"The suite ran {rounds} rounds (every system once per round); each "
                          "ratio is the median over rounds of that round's ratio, and each "
                          "row is the median over rounds (ratios_per_round has them all).")
    for name, (kind, _num, _den, _target, text) in table.items():
        how = {"throughput": "GB/s ratio, >1 better", "time": "time ratio, <1 better",
               "cpu": "CPU s/GB ratio, <1 better"}[kind]
        doc[name] = f"{text} ({how})"
    return doc


def judge(ratios: dict[str, float | None], table: dict[str, R]) -> tuple[dict[str, str],
                                                                        dict[str, bool | None]]:
    targets: dict[str, str] = {}
    meets: dict[str, bool | None] = {}
    for name, (_kind, _num, _den, target, _text) in table.items():
        if not target:
            continue
        targets[name] = target
        value = ratios.get(name)
        if value is None:
            meets[name] = None
        else:
            op, lim = target.split()
            meets[name] = value >= float(lim) if op == ">=" else value <= float(lim)
    return targets, meets


def merge_rounds(rounds: list[list[Row]]) -> list[Row]:
    """One row per (system, op, value, batch): medians over the rounds where it ran."""
    if len(rounds) == 1:
        return rounds[0]
    order: list[tuple[Any, ...]] = []
    groups: dict[tuple[Any, ...], list[Row]] = {}
    for rows in rounds:
        for r in rows:
            k = (r.system, r.op, r.value_size, r.batch)
            if k not in groups:
                order.append(k)
                groups[k] = []
            groups[k].append(r)

    def med(xs: list[float | None]) -> float | None:
        ys = [x for x in xs if x is not None]
        return float(statistics.median(ys)) if ys else None

    out = []
    for k in order:
        rs = groups[k]
        ok = [r for r in rs if r.status == "ok"]
        if not ok:
            out.append(next((r for r in rs if r.status == "errors"), rs[0]))
            continue
        m = Row(ok[0].system, ok[0].op, ok[0].value_size, ok[0].batch,
                med([r.gbps for r in ok]), med([r.p50_ms for r in ok]),
                med([r.p99_ms for r in ok]), sum(r.reps for r in ok), ok[0].note,
                cpu_s_per_gb=med([r.cpu_s_per_gb for r in ok]))
        splits = [r.cpu_split for r in ok if r.cpu_split]
        if splits:
            m.cpu_split = {k: v for k in splits[0]
                           if (v := med([s.get(k) for s in splits])) is not None}
        m.note = (m.note + "; " if m.note else "") + f"median of {len(ok)}/{len(rounds)} rounds"
        out.append(m)
    return out


# --------------------------------------------------------------------------------------------
# table


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.{digits}f}"


def format_table(rows: list[Row]) -> str:
    head = ["system", "op", "value", "batch", "GB/s", "p50 ms", "p99 ms", "n", "cpu s/GB", "note"]
    last = len(head) - 1
    body = []
    for r in rows:
        if r.status == "unavailable":
            body.append([r.system, r.op, "-", "-", "-", "-", "-", "-", "-",
                         f"{r.status.upper()}: {r.note}"])
            continue
        note = r.note if r.status == "ok" else f"{r.status.upper()}: {r.note}"
        if r.cpu_split:
            note += " [cpu s/GB: " + ", ".join(f"{k} {v:.3f}" for k, v in r.cpu_split.items()) + "]"
        body.append([r.system, r.op, size_label(r.value_size),
                     "-" if r.batch is None else str(r.batch), _fmt(r.gbps), _fmt(r.p50_ms),
                     _fmt(r.p99_ms), str(r.reps), _fmt(r.cpu_s_per_gb), note])
    widths = [max(len(head[i]), *(len(b[i].splitlines()[0] if b[i] else "") for b in body))
              if body else len(head[i]) for i in range(last)]
    lines = ["  ".join(h.ljust(w) if i < 2 or i == last else h.rjust(w)
                       for i, (h, w) in enumerate(zip(head, widths + [0], strict=True)))]
    lines.append("-" * (sum(widths) + 2 * len(widths) + 4))
    for b in body:
        first, *rest = (b[last] or "").splitlines() or [""]
        cells = [b[i].ljust(widths[i]) if i < 2 else b[i].rjust(widths[i]) for i in range(last)]
        lines.append("  ".join(cells + [first]).rstrip())
        indent = " " * (sum(widths) + 2 * len(widths))
        for extra in rest[:6]:
            lines.append(indent + "  | " + extra[:160])
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# environment


def _version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
        return out.strip().splitlines()[0] if out.strip() else "?"
    except (OSError, subprocess.SubprocessError):
        return "not installed"


def environment() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def pv(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    exe = shutil.which("redis-server")
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": pv("numpy"), "redis_py": pv("redis"), "hiredis": pv("hiredis"),
        "redis_server": _version([exe, "--version"]) if exe else "not installed",
        "mooncake": mooncake_peer.package_version(), "kvpool": pv("kvpool"),
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }


# --------------------------------------------------------------------------------------------


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=("store", "sidecar"), required=True)
    ap.add_argument("--quick", action="store_true",
                    help="only 1 MiB x 16 (plus exists/match), fewer repetitions")
    ap.add_argument("--json", type=Path, help="write rows and ratios here")
    ap.add_argument("--only", default="",
                    help="comma-separated subset of: memcpy,network,redis,mooncake,kvpool "
                         "(sidecar suite: also integrations)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the whole suite N times (systems interleaved); rows and ratios "
                         "are medians over rounds: steadier on a shared, busy machine")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="before each step wait up to SECONDS for the CPUs to be < 25%% busy "
                         "(other work on this machine skews every number)")
    ap.add_argument("--kvpool-tls", default=PLAIN, metavar="MODES",
                    help="comma-separated transport-security modes kvpool is measured in, each its own "
                         "node (store suite) or cluster (sidecar suite: the first mode every row, the "
                         "others put, put_drained, remote_get, match), all in every round: plain "
                         "(kvpool_store, kvpool_sidecar), tls (*_tls: mutual TLS on gRPC and the data "
                         "session), tls-plain-data (*_tls_plaindata: TLS control, data session opted "
                         "out); with plain and another mode, ratios <tag>_<op>_vs_plain")
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the work directory with every process's log")
    args = ap.parse_args(argv)

    plan = Plan.make(args.quick)
    steps = STORE_STEPS if args.suite == "store" else SIDECAR_STEPS
    if args.only:
        wanted = {s.strip() for s in args.only.split(",") if s.strip()}
        unknown = wanted - {n for n, _ in steps}
        if unknown:
            ap.error(f"unknown --only names: {sorted(unknown)}")
        steps = [(n, f) for n, f in steps if n in wanted]

    work_dir = Path(tempfile.mkdtemp(prefix=f"kvpool-bench-{args.suite}-"))
    procs = Procs(work_dir)
    modes = tuple(m.strip() for m in args.kvpool_tls.split(",") if m.strip())
    bad = set(modes) - set(TLS_MODES)
    if bad or not modes or len(set(modes)) != len(modes):
        ap.error(f"--kvpool-tls: unknown or repeated modes in {args.kvpool_tls!r} (of {sorted(TLS_MODES)})")
    ctx = Context(plan=plan, procs=procs, work_dir=work_dir, suite=args.suite, kvpool_tls=modes)
    # SIGINT too: a runner started in the background of a script inherits SIGINT ignored.
    old = {s: signal.signal(s, _raise_interrupt)
           for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    rounds: list[list[Row]] = []
    steps_log: list[dict[str, Any]] = []
    interrupted = False
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    try:
        for rnd in range(args.rounds):
            rows: list[Row] = []
            rounds.append(rows)
            for name, step in steps:
                busy = wait_idle(args.wait_idle, log=ctx.log) if args.wait_idle > 0 \
                    else cpu_busy()
                t0 = time.monotonic()
                ctx.log(f"[bench] round {rnd + 1}/{args.rounds}: {name} (CPUs {busy:.0%} busy "
                        f"before) ...")
                try:
                    got = step(ctx)
                except KeyboardInterrupt:
                    raise
                except Exception as e:  # one broken system never ends the run
                    got = [unavailable(name, f"{type(e).__name__}: {e}")]
                finally:
                    procs.stop_all()  # nothing of one system runs while the next is measured
                rows += got
                steps_log.append({"round": rnd + 1, "step": name, "seconds":
                                  round(time.monotonic() - t0, 1),
                                  "cpu_busy_before": round(busy, 3),
                                  "loadavg_after": round(os.getloadavg()[0], 2)})
                ctx.log(f"[bench] {name}: {len(got)} rows in {time.monotonic() - t0:.1f}s")
    except KeyboardInterrupt:
        interrupted = True
        ctx.log("[bench] interrupted; stopping everything started")
    finally:
        procs.stop_all()
        for s, h in old.items():
            signal.signal(s, h)

    table = {**(STORE_RATIOS if args.suite == "store" else SIDECAR_RATIOS),
             **mode_ratios(*MODE_OPS[args.suite], modes)}
    if interrupted and len(rounds) > 1 and not rounds[-1]:
        rounds.pop()
    per_round = [ratio_values(r, table) for r in rounds]
    ratios: dict[str, float | None] = {}
    for name in table:
        vals = [x for v, _ in per_round if (x := v[name]) is not None]
        ratios[name] = round(float(statistics.median(vals)), 3) if vals else None
    missing = {k: why for k, why in (per_round[-1][1] if per_round else {}).items()
               if ratios.get(k) is None}
    doc = ratios_doc(table, len(rounds))
    targets, meets = judge(ratios, table)
    rows = merge_rounds(rounds) if rounds else []
    title = f"kvpool bench: suite={args.suite}{' (quick)' if args.quick else ''}" + \
        (f", median of {len(rounds)} rounds" if len(rounds) > 1 else "") + \
        (" INTERRUPTED" if interrupted else "")
    print(title)
    print(format_table(rows))
    print()
    print("ratios (kvpool / peer; *_vs_plain: a TLS mode / plain; 1 MiB x 16; throughput: >1 better, "
          "time and cpu: <1 better):")
    for k, v in ratios.items():
        t = f"  target {targets[k]}: {'met' if meets[k] else 'NOT met'}" \
            if k in targets and meets.get(k) is not None else \
            (f"  target {targets[k]}" if k in targets else "")
        why = f"  ({missing[k]})" if k in missing else ""
        print(f"  {k:40s} {'-' if v is None else f'{v:.3f}':>8s}{t}{why}")
    load_after = os.getloadavg()[0]
    if max(load_before, load_after) > 1.5:
        print(f"WARNING: load average {load_before:.1f} before / {load_after:.1f} after the run "
              f"on {os.cpu_count()} cores: other work shared the CPUs, numbers are noisy")
    keep = args.keep_logs or interrupted or any(r.status == "unavailable" for r in rows)
    print(f"elapsed {time.monotonic() - started:.0f}s; logs in {work_dir}"
          + ("" if keep else " (removed)"))

    if args.json:
        out = {
            "suite": args.suite, "quick": args.quick, "interrupted": interrupted,
            "environment": environment(), "plan": plan.to_json(),
            "loadavg_before_after": [round(load_before, 2), round(load_after, 2)],
            "steps": steps_log,
            "rounds": len(rounds),
            "rows": [r.to_json() for r in rows],
            "ratios": ratios, "ratios_doc": doc, "ratios_targets": targets,
            "ratios_per_round": [{k: (None if v is None else round(v, 3)) for k, v in r.items()}
                                 for r, _ in per_round],
            "ratios_meet_target": meets, "ratios_missing": missing,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    if not keep:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
