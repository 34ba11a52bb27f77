"""A real Prometheus scrape of a pool on the harness cluster (issue 23, "A real Prometheus scrape").

The operator runs a KVPool of two store nodes; two engine pods get the kvpool sidecar injected,
one beside the pool and one in another namespace (labelled ``<namespace>.<pool>``), and run a
workload through it (puts past the sidecar's local tier, matches, reads, absent keys), so hits,
misses, bytes and restores move. Debian's Prometheus 2.42 scrapes it as the chart's PodMonitors
say: the chart is rendered with its PodMonitors on, each is translated into the scrape config
prometheus-operator would generate (``e2e.monitors``), and pods come from the harness's API server
(client certificate) through file_sd, since Debian builds Prometheus without Kubernetes
discovery. Both sidecars' series must carry the pool's ``pool_namespace`` and ``pool`` (what the
dashboard and the rules select by) and their own ``namespace``. Then every PromQL expression of
the dashboard (its variables set to this pool) and of the alert rules must return a series with
a number.

Expressions that return nothing on a healthy pool (an alert's condition) are evaluated with their
comparisons made ``bool`` (``e2e.prom.live_form``), so they return their series either way.
``e2e.prom.PENDING`` lists the families nothing here exports yet (none now); an expression over
one is skipped and the test fails once the family is exported, so the entry is removed then.

The operator's own metrics (the certificate-expiry gauge of the pool's TLS) are scraped from the
operator process as a static target with the labels the chart's ServiceMonitor gives it (its series
name the KVPool in ``pool_namespace`` and ``pool``): the ServiceMonitor itself cannot be discovered here, because the
harness's endpoints controller refuses the loopback pod IPs (``--endpoint-reconciler-type=none``
and 127.0.0.0/8 addresses in Endpoints are invalid), and the operator runs as a process beside the
cluster.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import subprocess
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.monitors import PodDiscovery, pod_monitor_scrape_configs, pod_target_groups, relabel
from e2e.prom import (  # noqa: F401 (the prometheus fixture)
    PROMETHEUS,
    PROMTOOL,
    ROOT,
    Prometheus,
    api_get,
    live_expressions,
    prometheus,
    query,
    still_pending,
    wait_for_series,
)
from e2e.test_operator_pool import (  # noqa: F401 (fixtures)
    Operator,
    create,
    create_pod_injected,
    kube,
    kvpool,
    operator,
    wait_status,
)
from e2e.testutil import python_cmd, wait_for
from kvpool.wire.metric_names import SidecarMetric, StoreMetric
from kvpool_operator.kube import Kube
from tests.kvpool_chart.test_chart import needs_helm, render

needs_prometheus = pytest.mark.skipif(not PROMETHEUS.exists(), reason="prometheus is not here: run tools/setup.sh "
                                                                      "(it unpacks Debian's prometheus package)")
POOL = "mon"
SCRAPE = ("metrics.podMonitor.enabled=true", "metrics.podMonitor.interval=1s",
          "metrics.podMonitor.scrapeTimeout=900ms")
"""The chart's values for the test: its PodMonitors on, scraping every second (a short test)."""
MOVED = [f"{StoreMetric.LOOKUP_BLOCKS}_total", f"{StoreMetric.HIT_BLOCKS}_total", f"{StoreMetric.MISS_BLOCKS}_total",
         f"{StoreMetric.BYTES_IN}_total", f"{StoreMetric.BYTES_OUT}_total", f"{StoreMetric.OP_SECONDS}_count",
         f"{SidecarMetric.LOOKUP_BLOCKS}_total", f"{SidecarMetric.HIT_BLOCKS}_total",
         f"{SidecarMetric.RESTORED_BYTES}_total", f"{SidecarMetric.POOL_BYTES_OUT}_total",
         f"{SidecarMetric.OP_SECONDS}_count"]
"""Counters the workload must have moved in the scraped series (hits, misses, bytes, restores)."""

