"""kvpool through its sidecar and client library, on a `kvpool.LocalCluster` of 4 store nodes
and 2 sidecars (A and B):

- put: `A.put(keys, values)`, fresh keys every repetition, back to back (each meets the
  write-through of the batches before it); put_drained: the same once A's write-through backlog
  has drained (waited for untimed): the put with and without a write-through in flight;
- local_get: what A just put (a local-tier hit) read into caller buffers, once A's
  write-through backlog of those puts has drained (untimed) — `A.get_into` where
  the client has it, else `A.get` with each view copied out: the same work as Mooncake's
  batch_get_into; local_get_zero_copy: `A.get` returning views, not copied (then released);
- remote_get: keys A put, which B's local tier does not hold, so they come from the store
  nodes, read by `B.get_into` into buffers from `B.alloc_buffer` (registered memory: the store
  nodes' bytes land there directly, the local tier is left as it was — what Mooncake's
  batch_get_into into its registered buffers does); A puts one key set (untimed), B.match waits
  until the pool has all of it, and every repetition reads it again from the pool (as
  Mooncake's loop reads the same keys; the note counts the pool and local hits);
- remote_get_promote: into plain caller buffers: the fetch lands in B's arena (promotion into
  its local tier) and is copied out, so each repetition reads a fresh key set A put (untimed);
- remote_get_zero_copy: the same, `B.get` returning views of B's arena, released untimed;
- remote_get_1node: remote_get (1 MiB x 16) on a second LocalCluster of one store node, the
  storage process count of Mooncake's TCP peer (one segment owner);
- match: `B.match(keys)` of 8192 keys spread over the 4 store nodes and not in B's local tier
  (each match's lease released, untimed, where the client returns one).

The put and remote get rows carry `cpu_s_per_gb`: the CPU seconds of every kvpool process (this
client, both sidecars, the store nodes) per GB of their timed batches (`common.CpuMeter`).

Transport security is a mode (`bench/run.py --kvpool-tls plain,tls,tls-plain-data`, every mode
in every round, one cluster each, `common.TLS_MODES`): the first mode measures every row above;
each further mode only what crosses the pool network (:data:`TLS_OPS`: put, put_drained,
remote_get, match), its rows named by the mode (`kvpool_sidecar_tls`,
`kvpool_sidecar_tls_plaindata`; plain keeps `kvpool_sidecar`).

If `kvpool.LocalCluster` / `kvpool.connect` are not there yet, the rows say "not available yet".
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from bench.common import (
    EXISTS_KEYS,
    TLS_MODES,
    Context,
    CpuMeter,
    GiB,
    MiB,
    Row,
    ensure_kvpool_importable,
    keys32,
    pattern,
    per_tls_mode,
    row_from_times,
    size_label,
    touched,
    unavailable,
    with_cpu,
)

SYSTEM = "kvpool_sidecar"
STORES = 4
TLS_OPS: dict[str, tuple[str, ...]] = {"put": ("throughput", "cpu"), "put_drained": ("throughput", "cpu"),
                                       "remote_get": ("throughput", "cpu"), "match": ("time",)}
"""The rows every transport-security mode measures (what crosses the pool network: a local hit
never does), and how ``bench/run.py`` sets each mode's against plain's."""


def import_api() -> Any:
    ensure_kvpool_importable()
    import kvpool
    for name in ("LocalCluster", "connect"):
        if not hasattr(kvpool, name):
            raise ImportError(f"kvpool.{name} missing")
    return kvpool


def measure(ctx: Context) -> list[Row]:
    """Every transport-security mode of ``ctx.kvpool_tls`` (default: plain), one cluster each:
    the first every row, the others the :data:`TLS_OPS` rows."""
    try:
        kvpool = import_api()
    except Exception as e:
        return [unavailable(SYSTEM, f"not available yet ({type(e).__name__}: {e})")]
    first = ctx.kvpool_tls[0] if ctx.kvpool_tls else None
    return per_tls_mode(ctx, lambda mode: measure_mode(ctx, kvpool, mode, full=mode == first))


def measure_mode(ctx: Context, kvpool: Any, mode: str, full: bool = True) -> list[Row]:
    """The rows of one transport-security mode, named by it (``full``: every row, else only
    the :data:`TLS_OPS` rows)."""
    security = TLS_MODES[mode].cluster_args()
    plan = ctx.plan
    local_bytes = (256 * MiB if plan.quick else GiB) + 2 * plan.max_batch_bytes
    store_bytes = 256 * MiB if plan.quick else GiB
    try:
        with _cluster_clients(kvpool, STORES, store_bytes, local_bytes, security) as (a, b, roles):
            rows = _measure(ctx, a, b, roles, full)
        if full:
            rows.append(_remote_get_1node(ctx, kvpool, store_bytes, local_bytes, security))
    except Exception as e:
        rows = [unavailable(SYSTEM, f"{type(e).__name__}: {e}")]
    for row in rows:  # measured under SYSTEM's name; named by the mode here, in one place
        row.system = TLS_MODES[mode].system(SYSTEM)
    return rows


def _remote_get_1node(ctx: Context, kvpool: Any, store_bytes: int, local_bytes: int,
                      security: dict[str, Any]) -> Row:
    """The same remote get from one store node: Mooncake's TCP peer has one segment owner, and
    4 store processes on a small machine share its cores with the sidecar."""
    with _cluster_clients(kvpool, 1, store_bytes, local_bytes, security) as (a, b, roles):
        v, nb = MiB, 16
        src = touched(v * nb, 1)
        pattern(src, nb + 1)
        row = _remote_get(ctx.plan, a, b, [src[j * v:(j + 1) * v].data for j in range(nb)], src,
                          registered(b, v * nb), v, nb, "remote_get_1node", roles)
        row.note += ", 1 store node"
        ctx.log(f"[kvpool_sidecar] 1 MiB x 16 remote get from 1 store node: {row.gbps:.2f} GB/s")
        return row


@contextlib.contextmanager
def _two_clients(kvpool: Any, stores: int, store_bytes: int, local_bytes: int) -> Iterator[tuple[Any, Any]]:
    """Clients of the two sidecars (A, B) of a fresh LocalCluster of ``stores`` store nodes."""
    with _cluster_clients(kvpool, stores, store_bytes, local_bytes) as (a, b, _roles):
        yield a, b


Roles = dict[str, list[int]]
"""Process role ('client', 'sidecar', 'store') → pids: what a :class:`CpuMeter` watches."""


@contextlib.contextmanager
def _cluster_clients(kvpool: Any, stores: int, store_bytes: int, local_bytes: int,
                     security: dict[str, Any] | None = None) -> Iterator[tuple[Any, Any, Roles]]:
    """As :func:`_two_clients`, with the pids of every kvpool process (this one is the client);
    ``security``: the cluster's TLS arguments (:meth:`bench.common.TlsMode.cluster_args`)."""
    with kvpool.LocalCluster(stores=stores, sidecars=2, store_bytes=store_bytes,
                             local_bytes=local_bytes, **(security or {})) as cluster:
        roles = {"client": [os.getpid()], "sidecar": list(cluster.sidecar_pids),
                 "store": list(cluster.store_pids)}
        a = kvpool.connect(cluster.sidecars[0])
        try:
            b = kvpool.connect(cluster.sidecars[1])
            try:
                yield a, b, roles
            finally:
                b.close()
        finally:
            a.close()


