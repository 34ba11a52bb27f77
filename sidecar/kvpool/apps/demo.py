"""`kvpool demo`: replay a multi-turn chat workload on embedded local pools (ISSUE 3 §4, DESIGN §1).

The workload: ``sessions`` chat sessions (300 by default) over 3 system prompts of 512 tokens,
2–6 turns per session; each turn appends 128 user tokens (the prompt is the whole history so
far) and then 256 answer tokens.  Turns of different sessions are interleaved uniformly at
random (every session is open from the start, its turns keep their order), and 4 engine
instances serve them.  Everything is drawn from fixed seeds (``numpy.random.default_rng``).

Each instance is one sidecar of a :class:`~kvpool.LocalCluster`; per turn the "engine" computes
the keys of the whole history (16-token blocks), makes one ``match``, one ``get`` of the blocks
it will use (verified byte-exact against values derived from the keys) and one ``put`` of the
rest: the prompt blocks it did not match and the answer's full blocks — the KV of the prompt and
the generated tokens, which is what a real engine holds after the turn.  Recomputed prefill =
prompt tokens − hit tokens, the hit from :func:`kvpool.plan_hit` (no window state: at least
one token is always computed).  A read answers per block (``get_many``): a block a store node
did not deliver in time (UNAVAILABLE: the sidecar's deadline shed it, on a loaded machine) is a
*shed read*, counted by reason and recomputed like a miss; any other block missing from a
matched prefix (NOT_FOUND, CHECKSUM, ...) is a failed read and fails the run.

Eight cells: routing {random, session-sticky} × {with the shared pool, without} × local capacity
{8000, 2000 blocks} (scaled by sessions/300 when the workload is smaller, so the cache pressure
stays the same).  The floor is what the workload itself adds each turn — the new user tokens,
plus each system prompt once — computed by replaying the turns against one unbounded cache.

Cells that differ only in routing share a cluster (each routing in its own key space, local
tiers emptied in between); ``--jobs`` clusters run at a time.  The replay runs turns back to
back where users would think for seconds, so a turn whose session's previous turn ended moments
ago on another instance first lets that instance's write-through reach the pool (see
:func:`replay`).  Usage: ``kvpool demo [--quick | --sessions N] [--cells SUBSET] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from kvpool.core.errors import Code, DeadlineExceeded, Suspect, code_name
from kvpool.core.keys import KeySpace
from kvpool.core.planning import plan_hit
from kvpool.wire.counters import SidecarCounter

BLOCK_TOKENS = 16
SYSTEM_PROMPTS = 3
SYSTEM_TOKENS = 512
USER_TOKENS = 128
ANSWER_TOKENS = 256
MIN_TURNS, MAX_TURNS = 2, 6
INSTANCES = 4
VOCAB = 32000
VALUE_BYTES = 4096
FULL_SESSIONS = 300
QUICK_SESSIONS = 60
CAPACITIES = (8000, 2000)  # local capacity in blocks at FULL_SESSIONS
ROUTINGS = ("random", "sticky")
SEED = 20240611
THINK_SECONDS = 0.5  # the least time between a session's answer and its next turn (see replay)
SHED_CODES = frozenset({Code.UNAVAILABLE})
"""Per-block codes of a read that a slow or suspect store node causes, not a lost block: the
sidecar gave up on the node at its deadline ("a slow part becomes misses, never a hang")."""
SHED_ERRORS = (DeadlineExceeded, Suspect)
"""What a client call raises when its sidecar was too slow: it missed the call's bound
(``ClientDeadlines``), or missed an earlier one and has not answered a probe since.  A match,
read or put that raises one is shed (nothing matched, read or stored), not a failure."""


# -- the workload -------------------------------------------------------------------------------


@dataclass
class Workload:
    """The chat sessions and the interleaved order of their turns (identical for every cell)."""

    sessions: int
    seed: int
    system: list[npt.NDArray[np.int64]]
    """The system prompts' tokens."""
    system_of: npt.NDArray[np.int64]
    """Which system prompt each session uses."""
    turns_of: npt.NDArray[np.int64]
    bodies: list[npt.NDArray[np.int64]]
    """Per session: every user and answer token after the system prompt, turn after turn."""
    order: list[tuple[int, int]]
    """(session, turn index) in the order the turns arrive."""

    @staticmethod
    def prompt_tokens(turn: int) -> int:
        """Prompt of turn ``turn`` (0-based): system + earlier turns + this turn's user tokens."""
        return SYSTEM_TOKENS + turn * (USER_TOKENS + ANSWER_TOKENS) + USER_TOKENS

    @staticmethod
    def after_blocks(turn: int) -> int:
        """Full blocks of the history after the answer of ``turn``: what the engine holds KV for."""
        return (SYSTEM_TOKENS + (turn + 1) * (USER_TOKENS + ANSWER_TOKENS)) // BLOCK_TOKENS

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens(k) for _, k in self.order)

    def keys(self, model: str = "kvpool-demo/chat-8b") -> list[list[bytes]]:
        """Per session: the block keys of its full final history in the key space of ``model``.

        The chain continues from the system prompt's last key: the same keys as hashing the
        whole history, without rehashing the shared 512 tokens per session.
        """
        space = KeySpace(model, block_tokens=BLOCK_TOKENS)
        sys_keys = [space.block_keys(t) for t in self.system]
        out = []
        for s in range(self.sessions):
            head = sys_keys[int(self.system_of[s])]
            out.append(head + space.block_keys(self.bodies[s], start_key=head[-1]))
        return out


