#!/usr/bin/env python3
"""The fault matrix (issue 19): real processes, a checked load, one fault at a time.

    python bench/faults.py [--rounds 3] [--faults sidecar-kill,sidecar-stop,store-kill,store-stop]
                           [--stop-seconds 5] [--json PATH]

A ``kvpool.LocalCluster`` of 2 store nodes and 2 sidecars: sidecar 0 has a big local tier (the
engine pod whose sidecar is faulted), sidecar 1 a small one, so most of its reads go to the
store nodes.  Four client threads (two per sidecar) run what an engine runs: ``match`` a
prefix-chained sequence, read the matched prefix (``get`` views, ``get_into`` plain buffers, or
``get_into`` buffers from ``alloc_buffer``), ``put`` what was missing, and now and then put
fresh blocks and read them back.  Every object's bytes and size derive from its key
(:func:`expected`), so every byte read is checked.

Faults, one per run: ``sidecar-kill`` (SIGKILL of sidecar 0, then started again on the same
socket, as a pod's ``restartPolicy: Always`` does), ``sidecar-stop`` (SIGSTOP for
``stop_seconds``, then SIGCONT), ``store-kill`` and ``store-stop`` (the same for store node 0;
restarted on the same address and node id).  Counted: wrong bytes; p50/p99/max of match and get
latency for calls that overlap the fault window (the signal until the process is back plus
``settle_seconds``; a call still running at the end counts with its age); errors by kind; for
``sidecar-kill`` the share of the objects sidecar 0 held before that the restarted sidecar serves
from its local tier (the arena it adopted) without a pool read, from its Stats counters
(``read_hits_local`` / ``read_hits_pool``, read around a quiet read of a probe set the load
never touches); whether every client works again after the fault.

The pytest ``tests/kvpool/sidecar/test_fault_matrix.py`` runs :func:`run_fault` once per fault
and asserts on the result; this script runs every fault ``--rounds`` times and prints medians.
Issue 19's targets with default settings: p99 ≤ 250 ms and max ≤ 1 s during a SIGSTOP, ≥ 90 %
of the local objects kept across a sidecar SIGKILL, no wrong byte ever.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import KiB, MiB, ensure_kvpool_importable  # noqa: E402

if TYPE_CHECKING:
    from kvpool.apps.cluster import LocalCluster
    from kvpool.client.client import Client

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# what is run


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault: what is hit (``sidecar`` 0 or ``store`` node 0) and how (``kill``: SIGKILL,
    then started again; ``stop``: SIGSTOP, then SIGCONT)."""

    target: str
    action: str

    @property
    def name(self) -> str:
        return f"{self.target}-{self.action}"


FAULTS = {f.name: f for f in (Fault("sidecar", "kill"), Fault("sidecar", "stop"),
                              Fault("store", "kill"), Fault("store", "stop"))}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The cluster, the load and the timing of one fault run (defaults: what the test runs)."""

    clients: int = 4
    """Client threads, alternating between sidecar 0 (the faulted one) and sidecar 1."""
    stores: int = 2
    """Store nodes (R=1): a store fault hits half of the pool's keys."""
    sequences: int = 64
    """Prefix-chained key sequences the load matches, reads and puts (all preloaded)."""
    blocks: int = 8
    """Blocks per sequence (one match, one read, at most one put of them per step)."""
    probe_objects: int = 192
    """Objects put through sidecar 0 before the load starts and read by nothing but the probe:
    the sample for the share kept across a sidecar restart."""
    sizes: tuple[int, ...] = (4 * KiB, 16 * KiB, 64 * KiB)
    """Object sizes, chosen by the key (a wrong object of another size is caught by its size)."""
    local_bytes: int = 128 * MiB
    """Sidecar 0's local tier: everything the run puts through it fits (no eviction)."""
    reader_local_bytes: int = 4 * MiB
    """Sidecar 1's local tier: small, so its reads go to the store nodes."""
    store_bytes: int = 128 * MiB
    """Each store node's DRAM tier."""
    before_seconds: float = 3.0
    """Load before the fault (the baseline latencies)."""
    stop_seconds: float = 5.0
    """How long a SIGSTOP lasts."""
    settle_seconds: float = 1.0
    """How long after the process is back (restarted, or continued) the fault window lasts."""
    after_seconds: float = 5.0
    """Load after the fault window (every client must read correctly again in it)."""
    think_seconds: float = 0.005
    """Pause between two steps of a client (a moderate load, not a CPU hog on 2 cores)."""
    fresh_share: float = 0.05
    """Share of steps that put 2 fresh blocks and read them back at once."""
    join_seconds: float = 30.0
    """At the end, how long a client's call may still run before it counts as hung."""
    seed: int = 0


