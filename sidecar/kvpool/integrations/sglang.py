"""SGLang HiCache storage backend: HiCache's pages stored in kvpool, loaded by the ``dynamic`` backend.

Loaded by SGLang, never by ``import kvpool``::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
        "class_name": "KVPoolHiCacheStorage", "interface_v1": 1, "address": "unix:///run/kvpool/kvpool.sock"}'

SGLang's factory calls ``cls(storage_config, kwargs)``, then ``register_mem_pool_host``.  A page
hash (SGLang's string key) becomes a 32-byte kvpool key: SHA-256 of it inside a key space of
the model and the TP/PP rank (MLA pages are rank-independent), plus the host pool's page layout.
Objects are framed by :mod:`kvpool.integrations.common` (layout fingerprint + checksum): a damaged
or foreign page is a miss.  ``batch_exists`` is one match (the leading run of hits);
``batch_get_v1`` / ``batch_set_v1`` copy straight between the sidecar's arena and the host pool's
pages (one copy each way, no intermediate tensor on the read side).
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvpool.core import errors
from kvpool.core.keys import KeySpace
from kvpool.core.traffic import DEFAULT_TRAFFIC_CLASS
from kvpool.integrations.common import HEADER_BYTES, IntegrationConfigError, check_object, fingerprint, sidecar_address
from kvpool.integrations.common import write_header as _write_header
from kvpool.wire.proto import store_pb2 as pb

log = logging.getLogger(__name__)
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
OUR_KEYS = ("address", "traffic_class")


class KVPoolHiCacheStorage(HiCacheStorage):
    """HiCache's L3 on the kvpool sidecar."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        for k, v in extra.items():
            if k in OUR_KEYS and not isinstance(v, str):
                raise IntegrationConfigError(f"hicache extra config {k} must be a string, got {v!r}")
        unknown = sorted(set(extra) - set(SGLANG_KEYS) - set(OUR_KEYS))
        if unknown:
            raise IntegrationConfigError(f"hicache extra config: unknown kvpool setting(s) {', '.join(unknown)}; "
                                         f"known: {', '.join(OUR_KEYS)}")
        self.config = storage_config
        self.address = sidecar_address(extra)
        self.traffic_class = str(extra.get("traffic_class", DEFAULT_TRAFFIC_CLASS))
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

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_dummy_flat_data_page()
        self.page_size = int(mem_pool_host.page_size)
        self.page_bytes = page.numel() * page.element_size()
        self.page_dtype = page.dtype
        self.layout = fingerprint([type(mem_pool_host).__name__, str(mem_pool_host.layout), self.page_size,
                                   tuple(mem_pool_host.get_data_page(0, flat=False).shape), str(page.dtype)])
        self._seed = KeySpace(self._space_fields[0], layout=self._space_fields[1],
                              extra={"engine": "sglang", "pages": f"{self.layout:016x}"}).seed

    # -- keys and framing ----------------------------------------------------------------------

    def pool_key(self, key: str) -> bytes:
        return hashlib.sha256(self._seed + key.encode()).digest()

    def _frame(self, value: torch.Tensor) -> memoryview:
        flat = value.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        buf = torch.empty(HEADER_BYTES + flat.numel(), dtype=torch.uint8)
        buf[HEADER_BYTES:] = flat
        mv = memoryview(buf.numpy())
        _write_header(mv, self.layout)
        return mv

    def _fetch(self, keys: list[str]) -> tuple[list[memoryview | None], Any]:
        """Views of the leading run of present, intact objects (None after it) and their lease."""
        pk = [self.pool_key(k) for k in keys]
        out: list[memoryview | None] = [None] * len(keys)
        got = None
        try:
            have = self.client.match(pk)
            if have:
                got = self.client.get(pk[:have])
                for i, v in enumerate(got):
                    why = check_object(v, self.layout)
                    if why is not None:
                        log.warning("kvpool page %d not loaded: %s", i, why)
                        self.stats["rejected"] += 1
                        break
                    out[i] = v
        except errors.KvpoolError as exc:
            log.warning("kvpool get of %d pages failed: %s", len(keys), exc)
        hits = sum(o is not None for o in out)
        self.stats["hits"] += hits
        self.stats["misses"] += len(keys) - hits
        return out, got

    @staticmethod
    def _copy(view: memoryview, dst: torch.Tensor) -> bool:
        n = dst.numel() * dst.element_size()
        if len(view) - HEADER_BYTES != n:
            return False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only arena view; we only read
            src = torch.frombuffer(view, dtype=torch.uint8, count=n, offset=HEADER_BYTES)
        dst.copy_(src.view(dst.dtype).view(dst.shape))
        return True

    def _put(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        if len(keys) != len(values):
            raise IntegrationConfigError(f"{len(keys)} keys but {len(values)} values")
        if not keys:
            return []
        try:
            codes = self.client.put([self.pool_key(k) for k in keys], [self._frame(v) for v in values],
                                    traffic_class=self.traffic_class)
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
        views, lease = self._fetch(list(keys))
        try:
            out: list[torch.Tensor | None] = []
            for v, t in zip(views, targets, strict=True):
                if v is None:
                    out.append(None)
                    continue
                if t is None:
                    t = torch.empty(len(v) - HEADER_BYTES, dtype=torch.uint8)
                out.append(t if self._copy(v, t) else None)
            return out
        finally:
            if lease is not None:
                lease.release()

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self._put([key], [value])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all(self._put(list(keys), list(values)))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if not keys:
            return 0
        try:
            n, lease = self.client.match_lease([self.pool_key(k) for k in keys], 1)
            if lease:
                self.client.release(lease)
            return int(n)
        except errors.KvpoolError as exc:
            log.warning("kvpool exists of %d pages failed (%s): a miss", len(keys), exc)
            return 0

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
        views, lease = self._fetch(list(keys))
        try:
            return [v is not None and self._copy(v, self.mem_pool_host.get_data_page(s, flat=False))
                    for v, s in zip(views, starts, strict=True)]
        finally:
            if lease is not None:
                lease.release()

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        starts = self._pages(keys, host_indices)
        return self._put(list(keys), [self.mem_pool_host.get_data_page(s, flat=False) for s in starts])

    def clear(self) -> None:
        """The pool is shared by every engine of the tenant: clearing one engine's view drops nothing."""

    def get_stats(self) -> dict[str, int]:
        return dict(self.stats)

    def close(self) -> None:
        self.client.close()
