"""Builders of a KVPool's children: StatefulSet, headless Service, ConfigMap, PDB, ServiceAccount,
admin Secret. Pure: (pool, node layout, settings) → manifests as plain dicts, ready for a
server-side apply; every child carries an ownerReference to the pool, so deleting the pool
deletes them all.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kvpool.core.sizing import store_shm_bytes

from .certs import (
    CA_CERT_KEY,
    ca_bundle_config_map_name,
    router_tls_secret_name,
    store_server_name,
    store_tls_secret_name,
)
from .model import API_VERSION, STORE_POOL_LABEL, NodeLayout, PoolSpec
from .podsecurity import container_security_context, pod_security_context
from .settings import Settings
from .units import format_quantity, memory_volume_limit

CONFIG_DIR = "/etc/kvpool/config"
CONFIG_KEY = "node.json"
ADMIN_DIR = "/etc/kvpool/admin"
ADMIN_KEY = "token"
SSD_DIR = "/var/lib/kvpool/ssd"
SHAREDFS_DIR = "/mnt/kvpool-sharedfs"
STORE_SHM_DIR = "/run/kvpool-store"
MASTER_KEY_DIR = "/etc/kvpool/master-key"
TLS_DIR = "/etc/kvpool/tls"
"""The ``--tls-dir`` of every kvpool container the operator makes (store node, router, injected
sidecar): the Secret of its certificate (kvpool_operator.certs)."""
MASTER_KEY_KEY = "key"
PREVIOUS_KEYS_KEY = "previous"
"""Optional entry of the master-key Secret: earlier keys, one per line, still opened (rotation)."""
CONFIG_HASH_ANNOTATION = "kvpool.io/config-hash"
ROUTER_GRPC_PORT = 7450
ROUTER_HTTP_PORT = 7451

Manifest = dict[str, Any]


def store_name(pool: PoolSpec) -> str:
    return f"{pool.name}-store"


def config_name(pool: PoolSpec) -> str:
    return f"{pool.name}-store-config"


def admin_secret_name(pool: PoolSpec) -> str:
    return f"{pool.name}-store-admin"


def master_key_secret_name(pool: PoolSpec) -> str:
    """The Secret holding the master key of encryption at rest (the user's, or one the operator mints)."""
    return pool.encryption_secret or f"{pool.name}-store-master-key"


def selector_labels(pool: PoolSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvpool", "app.kubernetes.io/component": "store",
            "app.kubernetes.io/instance": pool.name, STORE_POOL_LABEL: pool.name}


def selector_string(pool: PoolSpec) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(pool).items()))


def common_labels(pool: PoolSpec) -> dict[str, str]:
    return {**selector_labels(pool), "app.kubernetes.io/managed-by": "kvpool-operator"}


def owner_reference(pool: PoolSpec) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "KVPool", "name": pool.name, "uid": pool.uid,
            "controller": True, "blockOwnerDeletion": True}


def _meta(pool: PoolSpec, name: str, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": pool.namespace, "labels": {**common_labels(pool), **(labels or {})},
            "ownerReferences": [owner_reference(pool)]}


def service_address(pool: PoolSpec) -> str:
    """The pool's DNS name (headless Service: every ready store pod)."""
    return f"{store_name(pool)}.{pool.namespace}.svc:{pool.port}"


# -------------------------------------------------------------------------------- node config


def node_config(pool: PoolSpec, layout: NodeLayout) -> dict[str, Any]:
    """The JSON a store node reads with ``--config`` (see kvpool.store.config)."""
    cfg: dict[str, Any] = {
        "dramBytes": layout.dram_bytes,
        "watermarks": {"high": layout.dram.high_watermark, "low": layout.dram.low_watermark},
        "ttlSeconds": {k: int(v) for k, v in sorted(pool.ttl_seconds.items())},
        "closed": pool.default_tenant is None,
        "shmDir": STORE_SHM_DIR,
    }
    if layout.ssd is not None:
        cfg["ssdPath"] = SSD_DIR
        cfg["ssdBytes"] = layout.ssd.capacity_bytes or 0
    if layout.sharedfs is not None:
        cfg["sharedfsPath"] = f"{SHAREDFS_DIR}/{layout.sharedfs.sharedfs_subpath}".rstrip("/")
    if layout.encrypt_at_rest:
        # The path, never the key: the key stays in its Secret, mounted into the store pods only.
        cfg["masterKeyFile"] = f"{MASTER_KEY_DIR}/{MASTER_KEY_KEY}"
        cfg["previousMasterKeysFile"] = f"{MASTER_KEY_DIR}/{PREVIOUS_KEYS_KEY}"
    return cfg


