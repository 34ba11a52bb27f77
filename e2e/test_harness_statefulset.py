"""A StatefulSet on the harness, as the operator's store nodes will run: stable names that
resolve between pods (the agent's /etc/hosts stand-in for cluster DNS), claims provisioned and
bound by the real PV controller, and data on a claim surviving the pod's re-creation."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from kubernetes import client

from e2e.cluster import Cluster
from e2e.testutil import core_api, get_pod, is_ready, python_cmd, wait_for, wait_pod

pytestmark = pytest.mark.cluster

# Answers "id" with "<hostname>:<token kept on the claim>", and "ask NAME" by resolving NAME
# inside the pod and asking that peer for its id.
PEER_PROGRAM = """
    import os, pathlib, secrets, socket
    idfile = pathlib.Path("/data/id")
    if not idfile.exists():
        idfile.write_text(secrets.token_hex(8))
    me = f"{socket.gethostname()}:{idfile.read_text()}"
    srv = socket.create_server((os.environ["POD_IP"], 7000))
    while True:
        conn, _ = srv.accept()
        with conn:
            req = conn.recv(200).decode()
            if req.startswith("ask "):
                try:
                    addr = socket.gethostbyname(req[4:])
                    with socket.create_connection((addr, 7000), timeout=2) as peer:
                        peer.sendall(b"id")
                        conn.sendall(peer.recv(200))
                except OSError as exc:
                    conn.sendall(f"error {exc}".encode())
            else:
                conn.sendall(me.encode())
"""


def ask(ip: str, request: str) -> str:
    with socket.create_connection((ip, 7000), timeout=5) as conn:
        conn.sendall(request.encode())
        return conn.recv(200).decode()


def test_statefulset_names_claims_and_persistence(cluster: Cluster, api: client.ApiClient,
                                                  namespace: str) -> None:
    core = core_api(api)
    apps: Any = client.AppsV1Api(api)
    core.create_namespaced_service(namespace, {
        "metadata": {"name": "web"},
        "spec": {"clusterIP": "None", "selector": {"app": "web"},
                 "ports": [{"name": "peer", "port": 7000}]}})
    apps.create_namespaced_stateful_set(namespace, {
        "metadata": {"name": "web"},
        "spec": {
            "serviceName": "web", "replicas": 2, "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 2,
                    "containers": [{
                        "name": "peer", "image": "unused", "command": python_cmd(PEER_PROGRAM),
                        "env": [{"name": "POD_IP",
                                 "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                        "readinessProbe": {"tcpSocket": {"port": 7000}, "periodSeconds": 1},
                    }],
                },
            },
            "volumeClaimTemplates": [{
                "metadata": {"name": "data"},
                "spec": {"accessModes": ["ReadWriteOnce"],
                         "resources": {"requests": {"storage": "1Gi"}}},
            }],
        },
    })
    pods = {n: wait_pod(api, namespace, n, is_ready, 90, f"{n} ready") for n in ("web-0", "web-1")}
    ip0, ip1 = (pods[n]["status"]["podIP"] for n in ("web-0", "web-1"))

    def bound() -> bool:
        claims = core.list_namespaced_persistent_volume_claim(namespace).items
        return len(claims) == 2 and all(c.status.phase == "Bound" for c in claims)

    wait_for(bound, 60, "both claims bound by the PV controller")

    first_id = ask(ip0, "id")
    assert first_id.startswith("web-0:")
    # web-1 resolves its peer's stable name and the service name inside its own namespace.
    wait_for(lambda: ask(ip1, "ask web-0.web") == first_id, 20, "web-1 reaches web-0.web")
    fqdn = f"web-0.web.{namespace}.svc.cluster.local"
    assert ask(ip1, f"ask {fqdn}") == first_id
    # The service name maps to the ready pods it selects, refreshed about once a second.
    wait_for(lambda: ask(ip1, "ask web").split(":")[0] in ("web-0", "web-1"), 20,
             "web-1 resolves the service name")

    # Re-created under the same name, web-0 finds the token it left on its claim.
    old_uid = pods["web-0"]["metadata"]["uid"]
    core.delete_namespaced_pod("web-0", namespace)

    def recreated() -> dict[str, Any] | None:
        p = get_pod(api, namespace, "web-0")
        return p if p and p["metadata"]["uid"] != old_uid and is_ready(p) else None

    new0 = wait_for(recreated, 90, "web-0 re-created and ready")
    assert ask(new0["status"]["podIP"], "id") == first_id
    wait_for(lambda: ask(ip1, "ask web-0.web") == first_id, 20, "web-1 reaches the new web-0")
