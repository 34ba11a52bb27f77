"""Hit planning (DESIGN §5) and sizing helpers: pure functions."""

import pytest

from kvpool.core.planning import (
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
