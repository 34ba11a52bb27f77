"""KVPoolHiCacheStorage loaded by SGLang's real StorageBackendFactory ("dynamic"), over SGLang's real
device and host KV pools on CPU, data through a LocalCluster.

Runs in the sglang venv (tools/engines.sh; tests/integrations/test_engine_venvs.py runs it from the
main suite).  Two levels: the backend's calls made directly (first tests), then SGLang's real
HiCacheController with the backend attached as the scheduler attaches it, its own backup and prefetch
threads calling batch_set_v1, batch_exists and batch_get_v1 (``test_controller_*``).  The test plays
the scheduler thread's part (HiRadixCache's: allocate host pages for a hit, hand them to the
prefetch buffer, drain the ack queues), waiting on the controller's queues, never on time.  Not
driven: the controller's device<->host copies (SGLang's CPU build has no transfer kernels), so host
pages are filled directly, as a device-to-host write would leave them.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

# SGLang warns at import that its CUDA-only quantization kernels are unavailable on CPU.
warnings.filterwarnings("ignore", message="Only CUDA", category=UserWarning)

from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from kvpool import LocalCluster  # noqa: E402
from kvpool.integrations.common import IntegrationConfigError  # noqa: E402
from kvpool.integrations.sglang import KVPoolHiCacheStorage  # noqa: E402
from kvpool.integrations.staging import PathStat  # noqa: E402
from kvpool.wire.counters import SidecarCounter  # noqa: E402

PAGE, HEADS, LAYERS, DIM = 16, 2, 2, 16


def storage_config(address: str, **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny-llama",
        extra_config={"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
                      "class_name": "KVPoolHiCacheStorage", "interface_v1": 1, "address": address, **extra})


def device_pool() -> MHATokenToKVPool:
    return MHATokenToKVPool(512, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False, start_layer=0,
                            end_layer=LAYERS - 1)


def host_pool(kv: MHATokenToKVPool | None = None) -> MHATokenToKVPoolHost:
    kv = kv if kv is not None else device_pool()
    return MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, "page_first",
                                pin_memory=False, device_capacity_tokens=kv.size, start_layer=kv.start_layer,
                                end_layer=kv.end_layer, write_back_staging=kv.hicache_write_back_staging)


def backend(address: str, **extra: Any) -> tuple[KVPoolHiCacheStorage, MHATokenToKVPoolHost]:
    host = host_pool()
    b = StorageBackendFactory.create_backend("dynamic", storage_config(address, **extra), host)
    b = getattr(b, "_backend", b)  # SGLang may wrap it (failure injector) when configured to
    assert isinstance(b, KVPoolHiCacheStorage)
    b.register_mem_pool_host(host)
    return b, host


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(stores=2, sidecars=3, block_tokens=PAGE) as lc:
        yield lc


def page_indices(first_page: int, n: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)


def fill(host: MHATokenToKVPoolHost, first_page: int, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in range(first_page, first_page + n):
        page = host.get_data_page(p * PAGE, flat=False)
        page.copy_(torch.randn(page.shape, generator=g).half())


def pages(host: MHATokenToKVPoolHost, first_page: int, n: int) -> list[torch.Tensor]:
    return [host.get_data_page(p * PAGE, flat=False).clone() for p in range(first_page, first_page + n)]


def test_v1_pages_round_trip_between_two_engines(cluster: LocalCluster) -> None:
    a, ha = backend(cluster.sidecars[0])
    keys = [f"{i:064x}" for i in range(1, 6)]
    fill(ha, 3, 5, seed=1)
    assert a.batch_set_v1(keys, page_indices(3, 5)) == [True] * 5
    # Copied from the host pages straight into reserved arena extents (no framing buffer, no put copy).
    assert (a.stats[PathStat.ARENA_WRITES], a.stats[PathStat.STAGED_WRITES]) == (5, 0)
    want = pages(ha, 3, 5)
    a.close()

    b, hb = backend(cluster.sidecars[1])  # another sidecar: pages come from the store nodes
    try:
        assert b.batch_exists(keys) == 5
        assert b.batch_exists(keys[:2] + ["f" * 64] + keys[3:]) == 2  # the leading run of hits
        s0 = b.client.stats()
        assert b.batch_get_v1(keys, page_indices(10, 5)) == [True] * 5
        s1 = b.client.stats()
        got = pages(hb, 10, 5)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        # The fast path: fetched from the pool into registered staging, nothing landed in the arena.
        assert (b.stats[PathStat.REGISTERED_LANDINGS], b.stats[PathStat.ARENA_LANDINGS],
                b.stats[PathStat.LOCAL_VIEWS]) == (5, 0, 0)
        # Consecutive pages from evenly spaced staging slots: one copy for the run, not one per page.
        assert b.stats[PathStat.RUN_COPIES] == 5
        assert s1.counters[SidecarCounter.READ_HITS_POOL] - s0.counters[SidecarCounter.READ_HITS_POOL] == 5
        assert s1.local_objects == s0.local_objects
        # Misses: unknown pages are not found and leave the host pool alone.
        before = pages(hb, 20, 2)
        assert b.batch_exists(["e" * 64, "d" * 64]) == 0
        assert b.batch_get_v1(["e" * 64, "d" * 64], page_indices(20, 2)) == [False, False]
        assert all(torch.equal(x, y) for x, y in zip(pages(hb, 20, 2), before, strict=True))
    finally:
        b.close()


def test_local_hits_are_copied_from_arena_views_not_staged(cluster: LocalCluster) -> None:
    a, ha = backend(cluster.sidecars[0])
    keys = [f"l{i:063x}" for i in range(3)]
    fill(ha, 0, 3, seed=3)
    assert a.batch_set_v1(keys, page_indices(0, 3)) == [True] * 3
    want = pages(ha, 0, 3)
    a.close()
    b, hb = backend(cluster.sidecars[0])  # the same sidecar: its arena has them
    try:
        assert b.batch_get_v1(keys, page_indices(4, 3)) == [True] * 3
        assert all(torch.equal(g, w) for g, w in zip(pages(hb, 4, 3), want, strict=True))
        assert (b.stats[PathStat.LOCAL_VIEWS], b.stats[PathStat.REGISTERED_LANDINGS],
                b.stats[PathStat.ARENA_LANDINGS]) == (3, 0, 0)
    finally:
        b.close()


def test_a_batch_larger_than_staging_lands_in_parts_all_registered(cluster: LocalCluster) -> None:
    a, ha = backend(cluster.sidecars[0])
    keys = [f"p{i:063x}" for i in range(5)]
    fill(ha, 0, 5, seed=4)
    assert a.batch_set_v1(keys, page_indices(0, 5)) == [True] * 5
    want = pages(ha, 0, 5)
    slot = 32 + a.page_bytes
    a.close()
    b, hb = backend(cluster.sidecars[1], staging_mib=2 * slot / 2**20)  # two slots for five pages
    try:
        assert b._path is not None and b._path.pool.slots == 2
        assert b.batch_get_v1(keys, page_indices(6, 5)) == [True] * 5
        assert all(torch.equal(g, w) for g, w in zip(pages(hb, 6, 5), want, strict=True))
        assert (b.stats[PathStat.REGISTERED_LANDINGS], b.stats[PathStat.ARENA_LANDINGS],
                b.stats[PathStat.STAGING_WAITS]) == (5, 0, 0)
        assert b._path.pool.free == 2
    finally:
        b.close()


def test_v0_tensors_get_set_exists(cluster: LocalCluster) -> None:
    b, _ = backend(cluster.sidecars[1])
    try:
        vals = [torch.randn((2, PAGE, LAYERS, HEADS, DIM), generator=torch.Generator().manual_seed(i)).half()
                for i in range(3)]
        keys = [f"v0-{i}" for i in range(3)]
        assert not b.exists(keys[0])
        assert b.set(keys[0], vals[0]) and b.batch_set(keys[1:], vals[1:])
        assert b.exists(keys[2]) and b.batch_exists(keys) == 3
        outs = [torch.empty_like(v) for v in vals]
        got = b.batch_get(keys, outs)
        assert all(g is o for g, o in zip(got, outs, strict=True))
        assert all(torch.equal(o, v) for o, v in zip(outs, vals, strict=True))
        assert b.get("nope", torch.empty_like(vals[0])) is None
    finally:
        b.close()


def corrupt_last_byte(b: KVPoolHiCacheStorage, key: str) -> None:
    """Flip the last byte of the page stored under ``key`` where it rests: the sidecar's arena."""
    client = b.client
    with client.get([b.pool_key(key)]) as views:
        addr = np.frombuffer(views[0], dtype=np.uint8).ctypes.data
        base = np.frombuffer(client._arena, dtype=np.uint8).ctypes.data
        off = addr - base + len(views[0]) - 1
    client._arena[off] ^= 0xFF


