"""Wiring without I/O: handler registration, the webhook adapter, API paths, coalescing, CLI."""

import threading
from typing import Any

import kopf
import pytest

from kvpool_operator.handlers import register_all
from kvpool_operator.handlers.webhook import _merge, admission_pools, tenant_bindings
from kvpool_operator.kube import Kube, KubeError, path
from kvpool_operator.main import build_parser, peering_objects, seniority_priority, settings_from
from kvpool_operator.nodes import Nodes
from kvpool_operator.runtime import Coalescer, Runtime
from kvpool_operator.settings import Settings


def test_handlers_register_on_an_explicit_registry() -> None:
    reg = kopf.OperatorRegistry()
    register_all(reg, Runtime(Settings(), Kube(None), Nodes()))
    webhooks = list(reg._webhooks.get_all_handlers())
    assert [h.id for h in webhooks] == ["kvpool-inject"]
    assert webhooks[0].ignore_failures is True  # fail open
    # No kopf indexes: a standby replica (paused by peering) would answer from empty ones.
    assert len(reg._indexing.get_all_handlers()) == 0
    without = kopf.OperatorRegistry()
    register_all(without, Runtime(Settings(), Kube(None), Nodes()), with_webhook=False)
    assert list(without._webhooks.get_all_handlers()) == []


def test_webhook_adapter_helpers() -> None:
    patch: dict[str, Any] = {"metadata": {"labels": {"a": "b"}}}
    _merge(patch, {"metadata": {"annotations": {"x": "y"}}, "spec": {"containers": []}})
    assert patch == {"metadata": {"labels": {"a": "b"}, "annotations": {"x": "y"}}, "spec": {"containers": []}}


class _Api(Kube):
    """A Kube whose requests answer from a table (path -> body or KubeError)."""

    def __init__(self, answers: dict[str, Any]) -> None:
        super().__init__(None)
        self.answers = answers
        self.asked: list[str] = []

    def request(self, method: str, url: str, body: Any = None, query: Any = None,
                content_type: str = "application/json", timeout: float = 30.0) -> Any:
        self.asked.append(url)
        got = self.answers[url]
        if isinstance(got, KubeError):
            raise got
        return got


def test_the_webhook_reads_the_named_pool_from_the_api_server() -> None:
    """Any replica decides alike, a peering standby too: the pool comes from the API server at
    admission time, not from kopf indexes (empty on a paused replica)."""
    url = "/apis/kvpool.io/v1alpha1/namespaces/ns/kvpools/p"
    pool = {"apiVersion": "kvpool.io/v1alpha1", "kind": "KVPool", "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"storage": {"replicas": 1}}}
    kube = _Api({url: pool})
    got = admission_pools(kube, ("ns", "p"))
    assert list(got) == [("ns", "p")] and got["ns", "p"].key == "ns.p"
    assert kube.asked == [url]
    assert admission_pools(_Api({url: KubeError(404, "gone")}), ("ns", "p")) == {}
    assert admission_pools(_Api({url: KubeError(403, "not watched")}), ("ns", "p")) == {}
    assert admission_pools(_Api({}), None) == {}  # a malformed label: nothing to read
    with pytest.raises(KubeError):  # anything else fails the call (the handler fails open)
        admission_pools(_Api({url: KubeError(500, "boom")}), ("ns", "p"))


def test_tenant_bindings_of_a_namespace() -> None:
    def tn(name: str, nss: list[str], **meta: Any) -> dict[str, Any]:
        return {"metadata": {"name": name, **meta}, "spec": {"tenantId": name, "namespaces": nss}}

    items = [tn("a", ["x", "y"]), tn("b", ["y"]), tn("gone", ["x"], deletionTimestamp="2026-01-01T00:00:00Z"),
             {"metadata": {"name": "bad"}, "spec": {"namespaces": ["x"]}}]
    assert [t.tenant_id for t in tenant_bindings(items, "x")] == ["a"]
    assert [t.tenant_id for t in tenant_bindings(items, "y")] == ["a", "b"]
    assert tenant_bindings(items, "z") == []


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


def test_the_oldest_replica_has_the_highest_priority() -> None:
    """kopf makes the replica of highest priority active: by default the one that has run
    longest, so a restarted or rolled-out replica stands by instead of taking over mid-work."""
    old, new = seniority_priority(1_800_000_000, 999), seniority_priority(1_800_000_001, 0)
    assert old > new > 0
    assert seniority_priority(1_800_000_000, 1) != seniority_priority(1_800_000_000, 2)  # same second
    assert seniority_priority(1_800_000_000.9, 5) == seniority_priority(1_800_000_000, 5)
    assert new < 2**53  # exact in the peering object's JSON
    with pytest.raises(ValueError):
        seniority_priority(1_800_000_000, 1000)


def test_peering_objects_match_kopfs_mode() -> None:
    """A cluster-wide operator peers in a ClusterKopfPeering; one that watches namespaces in a
    KopfPeering in each (kopf leaves a replica paused for good while its object is missing)."""
    assert peering_objects("kvpool-operator", []) == [
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "kvpool-operator"}}]
    got = peering_objects("op", ["a", "b", "a"])
    assert [(o["kind"], o["metadata"]["namespace"]) for o in got] == [("KopfPeering", "a"), ("KopfPeering", "b")]
    assert path(got[0]["apiVersion"], got[0]["kind"], "a") == "/apis/kopf.dev/v1/namespaces/a/kopfpeerings"


def test_cli_refuses_incomplete_webhook_flags() -> None:
    from kvpool_operator.main import main

    with pytest.raises(SystemExit, match="--webhook-cert"):
        main(["--webhook-port", "9443"])
    with pytest.raises(SystemExit, match="dotted name"):
        main(["--webhook-port", "9443", "--webhook-cert", "c", "--webhook-key", "k", "--webhook-managed", "x"])
