"""The CRDs on the real API server: they install (structural, CEL compiles within its cost
budget), defaults apply, printer columns show, and each validation rule refuses a bad object
with a message that says what is wrong."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import Cluster
from e2e.testutil import wait_for
from kvpool.core.traffic import DEFAULT_TTL

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
CRD_NAMES = ["kvpools.kvpool.io", "kvtiers.kvpool.io", "tenantnamespaces.kvpool.io"]


def install_crds(cluster: Cluster) -> None:
    """kubectl apply the CRDs and wait until they are Established (idempotent)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    for name in CRD_NAMES:
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{name}")


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> Iterator[None]:
    install_crds(cluster)
    yield


def apply(cluster: Cluster, doc: dict[str, Any], namespace: str | None = None) -> Any:
    args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
    return cluster.kubectl(*args, input=json.dumps(doc), check=False)


def pool(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kvpool.io/v1alpha1", "kind": "KVPool", "metadata": {"name": name}, "spec": spec}


def tier(name: str, **spec: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"medium": "dram", "capacity": {"bytes": "1Gi"}}
    s.update(spec)
    return {"apiVersion": "kvpool.io/v1alpha1", "kind": "KVTier", "metadata": {"name": name}, "spec": s}


def tenant(name: str, **spec: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"tenantId": name, "namespaces": ["x"]}
    s.update(spec)
    return {"apiVersion": "kvpool.io/v1alpha1", "kind": "TenantNamespace", "metadata": {"name": name}, "spec": s}


def test_crds_install_with_short_names(cluster: Cluster, crds: None) -> None:
    out = cluster.kubectl("api-resources", "--api-group=kvpool.io", "-o", "wide").stdout
    for short in ("kvp", "kvt", "tns"):
        assert short in out.replace(",", " ").split(), out
    for name in CRD_NAMES:
        crd = json.loads(cluster.kubectl("get", "crd", name, "-o", "json").stdout)
        conds = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert conds.get("Established") == "True" and conds.get("NonStructuralSchema") is None, conds


def test_defaults_and_printer_columns(cluster: Cluster, crds: None, namespace: str) -> None:
    r = apply(cluster, pool("defaults"), namespace)
    assert r.returncode == 0, r.stderr
    got = json.loads(cluster.kubectl("get", "kvp", "defaults", "-n", namespace, "-o", "json").stdout)
    spec = got["spec"]
    assert spec["blockTokens"] == 128 and spec["hash"] == "sha256"
    assert spec["storage"]["replicas"] == 1 and spec["storage"]["replication"] == 1
    assert spec["ttl"] == DEFAULT_TTL
    assert spec["scaleDown"] == {"gracePeriodSeconds": 60, "utilizationLimit": 0.8}
    assert spec["scaleUp"] == {"warmFraction": 1.0, "warmDeadlineSeconds": 300}
    assert spec["sidecar"]["localBytes"] == "256Mi" and spec["autoscaling"]["enabled"] is False
    r = apply(cluster, pool("deadlines", sidecar={"deadlines": {"matchMs": 250}}), namespace)
    assert r.returncode == 0, r.stderr
    got = json.loads(cluster.kubectl("get", "kvp", "deadlines", "-n", namespace, "-o", "json").stdout)
    assert got["spec"]["sidecar"]["deadlines"] == {"matchMs": 250, "readMs": 100, "readBytesPerSecond": 100000000,
                                                   "probeMs": 1000, "suspectBackoffMs": 1000}
    header = cluster.kubectl("get", "kvpools", "-n", namespace).stdout.splitlines()[0].split()
    assert header == ["NAME", "READY", "REPLICAS", "CAPACITY", "USED", "UTILIZATION", "HITRATE", "PHASE", "AGE"]


@pytest.mark.parametrize(("doc", "message"), [
    (pool("bad-minmax", autoscaling={"enabled": False, "minReplicas": 5, "maxReplicas": 2}),
     "autoscaling.minReplicas must not exceed autoscaling.maxReplicas"),
    (pool("bad-range", storage={"replicas": 9}, autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 3}),
     "storage.replicas must lie between"),
    (pool("bad-replication", storage={"replicas": 2, "replication": 3}),
     "storage.replication cannot exceed storage.replicas"),
    (pool("bad-local", sidecar={"localBytes": "0"}), "sidecar.localBytes must be a positive quantity"),
    (pool("bad-local2", sidecar={"localBytes": -5}), "sidecar.localBytes must be a positive quantity"),
    (pool("bad-target", autoscaling={"targetUtilization": 1.5}), "targetUtilization must be in (0, 1)"),
    (pool("bad-limit", scaleDown={"utilizationLimit": 0}), "utilizationLimit must be in (0, 1]"),
    (pool("bad-drain-rate", scaleDown={"drainBandwidth": "fast"}), "drainBandwidth must be a quantity"),
    (pool("bad-drain-rate2", scaleDown={"drainBandwidth": -1}), "drainBandwidth must be a quantity"),
    (pool("bad-events", router={"events": {"enabled": True}}), "router.events needs a tenant"),
    (pool("bad-router", router={"replicas": 0}), "spec.router.replicas"),
    (pool("bad-grace", storage={"memberUnreadyGraceSeconds": -1}), "spec.storage.memberUnreadyGraceSeconds"),
    (pool("bad-events2", router={"events": {"enabled": True, "tenant": "Not_A_Tenant"}}), "spec.router.events.tenant"),
    (pool("bad-warm-rate", scaleUp={"warmBandwidth": "fast"}), "warmBandwidth must be a quantity"),
    (pool("bad-warm-frac", scaleUp={"warmFraction": 1.5}), "scaleUp.warmFraction must be in [0, 1]"),
    (pool("bad-warm-time", scaleUp={"warmDeadlineSeconds": 0}),
     "scaleUp.warmDeadlineSeconds must be above 0 unless warmFraction is 0"),
    (pool("bad-ttl", ttl={"agent": "forever"}), "spec.ttl.agent"),
    (pool("bad-hash", hash="md5"), "spec.hash"),
    (pool("bad-enc", storage={"encryption": {"secretName": "k"}}), "encryption.secretName needs encryption.enabled"),
    (pool("bad-deadline", sidecar={"deadlines": {"matchMs": 0}}), "spec.sidecar.deadlines.matchMs"),
    (pool("bad-deadline2", sidecar={"deadlines": {"readBytesPerSecond": -1}}),
     "spec.sidecar.deadlines.readBytesPerSecond"),
    (pool("bad-deadline3", sidecar={"deadlines": {"probeMs": "1s"}}), "spec.sidecar.deadlines.probeMs"),
    (pool("bad-peer", router={"allowedFrom": [{}]}), "a peer needs podSelector, namespaceSelector or ipBlock"),
    (pool("bad-peer2", router={"allowedFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}),
     "ipBlock cannot be combined with podSelector or namespaceSelector"),
])
def test_invalid_pools_refused(cluster: Cluster, crds: None, namespace: str, doc: dict[str, Any],
                               message: str) -> None:
    r = apply(cluster, doc, namespace)
    assert r.returncode != 0, f"{doc['metadata']['name']} was accepted"
    assert message in r.stderr, r.stderr


@pytest.mark.parametrize(("doc", "message"), [
    (tier("bad-wm", watermarks={"high": 0.8, "low": 0.9}), "watermarks.low must be below watermarks.high"),
    (tier("bad-cap", capacity={"bytes": "0"}), "capacity.bytes must be a positive quantity"),
    (tier("bad-cap2", capacity={"bytes": "1Gi", "memoryFraction": 0.5}),
     "set exactly one of capacity.bytes and capacity.memoryFraction"),
    (tier("bad-frac", medium="ssd", capacity={"memoryFraction": 0.5}),
     "capacity.memoryFraction is only valid for the dram medium"),
    (tier("bad-frac2", capacity={"memoryFraction": 1.5}), "capacity.memoryFraction must be in (0, 0.95]"),
    (tier("bad-vc", volumeClaim={"size": "1Gi"}), "volumeClaim is only valid for the ssd medium"),
    (tier("bad-fs", medium="sharedfs"), "a sharedfs tier needs spec.sharedfs.volume"),
    (tier("bad-fs2", sharedfs={"volume": {"emptyDir": {}}}), "sharedfs is only valid for the sharedfs medium"),
    (tier("bad-vcsize", medium="ssd", volumeClaim={"size": "0"}), "volumeClaim.size must be a positive quantity"),
    (tier("bad-medium", medium="tape"), "spec.medium"),
    (tier("bad-enc", encryptAtRest=True), "encryptAtRest is only valid for the ssd and sharedfs media"),
])
def test_invalid_tiers_refused(cluster: Cluster, crds: None, doc: dict[str, Any], message: str) -> None:
    r = apply(cluster, doc)
    assert r.returncode != 0, f"{doc['metadata']['name']} was accepted"
    assert message in r.stderr, r.stderr


@pytest.mark.parametrize(("doc", "message"), [
    (tenant("bad-quota", pools=[{"pool": "ns.p", "quotaBytes": "0"}]), "quotaBytes must be a positive quantity"),
    (tenant("bad-ref", pools=[{"pool": "justaname"}]), "spec.pools[0].pool"),
    (tenant("bad-ns", namespaces=[]), "spec.namespaces"),
    (tenant("Bad_Id", tenantId="Bad_Id"), "spec.tenantId"),
])
def test_invalid_tenants_refused(cluster: Cluster, crds: None, doc: dict[str, Any], message: str) -> None:
    r = apply(cluster, doc)
    assert r.returncode != 0, f"{doc['metadata']['name']} was accepted"
    assert message in r.stderr, r.stderr


def test_immutable_fields(cluster: Cluster, crds: None, namespace: str) -> None:
    assert apply(cluster, pool("imm", blockTokens=256), namespace).returncode == 0
    r = apply(cluster, pool("imm", blockTokens=128), namespace)
    assert r.returncode != 0 and "blockTokens is immutable" in r.stderr, r.stderr
    r = cluster.kubectl("patch", "kvp", "imm", "-n", namespace, "--type=merge", "-p",
                        '{"spec":{"hash":"sha256","storage":{"replicas":2}}}', check=False)
    assert r.returncode == 0, r.stderr  # other fields stay editable
    name = f"imm-{namespace}"
    assert apply(cluster, tier(name), None).returncode == 0
    r = apply(cluster, tier(name, medium="ssd"))
    assert r.returncode != 0 and "medium is immutable" in r.stderr, r.stderr
    cluster.kubectl("delete", "kvtier", name)
    tn = tenant(name, tenantId="t1")
    assert apply(cluster, tn).returncode == 0
    r = apply(cluster, tenant(name, tenantId="t2"))
    assert r.returncode != 0 and "tenantId is immutable" in r.stderr, r.stderr
    cluster.kubectl("delete", "tenantnamespace", name)


def test_examples_are_accepted_by_the_api_server(cluster: Cluster, crds: None) -> None:
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        r = cluster.kubectl("apply", "--dry-run=server", "-f", str(path), check=False)
        # Namespaced objects of examples that create their namespaces in the same file cannot be
        # dry-run before those exist; those files are applied for real in the scenario tests.
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if any(d["kind"] == "Namespace" for d in docs):
            continue
        assert r.returncode == 0, f"{path.name}: {r.stderr}"
    wait_for(lambda: True, 1, "noop")
