"""End to end, as a user runs kvpool (issue 6 §2): `helm install` of charts/kvpool, `kubectl apply`
of the examples, engine Deployments whose pods get the sidecar injected and run `kvpool loadgen`
through it, scale-down refused then forced, and nothing left behind after deletion and uninstall.

Everything runs on the harness cluster (e2e/): the chart's operator Deployment becomes a pod that
the node agent runs as a process (`kvpool operator ...`, the installed console script), and so do
the store pods that operator creates and the engine pods with their sidecars. The harness has no
Service routing, so the chart is installed in its `webhook.mode=url` (clientConfig.url on
127.0.0.1, the harness's webhook certificate in a TLS Secret); everything else is the defaults a
real cluster gets, except faster reconcile intervals. On the real node (a module marked
``realnode`` that imports the fixture and tests, e2e/test_realnode_chart.py) the same ``release``
installs the chart's defaults with the locally built image instead.

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
from typing import Any, cast

import pytest

from e2e.cluster import Cluster, free_port
from e2e.testutil import wait_for

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "kvpool"
API = "kvpool.io/v1alpha1"
LOADGEN_PREFIX = "KVPOOL_LOADGEN "
QUOTA_SLACK = 0.10
"""How far over its quotaBytes the pool may hold a tenant (README "Quotas"; kvpool.store.quota)."""
AUTOSCALE_COOLDOWN_SECONDS = 6
"""The release's autoscaler cooldown (the chart's default, 60 s, would make a test wait minutes)."""
CHART_IMAGE = "ghcr.io/kvpool/kvpool:0.1.0"
"""The chart's default image: the node agent ignores images, so its engines name this one."""