def test_a_corrupted_page_is_detected_and_not_loaded(cluster: LocalCluster) -> None:
    a, ha = backend(cluster.sidecars[2])
    keys = [f"c{i:063x}" for i in range(4)]
    fill(ha, 0, 4, seed=7)
    assert a.batch_set_v1(keys, page_indices(0, 4)) == [True] * 4
    want = pages(ha, 0, 4)
    corrupt_last_byte(a, keys[1])
    a.close()

    d, hd = backend(cluster.sidecars[2])  # same sidecar: it serves the damaged copy
    try:
        hd.kv_buffer.fill_(3.0)
        assert d.batch_get_v1(keys, page_indices(8, 4)) == [True, False, False, False]
        assert d.stats["rejected"] == 1
        got = pages(hd, 8, 4)
        assert torch.equal(got[0], want[0])
        assert all(bool((g == 3.0).all()) for g in got[1:])  # nothing damaged reached the host pool
    finally:
        d.close()


def test_bad_configuration_is_refused(cluster: LocalCluster) -> None:
    with pytest.raises(IntegrationConfigError, match="unknown kvpool setting.*adress"):
        StorageBackendFactory.create_backend("dynamic", storage_config(cluster.sidecars[0], adress="x"), None)
    with pytest.raises(IntegrationConfigError, match="unix://"):
        StorageBackendFactory.create_backend("dynamic", storage_config("tcp://127.0.0.1:1"), None)
    with pytest.raises(IntegrationConfigError, match="staging_wait_ms"):
        StorageBackendFactory.create_backend("dynamic", storage_config(cluster.sidecars[0], staging_wait_ms="x"),
                                             None)
    for bad in ({"fetch_decision": "never"}, {"prefill_tokens_per_s": "fast"}, {"estimate_refresh_ms": 1.5}):
        with pytest.raises(IntegrationConfigError, match=next(iter(bad))):
            StorageBackendFactory.create_backend("dynamic", storage_config(cluster.sidecars[0], **bad), None)
    b, _ = backend(cluster.sidecars[0])
    try:
        with pytest.raises(IntegrationConfigError, match="host indices"):
            b.batch_get_v1(["k"], torch.arange(3))
    finally:
        b.close()