def _match(client: Any, keys: list[bytes]) -> tuple[int, int]:
    """(blocks matched, lease id or 0)."""
    if hasattr(client, "match_lease"):
        n, lease = client.match_lease(keys)
        return int(n), int(lease)
    return int(client.match(keys)), 0


def _is_registered(client: Any, buf: np.ndarray) -> bool:
    return hasattr(client, "is_registered") and bool(client.is_registered(buf))


def _release(client: Any, lease: int) -> None:
    if lease and hasattr(client, "release"):
        client.release(lease)


def _release_views(views: Any) -> None:
    rel = getattr(views, "release", None)
    if callable(rel):
        rel()


def _timed_get_views(client: Any, keys: list[bytes], check: Callable[[Any], bool]) -> tuple[float, bool]:
    """The seconds of ``client.get(keys)`` (views) and ``check(views)``; the check and the views'
    release are untimed (the zero-copy rows)."""
    t0 = time.perf_counter()
    views = client.get(keys)
    dt = time.perf_counter() - t0
    try:
        return dt, check(views)
    finally:
        _release_views(views)


def _wait_match(client: Any, keys: list[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        n, lease = _match(client, keys)
        _release(client, lease)
        if n == len(keys):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"pool holds {n} of {len(keys)} keys after {timeout:.0f}s")
        time.sleep(0.002)


def wait_written_through(client: Any, timeout: float = 60.0) -> bool:
    """Wait until the sidecar's write-through backlog is empty (False if it cannot tell)."""
    if not hasattr(client, "stats"):
        return False
    deadline = time.monotonic() + timeout
    while client.stats().pending_pool_bytes > 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def registered(client: Any, nbytes: int) -> np.ndarray:
    """Caller buffers the sidecar lands reads in directly (``alloc_buffer``), pages written once."""
    buf = client.alloc_buffer(nbytes)
    buf.fill(0)
    return np.asarray(buf)


def _read_into(client: Any, keys: list[bytes], outs: list[np.ndarray]) -> int:
    """Read keys into caller buffers; returns the number of items that failed."""
    if hasattr(client, "get_into"):
        res = client.get_into(keys, [o.data for o in outs])
        return sum(1 for r, o in zip(res, outs, strict=True) if r != o.nbytes)
    views = client.get(keys)
    try:
        for view, out in zip(views, outs, strict=True):
            np.copyto(out, np.frombuffer(view, dtype=np.uint8))
    finally:
        _release_views(views)
    return 0


def _counter(client: Any, name: str) -> int:
    """A sidecar counter by its name (0 when the client has no stats or the sidecar no such
    counter: an older kvpool measured through $KVPOOL_BENCH_SRC)."""
    if not hasattr(client, "stats"):
        return 0
    return int(dict(client.stats().counters).get(name, 0))


def _pool_hits(client: Any) -> tuple[int, int]:
    """(pool hits, local hits) the sidecar has counted for its reads so far ((0, 0): unknown)."""
    from kvpool.wire.counters import SidecarCounter

    if not hasattr(client, "stats"):
        return 0, 0
    c = dict(client.stats().counters)
    return int(c.get(SidecarCounter.READ_HITS_POOL, 0)), int(c.get(SidecarCounter.READ_HITS_LOCAL, 0))


def _remote_get(plan: Any, a: Any, b: Any, vals: list[Any], src: np.ndarray, dst: np.ndarray,
                v: int, nb: int, op: str, roles: Roles | None = None) -> Row:
    """remote_get: keys A put, read by B from the pool into caller buffers.

    Into registered buffers the read leaves B's local tier as it was, so every repetition reads
    the same key set from the store nodes, as Mooncake's get loop reads the same keys (A puts
    it once, untimed, and B.match waits until the pool has all of it).  Into plain buffers a
    read promotes what it fetched into B's local tier, so each repetition needs a fresh key set
    (put and waited for, untimed).  The note says how many reads the pool served."""
    outs = [dst[j * v:(j + 1) * v] for j in range(nb)]
    same_keys = _is_registered(b, dst)
    read_how = "get_into registered buffers" if same_keys else "get_into"
    times: list[float] = []
    failures = 0
    dst[:v * nb].fill(0)
    pool0, local0 = _pool_hits(b)
    rkeys: list[bytes] = []
    meter = CpuMeter(roles) if roles else None
    for i in range(plan.warmup + plan.reps(v, nb)):
        if not same_keys or i == 0:
            rkeys = keys32(f"sc-{op}-{v}-{nb}-{i}", nb)
            a.put(rkeys, vals)
            _wait_match(b, rkeys)
        if meter and i >= plan.warmup:
            meter.start()
        t0 = time.perf_counter()
        failures += _read_into(b, rkeys, outs)
        dt = time.perf_counter() - t0
        if i >= plan.warmup:
            times.append(dt)
            if meter:
                meter.stop()
    pool1, local1 = _pool_hits(b)
    note = (f"B.{read_how} from the pool ({'the same' if same_keys else 'a fresh'} key set each rep; "
            f"pool hits {pool1 - pool0}, local hits {local1 - local0})"
            + (f"; {failures} item failures" if failures else ""))
    if not np.array_equal(dst[:v * nb], src[:v * nb]):
        note += "; VERIFY FAILED"
    return with_cpu(row_from_times(SYSTEM, op, v, nb, times, note=note), meter, v * nb * len(times))


def _remote_zero_copy(plan: Any, a: Any, b: Any, vals: list[Any], v: int, nb: int) -> Row:
    """remote_get_zero_copy: as remote_get, but `B.get` returning views of B's arena (where the
    fetch landed), released untimed: what an engine that reads the views in place pays."""
    times: list[float] = []
    bad = 0
    for i in range(plan.warmup + plan.reps(v, nb)):
        rkeys = keys32(f"sc-remote-views-{v}-{nb}-{i}", nb)
        a.put(rkeys, vals)
        _wait_match(b, rkeys)
        dt, ok = _timed_get_views(b, rkeys, lambda views: len(views) == nb and all(
            bytes(x[:64]) == bytes(val[:64]) and len(x) == v for x, val in zip(views, vals, strict=True)))
        bad += 0 if ok else 1
        if i >= plan.warmup:
            times.append(dt)
    return row_from_times(SYSTEM, "remote_get_zero_copy", v, nb, times,
                          note="B.get from the pool (views, released untimed)"
                          + (f"; {bad} WRONG VIEWS" if bad else ""))


def _put_rows(plan: Any, a: Any, vals: list[Any], v: int, nb: int, roles: Roles) -> tuple[list[Row], list[bytes]]:
    """put: ``A.put`` back to back, each batch meeting the write-through of the ones before (A
    writes them to the store nodes in the background, on the same cores); put_drained: each
    batch after A's write-through backlog has drained (waited for untimed), alone on the cores.
    The CPU counted: the back-to-back put's over its timed calls (the write-through they met
    included); the drained put's until its own write-through has drained (what one put costs
    all processes).  Returns the rows and the keys of the last batch."""
    rows: list[Row] = []
    keys: list[bytes] = []
    for op in ("put", "put_drained"):
        times: list[float] = []
        meter = CpuMeter(roles)
        drained = True
        held0, shed0 = _counter(a, "pool_writes_held_back"), _counter(a, "pool_writes_shed")
        for i in range(plan.warmup + plan.reps(v, nb)):
            keys = keys32(f"sc-{op}-{v}-{nb}-{i}", nb)
            if op == "put_drained":
                drained = wait_written_through(a) and drained
            timed = i >= plan.warmup
            # Back to back: one window over all the timed puts (reading /proc between them, a
            # few ms, would leave gaps in which the write-through runs alone).
            if timed and (op == "put_drained" or i == plan.warmup):
                meter.start()
            t0 = time.perf_counter()
            a.put(keys, vals)
            dt = time.perf_counter() - t0
            if timed:
                if op == "put_drained":
                    drained = wait_written_through(a) and drained
                    meter.stop()
                times.append(dt)
        if op == "put":
            meter.stop()
        note = "A.put, back to back (the write-through of the batches before in flight)" if op == "put" else \
            "A.put after the write-through backlog drained (cpu: until its own drained)" + (
                "" if drained else " (could not tell: not waited)")
        note += (f"; write-through batches held back {_counter(a, 'pool_writes_held_back') - held0}, "
                 f"blocks shed {_counter(a, 'pool_writes_shed') - shed0}")
        rows.append(with_cpu(row_from_times(SYSTEM, op, v, nb, times, note=note), meter, v * nb * len(times)))
    return rows, keys


def _measure(ctx: Context, a: Any, b: Any, roles: Roles, full: bool = True) -> list[Row]:
    """Every row of the suite but remote_get_1node (``full``), or only the :data:`TLS_OPS` rows."""
    plan = ctx.plan
    rows: list[Row] = []
    src = touched(plan.max_batch_bytes, 1)
    dst = touched(plan.max_batch_bytes, 0)
    reg_b = registered(b, plan.max_batch_bytes)
    for v, nb in plan.cells():
        pattern(src[:v * nb], nb + v // MiB)
        vals = [src[j * v:(j + 1) * v].data for j in range(nb)]

        put_rows, keys = _put_rows(plan, a, vals, v, nb, roles)
        cell = {r.op: r for r in put_rows}
        # A.put returns once the objects are in A's local tier; their write-through to the
        # store nodes goes on in the background.  Wait (untimed) for that backlog, so that it
        # does not run into the local_get timings below (Mooncake's put pays it inside put).
        drained = wait_written_through(a)
        if full:
            cell["local_get"] = _local_get(plan, a, keys, src, dst, v, nb, drained)
            cell["local_get_zero_copy"] = _local_zero_copy(plan, a, keys, v, nb)
        cell["remote_get"] = _remote_get(plan, a, b, vals, src, reg_b, v, nb, "remote_get", roles)
        if full:
            cell["remote_get_promote"] = _remote_get(plan, a, b, vals, src, dst, v, nb,
                                                     "remote_get_promote", roles)
            cell["remote_get_zero_copy"] = _remote_zero_copy(plan, a, b, vals, v, nb)
        rows += cell.values()
        ctx.log(f"[kvpool_sidecar] {size_label(v)} x {nb}: " + ", ".join(
            f"{op} {r.gbps:.2f}" + (f" ({r.cpu_s_per_gb} CPU s/GB)" if r.cpu_s_per_gb else "")
            for op, r in cell.items() if r.gbps is not None) + " GB/s")

    rows.append(_match_row(plan, a, b, src))
    return rows


def _local_zero_copy(plan: Any, a: Any, keys: list[bytes], v: int, nb: int) -> Row:
    """local_get_zero_copy: ``A.get`` of what A just put, returning views (released untimed)."""
    times: list[float] = []
    bad = 0
    for i in range(plan.warmup + plan.reps(v, nb)):
        dt, ok = _timed_get_views(a, keys, lambda views: len(views) == nb and all(len(x) == v for x in views))
        bad += 0 if ok else 1
        if i >= plan.warmup:
            times.append(dt)
    return row_from_times(SYSTEM, "local_get_zero_copy", v, nb, times,
                          note="A.get (views, released untimed)" + (f"; {bad} WRONG SIZES" if bad else ""))


def _local_get(plan: Any, a: Any, keys: list[bytes], src: np.ndarray, dst: np.ndarray, v: int, nb: int,
               drained: bool) -> Row:
    """local_get: what A just put (a local-tier hit) read into caller buffers ``dst``."""
    outs = [dst[j * v:(j + 1) * v] for j in range(nb)]
    read_how = "get_into" if hasattr(a, "get_into") else "get + copy into caller buffers"
    dst[:v * nb].fill(0)
    times = []
    failures = 0
    for i in range(plan.warmup + plan.reps(v, nb)):
        t0 = time.perf_counter()
        failures += _read_into(a, keys, outs)
        dt = time.perf_counter() - t0
        if i >= plan.warmup:
            times.append(dt)
    note = f"A.{read_how}" + ("" if drained else "; write-through backlog not drained") + (
        f"; {failures} item failures" if failures else "")
    if not np.array_equal(dst[:v * nb], src[:v * nb]):
        note += "; VERIFY FAILED"
    return row_from_times(SYSTEM, "local_get", v, nb, times, note=note)


def _match_row(plan: Any, a: Any, b: Any, src: np.ndarray) -> Row:
    """match: B.match of 8192 keys A put (4 KiB each), none in B's local tier."""
    keys = keys32("sc-match", EXISTS_KEYS)
    ev, eb = 4096, 512
    small = [src[j * ev:(j + 1) * ev].data for j in range(eb)]
    for i in range(0, EXISTS_KEYS, eb):
        a.put(keys[i:i + eb], small)
    _wait_match(b, keys, timeout=60)
    times = []
    n = 0
    for i in range(plan.warmup + plan.exists_reps):
        t0 = time.perf_counter()
        n, lease = _match(b, keys)
        dt = time.perf_counter() - t0
        _release(b, lease)  # untimed
        if i >= plan.warmup:
            times.append(dt)
    note = f"B.match, {STORES} store nodes" + ("" if n == EXISTS_KEYS else f"; WRONG {n}")
    return row_from_times(SYSTEM, "match", None, EXISTS_KEYS, times, note=note, with_bytes=False)


HOT_PATHS = ("match", "local_get", "remote_get")
"""The rows whose cost issue 19 bounds (bench/compare.py): match of 8192 keys, local get and
remote get (into registered buffers) of 1 MiB x 16."""


def hot_path_rows(ctx: Context) -> list[Row]:
    """Only the :data:`HOT_PATHS` rows (1 MiB x 16; match of 8192 keys), each measured as
    :func:`measure` does, on one fresh cluster."""
    kvpool = import_api()
    plan = ctx.plan
    v, nb = MiB, 16
    with _two_clients(kvpool, STORES, 256 * MiB, 256 * MiB + 2 * v * nb) as (a, b):
        src = touched(v * nb, 1)
        pattern(src, nb + 1)
        dst = touched(v * nb, 0)
        vals = [src[j * v:(j + 1) * v].data for j in range(nb)]
        keys = keys32(f"sc-hot-{v}-{nb}", nb)
        a.put(keys, vals)
        drained = wait_written_through(a)
        return [_match_row(plan, a, b, src), _local_get(plan, a, keys, src, dst, v, nb, drained),
                _remote_get(plan, a, b, vals, src, registered(b, v * nb), v, nb, "remote_get")]