def restart_hash(cfg: Mapping[str, Any]) -> str:
    """Hash of what a node reads only at start. TTLs and watermarks are pushed live (SetPolicy),
    so changing them must not restart the nodes and lose their DRAM contents."""
    fixed = {k: v for k, v in cfg.items() if k not in ("ttlSeconds", "watermarks")}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]


def config_map(pool: PoolSpec, layout: NodeLayout) -> Manifest:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(pool, config_name(pool)),
            "data": {CONFIG_KEY: json.dumps(node_config(pool, layout), sort_keys=True, indent=2)}}


def admin_secret(pool: PoolSpec, token: str) -> Manifest:
    """The admin token of the pool's nodes; created once (never re-applied: that would rotate it)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": _meta(pool, admin_secret_name(pool)),
            "stringData": {ADMIN_KEY: token}}


def master_key_secret(pool: PoolSpec, key: str) -> Manifest:
    """The pool's master key of encryption at rest; created once and never re-applied (another key
    would make every sealed object of the shared filesystem unreadable)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(pool, master_key_secret_name(pool)), "stringData": {MASTER_KEY_KEY: key}}


# --------------------------------------------------------------------------------- workloads


def store_resources(pool: PoolSpec, layout: NodeLayout, settings: Settings) -> dict[str, Any]:
    """The user's resources, with memory sized from the DRAM tier and a CPU request where unset."""
    limits = dict(pool.resources.get("limits") or {})
    requests = dict(pool.resources.get("requests") or {})
    assert layout.memory_limit_bytes is not None
    mem = format_quantity(layout.memory_limit_bytes)
    limits.setdefault("memory", mem)
    requests.setdefault("memory", limits["memory"])
    requests.setdefault("cpu", settings.store_cpu_request)
    return {"limits": limits, "requests": requests}


def events_args(pool: PoolSpec) -> list[str]:
    """The store's KV-events options: one tenant's stored/removed blocks on a ZMQ PUB socket and a
    replay socket (ZMQ authenticates nobody, so only the tenant named in the spec is published)."""
    if pool.events_tenant is None:
        return []
    return ["--events-endpoint", f"tcp://$(POD_IP):{pool.events_port}",
            "--events-replay-endpoint", f"tcp://$(POD_IP):{pool.events_replay_port}",
            "--events-tenant", pool.events_tenant, "--events-block-size", str(pool.block_tokens)]


def metrics_args(pool: PoolSpec) -> list[str]:
    """The store's /metrics flag (served on the pod IP, as the control port)."""
    return ["--metrics-port", str(pool.metrics_port)] if pool.metrics_port else []


def metrics_ports(pool: PoolSpec) -> list[dict[str, Any]]:
    """The store container's ``metrics`` port (the PodMonitor scrapes it by name)."""
    return [{"name": "metrics", "containerPort": pool.metrics_port, "protocol": "TCP"}] if pool.metrics_port else []


def event_ports(pool: PoolSpec, container: bool) -> list[dict[str, Any]]:
    if pool.events_tenant is None:
        return []
    if container:
        return [{"name": "events", "containerPort": pool.events_port, "protocol": "TCP"},
                {"name": "events-replay", "containerPort": pool.events_replay_port, "protocol": "TCP"}]
    return [{"name": "events", "port": pool.events_port, "targetPort": "events"},
            {"name": "events-replay", "port": pool.events_replay_port, "targetPort": "events-replay"}]


