"""SGLang HiCache storage backend: HiCache's pages stored in kvpool, loaded by the ``dynamic`` backend.

Loaded by SGLang, never by ``import kvpool``::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
        "class_name": "KVPoolHiCacheStorage", "interface_v1": 1, "address": "unix:///run/kvpool/kvpool.sock"}'

SGLang's factory calls ``cls(storage_config, kwargs)``, then ``register_mem_pool_host``.  A page
hash (SGLang's string key) becomes a 32-byte kvpool key: SHA-256 of it inside a key space of
the model and the TP/PP rank (MLA pages are rank-independent), plus the host pool's page layout.
Objects are framed by :mod:`kvpool.integrations.common` (layout fingerprint + checksum): a damaged
or foreign page is a miss.  ``batch_exists`` is one match (the leading run of hits), and is HiCache's
prefetch decision: it answers 0 pages when recomputing them is faster than loading them
(:mod:`kvpool.integrations.crossover`: the sidecar's measured read bandwidth and lookup time
against ``prefill_tokens_per_s``), so the prefetch is not started and SGLang prefills them;
``batch_get_v1`` / ``batch_set_v1`` move pages through :mod:`kvpool.integrations.staging`: a page
the sidecar's arena has is copied from it into the host pool (one copy), a page from the pool
lands in registered staging memory (``staging_mib``, allocated once) and is copied from there;
a saved page is copied from the host pool straight into a reserved arena extent (one copy).  The
host pool cannot itself be the landing: SGLang allocates it (pinned for CUDA) before the backend
is attached, and the sidecar writes only into memory kvpool allocated.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvpool.core import errors
from kvpool.core.keys import KeySpace
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS
from kvpool.integrations import crossover
from kvpool.integrations.common import (
    ADDRESS_HELP,
    HEADER_BYTES,
    IntegrationConfigError,
    check_keys,
    check_object,
    fingerprint,
    sidecar_address,
)
from kvpool.integrations.common import write_header as _write_header
from kvpool.integrations.staging import FastPath, Landing, PathStat, staging_settings
from kvpool.integrations.tensors import copy_tensor, host_array
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger(__name__)
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
SETTINGS = {
    "address": ADDRESS_HELP,
    "traffic_class": f"the traffic class of stored pages (default {DEFAULT_TRAFFIC_CLASS})",
    "staging_mib": "registered memory (MiB, allocated once) pages from the pool land in (staging)",
    "staging_wait_ms": "how long a read waits for a free staging slot before going through the arena",
    **crossover.SETTINGS,
}
OUR_KEYS = tuple(SETTINGS)
TEXT_KEYS = ("address", "traffic_class")


class KVPoolHiCacheStorage(HiCacheStorage):
    """HiCache's L3 on the kvpool sidecar."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        for k, v in extra.items():
            if k in TEXT_KEYS and not isinstance(v, str):
                raise IntegrationConfigError(f"hicache extra config {k} must be a string, got {v!r}")
        check_keys({k: v for k, v in extra.items() if k not in SGLANG_KEYS}, OUR_KEYS, "hicache extra config")
        self.config = storage_config
        self.address = sidecar_address(extra)
        self.traffic_class = str(extra.get("traffic_class", DEFAULT_TRAFFIC_CLASS))
        self._staging = staging_settings(extra, "hicache extra config")
        self._path: FastPath | None = None  # made when the host pool's page size is known
        rank = "mla" if storage_config.is_mla_model else f"tp{storage_config.tp_rank}/{storage_config.tp_size}"
        self._space_fields = (str(storage_config.model_name or ""), f"{rank},pp{storage_config.pp_rank}/"
                                                                    f"{storage_config.pp_size}")
        from kvpool.client.client import connect
        self.client = connect(self.address)
        self.mem_pool_host: Any = None
        self.layout = 0
        self.page_bytes = 0
        self._seed = KeySpace(*self._space_fields[:1], layout=self._space_fields[1],
                              extra={"engine": "sglang"}).seed
        self.stats = {"hits": 0, "misses": 0, "rejected": 0, "stored": 0, "refused": 0}
        self.decider = crossover.FetchDecider(crossover.CrossoverSettings.parse(extra, "hicache extra config"),
                                              self.client.stats, self.stats)
        self.page_size = 0

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_dummy_flat_data_page()
        self.page_size = int(mem_pool_host.page_size)
        self.page_bytes = page.numel() * page.element_size()
        self.layout = fingerprint([type(mem_pool_host).__name__, str(mem_pool_host.layout), self.page_size,
                                   tuple(mem_pool_host.get_data_page(0, flat=False).shape), str(page.dtype)])
        self._seed = KeySpace(self._space_fields[0], layout=self._space_fields[1],
                              extra={"engine": "sglang", "pages": f"{self.layout:016x}"}).seed
        if self._path is not None:
            self._path.close()
        self._path = FastPath(self.client, HEADER_BYTES + self.page_bytes, self._staging[0], self._staging[1],
                              self.stats)

    def _data_path(self) -> FastPath:
        if self._path is None:  # the v0 interface used before any host pool: pages of unknown size
            self._path = FastPath(self.client, 0, 0, self._staging[1], self.stats)
        return self._path

    # -- keys and framing ----------------------------------------------------------------------

    def pool_key(self, key: str) -> bytes:
        return hashlib.sha256(self._seed + key.encode()).digest()

    def _load(self, keys: list[str], put: Callable[[int, memoryview], bool],
              put_run: Callable[[int, Landing, int], bool] | None = None) -> list[bool]:
        """Read ``keys`` through the fast path, checking each object before ``put(i, view)``
        copies it into the engine's memory (or, given ``put_run``, before ``put_run(offset,
        landing, n)`` copies a part's run of checked objects at once, falling back to ``put``
        per object where it cannot); which were loaded (the leading run)."""
        out = [False] * len(keys)

        def check(i: int, view: memoryview) -> bool:
            why = check_object(view, self.layout)
            if why is not None:
                log.warning("kvpool page %d not loaded: %s", i, why)
                self.stats["rejected"] += 1
                return False
            if put_run is not None:
                return True  # copied with its run
            out[i] = put(i, view)
            return out[i]

        def copy(at: int, land: Landing, n: int) -> int:
            assert put_run is not None
            if put_run(at, land, n):
                out[at:at + n] = [True] * n
                return n
            for j in range(n):  # copy one by one, up to the first that does not fit
                view = land.views[j]
                assert view is not None
                if not put(at + j, view):
                    return j
                out[at + j] = True
            return n

        self._data_path().read_runs([self.pool_key(k) for k in keys], check, None if put_run is None else copy)
        hits = next((i for i, ok in enumerate(out) if not ok), len(out))
        self.stats["hits"] += hits
        self.stats["misses"] += len(keys) - hits
        return out[:hits] + [False] * (len(keys) - hits)

    @staticmethod
    def _copy(view: memoryview, dst: torch.Tensor) -> bool:
        n = dst.numel() * dst.element_size()
        if len(view) - HEADER_BYTES != n:
            return False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only arena view; we only read
            src = torch.frombuffer(view, dtype=torch.uint8, count=n, offset=HEADER_BYTES)
        copy_tensor(dst, src.view(dst.dtype).view(dst.shape))
        return True

    def _put(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        if len(keys) != len(values):
            raise IntegrationConfigError(f"{len(keys)} keys but {len(values)} values")
        if not keys:
            return []
        values = [v.detach() for v in values]
        sizes = [HEADER_BYTES + v.numel() * v.element_size() for v in values]

        def fill(i: int, obj: memoryview) -> None:
            v = values[i]
            dst = torch.frombuffer(obj, dtype=torch.uint8, count=sizes[i] - HEADER_BYTES, offset=HEADER_BYTES)
            copy_tensor(dst.view(v.dtype).view(v.shape), v)  # the page's strides, gathered in this one copy
            _write_header(obj, self.layout)

        try:
            codes = self._data_path().write([self.pool_key(k) for k in keys], sizes, fill, self.traffic_class)
        except errors.KvpoolError as exc:
            log.warning("kvpool put of %d pages failed: %s", len(keys), exc)
            self.stats["refused"] += len(keys)
            return [False] * len(keys)
        ok = [c in (pb.OK, pb.ALREADY_EXISTS) for c in codes]
        self.stats["stored"] += sum(ok)
        self.stats["refused"] += len(ok) - sum(ok)
        return ok

    # -- the v0 interface (tensors in and out) -------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        got: list[torch.Tensor | None] = [None] * len(keys)

        def put(i: int, view: memoryview) -> bool:
            t = targets[i] if targets[i] is not None else torch.empty(len(view) - HEADER_BYTES, dtype=torch.uint8)
            if self._copy(view, t):
                got[i] = t
            return got[i] is not None

        self._load(list(keys), put)
        return got

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self._put([key], [value])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all(self._put(list(keys), list(values)))

    def exists(self, key: str) -> bool:
        return self._present([key])[0] == 1

    def _present(self, keys: list[str]) -> tuple[int, int]:
        """(leading run of present pages, of them in the sidecar's local tier); nothing stays pinned."""
        if not keys:
            return 0, 0
        try:
            n, local, lease = self.client.match_local([self.pool_key(k) for k in keys], 1)
            if lease:
                self.client.release(lease)
            return int(n), int(local)
        except errors.KvpoolError as exc:
            log.warning("kvpool exists of %d pages failed (%s): a miss", len(keys), exc)
            return 0, 0

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """HiCache's prefetch query: the leading run of pages to load — 0 when recomputing them is
        faster (SGLang then prefills them and starts no prefetch).  Each call of the query (SGLang
        asks in batches of 128 pages) is decided on its own pages."""
        if not keys:
            return 0
        n, local = self._present(keys)
        if not self.page_size or not self.page_bytes:  # no host pool registered: nothing to size a load by
            return n
        ps = self.page_size
        return n if self.decider.decide(n * ps, local * ps, self.page_bytes // ps).fetch else 0

    # -- the v1 interface (host pool indices, no intermediate tensors) -------------------------

    def _pages(self, keys: list[str], host_indices: torch.Tensor) -> list[int]:
        if self.mem_pool_host is None:
            raise RuntimeError("KVPoolHiCacheStorage: register_mem_pool_host was not called")
        if len(host_indices) != len(keys) * self.page_size:
            raise IntegrationConfigError(f"{len(keys)} pages need {len(keys) * self.page_size} host indices, "
                                         f"got {len(host_indices)}")
        return [int(host_indices[i * self.page_size]) for i in range(len(keys))]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        starts = self._pages(keys, host_indices)
        return self._load(list(keys), lambda i, view: self._copy(view, self._page(starts[i])),
                          lambda at, land, n: self._copy_run(land, starts[at:at + n]))

    def _page(self, start: int) -> torch.Tensor:
        page: torch.Tensor = self.mem_pool_host.get_data_page(start, flat=False)
        return page

    def _copy_run(self, land: Landing, starts: list[int]) -> bool:
        """Copy the landing's first ``len(starts)`` objects into the host pages at ``starts`` with
        one numpy call, when they sit in evenly spaced staging slots and the pages evenly spaced
        in the host pool (consecutive pages of one buffer, whatever its layout); False (nothing
        copied) otherwise.  The pages' addresses are each checked, so the strided view over them
        covers exactly their elements."""
        rows = land.rows(0, len(starts))
        if rows is None or len(starts) < 2:
            return False
        pages = [self._page(s) for s in starts]
        first, size = pages[0], pages[0].numel() * pages[0].element_size()
        host = host_array(first)
        step = pages[1].data_ptr() - first.data_ptr()
        if (host is None or rows.shape[1] != HEADER_BYTES + size or step <= 0
                or any(p.data_ptr() != first.data_ptr() + k * step or p.stride() != first.stride()
                       for k, p in enumerate(pages))):
            return False
        dst = np.lib.stride_tricks.as_strided(host, (len(pages),) + host.shape, (step,) + host.strides)
        src = rows[:, HEADER_BYTES:].view(host.dtype).reshape((len(pages),) + host.shape)
        np.copyto(dst, src)
        self.stats[PathStat.RUN_COPIES] += len(pages)
        return True

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        starts = self._pages(keys, host_indices)
        return self._put(list(keys), [self.mem_pool_host.get_data_page(s, flat=False) for s in starts])

    def clear(self) -> None:
        """The pool is shared by every engine of the tenant: clearing one engine's view drops nothing."""

    def get_stats(self) -> dict[str, int]:
        return dict(self.stats)

    def close(self) -> None:
        if self._path is not None:
            self._path.close()
        self.client.close()
