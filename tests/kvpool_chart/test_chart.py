"""The Helm chart (charts/kvpool): lint and template are clean, the rendered objects say what the
issue asks (least-privilege RBAC, a fail-open webhook scoped by namespace and label, the operator
started as `kvpool operator`), the chart's CRDs are the top-level ones, and the values schema
refuses bad values. Uses the helm binary the e2e harness builds (skipped when it is not built)."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
CHART = ROOT / "charts" / "kvpool"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from e2e import build  # noqa: E402

HELM = build.cache_dir() / "bin" / f"helm-{build.HELM_VERSION}" / "helm"
KUBE_VERSION = build.K8S_VERSION.lstrip("v")
needs_helm = pytest.mark.skipif(not HELM.exists(), reason=f"helm is not built ({HELM}); run python -m e2e.build")


def helm(*args: str, check: bool = True, tmp: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp or "/tmp")}
    if tmp is not None:
        env.update(HELM_CACHE_HOME=str(tmp / "cache"), HELM_CONFIG_HOME=str(tmp / "config"),
                   HELM_DATA_HOME=str(tmp / "data"))
    proc = subprocess.run([str(HELM), *args], text=True, capture_output=True, env=env, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def render(tmp: Path, *sets: str, namespace: str = "kvpool-system") -> list[dict[str, Any]]:
    args = ["template", "kv", str(CHART), "-n", namespace, "--kube-version", KUBE_VERSION]
    for s in sets:
        args += ["--set", s]
    out = helm(*args, tmp=tmp)
    assert "WARNING" not in out.stderr, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def test_crds_are_the_top_level_ones() -> None:
    top = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    chart = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert top and chart == top
    for name in top:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), (
            f"charts/kvpool/crds/{name} differs from crds/{name}: cp crds/*.yaml charts/kvpool/crds/")


def test_dockerfile_entrypoint_is_kvpool() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["kvpool"]' in text
    assert "operator" in text  # the extra that brings kopf and the Kubernetes client


@needs_helm
def test_lint_is_clean(tmp_path: Path) -> None:
    out = helm("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, tmp=tmp_path)
    assert "0 chart(s) failed" in out.stdout
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


@needs_helm
def test_defaults_render_the_operator_rbac_and_webhook(tmp_path: Path) -> None:
    docs = render(tmp_path)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service",
                            "Service", "Secret", "MutatingWebhookConfiguration", "NetworkPolicy"])
    dep = one(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["kvpool"] and c["args"][c["args"].index("operator") - 2:][:3] == [
        "--log-level", "INFO", "operator"]
    args = c["args"]
    assert "--standalone" in args and "--webhook-port" in args
    assert args[args.index("--webhook-cert") + 1] == "/etc/kvpool/webhook/tls.crt"
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["serviceAccountName"] == "kv-kvpool"
    secret_vol = next(v for v in pod["volumes"] if v["name"] == "webhook-cert")
    secret = one(docs, "Secret")
    assert secret_vol["secret"]["secretName"] == secret["metadata"]["name"]

    mwc = one(docs, "MutatingWebhookConfiguration")
    (wh,) = mwc["webhooks"]
    assert wh["failurePolicy"] == "Ignore" and wh["timeoutSeconds"] <= 10 and wh["sideEffects"] == "None"
    (expr,) = wh["namespaceSelector"]["matchExpressions"]
    assert expr["key"] == "kubernetes.io/metadata.name" and expr["operator"] == "NotIn"
    assert {"kube-system", "kvpool-system"} <= set(expr["values"])
    assert wh["objectSelector"]["matchExpressions"] == [{"key": "kvpool.io/pool", "operator": "Exists"}]
    assert wh["rules"] == [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                            "resources": ["pods"], "scope": "Namespaced"}]
    svc = wh["clientConfig"]["service"]
    assert svc["path"] == "/kvpool-inject" and svc["namespace"] == "kvpool-system"
    names = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    assert svc["name"] in names and names[svc["name"]]["spec"]["ports"][0]["targetPort"] == "webhook"
    # The generated serving cert is signed by the CA in caBundle, for the Service's DNS names.
    assert wh["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)
    assert f"{svc['name']}.kvpool-system.svc" in sans


@needs_helm
def test_rbac_is_least_privilege(tmp_path: Path) -> None:
    docs = render(tmp_path)
    rules = one(docs, "ClusterRole")["rules"]
    for r in rules:
        assert "*" not in r["verbs"] and "*" not in r["resources"] and "*" not in r["apiGroups"], r
        assert "escalate" not in r["verbs"] and "bind" not in r["verbs"]
    granted = {(g, res, v) for r in rules for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]}
    assert ("kvpool.io", "kvpools/status", "patch") in granted
    assert ("apps", "statefulsets", "create") in granted
    assert ("apps", "deployments", "delete") in granted  # the pool's router API comes and goes with spec.router
    assert ("", "pods", "create") not in granted and ("", "pods", "delete") not in granted
    # The chart owns the webhook configuration: the operator gets no right to change it.
    assert not any(res == "mutatingwebhookconfigurations" for _, res, _ in granted)
    assert not any(g == "rbac.authorization.k8s.io" for g, _, _ in granted)

    # Watching some namespaces: the namespaced rights are Roles there, not cluster-wide.
    docs = render(tmp_path, "watchNamespaces={team-a,team-b}")
    cluster_res = {res for r in one(docs, "ClusterRole")["rules"] for res in r["resources"]}
    assert "statefulsets" not in cluster_res and "pods" not in cluster_res
    roles = by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in by_kind(docs, "RoleBinding")) == ["team-a", "team-b"]
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--watch-namespace"] == ["team-a", "team-b"]


@needs_helm
def test_url_mode_existing_secret_peering_and_service_monitor(tmp_path: Path) -> None:
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode()
    docs = render(tmp_path, "webhook.mode=url", "webhook.url=https://127.0.0.1:9443", "webhook.certSecret=mine",
                  f"webhook.caBundle={ca}", "replicaCount=2", "metrics.serviceMonitor.enabled=true",
                  "webhook.excludeNamespaces={infra}")
    assert not by_kind(docs, "Secret")  # the given Secret is used, none generated
    (wh,) = one(docs, "MutatingWebhookConfiguration")["webhooks"]
    assert wh["clientConfig"] == {"url": "https://127.0.0.1:9443/kvpool-inject", "caBundle": ca}
    assert "infra" in wh["namespaceSelector"]["matchExpressions"][0]["values"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "webhook-cert")["secret"]["secretName"] == "mine"
    args = pod["containers"][0]["args"]
    assert args[args.index("--peering") + 1] == "kvpool-operator" and "--standalone" not in args
    sm = one(docs, "ServiceMonitor")
    metrics_svc = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("-metrics"))
    assert all(metrics_svc["metadata"]["labels"].get(k) == v
               for k, v in sm["spec"]["selector"]["matchLabels"].items())

    docs = render(tmp_path, "webhook.enabled=false", "metrics.enabled=false")
    assert not by_kind(docs, "MutatingWebhookConfiguration") and not by_kind(docs, "Service")
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--webhook-port" not in args and args[args.index("--metrics-port") + 1] == "0"


@needs_helm
def test_two_replicas_peer_with_a_pdb_and_listen_where_told(tmp_path: Path) -> None:
    """replicaCount 2 (issue 19): a PodDisruptionBudget keeps one replica through drains, the
    replicas prefer different nodes, kopf's peering identity is the pod name, and the servers
    listen on listenAddress (the e2e harness's pods share one network namespace)."""
    docs = render(tmp_path)
    assert not by_kind(docs, "PodDisruptionBudget")  # one replica: nothing to keep
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--webhook-addr") + 1] == "0.0.0.0" and args[args.index("--metrics-addr") + 1] == "0.0.0.0"
    assert args[args.index("--liveness") + 1].startswith("http://0.0.0.0:")
    assert "affinity" not in pod

    docs = render(tmp_path, "replicaCount=2", "listenAddress=$(POD_IP)")
    pdb = one(docs, "PodDisruptionBudget")
    dep = one(docs, "Deployment")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    pod = dep["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    c = pod["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    args = c["args"]
    assert args[args.index("--webhook-addr") + 1] == args[args.index("--metrics-addr") + 1] == "$(POD_IP)"
    assert args[args.index("--liveness") + 1].startswith("http://$(POD_IP):")
    assert not by_kind(render(tmp_path, "replicaCount=2", "podDisruptionBudget.enabled=false"), "PodDisruptionBudget")

    # Watching namespaces, the replicas peer in a KopfPeering in each: the Roles allow it.
    docs = render(tmp_path, "replicaCount=2", "watchNamespaces={team-a}")
    (role,) = by_kind(docs, "Role")
    granted = {(g, res, v) for r in role["rules"] for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]}
    assert {("kopf.dev", "kopfpeerings", v) for v in ("get", "list", "watch", "create", "patch")} <= granted


@needs_helm
def test_network_policies_on_by_default_and_off_with_the_switch(tmp_path: Path) -> None:
    """The operator's pods get their own policy (webhook from anywhere: the API server is no pod;
    metrics from the monitoring namespace); the operator renders the pools' (issue 23)."""
    docs = render(tmp_path)
    dep = one(docs, "Deployment")
    pol = one(docs, "NetworkPolicy")
    assert pol["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    rules = {r["ports"][0]["port"]: r.get("from") for r in pol["spec"]["ingress"]}
    assert rules == {"health": None, "webhook": None, "metrics": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    labels = dict(kv.split("=") for kv in args[args.index("--operator-pod-labels") + 1].split(","))
    assert labels == dep["spec"]["selector"]["matchLabels"]
    assert yaml.safe_load(args[args.index("--metrics-from") + 1]) == rules["metrics"]
    granted = {(g, res, v) for r in one(docs, "ClusterRole")["rules"] for g in r["apiGroups"]
               for res in r["resources"] for v in r["verbs"]}
    assert ("networking.k8s.io", "networkpolicies", "create") in granted

    docs = render(tmp_path, "networkPolicy.enabled=false")
    assert not by_kind(docs, "NetworkPolicy")
    assert "--no-network-policy" in one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    # Off, the operator may still delete the policies it made while on (and nothing else).
    assert [r["verbs"] for r in one(docs, "ClusterRole")["rules"] if "networkpolicies" in r["resources"]] == [
        ["delete"]]


@needs_helm
@pytest.mark.parametrize("setting, message", [
    ("replicaCount=0", "/replicaCount"),
    ("webhook.timeoutSeconds=30", "/webhook/timeoutSeconds"),
    ("webhook.mode=sidecar", "/webhook/mode"),
    ("webhook.mode=url", "/webhook"),  # url mode needs an https URL
    ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ("logLevel=LOUD", "/logLevel"),
    ("operator.defaultDram=lots", "/operator/defaultDram"),
    ("watchNamespaces={Bad_Name}", "/watchNamespaces"),
    ("metrics.port=70000", "/metrics/port"),
    ("unknownKey=1", "unknownKey"),
])
def test_schema_refuses_bad_values(tmp_path: Path, setting: str, message: str) -> None:
    out = helm("template", "kv", str(CHART), "--kube-version", KUBE_VERSION, "--set", setting, check=False,
               tmp=tmp_path)
    assert out.returncode != 0, f"{setting} was accepted"
    assert "schema" in out.stderr and message in out.stderr, out.stderr


@needs_helm
def test_pod_monitors_scrape_the_ports_the_operator_names(tmp_path: Path) -> None:
    """The monitoring switch adds PodMonitors of the store nodes and of the injected sidecars,
    scraping the container ports the operator renders (by name); injected sidecars serve their
    metrics by default."""
    from kvpool_operator.children import store_container
    from kvpool_operator.injection import PoolView, sidecar_container
    from kvpool_operator.model import parse_pool, resolve_layout
    from kvpool_operator.settings import Settings
    from kvpool_operator.testing import pool_body

    assert not by_kind(render(tmp_path), "PodMonitor")  # off unless asked
    docs = render(tmp_path, "metrics.podMonitor.enabled=true", "metrics.podMonitor.labels.release=prom")
    monitors = {d["metadata"]["name"]: d for d in by_kind(docs, "PodMonitor")}
    assert set(monitors) == {"kv-kvpool-stores", "kv-kvpool-sidecars"}
    stores, sidecars = monitors["kv-kvpool-stores"], monitors["kv-kvpool-sidecars"]
    assert all(m["metadata"]["labels"]["release"] == "prom" for m in monitors.values())
    assert stores["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "kvpool",
                                                         "app.kubernetes.io/component": "store"}
    assert sidecars["spec"]["selector"]["matchExpressions"] == [{"key": "kvpool.io/pool", "operator": "Exists"}]
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    port = int(args[args.index("--sidecar-metrics-port") + 1])
    assert port > 0  # on by default

    settings = Settings()
    pool = parse_pool(pool_body())
    layout = resolve_layout(pool, {}, settings.default_dram_bytes, settings.store_memory_overhead_bytes)
    store_ports = {p["name"]: p["containerPort"] for p in store_container(pool, layout, settings)["ports"]}
    (store_ep,) = stores["spec"]["podMetricsEndpoints"]
    assert store_ports[store_ep["port"]] == pool.metrics_port == 7404
    sc = sidecar_container(PoolView("ns", "p", local_bytes=1 << 20, drain_seconds=0), None, settings)
    (sidecar_ep,) = sidecars["spec"]["podMetricsEndpoints"]
    assert {p["name"]: p["containerPort"] for p in sc["ports"]}[sidecar_ep["port"]] == port


def test_pool_tls_switch(tmp_path: Path) -> None:
    """On by default: the operator issues and uses the pools' certificates, keeping its own under
    the writable /var/tmp/kvpool; off, it is told so (its own default is on)."""
    args = one(render(tmp_path, "tls.enabled=false"), "Deployment")["spec"]["template"]["spec"]["containers"][0][
        "args"]
    assert "--tls" not in args and "--no-tls" in args
    dep = one(render(tmp_path), "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--tls" in args and args[args.index("--tls-dir") + 1] == "/var/tmp/kvpool/tls"
    mounts = [m["mountPath"] for m in dep["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]]
    assert "/var/tmp/kvpool" in mounts
