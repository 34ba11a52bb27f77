"""KVPoolConnector under vLLM's real v1 Scheduler and KVConnectorFactory, data through a LocalCluster.

Runs in the vllm venv (tools/engines.sh; tests/integrations/test_engine_venvs.py runs it from the
main suite).  The model's forward is a stand-in that writes a deterministic K/V per (layer, token,
position) into the paged cache at the slots vLLM's scheduler gave each token; everything else
(scheduling, block allocation, prefix cache, the connector's load/save calls and vLLM's recovery
from failed loads) is vLLM's own code.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvpool import LocalCluster
from kvpool.integrations.common import IntegrationConfigError
from kvpool.integrations.staging import PathStat
from kvpool.integrations.vllm import KVPoolConnector
from kvpool.wire.counters import SidecarCounter
from kvpool.wire.proto import store_pb2 as pb

BS = 16  # vLLM block size = kvpool block tokens
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS, HEAD = 2, 16
NUM_BLOCKS = 96
CPU_LAYOUT = "cpu"  # vLLM's CPU backend: [num_blocks, kv_heads, block_size, 2 * head_size]
KV_FIRST = "kv-first"  # the CUDA flash-attention style: [2, num_blocks, block_size, kv_heads, head_size]


def vllm_config(model_dir: Path, address: str, role: str = "kv_both", **extra: Any) -> VllmConfig:
    os.environ["HF_HUB_OFFLINE"] = "1"
    mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=1024)
    return VllmConfig(
        model_config=mc, cache_config=CacheConfig(block_size=BS),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8, max_model_len=1024,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector="KVPoolConnector",
                                            kv_connector_module_path="kvpool.integrations.vllm", kv_role=role,
                                            kv_load_failure_policy="recompute",
                                            kv_connector_extra_config={"address": address, **extra}),
        device_config=DeviceConfig("cpu"))


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
    page = spec.page_size_bytes
    return KVCacheConfig(num_blocks=NUM_BLOCKS,
                         kv_cache_tensors=[KVCacheTensor(size=page * NUM_BLOCKS, layers=[n],
                                                         layer_stride=page * NUM_BLOCKS, block_stride=page)
                                           for n in LAYERS],
                         kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


class Engine:
    """vLLM's scheduler and a worker-role connector over one paged KV cache."""

    def __init__(self, model_dir: Path, address: str, layout: str = CPU_LAYOUT, role: str = "kv_both",
                 **extra: Any) -> None:
        self.config = vllm_config(model_dir, address, role, **extra)
        kcc = kv_cache_config()
        self.config.cache_config.num_gpu_blocks = NUM_BLOCKS  # what the engine core sets after profiling
        self.scheduler = Scheduler(self.config, kcc, StructuredOutputManager(self.config), block_size=BS)
        worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, kcc)
        assert isinstance(worker, KVPoolConnector)
        self.worker = worker
        self.layout = layout
        shape = ((NUM_BLOCKS, HEADS, BS, 2 * HEAD) if layout == CPU_LAYOUT else (2, NUM_BLOCKS, BS, HEADS, HEAD))
        self.caches = {n: torch.zeros(shape, dtype=torch.float16) for n in LAYERS}
        worker.register_kv_caches(self.caches)
        self.block_ids: dict[str, list[int]] = {}
        self.load_errors: set[int] = set()
        self.kv_transfer_params: dict[str, Any] = {}
        """Per finished request, the ``kv_transfer_params`` of its output (P/D)."""

    def block(self, layer: str, block_id: int) -> torch.Tensor:
        t = self.caches[layer]
        return (t[block_id] if self.layout == CPU_LAYOUT else t[:, block_id]).clone()

    def write_kv(self, req: Request, start: int, n: int) -> None:
        """The model's stand-in: K/V of token p is a function of (layer, token, position)."""
        ids = self.block_ids[req.request_id]
        toks = torch.tensor(req.all_token_ids[start:start + n], dtype=torch.float32)
        pos = torch.arange(start, start + n, dtype=torch.float32)
        for li, name in enumerate(LAYERS):
            base = (toks * 0.37 + pos * 0.011 + li)[:, None, None]
            kv = (base + torch.arange(HEADS)[None, :, None] * 0.1 + torch.arange(2 * HEAD)[None, None, :] * 0.001)
            for j, p in enumerate(range(start, start + n)):
                b, o = ids[p // BS], p % BS
                if self.layout == CPU_LAYOUT:
                    self.caches[name][b, :, o, :] = kv[j].half()
                else:
                    self.caches[name][0, b, o] = kv[j, :, :HEAD].half()
                    self.caches[name][1, b, o] = kv[j, :, HEAD:].half()

    def step(self, finished_sending: set[str] | None = None) -> SchedulerOutput:
        so = self.scheduler.schedule()
        for new in so.scheduled_new_reqs:
            self.block_ids[new.req_id] = list(new.block_ids[0])
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            if c.new_block_ids[i] is not None:
                self.block_ids[rid].extend(c.new_block_ids[i][0])
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.handle_preemptions(so.kv_connector_metadata)
        w.start_load_kv(None)
        reqs = {r.request_id: r for r in self.scheduler.requests.values()}
        for name in LAYERS:
            w.wait_for_layer_load(name)
        for rid, n in so.num_scheduled_tokens.items():
            r = reqs[rid]
            self.write_kv(r, r.num_computed_tokens - n, n)  # schedule() already advanced it
        for name in LAYERS:
            w.save_kv_layer(name, self.caches[name], None)
        w.wait_for_save()
        w.wait_for_all_saves()
        sending, _ = w.get_finished(so.finished_req_ids)
        errors = w.get_block_ids_with_load_errors()
        self.load_errors |= errors
        w.clear_connector_metadata()
        out = ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens),
                                sampled_token_ids=[[7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else []
                                                   for r in so.num_scheduled_tokens],
                                kv_connector_output=KVConnectorOutput(finished_sending=(sending or set())
                                                                      | (finished_sending or set()),
                                                                      invalid_block_ids=errors))
        for outs in self.scheduler.update_from_output(so, out).values():
            for o in outs.outputs:
                if o.kv_transfer_params is not None:
                    self.kv_transfer_params[o.request_id] = o.kv_transfer_params
        return so

    def add(self, rid: str, prompt: list[int]) -> Request:
        req = Request(rid, prompt, SamplingParams(max_tokens=1), None)
        self.scheduler.add_request(req)
        return req

    def run_to_end(self, max_steps: int = 10) -> list[SchedulerOutput]:
        outs = []
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                break
            outs.append(self.step())
        assert not self.scheduler.has_requests(), "requests still unfinished"
        return outs

    def close(self) -> None:
        self.worker.shutdown()
        conn = self.scheduler.connector
        if conn is not None:
            conn.shutdown()


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 999, (n,), generator=g).tolist()


