"""The real-node tier's own tests: a kubelet with containerd runs kvpool's image, and what a
node agent cannot show holds: the pod network, cluster DNS, ClusterIP Services through
kube-proxy, in-cluster API access, signals to PID 1, the user and group of a container."""

from __future__ import annotations

import textwrap
import time
from typing import Any

import pytest
from kubernetes import client

from e2e.realnode import RealNodeCluster
from e2e.testutil import core_api, finished, get_pod, is_ready, wait_for, wait_pod

pytestmark = pytest.mark.realnode

POD_TIMEOUT = 120  # first pod of a session: sandbox + container creation under load


def pod(cluster: RealNodeCluster, name: str, source: str, *, labels: dict[str, str] | None = None,
        restart: str = "Never", security: dict[str, Any] | None = None,
        grace: int = 30, ports: list[int] | None = None) -> dict[str, Any]:
    """A pod running ``source`` with the image's Python."""
    container: dict[str, Any] = {
        "name": "main", "image": cluster.image, "imagePullPolicy": "Never",
        "command": ["python", "-u", "-c", textwrap.dedent(source)],
        "ports": [{"containerPort": p} for p in ports or []],
    }
    if security:
        container["securityContext"] = security
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": grace,
                 "containers": [container]},
    }


def run_to_end(api: Any, ns: str, manifest: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Create the pod, wait until it finished; its final object and its log (through the API:
    apiserver -> kubelet)."""
    core = core_api(api)
    core.create_namespaced_pod(ns, manifest)
    name = manifest["metadata"]["name"]
    done = wait_pod(api, ns, name, finished, POD_TIMEOUT, f"pod {name} to finish")
    return done, core.read_namespaced_pod_log(name, ns)


SERVER = """
    import http.server, socket
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = ("hello from " + socket.gethostname()).encode()
            self.send_response(200); self.end_headers(); self.wfile.write(body)
    http.server.HTTPServer(("", 8080), H).serve_forever()
"""


def start_server(api: Any, cluster: RealNodeCluster, ns: str, name: str = "web") -> dict[str, Any]:
    manifest = pod(cluster, name, SERVER, labels={"app": name}, restart="Always", ports=[8080],
                   grace=1)
    manifest["spec"]["containers"][0]["readinessProbe"] = {
        "tcpSocket": {"port": 8080}, "periodSeconds": 1}
    core_api(api).create_namespaced_pod(ns, manifest)
    return wait_pod(api, ns, name, is_ready, POD_TIMEOUT, f"pod {name} ready")


def fetch(url: str) -> str:
    """Pod source that prints the body at ``url``."""
    return f"""
        import urllib.request
        print(urllib.request.urlopen({url!r}, timeout=10).read().decode())
    """


def test_node_is_ready_with_containerd(cluster: RealNodeCluster, api: Any) -> None:
    node = core_api(api).read_node("kvpool-e2e")
    ready = [c for c in node.status.conditions if c.type == "Ready"]
    assert ready and ready[0].status == "True", node.status.conditions
    info = node.status.node_info
    assert info.kubelet_version == "v1.37.2"
    assert info.container_runtime_version.startswith("containerd://1.6"), info
    assert [a.address for a in node.status.addresses if a.type == "InternalIP"] == ["10.250.0.1"]


def test_pod_runs_the_image_and_reports_exit_code_and_logs(cluster: RealNodeCluster, api: Any,
                                                          namespace: str) -> None:
    done, log = run_to_end(api, namespace, pod(cluster, "exits", """
        import sys, kvpool
        print("kvpool imported from", kvpool.__file__)
        sys.exit(3)
    """))
    assert done["status"]["phase"] == "Failed"
    state = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert state["exitCode"] == 3
    assert state["reason"] == "Error"
    assert "kvpool imported from /opt/kvpool/" in log, log
    assert done["status"]["containerStatuses"][0]["image"].endswith(cluster.image.split("/")[-1])


def test_pod_ip_reaches_another_pod(cluster: RealNodeCluster, api: Any, namespace: str) -> None:
    server = start_server(api, cluster, namespace)
    ip = server["status"]["podIP"]
    assert ip.startswith("10.244.0."), ip
    done, log = run_to_end(api, namespace, pod(cluster, "client", fetch(f"http://{ip}:8080/")))
    assert done["status"]["phase"] == "Succeeded", log
    assert "hello from web" in log


def test_service_name_resolves_and_cluster_ip_reaches_the_pod(cluster: RealNodeCluster, api: Any,
                                                              namespace: str) -> None:
    start_server(api, cluster, namespace)
    svc = core_api(api).create_namespaced_service(namespace, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}})
    cluster_ip = svc.spec.cluster_ip
    # The short name goes through the pod's search path (kubelet's resolv.conf) to CoreDNS;
    # the body comes through kube-proxy's DNAT from port 80 to the pod's 8080.
    # Until kube-proxy has programmed the new Service's endpoint (its sync follows the
    # EndpointSlice controller, seconds under load) the ClusterIP is REJECTed: retry.
    done, log = run_to_end(api, namespace, pod(cluster, "client", """
        import socket, time, urllib.request
        print("resolved", socket.gethostbyname("web"),
              socket.gethostbyname("web.%s.svc.cluster.local" % open(
                  "/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()))
        deadline = time.monotonic() + 60
        while True:
            try:
                print(urllib.request.urlopen("http://web/", timeout=10).read().decode())
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise
                print("retrying:", exc, flush=True)
                time.sleep(0.5)
    """))
    assert done["status"]["phase"] == "Succeeded", log
    assert f"resolved {cluster_ip} {cluster_ip}" in log
    assert "hello from web" in log


def test_in_cluster_config_reaches_the_apiserver(cluster: RealNodeCluster, api: Any,
                                                 namespace: str) -> None:
    """What the operator pod does: the `kubernetes` Service (10.96.0.1, kube-proxy to the
    apiserver on the node IP), the service-account token, the cluster CA."""
    rbac: Any = client.RbacAuthorizationV1Api(api)
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "view"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "view"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}]})
    done, log = run_to_end(api, namespace, pod(cluster, "incluster", """
        import os
        from kubernetes import client, config
        config.load_incluster_config()
        print("host", os.environ["KUBERNETES_SERVICE_HOST"])
        ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
        names = [p.metadata.name for p in client.CoreV1Api().list_namespaced_pod(ns).items]
        print("pods", names)
    """))
    assert done["status"]["phase"] == "Succeeded", log
    assert "host 10.96.0.1" in log
    assert "'incluster'" in log


def test_pod_whose_process_handles_sigterm_is_deleted_fast(cluster: RealNodeCluster, api: Any,
                                                          namespace: str) -> None:
    core_api(api).create_namespaced_pod(namespace, pod(cluster, "term", """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        print("up", flush=True)
        while True:
            time.sleep(1)
    """, restart="Always"))
    wait_pod(api, namespace, "term", lambda p: p["status"].get("phase") == "Running",
             POD_TIMEOUT, "pod term running")
    start = time.monotonic()
    core_api(api).delete_namespaced_pod("term", namespace)
    wait_for(lambda: get_pod(api, namespace, "term") is None, 30, "pod term gone")
    took = time.monotonic() - start
    assert took < 5, f"deletion took {took:.1f}s with a grace period of 30s"


def test_run_as_user_and_group_show_in_id(cluster: RealNodeCluster, api: Any, namespace: str) -> None:
    manifest = pod(cluster, "ids", "", security={"runAsUser": 1234, "runAsGroup": 2345})
    manifest["spec"]["containers"][0]["command"] = ["id"]
    done, log = run_to_end(api, namespace, manifest)
    assert done["status"]["phase"] == "Succeeded", log
    assert log.startswith("uid=1234 gid=2345"), log
