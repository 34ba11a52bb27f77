"""Hit planning (DESIGN §5) and sizing helpers: pure functions."""

import pytest

from kvpool.core.planning import (
    PRIOR_LOCAL_READ_BYTES_PER_S,
    PRIOR_LOOKUP_SECONDS,
    PRIOR_POOL_READ_BYTES_PER_S,
    PRIOR_PREFILL_TOKENS_PER_S,
    CrossoverInputs,
    FetchMode,
    decide_fetch,
    kv_bytes_per_token,
    plan_hit,
    should_fetch,
    state_bytes,
    state_store_position,
)


def test_design_example_with_state() -> None:
    p = plan_hit(131072, 131072, state_positions=[130816])
    assert p.cap_tokens == 130938
    assert p.block_hit_tokens == 130816
    assert p.hit_tokens == 130816
    assert p.state_position == 130816
    assert p.compute_tokens == 256


def test_design_example_without_state() -> None:
    p = plan_hit(131072, 131072, state_positions=[])
    assert p.hit_tokens == 130688
    assert p.state_position is None
    assert p.compute_tokens == 384


def test_state_window_bounds() -> None:
    # Any state position in [L1 - B, L1] qualifies; the latest one is used.
    p = plan_hit(131072, 131072, state_positions=[130688, 130700, 130816])
    assert p.state_position == 130816 and p.hit_tokens == 130816
    p = plan_hit(131072, 131072, state_positions=[130688])
    assert p.state_position == 130688 and p.hit_tokens == 130816
    p = plan_hit(131072, 131072, state_positions=[130560, 130944])  # outside the window
    assert p.state_position is None and p.hit_tokens == 130688


def test_match_shorter_than_cap() -> None:
    p = plan_hit(10000, 1280, state_positions=[1280])
    assert p.hit_tokens == 1280 and p.compute_tokens == 8720
    p = plan_hit(10000, 1300, state_positions=[])  # not block aligned → floor
    assert p.block_hit_tokens == 1280 and p.hit_tokens == 1152


def test_no_window_caps_at_l_minus_1() -> None:
    p = plan_hit(1024, 1024, window_tokens=0, rollback_tokens=0)
    assert p.cap_tokens == 1023
    assert p.hit_tokens == 896  # floor(1023/128)*128, no state needed
    p = plan_hit(1025, 1024, window_tokens=0, rollback_tokens=0)
    assert p.hit_tokens == 1024 and p.compute_tokens == 1


def test_short_prompts() -> None:
    assert plan_hit(0, 0).hit_tokens == 0
    assert plan_hit(100, 0).compute_tokens == 100
    p = plan_hit(200, 128, state_positions=[128])
    assert p.cap_tokens == 66 and p.hit_tokens == 0


