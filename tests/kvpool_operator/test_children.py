"""Children of a KVPool built from its spec and tiers."""

import json
from typing import Any

from kvpool.core.traffic import DEFAULT_TTL_SECONDS
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
                   "ttlSeconds": DEFAULT_TTL_SECONDS, "closed": False,
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
    # tls: the store nodes' certificate (TLS is on by default, test_pool_tls).
    assert {m["name"] for m in c["volumeMounts"]} == {"config", "admin", "shm", "ssd", "sharedfs", "tls"}
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


def test_encryption_at_rest_mounts_the_master_key_secret() -> None:
    tiers = {"d": parse_tier(tier_body("d", capacity={"bytes": "2Gi"})),
             "s": parse_tier(tier_body("s", "ssd", capacity={"bytes": "10Gi"})),
             "se": parse_tier(tier_body("se", "ssd", capacity={"bytes": "10Gi"}, encryptAtRest=True))}

    def build(**storage: Any) -> tuple[PoolSpec, NodeLayout, dict[str, Any]]:
        pool = parse_pool(pool_body(storage=storage))
        layout = resolve_layout(pool, tiers, S.default_dram_bytes, S.store_memory_overhead_bytes)
        return pool, layout, children.stateful_set(pool, layout, S, 1)["spec"]["template"]["spec"]

    # Off: no key anywhere.
    pool, layout, pod = build(tiers=["d", "s"])
    assert not layout.encrypt_at_rest and "masterKeyFile" not in children.node_config(pool, layout)
    assert "master-key" not in {v["name"] for v in pod["volumes"]}
    # The tier asks for it, or the pool does: the node reads the key from the mounted Secret.
    for pool, layout, pod in (build(tiers=["d", "se"]), build(tiers=["d", "s"], encryption={"enabled": True})):
        assert layout.encrypt_at_rest
        cfg = children.node_config(pool, layout)
        assert cfg["masterKeyFile"] == f"{children.MASTER_KEY_DIR}/{children.MASTER_KEY_KEY}"
        vols = {v["name"]: v for v in pod["volumes"]}
        assert cfg["previousMasterKeysFile"] == f"{children.MASTER_KEY_DIR}/{children.PREVIOUS_KEYS_KEY}"
        # The whole Secret: its optional "previous" entry (a rotation) appears without a restart.
        assert vols["master-key"]["secret"] == {"secretName": "p-store-master-key", "defaultMode": 0o400}
        [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "master-key"]
        assert mount == {"name": "master-key", "mountPath": children.MASTER_KEY_DIR, "readOnly": True}
        # Switching it on restarts the nodes (they read the key only at start).
        assert children.restart_hash(cfg) != children.restart_hash(children.node_config(*build(tiers=["d", "s"])[:2]))
    # The key never goes into the ConfigMap or the pod spec, only its path.
    secret = children.master_key_secret(pool, "k" * 43)
    assert secret["stringData"] == {"key": "k" * 43} and secret["metadata"]["name"] == "p-store-master-key"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert "k" * 43 not in json.dumps(children.children(pool, layout, S, 1))
    # A Secret the user named is mounted instead.
    pool, layout, pod = build(tiers=["d"], encryption={"enabled": True, "secretName": "my-key"})
    assert {v["name"]: v for v in pod["volumes"]}["master-key"]["secret"]["secretName"] == "my-key"