WORKLOAD = """
    import os, time
    import numpy as np
    from kvpool.client.client import connect
    from e2e.prom import workload_round

    client = connect(os.environ["KVPOOL_ADDRESS"], timeout=60)
    rng = np.random.default_rng(0)
    rounds = 0
    while True:
        workload_round(client, rng, 4 << 20)  # twice the sidecar's local tier
        rounds += 1
        print("round", rounds, flush=True)
        time.sleep(0.5)
"""


def chart_pod_monitors(tmp: Path) -> list[dict[str, Any]]:
    """The chart's PodMonitors as ``helm template`` renders them with :data:`SCRAPE`."""
    return [d for d in render(tmp, *SCRAPE) if d["kind"] == "PodMonitor"]


def engine_pod(name: str = "engine", pool_label: str = POOL) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"kvpool.io/pool": pool_label}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [{
                "name": "engine", "image": "unused", "command": python_cmd(WORKLOAD),
                # e2e.prom's workload round, and the packages (a container gets the host's PYTHONPATH).
                "env": [{"name": "PYTHONPATH", "value": f"{ROOT}:{ROOT / 'sidecar'}:{ROOT / 'operator'}"}]}]}}


# ------------------------------------------------------------------------------------- pure


STORE_POD: dict[str, Any] = {
    "metadata": {"namespace": "apps", "name": "p-store-0", "uid": "u1",
                 "labels": {"app.kubernetes.io/name": "kvpool", "app.kubernetes.io/component": "store",
                            "kvpool.io/store-of": "p"},
                 "ownerReferences": [{"kind": "StatefulSet", "name": "p-store", "controller": True}]},
    "spec": {"nodeName": "n", "containers": [{"name": "store", "ports": [
        {"name": "control", "containerPort": 7400, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 7404, "protocol": "TCP"}]}]},
    "status": {"podIP": "127.0.9.2", "hostIP": "127.0.0.1", "phase": "Running",
               "conditions": [{"type": "Ready", "status": "True"}]},
}
ENGINE_POD: dict[str, Any] = {
    "metadata": {"namespace": "apps", "name": "engine", "labels": {"kvpool.io/pool": "p"},
                 "annotations": {"kvpool.io/injected": "apps.p"}},
    "spec": {"containers": [{"name": "engine"}],
             "initContainers": [{"name": "kvpool-sidecar", "restartPolicy": "Always",
                                 "ports": [{"name": "kvpool-metrics", "containerPort": 7461}]}]},
    "status": {"podIP": "127.0.9.3", "phase": "Running"},
}

REMOTE_ENGINE_POD: dict[str, Any] = {
    **ENGINE_POD,
    "metadata": {"namespace": "engines", "name": "remote", "labels": {"kvpool.io/pool": "apps.p"},
                 "annotations": {"kvpool.io/injected": "apps.p"}},
    "status": {"podIP": "127.0.9.4", "phase": "Running"},
}
"""An engine in another namespace than its pool (the label ``<namespace>.<name>``, as injection reads it)."""