# -- SGLang's real HiCacheController --------------------------------------------------------------

QUEUE_WAIT = 60.0  # an upper bound on one controller step, not a pacing sleep: each wait ends on a queue item


@contextmanager
def hicache(address: str, **settings: Any) -> Iterator[tuple[HiCacheController, MHATokenToKVPoolHost]]:
    """One engine's HiCache: device pool + paged allocator + host pool + the real controller, the kvpool
    backend attached through the dynamic factory exactly as ``--hicache-storage-backend dynamic`` does."""
    kv = device_pool()
    host = host_pool(kv)
    allocator = PagedTokenToKVPoolAllocator(kv.size, PAGE, torch.float16, "cpu", kv, False)
    c = HiCacheController(allocator, host, PAGE, None, threading.Event(), io_backend="direct")
    extra = storage_config(address, **settings).extra_config
    # A launched SGLang publishes its parallel topology; this process has none, so state the single
    # rank the controller derives the storage config (TP/PP ranks) from.  tp_group None: no
    # cross-rank all-reduce of hit counts (that is what one rank does too: it skips 1-wide groups).
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0):
        c.attach_storage_backend("dynamic", prefetch_threshold=PAGE, model_name="tiny-llama",
                                 storage_backend_extra_config=dict(extra))
    try:
        assert isinstance(c.storage_backend, KVPoolHiCacheStorage)
        # interface_v1 selects the zero-copy page functions: the threads call batch_{get,set}_v1.
        assert c.page_set_func.__func__ is HiCacheController._page_set_zero_copy
        assert c.page_get_func.__func__ is HiCacheController._page_get_zero_copy
        yield c, host
    finally:
        c.detach_storage_backend()


