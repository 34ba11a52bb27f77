"""Hit planning and sizing: the pure functions of DESIGN §1 and §5 (no I/O).

``plan_hit`` decides how much of a prompt to take from the cache given the matched block prefix
and the positions where state objects (sliding-window / recurrent state) exist; the rest of the
module sizes KV and state objects and decides whether fetching beats recomputing
(``should_fetch``, and ``decide_fetch`` on the measured inputs the engine integrations gather).
"""

from __future__ import annotations

import enum
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


# -- the crossover on measured inputs (the engine integrations' decision) ----------------------

PRIOR_POOL_READ_BYTES_PER_S = 1.0e9
"""Pool read bandwidth assumed until a sidecar has measured its own: about the engine-facing remote
read of this project's TCP path (0.85–1.1 GB/s, issue 21), below its registered-memory path."""
PRIOR_LOCAL_READ_BYTES_PER_S = 4.0e9
"""Local-tier bandwidth assumed until measured: one memory copy on a loaded core."""
PRIOR_LOOKUP_SECONDS = 1.0e-3
"""Fixed cost of a load assumed until measured: one round trip to the store nodes."""
PRIOR_PREFILL_TOKENS_PER_S = 1000.0
"""Prefill rate assumed when the engine's is neither configured nor measured yet: low on purpose.
The priors lean to loading (what every integration did before the rule existed): without a
measurement, cached work is not thrown away; the rule recomputes only on measured or configured
evidence."""


class FetchMode(enum.StrEnum):
    """The integrations' ``fetch_decision`` setting."""

    AUTO = "auto"
    """Decide per request: load when ``decide_fetch`` says the load is faster."""
    ALWAYS = "always"
    """Load whatever matched (the behaviour before the rule; counted as loads)."""


@dataclass(frozen=True)
class CrossoverInputs:
    """What one decision is made on (kept as the integrations' "last decision" in their stats)."""

    matched_tokens: int
    """Tokens the pool holds beyond what the engine already has (the load's size)."""
    local_tokens: int
    """Of those, in the sidecar's local tier (read at ``local_bytes_per_s``, the rest from the pool)."""
    bytes_per_token: int
    """KV bytes one token takes in this engine's layout (what one worker loads)."""
    pool_bytes_per_s: float
    local_bytes_per_s: float
    lookup_seconds: float
    """Fixed cost of a load before its bytes flow: a round trip to the owners (the sidecar's match time)."""
    prefill_tokens_per_s: float
    overlap_seconds: float = 0.0
    """Load time hidden behind compute (0 where the load completes before the forward starts)."""


def decide_fetch(x: CrossoverInputs, mode: FetchMode = FetchMode.AUTO) -> FetchDecision:
    """Load or recompute ``x.matched_tokens``: ``should_fetch`` with the load's bandwidth blended
    from the local-tier and pool shares.  ``NoHit`` when nothing matched; ``Always`` in that mode."""
    if x.matched_tokens <= 0:
        return FetchDecision(False, 0.0, 0.0, "NoHit")
    if x.pool_bytes_per_s <= 0 or x.local_bytes_per_s <= 0 or x.prefill_tokens_per_s <= 0 or x.bytes_per_token <= 0:
        raise ValueError("bandwidths, prefill rate and bytes per token must be positive")
    local = min(max(x.local_tokens, 0), x.matched_tokens)
    t_fetch = (local / x.local_bytes_per_s + (x.matched_tokens - local) / x.pool_bytes_per_s) * x.bytes_per_token
    if mode == FetchMode.ALWAYS:
        return FetchDecision(True, t_fetch, x.matched_tokens / x.prefill_tokens_per_s, "Always")
    # One rule (should_fetch) on the load's blended bandwidth: its T_fetch is t_fetch.
    return should_fetch(x.matched_tokens, x.bytes_per_token, x.matched_tokens * x.bytes_per_token / t_fetch,
                        x.prefill_tokens_per_s, x.overlap_seconds, x.lookup_seconds)
