"""The drain's bandwidth pacing (pure)."""

from __future__ import annotations

from kvpool.store.push import pace_delay


def test_unbounded_never_waits() -> None:
    assert pace_delay(10 << 30, 0.0, 0) == 0.0


def test_waits_exactly_until_the_rate_is_kept() -> None:
    assert pace_delay(4 << 20, 1.0, 2 << 20) == 1.0  # 4 MiB at 2 MiB/s takes 2 s; 1 s has passed
    assert pace_delay(1 << 20, 1.0, 2 << 20) == 0.0  # behind the bound: no wait
    assert pace_delay(0, 0.0, 1) == 0.0
