"""KVPoolRemoteConnector under LMCache's real LMCacheEngine, data through a LocalCluster.

Runs in the lmcache venv (tools/engines.sh; tests/integrations/test_engine_venvs.py runs it from the
main suite).  LMCache loads the connector itself from ``remote_storage_plugins`` + ``extra_config``;
the only stand-in is the "GPU" connector (LMCache's own mock moves no data): a CPU one that copies
tensor slices between a per-engine KV buffer and LMCache's memory objects.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata

from kvpool import LocalCluster
from kvpool.integrations.common import IntegrationConfigError
from kvpool.integrations.lmcache import KVPoolRemoteConnector
from kvpool.integrations.staging import PathStat

CHUNK = 32
LAYERS, HEADS, HEAD = 2, 2, 16
TOKENS = 1024  # the size of each engine's "GPU" KV buffer, in tokens


class CPUConnector(GPUConnectorInterface):  # type: ignore[misc]  # LMCache's classes are Any to mypy
    """Copies KV between a [2, layers, tokens, hidden] CPU buffer and memory objects (format KV_2LTD)."""

    def __init__(self) -> None:
        self.kv = torch.zeros((2, LAYERS, TOKENS, HEADS * HEAD), dtype=torch.float16)
        self.kvcaches = None

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        assert memory_obj.tensor is not None
        memory_obj.tensor.copy_(self.kv[:, :, start:end])

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        assert memory_obj.tensor is not None
        self.kv[:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int], **kwargs: Any) -> None:
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(m, s, e)

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kwargs: Any) -> None:
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(m, s, e)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, HEADS * HEAD])


def engine_config(address: str, **plugin: Any) -> LMCacheEngineConfig:
    # Staging of 1 MiB (16 of this model's 64 KiB chunks) rather than the default 256 MiB, which
    # each of the test's engines would hold (populated) for chunks this small.
    plugin = {"staging_mib": 1, **plugin}
    return LMCacheEngineConfig.from_dict({
        "chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.05, "save_unfull_chunk": True,
        # sha256_cbor (what a deployment wants: hashes equal across processes) is vLLM's; without vLLM
        # LMCache falls back to builtin anyway, which is consistent within this one test process.
        "pre_caching_hash_algorithm": "builtin",
        "remote_storage_plugins": ["kvpool"],
        "extra_config": {"remote_storage_plugin.kvpool.module_path": "kvpool.integrations.lmcache",
                         "remote_storage_plugin.kvpool.class_name": "KVPoolRemoteConnector",
                         "remote_storage_plugin.kvpool.address": address,
                         **{f"remote_storage_plugin.kvpool.{k}": v for k, v in plugin.items()}},
    })


def metadata() -> LMCacheMetadata:
    return LMCacheMetadata(model_name="tiny-llama", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.float16, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD))


_n = 0


class Engine:
    def __init__(self, address: str, **plugin: Any) -> None:
        global _n
        _n += 1
        self.id = f"kvpool-test-{_n}"
        self.gpu = CPUConnector()
        self.engine: LMCacheEngine = LMCacheEngineBuilder.get_or_create(
            self.id, engine_config(address, **plugin), metadata(), self.gpu, lambda t, r: None, lambda o, r: o)
        self.engine.post_init()

    def connector(self) -> KVPoolRemoteConnector:
        sm = self.engine.storage_manager
        assert sm is not None
        backends = [b for name, b in sm.storage_backends.items() if name.startswith("RemoteBackend")]
        assert len(backends) == 1, list(sm.storage_backends)
        conn = backends[0].connection
        conn = getattr(conn, "_connector", conn)  # LMCache wraps connectors in its InstrumentedRemoteConnector
        assert isinstance(conn, KVPoolRemoteConnector), conn
        return conn

    def close(self) -> None:
        sm = self.engine.storage_manager
        loop = getattr(sm, "loop", None)
        LMCacheEngineBuilder.destroy(self.id)
        # LMCache stops its storage loop but never closes it (its self-pipe sockets leak): close it here.
        if loop is not None and not loop.is_running() and not loop.is_closed():
            loop.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(stores=2, sidecars=3, block_tokens=CHUNK) as lc:
        yield lc


def fill(gpu: CPUConnector, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    gpu.kv[:, :, :n] = torch.randn((2, LAYERS, n, HEADS * HEAD), generator=g).half()


def wait(cond: Any, timeout: float = 20.0) -> None:
    import time
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_store_clear_local_and_retrieve_through_the_pool(cluster: LocalCluster) -> None:
    tokens = torch.randint(1, 30000, (5 * CHUNK + 7,), generator=torch.Generator().manual_seed(1))
    a = Engine(cluster.sidecars[0])
    try:
        conn = a.connector()
        fill(a.gpu, len(tokens), seed=2)
        expect = a.gpu.kv[:, :, :len(tokens)].clone()
        a.engine.store(tokens)
        wait(lambda: conn.stats["stored"] >= 6)  # 5 full chunks and the partial one, put asynchronously
        # Framed straight into reserved arena extents (no packing buffer, no put copy).
        assert (conn.stats[PathStat.ARENA_WRITES], conn.stats[PathStat.STAGED_WRITES]) == (6, 0)
    finally:
        a.close()

    b = Engine(cluster.sidecars[1])  # another engine, another sidecar: only the pool has the chunks
    try:
        assert b.engine.lookup(tokens) == len(tokens)
        a_only = b.engine.clear(locations=["LocalCPUBackend"])  # nothing local to clear: it is all remote
        assert a_only == 0
        mask = b.engine.retrieve(tokens)
        assert int(mask.sum()) == len(tokens)
        assert torch.equal(b.gpu.kv[:, :, :len(tokens)], expect)  # exact bytes back, the partial chunk included
        # The fast path: every chunk from the pool landed in registered staging, none in the arena.
        st = b.connector().stats
        assert st["hits"] >= 6 and st[PathStat.REGISTERED_LANDINGS] == st["hits"]
        assert (st[PathStat.ARENA_LANDINGS], st[PathStat.LOCAL_VIEWS]) == (0, 0)
        # Clear B's local tier: the next retrieve comes from the pool again, still exact.
        b.gpu.kv.zero_()
        b.engine.clear(locations=["LocalCPUBackend"])
        hits = b.connector().stats["hits"]
        mask = b.engine.retrieve(tokens)
        assert int(mask.sum()) == len(tokens) and torch.equal(b.gpu.kv[:, :, :len(tokens)], expect)
        assert b.connector().stats["hits"] > hits
        # A miss: other tokens are nowhere.
        other = torch.randint(1, 30000, (3 * CHUNK,), generator=torch.Generator().manual_seed(9))
        assert b.engine.lookup(other) == 0
        assert int(b.engine.retrieve(other).sum()) == 0
    finally:
        b.close()


def test_local_hits_are_copied_from_arena_views_not_staged(cluster: LocalCluster) -> None:
    tokens = torch.randint(1, 30000, (3 * CHUNK,), generator=torch.Generator().manual_seed(12))
    a = Engine(cluster.sidecars[0])
    try:
        conn = a.connector()
        fill(a.gpu, len(tokens), seed=13)
        expect = a.gpu.kv[:, :, :len(tokens)].clone()
        a.engine.store(tokens)
        wait(lambda: conn.stats["stored"] >= 3)
    finally:
        a.close()
    b = Engine(cluster.sidecars[0])  # the same sidecar: its arena has the chunks
    try:
        assert int(b.engine.retrieve(tokens).sum()) == len(tokens)
        assert torch.equal(b.gpu.kv[:, :, :len(tokens)], expect)
        st = b.connector().stats
        assert st["hits"] == 3 and st[PathStat.LOCAL_VIEWS] == 3
        assert (st[PathStat.REGISTERED_LANDINGS], st[PathStat.ARENA_LANDINGS]) == (0, 0)
    finally:
        b.close()


def test_connector_api_directly(cluster: LocalCluster) -> None:
    e = Engine(cluster.sidecars[1], staging_mib=0.07)  # one slot (a chunk here is 64 KiB): batches go in parts
    try:
        conn = e.connector()
        loop = asyncio.new_event_loop()
        try:
            keys = [CacheEngineKey("tiny-llama", 1, 0, 1000 + i, torch.float16) for i in range(3)]
            objs = []
            for i in range(3):
                m = conn.local_cpu_backend.allocate(conn.meta_shapes, conn.meta_dtypes, conn.meta_fmt)
                assert m is not None and m.tensor is not None
                m.tensor.copy_(torch.full(m.tensor.shape, float(i + 1)))
                objs.append(m)
            assert not conn.exists_sync(keys[0])
            loop.run_until_complete(conn.batched_put(keys[:2], objs[:2]))
            loop.run_until_complete(conn.put(keys[2], objs[2]))
            assert conn.exists_sync(keys[2]) and loop.run_until_complete(conn.exists(keys[1]))
            assert conn.batched_contains(keys) == 3
            missing = CacheEngineKey("tiny-llama", 1, 0, 999, torch.float16)
            assert conn.batched_contains([keys[0], missing, keys[2]]) == 1
            assert loop.run_until_complete(conn.batched_async_contains("l1", keys, pin=True)) == 3
            got = loop.run_until_complete(conn.batched_get(keys))
            for i, g in enumerate(got):
                assert g is not None and g.tensor is not None and torch.equal(g.tensor, objs[i].tensor)
                g.ref_count_down()
            assert loop.run_until_complete(conn.get(missing)) is None
            assert [o.tensor is not None for o in loop.run_until_complete(
                conn.batched_get_non_blocking("l2", [keys[0], missing, keys[2]]))] == [True]
            assert loop.run_until_complete(conn.list()) == []
            # remove drops the sidecar's local copy; the pool's committed copy stays until evicted.
            assert conn.remove_sync(keys[0]) and conn.exists_sync(keys[0])
            # Only in the pool now: the reads land in staging, one slot, so in three parts.
            assert conn._path.pool.slots == 1
            conn.client.remove([conn.pool_key(k) for k in keys[1:]])
            landed = conn.stats[PathStat.REGISTERED_LANDINGS]
            got = loop.run_until_complete(conn.batched_get(keys))
            for i, g in enumerate(got):
                assert g is not None and g.tensor is not None and torch.equal(g.tensor, objs[i].tensor)
                g.ref_count_down()
            assert conn.stats[PathStat.REGISTERED_LANDINGS] - landed == 3 and conn.stats[PathStat.ARENA_LANDINGS] == 0
            for o in objs:
                o.ref_count_down()
        finally:
            loop.close()
    finally:
        e.close()


def test_corrupted_chunk_is_a_miss_not_wrong_kv(cluster: LocalCluster) -> None:
    tokens = torch.randint(1, 30000, (4 * CHUNK,), generator=torch.Generator().manual_seed(5))
    a = Engine(cluster.sidecars[2])
    try:
        conn = a.connector()
        fill(a.gpu, len(tokens), seed=6)
        a.engine.store(tokens)
        wait(lambda: conn.stats["stored"] >= 4)
        # Flip a byte of chunk 2's stored KV where it rests: the sidecar's shared-memory arena.
        client = conn.client
        # The chunk keys LMCache made for these tokens, as the connector maps them.
        ce_keys = [key for _, _, key in a.engine.token_database.process_tokens(tokens)]
        pk = conn.pool_key(ce_keys[2])
        with client.get([pk]) as views:
            addr = np.frombuffer(views[0], dtype=np.uint8).ctypes.data
            base = np.frombuffer(client._arena, dtype=np.uint8).ctypes.data
            off = addr - base + len(views[0]) - 1
        client._arena[off] ^= 0xFF
    finally:
        a.close()

    d = Engine(cluster.sidecars[2])  # same sidecar: it serves the damaged copy
    try:
        c = d.connector()
        d.gpu.kv.fill_(7.0)
        mask = d.engine.retrieve(tokens)
        # Chunks 0 and 1 come back; chunk 2 is detected and not loaded, so neither are those after it.
        assert int(mask.sum()) == 2 * CHUNK
        assert c.stats["rejected"] == 1
        assert bool((d.gpu.kv[:, :, 2 * CHUNK:4 * CHUNK] == 7.0).all())  # nothing damaged reached the KV
    finally:
        d.close()


def test_bad_plugin_configuration_is_refused(cluster: LocalCluster) -> None:
    e = Engine(cluster.sidecars[0])
    try:
        lcb = e.connector().local_cpu_backend
        loop = asyncio.new_event_loop()
        with pytest.raises(IntegrationConfigError, match="unknown kvpool setting.*adress"):
            KVPoolRemoteConnector(loop, lcb, engine_config(cluster.sidecars[0], adress="x"))
        with pytest.raises(IntegrationConfigError, match="unix://"):
            KVPoolRemoteConnector(loop, lcb, engine_config("tcp://127.0.0.1:1"))
        for bad in ({"fetch_decision": "maybe"}, {"prefill_tokens_per_s": 0}, {"estimate_refresh_ms": "soon"}):
            with pytest.raises(IntegrationConfigError, match=f"kvpool.{next(iter(bad))}"):
                KVPoolRemoteConnector(loop, lcb, engine_config(cluster.sidecars[0], **bad))
        loop.close()
    finally:
        e.close()


def test_lookup_fetch_or_recompute_short_recomputed_long_loaded(cluster: LocalCluster,
                                                                read_from_pool: Any) -> None:
    """LMCache's lookup asks the connector; below the crossover it hears 0 chunks and retrieves
    nothing (the engine prefills them).  The pool's read bandwidth and lookup time are what
    sidecar 1 measured; the prefill rate is configured to put the crossover between 1 and 24
    chunks (their geometric mean); the estimates are read once (``estimate_refresh_ms`` of an
    hour), so the decisions are made on exactly the values read here."""
    def toks(seed: int, n: int) -> torch.Tensor:
        return torch.randint(1, 30000, (n,), generator=torch.Generator().manual_seed(seed))
    short, long, warm = toks(40, CHUNK), toks(41, 24 * CHUNK), toks(42, 16 * CHUNK)
    a = Engine(cluster.sidecars[0])
    try:
        conn = a.connector()
        fill(a.gpu, len(long), seed=43)
        expect = a.gpu.kv[:, :, :len(long)].clone()
        for t in (short, long, warm):
            a.engine.store(t)
        wait(lambda: conn.stats["stored"] >= 41)
        warm_keys = [conn.pool_key(key) for _, _, key in a.engine.token_database.process_tokens(warm)]
        bytes_per_token = conn.bytes_per_token
    finally:
        a.close()
    s = read_from_pool(cluster, warm_keys[:16], 4)  # sidecar 1 measures its pool: chunks it never held
    assert s.pool_read_samples >= 4
    rate = 1.0 / (bytes_per_token / s.pool_read_bytes_per_s + s.lookup_seconds / (CHUNK * 24 * CHUNK) ** 0.5)
    b = Engine(cluster.sidecars[1], prefill_tokens_per_s=rate, estimate_refresh_ms=3_600_000)
    try:
        c = b.connector()
        assert b.engine.lookup(short) == 0
        assert int(b.engine.retrieve(short).sum()) == 0 and c.stats["hits"] == 0
        assert c.stats["recomputed_cheaper"] == 1 and c.stats["recomputed_cheaper_tokens"] == CHUNK
        assert b.engine.lookup(long) == len(long)
        assert int(b.engine.retrieve(long).sum()) == len(long)
        assert torch.equal(b.gpu.kv[:, :, :len(long)], expect)
        assert c.stats["loaded"] == 1 and c.stats["last_matched_tokens"] == len(long)
        assert c.stats["last_pool_read_bytes_per_s"] == int(s.pool_read_bytes_per_s)
    finally:
        b.close()