@dataclass
class Release:
    cluster: Cluster
    name: str
    namespace: str  # the operator's
    apps: str  # where the pools and engines of these tests live
    home: Path
    webhook_port: int
    installed: bool = True
    image: str = CHART_IMAGE  # the engines' image: the local build on the real node

    def helm(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.home), "KUBECONFIG": str(self.cluster.kubeconfig),
               "HELM_CACHE_HOME": str(self.home / "cache"), "HELM_CONFIG_HOME": str(self.home / "config"),
               "HELM_DATA_HOME": str(self.home / "data")}
        proc = subprocess.run([str(self.cluster.binaries.helm), *args, "-n", self.namespace], env=env, text=True,
                              capture_output=True, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"helm {' '.join(args)}: {proc.stdout}\n{proc.stderr}"
        return proc

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        proc = self.cluster.kubectl(*args, input=input, check=False, timeout=timeout)
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
        last: dict[str, Any] = {}

        def check() -> dict[str, Any] | None:
            st = self.pool_status(name)
            last.update(st)
            return st if st and pred(st) else None

        try:
            return wait_for(check, timeout, what, interval=0.5)
        except AssertionError as exc:
            # What the operator last said, for a post-mortem of a run that cannot be repeated.
            raise AssertionError(f"{exc}; last status: {json.dumps(last, default=str)}") from None

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


def _install_args(cluster: Cluster, rel: Release) -> list[str]:
    """`helm install` settings for the cluster's tier, besides the fast intervals. The node agent
    has no Service routing and shares the host's network: the webhook by URL on 127.0.0.1 with
    the harness's certificate, free ports. The real node: the chart's defaults (webhook through
    its Service, its own certificate) with the locally built image, never pulled."""
    image = getattr(cluster, "image", None)
    if image is not None:
        repo, tag = str(image).rsplit(":", 1)
        rel.image = str(image)
        return ["--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
                "--set", "image.pullPolicy=Never"]
    assert cluster.pki is not None
    rel.kubectl("create", "secret", "tls", "kvpool-webhook-tls", "-n", rel.namespace,
                f"--cert={cluster.pki.webhook.cert}", f"--key={cluster.pki.webhook.key}")
    return ["--set", "webhook.mode=url", "--set", f"webhook.url=https://127.0.0.1:{rel.webhook_port}",
            "--set", f"webhook.port={rel.webhook_port}", "--set", "webhook.certSecret=kvpool-webhook-tls",
            "--set", f"webhook.caBundle={base64.b64encode(cluster.pki.ca.cert.read_bytes()).decode()}",
            "--set", f"health.port={free_port()}", "--set", f"metrics.port={free_port()}"]


@pytest.fixture(scope="module")
def release(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    """One release of the chart for a module, on the module's tier (e2e/conftest.py)."""
    tag = uuid.uuid4().hex[:6]
    rel = Release(cluster, "kvpool", f"kvpool-system-{tag}", f"apps-{tag}", tmp_path_factory.mktemp("helm"),
                  free_port())
    create_namespace(cluster, rel.namespace)
    create_namespace(cluster, rel.apps)
    start = time.monotonic()
    try:
        rel.helm("install", rel.name, str(CHART), "--wait", "--timeout", "240s", *_install_args(cluster, rel),
                 "--set", "operator.reconcileIntervalSeconds=2", "--set", "operator.tenantIntervalSeconds=3",
                 "--set", f"operator.autoscaleCooldownSeconds={AUTOSCALE_COOLDOWN_SECONDS}", timeout=300)
        rel.install_seconds = time.monotonic() - start  # type: ignore[attr-defined]
        yield rel
    finally:
        # Pools first, while the operator still runs (their children go with them), then the release.
        cluster.kubectl("delete", "tenantnamespaces.kvpool.io", "-l", f"kvpool-e2e/release={tag}", "--wait=true",
                        "--timeout=60s", check=False, timeout=90)
        cluster.kubectl("delete", "kvpools.kvpool.io", "--all", "-n", rel.apps, "--wait=true",
                        "--timeout=90s", check=False, timeout=120)
        if rel.installed:
            rel.helm("uninstall", rel.name, "--wait", "--timeout", "60s", check=False)
        for ns in (rel.apps, rel.namespace):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def loadgen_reports(rel: Release, pod: str) -> list[dict[str, Any]]:
    out = rel.kubectl("logs", "-n", rel.apps, pod, "-c", "engine", check=False).stdout
    return [json.loads(line[len(LOADGEN_PREFIX):]) for line in out.splitlines() if line.startswith(LOADGEN_PREFIX)]


def engine_deployment(name: str, pool: str, args: list[str], replicas: int = 1,
                      image: str = CHART_IMAGE) -> dict[str, Any]:
    """An engine Deployment opting into ``pool``; its container is the project's load generator
    (``image``: the release's, whose ``kvpool`` console script the real node runs)."""
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name, "kvpool.io/pool": pool}},
                              "spec": {"terminationGracePeriodSeconds": 5, "containers": [{
                                  "name": "engine", "image": image,
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
    def last() -> dict[str, Any] | None:
        reports = loadgen_reports(rel, pod)
        return reports[-1] if reports else None
    return wait_for(last, timeout, f"the loadgen summary of {pod}", interval=0.5)


def run_engine(rel: Release, pool: str, app: str, args: list[str], timeout: float = 180) -> dict[str, Any]:
    """Run one loadgen Deployment (``args`` with ``--hold``) to its summary, then delete it (the
    load stops)."""
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=json.dumps(engine_deployment(
        app, pool, args, image=rel.image)))
    pod = wait_for(lambda: deployment_pods(rel, app), 30, f"the {app} pod")[0]["metadata"]["name"]
    rep = wait_report(rel, pod, timeout)
    rel.kubectl("delete", f"deployment/{app}", "-n", rel.apps)
    return rep


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
    # The chart lints clean with the harness's helm too (tests/kvpool_chart skips while helm is
    # not built yet, as on a fresh machine before the first cluster session).
    lint = rel.helm("lint", "--strict", str(CHART), "--kube-version", "1.37.2")
    assert "0 chart(s) failed" in lint.stdout and "[WARNING]" not in lint.stdout, lint.stdout
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
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=json.dumps(engine_deployment(
        "engine", "minimal", args, image=rel.image)))
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


def kvtier(name: str, size: str) -> str:
    return json.dumps({"apiVersion": API, "kind": "KVTier", "metadata": {"name": name},
                       "spec": {"medium": "dram", "capacity": {"bytes": size}}})


def kvpool_doc(name: str, **spec: Any) -> str:
    return json.dumps({"apiVersion": API, "kind": "KVPool", "metadata": {"name": name}, "spec": spec})


def pool_events(rel: Release, pool: str) -> dict[str, str]:
    got = rel.get("events", "-n", rel.apps, "--field-selector",
                  f"involvedObject.kind=KVPool,involvedObject.name={pool}")
    return {e["reason"]: e["message"] for e in (got or {}).get("items", [])}


def sts_replicas(rel: Release, name: str) -> int | None:
    got = rel.get("statefulset", name, "-n", rel.apps)
    return None if got is None else int(got["spec"]["replicas"])


def test_5_too_full_scale_down_refused_until_forced(release: Release) -> None:
    rel = release
    tier = f"small-{rel.apps}"
    rel.kubectl("apply", "-f", "-", input=kvtier(tier, "16Mi"))
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=kvpool_doc(
        "full", storage={"replicas": 2, "tiers": [tier]}, scaleDown={"gracePeriodSeconds": 10},
        sidecar={"localBytes": "32Mi"}, tenancy={"defaultTenant": "public"}))
    rel.wait_pool("full", lambda s: s.get("readyReplicas") == 2, 120, "two ready store nodes")
    wait_injection_ready(rel, "full")
    # 56 blocks of 256Ki = 14Mi over two 16Mi nodes; on the one node left that would be 87 % > 80 %.
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=json.dumps(engine_deployment(
        "filler", "full", ["--prompts", "56", "--prompt-blocks", "1", "--value-bytes", str(256 << 10), "--flush",
                           "--hold"], image=rel.image)))
    pod = wait_for(lambda: deployment_pods(rel, "filler"), 30, "the filler pod")[0]["metadata"]["name"]
    rep = wait_report(rel, pod)
    assert rep["put_ok"] == 56 and rep["flushed"], rep
    rel.wait_pool("full", lambda s: s.get("usedBytes", 0) >= 14 << 20, 60, "14Mi used in status")

    rel.kubectl("patch", "kvpools.kvpool.io", "full", "-n", rel.apps, "--type=merge",
                "-p", '{"spec":{"storage":{"replicas":1}}}')
    st = rel.wait_pool("full", lambda s: cond(s, "ScaleDownBlocked") == ("True", "UtilizationTooHigh"), 60,
                       "ScaleDownBlocked")
    assert "kvpool.io/force-scale-down" in st["message"]
    time.sleep(3)
    assert sts_replicas(rel, "full-store") == 2
    assert "UtilizationTooHigh" in pool_events(rel, "full")

    rel.kubectl("annotate", "kvpools.kvpool.io", "full", "-n", rel.apps, "kvpool.io/force-scale-down=true")
    wait_for(lambda: sts_replicas(rel, "full-store") == 1, 120, "the StatefulSet lowered after the drain",
             interval=0.5)
    st = rel.wait_pool("full", lambda s: bool(s.get("lastDrain")) and cond(s, "ScaleDownBlocked") != (
        "True", "UtilizationTooHigh"), 60, "the drain recorded, no longer blocked")
    assert st["lastDrain"]["leaving"] == ["full-store-1"]
    assert [m["id"] for m in st["ring"]["members"]] == ["full-store-0"]
    rel.kubectl("delete", "deployment/filler", "-n", rel.apps)