# --------------------------------------------------------------------------------------------
# pure parts: the bytes of a key, checking them, window statistics


def size_for(key: bytes, sizes: Sequence[int]) -> int:
    return sizes[key[1] % len(sizes)]


def expected(key: bytes, sizes: Sequence[int]) -> np.ndarray:
    """The bytes stored under ``key``: the key repeated to its size (derived, never stored)."""
    return np.resize(np.frombuffer(key, np.uint8), size_for(key, sizes))


def wrong_bytes(key: bytes, got: Any, sizes: Sequence[int]) -> int:
    """Bytes of ``got`` (a buffer) that differ from what ``key`` holds; a size difference counts
    as that many wrong bytes on top of the differing ones in the common part."""
    want = expected(key, sizes)
    have = np.frombuffer(got, np.uint8)
    n = min(len(want), len(have))
    return int(np.count_nonzero(have[:n] != want[:n])) + abs(len(want) - len(have))


def chain(seed: int, label: str, n: int) -> list[bytes]:
    """``n`` 32-byte keys, each hashed from the one before (a prefix chain, as engines key)."""
    out, prev = [], hashlib.sha256(f"{seed}/{label}".encode()).digest()
    for _ in range(n):
        prev = hashlib.sha256(prev).digest()
        out.append(prev)
    return out


class WrongBytes(Exception):
    """A read returned, with bytes that are not the key's."""


@dataclasses.dataclass
class Call:
    """One client call as the load saw it."""

    client: int
    sidecar: int
    op: str
    """match, get (any read), put."""
    start: float
    """time.monotonic() at the call."""
    seconds: float
    ok: bool
    """Returned without an exception and, for a read, with every byte right."""
    error: str = ""
    """The exception's kind when not ok (``WrongBytes``: returned, with wrong bytes)."""


def in_window(calls: Sequence[Call], begin: float, end: float) -> list[Call]:
    """Calls that overlap [begin, end]: started before its end and ended after its begin."""
    return [c for c in calls if c.start <= end and c.start + c.seconds >= begin]


def exposed_sidecar(fault: Fault) -> int:
    """The sidecar whose clients the fault is in the way of: the faulted sidecar 0, or for a
    store fault sidecar 1, whose reads go to the store nodes (sidecar 0 serves its clients
    from its local tier and writes to the pool behind their backs)."""
    return 0 if fault.target == "sidecar" else 1


def recovered(calls: Sequence[Call], after: float) -> bool:
    """Whether one client works again: of its reads started after ``after``, at least one
    returned every byte right and none returned a wrong byte."""
    reads = [c for c in calls if c.op == "get" and c.start > after]
    return any(c.ok for c in reads) and not any(c.error == "WrongBytes" for c in reads)


@dataclasses.dataclass
class Latency:
    n: int = 0
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None


def latency(seconds: Sequence[float]) -> Latency:
    if not seconds:
        return Latency()
    t = np.asarray(seconds, np.float64) * 1e3
    return Latency(len(t), float(np.median(t)), float(np.percentile(t, 99)), float(t.max()))


# --------------------------------------------------------------------------------------------
# the load


