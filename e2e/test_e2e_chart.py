"""End to end, as a user runs kvpool (issue 6 §2): `helm install` of charts/kvpool, `kubectl apply`
of the examples, engine Deployments whose pods get the sidecar injected and run `kvpool loadgen`
through it, scale-down refused then forced, and nothing left behind after deletion and uninstall.

Everything runs on the harness cluster (e2e/): the chart's operator Deployment becomes a pod that
the node agent runs as a process (`kvpool operator ...`, the installed console script), and so do
the store pods that operator creates and the engine pods with their sidecars. The harness has no
Service routing, so the chart is installed in its `webhook.mode=url` (clientConfig.url on
127.0.0.1, the harness's webhook certificate in a TLS Secret); everything else is the defaults a
real cluster gets, except faster reconcile intervals.

The tests of this module share one release and one application namespace and run in order.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import Cluster, free_port
from e2e.testutil import wait_for

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "kvpool"
API = "kvpool.io/v1alpha1"
LOADGEN_PREFIX = "KVPOOL_LOADGEN "


@dataclass
class Release:
    cluster: Cluster
    name: str
    namespace: str  # the operator's
    apps: str  # where the pools and engines of these tests live
    home: Path
    webhook_port: int
    installed: bool = True

    def helm(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.home), "KUBECONFIG": str(self.cluster.kubeconfig),
               "HELM_CACHE_HOME": str(self.home / "cache"), "HELM_CONFIG_HOME": str(self.home / "config"),
               "HELM_DATA_HOME": str(self.home / "data")}
        proc = subprocess.run([str(self.cluster.binaries.helm), *args, "-n", self.namespace], env=env, text=True,
                              capture_output=True, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"helm {' '.join(args)}: {proc.stdout}\n{proc.stderr}"
        return proc

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = self.cluster.kubectl(*args, input=input, check=False)
        if check:
            assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stdout}\n{proc.stderr}"
        return proc

    def get(self, *args: str) -> Any:
        """`kubectl get ... -o json` as a dict, or None when it is not found."""
        proc = self.kubectl("get", *args, "-o", "json", check=False)
        if proc.returncode != 0:
            assert "NotFound" in proc.stderr, proc.stderr
            return None
        return json.loads(proc.stdout)

    def pool_status(self, name: str) -> dict[str, Any]:
        return dict((self.get("kvpools.kvpool.io", name, "-n", self.apps) or {}).get("status") or {})

    def wait_pool(self, name: str, pred: Callable[[dict[str, Any]], bool], timeout: float,
                  what: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            st = self.pool_status(name)
            return st if st and pred(st) else None

        return wait_for(check, timeout, what, interval=0.5)

    def operator_log(self, lines: int = 80) -> str:
        return self.kubectl("logs", "-n", self.namespace, f"deploy/{self.name}", f"--tail={lines}", check=False).stdout


def cond(status: dict[str, Any], ctype: str) -> tuple[str, str] | None:
    for c in status.get("conditions") or []:
        if c["type"] == ctype:
            return c["status"], c.get("reason", "")
    return None


def create_namespace(cluster: Cluster, name: str) -> None:
    cluster.kubectl("create", "namespace", name)
    # Pods are refused until the serviceaccount controller has made `default` there.
    wait_for(lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
             30, f"the default ServiceAccount in {name}", interval=0.2)


@pytest.fixture(scope="module")
def release(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    assert cluster.pki is not None
    tag = uuid.uuid4().hex[:6]
    rel = Release(cluster, "kvpool", f"kvpool-system-{tag}", f"apps-{tag}", tmp_path_factory.mktemp("helm"),
                  free_port())
    create_namespace(cluster, rel.namespace)
    create_namespace(cluster, rel.apps)
    rel.kubectl("create", "secret", "tls", "kvpool-webhook-tls", "-n", rel.namespace,
                f"--cert={cluster.pki.webhook.cert}", f"--key={cluster.pki.webhook.key}")
    start = time.monotonic()
    try:
        rel.helm("install", rel.name, str(CHART), "--wait", "--timeout", "180s",
                 "--set", "webhook.mode=url", "--set", f"webhook.url=https://127.0.0.1:{rel.webhook_port}",
                 "--set", f"webhook.port={rel.webhook_port}", "--set", "webhook.certSecret=kvpool-webhook-tls",
                 "--set", f"webhook.caBundle={base64.b64encode(cluster.pki.ca.cert.read_bytes()).decode()}",
                 # Free ports: every pod of the harness shares the host's network.
                 "--set", f"health.port={free_port()}", "--set", f"metrics.port={free_port()}",
                 "--set", "operator.reconcileIntervalSeconds=2", "--set", "operator.tenantIntervalSeconds=3")
        rel.install_seconds = time.monotonic() - start  # type: ignore[attr-defined]
        yield rel
    finally:
        # Pools first, while the operator still runs (their children go with them), then the release.
        cluster.kubectl("delete", "kvpools,tenantnamespaces", "--all", "-n", rel.apps, "--wait=true",
                        "--timeout=90s", check=False, timeout=120)
        if rel.installed:
            rel.helm("uninstall", rel.name, "--wait", "--timeout", "60s", check=False)
        for ns in (rel.apps, rel.namespace):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def loadgen_reports(rel: Release, pod: str) -> list[dict[str, Any]]:
    out = rel.kubectl("logs", "-n", rel.apps, pod, "-c", "engine", check=False).stdout
    return [json.loads(line[len(LOADGEN_PREFIX):]) for line in out.splitlines() if line.startswith(LOADGEN_PREFIX)]


def engine_deployment(name: str, pool: str, args: list[str], replicas: int = 1) -> dict[str, Any]:
    """An engine Deployment opting into ``pool``; its container is the project's load generator."""
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name, "kvpool.io/pool": pool}},
                              "spec": {"terminationGracePeriodSeconds": 5, "containers": [{
                                  "name": "engine", "image": "ghcr.io/kvpool/kvpool:0.1.0",
                                  "command": ["kvpool", "loadgen"], "args": args}]}}}}


