"""The operator against the real control plane: a KVPool becomes store pods whose readiness moves
its conditions and ring; pods created through the API server come back injected (or say why
not); TenantNamespaces get their Secrets; a too-full scale-down is refused until forced.

The operator runs as a process (``kvpool operator``) with its webhook on 127.0.0.1 and the
harness's webhook certificate; the store pods it creates run as processes on the node agent.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import procs
from e2e.cluster import Cluster, free_port
from e2e.nodeagent import POD_MARKER_ENV
from e2e.test_operator_crds import install_crds
from e2e.testutil import wait_for
from kvpool.wire.counters import StoreCounter
from kvpool_operator.kube import Kube

pytestmark = pytest.mark.cluster

API = "kvpool.io/v1alpha1"


class Operator:
    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        assert cluster.pki is not None
        self.port = free_port()
        self.metrics_port = free_port()
        """Its /metrics on 127.0.0.1 (the certificate-expiry gauge: e2e/test_monitoring_scrape.py)."""
        self.log = workdir / "operator.log"
        self.env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig))
        self._out = self.log.open("ab")
        self.argv = [
            sys.executable, "-m", "kvpool", "--log-level", "INFO", "operator", "--standalone",
            "--metrics-port", str(self.metrics_port), "--metrics-addr", "127.0.0.1", "--liveness", "",
            "--reconcile-interval", "2", "--tenant-interval", "3",
            "--webhook-port", str(self.port), "--webhook-addr", "127.0.0.1", "--webhook-host", "127.0.0.1",
            "--webhook-cert", str(cluster.pki.webhook.cert), "--webhook-key", str(cluster.pki.webhook.key)]
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self._out, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        """As a crash would: no chance to finish anything."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.stop()
        self._out.close()

    def tail(self, n: int = 80) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture(scope="module")
def kube(api: Any) -> Kube:
    return Kube(api)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    install_crds(cluster)
    op = Operator(cluster, tmp_path_factory.mktemp("operator"))
    assert cluster.pki is not None
    name = f"kvpool-e2e-{op.port}"
    kube.request("POST", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations", body={
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [{
            "name": "inject.kvpool.io",
            "clientConfig": {"url": f"https://127.0.0.1:{op.port}/kvpool-inject",
                             "caBundle": base64.b64encode(cluster.pki.ca.cert.read_bytes()).decode()},
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}],
            "objectSelector": {"matchExpressions": [{"key": "kvpool.io/pool", "operator": "Exists"}]},
            "namespaceSelector": {"matchExpressions": [{"key": "kvpool-e2e/test", "operator": "Exists"}]},
            "sideEffects": "None", "admissionReviewVersions": ["v1"], "failurePolicy": "Ignore",
            "timeoutSeconds": 5,
        }]})
    try:
        yield op
    finally:
        kube.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{name}")
        op.close()
        # Kept beside the other harness output for a post-mortem (the tmp dir may be gone).
        shutil.copyfile(op.log, Path(os.environ.get("KVPOOL_E2E_ARTIFACTS", "/tmp")) / "kvpool-e2e-operator.log")


@pytest.fixture
def trust(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Callable[[str], None]]:
    """``trust(pool)``: this process becomes a TLS client of the pool (the operator runs with TLS,
    its default), with the operator's certificate of it; StoreClients made without a
    configuration use it until the test ends."""
    from e2e.testutil import pool_client_tls
    from kvpool.wire import tls

    def use(pool: str) -> None:
        tls.install(pool_client_tls(kube, namespace, pool, str(tmp_path / "tls" / pool)))
    try:
        yield use
    finally:
        tls.install(None)


def kvpool(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "KVPool", "metadata": {"name": name}, "spec": spec}


def create(kube: Kube, doc: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
    if namespace:
        doc = {**doc, "metadata": {**doc["metadata"], "namespace": namespace}}
    got = kube.create(doc)
    assert got is not None, f"{doc['kind']} {doc['metadata']['name']} exists already"
    return got


def pool_status(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    return dict((kube.get(API, "KVPool", name, ns) or {}).get("status") or {})


def wait_status(kube: Kube, ns: str, name: str, pred: Callable[[dict[str, Any]], bool], timeout: float,
                what: str) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def check() -> dict[str, Any] | None:
        st = pool_status(kube, ns, name)
        last.update(st)
        return st if st and pred(st) else None

    try:
        return wait_for(check, timeout, what)
    except AssertionError as exc:
        # What the operator last said, for a post-mortem of a run that cannot be repeated.
        seen = {k: last.get(k) for k in ("phase", "message", "conditions", "ring", "rebalance", "lastRebalance",
                                         "drain", "usedBytes", "readyReplicas")}
        raise AssertionError(f"{exc}; last status: {json.dumps(seen, default=str)}") from None


def wait_events(kube: Kube, ns: str, reasons: set[str], name: str | None = None, kind: str = "KVPool",
                timeout: float = 15) -> set[str]:
    """Wait until Events with all of ``reasons`` exist for the object; returns the reasons seen.

    The operator posts a reconcile's Events after patching its status, so a status that shows
    the change can be read before its Events are listed."""
    def seen() -> set[str]:
        return {e["reason"] for e in kube.list("v1", "Event", ns)
                if e["involvedObject"]["kind"] == kind and (name is None or e["involvedObject"]["name"] == name)}
    try:
        return wait_for(lambda: got if (got := seen()) >= reasons else None, timeout, f"events {sorted(reasons)}")
    except AssertionError:
        raise AssertionError(f"events {sorted(reasons)} not all posted; seen {sorted(seen())}") from None


def cond(status: dict[str, Any], ctype: str) -> tuple[str, str] | None:
    for c in status.get("conditions") or []:
        if c["type"] == ctype:
            return c["status"], c.get("reason", "")
    return None


def engine_pod(name: str, label: str, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"kvpool.io/pool": label},
                                                             **meta},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "engine", "image": "unused", "command": ["sleep", "600"]}]}}