class Load:
    """``settings.clients`` threads, each with its own client, running :meth:`_step` until
    :meth:`stop`; every call is recorded (:class:`Call`), every byte read checked."""

    def __init__(self, cluster: LocalCluster, settings: Settings, sequences: list[list[bytes]]) -> None:
        import kvpool
        self.s = settings
        self.sequences = sequences
        self.calls: list[Call] = []
        self.errors: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()
        self.wrong_bytes = 0
        self.wrong_objects = 0
        self.read_objects = 0
        self.inflight: dict[int, tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.clients: list[Client] = []
        self.sidecar_of: list[int] = []
        for i in range(settings.clients):
            sc = i % 2 if len(cluster.sidecars) > 1 else 0
            self.clients.append(kvpool.connect(cluster.sidecars[sc]))
            self.sidecar_of.append(sc)
        self.threads = [threading.Thread(target=self._run, args=(i,), name=f"fault-load-{i}", daemon=True)
                        for i in range(settings.clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> list[tuple[int, str, float]]:
        """Stop the threads; the calls still running after ``join_seconds`` (client, op, age)."""
        self._stop.set()
        deadline = time.monotonic() + self.s.join_seconds
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        now = time.monotonic()
        with self._lock:
            hung = [(i, op, now - t0) for i, (op, t0) in self.inflight.items()]
        return hung

    def stop_now(self) -> None:
        """Tell the threads to stop (no wait)."""
        self._stop.set()

    def close(self) -> None:
        for c in self.clients:
            with contextlib.suppress(Exception):
                c.close()

    def in_flight_calls(self, now: float) -> list[Call]:
        """Calls running now, as calls that end now (a hung call is as slow as its age)."""
        with self._lock:
            return [Call(i, self.sidecar_of[i], op, t0, now - t0, False, "InFlight")
                    for i, (op, t0) in self.inflight.items()]

    # -- one client -------------------------------------------------------------------------

    def _call(self, i: int, op: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        t0 = time.monotonic()
        with self._lock:
            self.inflight[i] = (op, t0)
        out, error = None, ""
        try:
            out = fn()
        except Exception as exc:  # every kind is counted: the point is to see them
            error = type(exc).__name__
        dt = time.monotonic() - t0
        with self._lock:
            self.inflight.pop(i, None)
            self.calls.append(Call(i, self.sidecar_of[i], op, t0, dt, not error, error))
            if error:
                self.errors[f"{op}:{error}"] += 1
        return not error, out

    def _check(self, keys: Sequence[bytes], got: Sequence[Any]) -> None:
        """Count the objects read and their wrong bytes; raise :class:`WrongBytes` if any (so
        the call counts as failed, by that kind)."""
        sizes = self.s.sizes
        bad = [wrong_bytes(k, g, sizes) for k, g in zip(keys, got, strict=True)]
        n = sum(bad)
        with self._lock:
            self.read_objects += len(keys)
            self.wrong_bytes += n
            self.wrong_objects += sum(1 for b in bad if b)
        if n:
            raise WrongBytes(f"{n} wrong bytes in {sum(1 for b in bad if b)} of {len(keys)} objects")

    def _read(self, i: int, c: Client, keys: list[bytes], how: int, reg: np.ndarray) -> None:
        """Read ``keys`` one of three ways and check every byte; the call's ok says both."""
        sizes = self.s.sizes
        if how == 0:  # views of the arena
            def fn() -> None:
                with c.get(keys) as views:
                    self._check(keys, views)
        else:  # get_into: plain buffers (through the arena) or registered ones (alloc_buffer)
            def fn() -> None:
                outs: list[np.ndarray] = []
                at = 0
                for k in keys:
                    n = size_for(k, sizes)
                    outs.append(reg[at:at + n] if how == 2 else np.empty(n, np.uint8))
                    at += n
                got = c.get_into(keys, outs)
                have = [(k, o[:g]) for k, o, g in zip(keys, outs, got, strict=True) if g >= 0]
                if len(have) < len(keys):
                    with self._lock:
                        self.codes["get_into:miss"] += len(keys) - len(have)
                self._check([k for k, _ in have], [o for _, o in have])
        self._call(i, "get", fn)

    def _put(self, i: int, c: Client, keys: list[bytes]) -> None:
        sizes = self.s.sizes
        ok, codes = self._call(i, "put", lambda: c.put(keys, [expected(k, sizes) for k in keys]))
        if ok:
            from kvpool.wire.proto import store_pb2 as pb
            with self._lock:
                for code in codes:
                    if code not in (pb.OK, pb.ALREADY_EXISTS):
                        self.codes[f"put:{pb.Code.Name(code)}"] += 1

    def _run(self, i: int) -> None:
        c = self.clients[i]
        rng = random.Random(self.s.seed * 1000 + i)
        reg = np.asarray(c.alloc_buffer(self.s.blocks * max(self.s.sizes)))
        fresh = 0
        while not self._stop.is_set():
            if rng.random() < self.s.fresh_share:
                fresh += 1
                keys = chain(self.s.seed, f"fresh-{i}-{fresh}", 2)
                self._put(i, c, keys)
                self._read(i, c, keys, rng.randrange(3), reg)
            else:
                keys = rng.choice(self.sequences)
                ok, n = self._call(i, "match", functools.partial(c.match, keys))
                if ok and n:
                    self._read(i, c, keys[:n], rng.randrange(3), reg)
                if ok and n < len(keys):
                    self._put(i, c, keys[n:])
            self._stop.wait(self.s.think_seconds)


# --------------------------------------------------------------------------------------------
# faults on processes


def _arena_of(ready_line: str) -> str:
    return next((w.split("=", 1)[1] for w in ready_line.split() if w.startswith("arena=")), "")


def restart_sidecar(cluster: LocalCluster, i: int) -> None:
    """Start sidecar ``i`` again on the same socket (after a SIGKILL): ``LocalCluster.
    restart_sidecar``.  An arena the dead sidecar left in /dev/shm that the new one did not adopt
    is removed (it would hold its memory until reboot)."""
    old_arena = _arena_of(cluster.sidecar_procs[i].ready_line)
    cluster.restart_sidecar(i)
    new_arena = _arena_of(cluster.sidecar_procs[i].ready_line)
    if old_arena and old_arena != new_arena:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(old_arena)


# --------------------------------------------------------------------------------------------
# one run


@dataclasses.dataclass
class Outcome:
    """What one fault run measured (``to_json`` for the record)."""

    fault: str
    window_seconds: float = 0.0
    """Length of the fault window (signal → back + settle)."""
    back_seconds: float = 0.0
    """Signal → the process serving again (restart: READY; stop: SIGCONT)."""
    match: Latency = dataclasses.field(default_factory=Latency)
    get: Latency = dataclasses.field(default_factory=Latency)
    """Latencies of the calls overlapping the fault window, all clients."""
    match_exposed: Latency = dataclasses.field(default_factory=Latency)
    get_exposed: Latency = dataclasses.field(default_factory=Latency)
    """The same for the clients exposed to the fault (:func:`exposed_sidecar`)."""
    baseline_match: Latency = dataclasses.field(default_factory=Latency)
    baseline_get: Latency = dataclasses.field(default_factory=Latency)
    """Before the fault."""
    max_call_ms: float = 0.0
    """The slowest call of the whole run, any op (hung ones with their age)."""
    slowest: list[tuple[str, int, float, float]] = dataclasses.field(default_factory=list)
    """The 5 slowest calls: (op, sidecar, ms, start in s relative to the fault)."""
    calls: int = 0
    read_objects: int = 0
    wrong_bytes: int = 0
    wrong_objects: int = 0
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    """Exceptions by ``op:Kind``."""
    codes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Per-item outcomes that were not OK (``put:NO_SPACE``, ``get_into:miss``)."""
    hung: list[tuple[int, str, float]] = dataclasses.field(default_factory=list)
    """Calls still running ``join_seconds`` after the load was told to stop."""
    recovered: list[bool] = dataclasses.field(default_factory=list)
    """Per client: :func:`recovered`."""
    probe_objects: int = 0
    probe_local_before: int | None = None
    """Probe objects read as local hits before the fault (should be all)."""
    probe_local_after: int | None = None
    probe_pool_after: int | None = None
    probe_wrong_bytes: int = 0
    kept_share: float | None = None
    """sidecar-kill only: probe objects the restarted sidecar served as local hits / probe objects."""
    evicted_before: int | None = None
    reader_pool_hits: int = 0
    """Objects sidecar 1 read from the store nodes during the run (a store fault is in their way)."""
    adoption_counters: dict[str, int] = dataclasses.field(default_factory=dict)
    """The restarted sidecar's counters whose names speak of adoption or restart (none before
    sidecars adopt their arena)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ADOPTION_WORDS = ("adopt", "restor", "kept", "incarnation", "generation")


def _counters(c: Client) -> dict[str, int]:
    return {k: int(v) for k, v in c.stats().counters.items()}


def _probe(c: Client, keys: list[bytes], sizes: Sequence[int]) -> tuple[int, int, int]:
    """Read ``keys`` through the arena (plain buffers) on a quiet sidecar: (local hits, pool
    hits, wrong bytes) from the sidecar's counters around the reads."""
    from kvpool.wire.counters import SidecarCounter

    before = _counters(c)
    bad = 0
    for at in range(0, len(keys), 16):
        batch = keys[at:at + 16]
        outs = [np.empty(size_for(k, sizes), np.uint8) for k in batch]
        got = c.get_into(batch, outs)
        bad += sum(wrong_bytes(k, o[:g], sizes) for k, o, g in zip(batch, outs, got, strict=True) if g >= 0)
    after = _counters(c)
    return (after.get(SidecarCounter.READ_HITS_LOCAL, 0) - before.get(SidecarCounter.READ_HITS_LOCAL, 0),
            after.get(SidecarCounter.READ_HITS_POOL, 0) - before.get(SidecarCounter.READ_HITS_POOL, 0), bad)


def _wait(what: str, cond: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f}s")
        time.sleep(0.02)


def _inject(lc: LocalCluster, fault: Fault, s: Settings, log: Log) -> tuple[float, float]:
    """Hit sidecar 0 or store node 0 with ``fault``; (when it began, when the process was back)."""
    procs = lc.sidecar_procs if fault.target == "sidecar" else lc.store_procs
    pid = procs[0].pid
    log(f"[faults] {fault.name}: pid {pid}")
    t0 = time.monotonic()
    if fault.action == "kill":
        os.kill(pid, signal.SIGKILL)
        procs[0].popen.wait(30)
        if fault.target == "sidecar":
            restart_sidecar(lc, 0)
        else:
            lc.restart_store(0)
    else:
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(s.stop_seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
    return t0, time.monotonic()


def _measure(out: Outcome, load: Load, calls: list[Call], fault: Fault, t0: float, t_end: float,
             clients: int) -> None:
    """Fill ``out`` from the load's record: latencies in the window [t0, t_end] and before it,
    wrong bytes, errors, and which clients read correctly after the window."""
    win = in_window(calls, t0, t_end)
    faulted = [c for c in win if c.sidecar == exposed_sidecar(fault)]
    before = [c for c in calls if c.start + c.seconds < t0]
    out.match = latency([c.seconds for c in win if c.op == "match"])
    out.get = latency([c.seconds for c in win if c.op == "get"])
    out.match_exposed = latency([c.seconds for c in faulted if c.op == "match"])
    out.get_exposed = latency([c.seconds for c in faulted if c.op == "get"])
    out.baseline_match = latency([c.seconds for c in before if c.op == "match"])
    out.baseline_get = latency([c.seconds for c in before if c.op == "get"])
    out.max_call_ms = max((c.seconds for c in calls), default=0.0) * 1e3
    out.slowest = [(c.op, c.sidecar, round(c.seconds * 1e3, 1), round(c.start - t0, 3))
                   for c in sorted(calls, key=lambda c: -c.seconds)[:5]]
    out.calls = len(calls)
    out.read_objects, out.wrong_bytes, out.wrong_objects = load.read_objects, load.wrong_bytes, load.wrong_objects
    out.errors, out.codes = dict(load.errors), dict(load.codes)
    out.recovered = [recovered([c for c in calls if c.client == i], t_end) for i in range(clients)]


def run_fault(fault: Fault, settings: Settings = Settings(), log: Log = _stderr) -> Outcome:
    """Start a cluster, preload it, run the load, inject ``fault`` once, measure (see module doc)."""
    ensure_kvpool_importable()
    import kvpool
    from kvpool.apps.cluster import LocalCluster
    from kvpool.wire.counters import SidecarCounter

    s = settings
    out = Outcome(fault.name, probe_objects=s.probe_objects)
    seqs = [chain(s.seed, f"seq-{j}", s.blocks) for j in range(s.sequences)]
    probe = chain(s.seed, "probe", s.probe_objects)
    with LocalCluster(stores=s.stores, sidecars=1, store_bytes=s.store_bytes, local_bytes=s.local_bytes) as lc:
        lc.add_sidecar(local_bytes=s.reader_local_bytes)
        with kvpool.connect(lc.sidecars[0]) as loader:
            for keys in [*seqs, *(probe[j:j + 16] for j in range(0, len(probe), 16))]:
                codes = loader.put(keys, [expected(k, s.sizes) for k in keys])
                if any(c != 0 for c in codes):
                    raise RuntimeError(f"preload refused: codes {codes}")
            _wait("write-through of the preload", lambda: loader.stats().pending_pool_bytes == 0, 60)
            local, _, bad = _probe(loader, probe, s.sizes)
            out.probe_local_before, out.probe_wrong_bytes = local, bad
        load = Load(lc, s, seqs)
        try:
            load.start()
            time.sleep(s.before_seconds)
            with kvpool.connect(lc.sidecars[0]) as watcher:
                out.evicted_before = _counters(watcher).get(SidecarCounter.EVICTED, 0)
            t0, t_back = _inject(lc, fault, s, log)
            t_end = t_back + s.settle_seconds
            out.back_seconds, out.window_seconds = t_back - t0, t_end - t0
            time.sleep(s.settle_seconds + s.after_seconds)
            out.hung = load.stop()
            calls = load.calls + load.in_flight_calls(time.monotonic())
        finally:
            load.stop_now()
            load.close()
        _measure(out, load, calls, fault, t0, t_end, s.clients)
        with kvpool.connect(lc.sidecars[1]) as reader:
            out.reader_pool_hits = _counters(reader).get(SidecarCounter.READ_HITS_POOL, 0)
        if fault.target == "sidecar" and fault.action == "kill":
            with kvpool.connect(lc.sidecars[0]) as prober:
                out.adoption_counters = {k: v for k, v in _counters(prober).items()
                                         if any(w in k for w in ADOPTION_WORDS)}
                local, pool, bad = _probe(prober, probe, s.sizes)
            out.probe_local_after, out.probe_pool_after = local, pool
            out.probe_wrong_bytes += bad
            out.kept_share = local / len(probe) if probe else None
    log(f"[faults] {fault.name}: {summary_line(out)}")
    return out


# --------------------------------------------------------------------------------------------
# the table


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def summary_line(o: Outcome) -> str:
    m, g = o.match_exposed, o.get_exposed
    return (f"exposed clients: match p50/p99/max {_ms(m.p50_ms)}/{_ms(m.p99_ms)}/{_ms(m.max_ms)} ms, "
            f"get {_ms(g.p50_ms)}/{_ms(g.p99_ms)}/{_ms(g.max_ms)} ms; wrong bytes {o.wrong_bytes} "
            f"({o.wrong_objects} objects of {o.read_objects}), probe wrong {o.probe_wrong_bytes}, "
            f"errors {sum(o.errors.values())}, hung {len(o.hung)}, recovered {sum(o.recovered)}/{len(o.recovered)}"
            + ("" if o.kept_share is None else f", kept {o.kept_share:.0%}"))


def _med(xs: Sequence[float | None]) -> float | None:
    ys = [x for x in xs if x is not None]
    return float(statistics.median(ys)) if ys else None


def format_table(results: dict[str, list[Outcome]]) -> str:
    """One line per fault: medians over its rounds of the window latencies of the exposed
    clients (:func:`exposed_sidecar`; ``all p99``: every client) and of the kept share; the
    slowest call of all rounds, any op and client (``worst call``); wrong bytes, errors and hung
    calls summed over rounds (one is one too many)."""
    head = ("fault", "rounds", "match p50", "p99", "max", "all p99", "get p50", "p99", "max", "all p99",
            "worst call", "wrong B", "errors", "hung", "recov", "kept")
    rows = []
    for name, outs in results.items():
        def m(f: Callable[[Outcome], float | None], outs: list[Outcome] = outs) -> str:
            return _ms(_med([f(o) for o in outs]))
        kept = _med([o.kept_share for o in outs])
        worst = max(outs, key=lambda o: o.max_call_ms)
        rows.append((name, str(len(outs)),
                     m(lambda o: o.match_exposed.p50_ms), m(lambda o: o.match_exposed.p99_ms),
                     m(lambda o: o.match_exposed.max_ms), m(lambda o: o.match.p99_ms),
                     m(lambda o: o.get_exposed.p50_ms), m(lambda o: o.get_exposed.p99_ms),
                     m(lambda o: o.get_exposed.max_ms), m(lambda o: o.get.p99_ms),
                     f"{_ms(worst.max_call_ms)} {worst.slowest[0][0] if worst.slowest else ''}".strip(),
                     str(sum(o.wrong_bytes + o.probe_wrong_bytes for o in outs)),
                     str(sum(sum(o.errors.values()) for o in outs)), str(sum(len(o.hung) for o in outs)),
                     f"{sum(sum(o.recovered) for o in outs)}/{sum(len(o.recovered) for o in outs)}",
                     "-" if kept is None else f"{kept:.0%}"))
    widths = [max(len(h), *(len(r[j]) for r in rows)) if rows else len(h) for j, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) if j == 0 else h.rjust(w) for j, (h, w) in enumerate(zip(head, widths, strict=True)))]
    lines.append("-" * len(lines[0]))
    for r in rows:
        cells = zip(r, widths, strict=True)
        lines.append("  ".join(x.ljust(w) if j == 0 else x.rjust(w) for j, (x, w) in enumerate(cells)))
    errs: Counter[str] = Counter()
    for outs in results.values():
        for o in outs:
            errs.update(o.errors)
            errs.update(o.codes)
    if errs:
        lines.append("errors and item codes by kind (all rounds): "
                     + ", ".join(f"{k} {v}" for k, v in sorted(errs.items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each fault (medians over them)")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {', '.join(FAULTS)}")
    ap.add_argument("--stop-seconds", type=float, default=Settings.stop_seconds)
    ap.add_argument("--json", type=Path, help="write every run's outcome here")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.faults.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        ap.error(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    settings = Settings(stop_seconds=args.stop_seconds)
    results: dict[str, list[Outcome]] = {n: [] for n in names}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):  # faults interleaved round by round: a load spike hits all alike
        for n in names:
            _stderr(f"[faults] round {r + 1}/{args.rounds}: {n}")
            results[n].append(run_fault(FAULTS[n], dataclasses.replace(settings, seed=r)))
    print(f"kvpool fault matrix: {args.rounds} rounds, latencies in ms of the calls overlapping the fault "
          f"window (medians over rounds), SIGSTOP {settings.stop_seconds:g} s")
    print(format_table(results))
    load_after = os.getloadavg()[0]
    if max(load_before, load_after) > 1.5:
        print(f"WARNING: load average {load_before:.1f} before / {load_after:.1f} after on {os.cpu_count()} cores: "
              "other work shared the CPUs, latencies are noisy")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": dataclasses.asdict(settings),
                                         "runs": {n: [o.to_json() for o in outs] for n, outs in results.items()}},
                                        indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
