"""Hit planning and sizing: the pure functions of DESIGN §1 and §5 (no I/O).

``plan_hit`` decides how much of a prompt to take from the cache given the matched block prefix
and the positions where state objects (sliding-window / recurrent state) exist; the rest of the
module sizes KV and state objects and decides whether fetching beats recomputing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class HitPlan:
    """What to take from the cache for one prompt."""

    prompt_tokens: int
    hit_tokens: int
    """Tokens served from the cache (a multiple of the block size)."""
    state_position: int | None
    """Attach position of the state object used, or None when none is used."""
    compute_tokens: int
    """Tokens the engine must prefill: ``prompt_tokens - hit_tokens``."""
    cap_tokens: int
    """The most the hit may cover (the tail is always recomputed)."""
    block_hit_tokens: int
    """L1: the matched block prefix within the cap."""

    @property
    def hit_blocks(self) -> int:
        return self.hit_tokens // self.block_tokens if self.block_tokens else 0

    block_tokens: int = 128


def plan_hit(
    prompt_tokens: int,
    block_hit_tokens: int,
    state_positions: Iterable[int] = (),
    block_tokens: int = 128,
    window_tokens: int = 128,
    rollback_tokens: int = 6,
) -> HitPlan:
    """DESIGN §5: the hit for a prompt of ``prompt_tokens`` tokens.

    1. cap = L − max(1, W + R) (with no window state, W = 0, the cap is L − 1 when R = 0);
    2. L1 = the longest matched block prefix within the cap, a multiple of B;
    3. a state object at an attach position in [L1 − B, L1] makes the hit L1, otherwise the hit
       falls back to L1 − B (the last block is recomputed to rebuild state: bounded replay).
    Without sliding-window state (``window_tokens == 0``) no state is needed: the hit is L1.
    """
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    if prompt_tokens < 0 or block_hit_tokens < 0 or window_tokens < 0 or rollback_tokens < 0:
        raise ValueError("token counts must be non-negative")
    if window_tokens == 0:
        cap = max(0, prompt_tokens - 1)
    else:
        cap = max(0, prompt_tokens - max(1, window_tokens + rollback_tokens))
    l1 = (min(block_hit_tokens, cap) // block_tokens) * block_tokens
    used: int | None = None
    if window_tokens == 0 or l1 == 0:
        hit = l1
    else:
        candidates = [p for p in state_positions if l1 - block_tokens <= p <= l1]
        if candidates:
            used = max(candidates)
            hit = l1
        else:
            hit = l1 - block_tokens
    return HitPlan(
        prompt_tokens=prompt_tokens, hit_tokens=hit, state_position=used,
        compute_tokens=prompt_tokens - hit, cap_tokens=cap, block_hit_tokens=l1,
        block_tokens=block_tokens,
    )


def state_store_position(prompt_tokens: int, block_tokens: int = 128) -> int | None:
    """Where to store state after prefill: floor((L − 1) / B) × B; None when L ≤ B."""
    if prompt_tokens <= block_tokens:
        return None
    return ((prompt_tokens - 1) // block_tokens) * block_tokens


def state_bytes(layers: int, window_tokens: int, rollback_tokens: int, bytes_per_token: int) -> int:
    """Bytes of one state object: layers × (W + R) × bytes per token."""
    return layers * (window_tokens + rollback_tokens) * bytes_per_token


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Dense attention KV per token: 2 (K and V) × layers × kv_heads × head_dim × dtype bytes."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class FetchDecision:
    fetch: bool
    fetch_seconds: float
    recompute_seconds: float
    reason: str


def should_fetch(
    hit_tokens: int,
    bytes_per_token: int,
    fetch_bytes_per_second: float,
    prefill_tokens_per_second: float,
    overlap_seconds: float = 0.0,
    lookup_seconds: float = 0.0,
) -> FetchDecision:
    """Fetch pays when T_lookup + T_fetch − T_overlap < T_recompute (DESIGN §1)."""
    if hit_tokens <= 0:
        return FetchDecision(False, 0.0, 0.0, "NoHit")
    if fetch_bytes_per_second <= 0 or prefill_tokens_per_second <= 0:
        raise ValueError("bandwidth and prefill rate must be positive")
    t_fetch = hit_tokens * bytes_per_token / fetch_bytes_per_second
    t_recompute = hit_tokens / prefill_tokens_per_second
    cost = lookup_seconds + t_fetch - overlap_seconds
    if cost < t_recompute:
        return FetchDecision(True, t_fetch, t_recompute, "FetchFaster")
    return FetchDecision(False, t_fetch, t_recompute, "RecomputeFaster")