def wait_injection_ready(rel: Release, pool: str) -> None:
    """Until a dry-run pod opting into ``pool`` comes back injected (webhook and the operator's
    pool index are both in force)."""
    probe = json.dumps({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": "probe", "labels": {"kvpool.io/pool": pool}},
                        "spec": {"containers": [{"name": "c", "image": "x", "command": ["true"]}]}})

    def injected() -> bool:
        proc = rel.kubectl("create", "--dry-run=server", "-o", "json", "-n", rel.apps, "-f", "-", input=probe,
                           check=False)
        return proc.returncode == 0 and "kvpool.io/injected" in json.loads(proc.stdout)["metadata"].get(
            "annotations", {})

    wait_for(injected, 60, f"the injection webhook to serve pool {pool}", interval=0.5)


def deployment_pods(rel: Release, app: str) -> list[dict[str, Any]]:
    got = rel.get("pods", "-n", rel.apps, "-l", f"app={app}")
    return sorted((got or {}).get("items", []), key=lambda p: p["metadata"]["creationTimestamp"])


def wait_report(rel: Release, pod: str, timeout: float = 120) -> dict[str, Any]:
    return wait_for(lambda: (loadgen_reports(rel, pod) or [None])[-1], timeout, f"the loadgen summary of {pod}",
                    interval=0.5)


# ------------------------------------------------------------------------------------ scenarios