def create_pod_injected(kube: Kube, ns: str, pod: dict[str, Any]) -> dict[str, Any]:
    """Create a pod once the webhook is in force (dry runs tell: the configuration and the
    operator's pool index both take a moment)."""
    def decided() -> dict[str, Any] | None:
        got = kube.request("POST", f"/api/v1/namespaces/{ns}/pods", body=pod, query={"dryRun": "All"})
        ann = (got.get("metadata") or {}).get("annotations") or {}
        return got if ("kvpool.io/injected" in ann or "kvpool.io/skip-reason" in ann) else None

    wait_for(decided, 60, "the injection webhook to answer", interval=0.5)
    created: dict[str, Any] = kube.request("POST", f"/api/v1/namespaces/{ns}/pods", body=pod)
    return created


# ------------------------------------------------------------------------------------ tests


def test_pool_children_and_conditions(operator: Operator, kube: Kube, namespace: str) -> None:
    create(kube, kvpool("p", storage={"replicas": 2}, tenancy={"defaultTenant": "public"}), namespace)
    sts = wait_for(lambda: kube.get("apps/v1", "StatefulSet", "p-store", namespace), 60, "the StatefulSet")
    assert sts["spec"]["replicas"] == 2
    for api_version, kind, name in [("v1", "Service", "p-store"), ("v1", "ConfigMap", "p-store-config"),
                                    ("policy/v1", "PodDisruptionBudget", "p-store"),
                                    ("v1", "ServiceAccount", "p-store"), ("v1", "Secret", "p-store-admin"),
                                    ("apps/v1", "StatefulSet", "p-store")]:
        obj = kube.get(api_version, kind, name, namespace)
        assert obj is not None, f"{kind} {name}"
        ref = obj["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref.get("controller")) == ("KVPool", "p", True)
    cfg = json.loads(kube.get("v1", "ConfigMap", "p-store-config", namespace)["data"]["node.json"])  # type: ignore[index]
    assert cfg["closed"] is False and cfg["dramBytes"] == 1 << 30

    st = wait_status(kube, namespace, "p", lambda s: cond(s, "Ready") == ("True", "NodesReady"), 120, "the pool Ready")
    assert st["phase"] == "Ready" and st["readyReplicas"] == 2 and st["desiredReplicas"] == 2
    members = st["ring"]["members"]
    assert sorted(m["id"] for m in members) == ["p-store-0", "p-store-1"]
    pods = {p["metadata"]["name"]: p for p in kube.list("v1", "Pod", namespace, "kvpool.io/store-of=p")}
    for m in members:  # the ring names the pods' own IPs
        assert m["address"] == f"{pods[m['id']]['status']['podIP']}:7400" and m["state"] == "active"
    assert st["capacityBytes"] > 0 and st["capacity"].endswith("Gi")
    wait_events(kube, namespace, {"NodesReady", "RingUpdated"})

    # Drift repair: a deleted child comes back.
    kube.delete("v1", "ConfigMap", "p-store-config", namespace)
    wait_for(lambda: kube.get("v1", "ConfigMap", "p-store-config", namespace), 30, "the ConfigMap to be repaired")

    # A store pod going away moves the ring to a new epoch.
    epoch = st["ring"]["epoch"]
    kube.delete("v1", "Pod", "p-store-1", namespace)
    wait_for(lambda: pool_status(kube, namespace, "p")["ring"]["epoch"] > epoch, 60, "a new ring epoch")


def test_injection_and_skip_reasons(operator: Operator, kube: Kube, namespace: str) -> None:
    create(kube, kvpool("open", sidecar={"localBytes": "32Mi", "drainSeconds": 40},
                        tenancy={"defaultTenant": "public"}), namespace)
    create(kube, kvpool("closed", storage={"replicas": 0}), namespace)
    wait_for(lambda: pool_status(kube, namespace, "open").get("ring"), 60, "the pool's first status")
    pod = create_pod_injected(kube, namespace, engine_pod("engine", "open"))
    assert pod["metadata"]["annotations"]["kvpool.io/injected"] == f"{namespace}.open"
    side = pod["spec"]["initContainers"][0]
    assert side["name"] == "kvpool-sidecar" and side["restartPolicy"] == "Always"
    assert side["command"] == ["kvpool", "sidecar"] and "--pool" in side["args"]
    assert side["args"][side["args"].index("--local") + 1] == str(32 << 20)
    assert side["startupProbe"]["exec"]["command"][:2] == ["test", "-S"]
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["kvpool-shm"]["emptyDir"]["medium"] == "Memory"
    app = pod["spec"]["containers"][0]
    assert {"name": "KVPOOL_ADDRESS", "value": "unix:///run/kvpool/kvpool.sock"} in app["env"]
    assert any(m["mountPath"] == "/run/kvpool" for m in app["volumeMounts"])
    assert pod["spec"]["terminationGracePeriodSeconds"] == 45  # drain 40 + margin, above the user's 1

    skipped = create_pod_injected(kube, namespace, engine_pod("nopool", "nonexistent"))
    assert skipped["metadata"]["annotations"]["kvpool.io/skip-reason"].startswith("NoSuchPool: ")
    assert not skipped["spec"].get("initContainers")
    closed = create_pod_injected(kube, namespace, engine_pod("notenant", "closed"))
    assert closed["metadata"]["annotations"]["kvpool.io/skip-reason"].startswith("NoTenant: ")
    user = engine_pod("mine", "open", annotations={"kvpool.io/injected": "by-hand"})
    same = create_pod_injected(kube, namespace, user)
    assert same["metadata"]["annotations"]["kvpool.io/skip-reason"].startswith("AlreadyInjected: ")


def test_tenant_namespace_secrets(operator: Operator, kube: Kube, namespace: str) -> None:
    other = f"{namespace}-b"
    kube.create({"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": other, "labels": {"kvpool-e2e/test": other}}})
    try:
        create(kube, kvpool("shared", storage={"replicas": 1}), namespace)
        tn_name = f"tn-{namespace}"
        create(kube, {"apiVersion": API, "kind": "TenantNamespace", "metadata": {"name": tn_name},
                      "spec": {"tenantId": tn_name, "namespaces": [namespace, other],
                               "pools": [{"pool": f"{namespace}.shared", "quotaBytes": "64Mi"}]}})
        secret = f"kvpool-tenant-{tn_name}"
        def secret_in(ns: str) -> Callable[[], dict[str, Any] | None]:
            return lambda: kube.get("v1", "Secret", secret, ns)

        got = [wait_for(secret_in(ns), 60, f"the Secret in {ns}") for ns in (namespace, other)]
        docs = [json.loads(base64.b64decode(s["data"]["credentials.json"])) for s in got]
        assert docs[0] == docs[1] and docs[0]["tenantId"] == tn_name and len(docs[0]["token"]) >= 32
        st = wait_for(lambda: ((kube.get(API, "TenantNamespace", tn_name) or {}).get("status") or {}).get(
            "conditions") and kube.get(API, "TenantNamespace", tn_name)["status"], 30, "the tenant status")  # type: ignore[index]
        assert cond(st, "Ready") == ("True", "SecretsReady") and sorted(st["secrets"]) == sorted([namespace, other])
        assert st["pools"][0]["pool"] == f"{namespace}.shared" and st["pools"][0]["quotaBytes"] == 64 << 20

        # A pod of the tenant's namespace gets its credentials mounted into the sidecar only.
        wait_for(lambda: pool_status(kube, namespace, "shared").get("ring"), 60, "the pool's first status")
        pod = create_pod_injected(kube, other, engine_pod("engine", f"{namespace}.shared"))
        side = pod["spec"]["initContainers"][0]
        assert side["args"][side["args"].index("--tenant") + 1] == tn_name
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert vols["kvpool-tenant"]["secret"]["secretName"] == secret

        # Deleting the TenantNamespace removes its Secrets (they are owned by it).
        kube.delete(API, "TenantNamespace", tn_name)
        for ns in (namespace, other):
            present = secret_in(ns)
            wait_for(lambda: present() is None, 120, f"the Secret in {ns} gone")  # noqa: B023 (used at once)
    finally:
        kube.delete("v1", "Namespace", other)