def test_4_scale_down_under_load_keeps_what_was_moved(release: Release) -> None:
    rel = release
    tier = f"mid-{rel.apps}"
    rel.kubectl("apply", "-f", "-", input=kvtier(tier, "64Mi"))
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=kvpool_doc(
        "drained", storage={"replicas": 3, "tiers": [tier]}, scaleDown={"gracePeriodSeconds": 30},
        sidecar={"localBytes": "2Mi"}, tenancy={"defaultTenant": "public"}))
    rel.wait_pool("drained", lambda s: s.get("readyReplicas") == 3, 120, "three ready store nodes")
    wait_injection_ready(rel, "drained")
    # 256 blocks of 16Ki (4Mi) written once; a reader then keeps cycling through them with a
    # local tier of 2Mi, so that its gets keep going to the pool while it scales down.
    blocks = ["--prompts", "64", "--prompt-blocks", "4", "--value-bytes", str(16 << 10)]
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=json.dumps(engine_deployment(
        "writer", "drained", [*blocks, "--flush", "--hold"], image=rel.image)))
    writer = wait_for(lambda: deployment_pods(rel, "writer"), 30, "the writer pod")[0]["metadata"]["name"]
    rep = wait_report(rel, writer)
    assert rep["put_ok"] == 256 and rep["flushed"], rep
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=json.dumps(engine_deployment(
        "reader", "drained", [*blocks, "--read-only", "--duration", "600", "--interval", "0.02"], image=rel.image)))
    wait_for(lambda: [p for p in deployment_pods(rel, "reader") if p["status"].get("phase") == "Running"], 60,
             "the reader running")
    rel.wait_pool("drained", lambda s: s.get("hitRate", 0) > 0, 60, "hits in the pool's status")

    rel.kubectl("patch", "kvpools.kvpool.io", "drained", "-n", rel.apps, "--type=merge",
                "-p", '{"spec":{"storage":{"replicas":2}}}')
    st = rel.wait_pool("drained", lambda s: cond(s, "Draining") == ("True", "ScaleDown") or bool(s.get("lastDrain")),
                       60, "the Draining condition")
    seen_draining = cond(st, "Draining") == ("True", "ScaleDown")
    if seen_draining:
        assert st["drain"]["leaving"] == ["drained-store-2"] and st["phase"] == "Draining"
    st = rel.wait_pool("drained", lambda s: bool(s.get("lastDrain")) and not s.get("drain"), 120,
                       "the drain finished")
    wait_for(lambda: sts_replicas(rel, "drained-store") == 2, 60, "the StatefulSet lowered", interval=0.5)
    last = st["lastDrain"]
    assert last["result"] == "Completed" and last["leaving"] == ["drained-store-2"], last
    assert last["movedObjects"] > 0 and last["movedBytes"] >= last["movedObjects"] * (16 << 10), last
    assert sorted(m["id"] for m in st["ring"]["members"]) == ["drained-store-0", "drained-store-1"]
    events = pool_events(rel, "drained")
    assert "DrainStarted" in events and "DrainCompleted" in events, events
    assert f"moved {last['movedObjects']} objects" in events["DrainCompleted"]

    # A fresh engine reads every block back from the two nodes left (none was dropped).
    rel.kubectl("delete", "deployment/reader", "deployment/writer", "-n", rel.apps)
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=json.dumps(engine_deployment(
        "checker", "drained", [*blocks, "--read-only", "--hold"], image=rel.image)))
    checker = wait_for(lambda: deployment_pods(rel, "checker"), 30, "the checker pod")[0]["metadata"]["name"]
    rep = wait_report(rel, checker)
    assert last["droppedObjects"] == 0, last
    assert rep["hit_blocks"] == 256 and rep["verified"] == 256 and rep["mismatches"] == 0, rep
    numbers = {k: last[k] for k in ("movedObjects", "movedBytes", "droppedObjects", "droppedBytes",
                                    "durationSeconds")}
    numbers["drainingConditionSeen"] = seen_draining
    out = Path(os.environ.get("KVPOOL_E2E_ARTIFACTS", "/tmp")) / "kvpool-e2e-scale-down.json"
    out.write_text(json.dumps(numbers, indent=2) + "\n")
    print(f"scale-down 3 -> 2 under load: {numbers}")
    rel.kubectl("delete", "deployment/checker", "-n", rel.apps)


