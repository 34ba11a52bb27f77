"""The engine-side half of bench/integrations.py: one integration's remote read, timed inside
that engine's venv (``python bench/integration_worker.py ENGINE --writer ADDR --reader ADDR``).

The engine and its integration are built the way tests/integrations/test_<engine>.py build them
(the engine's real classes, KV buffers of the real shapes on CPU), with one geometry for all:
32 layers x 8 KV heads x head size 64, float16, 16 tokens per block/page/chunk, so one stored
object carries 1 MiB of KV (plus the integration's frame).  Each repetition stores 16 fresh
objects through the *writer* sidecar with the integration's own save call (untimed), waits
until that sidecar's write-through to the store nodes has drained (untimed), then times the
*reader* engine's own load call into its own buffers: the objects are not in the reader
sidecar's local tier, so they come from the store nodes (the reader sidecar's pool/local hit
counters say so in the note).  The last repetition's buffers are compared with what was stored.

Prints one line ``RESULT {json}``: ``times`` (seconds per timed batch), ``failures`` (objects
the load reported missing or rejected), ``verify`` ("" or what differed), ``pool_hits`` /
``local_hits``, ``version``, ``cpu_s_per_gb`` / ``cpu_split`` (``bench.common.CpuMeter`` over the
timed loads: this process as the client, and the sidecars and store nodes named by ``--roles``);
or ``error``.  Imports the standard library, torch, the engine, kvpool and bench.common (numpy).

Adding an integration: one class with ``write(i)``, ``prepare(i)`` (untimed), ``load()`` (the
timed call; returns the number of objects not loaded), ``verify()`` and ``close()``, named in :data:`BENCHES`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

LAYERS, HEADS, HEAD, TOKENS = 32, 8, 64, 16
"""Geometry of every engine here: 2 (K, V) x 32 x 8 x 64 x 16 tokens x 2 bytes = 1 MiB per object."""
DTYPE = torch.float16
OBJECT_BYTES = 2 * LAYERS * HEADS * HEAD * TOKENS * 2
BATCH = 16
SLOTS = 64
"""Blocks / pages of each engine's KV buffers: the writer's source is 0..15, the reader lands in 16..31."""


class Bench(Protocol):
    def write(self, i: int) -> None:
        """Store batch ``i`` (fresh keys) through the writer sidecar with the integration's save call."""

    def prepare(self, i: int) -> None:
        """Untimed, before :meth:`load`: empty the landing buffers, build what the engine would
        hand the load call for batch ``i``."""

    def load(self) -> int:
        """The timed call: load the prepared batch into the reader engine's buffers; the number
        of objects it did not load."""

    def verify(self) -> str:
        """'' when the reader's buffers hold what the writer stored, else what differs."""

    def close(self) -> None: ...


def _random_kv(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DTYPE)


