"""Wiring without I/O: handler registration, the webhook adapter, API paths, coalescing, CLI."""

import threading
from typing import Any

import kopf
import pytest

from kvpool_operator.handlers import register_all
from kvpool_operator.handlers.webhook import _first, _merge
from kvpool_operator.kube import Kube, path
from kvpool_operator.main import build_parser, settings_from
from kvpool_operator.nodes import Nodes
from kvpool_operator.runtime import Coalescer, Runtime
from kvpool_operator.settings import Settings


def test_handlers_register_on_an_explicit_registry() -> None:
    reg = kopf.OperatorRegistry()
    register_all(reg, Runtime(Settings(), Kube(None), Nodes()))
    webhooks = list(reg._webhooks.get_all_handlers())
    assert [h.id for h in webhooks] == ["kvpool-inject"]
    assert webhooks[0].ignore_failures is True  # fail open
    assert len(reg._indexing.get_all_handlers()) == 2
    without = kopf.OperatorRegistry()
    register_all(without, Runtime(Settings(), Kube(None), Nodes()), with_webhook=False)
    assert list(without._webhooks.get_all_handlers()) == []


def test_webhook_adapter_helpers() -> None:
    patch: dict[str, Any] = {"metadata": {"labels": {"a": "b"}}}
    _merge(patch, {"metadata": {"annotations": {"x": "y"}}, "spec": {"containers": []}})
    assert patch == {"metadata": {"labels": {"a": "b"}, "annotations": {"x": "y"}}, "spec": {"containers": []}}
    assert _first({("ns", "p"): ["v1", "v2"], ("ns", "q"): []}) == {("ns", "p"): "v1"}


def test_api_paths() -> None:
    assert path("v1", "Pod", "ns") == "/api/v1/namespaces/ns/pods"
    assert path("apps/v1", "StatefulSet", "ns", "s") == "/apis/apps/v1/namespaces/ns/statefulsets/s"
    assert path("kvpool.io/v1alpha1", "KVPool", "ns", "p", "status") == \
        "/apis/kvpool.io/v1alpha1/namespaces/ns/kvpools/p/status"
    assert path("kvpool.io/v1alpha1", "KVTier", "ignored", "t") == "/apis/kvpool.io/v1alpha1/kvtiers/t"
    with pytest.raises(ValueError, match="does not know"):
        path("v1", "Nope")


def test_coalescer_folds_concurrent_requests_into_one_more_run() -> None:
    c = Coalescer()
    runs: list[int] = []
    gate, entered = threading.Event(), threading.Event()

    def slow() -> None:
        runs.append(1)
        entered.set()
        gate.wait(5)

    t = threading.Thread(target=c.run, args=("k", slow))
    t.start()
    entered.wait(5)
    assert c.run("k", slow) is False and c.run("k", slow) is False  # folded
    gate.set()
    t.join(5)
    assert len(runs) == 2  # the first, then exactly one more
    assert c.run("k", lambda: None) is True


def test_cli_settings() -> None:
    args = build_parser().parse_args(["--image", "img:1", "--default-dram", "2Gi", "--command", "python -m kvpool"])
    s = settings_from(args)
    assert (s.image, s.default_dram_bytes, s.command) == ("img:1", 2 << 30, ("python", "-m", "kvpool"))
    with pytest.raises(SystemExit, match="default-dram"):
        settings_from(build_parser().parse_args(["--default-dram", "lots"]))


def test_a_replacement_replica_stands_by_briefly_for_a_killed_one() -> None:
    """kopf's 60 s peering lifetime kept a replica that replaced a killed operator pod paused for
    up to a minute (a KVTier deletion waited that long for its finalizer in CI)."""
    assert build_parser().parse_args([]).peering_lifetime == 15
    assert build_parser().parse_args(["--peering-lifetime", "30"]).peering_lifetime == 30


def test_cli_refuses_incomplete_webhook_flags() -> None:
    from kvpool_operator.main import main

    with pytest.raises(SystemExit, match="--webhook-cert"):
        main(["--webhook-port", "9443"])
    with pytest.raises(SystemExit, match="dotted name"):
        main(["--webhook-port", "9443", "--webhook-cert", "c", "--webhook-key", "k", "--webhook-managed", "x"])