def tenant_status(rel: Release, name: str) -> dict[str, Any]:
    return dict((rel.get("tenantnamespaces.kvpool.io", name) or {}).get("status") or {})


def test_6_two_tenants_same_prompts_no_cross_hits_quota_refused(release: Release) -> None:
    rel = release
    tag = rel.apps.split("-", 1)[1]
    teams = {"a": (f"team-a-{tag}", "8Mi"), "b": (f"team-b-{tag}", "1Mi")}
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=kvpool_doc(
        "shared", storage={"replicas": 2}, sidecar={"localBytes": "16Mi"}))  # no default tenant: closed
    for ns, quota in teams.values():
        create_namespace(rel.cluster, ns)
        rel.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": API, "kind": "TenantNamespace",
            "metadata": {"name": ns, "labels": {"kvpool-e2e/release": tag}},
            "spec": {"tenantId": ns, "namespaces": [ns],
                     "pools": [{"pool": f"{rel.apps}.shared", "quotaBytes": quota}]}}))
    try:
        rel.wait_pool("shared", lambda s: s.get("readyReplicas") == 2, 120, "two ready store nodes")
        for ns, _ in teams.values():
            wait_for(lambda: cond(tenant_status(rel, ns), "Ready") == ("True", "SecretsReady"), 60,  # noqa: B023
                     f"tenant {ns} Ready", interval=0.5)
        # The same prompts in both namespaces: 256 blocks of 16Ki = 4Mi, within a's quota, not b's.
        args = ["--prompts", "64", "--prompt-blocks", "4", "--value-bytes", str(16 << 10), "--flush", "--hold"]
        reports = {}
        for team, (ns, _) in teams.items():
            rel.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(engine_deployment(
                "engine", f"{rel.apps}.shared", args, image=rel.image)))
            pods = wait_for(lambda: rel.get("pods", "-n", ns, "-l", "app=engine")["items"], 30,  # noqa: B023
                            f"the engine of {ns}")
            pod = pods[0]
            assert pod["metadata"]["annotations"]["kvpool.io/injected"] == f"{rel.apps}.shared"
            side = pod["spec"]["initContainers"][0]
            assert side["args"][side["args"].index("--tenant") + 1] == ns
            reports[team] = wait_for(lambda: _report_in(rel, ns, pod["metadata"]["name"]), 120,  # noqa: B023
                                     f"the loadgen summary in {ns}", interval=0.5)
            assert reports[team]["tenant"] == ns
        # b ran after a had stored the same prompts, and found none of them.
        assert reports["a"]["put_ok"] == 256 and reports["a"]["hit_blocks"] == 0, reports["a"]
        assert reports["b"]["hit_blocks"] == 0 and reports["b"]["verified"] == 0, reports["b"]

        def row(ns: str) -> dict[str, Any]:
            return next(iter(tenant_status(rel, ns).get("pools") or []), {})

        # Refused, not silently dropped, and the quota is the pool's: each of the 2 store nodes
        # admits its share (512Ki), so b holds its 1Mi (usage and quota in one unit, logical
        # bytes) and never more than the stated slack over it (README "Quotas"), of the 4Mi written.
        b_quota = 1 << 20
        b = wait_for(lambda: row(teams["b"][0]) if row(teams["b"][0]).get("refusals")
                     and row(teams["b"][0]).get("usedBytes", 0) >= 0.75 * b_quota else None, 60,
                     "refusals and b's usage in its status", interval=0.5)
        assert b["quotaBytes"] == b_quota and b["usedBytes"] <= b_quota * (1 + QUOTA_SLACK), b
        assert b["physicalBytes"] == b["usedBytes"], b  # R=1: one copy of each object
        a = wait_for(lambda: row(teams["a"][0]) if row(teams["a"][0]).get("usedBytes", 0) >= 4 << 20 else None, 60,
                     "tenant a's usage in its status", interval=0.5)
        assert not a.get("refusals"), a
    finally:
        for ns, _ in teams.values():
            rel.kubectl("delete", "deployment/engine", "-n", ns, "--ignore-not-found", check=False)
        rel.kubectl("delete", "tenantnamespaces.kvpool.io", "-l", f"kvpool-e2e/release={tag}", "--timeout=60s",
                    check=False, timeout=90)
        for ns, _ in teams.values():
            rel.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        rel.kubectl("delete", "kvpools.kvpool.io", "shared", "-n", rel.apps, "--timeout=60s", check=False, timeout=90)


