"""Shared machinery of the benchmark harness: the measurement plan, result rows, timing and
statistics, and the process group that starts servers on 127.0.0.1 and always stops them.

Nothing here knows about a particular system; the system modules (ceilings, peers, kvpool_*)
build rows with these helpers and the runner (run.py) prints and saves them.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

REPO_ROOT = Path(__file__).resolve().parent.parent
EXISTS_KEYS = 8192


def size_label(n: int | None) -> str:
    """128 KiB -> '128KiB', 1 MiB -> '1MiB'; None -> '-'."""
    if n is None:
        return "-"
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{name}"
    return f"{n}B"


# --------------------------------------------------------------------------------------------
# plan


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to measure: the value sizes and batch sizes of the put/get cells and how often."""

    quick: bool
    """Fewer repetitions and only the 1 MiB x 16 cell (plus exists)."""
    value_sizes: tuple[int, ...]
    """Bytes per value."""
    batches: tuple[int, ...]
    """Values per batch (one batch = one timed operation)."""
    target_bytes: int
    """Bytes to move per cell and op; repetitions = target_bytes / batch bytes, clamped."""
    min_reps: int
    """Fewest timed repetitions of any cell (so p99 of small counts is close to the max)."""
    max_reps: int
    """Most timed repetitions of any cell."""
    exists_reps: int
    """Timed repetitions of the 8192-key exists/match."""
    warmup: int = 2
    """Untimed repetitions before the timed ones."""

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls(quick=True, value_sizes=(MiB,), batches=(16,), target_bytes=160 * MiB,
                       min_reps=5, max_reps=20, exists_reps=7, warmup=2)
        return cls(quick=False, value_sizes=(128 * KiB, MiB, 4 * MiB), batches=(1, 16, 64),
                   target_bytes=512 * MiB, min_reps=5, max_reps=200, exists_reps=21, warmup=2)

    def cells(self) -> list[tuple[int, int]]:
        return [(v, b) for v in self.value_sizes for b in self.batches]

    def reps(self, value_size: int, batch: int) -> int:
        n = self.target_bytes // max(1, value_size * batch)
        return int(min(self.max_reps, max(self.min_reps, n)))

    @property
    def max_batch_bytes(self) -> int:
        return max(v * b for v, b in self.cells())

    def total_put_bytes(self) -> int:
        """Bytes written by the put reps of all cells (warmup included), fresh keys each rep."""
        return sum((self.reps(v, b) + self.warmup) * v * b for v, b in self.cells())

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["cells"] = [[v, b] for v, b in self.cells()]
        d["reps"] = {f"{size_label(v)}x{b}": self.reps(v, b) for v, b in self.cells()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        fields = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v)
                              for k, v in d.items() if k in fields}
        return cls(**kw)