def _zero(t: torch.Tensor) -> None:
    """Empty a landing buffer (untimed) with numpy, not torch's ``zero_``: a torch op opens an
    OpenMP region whose threads then spin-wait for more work, and that spinning ran into the timed
    load and was metered as the integration's CPU (the client's cpu s/GB fell from 0.7-1.5 to 0.48
    in a SGLang run with OMP_WAIT_POLICY=PASSIVE).  The loads themselves copy with numpy."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    t.detach().view(as_int).numpy().fill(0)  # any strides: a view of the same bits


def _check_size(nbytes: int, what: str) -> None:
    if nbytes != OBJECT_BYTES:
        raise RuntimeError(f"{what} holds {nbytes} bytes, not the {OBJECT_BYTES} this bench is laid out for")


def _differ(got: torch.Tensor, want: torch.Tensor, what: str) -> str:
    return "" if torch.equal(got, want) else f"{what} differ from what was stored"


# -- vLLM: KVPoolConnector, worker side ---------------------------------------------------------


class VllmConnectorBench:
    """Two worker-role KVPoolConnectors from vLLM's KVConnectorFactory over paged caches in vLLM's
    CPU layout [blocks, kv_heads, block_size, 2 * head]; the scheduler's part is played by the
    step metadata it would send (a load of 16 blocks of a 256-token prompt)."""

    def __init__(self, writer: str, reader: str) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvpool.integrations import vllm as kv
        self.kv = kv
        self.role = KVConnectorRole.WORKER
        self.layers = self.layer_names()
        self.tmp = self.model_dir()
        self.a, self.a_caches = self._worker(writer)
        self.b, self.b_caches = self._worker(reader)
        _check_size(sum(t[0].numel() * t.element_size() for t in self.a_caches.values()), "a vLLM block")
        for li, name in enumerate(self.layers):
            self.a_caches[name][:BATCH] = _random_kv(self.a_caches[name][:BATCH].shape, li)

    @staticmethod
    def model_dir() -> tempfile.TemporaryDirectory[str]:
        """A model directory vLLM's ModelConfig accepts: a config.json of this geometry, no weights."""
        d = tempfile.TemporaryDirectory(prefix="kvpool-bench-vllm-")
        with open(os.path.join(d.name, "config.json"), "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * HEAD,
                       "intermediate_size": 2 * HEADS * HEAD, "num_attention_heads": HEADS,
                       "num_key_value_heads": HEADS, "num_hidden_layers": LAYERS, "vocab_size": 1000,
                       "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float16",
                       "head_dim": HEAD}, f)
        return d

    @staticmethod
    def layer_names() -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]

    @staticmethod
    def config(model: str, transfer: dict[str, Any]) -> tuple[Any, Any]:
        """vLLM's configuration on CPU with ``transfer`` as its kv_transfer_config, and the KV cache
        configuration of SLOTS blocks that the engine core would give the workers."""
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

        os.environ["HF_HUB_OFFLINE"] = "1"
        mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype="float16", max_model_len=4096)
        config = VllmConfig(
            model_config=mc, cache_config=CacheConfig(block_size=TOKENS),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=8, max_model_len=4096,
                                             is_encoder_decoder=False),
            kv_transfer_config=KVTransferConfig(**transfer), device_config=DeviceConfig("cpu"))
        spec = FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
        page = spec.page_size_bytes
        layers = VllmConnectorBench.layer_names()
        # One backing allocation, layer-outermost (vLLM 0.34's KVCacheTensor: size is the total).
        kcc = KVCacheConfig(num_blocks=SLOTS,
                            kv_cache_tensors=[KVCacheTensor(size=page * SLOTS * LAYERS, layers=layers,
                                                            layer_stride=page * SLOTS, block_stride=page)],
                            kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
        config.cache_config.num_gpu_blocks = SLOTS
        return config, kcc

    def _worker(self, address: str) -> tuple[Any, dict[str, torch.Tensor]]:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        config, kcc = self.config(self.tmp.name, {
            "kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"address": address}})
        worker = KVConnectorFactory.create_connector(config, self.role, kcc)
        caches = {n: torch.zeros((SLOTS, HEADS, TOKENS, 2 * HEAD), dtype=DTYPE) for n in self.layers}
        worker.register_kv_caches(caches)
        return worker, caches

    def _tokens(self, i: int) -> tuple[int, ...]:
        g = torch.Generator().manual_seed(1_000_003 * (i + 1))
        return tuple(torch.randint(1, 999, (BATCH * TOKENS,), generator=g).tolist())

    def write(self, i: int) -> None:
        rid = f"w{i}"
        meta = self.kv.KVPoolConnectorMetadata(saves=[self.kv.BlockRange(rid, self._tokens(i), (), 0,
                                                                          tuple(range(BATCH)))])
        self.a.bind_connector_metadata(meta)
        self.a.wait_for_save()
        self.a.wait_for_all_saves()
        self.a.get_finished({rid})
        self.a.clear_connector_metadata()

    def prepare(self, i: int) -> None:
        for t in self.b_caches.values():
            _zero(t[BATCH:2 * BATCH])
        meta = self.kv.KVPoolConnectorMetadata(loads=[self.kv.BlockRange(f"r{i}", self._tokens(i), (), 0,
                                                                          tuple(range(BATCH, 2 * BATCH)))])
        self.b.bind_connector_metadata(meta)

    def load(self) -> int:
        self.b.start_load_kv(None)
        for name in self.layers:
            self.b.wait_for_layer_load(name)
        bad = len(self.b.get_block_ids_with_load_errors())
        self.b.clear_connector_metadata()
        return bad

    def verify(self) -> str:
        return next((w for n in self.layers if (w := _differ(self.b_caches[n][BATCH:2 * BATCH],
                                                             self.a_caches[n][:BATCH], f"blocks of {n}"))), "")

    def close(self) -> None:
        self.a.shutdown()
        self.b.shutdown()
        self.tmp.cleanup()


# -- vLLM: KVPoolSecondaryTier under OffloadingConnector + TieringOffloadingSpec -----------------


class VllmTierBench:
    """Two vLLM schedulers with OffloadingConnector + TieringOffloadingSpec whose secondary tier is
    KVPoolSecondaryTier (built by vLLM's SecondaryTierFactory, as tests/integrations/
    test_vllm_tier.py builds it); one chunk = one block = 1 MiB row of the CPU primary tier.  The
    manager's part is played by the transfer jobs it would submit: A's tier stores rows 0..15
    (submit_store), B's tier promotes the same keys into rows 16..31 (submit_load, timed until
    get_finished_jobs reports the job)."""

    def __init__(self, writer: str, reader: str) -> None:
        import importlib

        import numpy as np
        from vllm.v1.kv_offload.tiering.base import TransferJob

        # By name: the bench runs against checkouts with and without the module (the runner says so).
        tier_cls = importlib.import_module("kvpool.integrations.vllm_tier").KVPoolSecondaryTier
        self.np, self.job = np, TransferJob
        self.model = VllmConnectorBench.model_dir()
        self.schedulers: list[Any] = []
        self.a, self.a_rows = self._tier(writer, tier_cls)
        self.b, self.b_rows = self._tier(reader, tier_cls)
        _check_size(self.a_rows.shape[1], "a vLLM CPU-tier row")
        self.a_rows[:BATCH] = np.random.default_rng(7).integers(0, 256, (BATCH, OBJECT_BYTES), dtype=np.uint8)
        self.jobs = 0

    def _tier(self, address: str, cls: type) -> tuple[Any, Any]:
        import numpy as np
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        tier = {"type": cls.__name__, "module_path": cls.__module__, "address": address}
        config, kcc = VllmConnectorBench.config(self.model.name, {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                          "cpu_bytes_to_use": SLOTS * OBJECT_BYTES, "secondary_tiers": [tier]}})
        scheduler = Scheduler(config, kcc, StructuredOutputManager(config), block_size=TOKENS)
        manager = scheduler.connector.scheduler.manager
        got = manager.secondary_tiers[0]
        if not isinstance(got, cls):
            raise RuntimeError(f"vLLM built {got!r} as the secondary tier, not {cls.__name__}")
        self.schedulers.append(scheduler)
        return got, np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)

    @staticmethod
    def _keys(i: int) -> list[bytes]:
        import hashlib

        from vllm.v1.kv_offload.base import make_offload_key
        return [make_offload_key(hashlib.sha256(f"bench-{i}-{j}".encode()).digest(), 0) for j in range(BATCH)]

    def _job(self, i: int, first_row: int, load: bool) -> Any:
        from vllm.v1.kv_offload.base import ReqContext
        self.jobs += 1
        rows = self.np.arange(first_row, first_row + BATCH)
        return self.job(self.jobs, self._keys(i), rows, load, ReqContext(f"r{i}"))

    @staticmethod
    def _run(tier: Any, job: Any) -> bool:
        """Submit ``job`` and poll the tier until it reports it (as the manager polls): its success."""
        deadline = time.monotonic() + 60.0
        (tier.submit_load if job.is_promotion else tier.submit_store)(job)
        while True:
            done = [r for r in tier.get_finished_jobs() if r.job_id == job.job_id]
            if done:
                return bool(done[0].success)
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job.job_id} not finished in 60 s: {tier.stats}")
            time.sleep(0.0001)

    def write(self, i: int) -> None:
        if not self._run(self.a, self._job(i, 0, load=False)):
            raise RuntimeError(f"submit_store of batch {i} failed: {self.a.stats}")

    def prepare(self, i: int) -> None:
        self.b_rows[BATCH:2 * BATCH] = 0
        self.pending = self._job(i, BATCH, load=True)

    def load(self) -> int:
        loaded = self.b.stats["loaded"]
        self._run(self.b, self.pending)
        return BATCH - int(self.b.stats["loaded"] - loaded)

    def verify(self) -> str:
        same = self.np.array_equal(self.b_rows[BATCH:2 * BATCH], self.a_rows[:BATCH])
        return "" if same else "CPU-tier rows differ from what was stored"

    def close(self) -> None:
        self.a_rows = self.b_rows = None  # vLLM unmaps the regions: no view of them may outlive that
        for s in self.schedulers:
            s.connector.shutdown()
        self.model.cleanup()


