"""The engine integrations' data path: reads land in registered staging memory, writes go straight
into the sidecar's arena.

What the engines call reads and writes kvpool objects through here (vLLM's connector, SGLang's
HiCache backend, LMCache's remote connector), so each pays the fewest copies kvpool can offer:

- **Remote reads** (objects not in the sidecar's local tier) land with ``Client.get_into`` in a
  :class:`StagingPool`: registered memory from ``Client.alloc_buffer``, allocated once and reused
  (its pages stay mapped and cache-warm), that the sidecar writes the pool's bytes into directly.
  The integration then makes its one copy into the engine's memory (vLLM's paged cache, SGLang's
  host pages, LMCache's memory objects).  No arena extent is taken for them (the local tier is
  left as it was: a read-through, as Mooncake's registered buffers are).
- **Local hits** (keys the sidecar's arena has) are read first, in one ``Client.get_many(...,
  local_only=True)`` that fetches nothing from the pool, as views of the arena, zero copy, and
  the integration copies them once into the engine's memory, as before: the same one READ
  round trip.  Read into staging, they would cost a second copy (the sidecar's, arena to
  staging); the keys it did not find go to staging (a second round trip, only for them).
- **Writes** reserve arena extents (``Client.reserve``) and the engine's bytes are gathered
  straight into them, then committed: one copy, where the integrations used to gather into a
  fresh buffer (cold pages, faulted in on every save) and ``put`` copied it again.  Items the
  local tier has no room for go with ``Client.put`` from staging (which streams them to the pool).

Why not land straight in the engine's memory: the sidecar maps only memfd regions made by
``alloc_buffer``, and every engine allocates its KV memory itself before kvpool is attached
(vLLM's paged cache; SGLang's host pool, pinned for CUDA, in ``HostKVCache.__init__``; LMCache's
allocator, behind ``local_cpu_backend``); an object is also framed (32-byte header, LMCache's
metadata) and a vLLM block is spread over every layer's tensor, so even registered engine memory
could not take an object as one contiguous landing.

Micro-measurements that picked these paths (16 objects of 1 MiB, a ``LocalCluster`` of one store
node and two sidecars, milliseconds: run 1 the median of 7, runs 2-4 the best of 7 with the
median beside it; on the 2 CI cores shared with other sessions at a load average of 5-8, so a
figure moves by ±30% between runs; run 4 after local hits moved into the local-only READ):

=========================================  ======  ===========  ===========  ===========
path                                       run 1   run 2        run 3        run 4
=========================================  ======  ===========  ===========  ===========
remote: ``get`` (arena extent) + copy      14.0    14.2 (19.1)  12.3 (13.5)  15.5 (17.1)
remote: staging + copy (chosen)             9.0    13.2 (13.9)   9.8 (14.3)  14.0 (17.5)
remote: ``get_into`` staging, no copy       6.1    10.4 (10.9)  10.1 (10.9)   9.1 (10.0)
local: ``get`` arena views + copy           1.5     2.0 (2.2)    1.8 (2.1)    2.6 (2.7)
local: ``get_into`` staging + copy          3.1     4.2 (4.5)    4.2 (4.3)    4.6 (4.8)
local: ``FastPath.read`` + copy (chosen)    1.7     2.5 (2.8)    2.3 (2.8)    2.4 (2.7)
save: in ``torch.empty`` + ``put``         17.6    29.3 (31.2)  11.9 (13.2)  15.0 (25.1)
save: in reserved extents (chosen)         11.7     7.8 (8.8)    8.1 (8.7)    6.7 (7.4)
=========================================  ======  ===========  ===========  ===========

So: remote objects land in staging (no arena extent taken, nothing of the local tier evicted for
them, warm reused pages; on these loaded cores the gain over the arena landing ranges from none
to a third); local hits stay arena views (into staging they pay the sidecar's copy too, twice the
time; runs 1-3 told them apart with a local-only MATCH first, a round trip more, which the
local-only READ of run 4 folds into the read itself: local hits now cost what ``get`` + copy
does); saves gather in place, 1.3-3× faster.  Run 1 copied into the engine's memory with torch's
``copy_``, runs 2-4 with numpy's (:mod:`kvpool.integrations.tensors` says why).

Counters (:class:`PathStat`, in each integration's ``stats``) prove which path was taken.  Pure
Python and numpy: no engine, no torch.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Generator, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.core import errors
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS
from kvpool.integrations.common import IntegrationConfigError
from kvpool.wire.proto import store_pb2 as pb

if TYPE_CHECKING:
    from kvpool.client.client import Client
    from kvpool.client.results import Reads

log = logging.getLogger(__name__)

DEFAULT_STAGING_MIB = 64
DEFAULT_STAGING_WAIT_MS = 50
PIPELINE_OBJECTS = 4
"""Objects per part of a pipelined read (:meth:`FastPath.read_parts`) when its caller asks for
small parts: the next part lands while the engine checks and copies this one.  Not the default of
:meth:`FastPath.read_each`: on the 2 shared cores of the CI machine, 16 × 1 MiB read in parts of 4
(or 8) took as long or longer than one read (SGLang: 26.7 vs 14.8 ms, in the worker of
bench/integrations.py) and cost the sidecar and the store nodes more CPU per byte (0.78 vs 0.45
and 0.44 vs 0.27 s/GB): each part is a round trip and a smaller fan-out, and the overlap has no
idle core to run on.  Where cores are free, parts overlap the landing with the copies."""
PART_DEADLINE_S = 60.0
"""How long a pipelined read waits for a part in flight (the client's own calls have deadlines;
this bounds the hand-over between threads)."""


class PathStat(enum.StrEnum):
    """Which path each object took (keys of an integration's ``stats``)."""

    REGISTERED_LANDINGS = "registered_landings"
    """Objects a remote read landed in registered staging memory (the fast path)."""
    ARENA_LANDINGS = "arena_landings"
    """Objects a remote read landed in the sidecar's arena (staging full past its wait, an
    object larger than a slot, or staging the sidecar refused to map)."""
    LOCAL_VIEWS = "local_views"
    """Local hits read as views of the sidecar's arena (zero copy)."""
    STAGING_WAITS = "staging_waits"
    """Reads or writes that waited for a staging slot."""
    ARENA_WRITES = "arena_writes"
    """Objects written in place into reserved arena extents (one copy)."""
    RUN_COPIES = "run_copies"
    """Objects copied into the engine's memory with one call for a run of them (:meth:`Landing.rows`),
    not one call per object."""
    STAGED_WRITES = "staged_writes"
    """Objects put from staging or a temporary buffer (the local tier had no room: ``put``
    streams them to the pool)."""


def path_stats() -> dict[str, int]:
    return {str(s): 0 for s in PathStat}


def staging_settings(extra: MutableMapping[str, Any] | dict[str, Any], where: str,
                     default_mib: int = DEFAULT_STAGING_MIB) -> tuple[int, float]:
    """``staging_mib`` (registered memory for remote reads, allocated once; 0: none, reads
    land in the arena) and
    ``staging_wait_ms`` (how long a read waits for a free slot before going through the arena)
    from an integration's configuration, checked."""
    mib = extra.get("staging_mib", default_mib)
    wait = extra.get("staging_wait_ms", DEFAULT_STAGING_WAIT_MS)
    for name, v in (("staging_mib", mib), ("staging_wait_ms", wait)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
            raise IntegrationConfigError(f"{where}.{name} must be a number >= 0, got {v!r}")
    return int(mib * (1 << 20)), float(wait) / 1000.0


class StagingPool:
    """Fixed slots of registered memory (one ``alloc_buffer`` region, allocated once), each the
    size of the largest object the integration reads; thread-safe.  :meth:`acquire` takes free
    slots, waiting at most its deadline for the first one."""

    def __init__(self, client: Client, slot_bytes: int, total_bytes: int) -> None:
        self.client = client
        self.slot_bytes = max(1, int(slot_bytes))
        self.slots = total_bytes // self.slot_bytes
        self._mem: np.ndarray | None = client.alloc_buffer(self.slots * self.slot_bytes) if self.slots else None
        self._free = list(range(self.slots - 1, -1, -1))  # popped from the end: slot 0 first, kept warm
        self._cond = threading.Condition()

    @property
    def registered(self) -> bool:
        """Whether ``get_into`` of the slots lands bytes directly (the sidecar mapped the region)."""
        return self._mem is not None and bool(self.client.is_registered(self._mem[:1]))

    def acquire(self, n: int, wait_s: float) -> tuple[list[int], bool]:
        """Up to ``n`` free slots (fewer when fewer are free; none when none came free within
        ``wait_s``) and whether it waited."""
        if n <= 0 or not self.slots:
            return [], False
        deadline = time.monotonic() + wait_s
        waited = False
        with self._cond:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0:
                    return [], waited
                waited = True
                self._cond.wait(left)
            take = min(n, len(self._free))
            got = self._free[-take:][::-1]
            del self._free[-take:]
            return got, waited

    @property
    def free(self) -> int:
        """Slots free now."""
        return len(self._free)

    def view(self, slot: int) -> np.ndarray:
        assert self._mem is not None
        return self._mem[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    def rows(self, slots: Sequence[int], size: int) -> np.ndarray | None:
        """The first ``size`` bytes of ``slots`` as one 2-D array (a row per slot, no copy), or
        None when the slots are not evenly spaced upwards (a copy per object is then needed)."""
        if self._mem is None or not slots or size > self.slot_bytes:
            return None
        first, step = slots[0], (slots[1] - slots[0] if len(slots) > 1 else 1)
        if step < 1 or any(s != first + k * step for k, s in enumerate(slots)):
            return None
        grid = self._mem.reshape(self.slots, self.slot_bytes)
        return grid[first::step][:len(slots), :size]

    def release(self, slots: Sequence[int]) -> None:
        if slots:
            with self._cond:
                self._free.extend(reversed(slots))
                self._cond.notify_all()

    def close(self) -> None:
        if self._mem is not None:
            try:
                self.client.free_buffer(self._mem)
            except errors.KvpoolError:
                pass  # the client is closed already: its regions went with it
            self._mem = None


class Landing:
    """A read's objects: per key a view (arena view of a local hit, or a staging slot) or None,
    valid until :meth:`release` (which drops the arena lease and gives the slots back);
    ``error``: the sidecar's error that stopped the read (its unread keys are None), if any."""

    def __init__(self, n: int, pool: StagingPool | None) -> None:
        self.views: list[memoryview | None] = [None] * n
        self.error: errors.KvpoolError | None = None
        self._leased: list[Reads] = []
        self._slots: list[int] = []
        self._slot_of: list[int | None] = [None] * n  # the staging slot each view is in
        self._pool = pool

    @property
    def prefix(self) -> int:
        """How many keys from the start have a view."""
        return next((i for i, v in enumerate(self.views) if v is None), len(self.views))

    def rows(self, lo: int, hi: int) -> np.ndarray | None:
        """Objects ``lo..hi-1`` as one uint8 array of a row each, no copy, when they all landed in
        evenly spaced staging slots and are of one size (as a batch of one engine's blocks does);
        None otherwise (local hits are arena views: copy those one by one).  An engine copies a
        slice of every object with one call over this instead of one call per object."""
        views, slots = self.views[lo:hi], self._slot_of[lo:hi]
        if self._pool is None or not views or any(v is None for v in views) or any(s is None for s in slots):
            return None
        size = len(views[0])  # type: ignore[arg-type]
        if any(len(v) != size for v in views):  # type: ignore[arg-type]
            return None
        return self._pool.rows([s for s in slots if s is not None], size)

    def release(self) -> None:
        for r in self._leased:
            r.release()
        self._leased = []
        if self._pool is not None:
            self._pool.release(self._slots)
        self._slots = []

    def __enter__(self) -> Landing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class FastPath:
    """One integration's reads and writes through the fastest path (see the module docstring).

    ``object_bytes``: the largest object the integration reads (a staging slot's size);
    ``stats``: the integration's stats, where :class:`PathStat` counts go."""

    def __init__(self, client: Client, object_bytes: int, staging_bytes: int, wait_s: float,
                 stats: MutableMapping[str, int]) -> None:
        self.client = client
        self.pool = StagingPool(client, object_bytes, staging_bytes)
        self.wait_s = wait_s
        self.stats = stats
        self._helpers: ThreadPoolExecutor | None = None
        self._helpers_lock = threading.Lock()
        for s in PathStat:
            stats.setdefault(str(s), 0)

    # -- reads --------------------------------------------------------------------------------

    def read(self, keys: Sequence[bytes], wait_s: float | None = None) -> Landing:
        """Views of ``keys``: local hits in the arena, the rest landed in staging slots (through
        the arena only when no slot came free within ``wait_s``, default the pool's wait).  None
        for a miss; past a remote miss only the objects of the same batch have views (``prefix``
        is what a prefix load takes).  Errors of the sidecar are misses (and ``error``)."""
        land = Landing(len(keys), self.pool)
        try:
            # One READ of the local tier only: its hits are views (pinned by its lease), the
            # rest NOT_FOUND, fetched nowhere yet.
            local = self.client.get_many(keys, local_only=True)
            land._leased.append(local)
            rest = []
            for i, v in enumerate(local.views):
                if v is None:
                    rest.append(i)
                else:
                    land.views[i] = v
            self.stats[PathStat.LOCAL_VIEWS] += len(keys) - len(rest)
            if rest:
                self._read_remote(keys, rest, land, self.wait_s if wait_s is None else wait_s)
        except errors.KvpoolError as exc:
            log.warning("kvpool read of %d objects stopped (%s): the rest are misses", len(keys), exc)
            land.error = exc
        return land

    def read_parts(self, keys: Sequence[bytes], part: int = PIPELINE_OBJECTS,
                   wait_s: float | None = None) -> Generator[tuple[int, Landing], None, None]:
        """:meth:`read` of ``keys`` in parts of at most ``part`` objects (and at most half the
        staging slots, so two parts fit), yielding ``(offset, landing)`` in order.  Before a part
        is yielded the next one's read is issued on a helper thread: it lands while the caller
        checks and copies this one (the client's ``get_into`` blocks, so only a second thread
        overlaps them).  The caller releases each landing once it is done with it.  Stops after a
        part whose prefix ended (a miss or an error); closing the generator early releases a part
        still in flight when it lands."""
        if not keys:
            return
        slots = self.pool.slots
        step = max(1, min(part, slots // 2) if slots else part)  # one slot: parts of one
        ahead = slots != 1  # one slot holds one part: the next could only land in the arena
        at, land = 0, self.read(keys[:step], wait_s)
        nxt: Future[Landing] | None = None
        try:
            while True:
                end = at + len(land.views)
                more = end < len(keys) and land.prefix == len(land.views)
                if more and ahead:
                    nxt = self._helper().submit(self.read, keys[end:end + step], wait_s)
                yield at, land
                if not more:
                    return
                if nxt is None:
                    land, at = self.read(keys[end:end + step], wait_s), end
                    continue
                try:
                    land = nxt.result(PART_DEADLINE_S)
                except FutureTimeout:
                    log.warning("kvpool read of %d objects still running after %.0fs: the rest are misses",
                                len(keys) - end, PART_DEADLINE_S)
                    return
                nxt, at = None, end
        finally:
            if nxt is not None:  # abandoned (the caller stopped, or the deadline passed)
                nxt.add_done_callback(lambda f: f.result().release())

    def _helper(self) -> ThreadPoolExecutor:
        with self._helpers_lock:
            if self._helpers is None:
                # Two: each of up to two concurrent readers of this integration keeps its next part in flight.
                self._helpers = ThreadPoolExecutor(2, thread_name_prefix="kvpool-read-ahead")
            return self._helpers

    def read_each(self, keys: Sequence[bytes], use: Callable[[int, memoryview], bool],
                  part: int | None = None) -> int:
        """Read ``keys`` in parts of ``part`` objects (default: half the staging slots, so a
        batch that fits is one read) pipelined (:meth:`read_parts`: the next part lands while
        this one is used), handing each object in order to ``use(index, view)`` (its check and
        copy into the engine's memory), so a batch of any size stays within staging.  Stops at
        the first miss or when ``use`` returns False; how many were used."""
        return self.read_runs(keys, use, None, part)

    def read_runs(self, keys: Sequence[bytes], check: Callable[[int, memoryview], bool],
                  copy: Callable[[int, Landing, int], int] | None, part: int | None = None) -> int:
        """:meth:`read_each` with the copy split off: ``check(index, view)`` each object, then
        ``copy(offset, landing, n)`` once per part for its leading run of ``n`` checked objects
        (keys ``offset .. offset+n-1``; it returns how many it copied, fewer stops the read),
        before the part is released, so an engine can copy a
        run with one call over :meth:`Landing.rows` instead of one per object."""
        parts = self.read_parts(keys, part or self.pool.slots // 2 or self.pool.slots or len(keys))
        try:
            for at, land in parts:
                with land:
                    n = next((j for j, v in enumerate(land.views[:land.prefix])
                              if not check(at + j, v)), land.prefix)  # type: ignore[arg-type]
                    if n and copy is not None:
                        n = copy(at, land, n)
                    if n < len(land.views):
                        return at + n
            return len(keys)
        finally:
            parts.close()

    def _read_remote(self, keys: Sequence[bytes], rest: list[int], land: Landing, wait_s: float) -> None:
        """Land ``keys[i] for i in rest`` (increasing) in staging slots; a miss ends the read
        after its batch (the batch's other objects keep their views: one call fetched them)."""
        at = 0
        while at < len(rest):
            # Wait for slots only while other readers' releases can cover the rest: never for
            # slots this read holds itself.
            can_wait = len(land._slots) + len(rest) - at <= self.pool.slots
            slots, waited = self.pool.acquire(len(rest) - at, wait_s if can_wait else 0.0)
            self.stats[PathStat.STAGING_WAITS] += waited
            if not slots or not self.pool.registered:
                self.pool.release(slots)
                self._read_arena(keys, rest[at:], land)
                return
            land._slots.extend(slots)
            bufs = [self.pool.view(s) for s in slots]
            part = rest[at:at + len(slots)]
            try:
                sizes = self.client.get_into([keys[i] for i in part], bufs)
            except errors.InvalidArgument:
                # An object larger than a slot (not one this engine wrote: it fails its checks
                # anyway, or a larger chunk): read through the arena, where any size fits.
                self._read_arena(keys, rest[at:], land)
                return
            for i, slot, buf, size in zip(part, slots, bufs, sizes, strict=True):
                if size >= 0:
                    land.views[i] = buf.data[:size]
                    land._slot_of[i] = slot
                    self.stats[PathStat.REGISTERED_LANDINGS] += 1
            if min(sizes) < 0:
                return  # the prefix ended: no further batch for it
            at += len(slots)

    def _read_arena(self, keys: Sequence[bytes], rest: list[int], land: Landing) -> None:
        reads = self.client.get_many([keys[i] for i in rest])
        land._leased.append(reads)
        for i, v in zip(rest, reads.views, strict=True):
            land.views[i] = v
        self.stats[PathStat.ARENA_LANDINGS] += sum(v is not None for v in reads.views)

    # -- writes -------------------------------------------------------------------------------

    def write(self, keys: Sequence[bytes], sizes: Sequence[int], fill: Callable[[int, memoryview], None],
              traffic_class: str = DEFAULT_TRAFFIC_CLASS) -> list[int]:
        """Store objects of ``sizes`` bytes that ``fill(i, view)`` writes (the whole object:
        its header too) into ``view``: in place in reserved arena extents, or, for those the
        local tier had no room for, into staging (a temporary buffer when staging is busy) and
        ``put`` from there.  Per-item codes (OK / ALREADY_EXISTS: stored)."""
        if not keys:
            return []
        res = self.client.reserve(keys, sizes, traffic_class)
        for i, v in enumerate(res.views):
            if v is not None:
                fill(i, v)
        codes = res.commit()
        self.stats[PathStat.ARENA_WRITES] += sum(v is not None for v in res.views)
        left = [i for i, c in enumerate(res.codes) if c in (pb.NO_SPACE, pb.TOO_LARGE)]
        if left:
            for i, c in zip(left, self._put_staged([keys[i] for i in left], [sizes[i] for i in left],
                                                   lambda j, v: fill(left[j], v), traffic_class), strict=True):
                codes[i] = c
        return codes

    def _put_staged(self, keys: list[bytes], sizes: list[int], fill: Callable[[int, memoryview], None],
                    traffic_class: str) -> list[int]:
        fits = max(sizes) <= self.pool.slot_bytes
        slots, waited = self.pool.acquire(len(keys), self.wait_s) if fits else ([], False)
        self.stats[PathStat.STAGING_WAITS] += waited
        try:
            bufs: list[Any] = [self.pool.view(s)[:n] for s, n in zip(slots, sizes, strict=False)]
            bufs += [bytearray(n) for n in sizes[len(slots):]]
            views = [memoryview(b).cast("B") for b in bufs]
            for j, v in enumerate(views):
                fill(j, v)
            codes = self.client.put(keys, views, traffic_class=traffic_class)
        finally:
            self.pool.release(slots)
        self.stats[PathStat.STAGED_WRITES] += len(keys)
        return codes

    def close(self) -> None:
        with self._helpers_lock:
            helpers, self._helpers = self._helpers, None
        if helpers is not None:
            helpers.shutdown(wait=True)  # the parts in flight land and are released before the slots go
        self.pool.close()