def _report_in(rel: Release, ns: str, pod: str) -> dict[str, Any] | None:
    out = rel.kubectl("logs", "-n", ns, pod, "-c", "engine", check=False).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith(LOADGEN_PREFIX)]
    return json.loads(lines[-1][len(LOADGEN_PREFIX):]) if lines else None


def operator_pod(rel: Release) -> dict[str, Any] | None:
    pods = rel.get("pods", "-n", rel.namespace, "-l", "app.kubernetes.io/name=kvpool")["items"]
    ready = [p for p in pods if not p["metadata"].get("deletionTimestamp")
             and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]
    return ready[0] if ready else None


def test_8_deleted_engine_pod_drains_its_local_state_to_the_pool(release: Release) -> None:
    rel = release
    wait_injection_ready(rel, "minimal")
    # State objects stay in the sidecar's local tier (host memory) until eviction or drain.
    args = ["--prompts", "16", "--prompt-blocks", "2", "--states", "--hold"]
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=json.dumps(engine_deployment(
        "stateful", "minimal", args, image=rel.image)))
    pod = wait_for(lambda: deployment_pods(rel, "stateful"), 30, "the stateful engine pod")[0]
    name = pod["metadata"]["name"]
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    rep = wait_report(rel, name)
    assert rep["state_puts"] == 16 and rep["state_hits"] == 0, rep

    def reader(app: str) -> dict[str, Any]:
        rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=json.dumps(engine_deployment(
            app, "minimal", ["--prompts", "16", "--prompt-blocks", "2", "--states", "--read-only", "--hold"],
            image=rel.image)))
        p = wait_for(lambda: deployment_pods(rel, app), 30, f"the {app} pod")[0]["metadata"]["name"]
        got = wait_report(rel, p)
        rel.kubectl("delete", f"deployment/{app}", "-n", rel.apps)
        return got

    before = reader("before")
    assert before["state_hits"] == 0, before  # only the stateful pod's sidecar has them

    start = time.monotonic()
    rel.kubectl("delete", "deployment/stateful", "-n", rel.apps)
    wait_for(lambda: rel.get("pod", name, "-n", rel.apps) is None, grace + 30, "the engine pod gone", interval=0.5)
    took = time.monotonic() - start
    after = reader("after")
    assert after["state_hits"] == 16 and after["mismatches"] == 0, after
    assert took < grace + 10, f"the pod took {took:.1f}s to go, grace {grace}s"