# -- SGLang: KVPoolHiCacheStorage, v1 interface ------------------------------------------------


class SglangHiCacheBench:
    """Two KVPoolHiCacheStorage backends from SGLang's StorageBackendFactory ("dynamic"), each over
    its own MHATokenToKVPoolHost (page_first layout) of an MHATokenToKVPool on CPU."""

    def __init__(self, writer: str, reader: str) -> None:
        warnings.filterwarnings("ignore", message="Only CUDA", category=UserWarning)
        self.a, self.ha = self._backend(writer)
        self.b, self.hb = self._backend(reader)
        flat = self.ha.get_dummy_flat_data_page()
        _check_size(flat.numel() * flat.element_size(), "an SGLang host page")
        for p in range(BATCH):
            page = self.ha.get_data_page(p * TOKENS, flat=False)
            page.copy_(_random_kv(tuple(page.shape), p))

    @staticmethod
    def _backend(address: str) -> tuple[Any, Any]:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        kv = MHATokenToKVPool(SLOTS * TOKENS // 2, TOKENS, DTYPE, HEADS, HEAD, LAYERS, "cpu", False, start_layer=0,
                              end_layer=LAYERS - 1)
        host = MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2, 0, TOKENS, "page_first",
                                    pin_memory=False, device_capacity_tokens=kv.size, start_layer=kv.start_layer,
                                    end_layer=kv.end_layer, write_back_staging=kv.hicache_write_back_staging)
        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=True, model_name="bench-model",
            extra_config={"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
                          "class_name": "KVPoolHiCacheStorage", "interface_v1": 1, "address": address})
        backend = StorageBackendFactory.create_backend("dynamic", config, host)
        backend = getattr(backend, "_backend", backend)
        backend.register_mem_pool_host(host)
        return backend, host

    @staticmethod
    def _indices(first_page: int) -> torch.Tensor:
        return torch.arange(first_page * TOKENS, (first_page + BATCH) * TOKENS, dtype=torch.int64)

    @staticmethod
    def _keys(i: int) -> list[str]:
        return [f"{i:032x}{j:032x}" for j in range(BATCH)]

    def write(self, i: int) -> None:
        ok = self.a.batch_set_v1(self._keys(i), self._indices(0))
        if not all(ok):
            raise RuntimeError(f"batch_set_v1 stored {sum(ok)} of {len(ok)} pages")

    def prepare(self, i: int) -> None:
        for p in range(BATCH, 2 * BATCH):
            _zero(self.hb.get_data_page(p * TOKENS, flat=False))
        self.pending = (self._keys(i), self._indices(BATCH))

    def load(self) -> int:
        ok: list[bool] = self.b.batch_get_v1(*self.pending)
        return len(ok) - sum(ok)

    def verify(self) -> str:
        return next((w for p in range(BATCH) if (w := _differ(self.hb.get_data_page((BATCH + p) * TOKENS, flat=False),
                                                              self.ha.get_data_page(p * TOKENS, flat=False),
                                                              f"host page {p}"))), "")

    def close(self) -> None:
        self.a.close()
        self.b.close()