def test_1_helm_install_runs_the_operator(release: Release) -> None:
    rel = release
    pods = rel.get("pods", "-n", rel.namespace, "-l", "app.kubernetes.io/name=kvpool")["items"]
    assert len(pods) == 1
    pod = pods[0]
    assert pod["status"]["phase"] == "Running"
    assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "True"
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["kvpool"] and "operator" in c["args"]
    assert pod["spec"]["serviceAccountName"] == rel.name
    status = json.loads(rel.helm("status", rel.name, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    assert "kubectl get kvpools" in status["info"]["notes"]
    mwc = rel.get("mutatingwebhookconfiguration", f"kvpool-webhook-{rel.namespace}")
    assert mwc["webhooks"][0]["clientConfig"]["url"] == f"https://127.0.0.1:{rel.webhook_port}/kvpool-inject"
    for crd in ("kvpools.kvpool.io", "kvtiers.kvpool.io", "tenantnamespaces.kvpool.io"):
        assert rel.get("crd", crd) is not None
    # The operator acts as its ServiceAccount: it may create StatefulSets, not delete pods.
    sa = f"system:serviceaccount:{rel.namespace}:{rel.name}"
    assert rel.kubectl("auth", "can-i", "create", "statefulsets", "-n", rel.apps, "--as", sa).stdout.strip() == "yes"
    assert rel.kubectl("auth", "can-i", "delete", "pods", "-n", rel.apps, "--as", sa,
                       check=False).stdout.strip() == "no"
    print(f"helm install --wait: {rel.install_seconds:.1f}s")  # type: ignore[attr-defined]


def test_2_minimal_pool_from_the_example(release: Release) -> None:
    rel = release
    rel.kubectl("apply", "-n", rel.apps, "-f", str(ROOT / "examples" / "minimal.yaml"))
    st = rel.wait_pool("minimal", lambda s: cond(s, "Ready") == ("True", "NodesReady"), 120, "the pool Ready")
    assert st["phase"] == "Ready" and st["readyReplicas"] == 1 and st["capacityBytes"] > 0
    store = rel.get("pod", "minimal-store-0", "-n", rel.apps)
    assert store["status"]["phase"] == "Running"
    assert store["spec"]["containers"][0]["command"][0] == "kvpool"
    table = rel.kubectl("get", "kvpools", "-n", rel.apps).stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "REPLICAS", "CAPACITY", "USED", "UTILIZATION", "HITRATE", "PHASE",
                                "AGE"]
    row = table[1].split()
    assert row[0] == "minimal" and row[1] == "1" and row[3].endswith("Gi") and row[7] == "Ready", table


def test_3_engines_get_sidecars_and_share_the_pool(release: Release) -> None:
    rel = release
    wait_injection_ready(rel, "minimal")
    args = ["--prompts", "16", "--prompt-blocks", "4", "--flush", "--hold"]
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=json.dumps(engine_deployment("engine", "minimal", args)))
    first = wait_for(lambda: deployment_pods(rel, "engine"), 30, "the engine pod")[0]
    name = first["metadata"]["name"]
    assert first["metadata"]["annotations"]["kvpool.io/injected"] == f"{rel.apps}.minimal"
    side = first["spec"]["initContainers"][0]
    assert side["name"] == "kvpool-sidecar" and side["restartPolicy"] == "Always"
    env = {e["name"]: e.get("value") for e in first["spec"]["containers"][0]["env"]}
    assert env["KVPOOL_ADDRESS"] == "unix:///run/kvpool/kvpool.sock"
    rep = wait_report(rel, name)
    assert rep["blocks"] == 64 and rep["put_ok"] == 64 and rep["hit_blocks"] == 0 and rep["flushed"], rep
    assert rep["errors"] == {} and rep["mismatches"] == 0

    # A second engine pod (the Deployment scaled) asks for the same prompts: all from the pool.
    rel.kubectl("scale", "deployment/engine", "-n", rel.apps, "--replicas=2")
    second = wait_for(lambda: [p for p in deployment_pods(rel, "engine") if p["metadata"]["name"] != name], 30,
                      "the second engine pod")[0]
    rep2 = wait_report(rel, second["metadata"]["name"])
    assert rep2["hit_blocks"] == 64 and rep2["verified"] == 64 and rep2["put_blocks"] == 0, rep2
    st = rel.wait_pool("minimal", lambda s: s.get("hitRate", 0) > 0, 60, "a hit rate in the pool's status")
    assert st["usedBytes"] >= 64 * 4096
    rel.kubectl("delete", "deployment/engine", "-n", rel.apps)