def test_7_operator_pod_killed_mid_drain_the_new_one_resumes(release: Release) -> None:
    rel = release
    tier = f"mid-{rel.apps}"
    rel.kubectl("apply", "-f", "-", input=kvtier(tier, "64Mi"))
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=kvpool_doc(
        # 4 MiB/s: the ~8 MiB on the leaving node take 2 s to push, a window the kill cannot miss
        # (unbounded, the push finished between two polls of the status now and then).
        "resume", storage={"replicas": 2, "tiers": [tier]}, scaleDown={"gracePeriodSeconds": 30,
                                                                       "drainBandwidth": "4Mi"},
        sidecar={"localBytes": "8Mi"}, tenancy={"defaultTenant": "public"}))
    rel.wait_pool("resume", lambda s: s.get("readyReplicas") == 2, 120, "two ready store nodes")
    wait_injection_ready(rel, "resume")
    blocks = ["--prompts", "128", "--prompt-blocks", "4", "--value-bytes", str(32 << 10)]
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=json.dumps(engine_deployment(
        "writer", "resume", [*blocks, "--flush", "--hold"], image=rel.image)))
    writer = wait_for(lambda: deployment_pods(rel, "writer"), 30, "the writer pod")[0]["metadata"]["name"]
    assert wait_report(rel, writer)["put_ok"] == 512
    rel.kubectl("delete", "deployment/writer", "-n", rel.apps)
    old = operator_pod(rel)
    assert old is not None

    rel.kubectl("patch", "kvpools.kvpool.io", "resume", "-n", rel.apps, "--type=merge",
                "-p", '{"spec":{"storage":{"replicas":1}}}')
    # As a crash would, the moment the drain is in status (the API directly: kubectl's start-up
    # would eat into the window before the operator's next tick finishes a short drain): the pod
    # object goes at once and the node agent kills its process.
    from kubernetes import client

    with rel.cluster.api_client() as api:
        custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        try:
            wait_for(lambda: (cast(dict[str, Any], custom.get_namespaced_custom_object(
                         "kvpool.io", "v1alpha1", rel.apps, "kvpools", "resume")).get("status") or {}).get("drain"),
                     60, "the drain recorded in status", interval=0.05)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; status: {json.dumps(rel.pool_status('resume'))}") from None
        core.delete_namespaced_pod(old["metadata"]["name"], rel.namespace, grace_period_seconds=0)
    st = rel.pool_status("resume")
    assert st.get("drain") and st["drain"]["leaving"] == ["resume-store-1"], st
    assert cond(st, "Draining") == ("True", "ScaleDown")
    assert sts_replicas(rel, "resume-store") == 2

    new = wait_for(lambda: (p := operator_pod(rel)) and p["metadata"]["uid"] != old["metadata"]["uid"] and p, 120,
                   "a new operator pod ready", interval=0.5)
    st = rel.wait_pool("resume", lambda s: bool(s.get("lastDrain")) and not s.get("drain"), 120,
                       "the drain finished by the new operator")
    last = st["lastDrain"]
    assert last["leaving"] == ["resume-store-1"] and last["result"] == "Completed", last
    assert last["movedObjects"] > 0 and last["droppedObjects"] == 0, last
    wait_for(lambda: sts_replicas(rel, "resume-store") == 1, 60, "the StatefulSet lowered", interval=0.5)
    assert [m["id"] for m in st["ring"]["members"]] == ["resume-store-0"]
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=json.dumps(engine_deployment(
        "checker", "resume", [*blocks, "--read-only", "--hold"], image=rel.image)))
    checker = wait_for(lambda: deployment_pods(rel, "checker"), 30, "the checker pod")[0]["metadata"]["name"]
    rep = wait_report(rel, checker)
    assert rep["hit_blocks"] == 512 and rep["mismatches"] == 0, rep
    rel.kubectl("delete", "deployment/checker", "-n", rel.apps)
    print(f"operator {old['metadata']['name']} killed mid-drain, {new['metadata']['name']} finished it: {last}")