def backup(c: HiCacheController, host_indices: torch.Tensor, tokens: list[int]) -> int:
    """The scheduler's write_backup_storage: hand host pages to the backup thread, wait for its ack."""
    op_id = c.write_storage(host_indices, tokens, hash_value=get_storage_hash_str(tokens, None, page_size=PAGE))
    done = c.ack_backup_queue.get(timeout=QUEUE_WAIT)
    assert done.id == op_id
    return int(done.completed_tokens)


def prefetch(c: HiCacheController, rid: str, tokens: list[int]) -> tuple[PrefetchOperation, int]:
    """The scheduler's side of one prefetch: the prefetch thread's hit query comes back on
    prefetch_hit_queue; a hit gets host pages and goes to the I/O thread, whose acks end with
    completed_req.  Returns the operation and the tokens it loaded."""
    op = c.prefetch(rid, tokens)
    hit = c.prefetch_hit_queue.get(timeout=QUEUE_WAIT)
    assert hit is op
    if op.storage_hit_count < c.prefetch_threshold:  # HiRadixCache revokes: nothing is transferred
        return op, 0
    op.host_indices = c.alloc_prefetch_host_buffers(op, op.storage_hit_count)
    assert op.host_indices is not None
    c.prefetch_buffer.put(op)
    loaded = 0
    while True:
        ack = c.ack_prefetch_queue.get(timeout=QUEUE_WAIT)
        assert ack.operation is op
        if ack.completed_tokens is not None:
            loaded = ack.completed_tokens
        if ack.completed_req:
            return op, loaded


def host_pages(host: MHATokenToKVPoolHost, indices: torch.Tensor) -> list[torch.Tensor]:
    return [host.get_data_page(int(indices[i]), flat=False).clone() for i in range(0, len(indices), PAGE)]


