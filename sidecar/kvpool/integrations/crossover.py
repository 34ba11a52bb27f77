"""Fetch or recompute, per request: the engine integrations' decision and where its inputs come from.

The rule is pure (:func:`kvpool.core.planning.decide_fetch`: load when T_lookup + T_fetch −
T_overlap < T_recompute).  This module gathers its inputs at the edges and counts the outcomes:

* the sidecar's measured read estimates (pool and local read bandwidth, match time;
  ``SidecarStats``), fetched once when the integration starts and then refreshed in the background
  every ``estimate_refresh_ms``: no request waits for a Stats call.  They are not carried in the
  match reply because they move slowly (decaying averages over many reads) while the match frame
  is the hottest one of the fast session: a cached copy a second old decides as well and keeps
  that frame's contract unchanged;
* the engine's prefill rate: the ``prefill_tokens_per_s`` setting, else what the integration
  measured from the engine (:meth:`FetchDecider.observe_prefill`; the vLLM connector times its
  scheduler steps), else :data:`~kvpool.core.planning.PRIOR_PREFILL_TOKENS_PER_S`;
* the match (tokens beyond what the engine already has, how many of them are in the local
  tier) and the engine's KV bytes per token, from the integration.

Outcomes are counted (:class:`~kvpool.wire.counters.FetchDecisionCounter`) in the integration's
own stats dict, next to the inputs of the last decision (``last_*``, integers: microseconds,
bytes per second, tokens per second).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from kvpool.core import planning
from kvpool.core.planning import CrossoverInputs, FetchDecision, FetchMode
from kvpool.core.rates import DecayingRate
from kvpool.integrations import engine_metrics
from kvpool.integrations.common import IntegrationConfigError
from kvpool.wire.counters import FetchDecisionCounter as C

log = logging.getLogger(__name__)

SETTINGS = {
    "fetch_decision": "auto (default): load a match only when loading is faster than recomputing it (measured "
                      "inputs); always: load whatever matched",
    "prefill_tokens_per_s": "the engine's prefill rate in tokens/s; overrides the measured rate (default: "
                            f"measured where the engine allows, else {planning.PRIOR_PREFILL_TOKENS_PER_S:g})",
    "estimate_refresh_ms": "how often the sidecar's measured read bandwidth and lookup time are refreshed, in the "
                           "background (default 1000)",
}
"""The crossover settings every integration takes (merged into each one's SETTINGS)."""


@dataclass(frozen=True)
class CrossoverSettings:
    mode: FetchMode = FetchMode.AUTO
    """``fetch_decision``."""
    prefill_tokens_per_s: float | None = None
    """Configured prefill rate (None: measured, else the prior)."""
    refresh_seconds: float = 1.0
    """Age at which the cached sidecar estimates are refreshed (in the background)."""

    @classmethod
    def parse(cls, cfg: Mapping[str, Any], where: str) -> CrossoverSettings:
        """The crossover settings of an integration's configuration ``cfg`` (named ``where`` in errors)."""
        mode = cfg.get("fetch_decision", FetchMode.AUTO.value)
        if mode not in {m.value for m in FetchMode}:
            raise IntegrationConfigError(f"{where}.fetch_decision must be one of "
                                         f"{', '.join(m.value for m in FetchMode)}, got {mode!r}")
        raw = cfg.get("prefill_tokens_per_s")
        rate = None if raw is None else _number(raw, float)
        if raw is not None and (rate is None or not rate > 0 or rate == float("inf")):
            raise IntegrationConfigError(f"{where}.prefill_tokens_per_s must be a positive number, got {raw!r}")
        raw = cfg.get("estimate_refresh_ms", 1000)
        refresh = _number(raw, int)
        if refresh is None or refresh <= 0:
            raise IntegrationConfigError(f"{where}.estimate_refresh_ms must be a positive integer, got {raw!r}")
        return cls(FetchMode(mode), rate, refresh / 1000.0)


def _number(value: Any, kind: type[int] | type[float]) -> float | None:
    """``value`` as a number of ``kind`` (a numeric string too: LMCache's settings may come from the
    environment); None when it is not one (a bool, a fraction where an integer is due, text)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = kind(value)
        except ValueError:
            return None
    if kind is int and not isinstance(value, int):
        return None
    return float(value) if isinstance(value, int | float) else None


@dataclass(frozen=True)
class Estimates:
    """The sidecar's read estimates as the decider uses them."""

    pool_bytes_per_s: float = planning.PRIOR_POOL_READ_BYTES_PER_S
    local_bytes_per_s: float = planning.PRIOR_LOCAL_READ_BYTES_PER_S
    lookup_seconds: float = planning.PRIOR_LOOKUP_SECONDS
    pool_samples: int = 0
    """Reads behind ``pool_bytes_per_s`` (below the sidecar's minimum: its prior)."""

    @classmethod
    def of(cls, stats: Any) -> Estimates:
        """From a ``SidecarStats`` reply (a sidecar without the fields reports 0s: the priors)."""
        return cls(stats.pool_read_bytes_per_s or planning.PRIOR_POOL_READ_BYTES_PER_S,
                   stats.local_read_bytes_per_s or planning.PRIOR_LOCAL_READ_BYTES_PER_S,
                   stats.lookup_seconds or planning.PRIOR_LOOKUP_SECONDS, int(stats.pool_read_samples))


class SidecarEstimates:
    """The sidecar's estimates, cached: read at start, refreshed in the background when older
    than ``refresh_seconds`` (one refresh at a time); a failed refresh keeps the last ones."""

    def __init__(self, stats: Callable[[], Any], refresh_seconds: float) -> None:
        self._stats = stats
        self.refresh_seconds = refresh_seconds
        self._lock = threading.Lock()
        self._current = Estimates()
        self._at = 0.0
        self._refreshing = False
        self.refresh()

    def refresh(self) -> Estimates:
        """Read the sidecar's estimates now (the caller waits: start, tests)."""
        try:
            got = Estimates.of(self._stats())
        except Exception as exc:  # the sidecar away: keep deciding on what we had (or the priors)
            log.debug("kvpool stats for the fetch decision failed: %s", exc)
            got = None
        with self._lock:
            if got is not None:
                self._current = got
            self._at = time.monotonic()
            self._refreshing = False
            return self._current

    def get(self) -> Estimates:
        """The cached estimates; starts a background refresh when they are stale (never waits)."""
        with self._lock:
            current = self._current
            stale = time.monotonic() - self._at > self.refresh_seconds and not self._refreshing
            if stale:
                self._refreshing = True
        if stale:
            threading.Thread(target=self.refresh, name="kvpool-estimates", daemon=True).start()
        return current


class FetchDecider:
    """One integration's decision and its counters; thread-safe."""

    def __init__(self, settings: CrossoverSettings, stats: Callable[[], Any], counts: MutableMapping[str, int]) -> None:
        self.settings = settings
        self.estimates = SidecarEstimates(stats, settings.refresh_seconds)
        self.counts = counts
        """The integration's stats dict: the decision's counters and ``last_*`` inputs go there."""
        for c in C:
            counts.setdefault(c.value, 0)
        self._lock = threading.Lock()
        # The engine's measured prefill rate: token-weighted over recent steps (half-life 64k
        # tokens), the prior until 4 steps were timed.
        self._prefill = DecayingRate(planning.PRIOR_PREFILL_TOKENS_PER_S, half_life=65536)
        engine_metrics.track(self)  # the engine's /metrics: kvpool_engine_fetch_decisions

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` in ``seconds`` (a measured step)."""
        with self._lock:
            self._prefill.add(tokens, seconds, time.monotonic())

    def prefill_rate(self) -> float:
        """Tokens/s: the setting, else measured, else the prior."""
        if self.settings.prefill_tokens_per_s is not None:
            return self.settings.prefill_tokens_per_s
        with self._lock:
            return self._prefill.rate(time.monotonic())

    def decide(self, matched_tokens: int, local_tokens: int, bytes_per_token: int) -> FetchDecision:
        """Load (``.fetch``) or recompute the ``matched_tokens`` the pool holds beyond what the
        engine has (``local_tokens`` of them in the sidecar's local tier); counted."""
        if matched_tokens <= 0:
            with self._lock:
                self.counts[C.RECOMPUTED_MISSING] += 1
            return FetchDecision(False, 0.0, 0.0, "NoHit")
        e = self.estimates.get()
        x = CrossoverInputs(matched_tokens, local_tokens, max(1, bytes_per_token), e.pool_bytes_per_s,
                            e.local_bytes_per_s, e.lookup_seconds, self.prefill_rate())
        d = planning.decide_fetch(x, self.settings.mode)
        with self._lock:
            if d.fetch:
                self.counts[C.LOADED] += 1
                self.counts[C.LOADED_TOKENS] += matched_tokens
            else:
                self.counts[C.RECOMPUTED_CHEAPER] += 1
                self.counts[C.RECOMPUTED_CHEAPER_TOKENS] += matched_tokens
            self.counts.update(last_matched_tokens=matched_tokens, last_local_tokens=x.local_tokens,
                               last_bytes_per_token=x.bytes_per_token,
                               last_pool_read_bytes_per_s=int(x.pool_bytes_per_s),
                               last_local_read_bytes_per_s=int(x.local_bytes_per_s),
                               last_lookup_us=round(x.lookup_seconds * 1e6),
                               last_prefill_tokens_per_s=int(x.prefill_tokens_per_s),
                               last_fetch_us=round(d.fetch_seconds * 1e6),
                               last_recompute_us=round(d.recompute_seconds * 1e6), last_loaded=int(d.fetch))
        return d