def pool_bytes(plan: Plan) -> int:
    """Capacity given to every store under test (Mooncake's segment, kvpool's DRAM tier): room
    for every cell's get set (kept to the end: a read object may be leased), one put batch in
    flight and the exists keys, doubled to stay far below any eviction watermark. Put reps
    remove their keys (untimed) before the next rep, so this suffices."""
    kept = sum(v * b for v, b in plan.cells()) + plan.max_batch_bytes + EXISTS_KEYS * 4096
    need = 2 * kept + 64 * MiB
    return max(512 * MiB, -(-need // (256 * MiB)) * 256 * MiB)


# --------------------------------------------------------------------------------------------
# rows and statistics


@dataclasses.dataclass
class Row:
    """One line of the table: one system doing one op at one value size and batch size."""

    system: str
    op: str
    value_size: int | None
    batch: int | None
    gbps: float | None = None
    """Median throughput, 1e9 bytes per second (batch bytes / median batch latency)."""
    p50_ms: float | None = None
    p99_ms: float | None = None
    reps: int = 0
    note: str = ""
    status: str = "ok"
    """'ok'; 'errors' (measured, but some items failed or the bytes/answers were wrong: the
    note says what; such a row enters no ratio); 'unavailable' (the system could not run)."""
    cpu_s_per_gb: float | None = None
    """CPU seconds of every process of the system (client, servers) per 1e9 bytes moved in
    the timed batches (:class:`CpuMeter`); None where not measured."""
    cpu_split: dict[str, float] | None = None
    """The same, per process role ('client', 'sidecar', 'store', ...)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Row:
        return cls(**d)


def row_from_times(system: str, op: str, value_size: int | None, batch: int | None,
                   seconds: Sequence[float], note: str = "", with_bytes: bool = True) -> Row:
    """Median throughput and p50/p99 latency of timed batches (seconds per batch)."""
    t = np.asarray(seconds, dtype=np.float64)
    p50 = float(np.median(t))
    p99 = float(np.percentile(t, 99))
    gbps = None
    if with_bytes and value_size and batch and p50 > 0:
        gbps = value_size * batch / p50 / 1e9
    row = Row(system, op, value_size, batch, gbps, p50 * 1e3, p99 * 1e3, len(t), note)
    if any(m in note for m in ERROR_MARKERS):
        row.status = "errors"
    return row


ERROR_MARKERS = ("item failures", "VERIFY FAILED", "WRONG")
"""Words the system modules put in a row's note when items failed or answers were wrong."""


def with_cpu(row: Row, meter: CpuMeter | None, nbytes: int) -> Row:
    """``row`` with the CPU per GB ``meter`` saw over ``nbytes`` moved (its timed batches)."""
    if meter is not None and nbytes > 0:
        split = meter.seconds()
        if split:
            row.cpu_s_per_gb = round(sum(split.values()) / (nbytes / 1e9), 4)
            row.cpu_split = {k: round(v / (nbytes / 1e9), 4) for k, v in split.items()}
    return row


def unavailable(system: str, reason: str, op: str = "-") -> Row:
    return Row(system, op, None, None, status="unavailable", note=reason)


def timed(fn: Callable[[int], object], reps: int, warmup: int = 0) -> list[float]:
    """Call fn(i) warmup times untimed (i < 0) and reps times timed; seconds per call."""
    for i in range(warmup):
        fn(-1 - i)
    out = []
    pc = time.perf_counter
    for i in range(reps):
        t0 = pc()
        fn(i)
        out.append(pc() - t0)
    return out


def touched(nbytes: int, fill: int = 0x5A) -> np.ndarray:
    """A page-aligned uint8 buffer whose pages are all written (no first-touch cost later)."""
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    buf = raw[off:off + nbytes]
    buf.fill(fill)
    return buf


def pattern(buf: np.ndarray, seed: int) -> None:
    """Write a cheap, position-dependent pattern so a misplaced item is detected on verify."""
    n = buf.nbytes
    if n == 0:
        return
    step = 4096
    buf.fill(seed & 0xFF)
    idx = np.arange(0, n, step)
    buf[idx] = ((idx // step) + seed) & 0xFF


def keys32(prefix: str, n: int) -> list[bytes]:
    """n distinct 32-byte keys (the shape of kvpool keys), deterministic in prefix."""
    import hashlib
    base = hashlib.sha256(prefix.encode()).digest()
    return [hashlib.sha256(base + i.to_bytes(8, "little")).digest() for i in range(n)]


# --------------------------------------------------------------------------------------------
# machine load


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)  # idle + iowait
    return sum(parts), idle


def cpu_busy(sample: float = 0.5) -> float:
    """Fraction of all CPUs busy over `sample` seconds (0..1), whoever keeps them busy."""
    try:
        t0, i0 = _cpu_times()
        time.sleep(sample)
        t1, i1 = _cpu_times()
    except (OSError, ValueError, IndexError):
        return float("nan")
    dt = t1 - t0
    return 1.0 - (i1 - i0) / dt if dt > 0 else 0.0


def wait_idle(max_wait: float, busy_below: float = 0.25,
              log: Callable[[str], None] | None = None) -> float:
    """Wait up to max_wait seconds for the CPUs to be mostly idle; returns the last busy
    fraction seen (the benchmark shares 2 cores with anything else running)."""
    deadline = time.monotonic() + max_wait
    busy = cpu_busy()
    waited = False
    while busy >= busy_below and time.monotonic() < deadline:
        if log and not waited:
            log(f"[bench] CPUs {busy:.0%} busy; waiting up to {max_wait:.0f}s for quiet")
        waited = True
        busy = cpu_busy(1.0)
    return busy


# --------------------------------------------------------------------------------------------
# CPU per byte


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Nanoseconds on CPU of each live thread of ``pid`` (``/proc/<pid>/task/<tid>/schedstat``:
    exact, where ``/proc/<pid>/stat`` counts 10 ms ticks); {} for a process that is gone."""
    out: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return out


class CpuMeter:
    """CPU seconds of a set of processes (role → pids), summed over the windows between
    :meth:`start` and :meth:`stop` (the timed batches of one row).

    Per thread, so a thread that starts inside a window counts from 0 and one that ends inside
    it counts what it had at the window's start (lost: its last moments; the systems measured
    keep their worker threads).  Every thread of a process counts, its idle pollers too: that
    is what the process costs the machine.  The measuring thread itself is read with
    ``time.thread_time_ns`` right at the window's edges, and the other processes' threads
    outside them, so the reads of /proc (a few ms of CPU for a sidecar's threads) are not
    counted as the client's."""

    def __init__(self, roles: Mapping[str, Sequence[int]]) -> None:
        self.roles = {role: list(pids) for role, pids in roles.items() if pids}
        self._total: dict[str, int] = {role: 0 for role in self.roles}
        self._at: dict[int, dict[int, int]] = {}

    def _order(self) -> list[tuple[str, int]]:
        me = os.getpid()
        pairs = [(role, pid) for role, pids in self.roles.items() for pid in pids]
        return [p for p in pairs if p[1] == me] + [p for p in pairs if p[1] != me]

    def start(self) -> None:
        self._at = {pid: thread_cpu_ns(pid) for _role, pid in reversed(self._order())}
        me = self._at.get(os.getpid())
        if me is not None:
            me[threading.get_native_id()] = time.thread_time_ns()

    def stop(self) -> None:
        mine = time.thread_time_ns()
        now = [(role, pid, thread_cpu_ns(pid)) for role, pid in self._order()]
        for role, pid, threads in now:
            if pid == os.getpid():
                threads[threading.get_native_id()] = mine
            before = self._at.get(pid, {})
            self._total[role] += sum(max(0, ns - before.get(tid, 0)) for tid, ns in threads.items())

    def seconds(self) -> dict[str, float]:
        """Role → CPU seconds over every window so far."""
        return {role: ns / 1e9 for role, ns in self._total.items()}


def timed_cpu(fn: Callable[[int], object], reps: int, meter: CpuMeter, warmup: int = 0) -> list[float]:
    """:func:`timed`, with ``meter`` running around each timed call (not the warmup)."""
    for i in range(warmup):
        fn(-1 - i)
    out = []
    pc = time.perf_counter
    for i in range(reps):
        meter.start()
        t0 = pc()
        fn(i)
        out.append(pc() - t0)
        meter.stop()
    return out


# --------------------------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"port {port} not open after {timeout:.0f}s") from None
            time.sleep(0.05)


_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    # Runs in the child between fork and exec: die with the runner even if it is SIGKILLed,
    # so a crashed or killed benchmark never leaves servers behind.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass


@dataclasses.dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    ready_line: str | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, n: int = 12) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


class Procs:
    """Every process the benchmark starts, each in its own session (process group), stopped
    (SIGTERM, then SIGKILL) by stop()/stop_all() — on normal exit, exceptions and Ctrl-C."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.live: list[Proc] = []
        self._lock = threading.Lock()

    def start(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
              ready_line: str | None = None, ready_port: int | None = None,
              timeout: float = 60.0, cwd: str | Path | None = None) -> Proc:
        """Start argv; wait until stdout prints a line starting with ready_line, or until
        ready_port accepts connections (or neither). stdout+stderr go to a log file."""
        log = self.log_dir / f"{name}.log"
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        popen = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=full_env, cwd=cwd, start_new_session=True,
            preexec_fn=_child_setup)
        proc = Proc(name, popen, log)
        with self._lock:
            self.live.append(proc)
        found = threading.Event()

        def pump() -> None:
            # Copy the child's output to its log; note the readiness line when it appears.
            assert popen.stdout is not None
            with open(log, "wb") as f:
                for line in popen.stdout:
                    f.write(line)
                    f.flush()
                    if ready_line and not found.is_set():
                        text = line.decode(errors="replace").strip()
                        if text.startswith(ready_line):
                            proc.ready_line = text
                            found.set()

        threading.Thread(target=pump, name=f"log-{name}", daemon=True).start()
        try:
            if ready_line:
                deadline = time.monotonic() + timeout
                while not found.wait(0.05):
                    if popen.poll() is not None:
                        time.sleep(0.2)  # let the pump write the last lines
                        raise RuntimeError(f"{name} exited with {popen.returncode} before "
                                           f"printing {ready_line!r}:\n{proc.log_tail()}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name} did not print {ready_line!r} in "
                                           f"{timeout:.0f}s:\n{proc.log_tail()}")
            if ready_port is not None:
                try:
                    wait_port(ready_port, timeout, popen)
                except (RuntimeError, TimeoutError) as e:
                    time.sleep(0.2)
                    raise type(e)(f"{name}: {e}\n{proc.log_tail()}") from None
        except BaseException:
            self.stop(proc)
            raise
        return proc

    def stop(self, proc: Proc, grace: float = 5.0) -> None:
        p = proc.popen
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        # Anything left in the group (grandchildren) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with self._lock:
            if proc in self.live:
                self.live.remove(proc)

    def stop_all(self) -> None:
        with self._lock:
            procs = list(reversed(self.live))
        for proc in procs:
            self.stop(proc)

    @contextlib.contextmanager
    def scope(self) -> Iterator[Procs]:
        """Processes started inside the block are stopped when it ends (newest first)."""
        before = set(id(p) for p in self.live)
        try:
            yield self
        finally:
            with self._lock:
                mine = [p for p in self.live if id(p) not in before]
            for proc in reversed(mine):
                self.stop(proc)


def python_env() -> dict[str, str]:
    """Environment for Python children: the repo's bench package and kvpool sources importable
    even without an editable install."""
    parts = [str(REPO_ROOT), str(REPO_ROOT / "sidecar")]
    old = os.environ.get("PYTHONPATH")
    if old:
        parts.append(old)
    return {"PYTHONPATH": os.pathsep.join(parts), "PYTHONUNBUFFERED": "1"}


KVPOOL_SRC_ENV = "KVPOOL_BENCH_SRC"
"""Names another checkout's source root (its ``sidecar/``) to measure instead of this one's:
bench/compare.py runs the same harness over two versions of kvpool."""


def source_root() -> str:
    """The kvpool source root the runner measures (its own checkout's, or $KVPOOL_BENCH_SRC)."""
    return os.environ.get(KVPOOL_SRC_ENV) or str(REPO_ROOT / "sidecar")


def engine_python(engine: str) -> str | None:
    """The engine venv's python (tools/engines.sh --python), None when the venv is not built."""
    try:
        r = subprocess.run(["bash", str(REPO_ROOT / "tools" / "engines.sh"), "--python", engine],
                           capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    py = r.stdout.strip()
    return py if r.returncode == 0 and py and os.path.exists(py) else None


def ensure_kvpool_importable() -> None:
    """Make `import kvpool` work from a plain checkout (sidecar/ is the source root; the
    directory in $KVPOOL_BENCH_SRC instead when set)."""
    src = source_root()
    # First on the path, for this process and the servers it starts (`python -m kvpool ...`):
    # a kvpool installed elsewhere (another checkout's editable install) must not be what a
    # run from this checkout measures.
    if sys.path[:1] != [src]:
        sys.path.insert(0, src)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != src]
    os.environ["PYTHONPATH"] = os.pathsep.join([src, *paths])


@dataclasses.dataclass(frozen=True)
class TlsMode:
    """One transport-security mode kvpool is measured in (``bench/run.py --kvpool-tls``): how its
    servers start and what its rows are called.  The store and sidecar suites read it here."""

    tag: str
    """What the mode's system names end with (``kvpool_store_<tag>``); "" for plain, whose rows
    keep the names of runs before the modes existed."""
    tls: bool
    """Mutual TLS on gRPC (and, unless ``store_flags`` opts it out, on the data session)."""
    store_flags: tuple[str, ...]
    """Extra flags of every store node."""
    text: str
    """What the mode is, for ratio descriptions."""

    def system(self, base: str) -> str:
        """The system name of ``base``'s rows in this mode."""
        return f"{base}_{self.tag}" if self.tag else base

    def cluster_args(self) -> dict[str, Any]:
        """``LocalCluster`` arguments of this mode (plain is ``tls=False``: LocalCluster's own
        default is TLS)."""
        return {"tls": self.tls, "store_args": list(self.store_flags)}


PLAIN = "plain"
TLS_MODES: dict[str, TlsMode] = {
    PLAIN: TlsMode("", False, (), "no TLS"),
    "tls": TlsMode("tls", True, (), "mutual TLS on gRPC and the data session"),
    "tls-plain-data": TlsMode("tls_plaindata", True, ("--plaintext-data-session",),
                              "TLS on gRPC, the data session opted out (ticket-opened connections)"),
}
"""``--kvpool-tls`` mode name -> the mode."""


@dataclasses.dataclass
class Context:
    """What a system module gets: the plan, the process group and a place for its files."""

    plan: Plan
    procs: Procs
    work_dir: Path
    suite: str
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)
    kvpool_tls: tuple[str, ...] = (PLAIN,)
    """Transport-security modes (:data:`TLS_MODES`) kvpool is measured in, each in every round
    (:func:`per_tls_mode`)."""


def per_tls_mode(ctx: Context, measure_mode: Callable[[str], list[Row]]) -> list[Row]:
    """The rows of ``measure_mode(mode)`` for every mode of ``ctx.kvpool_tls`` in turn: one step
    of a round measures them all, so the modes share that round's machine load and their ratios
    (``bench/run.py`` :func:`mode_ratios`) are taken within a round."""
    rows: list[Row] = []
    for mode in ctx.kvpool_tls:
        rows += measure_mode(mode)
    return rows


def cluster_security(ctx: Context) -> dict[str, Any]:
    """``LocalCluster`` arguments of the run's first transport-security mode: the clusters of
    steps measured in one mode only (bench/integrations.py) run in it."""
    return TLS_MODES[ctx.kvpool_tls[0] if ctx.kvpool_tls else PLAIN].cluster_args()