def build_workload(sessions: int, seed: int = SEED) -> Workload:
    rng = np.random.default_rng(seed)
    system = [rng.integers(0, VOCAB, SYSTEM_TOKENS, dtype=np.int64) for _ in range(SYSTEM_PROMPTS)]
    system_of = rng.integers(0, SYSTEM_PROMPTS, sessions)
    turns_of = rng.integers(MIN_TURNS, MAX_TURNS + 1, sessions)
    bodies = [rng.integers(0, VOCAB, int(turns_of[s]) * (USER_TOKENS + ANSWER_TOKENS), dtype=np.int64)
              for s in range(sessions)]
    # A uniformly random interleaving of all sessions' turns that keeps each session's order.
    sess = np.repeat(np.arange(sessions), turns_of)
    rng.shuffle(sess)
    nxt = [0] * sessions
    order = []
    for s in sess.tolist():
        order.append((s, nxt[s]))
        nxt[s] += 1
    return Workload(sessions, seed, system, system_of, turns_of, bodies, order)


def unique_blocks(keys: list[list[bytes]]) -> int:
    seen: set[bytes] = set()
    for ks in keys:
        seen.update(ks)
    return len(seen)


def floor_tokens(wl: Workload, session_keys: list[list[bytes]]) -> list[int]:
    """Per turn, the prefill tokens recomputed with one unbounded cache shared by everyone: what
    each turn adds (its new user tokens, and the system prompt the first time it is seen)."""
    held: set[bytes] = set()
    out = []
    for s, k in wl.order:
        keys = session_keys[s]
        L = wl.prompt_tokens(k)
        nb = L // BLOCK_TOKENS
        n = 0
        while n < nb and keys[n] in held:
            n += 1
        out.append(plan_hit(L, n * BLOCK_TOKENS, block_tokens=BLOCK_TOKENS, window_tokens=0,
                            rollback_tokens=0).compute_tokens)
        held.update(keys[:wl.after_blocks(k)])
    return out


# -- block values ---------------------------------------------------------------------------------