def test_scale_down_refused_then_forced(operator: Operator, kube: Kube, namespace: str,
                                        trust: Callable[[str], None]) -> None:
    from kvpool.core.ring import owners
    from kvpool.pool.node_client import StoreClient

    kube.apply({"apiVersion": API, "kind": "KVTier", "metadata": {"name": f"small-{namespace}"},
                "spec": {"medium": "dram", "capacity": {"bytes": "16Mi"}}})
    create(kube, kvpool("s", storage={"replicas": 2, "tiers": [f"small-{namespace}"]},
                        scaleDown={"gracePeriodSeconds": 10}, tenancy={"defaultTenant": "public"}), namespace)
    st = wait_status(kube, namespace, "s", lambda s: s.get("readyReplicas") == 2, 120, "two ready store nodes")
    trust("s")
    # Fill each node to ~7Mi: 14Mi on the 16Mi that one node would have left is 87 % > 80 %.  Each
    # node gets keys it owns under the ring, as a sidecar writes them: a copy put straight to a
    # non-owner is foreign there, and the check counts owned bytes (a warm-up's copies are
    # duplicates), so random keys made the outcome hang on when each node had counted its foreign
    # bytes (a CI run saw the scale-down go ahead).
    ids = [m["id"] for m in st["ring"]["members"]]
    mine: dict[str, list[bytes]] = {i: [] for i in ids}
    while any(len(k) < 28 for k in mine.values()):
        key = os.urandom(32)
        owner = ids[int(owners(key, ids)[0, 0])]
        if len(mine[owner]) < 28:
            mine[owner].append(key)
    block = os.urandom(256 << 10)
    for m in st["ring"]["members"]:
        with StoreClient(m["address"]) as c:
            codes = c.put(mine[m["id"]], [block] * 28)
            assert all(code == 0 for code in codes), codes
    wait_for(lambda: pool_status(kube, namespace, "s").get("usedBytes", 0) >= 14 << 20, 30, "usage in status")
    kube.merge_patch(API, "KVPool", "s", namespace, {"spec": {"storage": {"replicas": 1}}})
    st = wait_status(kube, namespace, "s", lambda s: cond(s, "ScaleDownBlocked") == ("True", "UtilizationTooHigh"),
                     30, "ScaleDownBlocked")
    assert "kvpool.io/force-scale-down" in st["message"]
    time.sleep(3)
    assert kube.get("apps/v1", "StatefulSet", "s-store", namespace)["spec"]["replicas"] == 2  # type: ignore[index]
    kube.merge_patch(API, "KVPool", "s", namespace,
                     {"metadata": {"annotations": {"kvpool.io/force-scale-down": "true"}}})
    wait_for(lambda: kube.get("apps/v1", "StatefulSet", "s-store", namespace)["spec"]["replicas"] == 1,  # type: ignore[index]
             90, "the StatefulSet lowered after the drain")
    # The StatefulSet is lowered first, then the status written: wait for both.
    st = wait_status(kube, namespace, "s", lambda s: bool(s.get("lastDrain")), 30, "lastDrain in status")
    assert st["lastDrain"]["leaving"] == ["s-store-1"] and st["lastDrain"]["result"] in ("Completed",
                                                                                         "DeadlineExceeded")
    assert [m["id"] for m in st["ring"]["members"]] == ["s-store-0"]
    wait_events(kube, namespace, {"UtilizationTooHigh", "DrainStarted"})
    kube.delete(API, "KVTier", f"small-{namespace}")


