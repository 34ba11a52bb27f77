"""The integrations' fetch-or-recompute decider (kvpool.integrations.crossover): settings, where
each input comes from, counters.  No engine and no sidecar: the Stats call is a plain function
returning what a sidecar's reply holds (the LocalCluster tests cover the real one)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.core import planning
from kvpool.core.planning import FetchMode
from kvpool.integrations.common import IntegrationConfigError
from kvpool.integrations.crossover import CrossoverSettings, Estimates, FetchDecider, SidecarEstimates


def reply(pool: float = 2e9, local: float = 8e9, lookup: float = 1e-3, samples: int = 10) -> Any:
    return SimpleNamespace(pool_read_bytes_per_s=pool, local_read_bytes_per_s=local, lookup_seconds=lookup,
                           pool_read_samples=samples)


def test_settings_parse_and_refuse_with_the_name() -> None:
    s = CrossoverSettings.parse({}, "x")
    assert (s.mode, s.prefill_tokens_per_s, s.refresh_seconds) == (FetchMode.AUTO, None, 1.0)
    s = CrossoverSettings.parse({"fetch_decision": "always", "prefill_tokens_per_s": "2.5e4",
                                 "estimate_refresh_ms": "250"}, "x")  # numeric strings: LMCache's environment
    assert (s.mode, s.prefill_tokens_per_s, s.refresh_seconds) == (FetchMode.ALWAYS, 25000.0, 0.25)
    for bad, name in (({"fetch_decision": "never"}, "x.fetch_decision"),
                      ({"prefill_tokens_per_s": 0}, "x.prefill_tokens_per_s"),
                      ({"prefill_tokens_per_s": True}, "x.prefill_tokens_per_s"),
                      ({"prefill_tokens_per_s": "inf"}, "x.prefill_tokens_per_s"),
                      ({"estimate_refresh_ms": 1.5}, "x.estimate_refresh_ms"),
                      ({"estimate_refresh_ms": -1}, "x.estimate_refresh_ms")):
        with pytest.raises(IntegrationConfigError, match=name):
            CrossoverSettings.parse(bad, "x")


def test_estimates_of_an_older_sidecar_are_the_priors() -> None:
    e = Estimates.of(reply(0.0, 0.0, 0.0, 0))
    assert (e.pool_bytes_per_s, e.local_bytes_per_s, e.lookup_seconds) == (
        planning.PRIOR_POOL_READ_BYTES_PER_S, planning.PRIOR_LOCAL_READ_BYTES_PER_S, planning.PRIOR_LOOKUP_SECONDS)


def test_estimates_are_read_at_start_then_refreshed_in_the_background_never_waited_for() -> None:
    calls: list[float] = []
    gate = threading.Event()

    def stats() -> Any:
        calls.append(time.monotonic())
        if len(calls) > 1:
            assert gate.wait(10)  # a slow sidecar: the refresh waits, the caller does not
        return reply(pool=1e9 * len(calls))
    cache = SidecarEstimates(stats, refresh_seconds=0.01)
    assert cache.get().pool_bytes_per_s == 1e9 and len(calls) == 1
    time.sleep(0.02)
    t0 = time.monotonic()
    assert cache.get().pool_bytes_per_s == 1e9  # stale: the old values now, a refresh under way
    assert cache.get().pool_bytes_per_s == 1e9
    assert time.monotonic() - t0 < 1.0
    deadline = time.monotonic() + 10
    while len(calls) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    gate.set()
    while cache.get().pool_bytes_per_s != 2e9:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert len(calls) == 2  # one refresh at a time


def test_a_failed_read_keeps_the_last_estimates() -> None:
    answers = [reply(pool=3e9)]

    def stats() -> Any:
        if not answers:
            raise OSError("sidecar away")
        return answers.pop()
    cache = SidecarEstimates(stats, refresh_seconds=3600)
    assert cache.refresh().pool_bytes_per_s == 3e9
    assert cache.refresh().pool_bytes_per_s == 3e9


def test_decider_counts_and_records_the_last_inputs() -> None:
    counts: dict[str, int] = {"hits": 0}
    d = FetchDecider(CrossoverSettings(prefill_tokens_per_s=10_000, refresh_seconds=3600),
                     lambda: reply(lookup=0.02), counts)
    assert not d.decide(0, 0, 131072).fetch
    assert not d.decide(32, 0, 26_000).fetch  # short: the 20 ms lookup is not paid back
    assert d.decide(2048, 0, 26_000).fetch
    assert counts == counts | {"hits": 0, "recomputed_missing": 1, "recomputed_cheaper": 1,
                               "recomputed_cheaper_tokens": 32, "loaded": 1, "loaded_tokens": 2048,
                               "last_matched_tokens": 2048, "last_lookup_us": 20000,
                               "last_pool_read_bytes_per_s": 2_000_000_000, "last_prefill_tokens_per_s": 10_000,
                               "last_loaded": 1}
    assert counts["last_fetch_us"] == round(2048 * 26_000 / 2e9 * 1e6)
    _the_engine_metrics_count_it(d)
    # always: the short one loads too.
    always = FetchDecider(CrossoverSettings(FetchMode.ALWAYS, 10_000), lambda: reply(lookup=0.02), {})
    assert always.decide(32, 0, 26_000).fetch and always.counts["loaded"] == 1


def test_prefill_rate_is_the_setting_else_measured_else_the_prior() -> None:
    measured = FetchDecider(CrossoverSettings(), reply, {})
    assert measured.prefill_rate() == planning.PRIOR_PREFILL_TOKENS_PER_S
    for _ in range(4):
        measured.observe_prefill(4096, 0.1)  # 40 960 tokens/s
    assert measured.prefill_rate() == pytest.approx(40_960)
    configured = FetchDecider(CrossoverSettings(prefill_tokens_per_s=123.0), reply, {})
    for _ in range(4):
        configured.observe_prefill(4096, 0.1)
    assert configured.prefill_rate() == 123.0


def _the_engine_metrics_count_it(d: FetchDecider) -> None:
    """The process's default registry (what an engine's own /metrics serves) sums the live
    deciders' counts at scrape time: this one's are in it (others of the test process may add)."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvpool.wire.metric_names import EngineMetric

    samples = {(s.name, s.labels.get("decision")): s.value
               for f in text_string_to_metric_families(generate_latest(REGISTRY).decode()) for s in f.samples}
    for label, mine in (("loaded", 1), ("recomputed_cheaper", 1), ("recomputed_missing", 1)):
        assert samples[(EngineMetric.FETCH_DECISIONS + "_total", label)] >= mine
    assert samples[(EngineMetric.FETCH_DECISION_TOKENS + "_total", "recomputed_cheaper")] >= 32
    assert samples[(EngineMetric.FETCH_DECISION_TOKENS + "_total", "loaded")] >= 2048
    assert d.counts["loaded"] == 1