@pytest.mark.parametrize("layout", [CPU_LAYOUT, KV_FIRST])
def test_engine_b_loads_what_engine_a_saved_and_computes_only_the_tail(model_dir: Path, cluster: LocalCluster,
                                                                        layout: str) -> None:
    shared = prompt(1 if layout == CPU_LAYOUT else 2, 7 * BS + 5)  # 7 full blocks and a partial one
    a = Engine(model_dir, cluster.sidecars[0], layout)
    try:
        ra = a.add("a-1", shared)
        first = a.step()
        assert first.num_scheduled_tokens["a-1"] == len(shared)  # nothing in the pool yet: a full prefill
        assert ra.is_finished()
        # Its saves were handed to the worker's background thread: vLLM keeps the blocks until the
        # worker's get_finished reports the request (the next step), then frees them.
        assert "a-1" in a.scheduler.requests
        a.run_to_end()
        assert "a-1" not in a.scheduler.requests
        assert a.worker.stats["saved_blocks"] == 7
        # Gathered straight into reserved arena extents: no staging, no put copy.
        assert a.worker.stats[PathStat.ARENA_WRITES] == 7 and a.worker.stats[PathStat.STAGED_WRITES] == 0
        a_blocks = {(name, i): a.block(name, a.block_ids["a-1"][i]) for name in LAYERS for i in range(7)}
        assert ra.is_finished()
    finally:
        a.close()

    b = Engine(model_dir, cluster.sidecars[1], layout)  # another sidecar: the blocks come from the store nodes
    try:
        tail = prompt(3, 2 * BS + 3)
        rb = b.add("b-1", shared[:6 * BS + 9] + tail)  # shares 6 full blocks, then diverges mid-block
        before = b.worker.client.stats()
        so = b.step()
        after = b.worker.client.stats()
        # vLLM's scheduler took the external hit: it scheduled only the tail.
        assert so.num_scheduled_tokens["b-1"] == len(rb.prompt_token_ids) - 6 * BS
        assert b.worker.stats["loaded_blocks"] == 6 and not b.load_errors
        # The fast path: every remote block landed in registered staging, none in the arena; the
        # sidecar fetched them from the pool and its local tier took only B's own saves.
        st = b.worker.stats
        assert st[PathStat.RUN_COPIES] == 6  # one numpy copy per layer for the six blocks, not one per block
        assert (st[PathStat.REGISTERED_LANDINGS], st[PathStat.ARENA_LANDINGS], st[PathStat.LOCAL_VIEWS]) == (6, 0, 0)
        assert after.counters[SidecarCounter.READ_HITS_POOL] - before.counters[SidecarCounter.READ_HITS_POOL] == 6
        assert after.local_objects - before.local_objects == st["saved_blocks"]
        for i in range(6):
            for name in LAYERS:
                assert torch.equal(b.block(name, b.block_ids["b-1"][i]), a_blocks[(name, i)]), (name, i)
        b.run_to_end()
        # B saved its own new full blocks (6 shared + 3 new of its 8 full ones, minus the loaded 6).
        assert b.worker.stats["saved_blocks"] == (len(rb.prompt_token_ids) // BS) - 6
    finally:
        b.close()


def test_a_miss_prefills_everything(model_dir: Path, cluster: LocalCluster) -> None:
    e = Engine(model_dir, cluster.sidecars[1])
    try:
        p = prompt(11, 4 * BS + 1)
        e.add("m-1", p)
        so = e.step()
        assert so.num_scheduled_tokens["m-1"] == len(p)
        assert e.worker.stats["loaded_blocks"] == 0
        conn = e.scheduler.connector
        assert isinstance(conn, KVPoolConnector)
        # A prompt of exactly one block: the last token is always computed, so nothing can be a hit.
        one_block = Request("m-2", p[:BS], SamplingParams(max_tokens=1), None)
        assert conn.get_num_new_matched_tokens(one_block, 0) == (0, False)
    finally:
        e.close()


def test_corrupted_blocks_are_detected_and_vllm_recomputes_them(model_dir: Path, cluster: LocalCluster) -> None:
    p = prompt(21, 5 * BS + 2)
    a = Engine(model_dir, cluster.sidecars[2])
    try:
        a.add("c-1", p)
        a.run_to_end()
        assert a.worker.stats["saved_blocks"] == 5
        # Flip one byte of block 3's payload where it rests: the sidecar's shared-memory arena.
        keys = a.worker._my_space(()).block_keys(p[:5 * BS])
        client = a.worker.client
        with client.get(keys[3:4]) as views:
            import numpy as np
            addr = np.frombuffer(views[0], dtype=np.uint8).ctypes.data
            base = np.frombuffer(client._arena, dtype=np.uint8).ctypes.data
            off = addr - base + len(views[0]) - 1
        client._arena[off] ^= 0xFF
    finally:
        a.close()

    d = Engine(model_dir, cluster.sidecars[2])  # same sidecar: it serves the damaged local copy
    try:
        rd = d.add("d-1", p)
        so = d.step()
        assert so.num_scheduled_tokens["d-1"] == len(p) - 5 * BS  # the match (metadata) promised 5 blocks
        bad = set(d.block_ids["d-1"][3:5])
        assert d.load_errors == bad  # block 3 fails its checksum; block 4 depends on it
        for i in (3, 4):  # nothing of the damaged object reached the paged cache
            assert not d.block(LAYERS[0], d.block_ids["d-1"][i]).any()
        # vLLM's own recovery: it rolls the request back to the valid prefix and recomputes from there.
        assert rd.num_computed_tokens == 3 * BS
        d.run_to_end()
        for i in (3, 4):
            assert d.block(LAYERS[0], d.block_ids["d-1"][i]).any()
    finally:
        d.close()


def test_bad_configuration_is_refused_with_its_name(model_dir: Path, cluster: LocalCluster) -> None:
    with pytest.raises(IntegrationConfigError, match="unknown kvpool setting.*adress"):
        KVPoolConnector(vllm_config(model_dir, cluster.sidecars[0], adress="x"), KVConnectorRole.SCHEDULER,
                        kv_cache_config())
    with pytest.raises(IntegrationConfigError, match="unix://"):
        KVPoolConnector(vllm_config(model_dir, "tcp://127.0.0.1:1"), KVConnectorRole.SCHEDULER, kv_cache_config())
    with pytest.raises(IntegrationConfigError, match="staging_mib"):
        KVPoolConnector(vllm_config(model_dir, cluster.sidecars[0], staging_mib=-1), KVConnectorRole.SCHEDULER,
                        kv_cache_config())
    with pytest.raises(IntegrationConfigError, match="lease_ms"):
        KVPoolConnector(vllm_config(model_dir, cluster.sidecars[0], lease_ms=0), KVConnectorRole.SCHEDULER,
                        kv_cache_config())
    for bad in ({"fetch_decision": "sometimes"}, {"prefill_tokens_per_s": -5}, {"estimate_refresh_ms": 0}):
        with pytest.raises(IntegrationConfigError, match=next(iter(bad))):
            KVPoolConnector(vllm_config(model_dir, cluster.sidecars[0], **bad), KVConnectorRole.SCHEDULER,
                            kv_cache_config())


def test_keys_come_from_the_configuration_not_the_process(model_dir: Path, cluster: LocalCluster) -> None:
    c1 = KVPoolConnector(vllm_config(model_dir, cluster.sidecars[0]), KVConnectorRole.SCHEDULER, kv_cache_config())
    c2 = KVPoolConnector(vllm_config(model_dir, cluster.sidecars[1]), KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        p = prompt(5, 3 * BS)
        assert c1._my_space(()).block_keys(p) == c2._my_space(()).block_keys(p)
        assert c1._my_space((("lora", "a:"),)).block_keys(p) != c1._my_space(()).block_keys(p)
        assert c1._my_space((("cache_salt", "s"),)).block_keys(p) != c1._my_space(()).block_keys(p)
    finally:
        c1.shutdown()
        c2.shutdown()


def save_prompt(model_dir: Path, address: str, p: list[int], blocks: int) -> dict[tuple[str, int], torch.Tensor]:
    """Engine A computes and saves ``p`` through ``address``; its blocks' bytes by (layer, index)."""
    a = Engine(model_dir, address)
    try:
        a.add("src", p)
        a.run_to_end()
        assert a.worker.stats["saved_blocks"] == blocks
        return {(name, i): a.block(name, a.block_ids["src"][i]) for name in LAYERS for i in range(blocks)}
    finally:
        a.close()


def load_prompt(e: Engine, p: list[int], blocks: int, want: dict[tuple[str, int], torch.Tensor]) -> None:
    e.add("dst", p)
    so = e.step()
    assert so.num_scheduled_tokens["dst"] == len(p) - blocks * BS and not e.load_errors
    assert e.worker.stats["loaded_blocks"] == blocks
    for i in range(blocks):
        for name in LAYERS:
            assert torch.equal(e.block(name, e.block_ids["dst"][i]), want[(name, i)]), (name, i)


def test_local_hits_are_read_as_arena_views_not_through_staging(model_dir: Path, cluster: LocalCluster) -> None:
    p = prompt(31, 5 * BS + 3)
    want = save_prompt(model_dir, cluster.sidecars[0], p, 5)
    e = Engine(model_dir, cluster.sidecars[0])  # the sidecar that took the saves: local hits
    try:
        load_prompt(e, p, 5, want)
        st = e.worker.stats
        assert (st[PathStat.LOCAL_VIEWS], st[PathStat.REGISTERED_LANDINGS], st[PathStat.ARENA_LANDINGS]) == (5, 0, 0)
    finally:
        e.close()


def test_a_load_larger_than_staging_goes_in_parts_still_registered(model_dir: Path, cluster: LocalCluster) -> None:
    p = prompt(41, 6 * BS + 1)
    want = save_prompt(model_dir, cluster.sidecars[0], p, 6)
    probe = Engine(model_dir, cluster.sidecars[2])
    obj = 32 + probe.worker._payload
    probe.close()
    e = Engine(model_dir, cluster.sidecars[2], staging_mib=4 * obj / 2**20)  # 4 slots for 6 blocks
    try:
        assert e.worker._path is not None and e.worker._path.pool.slots == 4
        load_prompt(e, p, 6, want)
        st = e.worker.stats
        assert (st[PathStat.REGISTERED_LANDINGS], st[PathStat.ARENA_LANDINGS]) == (6, 0)
        assert e.worker._path.pool.free == 4  # every slot back after the step
    finally:
        e.close()


def test_without_staging_remote_blocks_land_in_the_arena_and_are_counted(model_dir: Path,
                                                                         cluster: LocalCluster) -> None:
    p = prompt(51, 3 * BS + 1)
    want = save_prompt(model_dir, cluster.sidecars[0], p, 3)
    e = Engine(model_dir, cluster.sidecars[1], staging_mib=0)
    try:
        load_prompt(e, p, 3, want)
        st = e.worker.stats
        assert (st[PathStat.REGISTERED_LANDINGS], st[PathStat.ARENA_LANDINGS]) == (0, 3)
    finally:
        e.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
def test_copy_tensor_copies_strided_views_of_any_dtype_exactly(dtype: torch.dtype) -> None:
    from kvpool.integrations.tensors import copy_tensor
    src = (torch.randn((2, 6, 4, 3), generator=torch.Generator().manual_seed(1)) * 50).to(dtype)
    dst = torch.zeros((2, 6, 4, 3), dtype=dtype)
    copy_tensor(dst.select(1, 2), src.select(1, 4))  # both strided: the kv-first layout's block
    assert torch.equal(dst.select(1, 2), src.select(1, 4)) and not dst.select(1, 3).any()


def test_fetch_or_recompute_a_short_prefix_is_recomputed_and_a_long_one_loaded(read_from_pool: Any, model_dir: Path,
                                                                             cluster: LocalCluster) -> None:
    """On vLLM's real scheduler.  The pool's read bandwidth and lookup time are what sidecar 1
    measured of its remote reads; the prefill rate is configured so that the crossover falls
    between a 2-block and a 40-block prefix (their geometric mean).  The connector reads the
    sidecar's estimates once at start (``estimate_refresh_ms`` of an hour): it decides on exactly
    the values read here, so the outcome is not left to timing."""
    short, long, warm = prompt(131, 2 * BS + 5), prompt(132, 40 * BS + 5), prompt(133, 40 * BS + 1)
    a = Engine(model_dir, cluster.sidecars[0])
    try:
        for rid, p in (("x-s", short), ("x-l", long), ("x-w", warm)):
            a.add(rid, p)
        a.run_to_end()
        assert a.worker.stats["saved_blocks"] == 82
        warm_keys = a.worker._my_space(()).block_keys(warm[:40 * BS])
    finally:
        a.close()
    s = read_from_pool(cluster, warm_keys[:40], 8)  # sidecar 1 measures its pool: blocks it never held
    assert s.pool_read_samples >= 4 and s.lookup_samples >= 4  # measured, not the priors
    bytes_per_token = len(LAYERS) * kv_cache_config().kv_cache_groups[0].kv_cache_spec.page_size_bytes // BS
    crossover = (2 * BS * 40 * BS) ** 0.5
    rate = 1.0 / (bytes_per_token / s.pool_read_bytes_per_s + s.lookup_seconds / crossover)

    b = Engine(model_dir, cluster.sidecars[1], prefill_tokens_per_s=rate, estimate_refresh_ms=3_600_000)
    try:
        conn = b.scheduler.connector
        assert isinstance(conn, KVPoolConnector) and conn.decider is not None
        est = conn.decider.estimates.get()
        assert (est.pool_bytes_per_s, est.lookup_seconds) == (s.pool_read_bytes_per_s, s.lookup_seconds)
        assert conn.bytes_per_token == bytes_per_token

        # Short: below the crossover.  vLLM gets 0 external tokens; the match's pins are dropped.
        probe = Request("y-probe", short, SamplingParams(max_tokens=1), None)
        assert conn.get_num_new_matched_tokens(probe, 0) == (0, False)
        assert conn._reqs["y-probe"].leases == [] and conn._reqs["y-probe"].load is None
        conn.request_finished(probe, [])
        b.add("y-s", short)
        so = b.step()
        assert so.num_scheduled_tokens["y-s"] == len(short)  # all of it prefilled
        assert conn.stats["recomputed_cheaper"] == 2 and conn.stats["recomputed_cheaper_tokens"] == 2 * 2 * BS
        assert conn.stats["loaded"] == 0 and conn.stats["last_loaded"] == 0
        assert conn.stats["last_fetch_us"] + conn.stats["last_lookup_us"] >= conn.stats["last_recompute_us"]
        b.run_to_end()
        assert b.worker.stats["loaded_blocks"] == 0
        assert b.worker.stats["saved_blocks"] == 0  # its blocks are in the pool: recomputed, not stored again

        # Long: above it.  Loaded; vLLM schedules only the tail.
        b.add("y-l", long)
        so = b.step()
        assert so.num_scheduled_tokens["y-l"] == len(long) - 40 * BS
        assert b.worker.stats["loaded_blocks"] == 40 and not b.load_errors
        assert conn.stats["loaded"] == 1 and conn.stats["loaded_tokens"] == 40 * BS
        assert conn.stats["last_matched_tokens"] == 40 * BS and conn.stats["last_loaded"] == 1
        assert conn.stats["last_pool_read_bytes_per_s"] == int(s.pool_read_bytes_per_s)
        b.run_to_end()

        # Not in the pool at all: recomputed, counted as missing.
        b.add("y-m", prompt(134, 3 * BS + 1))
        b.run_to_end()
        assert conn.stats["recomputed_missing"] == 1
    finally:
        b.close()


def test_fetch_decision_always_loads_what_matched(model_dir: Path, cluster: LocalCluster) -> None:
    """``fetch_decision: always`` loads even where recomputing is faster (a prefill rate no pool can beat)."""
    p = prompt(141, 2 * BS + 3)
    a = Engine(model_dir, cluster.sidecars[2])
    try:
        a.add("z-a", p)
        a.run_to_end()
    finally:
        a.close()
    for mode, loaded in (("auto", 0), ("always", 2)):
        e = Engine(model_dir, cluster.sidecars[2], fetch_decision=mode, prefill_tokens_per_s=1e12)
        try:
            e.add(f"z-{mode}", p)
            so = e.step()
            assert so.num_scheduled_tokens[f"z-{mode}"] == len(p) - loaded * BS
            e.run_to_end()
            assert e.worker.stats["loaded_blocks"] == loaded
        finally:
            e.close()


def test_the_prefill_rate_is_measured_from_the_scheduler_steps(model_dir: Path, cluster: LocalCluster) -> None:
    """No ``prefill_tokens_per_s``: the connector times its steps of many tokens (each one's tokens
    over the time until the next step is planned) and decides on that rate, not the prior."""
    from kvpool.core.planning import PRIOR_PREFILL_TOKENS_PER_S
    e = Engine(model_dir, cluster.sidecars[0])
    try:
        conn = e.scheduler.connector
        assert isinstance(conn, KVPoolConnector) and conn.decider is not None
        assert conn.decider.prefill_rate() == PRIOR_PREFILL_TOKENS_PER_S
        for i in range(5):  # five prefills of 300 tokens, each step timed by the next one's plan
            e.add(f"t-{i}", prompt(150 + i, 300))
            e.run_to_end()
        rate = conn.decider.prefill_rate()
        # This test's "model" is Python loops: slow, but a measurement (not the prior), in range.
        assert rate != PRIOR_PREFILL_TOKENS_PER_S and 10 < rate < 1e8
        assert conn.stats["recomputed_missing"] == 5  # nothing of these was in the pool
    finally:
        e.close()


def test_fetch_or_recompute_follows_the_pool_a_prefix_loaded_from_a_fast_pool_is_recomputed_from_a_slow_one(
        model_dir: Path, tmp_path: Path) -> None:
    """A really slow pool: the store node's blocks sit on its SSD tier, whose every read is made to
    sleep 100 ms (the store's fault hook, ``faultTierDelayFile``).  The same engine, the same 40-block
    prefix length: loaded while the pool is fast, recomputed once the sidecar has measured it slow.
    The prefill rate is configured at a quarter of the fast pool's load rate (the load wins by 4×)."""
    delay = tmp_path / "delay"
    long1, long2, fast, slow_a, slow_b = (prompt(160 + i, n * BS + 1) for i, n in enumerate((40, 40, 32, 40, 40)))
    # The sidecars' store-read deadline is 2 s (default 100 ms), so a read of the slow pool is a
    # slow sample on busy cores, never a timed-out miss.
    with LocalCluster(stores=1, sidecars=2, block_tokens=BS, store_bytes=1 << 20, ssd_bytes=32 << 20,
                      store_config={"faultTierDelayFile": str(delay), "tierReadSeconds": 10.0},
                      sidecar_args=["--read-deadline-ms", "2000"]) as lc:
        a = Engine(model_dir, lc.sidecars[0])
        try:
            for i, p in enumerate((long1, long2, fast, slow_a, slow_b)):
                a.add(f"s-{i}", p)
                a.run_to_end()
            assert a.worker.stats["saved_blocks"] == 192
            space = a.worker._my_space(())
            fast_keys = space.block_keys(fast[:32 * BS])
            slow_keys = space.block_keys(slow_a[:40 * BS]) + space.block_keys(slow_b[:40 * BS])
        finally:
            a.close()
        with lc.connect(0) as c:  # 3 MiB more than the node's 1 MiB of DRAM: the blocks above go to its SSD
            filler = [bytes([i]) * 32 for i in range(48)]
            for i in range(0, 48, 8):
                assert c.put(filler[i:i + 8], [bytes([i]) * (64 << 10)] * 8) == [pb.OK] * 8
        admin = lc.admin(lc.stores[0])
        deadline = time.monotonic() + 30
        while admin.stats().counters.get("demoted", 0) < 192:
            assert time.monotonic() < deadline, admin.stats().counters
            time.sleep(0.05)
        with lc.connect(1) as c:  # sidecar 1 measures the pool while it is fast
            for i in range(0, 32, 8):
                assert c.match(fast_keys[i:i + 8]) == 8
                with c.get(fast_keys[i:i + 8]):
                    pass
            s = c.stats()
        assert s.pool_read_samples >= 4
        bytes_per_token = len(LAYERS) * kv_cache_config().kv_cache_groups[0].kv_cache_spec.page_size_bytes // BS
        load_seconds = s.lookup_seconds + 40 * BS * bytes_per_token / s.pool_read_bytes_per_s
        rate = 40 * BS / (4 * load_seconds)
        b = Engine(model_dir, lc.sidecars[1], prefill_tokens_per_s=rate, estimate_refresh_ms=3_600_000)
        try:
            conn = b.scheduler.connector
            assert isinstance(conn, KVPoolConnector) and conn.decider is not None
            b.add("fast-pool", long1)
            so = b.step()
            assert so.num_scheduled_tokens["fast-pool"] == 1 and conn.stats["loaded"] == 1
            b.run_to_end()
            assert b.worker.stats["loaded_blocks"] == 40

            delay.write_text("0.1")  # every SSD read of the node now sleeps 100 ms
            with lc.connect(1) as c:  # sidecar 1 measures it: one block per read (each within its deadline)
                for k in slow_keys:
                    assert c.match([k]) == 1
                    with c.get([k]):
                        pass
                slow_s = c.stats()
            est = conn.decider.estimates.refresh()  # what a background refresh brings, now
            assert est.pool_bytes_per_s == slow_s.pool_read_bytes_per_s < s.pool_read_bytes_per_s / 4
            b.add("slow-pool", long2)
            so = b.step()
            assert so.num_scheduled_tokens["slow-pool"] == len(long2)  # recomputed: nothing loaded
            assert conn.stats["recomputed_cheaper"] == 1 and conn.stats["last_matched_tokens"] == 40 * BS
            assert conn.stats["last_fetch_us"] > conn.stats["last_recompute_us"]
            b.run_to_end()
            assert b.worker.stats["loaded_blocks"] == 40
        finally:
            b.close()
            delay.unlink(missing_ok=True)


def test_prefill_and_decode_instances_hand_a_prompt_over_through_kv_transfer_params(model_dir: Path,
                                                                                   cluster: LocalCluster) -> None:
    """kv_producer returns the published record in the finished request's output; kv_consumer,
    given it in ``SamplingParams.extra_args``, loads the blocks it hands over and stores nothing."""
    shared = prompt(61, 7 * BS + 5)  # a seed of its own: the corruption test damaged prompt 21 in place
    p = Engine(model_dir, cluster.sidecars[0], role="kv_producer")
    try:
        p.add("p-1", shared)
        p.run_to_end()
        params = p.kv_transfer_params["p-1"]
        assert list(params) == ["kvpool_handoff"] and len(params["kvpool_handoff"]) == 1
        assert p.scheduler.connector is not None and p.scheduler.connector.stats["handoffs_published"] == 1
        blocks = {(name, i): p.block(name, p.block_ids["p-1"][i]) for name in LAYERS for i in range(7)}
    finally:
        p.close()
    d = Engine(model_dir, cluster.sidecars[2], role="kv_consumer")
    try:
        req = Request("d-1", shared, SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None)
        d.scheduler.add_request(req)
        so = d.step()
        assert so.num_scheduled_tokens["d-1"] == len(shared) - 7 * BS  # the tail only
        assert d.worker.stats["loaded_blocks"] == 7 and not d.load_errors
        for (name, i), want in blocks.items():
            assert torch.equal(d.block(name, d.block_ids["d-1"][i]), want), (name, i)
        d.run_to_end()
        conn = d.scheduler.connector
        assert isinstance(conn, KVPoolConnector)
        st = conn.stats
        assert (st["handoffs_accepted"], st["handoff_blocks"], st["handoff_refused"]) == (1, 7, 0)
        assert d.worker.stats["saved_blocks"] == 0  # a decode instance stores nothing
        assert "d-1" not in d.kv_transfer_params  # and publishes nothing
        # A record refused (here: malformed) recomputes the whole prompt, although the pool has it.
        bad = Request("d-2", shared, SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
            "kvpool_handoff": ["AAAA"]}}), None)
        d.scheduler.add_request(bad)
        assert d.step().num_scheduled_tokens["d-2"] == len(shared)
        assert conn.stats["handoff_refused"] == 1
    finally:
        d.close()


def test_an_unknown_kv_role_is_refused_at_start(model_dir: Path, cluster: LocalCluster) -> None:
    cfg = vllm_config(model_dir, cluster.sidecars[0])
    cfg.kv_transfer_config.kv_role = "kv_prefill"  # type: ignore[assignment,union-attr]  # vLLM checks at parse
    with pytest.raises(IntegrationConfigError, match="kv_role must be one of kv_producer, kv_consumer, kv_both"):
        KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