def test_tiered_pool_with_claims_and_tier_change(operator: Operator, kube: Kube, namespace: str) -> None:
    dram, ssd = f"d-{namespace}", f"s-{namespace}"
    kube.apply({"apiVersion": API, "kind": "KVTier", "metadata": {"name": dram},
                "spec": {"medium": "dram", "capacity": {"bytes": "16Mi"}, "watermarks": {"high": 0.9, "low": 0.7}}})
    kube.apply({"apiVersion": API, "kind": "KVTier", "metadata": {"name": ssd},
                "spec": {"medium": "ssd", "capacity": {"bytes": "32Mi"}}})
    try:
        create(kube, kvpool("t", storage={"replicas": 1, "tiers": [dram, ssd]}, tenancy={"defaultTenant": "x"}),
               namespace)
        st = wait_status(kube, namespace, "t", lambda s: s.get("readyReplicas") == 1, 120, "the tiered node ready")
        assert st["capacityBytes"] >= 48 << 20  # DRAM and SSD of the node
        sts = kube.get("apps/v1", "StatefulSet", "t-store", namespace)
        assert sts is not None
        claim = sts["spec"]["volumeClaimTemplates"][0]
        assert claim["spec"]["resources"]["requests"]["storage"] == "34Mi"  # 32Mi + 5 %, whole MiB
        pvcs = kube.request("GET", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims")["items"]
        assert [p["metadata"]["name"] for p in pvcs] == ["ssd-t-store-0"] and pvcs[0]["status"]["phase"] == "Bound"
        cfg = json.loads(kube.get("v1", "ConfigMap", "t-store-config", namespace)["data"]["node.json"])  # type: ignore[index]
        assert cfg["ssdBytes"] == 32 << 20 and cfg["watermarks"] == {"high": 0.9, "low": 0.7}
        tier_status = wait_for(lambda: ((kube.get(API, "KVTier", ssd) or {}).get("status") or {}).get("pools"), 30,
                               "the tier's status")
        assert tier_status == [f"{namespace}.t"]
        before = sts["spec"]["template"]["metadata"]["annotations"]["kvpool.io/config-hash"]

        # A KVTier change re-reconciles the pools using it: new config, new template, rolled out.
        kube.merge_patch(API, "KVTier", dram, None, {"spec": {"capacity": {"bytes": "24Mi"}}})

        def config() -> dict[str, Any]:
            cm = kube.get("v1", "ConfigMap", "t-store-config", namespace) or {}
            return dict(json.loads((cm.get("data") or {}).get("node.json", "{}")))

        wait_for(lambda: config().get("dramBytes") == 24 << 20, 30, "the ConfigMap to follow the tier")

        def new_template() -> bool:
            got = kube.get("apps/v1", "StatefulSet", "t-store", namespace) or {}
            return bool(got["spec"]["template"]["metadata"]["annotations"]["kvpool.io/config-hash"] != before)

        wait_for(new_template, 30, "a new pod template (the node reads its tiers at start)")
        wait_status(kube, namespace, "t", lambda s: s.get("capacityBytes", 0) >= 56 << 20, 120,
                    "the restarted node reporting the larger tier")

        # Claims cannot grow under a StatefulSet: the pool says so and keeps the node within its claim.
        kube.merge_patch(API, "KVTier", ssd, None, {"spec": {"capacity": {"bytes": "64Mi"}}})
        st = wait_status(kube, namespace, "t", lambda s: cond(s, "Degraded") == ("True", "VolumeClaimsImmutable"),
                         30, "Degraded VolumeClaimsImmutable")
        assert 32 << 20 <= config()["ssdBytes"] <= 34 << 20 and "recreate the pool" in st["message"]
    finally:
        kube.delete(API, "KVTier", dram)
        kube.delete(API, "KVTier", ssd)


def test_encrypted_tier_gets_a_master_key_and_seals_what_it_demotes(operator: Operator, kube: Kube,
                                                                    namespace: str,
                                                                    trust: Callable[[str], None]) -> None:
    from kvpool.pool.node_client import StoreClient

    dram, ssd = f"ed-{namespace}", f"es-{namespace}"
    kube.apply({"apiVersion": API, "kind": "KVTier", "metadata": {"name": dram},
                "spec": {"medium": "dram", "capacity": {"bytes": "4Mi"}}})
    kube.apply({"apiVersion": API, "kind": "KVTier", "metadata": {"name": ssd},
                "spec": {"medium": "ssd", "capacity": {"bytes": "32Mi"}, "encryptAtRest": True}})
    try:
        create(kube, kvpool("e", storage={"replicas": 1, "tiers": [dram, ssd]}, tenancy={"defaultTenant": "x"}),
               namespace)
        secret = wait_for(lambda: kube.get("v1", "Secret", "e-store-master-key", namespace), 60, "the master key")
        assert len(base64.b64decode(secret["data"]["key"])) >= 32
        assert secret["metadata"]["ownerReferences"][0]["name"] == "e"
        cm = wait_for(lambda: kube.get("v1", "ConfigMap", "e-store-config", namespace), 60, "the ConfigMap")
        assert json.loads(cm["data"]["node.json"])["masterKeyFile"] == "/etc/kvpool/master-key/key"
        # The node started (it refuses to without a readable key) and seals what it demotes.
        st = wait_status(kube, namespace, "e", lambda s: s.get("readyReplicas") == 1, 120, "the encrypted node ready")
        trust("e")
        keys = [os.urandom(32) for _ in range(24)]
        vals = [os.urandom(512 << 10) for _ in range(24)]
        with StoreClient(st["ring"]["members"][0]["address"]) as c:
            for i in range(0, 24, 4):
                assert c.put(keys[i:i + 4], vals[i:i + 4]) == [0] * 4
            assert c.stats().counters[StoreCounter.SEALED] > 10
            got = [bytes(g) if g is not None else None for i in range(0, 24, 2) for g in c.get(keys[i:i + 2])]
            assert got == vals
            assert c.stats().counters.get(StoreCounter.AT_REST_AUTH_FAILURES, 0) == 0
    finally:
        kube.delete(API, "KVTier", dram)
        kube.delete(API, "KVTier", ssd)


def test_a_missing_master_key_secret_is_a_condition_then_the_pool_starts(operator: Operator, kube: Kube,
                                                                         namespace: str) -> None:
    """A Secret the user names but has not created: the pool says so (Degraded, a Warning Event)
    and starts no store pod that could only fail; once the Secret exists, the pool comes up."""
    create(kube, kvpool("m", storage={"replicas": 1, "encryption": {"enabled": True, "secretName": "m-key"}},
                        tenancy={"defaultTenant": "x"}), namespace)
    st = wait_status(kube, namespace, "m", lambda s: cond(s, "Degraded") == ("True", "MasterKeySecretMissing"),
                     60, "Degraded MasterKeySecretMissing")
    assert f"{namespace}/m-key" in st["message"] and st["phase"] == "Degraded"
    assert kube.get("apps/v1", "StatefulSet", "m-store", namespace) is None
    assert kube.get("v1", "Secret", "m-key", namespace) is None  # the user's to create: never minted
    # Too short a key is refused the same way, with its own reason.
    kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "m-key", "namespace": namespace},
                "stringData": {"key": "short"}})
    st = wait_status(kube, namespace, "m", lambda s: cond(s, "Degraded") == ("True", "MasterKeyInvalid"),
                     60, "Degraded MasterKeyInvalid")
    assert "at least 32 bytes" in st["message"]
    assert kube.get("apps/v1", "StatefulSet", "m-store", namespace) is None
    kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "m-key", "namespace": namespace},
                "stringData": {"key": base64.b64encode(os.urandom(32)).decode()}})
    st = wait_status(kube, namespace, "m", lambda s: s.get("readyReplicas") == 1
                     and cond(s, "Degraded") == ("False", "AsExpected"), 120, "the encrypted node ready")
    events = kube.list("v1", "Event", namespace)
    assert any(e.get("reason") == "MasterKeySecretMissing" and e.get("type") == "Warning" for e in events)