def tls_args(pool_name: str, pool_namespace: str) -> list[str]:
    """``--tls-dir`` and the name the pool's store nodes are checked by: every store node serves
    it, and they are dialled by pod IP (the ring)."""
    return ["--tls-dir", TLS_DIR, "--tls-server-name", store_server_name(pool_name, pool_namespace)]


def store_container(pool: PoolSpec, layout: NodeLayout, settings: Settings) -> dict[str, Any]:
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
              {"name": "admin", "mountPath": ADMIN_DIR, "readOnly": True},
              {"name": "shm", "mountPath": STORE_SHM_DIR}]
    if layout.ssd is not None:
        mounts.append({"name": "ssd", "mountPath": SSD_DIR})
    if layout.sharedfs is not None:
        mounts.append({"name": "sharedfs", "mountPath": SHAREDFS_DIR})
    if layout.encrypt_at_rest:
        mounts.append({"name": "master-key", "mountPath": MASTER_KEY_DIR, "readOnly": True})
    tls: list[str] = []
    if settings.tls:
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
        tls = tls_args(pool.name, pool.namespace)
        if pool.plaintext_data_session:
            # The trusted-network opt-out: bulk bytes in the clear, each connection opened by a
            # ticket from the TLS control channel (without TLS everything is plaintext anyway).
            tls.append("--plaintext-data-session")
    probe = {"tcpSocket": {"port": "control"}}
    return {
        "name": "store",
        "image": pool.image or settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": [*settings.command, "store"],
        # The pod IP, not 0.0.0.0: the harness runs pods as processes sharing one host.
        "args": ["--listen", f"$(POD_IP):{pool.port}", "--transfer-port", str(pool.transfer_port),
                 "--config", f"{CONFIG_DIR}/{CONFIG_KEY}", "--node-id", "$(POD_NAME)",
                 "--admin-token-file", f"{ADMIN_DIR}/{ADMIN_KEY}", *events_args(pool), *metrics_args(pool),
                 *tls],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "KVPOOL_NODE_ID", "value": "$(POD_NAME)"}],
        "ports": [{"name": "control", "containerPort": pool.port, "protocol": "TCP"},
                  {"name": "transfer", "containerPort": pool.transfer_port, "protocol": "TCP"},
                  *event_ports(pool, container=True), *metrics_ports(pool)],
        "readinessProbe": {**probe, "periodSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {**probe, "initialDelaySeconds": 10, "periodSeconds": 10, "failureThreshold": 6},
        "resources": store_resources(pool, layout, settings),
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
    }