# -- LMCache: KVPoolRemoteConnector ---------------------------------------------------------------


class LmcacheConnectorBench:
    """An LMCacheEngine (LMCacheEngineBuilder, the kvpool remote storage plugin) on the reader
    sidecar; its connector's batched_get lands the chunks in memory objects of LMCache's local
    CPU backend.  The writer is a second KVPoolRemoteConnector on the writer sidecar over the same
    backend (same metadata, so the same keys), storing with batched_put."""

    def __init__(self, writer: str, reader: str) -> None:
        import asyncio

        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        from kvpool.integrations.lmcache import KVPoolRemoteConnector
        self.builder = LMCacheEngineBuilder
        self.id = f"kvpool-bench-{os.getpid()}"
        self.engine = LMCacheEngineBuilder.get_or_create(self.id, self._config(reader), self._metadata(),
                                                         _cpu_connector(), lambda t, r: None, lambda o, r: o)
        self.engine.post_init()
        sm = self.engine.storage_manager
        remote = [b for name, b in sm.storage_backends.items() if name.startswith("RemoteBackend")]
        conn = remote[0].connection
        self.b = getattr(conn, "_connector", conn)  # LMCache wraps it in its InstrumentedRemoteConnector
        if not isinstance(self.b, KVPoolRemoteConnector):
            raise RuntimeError(f"LMCache's remote backend is {self.b!r}, not the kvpool connector")
        self.loop = asyncio.new_event_loop()
        self.a = KVPoolRemoteConnector(self.loop, self.b.local_cpu_backend, self._config(writer))
        self.source = _random_kv((2, LAYERS, TOKENS, HEADS * HEAD), 7)
        self.got: list[Any] = []

    @staticmethod
    def _config(address: str) -> Any:
        from lmcache.v1.config import LMCacheEngineConfig
        return LMCacheEngineConfig.from_dict({
            "chunk_size": TOKENS, "local_cpu": True, "max_local_cpu_size": 0.25, "save_unfull_chunk": True,
            "pre_caching_hash_algorithm": "builtin", "remote_storage_plugins": ["kvpool"],
            "extra_config": {"remote_storage_plugin.kvpool.module_path": "kvpool.integrations.lmcache",
                             "remote_storage_plugin.kvpool.class_name": "KVPoolRemoteConnector",
                             "remote_storage_plugin.kvpool.address": address}})

    @staticmethod
    def _metadata() -> Any:
        from lmcache.v1.metadata import LMCacheMetadata
        return LMCacheMetadata(model_name="bench-model", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=DTYPE, kv_shape=(LAYERS, 2, TOKENS, HEADS, HEAD),
                               chunk_size=TOKENS)

    @staticmethod
    def _keys(i: int) -> list[Any]:
        from lmcache.utils import CacheEngineKey
        return [CacheEngineKey("bench-model", 1, 0, (i << 16) + j + 1, DTYPE) for j in range(BATCH)]

    def write(self, i: int) -> None:
        lcb = self.a.local_cpu_backend
        objs = []
        try:
            for _ in range(BATCH):
                m = lcb.allocate(self.a.meta_shapes, self.a.meta_dtypes, self.a.meta_fmt)
                if m is None:
                    raise RuntimeError("LMCache's CPU buffer is full")
                objs.append(m)
                _check_size(m.tensor.numel() * m.tensor.element_size(), "an LMCache chunk")
                m.tensor.copy_(self.source.view(m.tensor.shape))
            self.loop.run_until_complete(self.a.batched_put(self._keys(i), objs))
        finally:
            for m in objs:
                m.ref_count_down()
        if self.a.stats["refused"]:
            raise RuntimeError(f"batched_put refused {self.a.stats['refused']} chunks")

    def prepare(self, i: int) -> None:
        self._release()  # the previous batch's memory objects, as the engine frees them once used
        self.pending = self._keys(i)

    def load(self) -> int:
        self.got = self.loop.run_until_complete(self.b.batched_get(self.pending))
        return sum(g is None for g in self.got)

    def verify(self) -> str:
        for j, g in enumerate(self.got):
            if g is None or (w := _differ(g.tensor, self.source.view(g.tensor.shape), f"chunk {j}")):
                return "missing chunk" if g is None else w
        return ""

    def _release(self) -> None:
        for g in self.got:
            if g is not None:
                g.ref_count_down()
        self.got = []

    def close(self) -> None:
        self._release()
        self.loop.run_until_complete(self.a.close())
        loop = getattr(self.engine.storage_manager, "loop", None)
        self.builder.destroy(self.id)
        if loop is not None and not loop.is_running() and not loop.is_closed():
            loop.close()
        self.loop.close()


