"""Harness API features the operator needs: CustomResourceDefinitions via kubectl, and a
mutating admission webhook on 127.0.0.1 (with the harness's webhook cert) that really mutates
a pod which then runs with the mutation."""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.cluster import Cluster
from e2e.testutil import finished, wait_for, wait_pod

pytestmark = pytest.mark.cluster

CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.e2e.kvpool.io
spec:
  group: e2e.kvpool.io
  scope: Namespaced
  names: {kind: Widget, plural: widgets, singular: widget}
  versions:
  - name: v1
    served: true
    storage: true
    subresources: {status: {}}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size: {type: integer, minimum: 1}
"""


def test_crd_apply_use_and_delete(cluster: Cluster, api: client.ApiClient,
                                  namespace: str) -> None:
    cluster.kubectl("apply", "-f", "-", input=CRD)
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=30s",
                    "crd/widgets.e2e.kvpool.io")
    objs: Any = client.CustomObjectsApi(api)

    def create(size: int) -> Any:
        return objs.create_namespaced_custom_object(
            "e2e.kvpool.io", "v1", namespace, "widgets",
            {"apiVersion": "e2e.kvpool.io/v1", "kind": "Widget",
             "metadata": {"name": f"w{size}"}, "spec": {"size": size}})

    # Discovery of a new CRD can lag Established by a moment in the apiserver's handler.
    wait_for(lambda: _created(create, 3), 30, "first widget created")
    with pytest.raises(ApiException) as bad:
        create(0)  # the schema's minimum is enforced by the real apiserver
    assert bad.value.status == 422
    got = json.loads(cluster.kubectl("get", "widgets", "-n", namespace, "-o", "json").stdout)
    assert [i["spec"]["size"] for i in got["items"]] == [3]

    cluster.kubectl("delete", "crd", "widgets.e2e.kvpool.io", "--wait=true", timeout=90)
    ext: Any = client.ApiextensionsV1Api(api)
    with pytest.raises(ApiException) as gone:
        ext.read_custom_resource_definition("widgets.e2e.kvpool.io")
    assert gone.value.status == 404
    with pytest.raises(ApiException) as no_api:
        objs.list_namespaced_custom_object("e2e.kvpool.io", "v1", namespace, "widgets")
    assert no_api.value.status == 404


def _created(create: Any, size: int) -> bool:
    try:
        create(size)
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise


class _Mutator(BaseHTTPRequestHandler):
    """Adds a label and an env var to every pod it is asked about, and remembers the pods."""

    seen: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        req = review["request"]
        pod = req["object"]
        type(self).seen.append(pod["metadata"].get("name") or pod["metadata"].get("generateName"))
        patch: list[dict[str, Any]] = []
        if not pod["metadata"].get("labels"):
            patch.append({"op": "add", "path": "/metadata/labels", "value": {}})
        patch.append({"op": "add", "path": "/metadata/labels/kvpool-e2e~1mutated", "value": "yes"})
        env = {"name": "INJECTED", "value": "from-webhook"}
        if pod["spec"]["containers"][0].get("env"):
            patch.append({"op": "add", "path": "/spec/containers/0/env/-", "value": env})
        else:
            patch.append({"op": "add", "path": "/spec/containers/0/env", "value": [env]})
        body = json.dumps({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "response": {"uid": req["uid"], "allowed": True, "patchType": "JSONPatch",
                         "patch": base64.b64encode(json.dumps(patch).encode()).decode()},
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass


@pytest.fixture
def webhook_server(cluster: Cluster) -> Iterator[int]:
    """A TLS webhook on 127.0.0.1 serving the harness webhook cert; yields its port."""
    assert cluster.pki is not None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cluster.pki.webhook.cert), str(cluster.pki.webhook.key))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Mutator)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_mutating_webhook_mutates_a_running_pod(cluster: Cluster, api: client.ApiClient,
                                                namespace: str, webhook_server: int,
                                                tmp_path: Path) -> None:
    assert cluster.pki is not None
    adm: Any = client.AdmissionregistrationV1Api(api)
    name = f"mutate-{namespace}"
    adm.create_mutating_webhook_configuration({
        "metadata": {"name": name},
        "webhooks": [{
            "name": "mutate.e2e.kvpool.io",
            "clientConfig": {"url": f"https://127.0.0.1:{webhook_server}/mutate",
                             "caBundle": base64.b64encode(
                                 cluster.pki.ca.cert.read_bytes()).decode()},
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                       "resources": ["pods"]}],
            # Only this test's namespace: other tests' pods must not depend on this server.
            "namespaceSelector": {"matchLabels": {"kvpool-e2e/test": namespace}},
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "failurePolicy": "Fail",
            "timeoutSeconds": 5,
        }],
    })
    core: Any = client.CoreV1Api(api)
    tmp_path.chmod(0o777)
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain"},
        "spec": {
            "restartPolicy": "Never",
            "volumes": [{"name": "out", "hostPath": {"path": str(tmp_path)}}],
            "containers": [{"name": "c", "image": "unused",
                            "command": ["sh", "-c", 'printf %s "$INJECTED" > /out/env'],
                            "volumeMounts": [{"name": "out", "mountPath": "/out"}]}],
        },
    }
    try:
        # The apiserver picks up a new webhook configuration asynchronously; dry-run creations
        # (which do call side-effect-free webhooks) tell when it is in force.
        def mutated_dry_run() -> bool:
            created = core.create_namespaced_pod(namespace, pod, dry_run="All")
            return (created.metadata.labels or {}).get("kvpool-e2e/mutated") == "yes"

        wait_for(mutated_dry_run, 30, "webhook in force", interval=0.3)
        created = core.create_namespaced_pod(namespace, pod)
        assert created.metadata.labels["kvpool-e2e/mutated"] == "yes"
        assert "plain" in _Mutator.seen
        done = wait_pod(api, namespace, "plain", finished, 60, "mutated pod finished")
        assert done["status"]["phase"] == "Succeeded"
        # The process saw the variable only the webhook added.
        assert (tmp_path / "env").read_text() == "from-webhook"
    finally:
        adm.delete_mutating_webhook_configuration(name)


def test_helm_installs_and_uninstalls_a_chart(cluster: Cluster, api: client.ApiClient,
                                              namespace: str, tmp_path: Path) -> None:
    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-settings\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n")
    # helm keeps caches and config under $HOME by default; keep this test's to itself.
    env = {"PATH": os.environ.get("PATH", ""), "HELM_CACHE_HOME": str(tmp_path / "cache"),
           "HELM_CONFIG_HOME": str(tmp_path / "config"), "HELM_DATA_HOME": str(tmp_path / "data"),
           "KUBECONFIG": str(cluster.kubeconfig)}

    def helm(*args: str) -> str:
        proc = subprocess.run([str(cluster.binaries.helm), *args, "-n", namespace], env=env,
                              text=True, capture_output=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    helm("install", "demo", str(chart), "--set", "greeting=hi", "--wait", "--timeout", "60s")
    core: Any = client.CoreV1Api(api)
    assert core.read_namespaced_config_map("demo-settings", namespace).data == {"greeting": "hi"}
    assert "demo" in helm("list", "-q")
    helm("uninstall", "demo", "--wait")
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_config_map("demo-settings", namespace)
    assert gone.value.status == 404
