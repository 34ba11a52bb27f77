"""The chart's dashboard and alert rules (charts/kvpool/files: dashboard.json, prometheus-rules.yaml):
rendered from their files, `promtool check rules` and `promtool test rules` (a unit test per
alert, tests/kvpool_chart/promtool/rules_test.yaml), and every PromQL expression of both evaluated
by a real Prometheus scraping a LocalCluster's store nodes and sidecars during a workload.

Prometheus and promtool are Debian's 2.42 package, which tools/setup.sh unpacks into the cache; the
helpers that find, run and query it are e2e.prom's (e2e/test_monitoring_scrape.py scrapes a pool on
the harness cluster with them).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from e2e.prom import (  # noqa: E402, F401 (the prometheus fixture)
    CERT_EXPIRY,
    PROMETHEUS,
    PROMTOOL,
    SHORT_WINDOW,
    Prometheus,
    dashboard,
    dashboard_exprs,
    free_port,
    live_expressions,
    live_form,
    prometheus,
    query,
    rule_groups,
    rules,
    still_pending,
    wait_for_series,
    workload_round,
)
from tests.kvpool_chart.test_chart import needs_helm, one, render  # noqa: E402

needs_promtool = pytest.mark.skipif(not PROMTOOL.exists(), reason="promtool is not here: run tools/setup.sh "
                                                                  "(it unpacks Debian's prometheus package)")
RULES_TEST = Path(__file__).parent / "promtool" / "rules_test.yaml"
POOL_NAMESPACE = "local"


def _rendered(tmp: Path) -> list[dict[str, Any]]:
    return render(tmp, "monitoring.dashboard.enabled=true", "monitoring.prometheusRule.enabled=true")


# ------------------------------------------------------------------------------------- pure


def test_every_alert_the_issue_asks_for_is_there_with_a_unit_test() -> None:
    alerts = [r["alert"] for r in rules() if "alert" in r]
    assert alerts == ["KVPoolNearFull", "KVPoolStoreNodeDown", "KVPoolQuotaRefusalsRising", "KVPoolHitRateDropping",
                      "KVPoolDrainStuck", "KVPoolCertificateNearExpiry"]
    tested = {t["alertname"] for case in yaml.safe_load(RULES_TEST.read_text())["tests"]
              for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert tested == set(alerts)  # each fires in its test (and each test has a case where it must not)
    assert any(CERT_EXPIRY in r["expr"] for r in rules())
    for r in rules():
        if "alert" in r:
            assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"], r["alert"]


def test_dashboard_panels_cover_what_the_issue_asks() -> None:
    d = dashboard()
    assert d["uid"] == "kvpool-pools" and [v["name"] for v in d["templating"]["list"]] == [
        "datasource", "namespace", "pool"]
    titles = " / ".join(p["title"].lower() for p in d["panels"])
    for what in ("capacity and usage", "hit rate by tier and tenant", "miss reasons", "latency", "drain",
                 "warm-up", "quota refusals", "useful restore"):
        assert what in titles, what
    exprs = dashboard_exprs()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and len(exprs) >= 20
    # Every query is scoped by the dashboard's variables: the pool's namespace and name, which
    # store and sidecar series carry alike (never the pod's namespace: an engine's may be another).
    for e in exprs:
        for sel in re.findall(r"\{([^}]*)\}", e):
            assert 'pool_namespace=~"$namespace"' in sel and 'pool=~"$pool"' in sel, e
            assert not re.search(r"(?<!_)namespace=", sel), e
    for v in d["templating"]["list"][1:]:
        assert "pool_namespace" in v["query"]["query"], v


def test_rules_group_by_the_pool_labels() -> None:
    """Grouped by pool_namespace and pool, the labels store and sidecar series share (issue 23)."""
    groupings = [(r["expr"], by) for r in rules() for by in re.findall(r"by \(([^)]*)\)", r["expr"])]
    assert len(groupings) >= 8
    for expr, by in groupings:
        assert {"pool_namespace", "pool"} <= {x.strip() for x in by.split(",")}, expr


def test_expressions_name_only_documented_metrics() -> None:
    """The names the PromQL uses are the exporters' (kvpool.wire.metric_names, docs/metrics.md)."""
    from kvpool.wire import metric_names as names

    known = {m.value for enum in (names.StoreMetric, names.SidecarMetric, names.EngineMetric, names.TlsMetric)
             for m in enum}
    assert CERT_EXPIRY == names.TlsMetric.CERTIFICATE_EXPIRY
    used = {m for e in [*dashboard_exprs(), *(r["expr"] for r in rules())]
            for m in re.findall(r"\b(kvpool_[a-z0-9_]+)", e)}
    stripped = {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in used}
    assert stripped <= known, sorted(stripped - known)


# ------------------------------------------------------------------------------ chart + promtool


