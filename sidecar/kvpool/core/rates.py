"""Measured rates for the fetch-or-recompute rule: a decaying, amount-weighted average (pure, no I/O).

The sidecar measures its pool read bandwidth (bytes per second of remote fetches), its local-tier
copy bandwidth and its match time with it; the vLLM connector its prefill rate (tokens per
second).  Each sample is an amount (bytes, tokens, calls) and the seconds it took.  The estimate
is ``sum(amount) / sum(seconds)`` over recent samples, each older sample's weight halved for every
``half_life`` of amount that came after it: a large read moves the estimate more than a small
one (weighted by bytes), and a change of the pool shows within a few reads.

Until ``min_samples`` samples exist, and again after ``stale_seconds`` without one, the estimate
is the documented ``prior`` (:mod:`kvpool.core.planning` holds the priors).  The reset matters:
a pool measured slow makes the engines recompute, so nothing reads it any more; after a quiet
spell the prior (which leans to loading) has them read and measure it again.

Not thread-safe: the owner serialises ``add`` (the sidecar holds a lock around it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecayingRate:
    """Amount per second over recent samples, the prior until enough of them exist."""

    prior: float
    """The rate reported until ``min_samples`` samples exist (and after a stale spell)."""
    half_life: float
    """Amount after which a sample's weight is halved (bytes, tokens or calls)."""
    min_samples: int = 4
    """Samples needed before the measurement replaces the prior."""
    stale_seconds: float = 300.0
    """With no sample for this long the measurement is dropped (back to the prior); 0: never."""
    amount: float = 0.0
    seconds: float = 0.0
    samples: int = 0
    last: float = 0.0
    """Clock of the last sample (the caller's monotonic clock)."""

    def __post_init__(self) -> None:
        if self.prior <= 0 or self.half_life <= 0 or self.min_samples < 1:
            raise ValueError("prior and half_life must be positive, min_samples at least 1")

    def add(self, amount: float, seconds: float, now: float) -> None:
        """One sample: ``amount`` moved (or done) in ``seconds``; empty or zero-time ones are ignored."""
        if amount <= 0 or seconds <= 0:
            return
        self._expire(now)
        keep = 0.5 ** (amount / self.half_life)
        self.amount = self.amount * keep + amount
        self.seconds = self.seconds * keep + seconds
        self.samples += 1
        self.last = now

    def _expire(self, now: float) -> None:
        if self.samples and self.stale_seconds and now - self.last > self.stale_seconds:
            self.amount = self.seconds = 0.0
            self.samples = 0

    def measured(self, now: float) -> bool:
        """Whether :meth:`rate` is a measurement (else it is the prior)."""
        self._expire(now)
        return self.samples >= self.min_samples and self.seconds > 0

    def rate(self, now: float) -> float:
        """Amount per second: measured, or the prior."""
        return self.amount / self.seconds if self.measured(now) else self.prior

    def samples_at(self, now: float) -> int:
        """Samples behind the estimate (0 after a stale spell)."""
        self._expire(now)
        return self.samples