class Values:
    """Values derived from the keys: the key tiled to ``size`` bytes, XOR a position pattern (so a
    block read at a shifted offset or from another key never compares equal)."""

    def __init__(self, size: int = VALUE_BYTES) -> None:
        if size < 32 or size % 32:
            raise ValueError("value size must be a positive multiple of 32 bytes")
        self.size = size
        self.pattern = (np.arange(size, dtype=np.uint32) * 2654435761 >> 24).astype(np.uint8)

    def batch(self, keys: Sequence[bytes]) -> npt.NDArray[np.uint8]:
        """(len(keys), size) array: row i is the value of keys[i]."""
        k = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 32)
        out: npt.NDArray[np.uint8] = np.tile(k, (1, self.size // 32)) ^ self.pattern
        return out


# -- one cell ---------------------------------------------------------------------------------


@dataclass
class Cell:
    routing: str
    pool: bool
    local_blocks: int

    @property
    def name(self) -> str:
        return f"{self.routing}/{'pool' if self.pool else 'no-pool'}/{self.local_blocks}"


@dataclass
class CellResult:
    name: str
    routing: str
    pool: bool
    local_blocks: int
    turns: int = 0
    prompt_tokens: int = 0
    recomputed_tokens: int = 0
    recompute_share: float = 0.0
    local_read_bytes: int = 0
    pool_read_bytes: int = 0
    local_write_bytes: int = 0
    pool_write_bytes: int = 0
    pool_writes_shed: int = 0
    turns_above_floor: int = 0
    think_waits: int = 0
    think_wait_seconds: float = 0.0
    verified_blocks: int = 0
    checked_blocks: int = 0
    mismatches: int = 0
    get_failures: int = 0
    """Reads of a matched prefix that missed a block for a reason other than :data:`SHED_CODES`."""
    shed_reads: int = 0
    """Reads of a matched prefix that missed blocks only for :data:`SHED_CODES` reasons."""
    shed_blocks: dict[str, int] = field(default_factory=dict)
    """Blocks of those reads not delivered, by reason: the code name (:data:`SHED_CODES`), or the
    exception of a whole read shed (:data:`SHED_ERRORS`)."""
    shed_calls: dict[str, int] = field(default_factory=dict)
    """Matches and puts shed (:data:`SHED_ERRORS`), by ``"<call>: <exception>"``."""
    put_failures: int = 0
    wall_seconds: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)


def classify_read(codes: Sequence[int]) -> tuple[int, dict[str, int], int]:
    """A matched prefix's per-block read codes: (blocks read from the start, blocks shed by code
    name — :data:`SHED_CODES` —, blocks missing for any other reason: failures)."""
    prefix = next((i for i, c in enumerate(codes) if c != Code.OK), len(codes))
    shed: dict[str, int] = {}
    failed = 0
    for c in codes:
        if c in SHED_CODES:
            name = code_name(c)
            shed[name] = shed.get(name, 0) + 1
        elif c != Code.OK:
            failed += 1
    return prefix, shed, failed


def _count(into: dict[str, int], what: str, k: int = 1) -> None:
    into[what] = into.get(what, 0) + k


def _sum_counters(clients: Sequence[Any]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for c in clients:
        for key, v in c.stats().counters.items():
            totals[key] = totals.get(key, 0) + int(v)
    return totals


def _wait_pool_writes(clients: Sequence[Any], seconds: float = 30.0) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and any(c.stats().pending_pool_bytes for c in clients):
        time.sleep(0.02)


def replay(wl: Workload, session_keys: list[list[bytes]], cell: Cell, clients: Sequence[Any],
           routes: npt.NDArray[np.int64], values: Values, floor: Sequence[int], verify_every: int = 4,
           think_seconds: float = THINK_SECONDS, progress: Callable[[int, int], None] | None = None,
           gate: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext) -> CellResult:
    """One cell on running sidecars (one client per engine instance): every turn of the workload.

    ``floor`` is each turn's floor (:func:`floor_tokens`); turns recomputing more are counted.
    A read that misses blocks of its matched prefix (:func:`classify_read`) loads the blocks
    before the first missing one and recomputes the rest, as an engine does; the miss is a shed
    read or a failure.
    Think time: in life a user reads the answer for seconds before the next turn, while the
    replay runs turns back to back; so when a session's previous turn ended less than
    ``think_seconds`` ago on another instance, the turn first waits (a bounded poll) for that
    instance's write-through backlog to reach the pool, as it would have by then.
    """
    res = CellResult(cell.name, cell.routing, cell.pool, cell.local_blocks)
    with gate():
        before = _sum_counters(clients)
    t0 = time.perf_counter()
    head = values.pattern[:32].tobytes()
    head_int = int.from_bytes(head, "little")
    n_turns = len(wl.order)
    last_turn: dict[int, tuple[float, int]] = {}  # session → (end of its previous turn, instance)
    for t, (s, k) in enumerate(wl.order):
        with gate():
            inst = int(routes[t]) if cell.routing == "random" else s % len(clients)
            c = clients[inst]
            prev = last_turn.get(s)
            if cell.pool and prev is not None and prev[1] != inst and time.perf_counter() - prev[0] < think_seconds:
                res.think_waits += 1
                tw = time.perf_counter()
                deadline = prev[0] + think_seconds
                while clients[prev[1]].stats().pending_pool_bytes and time.perf_counter() < deadline:
                    time.sleep(0.002)
                res.think_wait_seconds += time.perf_counter() - tw
            keys = session_keys[s]
            L = wl.prompt_tokens(k)
            prompt_keys = keys[:L // BLOCK_TOKENS]
            try:
                n, lease = c.match_lease(prompt_keys)
            except SHED_ERRORS as exc:
                _count(res.shed_calls, f"match: {type(exc).__name__}")
                n, lease = 0, 0
            plan = plan_hit(L, n * BLOCK_TOKENS, block_tokens=BLOCK_TOKENS, window_tokens=0, rollback_tokens=0)
            hit = plan.hit_blocks
            got = None
            if hit:
                try:
                    got = c.get_many(prompt_keys[:hit], lease_id=lease)
                except SHED_ERRORS as exc:
                    res.shed_reads += 1
                    _count(res.shed_blocks, type(exc).__name__, hit)
                    plan = plan_hit(L, 0, block_tokens=BLOCK_TOKENS, window_tokens=0, rollback_tokens=0)
                    n = 0
            if got is not None:
                try:
                    read, shed, failed = classify_read(got.codes)
                    if failed:
                        res.get_failures += 1
                    elif shed:
                        res.shed_reads += 1
                    for name, k in shed.items():
                        _count(res.shed_blocks, name, k)
                    if read < hit:  # load what was read, recompute from the first missing block
                        plan = plan_hit(L, read * BLOCK_TOKENS, block_tokens=BLOCK_TOKENS, window_tokens=0,
                                        rollback_tokens=0)
                        n = read
                    blocks = [v for v in got.views[:read] if v is not None]
                    used = prompt_keys[:read]
                    if t % verify_every == 0:
                        # Byte-exact, every block read.
                        got_bytes = b"".join(blocks)
                        want = values.batch(used)
                        if got_bytes != want.tobytes():
                            g = np.frombuffer(got_bytes, dtype=np.uint8)
                            if g.size != want.size:
                                res.mismatches += read
                            else:
                                res.mismatches += int(np.any(g.reshape(want.shape) != want, axis=1).sum())
                        res.verified_blocks += read
                    else:
                        # Cheap: size and the first 32 bytes of every block.
                        for key, v in zip(used, blocks, strict=True):
                            if len(v) != values.size or (int.from_bytes(v[:32], "little") ^ head_int) != \
                                    int.from_bytes(key, "little"):
                                res.mismatches += 1
                        res.checked_blocks += read
                finally:
                    got.release()
            elif lease:  # no read took the match's pins (none wanted, or it was shed)
                c.release(lease)
            res.turns += 1
            res.prompt_tokens += L
            res.recomputed_tokens += plan.compute_tokens
            if plan.compute_tokens > floor[t]:
                res.turns_above_floor += 1
            # The engine now holds KV for prompt + answer: store every full block it did not match.
            rest = keys[n:wl.after_blocks(k)]
            if rest:
                try:
                    codes = c.put(rest, list(values.batch(rest)))
                except SHED_ERRORS as exc:
                    _count(res.shed_calls, f"put: {type(exc).__name__}")
                else:
                    res.put_failures += sum(1 for x in codes if x not in (0, 5))  # OK, ALREADY_EXISTS
            last_turn[s] = (time.perf_counter(), inst)
            if progress is not None:
                progress(t + 1, n_turns)
    with gate():
        if cell.pool:
            _wait_pool_writes(clients)  # so that the pool-write counters are final
        res.wall_seconds = time.perf_counter() - t0
        after = _sum_counters(clients)
    d = {key: after.get(key, 0) - before.get(key, 0) for key in sorted(after)}
    res.counters = {key: v for key, v in d.items() if v}
    res.recompute_share = res.recomputed_tokens / res.prompt_tokens if res.prompt_tokens else 0.0
    res.local_read_bytes = d.get(SidecarCounter.HIT_BLOCKS_LOCAL, 0) * values.size
    res.pool_read_bytes = d.get(SidecarCounter.HIT_BLOCKS_POOL, 0) * values.size
    res.local_write_bytes = d.get(SidecarCounter.PUT_BLOCKS, 0) * values.size
    res.pool_write_bytes = d.get(SidecarCounter.POOL_WRITES, 0) * values.size
    res.pool_writes_shed = d.get(SidecarCounter.POOL_WRITES_SHED, 0)
    return res


def clear_local(clients: Sequence[Any], session_keys: list[list[bytes]]) -> int:
    """Remove a finished cell's blocks from every local tier; objects left over (should be 0)."""
    every = sorted({key for ks in session_keys for key in ks})
    for c in clients:
        for i in range(0, len(every), 8192):
            c.remove(every[i:i + 8192])
    return sum(int(c.stats().local_objects) for c in clients)


# -- the whole demo ---------------------------------------------------------------------------------


def all_cells(capacities: Sequence[int]) -> list[Cell]:
    return [Cell(r, p, cap) for r in ROUTINGS for p in (False, True) for cap in capacities]


def select_cells(cells: list[Cell], spec: str | None) -> list[Cell]:
    """``spec``: comma-separated patterns, each '/'-separated parts that must all match a cell's
    name parts (``random``, ``sticky/no-pool``, ``pool/2000``, ``random/pool/8000``)."""
    if not spec:
        return cells
    out = []
    pats = [p.strip() for p in spec.split(",") if p.strip()]
    for c in cells:
        parts = c.name.split("/")
        if any(all(q in parts for q in pat.split("/")) for pat in pats):
            out.append(c)
    if not out:
        raise ValueError(f"--cells {spec!r} selects none of: {', '.join(c.name for c in cells)}")
    return out


_grpc_fork_support_off = False


class _ForkGate:
    """Keeps process start-ups (fork + exec) apart from gRPC calls in flight in other threads.

    gRPC's fork handlers are skipped when a fork happens while other threads are inside gRPC
    calls, and the forked child can then abort before its exec (epoll_wait EBADF,
    grpc/grpc#43055): with several clusters at a time, a cluster starts only between turns.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._cond = threading.Condition()
        self._calls = 0
        self._forking = False

    @staticmethod
    def needed() -> bool:
        """Whether gRPC's fork handlers may be on (known off only when :func:`main` turned them
        off before gRPC was loaded)."""
        return not _grpc_fork_support_off

    @contextlib.contextmanager
    def calls(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        with self._cond:
            self._cond.wait_for(lambda: not self._forking)
            self._calls += 1
        try:
            yield
        finally:
            with self._cond:
                self._calls -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def forking(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        with self._cond:
            self._cond.wait_for(lambda: not self._forking)
            self._forking = True  # new calls wait from now on
            self._cond.wait_for(lambda: not self._calls)
        try:
            yield
        finally:
            with self._cond:
                self._forking = False
                self._cond.notify_all()


class _Stopped(Exception):
    """Another job failed or the user interrupted: stop this cell (its cluster is torn down)."""


class _Progress:
    """One status line on stderr (``\\r``-updated) for the cells running now, a line per finished cell."""

    def __init__(self, stream: TextIO | None, n_cells: int) -> None:
        self.stream = stream
        self.n_cells = n_cells
        self.done = 0
        self.active: dict[str, str] = {}
        self.lock = threading.Lock()
        self.last = 0.0
        self.width = 0

    def _draw(self) -> None:
        assert self.stream is not None
        line = f"[{self.done}/{self.n_cells} done] " + " | ".join(self.active.values())
        self.stream.write("\r" + line.ljust(self.width))
        self.width = len(line)
        self.stream.flush()

    def update(self, key: str, text: str, force: bool = False) -> None:
        if self.stream is None:
            return
        with self.lock:
            self.active[key] = text
            now = time.perf_counter()
            if force or now - self.last >= 0.25:
                self.last = now
                self._draw()

    def finish(self, key: str, text: str) -> None:
        if self.stream is None:
            return
        with self.lock:
            self.done += 1
            self.active.pop(key, None)
            self.stream.write("\r" + text.ljust(self.width) + "\n")
            self.width = 0
            if self.active:
                self._draw()
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def run_demo(sessions: int = FULL_SESSIONS, cells: str | None = None, seed: int = SEED,
             capacities: Sequence[int] | None = None, value_bytes: int = VALUE_BYTES, stores: int = 2,
             verify_every: int = 4, jobs: int = 2, progress: TextIO | None = sys.stderr) -> dict[str, Any]:
    """Run the selected cells; returns the results (what ``--json`` writes).

    The cells that differ only in routing share one LocalCluster (same pool setting and local
    capacity), one after the other: each routing has its own key space (its own model name),
    and a finished cell's blocks are removed from every local tier before the next starts, so
    every cell begins with empty local tiers and nothing of its own in the pool.  ``jobs``
    clusters run at the same time (each cell is still one sequential replay, so its recompute
    share does not depend on it; its wall time does).
    """
    from kvpool.apps.cluster import LocalCluster

    t_start = time.perf_counter()
    if capacities is None:
        capacities = [max(1, round(c * sessions / FULL_SESSIONS)) for c in CAPACITIES]
    if verify_every < 1:
        raise ValueError("verify_every must be at least 1")
    if jobs < 1:
        raise ValueError("jobs must be at least 1")
    chosen = select_cells(all_cells(capacities), cells)
    wl = build_workload(sessions, seed)
    keyspaces = {r: wl.keys(f"kvpool-demo/chat-8b/{r}") for r in sorted({c.routing for c in chosen})}
    floor_per_turn = floor_tokens(wl, next(iter(keyspaces.values())))
    floor = sum(floor_per_turn)
    n_unique = unique_blocks(next(iter(keyspaces.values())))
    total = wl.total_prompt_tokens
    values = Values(value_bytes)
    routes = np.random.default_rng([seed, 1]).integers(0, INSTANCES, len(wl.order))
    groups: dict[tuple[bool, int], list[Cell]] = {}
    for cell in chosen:
        groups.setdefault((cell.pool, cell.local_blocks), []).append(cell)
    # The heaviest (with the pool, then the smallest local tiers) first, so parallel jobs balance.
    order = sorted(groups, key=lambda g: (not g[0], g[1]))
    results: dict[str, CellResult] = {}
    startup: list[float] = []
    leftovers: list[int] = []
    stop = threading.Event()
    # One job at a time needs no gate: nothing else is in gRPC while its cluster starts.
    gate = _ForkGate(enabled=jobs > 1 and _ForkGate.needed())
    prog = _Progress(progress, len(chosen))

    def run_group(pool: bool, cap: int) -> None:
        group = groups[(pool, cap)]
        key = f"{pool}/{cap}"
        # Enough for the whole working set of every cell run in it, with room to spare.
        store_bytes = int(n_unique * values.size * len(group) * 1.25 / max(stores, 1)) + (16 << 20)
        prog.update(key, f"{group[0].name}: starting {stores if pool else 0} stores + {INSTANCES} sidecars",
                    force=True)
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            with gate.forking():
                lc = stack.enter_context(LocalCluster(
                    stores=stores if pool else 0, sidecars=INSTANCES, store_bytes=store_bytes,
                    local_bytes=cap * values.size, block_tokens=BLOCK_TOKENS))
            with gate.calls():
                clients = [lc.connect(i) for i in range(INSTANCES)]
            startup.append(time.perf_counter() - t0)
            try:
                for j, cell in enumerate(group):
                    t_cell = time.perf_counter()

                    def show(done: int, n: int, cell: Cell = cell, t_cell: float = t_cell) -> None:
                        if stop.is_set():
                            raise _Stopped
                        prog.update(key, f"{cell.name} {100 * done / n:5.1f}% {time.perf_counter() - t_cell:5.1f}s")

                    r = replay(wl, keyspaces[cell.routing], cell, clients, routes, values, floor_per_turn,
                               verify_every, progress=show, gate=gate.calls)
                    results[cell.name] = r
                    prog.finish(key, f"  {cell.name:<22} {100 * r.recompute_share:5.1f}% recomputed, "
                                     f"{r.wall_seconds:5.1f} s")
                    if j + 1 < len(group):
                        with gate.calls():
                            leftovers.append(clear_local(clients, keyspaces[cell.routing]))
            finally:
                for c in clients:
                    c.close()

    try:
        with futures.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="demo-cell") as ex:
            pending = [ex.submit(run_group, *g) for g in order]
            try:
                for f in futures.as_completed(pending):
                    exc = f.exception()
                    if exc is not None:
                        stop.set()
                        raise exc
            except BaseException:
                stop.set()  # the other jobs stop at their next turn; their clusters are torn down
                for f in pending:
                    f.cancel()
                raise
    finally:
        prog.close()
    ordered = [results[c.name] for c in chosen]
    return {
        "workload": {
            "sessions": sessions, "seed": seed, "system_prompts": SYSTEM_PROMPTS, "system_tokens": SYSTEM_TOKENS,
            "turns_min": MIN_TURNS, "turns_max": MAX_TURNS, "user_tokens": USER_TOKENS,
            "answer_tokens": ANSWER_TOKENS, "instances": INSTANCES, "block_tokens": BLOCK_TOKENS,
            "value_bytes": value_bytes, "turns": len(wl.order), "prompt_tokens": total,
            "unique_blocks": n_unique, "capacities_blocks": list(capacities), "store_nodes": stores,
            "verify_every": verify_every, "jobs": jobs,
        },
        "floor_tokens": floor,
        "floor_share": floor / total if total else 0.0,
        "cells": [asdict(r) for r in ordered],
        "mismatches": sum(r.mismatches for r in ordered),
        "local_leftovers": sum(leftovers),
        "clusters": len(groups),
        "startup_seconds": sum(startup),
        "wall_seconds": time.perf_counter() - t_start,
    }


# -- output -----------------------------------------------------------------------------------


def _mb(n: int) -> str:
    return f"{n / 1e6:8.1f}"


def format_report(out: dict[str, Any]) -> str:
    w = out["workload"]
    floor = out["floor_share"]
    new_per_turn = w["user_tokens"]
    lines = [
        f"kvpool demo: {w['sessions']} sessions, {w['turns']} turns over {w['system_prompts']} system prompts of "
        f"{w['system_tokens']} tokens, {w['instances']} instances, {w['block_tokens']}-token blocks of "
        f"{w['value_bytes']} B",
        f"  prefill tokens {w['prompt_tokens']:,}; unique blocks {w['unique_blocks']:,}; local capacity "
        f"{' / '.join(str(c) for c in w['capacities_blocks'])} blocks per instance",
        f"  floor: each turn adds {new_per_turn} new user tokens (plus each system prompt once) = "
        f"{out['floor_tokens']:,} tokens = {100 * floor:.1f}% of prefill",
        "",
        f"{'routing':<8} {'pool':<8} {'local':>6}  {'recomputed':>10} {'vs floor':>8}  "
        f"{'local rd MB':>11} {'pool rd MB':>10} {'pool wr MB':>10}  {'wall s':>6}  {'bad':>4}",
    ]
    for c in out["cells"]:
        lines.append(
            f"{c['routing']:<8} {'yes' if c['pool'] else 'no':<8} {c['local_blocks']:>6}  "
            f"{100 * c['recompute_share']:9.1f}% {c['recompute_share'] / floor if floor else 0:7.2f}x  "
            f"{_mb(c['local_read_bytes']):>11} {_mb(c['pool_read_bytes']):>10} {_mb(c['pool_write_bytes']):>10}  "
            f"{c['wall_seconds']:6.1f}  {c['mismatches']:>4}")
        extra = [f"{k}={c[k]}" for k in ("get_failures", "put_failures") if c[k]]
        if c["shed_reads"]:
            why = ", ".join(f"{k} {name}" for name, k in sorted(c["shed_blocks"].items()))
            extra.append(f"{c['shed_reads']} reads shed at a deadline ({why} blocks, recomputed: UNAVAILABLE, a store "
                         f"node too slow to answer the sidecar in time or skipped while suspect; DeadlineExceeded "
                         f"or Suspect, the sidecar too slow to answer the client)")
        if c["shed_calls"]:
            extra.append("calls shed at the client's deadline: " + ", ".join(
                f"{k} {name}" for name, k in sorted(c["shed_calls"].items())))
        if c[SidecarCounter.POOL_WRITES_SHED]:
            extra.append(f"{c['pool_writes_shed']} pool writes deferred (write-through backlog full)")
        if c["pool"] and c["turns_above_floor"]:
            why = "a prefix another instance was still writing to the pool" + (
                ", or a shed call" if c["shed_reads"] or c["shed_calls"] else "")
            extra.append(f"{c['turns_above_floor']} of {c['turns']} turns above their floor ({why})")
        if extra:
            lines.append(f"{'':<8} note: {', '.join(extra)}")
    n_full = sum(c["verified_blocks"] for c in out["cells"])
    n_head = sum(c["checked_blocks"] for c in out["cells"])
    lines.append(f"total wall time {out['wall_seconds']:.1f} s ({out['clusters']} clusters, {w['jobs']} at a time, "
                 f"started in {out['startup_seconds']:.1f} s in all)")
    lines.append(f"blocks read back: {n_full:,} verified byte-exact, {n_head:,} checked by size and header; "
                 f"mismatches: {out['mismatches']}")
    lines += [""] + interpret(out)
    return "\n".join(lines)


def interpret(out: dict[str, Any]) -> list[str]:
    floor = out["floor_share"]
    by = {(c["routing"], c["pool"], c["local_blocks"]): c["recompute_share"] for c in out["cells"]}
    caps = sorted({c["local_blocks"] for c in out["cells"]}, reverse=True)
    lines = []
    rnd = [by[("random", False, cap)] for cap in caps if ("random", False, cap) in by]
    if rnd:
        lines.append(f"Without the pool, random routing recomputes {100 * min(rnd):.0f}–{100 * max(rnd):.0f}% of "
                     f"prefill ({min(rnd) / floor:.1f}–{max(rnd) / floor:.1f}x the {100 * floor:.1f}% floor): "
                     f"a turn lands where its history is cached only about one time in {INSTANCES}.")
    pooled = [v for (_, p, _), v in by.items() if p]
    if pooled:
        gap = max(pooled) - floor
        if gap <= 0.02:
            lo, hi = f"{100 * min(pooled):.1f}", f"{100 * max(pooled):.1f}"
            span = f"{lo}%" if lo == hi else f"{lo}–{hi}%"
            lines.append(f"With the shared pool every cell recomputes {span} ({100 * gap:+.2f} points from the floor "
                         f"at most), whatever the routing and the local capacity: hitting the cache no longer "
                         f"depends on which instance serves.")
        else:
            lines.append(f"With the shared pool the cells recompute {100 * min(pooled):.1f}–{100 * max(pooled):.1f}%, "
                         f"up to {100 * gap:.1f} points above the floor: see the notes above.")
    st = [(cap, by[("sticky", False, cap)]) for cap in caps if ("sticky", False, cap) in by]
    if len(st) >= 2:
        verb = "climbs to" if st[-1][1] > st[0][1] + 0.02 else "stays at"
        lines.append(f"Session-sticky routing alone is at {100 * st[0][1]:.1f}% with {st[0][0]} local blocks but "
                     f"{verb} {100 * st[-1][1]:.1f}% with {st[-1][0]}: cache-aware routing only works while "
                     f"each instance's sessions fit in its local cache.")
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpool demo", description=__doc__.split("\n\n")[0] if __doc__ else None)
    work = ap.add_argument_group("workload")
    work.add_argument("--sessions", type=int, default=None, help=f"chat sessions (default {FULL_SESSIONS})")
    work.add_argument("--quick", action="store_true", help=f"reduced size: {QUICK_SESSIONS} sessions")
    work.add_argument("--value-bytes", type=int, default=VALUE_BYTES, help="bytes per block value (default 4096)")
    work.add_argument("--seed", type=int, default=SEED, help=f"seed of the workload (default {SEED})")
    cells = ap.add_argument_group("cells (routing x capacity)")
    cells.add_argument("--cells", default=None,
                       help="comma-separated subset, e.g. 'random', 'sticky/no-pool', 'pool/2000' (default: all 8)")
    cells.add_argument("--capacities", default=None,
                       help="local capacities in blocks, comma-separated (default 8000,2000 × sessions/300)")
    cells.add_argument("--stores", type=int, default=2, help="store nodes in the with-pool cells (default 2)")
    run = ap.add_argument_group("running and output")
    run.add_argument("--verify-every", type=int, default=4, metavar="N",
                     help="verify every block byte-exact on every N-th turn, size and header on the others "
                          "(default 4; 1: every block of every turn)")
    run.add_argument("--jobs", type=int, default=2, metavar="N",
                     help="clusters running at the same time (default 2; wall times per cell grow with it)")
    run.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    run.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    # gRPC's fork handlers can make a child forked by subprocess abort before its exec
    # (grpc/grpc#43055; the _ForkGate covers our own threads) and log a line per fork: this
    # process only forks to exec, so turn them off before gRPC is loaded.
    global _grpc_fork_support_off
    if "grpc" not in sys.modules:
        os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
        _grpc_fork_support_off = os.environ["GRPC_ENABLE_FORK_SUPPORT"].strip().lower() in ("0", "false", "no")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    sessions = args.sessions if args.sessions is not None else QUICK_SESSIONS if args.quick else FULL_SESSIONS
    if sessions <= 0:
        print("kvpool demo: --sessions must be positive", file=sys.stderr)
        return 2
    caps = None
    if args.capacities:
        try:
            caps = [int(x) for x in args.capacities.split(",") if x.strip()]
        except ValueError:
            print(f"kvpool demo: --capacities {args.capacities!r} is not a list of integers", file=sys.stderr)
            return 2
    try:
        out = run_demo(sessions, args.cells, args.seed, caps, args.value_bytes, args.stores, args.verify_every,
                       args.jobs, progress=None if args.no_progress else sys.stderr)
    except ValueError as exc:
        print(f"kvpool demo: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvpool demo: interrupted (clusters stopped)", file=sys.stderr)
        return 130
    print(format_report(out), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 1 if failed(out) else 0


def failed(out: dict[str, Any]) -> bool:
    """Whether a run failed: a block read back wrong, blocks left in a local tier, a failed read
    of a matched prefix or a failed put.  Shed reads (:data:`SHED_CODES`) are not failures."""
    return bool(out["mismatches"] or out["local_leftovers"] or any(
        c["get_failures"] or c["put_failures"] for c in out["cells"]))


if __name__ == "__main__":
    sys.exit(main())