def volume_claim_templates(pool: PoolSpec, layout: NodeLayout) -> list[dict[str, Any]]:
    if layout.ssd is None:
        return []
    tier = layout.ssd
    # Capacity + 5 % for filesystem overhead, rounded up to whole MiB (a readable quantity).
    size = tier.claim_bytes or -(-int((tier.capacity_bytes or 0) * 1.05) // (1 << 20)) * (1 << 20)
    spec: dict[str, Any] = {"accessModes": list(tier.access_modes),
                            "resources": {"requests": {"storage": format_quantity(size)}}}
    if tier.storage_class:
        spec["storageClassName"] = tier.storage_class
    return [{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": "ssd", "labels": selector_labels(pool)}, "spec": spec}]


def stateful_set(pool: PoolSpec, layout: NodeLayout, settings: Settings, replicas: int) -> Manifest:
    """The store nodes; ``replicas`` comes from the scaling/drain plan, never straight from spec."""
    cfg = node_config(pool, layout)
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_name(pool)}},
        {"name": "admin", "secret": {"secretName": admin_secret_name(pool), "defaultMode": 0o400}},
        {"name": "shm", "emptyDir": {"medium": "Memory",
                                     "sizeLimit": memory_volume_limit(
                                         store_shm_bytes(layout.dram_bytes, layout.dram.high_watermark)
                                         + settings.shm_slack_bytes)}},
    ]
    if layout.sharedfs is not None and layout.sharedfs.sharedfs_volume is not None:
        volumes.append({**dict(layout.sharedfs.sharedfs_volume), "name": "sharedfs"})
    if layout.encrypt_at_rest:
        # The whole Secret (no items): ``previous`` may come and go with a rotation, and the
        # kubelet updates the files in place, so the nodes pick a rotation up without a restart.
        volumes.append({"name": "master-key", "secret": {
            "secretName": master_key_secret_name(pool), "defaultMode": 0o400}})
    if settings.tls:
        # The whole Secret: a renewal or a CA rotation rewrites it, the kubelet updates the files
        # in place and the node re-reads them at its next handshake, without a restart.
        volumes.append({"name": "tls", "secret": {"secretName": store_tls_secret_name(pool.name),
                                                  "defaultMode": 0o400}})
    pod_spec: dict[str, Any] = {
        "serviceAccountName": store_name(pool),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # Long enough for a node to finish a drain it was asked to do before it got SIGTERM.
        "terminationGracePeriodSeconds": pool.grace_period_seconds + 30,
        "securityContext": pod_security_context(),
        "containers": [store_container(pool, layout, settings)],
        "volumes": volumes,
    }
    if pool.node_selector:
        pod_spec["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in pool.tolerations]
    spec: dict[str, Any] = {
        "replicas": replicas,
        "serviceName": store_name(pool),
        # All at once: store nodes do not depend on each other, and the ring is built from the ready ones.
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": selector_labels(pool)},
        "updateStrategy": {"type": "RollingUpdate"},
        # Scaled-away claims hold a cache nobody will read again.
        "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Delete"},
        "template": {
            "metadata": {"labels": {**common_labels(pool), **settings.store_labels},
                         "annotations": {CONFIG_HASH_ANNOTATION: restart_hash(cfg)}},
            "spec": pod_spec,
        },
    }
    claims = volume_claim_templates(pool, layout)
    if claims:
        spec["volumeClaimTemplates"] = claims
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(pool, store_name(pool)), "spec": spec}


def headless_service(pool: PoolSpec) -> Manifest:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(pool, store_name(pool)),
            "spec": {"clusterIP": "None", "selector": selector_labels(pool), "publishNotReadyAddresses": False,
                     "ports": [{"name": "control", "port": pool.port, "targetPort": "control"},
                               {"name": "transfer", "port": pool.transfer_port, "targetPort": "transfer"},
                               *event_ports(pool, container=False)]}}


# ------------------------------------------------------------------------------------ router


def router_name(pool: PoolSpec) -> str:
    return f"{pool.name}-router"


def router_labels(pool: PoolSpec) -> dict[str, str]:
    """Never the store pods' pool label: a router pod must not be taken for a store node."""
    return {"app.kubernetes.io/name": "kvpool", "app.kubernetes.io/component": "router",
            "app.kubernetes.io/instance": pool.name}


def _router_meta(pool: PoolSpec) -> dict[str, Any]:
    return {"name": router_name(pool), "namespace": pool.namespace,
            "labels": {**router_labels(pool), "app.kubernetes.io/managed-by": "kvpool-operator"},
            "ownerReferences": [owner_reference(pool)]}


