"""The decaying, amount-weighted rate behind the fetch-or-recompute inputs (pure)."""

import pytest

from kvpool.core.rates import DecayingRate


def test_the_prior_until_enough_samples_then_bytes_over_seconds() -> None:
    r = DecayingRate(prior=1e9, half_life=1e12, min_samples=3)
    assert r.rate(0.0) == 1e9 and not r.measured(0.0)
    r.add(100e6, 1.0, 1.0)
    r.add(100e6, 1.0, 2.0)
    assert r.rate(2.0) == 1e9  # two samples: still the prior
    r.add(200e6, 0.5, 3.0)
    assert r.measured(3.0) and r.samples_at(3.0) == 3
    # Weighted by bytes: 400 MB in 2.5 s (not the mean of 100, 100 and 400 MB/s).
    assert r.rate(3.0) == pytest.approx(400e6 / 2.5, rel=1e-3)


def test_older_samples_fade_by_the_amount_that_followed() -> None:
    r = DecayingRate(prior=1.0, half_life=100.0, min_samples=1, stale_seconds=0)
    r.add(100, 100.0, 0.0)  # 1 unit/s
    for t in range(1, 30):
        r.add(100, 1.0, float(t))  # then 100 units/s, for 29 half-lives
    assert r.rate(30.0) == pytest.approx(100.0, rel=1e-3)


def test_empty_samples_are_ignored_and_a_stale_measure_returns_to_the_prior() -> None:
    r = DecayingRate(prior=5.0, half_life=10.0, min_samples=1, stale_seconds=60.0)
    r.add(0, 1.0, 0.0)
    r.add(10, 0.0, 0.0)
    assert r.samples_at(0.0) == 0
    r.add(10, 1.0, 0.0)
    assert r.rate(59.0) == pytest.approx(10.0)
    assert r.rate(61.0) == 5.0 and r.samples_at(61.0) == 0  # a quiet spell: measured again from scratch
    with pytest.raises(ValueError):
        DecayingRate(prior=0.0, half_life=1.0)