def fill_pages(host: MHATokenToKVPoolHost, indices: torch.Tensor, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    for i in range(0, len(indices), PAGE):
        page = host.get_data_page(int(indices[i]), flat=False)
        page.copy_(torch.randn(page.shape, generator=g).half())
    return host_pages(host, indices)


def tokens_of(first: int, pages_: int) -> list[int]:
    return list(range(first, first + pages_ * PAGE))


def test_controller_backup_thread_stores_and_prefetch_thread_loads_exact_pages(cluster: LocalCluster) -> None:
    tokens = tokens_of(1000, 4)
    with hicache(cluster.sidecars[0]) as (a, ha):
        hi = ha.alloc(len(tokens))
        want = fill_pages(ha, hi, seed=11)
        assert backup(a, hi, tokens) == len(tokens)
        assert a.storage_backend.stats["stored"] == 4
        # Drop the local copy: the host pages are freed and wiped, only kvpool holds them.
        a.evict_host(hi)
        ha.kv_buffer.zero_()
        op, loaded = prefetch(a, "a-again", tokens)
        assert op.storage_hit_count == len(tokens) and loaded == len(tokens)
        assert all(torch.equal(g, w) for g, w in zip(host_pages(ha, op.host_indices), want, strict=True))

    with hicache(cluster.sidecars[1]) as (b, hb):  # another engine on another sidecar: via the store nodes
        op, loaded = prefetch(b, "b", tokens)
        assert loaded == len(tokens)
        assert all(torch.equal(g, w) for g, w in zip(host_pages(hb, op.host_indices), want, strict=True))
        # SGLang's prefetch thread read them through the fast path: landed in registered staging.
        assert b.storage_backend.stats[PathStat.REGISTERED_LANDINGS] == 4
        assert b.storage_backend.stats[PathStat.ARENA_LANDINGS] == 0
        # A request sharing the first two pages only: the hash chain hits exactly those two.
        op, loaded = prefetch(b, "b-fork", tokens[:2 * PAGE] + tokens_of(5000, 2))
        assert op.storage_hit_count == 2 * PAGE and loaded == 2 * PAGE
        assert all(torch.equal(g, w) for g, w in zip(host_pages(hb, op.host_indices), want[:2], strict=True))
        assert b.storage_backend.stats["rejected"] == 0


def test_controller_miss_prefetches_nothing(cluster: LocalCluster) -> None:
    with hicache(cluster.sidecars[1]) as (c, host):
        free_before = host.available_size()
        host.kv_buffer.fill_(5.0)
        op, loaded = prefetch(c, "miss", tokens_of(9000, 3))
        assert op.storage_hit_count == 0 and op.hash_value == [] and loaded == 0
        assert op.host_indices is None and host.available_size() == free_before
        assert bool((host.kv_buffer == 5.0).all())
        assert c.storage_backend.stats["hits"] == 0  # batch_get_v1 was never reached


def test_controller_detects_a_corrupted_page_and_loads_only_the_run_before_it(cluster: LocalCluster) -> None:
    tokens = tokens_of(20000, 4)
    with hicache(cluster.sidecars[2]) as (c, host):
        hi = host.alloc(len(tokens))
        want = fill_pages(host, hi, seed=23)
        assert backup(c, hi, tokens) == len(tokens)
        corrupt_last_byte(c.storage_backend, get_storage_hash_str(tokens, None, page_size=PAGE)[1])
        c.evict_host(hi)
        host.kv_buffer.fill_(3.0)
        op, loaded = prefetch(c, "damaged", tokens)
        # The existence query does not read the bytes (one match); the load checks them and stops.
        assert op.storage_hit_count == len(tokens)
        assert loaded == PAGE
        assert c.storage_backend.stats["rejected"] == 1
        got = host_pages(host, op.host_indices)
        assert torch.equal(got[0], want[0])
        assert all(bool((g == 3.0).all()) for g in got[1:])  # nothing damaged reached the host pool


def test_controller_prefetch_fetch_or_recompute_short_recomputed_long_loaded(cluster: LocalCluster,
                                                                             read_from_pool: Any) -> None:
    """SGLang's prefetch thread asks batch_exists; below the crossover it hears 0 pages and starts no
    prefetch (SGLang prefills them).  The pool's read bandwidth and lookup time are what sidecar 1
    measured; the prefill rate is configured to put the crossover between 1 and 24 pages (their
    geometric mean); the estimates are read once (``estimate_refresh_ms`` of an hour), so the
    decisions are made on exactly the values read here."""
    short, long, warm = tokens_of(30000, 1), tokens_of(31000, 24), tokens_of(32000, 16)
    with hicache(cluster.sidecars[0]) as (a, ha):
        for seed, t in enumerate((short, long, warm)):
            hi = ha.alloc(len(t))
            fill_pages(ha, hi, seed=seed)
            assert backup(a, hi, t) == len(t)
            ha.free(hi)
        warm_keys = [a.storage_backend.pool_key(h) for h in get_storage_hash_str(warm, None, page_size=PAGE)]
    s = read_from_pool(cluster, warm_keys[:16], 4)  # sidecar 1 measures its pool: pages it never held
    assert s.pool_read_samples >= 4
    page_bytes = 2 * LAYERS * PAGE * HEADS * DIM * 2
    rate = 1.0 / (page_bytes / PAGE / s.pool_read_bytes_per_s + s.lookup_seconds / (PAGE * 24 * PAGE) ** 0.5)
    with hicache(cluster.sidecars[1], prefill_tokens_per_s=rate, estimate_refresh_ms=3_600_000) as (b, hb):
        backend_ = b.storage_backend
        assert isinstance(backend_, KVPoolHiCacheStorage) and backend_.page_bytes == page_bytes
        op, loaded = prefetch(b, "short", short)
        assert op.storage_hit_count == 0 and loaded == 0 and op.host_indices is None
        assert backend_.stats["recomputed_cheaper"] == 1 and backend_.stats["recomputed_cheaper_tokens"] == PAGE
        assert backend_.stats["hits"] == 0  # batch_get_v1 was never reached
        op, loaded = prefetch(b, "long", long)
        assert op.storage_hit_count == len(long) and loaded == len(long)
        assert backend_.stats["loaded"] == 1 and backend_.stats["last_matched_tokens"] == len(long)
        assert backend_.stats["last_pool_read_bytes_per_s"] == int(s.pool_read_bytes_per_s)
        prefetch(b, "missing", tokens_of(33000, 2))
        assert backend_.get_stats()["recomputed_missing"] == 1