def test_router_api_and_kv_events_for_kv_aware_routers(operator: Operator, kube: Kube, namespace: str,
                                                       trust: Callable[[str], None]) -> None:
    """spec.router: the operator runs the router API (its pods never taken for store nodes) and
    the nodes publish one tenant's KV events; a vLLM-typed event consumer and the HTTP match
    agree with what the node holds; switching the router off removes it."""
    import http.client
    import socket
    import ssl

    from kvpool.pool.node_client import StoreClient

    create(kube, kvpool("r", storage={"replicas": 1}, tenancy={"defaultTenant": "x"},
                        router={"enabled": True, "events": {"enabled": True, "tenant": "x"}}), namespace)
    st = wait_status(kube, namespace, "r", lambda s: s.get("readyReplicas") == 1 and bool(s.get("router")),
                     120, "the node ready and the router in status")
    assert st["router"]["grpc"] == f"r-router.{namespace}.svc:7450" and st["router"]["events"]["port"] == 7402
    assert st["replicas"] == 1  # the router pod is not counted as a store pod
    trust("r")
    # TLS: the router serves HTTPS with its certificate, which callers check with the pool's CA
    # bundle (the ConfigMap the status names) against the router Service's name.
    assert st["router"]["http"] == f"https://r-router.{namespace}.svc:7451/v1/pool/match"
    bundle = st["router"]["caBundle"]
    cm = wait_for(lambda: kube.get("v1", "ConfigMap", bundle["configMap"], namespace), 30, "the CA bundle")
    ctx = ssl.create_default_context(cadata=cm["data"][bundle["key"]])
    selector = "app.kubernetes.io/component=router,app.kubernetes.io/instance=r"

    def router_ip() -> str | None:
        pods = [p for p in kube.list("v1", "Pod", namespace, selector)
                if any(c.get("type") == "Ready" and c.get("status") == "True"
                       for c in (p.get("status") or {}).get("conditions") or [])]
        return pods[0]["status"]["podIP"] if pods else None

    rip = wait_for(router_ip, 120, "the router pod ready")
    address = st["ring"]["members"][0]["address"]
    host = address.rpartition(":")[0]
    keys = [os.urandom(32) for _ in range(6)]
    with StoreClient(address) as c:
        assert c.put(keys[:4], [os.urandom(4096) for _ in range(4)]) == [0] * 4

    def match() -> Any:
        # The pod IP is dialled (no cluster DNS here); the certificate is checked for the Service's name.
        conn = http.client.HTTPConnection(rip, 7451, timeout=5)
        try:
            conn.sock = ctx.wrap_socket(socket.create_connection((rip, 7451), 5),
                                        server_hostname=f"r-router.{namespace}.svc")
            conn.request("POST", "/v1/pool/match", body=json.dumps({"keys": [k.hex() for k in keys]}).encode(),
                         headers={"Content-Type": "application/json"})
            with conn.getresponse() as resp:
                return json.loads(resp.read())
        except OSError:
            return None  # the router's view of the ring is still starting
        finally:
            conn.close()
    got = wait_for(lambda: (m := match()) is not None and m.get("hit_blocks") == 4 and m, 60, "the router's match")
    assert got["blocks"] == 6

    consumer = Path(__file__).resolve().parents[1] / "tests" / "kvpool" / "sidecar" / "_kv_router.py"
    proc = subprocess.Popen([sys.executable, str(consumer)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdin is not None and proc.stdout is not None

        def call(req: dict[str, Any]) -> Any:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(req) + "\n")
            proc.stdin.flush()
            return json.loads(proc.stdout.readline())
        assert json.loads(proc.stdout.readline()) == {"ready": True}
        assert call({"op": "add", "name": "node", "pub": f"tcp://{host}:7402", "replay": f"tcp://{host}:7403"})
        with StoreClient(address) as c:
            assert c.put(keys[4:], [os.urandom(4096) for _ in range(2)]) == [0] * 2
            assert c.remove(keys[:1]) == [0]
        want = sorted(k.hex() for k in keys[1:])
        wait_for(lambda: call({"op": "dump"})["index"]["node"] == want, 30, "the consumer's index")
    finally:
        proc.kill()
        proc.wait(10)
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()

    kube.merge_patch(API, "KVPool", "r", namespace, {"spec": {"router": {"enabled": False}}})
    wait_for(lambda: kube.get("apps/v1", "Deployment", "r-router", namespace) is None, 60, "the router removed")
    assert kube.get("v1", "Service", "r-router", namespace) is None
    st = wait_status(kube, namespace, "r", lambda s: (s.get("router") or {}).get("enabled") is False, 60,
                     "the router out of status")
    assert "grpc" not in st["router"]
    assert st["router"]["events"]["port"] == 7402


def test_tenant_token_quota_and_revocation_reach_the_nodes(operator: Operator, kube: Kube, namespace: str,
                                                           trust: Callable[[str], None]) -> None:
    from kvpool.core import errors
    from kvpool.pool.node_client import StoreClient

    create(kube, kvpool("q", storage={"replicas": 1}), namespace)  # no default tenant: closed nodes
    tn_name = f"q-{namespace}"
    create(kube, {"apiVersion": API, "kind": "TenantNamespace", "metadata": {"name": tn_name},
                  "spec": {"tenantId": tn_name, "namespaces": [namespace],
                           "pools": [{"pool": f"{namespace}.q", "quotaBytes": "1Mi"}]}})
    secret = wait_for(lambda: kube.get("v1", "Secret", f"kvpool-tenant-{tn_name}", namespace), 60, "the Secret")
    token = json.loads(base64.b64decode(secret["data"]["credentials.json"]))["token"]
    st = wait_status(kube, namespace, "q", lambda s: s.get("readyReplicas") == 1, 120, "the node ready")
    trust("q")
    address = st["ring"]["members"][0]["address"]
    block = os.urandom(384 << 10)

    def put(tok: str) -> list[int]:
        with StoreClient(address, tok) as c:
            return c.put([os.urandom(32) for _ in range(4)], [block] * 4)

    # The node knows the token once the operator has pushed the tenants.
    codes = wait_for(lambda: _try(put, token), 60, "the tenant's token accepted by the node")
    assert codes.count(0) == 2 and codes.count(2) == 2, codes  # 2 × 384Ki fit in 1Mi, then QUOTA_EXCEEDED
    with pytest.raises(errors.KvpoolError):
        put("")  # closed pool: no token, no service
    row = wait_for(lambda: next((p for p in ((kube.get(API, "TenantNamespace", tn_name) or {}).get("status") or {})
                                 .get("pools", []) if p.get("refusals")), None), 60, "refusals in the tenant status")
    assert row["usedBytes"] >= 2 * (384 << 10) and row["quotaBytes"] == 1 << 20 and row["refusals"] >= 2

    # Deleting the TenantNamespace revokes the token at the node.
    kube.delete(API, "TenantNamespace", tn_name)
    wait_for(lambda: _try(put, token) is None, 60, "the token revoked")


def _try(fn: Callable[[str], list[int]], token: str) -> list[int] | None:
    from kvpool.core import errors

    try:
        return fn(token)
    except errors.KvpoolError:
        return None


def test_operator_killed_mid_drain_resumes_from_status(operator: Operator, kube: Kube, namespace: str,
                                                       trust: Callable[[str], None]) -> None:
    from kvpool.pool.node_client import StoreClient

    # 1 MiB/s: the 4 MiB drain lasts about 4 s, so it is still running when the operator is
    # killed (unbounded, it could end between the status read and the kill).
    create(kube, kvpool("r", storage={"replicas": 2}, scaleDown={"gracePeriodSeconds": 30, "drainBandwidth": "1Mi"},
                        tenancy={"defaultTenant": "public"}), namespace)
    st = wait_status(kube, namespace, "r", lambda s: s.get("readyReplicas") == 2, 120, "two ready store nodes")
    trust("r")
    leaving = next(m for m in st["ring"]["members"] if m["id"] == "r-store-1")
    keys = [os.urandom(32) for _ in range(64)]
    with StoreClient(leaving["address"]) as c:
        assert set(c.put(keys, [os.urandom(64 << 10)] * len(keys))) == {0}
    kube.merge_patch(API, "KVPool", "r", namespace, {"spec": {"storage": {"replicas": 1}}})
    # Kill the operator the moment the drain is recorded: the rest must come from status.
    wait_status(kube, namespace, "r", lambda s: bool(s.get("drain")), 30, "the drain recorded in status")
    operator.kill()
    try:
        st = pool_status(kube, namespace, "r")
        assert st["drain"]["leaving"] == ["r-store-1"] and cond(st, "Draining") == ("True", "ScaleDown")
        assert kube.get("apps/v1", "StatefulSet", "r-store", namespace)["spec"]["replicas"] == 2  # type: ignore[index]
    finally:
        operator.start()
    st = wait_status(kube, namespace, "r", lambda s: bool(s.get("lastDrain")) and not s.get("drain"), 90,
                     "the drain finished by the restarted operator")
    assert st["lastDrain"]["leaving"] == ["r-store-1"] and st["lastDrain"]["result"] == "Completed"
    assert st["lastDrain"]["movedObjects"] + st["lastDrain"]["droppedObjects"] >= 1
    assert [m["id"] for m in st["ring"]["members"]] == ["r-store-0"]
    wait_for(lambda: kube.get("apps/v1", "StatefulSet", "r-store", namespace)["spec"]["replicas"] == 1,  # type: ignore[index]
             30, "the StatefulSet lowered")
    # What was moved is readable from the remaining node.
    remaining = st["ring"]["members"][0]["address"]
    with StoreClient(remaining) as c:
        got = c.get(keys)
    assert sum(v is not None for v in got) == st["lastDrain"]["movedObjects"]


def test_scale_up_rebalance_warms_the_new_node_and_reports_it(operator: Operator, kube: Kube, namespace: str,
                                                              trust: Callable[[str], None]) -> None:
    """Issue 8 part 1: scaling a pool that holds data up shows Rebalancing (waiting for the ring,
    then the previous owner pushing its hottest moved objects, paced) and then the counts."""
    from kvpool.core.ring import owners
    from kvpool.pool.node_client import StoreClient

    create(kube, kvpool("u", storage={"replicas": 1}, scaleUp={"warmBandwidth": "1Mi"},
                        tenancy={"defaultTenant": "public"}), namespace)
    st = wait_status(kube, namespace, "u", lambda s: s.get("readyReplicas") == 1, 120, "one ready store node")
    trust("u")
    first = st["ring"]["members"][0]["address"]
    keys = [os.urandom(32) for _ in range(48)]
    values = [os.urandom(64 << 10) for _ in keys]  # 3 MiB; about half moves: > 1 s at 1Mi/s
    with StoreClient(first) as c:
        assert set(c.put(keys, values)) == {0}
    # The operator must see the node holding data before the scale-up (else nothing to warm).
    wait_status(kube, namespace, "u", lambda s: s.get("usedBytes", 0) >= len(keys) * (64 << 10), 60,
                "the stored bytes in status")
    kube.merge_patch(API, "KVPool", "u", namespace, {"spec": {"storage": {"replicas": 2}}})
    st = wait_status(kube, namespace, "u", lambda s: (cond(s, "Rebalancing") or ("",))[0] == "True", 120,
                     "Rebalancing=True")
    # The phase says Rebalancing unless something worse shows (a new node not answering its
    # first Stats call on a loaded machine is Degraded for a reconcile): the condition is the contract.
    assert st["phase"] in ("Rebalancing", "Degraded") and st["rebalance"]["added"] == ["u-store-1"]
    assert st["rebalance"]["sources"] == ["u-store-0"]
    st = wait_status(kube, namespace, "u", lambda s: bool(s.get("lastRebalance")) and not s.get("rebalance"), 120,
                     "the rebalance done")
    assert cond(st, "Rebalancing") == ("False", "Balanced") and st["phase"] == "Ready", st
    last = st["lastRebalance"]
    ids = [m["id"] for m in st["ring"]["members"]]
    assert sorted(ids) == ["u-store-0", "u-store-1"]
    moved = [k for k, o in zip(keys, owners(b"".join(keys), ids)[:, 0].tolist(), strict=True)
             if ids[o] == "u-store-1"]
    assert last["result"] == "Completed" and last["added"] == ["u-store-1"], last
    assert last["movedObjects"] == len(moved) and last["plannedObjects"] == len(moved), last
    assert last["movedBytes"] == len(moved) * (64 << 10) and last["failedObjects"] == 0, last
    new = next(m["address"] for m in st["ring"]["members"] if m["id"] == "u-store-1")
    with StoreClient(new) as c:
        assert c.exists(moved, prefix_only=False).present == [True] * len(moved)
    wait_events(kube, namespace, {"RebalanceStarted", "RebalanceCompleted"}, "u")


def test_a_store_container_restart_keeps_its_ring_place(operator: Operator, kube: Kube, namespace: str) -> None:
    """A crashed store container comes back in the same pod (same IP) within the operator's
    member grace: the pod is not ready for a while, yet the ring keeps its epoch and members (no
    keys moved twice); the pool shows Degraded meanwhile, then Ready."""
    create(kube, kvpool("flap", storage={"replicas": 2}), namespace)
    st = wait_status(kube, namespace, "flap", lambda s: s.get("readyReplicas") == 2 and s.get("phase") == "Ready",
                     120, "two ready store nodes")
    ring = st["ring"]
    uid = (kube.get("v1", "Pod", "flap-store-1", namespace) or {})["metadata"]["uid"]
    # The pod's one container (the store) dies; the node agent restarts it in the same pod.
    assert procs.kill_marked(POD_MARKER_ENV, uid) > 0, "no process of flap-store-1 was found"
    seen_unready = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pod = kube.get("v1", "Pod", "flap-store-1", namespace) or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (pod.get("status") or {}).get("conditions") or [])
        restarts = sum(c.get("restartCount", 0) for c in (pod.get("status") or {}).get("containerStatuses") or [])
        seen_unready = seen_unready or not ready
        assert pool_status(kube, namespace, "flap")["ring"] == ring, "the ring changed during the restart"
        if ready and restarts >= 1 and seen_unready:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"flap-store-1 did not come back ready after a restart (seen unready: {seen_unready})")
    st = wait_status(kube, namespace, "flap", lambda s: s.get("phase") == "Ready", 60, "Ready again")
    assert st["ring"] == ring