def scraped(configs: list[dict[str, Any]], pods: list[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The targets Prometheus would scrape with ``configs`` among ``pods``, each as the labels
    its series get (the ``__`` ones dropped, as Prometheus does after relabelling)."""
    out = []
    for cfg in configs:
        for group in pod_target_groups(pods):
            for target in group["targets"]:
                got = relabel({**group["labels"], "__address__": target, "job": cfg["job_name"]},
                              cfg["relabel_configs"])
                if got is not None:
                    out.append({k: v for k, v in got.items() if not k.startswith("__")})
    return out


def test_pod_targets_are_the_pod_roles() -> None:
    groups = pod_target_groups([STORE_POD, ENGINE_POD, {**ENGINE_POD, "status": {"phase": "Pending"}}])
    assert [g["targets"] for g in groups] == [["127.0.9.2:7400"], ["127.0.9.2:7404"], ["127.0.9.3"],
                                              ["127.0.9.3:7461"]]
    store = groups[1]["labels"]
    assert store["__meta_kubernetes_pod_label_kvpool_io_store_of"] == "p"
    assert store["__meta_kubernetes_pod_labelpresent_app_kubernetes_io_component"] == "true"
    assert store["__meta_kubernetes_pod_container_port_name"] == "metrics"
    assert store["__meta_kubernetes_pod_ready"] == "true" and store["__meta_kubernetes_pod_container_init"] == "false"
    assert store["__meta_kubernetes_pod_controller_kind"] == "StatefulSet"
    engine = groups[2]["labels"]  # a container without ports: the bare pod IP
    assert engine["__meta_kubernetes_pod_container_name"] == "engine"
    assert "__meta_kubernetes_pod_container_port_name" not in engine
    sidecar = groups[3]["labels"]  # a native sidecar's port is discovered, marked init
    assert sidecar["__meta_kubernetes_pod_container_init"] == "true"
    assert sidecar["__meta_kubernetes_pod_container_port_protocol"] == "TCP"
    assert sidecar["__meta_kubernetes_pod_annotation_kvpool_io_injected"] == "apps.p"
    assert sidecar["__meta_kubernetes_pod_ready"] == "unknown"


def test_a_pod_monitor_becomes_the_operators_scrape_config() -> None:
    monitor: dict[str, Any] = {"kind": "PodMonitor", "metadata": {"namespace": "mon", "name": "kv-sidecars"}, "spec": {
        "selector": {"matchLabels": {"a.b/c": "x"},
                     "matchExpressions": [{"key": "kvpool.io/pool", "operator": "Exists"},
                                          {"key": "tier", "operator": "NotIn", "values": ["a", "b"]}]},
        "namespaceSelector": {"matchNames": ["apps"]},
        "podMetricsEndpoints": [{"port": "kvpool-metrics", "path": "/metrics", "interval": "5s",
                                 "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_label_kvpool_io_pool"],
                                                  "targetLabel": "pool"}]}]}}
    (cfg,) = pod_monitor_scrape_configs(monitor, Path("/sd.json"))
    assert cfg["job_name"] == "podMonitor/mon/kv-sidecars/0" and cfg["honor_labels"] is False
    assert (cfg["metrics_path"], cfg["scrape_interval"]) == ("/metrics", "5s")
    assert cfg["file_sd_configs"] == [{"files": ["/sd.json"], "refresh_interval": "1s"}]
    rules = cfg["relabel_configs"]
    assert rules[0] == {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}
    assert {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"} in rules
    assert {"action": "keep", "source_labels": ["__meta_kubernetes_namespace"], "regex": "apps"} in rules
    assert {"action": "keep", "regex": "(x);true", "source_labels": [
        "__meta_kubernetes_pod_label_a_b_c", "__meta_kubernetes_pod_labelpresent_a_b_c"]} in rules
    assert {"action": "keep", "source_labels": ["__meta_kubernetes_pod_labelpresent_kvpool_io_pool"],
            "regex": "true"} in rules
    assert {"action": "drop", "regex": "(a|b);true", "source_labels": [
        "__meta_kubernetes_pod_label_tier", "__meta_kubernetes_pod_labelpresent_tier"]} in rules
    assert {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
            "regex": "kvpool-metrics"} in rules
    assert rules[-3:] == [{"target_label": "job", "replacement": "mon/kv-sidecars"},
                          {"target_label": "endpoint", "replacement": "kvpool-metrics"},
                          {"source_labels": ["__meta_kubernetes_pod_label_kvpool_io_pool"], "target_label": "pool"}]
    with pytest.raises(ValueError, match="tlsConfig"):
        pod_monitor_scrape_configs({**monitor, "spec": {**monitor["spec"], "podMetricsEndpoints": [
            {"port": "x", "tlsConfig": {}}]}}, Path("/sd.json"))


@needs_helm
@pytest.mark.skipif(not PROMTOOL.exists(), reason="promtool is not here: run tools/setup.sh")
def test_the_chart_monitors_make_a_config_promtool_accepts(tmp_path: Path) -> None:
    monitors = chart_pod_monitors(tmp_path)
    assert sorted(m["metadata"]["name"] for m in monitors) == ["kv-kvpool-sidecars", "kv-kvpool-stores"]
    sd = tmp_path / "pods.json"
    sd.write_text(json.dumps(pod_target_groups([STORE_POD, ENGINE_POD])))
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump({"scrape_configs": [c for m in monitors for c in pod_monitor_scrape_configs(m, sd)]}))
    r = subprocess.run([str(PROMTOOL), "check", "config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


@needs_helm
def test_store_and_sidecar_series_name_their_pool_in_the_same_labels(tmp_path: Path) -> None:
    """Issue 23: an engine in another namespace than its pool carries ``<namespace>.<pool>`` in
    kvpool.io/pool; its sidecar's series name the pool as the store nodes' do (``pool``,
    ``pool_namespace``, what the dashboard and the rules select by) and keep the engine's own
    ``namespace``."""
    configs = [c for m in chart_pod_monitors(tmp_path) for c in pod_monitor_scrape_configs(m, Path("/sd.json"))]
    got = sorted((t["container"], t["pod"], t["namespace"], t["pool_namespace"], t["pool"], t["endpoint"])
                 for t in scraped(configs, [STORE_POD, ENGINE_POD, REMOTE_ENGINE_POD]))
    assert got == [("kvpool-sidecar", "engine", "apps", "apps", "p", "kvpool-metrics"),
                   ("kvpool-sidecar", "remote", "engines", "apps", "p", "kvpool-metrics"),
                   ("store", "p-store-0", "apps", "apps", "p", "metrics")]
    # tests/kvpool_chart/test_monitoring.py: the dashboard and the rules select and group by these.


# ------------------------------------------------------------------------------- the scrape


def _active_targets(base: str, namespace: str) -> list[dict[str, Any]]:
    """The targets of the pool in ``namespace`` (their pods may run in other namespaces)."""
    return [t for t in api_get(base, "targets", state="active")["activeTargets"]
            if t["labels"].get("pool_namespace") == namespace]


def _engine_exited(api: Kube, engines: list[tuple[str, str]]) -> str:
    """Why an engine container (of the pods ``(namespace, name)``) is not running any more ("" while they run)."""
    for ns, name in engines:
        pod = api.get("v1", "Pod", name, ns) or {}
        for c in (pod.get("status") or {}).get("containerStatuses") or []:
            if c["name"] == "engine" and "terminated" in (c.get("state") or {}):
                return f"{ns}/{name}: " + json.dumps(c["state"]["terminated"])
    return ""


@contextlib.contextmanager
def another_namespace(api: Kube, name: str) -> Iterator[str]:
    """A namespace of its own for an engine away from its pool, deleted afterwards."""
    api.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": name, "labels": {"kvpool-e2e/test": name}}})
    try:
        # Pods are refused until the serviceaccount controller has made `default` there.
        wait_for(lambda: api.get("v1", "ServiceAccount", "default", name), 30, "default service account")
        yield name
    finally:
        api.delete("v1", "Namespace", name)


@pytest.mark.cluster
@pytest.mark.slow
@needs_prometheus
def test_prometheus_scrapes_a_pool_on_the_harness_during_a_workload(
        operator: Operator, kube: Kube, namespace: str, prometheus: Prometheus,  # noqa: F811
        tmp_path: Path) -> None:
    start = time.monotonic()
    with another_namespace(kube, f"{namespace}-engines") as remote_ns:
        # The default tenant's sidecars get the pool's certificate (TLS is the operator's default)
        # only where the pool says they may run: its own namespace unless spec.sidecar.namespaces.
        create(kube, kvpool(POOL, storage={"replicas": 2}, sidecar={"localBytes": "2Mi",
                                                                   "namespaces": [namespace, remote_ns]},
                            tenancy={"defaultTenant": "public"}), namespace)
        wait_status(kube, namespace, POOL, lambda s: s.get("readyReplicas") == 2, 120, "two ready store nodes")
        scrape_pool(kube, namespace, remote_ns, prometheus, tmp_path, start, operator.metrics_port)


def scrape_pool(api: Kube, namespace: str, remote_ns: str, prometheus: Prometheus, tmp_path: Path,  # noqa: F811
                start: float, operator_metrics_port: int) -> None:
    """The scrape: an engine beside the pool and one in ``remote_ns`` (labelled
    ``<namespace>.<pool>``), both running the workload, both sidecars scraped and labelled with
    the pool's namespace and name."""
    engines = [(namespace, "engine"), (remote_ns, "remote")]
    for (ns, name), label in zip(engines, (POOL, f"{namespace}.{POOL}"), strict=True):
        pod = create_pod_injected(api, ns, engine_pod(name, label))
        assert pod["metadata"]["annotations"].get("kvpool.io/injected") == f"{namespace}.{POOL}", pod["metadata"]

    # Scoped to this test's namespaces: the session's other tests run pools of their own.
    sd = tmp_path / "pods.json"
    discovery = PodDiscovery(api, sd, namespaces=[namespace, remote_ns]).start()
    try:
        configs = [c for m in chart_pod_monitors(tmp_path) for c in pod_monitor_scrape_configs(m, sd)]
        configs.append({"job_name": "kvpool-operator", "static_configs": [
            {"targets": [f"127.0.0.1:{operator_metrics_port}"],
             "labels": {"namespace": "kvpool-system", "container": "operator", "endpoint": "metrics"}}]})
        base = prometheus.start(configs)
        ready = time.monotonic()

        # Every store node and both injected sidecars are targets, up, labelled as the dashboard
        # expects: the pool's namespace and name, and the pod's own namespace.
        def up() -> list[dict[str, Any]] | None:
            got = _active_targets(base, namespace)
            return got if len(got) == 4 and all(t["health"] == "up" for t in got) else None

        try:
            targets = wait_for(up, 90, "4 healthy targets", interval=1)
        except AssertionError:
            raise AssertionError(f"targets: {json.dumps(_active_targets(base, namespace))}\n"
                                 f"engine: {_engine_exited(api, engines)}\n{prometheus.log_tail()}") from None
        seen = sorted(tuple(t["labels"].get(k) for k in ("pod", "namespace", "container", "endpoint", "pool",
                                                          "pool_namespace")) for t in targets)
        assert seen == [("engine", namespace, "kvpool-sidecar", "kvpool-metrics", POOL, namespace),
                        (f"{POOL}-store-0", namespace, "store", "metrics", POOL, namespace),
                        (f"{POOL}-store-1", namespace, "store", "metrics", POOL, namespace),
                        ("remote", remote_ns, "kvpool-sidecar", "kvpool-metrics", POOL, namespace)]
        for t in targets:  # pods are processes on the host: their IPs are loopback addresses
            host = urllib.parse.urlsplit(t["scrapeUrl"]).hostname or ""
            assert ipaddress.ip_address(host).is_loopback, t["scrapeUrl"]

        waiting = wait_for_series(base, live_expressions(namespace, POOL), 90, lambda: bool(_engine_exited(
            api, engines)))
        exited = _engine_exited(api, engines)
        assert not exited, exited
        assert not waiting, "no series with a number for:\n" + "\n".join(waiting.values())
        still = [m for m in MOVED if not any(float(r["value"][1]) > 0 for r in query(
            base, f'sum(increase({m}{{pool_namespace="{namespace}", pool="{POOL}"}}[5m]))'))]
        assert not still, f"the workload did not move {still}"
        # The engine away from its pool counts in the pool's series (what the dashboard selects).
        remote = query(base, f'sum(increase({SidecarMetric.LOOKUP_BLOCKS}_total{{pool_namespace="{namespace}", '
                             f'pool="{POOL}", namespace="{remote_ns}"}}[5m]))')
        assert remote and float(remote[0]["value"][1]) > 0, remote
        assert not still_pending(base)
        print(f"pool and engine up: {ready - start:.1f}s, every expression with series {time.monotonic() - ready:.1f}s"
              f" later ({len(live_expressions())} expressions)")
        assert len(discovery.errors) < 5, discovery.errors  # a busy API server may miss a round or two
    finally:
        discovery.stop()