@needs_helm
def test_chart_renders_the_files_off_by_default(tmp_path: Path) -> None:
    assert not [d for d in render(tmp_path) if d["kind"] in ("ConfigMap", "PrometheusRule")]
    docs = _rendered(tmp_path)
    cm = one(docs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # kube-prometheus-stack's dashboard sidecar
    assert json.loads(cm["data"]["kvpool.json"]) == dashboard()
    assert one(docs, "PrometheusRule")["spec"]["groups"] == rule_groups()
    cm = one(render(tmp_path, "monitoring.dashboard.enabled=true", "monitoring.dashboard.namespace=grafana"),
             "ConfigMap")
    assert cm["metadata"]["namespace"] == "grafana"


def _write_rendered_rules(tmp: Path) -> Path:
    spec = one(_rendered(tmp), "PrometheusRule")["spec"]
    path = tmp / "rules.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@needs_helm
@needs_promtool
def test_promtool_checks_the_rendered_rules(tmp_path: Path) -> None:
    path = _write_rendered_rules(tmp_path)
    r = subprocess.run([str(PROMTOOL), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    assert f"{len(rules())} rules found" in r.stdout


@needs_helm
@needs_promtool
def test_promtool_unit_tests_every_alert(tmp_path: Path) -> None:
    _write_rendered_rules(tmp_path)
    shutil.copy(RULES_TEST, tmp_path / "rules_test.yaml")
    r = subprocess.run([str(PROMTOOL), "test", "rules", str(tmp_path / "rules_test.yaml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------------- a real scrape


def test_live_form() -> None:
    assert live_form('sum(rate(x{pool=~"$pool"}[$__rate_interval]))') == f'sum(rate(x{{pool=~".*"}}[{SHORT_WINDOW}]))'
    assert live_form("a[2h] > 2 * b and c > bool 1") == f"a[{SHORT_WINDOW}] > bool 2 * b and c > bool 1"
    assert live_form('up{reason!="x"} == 0') == 'up{reason!="x"} == bool 0'


def scrape_targets(lc: Any) -> list[dict[str, Any]]:
    """Static targets with the labels the chart's PodMonitors give a pod's endpoint (namespace,
    pod, container, endpoint = the port's name, pool and pool_namespace naming the pool); the
    second sidecar is an engine's in another namespace than the pool's (``e2e/
    test_monitoring_scrape.py`` checks the PodMonitors' relabelling gives it these labels)."""
    out = []
    for kind, n, container, port in (("store", len(lc.stores), "store", "metrics"),
                                     ("sidecar", len(lc.sidecars), "kvpool-sidecar", "kvpool-metrics")):
        for i in range(n):
            host = urllib.parse.urlsplit(lc.metrics_url(kind, i)).netloc
            ns = "engines" if kind == "sidecar" and i == 1 else POOL_NAMESPACE
            out.append({"targets": [host], "labels": {
                "namespace": ns, "pool_namespace": POOL_NAMESPACE, "pool": "local", "pod": f"{kind}-{i}",
                "container": container, "endpoint": port}})
    return out


@contextlib.contextmanager
def operator_exporter(tmp_path: Path) -> Iterator[list[dict[str, Any]]]:
    """The operator's own ``/metrics`` (kvpool_operator.metrics.serve) after the TLS step of a
    pool's reconcile (kvpool_operator.pool_tls over an in-memory stand-in of the Kubernetes API):
    the certificate-expiry gauge of real certificates, as a target of the chart's ServiceMonitor."""
    from kvpool_operator import certs, metrics, pool_tls
    from kvpool_operator.model import parse_pool
    from kvpool_operator.testing import pool_body
    from tests.kvpool_operator.test_pool_tls import Secrets

    pool = parse_pool(pool_body("local", "local", router={"enabled": True}))
    pool_tls.ensure_pool_tls(Secrets(("local",)), pool, str(tmp_path / "operator-tls"),  # type: ignore[arg-type]
                             certs.CertPolicy())
    port = free_port()
    server = metrics.serve(port, "127.0.0.1")
    try:
        yield [{"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": "kvpool-system", "container": "operator",
                                                              "endpoint": "metrics"}}]
    finally:
        server.shutdown()
        server.server_close()
        pool_tls.forget_pool(None, pool_body("local", "local"))


@pytest.mark.slow
@pytest.mark.skipif(not PROMETHEUS.exists(), reason="prometheus is not here: run tools/setup.sh")
def test_a_real_prometheus_evaluates_every_expression(prometheus: Prometheus, tmp_path: Path) -> None:  # noqa: F811
    import numpy as np

    from kvpool.apps.cluster import LocalCluster

    mib = 1 << 20
    with LocalCluster(stores=2, sidecars=2, tenants=["a", "b"], quotas={"b": 2 * mib}, store_bytes=4 * mib,
                      local_bytes=2 * mib, ssd_bytes=16 * mib) as lc, operator_exporter(tmp_path) as operator:
        # The operator's job as the chart's ServiceMonitor makes it.
        base = prometheus.start([{"job_name": "kvpool", "static_configs": scrape_targets(lc)},
                                 {"job_name": "kvpool-operator", "static_configs": operator}])
        stop = threading.Event()
        failed: list[BaseException] = []

        def work() -> None:
            """Tenant a writes past DRAM and its sidecar's local tier; tenant b past its quota."""
            rng = np.random.default_rng(0)
            try:
                while not stop.is_set():
                    for i, nbytes in ((0, 4 * mib), (1, 3 * mib)):
                        c = lc.connect(i)
                        try:
                            workload_round(c, rng, nbytes)
                        finally:
                            c.close()
                    stop.wait(0.5)
            except BaseException as exc:  # shown by the test, not lost in a thread
                failed.append(exc)

        # The workload runs while Prometheus scrapes, so every rate has samples that moved.
        worker = threading.Thread(target=work, name="workload")
        worker.start()
        try:
            waiting = wait_for_series(base, live_expressions(POOL_NAMESPACE, "local"), 120, lambda: bool(failed))
        finally:
            stop.set()
            worker.join(60)
        assert not failed, failed
        assert not waiting, "no series with a number for:\n" + "\n".join(waiting.values())
        assert not still_pending(base)
        # The operator's gauge names the KVPool (pool_namespace, pool); namespace is the operator's.
        got = query(base, f'{CERT_EXPIRY}{{pool_namespace="local", pool="local", namespace="kvpool-system"}}')
        assert {r["metric"]["kind"] for r in got} == {"ca", "serving", "client", "router"}