class CrashLoop:
    """Keeps a pod's processes dead: each one the node agent (re)starts is killed at once, as a
    store whose container crashes on every start would be.  The pod object stays, never ready
    again, with the IP it had: what the operator sees of a node lost for good."""

    def __init__(self, uid: str) -> None:
        self.uid = uid
        self.kills = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CrashLoop:
        self.kills = procs.kill_marked(POD_MARKER_ENV, self.uid)
        assert self.kills > 0, f"no process of pod {self.uid} was found"
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.kills += procs.kill_marked(POD_MARKER_ENV, self.uid)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_a_lost_store_node_is_rereplicated_so_a_second_loss_loses_nothing(operator: Operator, kube: Kube,
                                                                          namespace: str,
                                                                          trust: Callable[[str], None]) -> None:
    """Replication 2 over 3 store nodes; one node's container crashes on every start (the pod
    stays, never ready again): past spec.storage.memberUnreadyGraceSeconds the operator publishes
    a ring without it and the survivors push each block that lost a copy to its new owner
    (Rebalancing reason Rereplicating, then lastRebalance).  Then a second of the original nodes
    dies too, and every object written before the first loss reads back byte-exact from the last."""
    from kvpool.pool.node_client import StoreClient
    from kvpool.pool.routing import write_routes

    # Paced, so the push lasts a few seconds and its status is seen while it runs.
    create(kube, kvpool("rr", storage={"replicas": 3, "replication": 2, "memberUnreadyGraceSeconds": 3},
                        scaleUp={"warmBandwidth": "512Ki"}, tenancy={"defaultTenant": "public"}), namespace)
    st = wait_status(kube, namespace, "rr", lambda s: s.get("readyReplicas") == 3 and s.get("phase") == "Ready"
                     and len((s.get("ring") or {}).get("members", [])) == 3 and not s.get("rebalance"),
                     120, "three ready store nodes in the ring")
    ring = st["ring"]
    assert ring["replicas"] == 2
    ids = [m["id"] for m in ring["members"]]
    assert ids == ["rr-store-0", "rr-store-1", "rr-store-2"]
    address = {m["id"]: m["address"] for m in ring["members"]}
    trust("rr")

    # Written as a sidecar writes with replication 2: each block to its 2 owners, one batch per node.
    keys = [os.urandom(32) for _ in range(48)]
    values = [os.urandom(64 << 10) for _ in keys]  # 3 MiB, 6 MiB stored
    routes = write_routes(b"".join(keys), ids, 2)
    for nid, idx in routes.items():
        with StoreClient(address[nid]) as c:
            assert set(c.put([keys[i] for i in idx.tolist()], [values[i] for i in idx.tolist()])) == {0}
    lost = sorted(routes["rr-store-2"].tolist())
    assert 0 < len(lost) < len(keys)
    wait_status(kube, namespace, "rr", lambda s: s.get("usedBytes", 0) >= 2 * len(keys) * (64 << 10), 60,
                "the stored bytes in status")

    first = (kube.get("v1", "Pod", "rr-store-2", namespace) or {})["metadata"]["uid"]
    second = (kube.get("v1", "Pod", "rr-store-0", namespace) or {})["metadata"]["uid"]
    with CrashLoop(first):
        st = wait_status(kube, namespace, "rr", lambda s: [m["id"] for m in s["ring"]["members"]]
                         == ["rr-store-0", "rr-store-1"], 60, "a ring without the lost node")
        assert st["ring"]["epoch"] > ring["epoch"]
        epoch = st["ring"]["epoch"]
        st = wait_status(kube, namespace, "rr", lambda s: cond(s, "Rebalancing") == ("True", "Rereplicating"), 60,
                         "Rebalancing reason Rereplicating")
        rb = st["rebalance"]
        assert rb["removed"] == ["rr-store-2"] and rb["added"] == [] and rb["epoch"] == epoch, rb
        assert rb["sources"] == ["rr-store-0", "rr-store-1"], rb
        st = wait_status(kube, namespace, "rr", lambda s: bool(s.get("lastRebalance")) and not s.get("rebalance"),
                         90, "the re-replication done")
        last = st["lastRebalance"]
        assert last["result"] == "Completed" and last["removed"] == ["rr-store-2"] and last["epoch"] == epoch, last
        # One push per block that lost its copy on rr-store-2, none failed.
        assert last["movedObjects"] == len(lost) and last["movedBytes"] == len(lost) * (64 << 10), last
        assert last["failedObjects"] == 0 and last["remainingObjects"] == 0, last
        assert cond(st, "Rebalancing") == ("False", "Balanced"), st.get("conditions")
        assert st["ring"]["epoch"] == epoch  # the lost node stayed out
        wait_events(kube, namespace, {"RebalanceStarted", "RebalanceCompleted"}, "rr")
        for nid in ("rr-store-0", "rr-store-1"):
            with StoreClient(address[nid]) as c:
                assert c.exists(keys, prefix_only=False).present == [True] * len(keys), nid

        # A second original node dies: the last one still holds every block.
        with CrashLoop(second):
            with StoreClient(address["rr-store-1"]) as c:
                got = c.get(keys)
            assert [bytes(g) if g is not None else None for g in got] == values