def router_deployment(pool: PoolSpec, settings: Settings) -> Manifest:
    """``kvpool router-api``: the pool hit length of a prompt for KV-aware routers without a
    sidecar.  It holds no credential: each caller's tenant token goes through to the nodes."""
    probe = {"tcpSocket": {"port": "http"}}
    tls: list[str] = []
    pod_tls: dict[str, Any] = {}
    if settings.tls:
        # It serves its Service's names and dials the store nodes by pod IP, as a sidecar does.
        tls = tls_args(pool.name, pool.namespace)
        pod_tls = {"volumes": [{"name": "tls", "secret": {"secretName": router_tls_secret_name(pool.name),
                                                           "defaultMode": 0o400}}]}
    container: dict[str, Any] = {
        "name": "router-api",
        "image": pool.image or settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": [*settings.command, "router-api"],
        "args": ["--pool", service_address(pool), "--listen", f"$(POD_IP):{ROUTER_GRPC_PORT}",
                 "--http", f"$(POD_IP):{ROUTER_HTTP_PORT}", *tls],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "grpc", "containerPort": ROUTER_GRPC_PORT, "protocol": "TCP"},
                  {"name": "http", "containerPort": ROUTER_HTTP_PORT, "protocol": "TCP"}],
        "readinessProbe": {**probe, "periodSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {**probe, "initialDelaySeconds": 10, "periodSeconds": 10, "failureThreshold": 6},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": container_security_context(),
    }
    if settings.tls:
        container["volumeMounts"] = [{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _router_meta(pool),
            "spec": {"replicas": pool.router_replicas, "selector": {"matchLabels": router_labels(pool)},
                     "template": {"metadata": {"labels": _router_meta(pool)["labels"]},
                                  "spec": {"automountServiceAccountToken": False, "enableServiceLinks": False,
                                           "securityContext": pod_security_context(),
                                           "containers": [container], **pod_tls}}}}


def router_service(pool: PoolSpec) -> Manifest:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _router_meta(pool),
            "spec": {"selector": router_labels(pool),
                     "ports": [{"name": "grpc", "port": ROUTER_GRPC_PORT, "targetPort": "grpc"},
                               {"name": "http", "port": ROUTER_HTTP_PORT, "targetPort": "http"}]}}


def pod_disruption_budget(pool: PoolSpec) -> Manifest:
    # One node at a time: a voluntary eviction costs that node's share of the cache.
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(pool, store_name(pool)),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(pool)}}}


def service_account(pool: PoolSpec) -> Manifest:
    # Store nodes never call the Kubernetes API: no token, no RBAC.
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(pool, store_name(pool)),
            "automountServiceAccountToken": False}


def router_status(pool: PoolSpec, settings: Settings) -> dict[str, Any] | None:
    """Where routers reach the pool's router API and the nodes' KV events (None: neither is on; a
    merge patch then removes the field). With TLS the API is HTTPS/TLS, verified with the CA
    bundle the ``caBundle`` ConfigMap holds."""
    if not pool.router_enabled and pool.events_tenant is None:
        return None
    # Every field named (None when off): this goes out as a merge patch, which keeps what it omits.
    host = f"{router_name(pool)}.{pool.namespace}.svc"
    on = pool.router_enabled
    scheme = "https" if settings.tls else "http"
    return {"enabled": on, "grpc": f"{host}:{ROUTER_GRPC_PORT}" if on else None,
            "http": f"{scheme}://{host}:{ROUTER_HTTP_PORT}/v1/pool/match" if on else None,
            "caBundle": {"configMap": ca_bundle_config_map_name(pool.name), "key": CA_CERT_KEY}
            if on and settings.tls else None,
            "events": None if pool.events_tenant is None else {
                "port": pool.events_port, "replayPort": pool.events_replay_port,
                "service": f"{store_name(pool)}.{pool.namespace}.svc"}}


def pruned(pool: PoolSpec) -> tuple[tuple[str, str, str], ...]:
    """Optional children the spec switched off: (apiVersion, kind, name) to delete."""
    if pool.router_enabled:
        return ()
    return (("apps/v1", "Deployment", router_name(pool)), ("v1", "Service", router_name(pool)),
            ("v1", "Secret", router_tls_secret_name(pool.name)))


def children(pool: PoolSpec, layout: NodeLayout, settings: Settings, replicas: int) -> list[Manifest]:
    """Everything re-applied on each reconcile (the admin Secret is created once, separately)."""
    router = [router_deployment(pool, settings), router_service(pool)] if pool.router_enabled else []
    # The StatefulSet stays last (the reconcile adjusts its claims there).
    return [service_account(pool), config_map(pool, layout), headless_service(pool), pod_disruption_budget(pool),
            *router, stateful_set(pool, layout, settings, replicas)]
