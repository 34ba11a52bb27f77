"""Children of a KVPool built from its spec and tiers."""

import json
from typing import Any

from kvpool_operator import children
from kvpool_operator.model import NodeLayout, PoolSpec, parse_pool, parse_tier, resolve_layout
from kvpool_operator.settings import Settings
from kvpool_operator.testing import pool_body, tier_body

S = Settings()


def _pool_and_layout(**spec: Any) -> tuple[PoolSpec, NodeLayout]:
    tiers = {"d": parse_tier(tier_body("d", capacity={"bytes": "2Gi"}, watermarks={"high": 0.9, "low": 0.7})),
             "s": parse_tier(tier_body("s", "ssd", capacity={"bytes": "10Gi"},
                                       volumeClaim={"storageClassName": "fast"})),
             "f": parse_tier(tier_body("f", "sharedfs", sharedfs={"volume": {"nfs": {"server": "n", "path": "/e"}},
                                                                  "subPath": "kv"}))}
    pool = parse_pool(pool_body(**spec))
    return pool, resolve_layout(pool, tiers, S.default_dram_bytes, S.store_memory_overhead_bytes)


def test_every_child_is_owned_and_labelled() -> None:
    pool, layout = _pool_and_layout()
    objs = children.children(pool, layout, S, 3)
    assert [o["kind"] for o in objs] == ["ServiceAccount", "ConfigMap", "Service", "PodDisruptionBudget",
                                         "StatefulSet"]
    for o in objs + [children.admin_secret(pool, "t")]:
        ref = o["metadata"]["ownerReferences"][0]
        assert ref == {"apiVersion": "kvpool.io/v1alpha1", "kind": "KVPool", "name": "p", "uid": "uid-1",
                       "controller": True, "blockOwnerDeletion": True}
        assert o["metadata"]["namespace"] == "ns"
        assert o["metadata"]["labels"]["kvpool.io/store-of"] == "p"
        assert "kvpool.io/pool" not in o["metadata"]["labels"]  # store pods must never get sidecars


def test_node_config_dram_only_and_open_tenancy() -> None:
    pool, layout = _pool_and_layout(tenancy={"defaultTenant": "public"})
    cfg = children.node_config(pool, layout)
    assert cfg == {"dramBytes": 1 << 30, "watermarks": {"high": 0.95, "low": 0.85},
                   "ttlSeconds": {"agent": 259200, "chatbot": 604800}, "closed": False,
                   "shmDir": children.STORE_SHM_DIR}
    cm = children.config_map(pool, layout)
    assert json.loads(cm["data"]["node.json"]) == cfg


def test_tiered_statefulset() -> None:
    pool, layout = _pool_and_layout(storage={"replicas": 3, "tiers": ["d", "s", "f"], "port": 7500})
    cfg = children.node_config(pool, layout)
    assert cfg["closed"] is True
    assert (cfg["dramBytes"], cfg["ssdBytes"], cfg["ssdPath"]) == (2 << 30, 10 << 30, children.SSD_DIR)
    assert cfg["sharedfsPath"] == f"{children.SHAREDFS_DIR}/kv" and cfg["watermarks"] == {"high": 0.9, "low": 0.7}
    sts = children.stateful_set(pool, layout, S, 2)
    spec = sts["spec"]
    assert spec["replicas"] == 2 and spec["serviceName"] == "p-store" and spec["podManagementPolicy"] == "Parallel"
    claim = spec["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "ssd" and claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["resources"]["requests"]["storage"] == "10752Mi"
    pod = spec["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["kvpool", "store"]
    assert c["args"][:4] == ["--listen", "$(POD_IP):7500", "--transfer-port", "7501"]
    assert {m["name"] for m in c["volumeMounts"]} == {"config", "admin", "shm", "ssd", "sharedfs"}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["sharedfs"]["nfs"] == {"server": "n", "path": "/e"}
    assert vols["shm"]["emptyDir"]["medium"] == "Memory"
    assert c["resources"]["limits"]["memory"] == "2304Mi"  # 2Gi DRAM + 256Mi overhead
    assert c["resources"]["requests"] == {"memory": "2304Mi", "cpu": "100m"}
    assert pod["terminationGracePeriodSeconds"] == 90 and pod["automountServiceAccountToken"] is False
    assert c["readinessProbe"]["tcpSocket"]["port"] == "control"


def test_user_resources_are_kept() -> None:
    pool, layout = _pool_and_layout(storage={"resources": {"limits": {"memory": "3Gi", "cpu": "2"}}})
    res = children.store_resources(pool, layout, S)
    assert res == {"limits": {"memory": "3Gi", "cpu": "2"}, "requests": {"memory": "3Gi", "cpu": "100m"}}


def test_restart_hash_ignores_live_policy() -> None:
    pool, layout = _pool_and_layout()
    a = children.node_config(pool, layout)
    b = dict(a, ttlSeconds={"agent": 1}, watermarks={"high": 0.5, "low": 0.1})
    c = dict(a, dramBytes=5)
    assert children.restart_hash(a) == children.restart_hash(b) != children.restart_hash(c)


def test_service_pdb_sa() -> None:
    pool, _ = _pool_and_layout()
    svc = children.headless_service(pool)
    assert svc["spec"]["clusterIP"] == "None"
    assert [p["port"] for p in svc["spec"]["ports"]] == [7400, 7401]
    assert children.pod_disruption_budget(pool)["spec"]["maxUnavailable"] == 1
    assert children.service_account(pool)["automountServiceAccountToken"] is False
    assert children.service_address(pool) == "p-store.ns.svc:7400"
    assert children.admin_secret(pool, "tok")["stringData"] == {"token": "tok"}