def test_hit_never_exceeds_cap_or_match() -> None:
    for L in range(0, 2000, 37):
        for m in range(0, L + 256, 64):
            for states in ([], [((L - 1) // 128) * 128]):
                p = plan_hit(L, m, states)
                assert 0 <= p.hit_tokens <= min(m, p.cap_tokens)
                assert p.hit_tokens % 128 == 0
                assert p.hit_tokens + p.compute_tokens == L


def test_invalid() -> None:
    with pytest.raises(ValueError):
        plan_hit(10, 0, block_tokens=0)
    with pytest.raises(ValueError):
        plan_hit(-1, 0)


def test_state_store_position() -> None:
    assert state_store_position(128) is None
    assert state_store_position(100) is None
    assert state_store_position(129) == 128
    assert state_store_position(256) == 128
    assert state_store_position(131072) == 130944


def test_sizes() -> None:
    assert state_bytes(20, 128, 6, 528) == 1_415_040
    assert kv_bytes_per_token(32, 8, 128, 2) == 128 * 1024


def test_should_fetch() -> None:
    bpt = kv_bytes_per_token(32, 8, 128, 2)
    long = should_fetch(100_000, bpt, 5e9, 10_000)  # 2.6 s fetch vs 10 s recompute
    assert long.fetch and long.reason == "FetchFaster"
    slow = should_fetch(1000, bpt, 1e6, 100_000)  # 131 s fetch vs 0.01 s recompute
    assert not slow.fetch and slow.reason == "RecomputeFaster"
    assert should_fetch(1000, bpt, 1e8, 1000, overlap_seconds=2.0).fetch
    assert not should_fetch(0, bpt, 1e9, 1000).fetch
    with pytest.raises(ValueError):
        should_fetch(10, bpt, 0, 1000)


def _inputs(**kw: float) -> CrossoverInputs:
    base: dict[str, float] = dict(matched_tokens=1024, local_tokens=0, bytes_per_token=131072,
                                  pool_bytes_per_s=2e9, local_bytes_per_s=8e9, lookup_seconds=1e-3,
                                  prefill_tokens_per_s=10_000)
    base.update(kw)
    return CrossoverInputs(**base)  # type: ignore[arg-type]


def test_decide_fetch_is_should_fetch_on_the_blended_bandwidth() -> None:
    # 1024 tokens × 128 KiB = 128 MiB: 67 ms from the pool at 2 GB/s, 102 ms to recompute.
    d = decide_fetch(_inputs())
    assert d.fetch and d.reason == "FetchFaster"
    assert d.fetch_seconds == pytest.approx(1024 * 131072 / 2e9) and d.recompute_seconds == pytest.approx(0.1024)
    # The same from the local tier: a quarter of the time.
    assert decide_fetch(_inputs(local_tokens=1024)).fetch_seconds == pytest.approx(1024 * 131072 / 8e9)
    # Half local, half pool: the two shares add (a local count above the match is clamped).
    half = decide_fetch(_inputs(local_tokens=512)).fetch_seconds
    assert half == pytest.approx(512 * 131072 / 8e9 + 512 * 131072 / 2e9)
    assert decide_fetch(_inputs(local_tokens=5000)).fetch_seconds == pytest.approx(1024 * 131072 / 8e9)


def test_decide_fetch_crossover_in_length_comes_from_the_fixed_lookup() -> None:
    # Per token: fetch 13 µs, recompute 100 µs; the 20 ms lookup is paid back after ~230 tokens.
    slow_lookup = dict(lookup_seconds=0.02, bytes_per_token=26_000)
    short, long = decide_fetch(_inputs(matched_tokens=32, **slow_lookup)), \
        decide_fetch(_inputs(matched_tokens=2048, **slow_lookup))
    assert (short.fetch, short.reason) == (False, "RecomputeFaster")
    assert (long.fetch, long.reason) == (True, "FetchFaster")
    # A slow pool (a fetch slower per token than prefill) recomputes at every length.
    assert not decide_fetch(_inputs(matched_tokens=100_000, pool_bytes_per_s=1e8)).fetch
    # Overlap hides load time.
    assert decide_fetch(_inputs(matched_tokens=32, overlap_seconds=0.05, **slow_lookup)).fetch


def test_decide_fetch_modes_and_refusals() -> None:
    assert decide_fetch(_inputs(matched_tokens=0)).reason == "NoHit"
    slow = _inputs(pool_bytes_per_s=1e6)
    assert not decide_fetch(slow).fetch
    assert (decide_fetch(slow, FetchMode.ALWAYS).fetch, decide_fetch(slow, FetchMode.ALWAYS).reason) == (True, "Always")
    for bad in (dict(pool_bytes_per_s=0), dict(prefill_tokens_per_s=0), dict(bytes_per_token=0)):
        with pytest.raises(ValueError):
            decide_fetch(_inputs(**bad))


def test_the_priors_lean_to_loading() -> None:
    """Before anything is measured, a Llama-8B-sized token (128 KiB) of a one-block prefix loads:
    the rule recomputes only on measured or configured evidence."""
    x = CrossoverInputs(16, 0, 131072, PRIOR_POOL_READ_BYTES_PER_S, PRIOR_LOCAL_READ_BYTES_PER_S,
                        PRIOR_LOOKUP_SECONDS, PRIOR_PREFILL_TOKENS_PER_S)
    assert decide_fetch(x).fetch