def test_9_deleting_the_pool_and_uninstalling_leave_only_the_crds(release: Release) -> None:
    rel = release
    children = [("statefulset", "minimal-store"), ("service", "minimal-store"), ("configmap", "minimal-store-config"),
                ("poddisruptionbudget", "minimal-store"), ("serviceaccount", "minimal-store"),
                ("secret", "minimal-store-admin")]
    for kind, name in children:
        assert rel.get(kind, name, "-n", rel.apps) is not None, (kind, name)
    rel.kubectl("delete", "kvpools.kvpool.io", "minimal", "-n", rel.apps, "--timeout=60s")

    def all_gone() -> bool:
        left = [(k, n) for k, n in children if rel.get(k, n, "-n", rel.apps) is not None]
        pods = rel.get("pods", "-n", rel.apps, "-l", "kvpool.io/store-of=minimal")["items"]
        return not left and not pods

    wait_for(all_gone, 90, "the pool's children and store pods gone", interval=0.5)

    # Uninstall (pools and tiers first: their finalizers need the operator).
    rel.kubectl("delete", "kvpools.kvpool.io", "--all", "-n", rel.apps, "--timeout=90s", timeout=120)
    rel.kubectl("delete", "kvtiers.kvpool.io", f"small-{rel.apps}", f"mid-{rel.apps}", "--ignore-not-found",
                "--timeout=60s")
    rel.helm("uninstall", rel.name, "--wait", "--timeout", "90s")
    rel.installed = False
    full = rel.name
    for kind, name in [("clusterrole", full), ("clusterrolebinding", full),
                       ("mutatingwebhookconfiguration", f"kvpool-webhook-{rel.namespace}")]:
        assert rel.get(kind, name) is None, (kind, name)
    wait_for(lambda: not rel.get("pods", "-n", rel.namespace)["items"], 60, "the operator pod gone", interval=0.5)
    for kind in ("deployments", "services", "serviceaccounts", "roles", "rolebindings", "configmaps"):
        items = [i["metadata"]["name"] for i in rel.get(kind, "-n", rel.namespace)["items"]]
        # What the API server itself keeps in every namespace.
        items = [n for n in items if n not in ("default", "kube-root-ca.crt")]
        assert not items, (kind, items)
    secrets = [i["metadata"]["name"] for i in rel.get("secrets", "-n", rel.namespace)["items"]]
    assert secrets == ["kvpool-webhook-tls"]  # the test's own, not the chart's
    assert not rel.helm("list", "-q").stdout.strip()
    for crd in ("kvpools.kvpool.io", "kvtiers.kvpool.io", "tenantnamespaces.kvpool.io"):
        assert rel.get("crd", crd) is not None, f"{crd} removed (Helm keeps CRDs)"
