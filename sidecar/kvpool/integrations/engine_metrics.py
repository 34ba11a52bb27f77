"""The fetch-or-recompute counts of an engine integration, in its process's Prometheus registry.

Every engine kvpool integrates with (vLLM, SGLang, LMCache) serves prometheus-client's default
registry on its own ``/metrics``; this module adds one collector to it that sums, at scrape time,
the :class:`~kvpool.wire.counters.FetchDecisionCounter` counts of every live
:class:`~kvpool.integrations.crossover.FetchDecider` of the process (the decider counts under its
own lock, so the decision path pays nothing more).  ``recomputed_cheaper`` is the miss reason
"recomputed because cheaper" (:class:`~kvpool.wire.counters.MissReason`), in lookups and tokens.
Names: :class:`~kvpool.wire.metric_names.EngineMetric`.

An engine whose ``/metrics`` is served by another process than the one deciding (vLLM v1: the
API server aggregates only its multiprocess files, the decision runs in the engine core) does not
show them there: ``KVPOOL_ENGINE_METRICS_PORT`` then makes the deciding process serve its own
registry on that port (``KVPOOL_ENGINE_METRICS_ADDR``, default 0.0.0.0).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from kvpool.wire.counters import FetchDecisionCounter as C
from kvpool.wire.metric_names import EngineMetric

DECISIONS = {"loaded": C.LOADED, "recomputed_cheaper": C.RECOMPUTED_CHEAPER,
             "recomputed_missing": C.RECOMPUTED_MISSING}
"""``decision`` label → the counter of lookups."""
TOKENS = {"loaded": C.LOADED_TOKENS, "recomputed_cheaper": C.RECOMPUTED_CHEAPER_TOKENS}
"""``decision`` label → the counter of tokens."""


PORT_ENV = "KVPOOL_ENGINE_METRICS_PORT"
"""A port on which the deciding process serves its registry itself (unset: the engine's own /metrics)."""
ADDR_ENV = "KVPOOL_ENGINE_METRICS_ADDR"


class Counted(Protocol):
    @property
    def counts(self) -> Mapping[str, int]: ...


_deciders: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def totals(counts: list[Mapping[str, int]]) -> tuple[dict[str, int], dict[str, int]]:
    """Lookups and tokens by ``decision`` label, summed over ``counts`` (pure)."""
    return ({label: sum(int(c.get(name, 0)) for c in counts) for label, name in DECISIONS.items()},
            {label: sum(int(c.get(name, 0)) for c in counts) for label, name in TOKENS.items()})


class _Collector:
    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        lookups, tokens = totals([d.counts for d in list(_deciders)])
        fam = CounterMetricFamily(EngineMetric.FETCH_DECISIONS, "kvpool lookups by fetch-or-recompute decision",
                                  labels=["decision"])
        for label, n in lookups.items():
            fam.add_metric([label], n)
        yield fam
        fam = CounterMetricFamily(EngineMetric.FETCH_DECISION_TOKENS, "Tokens of those lookups, by decision",
                                  labels=["decision"])
        for label, n in tokens.items():
            fam.add_metric([label], n)
        yield fam


def track(decider: Counted) -> None:
    """Count ``decider`` in the process's ``/metrics`` (the collector is registered once; without
    prometheus-client in the engine's environment nothing is exported)."""
    global _registered
    with _lock:
        _deciders.add(decider)
        if _registered:
            return
        try:
            from prometheus_client import REGISTRY
        except ImportError:  # an engine environment without it: the counts stay in the stats dict
            return
        REGISTRY.register(_Collector())
        _registered = True
        port = os.environ.get(PORT_ENV, "")
        if port:
            from kvpool.wire import metrics_http

            metrics_http.serve(metrics_http.parse_port(port), os.environ.get(ADDR_ENV, "0.0.0.0"), REGISTRY)