def _cpu_connector() -> Any:
    """LMCache needs a "GPU" connector to build an engine; batched_get never calls it."""
    from lmcache.v1.gpu_connector import GPUConnectorInterface

    class CPUConnector(GPUConnectorInterface):  # type: ignore[misc]
        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            raise NotImplementedError

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            raise NotImplementedError

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            raise NotImplementedError

        def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None,
                           **kwargs: Any) -> None:
            raise NotImplementedError

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, LAYERS, num_tokens, HEADS * HEAD])

    return CPUConnector()


BENCHES: dict[str, Callable[[str, str], Bench]] = {
    "vllm": VllmConnectorBench,
    "sglang": SglangHiCacheBench,
    "lmcache": LmcacheConnectorBench,
    "vllm_tier": VllmTierBench,
}
"""Engine name (bench/integrations.py names it) -> its bench, built from (writer, reader) addresses."""

VERSIONS = {"vllm": "vllm", "sglang": "sglang", "lmcache": "lmcache", "vllm_tier": "vllm"}
"""Engine name -> the distribution whose version the row reports."""


# -- the loop -----------------------------------------------------------------------------------


def _drain(client: Any, timeout: float = 60.0) -> None:
    """Wait until the sidecar's write-through backlog is empty: the store nodes hold the batch."""
    deadline = time.monotonic() + timeout
    while client.stats().pending_pool_bytes > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the writer sidecar's write-through did not drain in {timeout:.0f}s")
        time.sleep(0.002)


