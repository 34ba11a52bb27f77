"""KVPoolHiCacheStorage loaded by SGLang's real StorageBackendFactory ("dynamic"), over SGLang's real
device and host KV pools on CPU, data through a LocalCluster.

Runs in the sglang venv (tools/engines.sh; tests/integrations/test_engine_venvs.py runs it from the
main suite).  Not driven here: the HiCacheController's backup/prefetch threads (they need SGLang's
distributed context); the calls they make (batch_set_v1, batch_exists, batch_get_v1) are made directly.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

# SGLang warns at import that its CUDA-only quantization kernels are unavailable on CPU.
warnings.filterwarnings("ignore", message="Only CUDA", category=UserWarning)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvpool import LocalCluster  # noqa: E402
from kvpool.integrations.common import IntegrationConfigError  # noqa: E402
from kvpool.integrations.sglang import KVPoolHiCacheStorage  # noqa: E402

PAGE, HEADS, LAYERS, DIM = 16, 2, 2, 16


def storage_config(address: str, **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny-llama",
        extra_config={"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
                      "class_name": "KVPoolHiCacheStorage", "interface_v1": 1, "address": address, **extra})


def host_pool() -> MHATokenToKVPoolHost:
    kv = MHATokenToKVPool(512, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False, start_layer=0,
                          end_layer=LAYERS - 1)
    return MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, "page_first",
                                pin_memory=False, device_capacity_tokens=kv.size, start_layer=kv.start_layer,
                                end_layer=kv.end_layer, write_back_staging=kv.hicache_write_back_staging)


def backend(address: str) -> tuple[KVPoolHiCacheStorage, MHATokenToKVPoolHost]:
    host = host_pool()
    b = StorageBackendFactory.create_backend("dynamic", storage_config(address), host)
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
    want = pages(ha, 3, 5)
    a.close()

    b, hb = backend(cluster.sidecars[1])  # another sidecar: pages come from the store nodes
    try:
        assert b.batch_exists(keys) == 5
        assert b.batch_exists(keys[:2] + ["f" * 64] + keys[3:]) == 2  # the leading run of hits
        assert b.batch_get_v1(keys, page_indices(10, 5)) == [True] * 5
        got = pages(hb, 10, 5)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        # Misses: unknown pages are not found and leave the host pool alone.
        before = pages(hb, 20, 2)
        assert b.batch_exists(["e" * 64, "d" * 64]) == 0
        assert b.batch_get_v1(["e" * 64, "d" * 64], page_indices(20, 2)) == [False, False]
        assert all(torch.equal(x, y) for x, y in zip(pages(hb, 20, 2), before, strict=True))
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


def test_a_corrupted_page_is_detected_and_not_loaded(cluster: LocalCluster) -> None:
    a, ha = backend(cluster.sidecars[2])
    keys = [f"c{i:063x}" for i in range(4)]
    fill(ha, 0, 4, seed=7)
    assert a.batch_set_v1(keys, page_indices(0, 4)) == [True] * 4
    want = pages(ha, 0, 4)
    client = a.client
    with client.get([a.pool_key(keys[1])]) as views:  # flip a byte of page 1 where it rests: the sidecar's arena
        addr = np.frombuffer(views[0], dtype=np.uint8).ctypes.data
        base = np.frombuffer(client._arena, dtype=np.uint8).ctypes.data
        off = addr - base + len(views[0]) - 1
    client._arena[off] ^= 0xFF
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
    b, _ = backend(cluster.sidecars[0])
    try:
        with pytest.raises(IntegrationConfigError, match="host indices"):
            b.batch_get_v1(["k"], torch.arange(3))
    finally:
        b.close()