def _hits(client: Any) -> tuple[int, int]:
    from kvpool.wire.counters import SidecarCounter
    c = dict(client.stats().counters)
    return int(c.get(SidecarCounter.READ_HITS_POOL, 0)), int(c.get(SidecarCounter.READ_HITS_LOCAL, 0))


def run(engine: str, writer: str, reader: str, reps: int, warmup: int, roles: dict[str, list[int]]) -> dict[str, Any]:
    """Time ``reps`` loads (after ``warmup``), metering the CPU of this process (the client) and of
    ``roles`` (the cluster's processes) over the timed loads only."""
    from importlib.metadata import version

    import kvpool
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the bench package, for its meter
    from bench.common import CpuMeter, Row, with_cpu
    meter = CpuMeter({"client": [os.getpid()], **roles})
    bench = BENCHES[engine](writer, reader)
    wc, rc = kvpool.connect(writer), kvpool.connect(reader)
    try:
        times: list[float] = []
        failures = 0
        pool0, local0 = _hits(rc)
        for i in range(warmup + reps):
            bench.write(i)
            _drain(wc)
            bench.prepare(i)
            timed = i >= warmup
            if timed:
                meter.start()
            t0 = time.perf_counter()
            failures += bench.load()
            dt = time.perf_counter() - t0
            if timed:
                meter.stop()
                times.append(dt)
        pool1, local1 = _hits(rc)
        cpu = with_cpu(Row(engine, "load", OBJECT_BYTES, BATCH), meter, OBJECT_BYTES * BATCH * len(times))
        return {"times": times, "failures": failures, "verify": bench.verify(), "pool_hits": pool1 - pool0,
                "local_hits": local1 - local0, "version": f"{VERSIONS[engine]} {version(VERSIONS[engine])}",
                "cpu_s_per_gb": cpu.cpu_s_per_gb, "cpu_split": cpu.cpu_split}
    finally:
        bench.close()
        wc.close()
        rc.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", choices=sorted(BENCHES))
    ap.add_argument("--writer", required=True, help="address of the sidecar the objects are stored through")
    ap.add_argument("--reader", required=True, help="address of the sidecar the engine loads through")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--roles", default="{}",
                    help='JSON {"sidecar": [pids], "store": [pids]}: processes whose CPU the row counts too')
    args = ap.parse_args(argv)
    try:
        out = run(args.engine, args.writer, args.reader, args.reps, args.warmup, json.loads(args.roles))
    except Exception as e:
        traceback.print_exc()
        out = {"error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(out), flush=True)
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
