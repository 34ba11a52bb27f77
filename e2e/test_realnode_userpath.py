"""The user's path on the real node (issue 24, part 3): `helm install` of charts/kvpool with the
locally built image, `kubectl apply -f examples/minimal.yaml`, the pool Ready with its store pod
in a container, an engine pod that gets the sidecar injected (a native sidecar under the real
kubelet) and reads and writes through it, byte-exact, to the store over the pod network, fast
deletion, the intended uid/gid in every kvpool container, and `helm uninstall` leaving nothing.

Everything is the chart's defaults (webhook through its Service, the chart's own certificate),
except the image (the local one, never pulled) and a faster reconcile interval.

The rest of the path (a scale-down draining the hottest objects first, autoscaling, the engine
pod's flush of its local state at deletion) is test_realnode_chart.py.

The tests share one release and run in order.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e.realnode import RealNodeCluster
from e2e.testutil import wait_for

pytestmark = pytest.mark.realnode

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "kvpool"
KVPOOL_UID_GID = "uid=65532(kvpool) gid=65532(kvpool)"  # the Dockerfile's user, and the chart's

# The engine's client: 32 objects of 64 KiB whose bytes derive from their keys, written with
# wait=True (each code is the pool's verdict: the store node took it) and read back; `read`
# only reads (a fresh pod: its local tier is empty, so every byte comes from the store pod).
ENGINE = textwrap.dedent("""
    import hashlib, os, sys, time
    from kvpool.client.client import connect
    keys = [hashlib.sha256(b"userpath-%d" % i).digest() for i in range(32)]
    values = [hashlib.sha256(k).digest() * 2048 for k in keys]
    deadline = time.monotonic() + 60
    while True:
        try:
            client = connect(os.environ["KVPOOL_ADDRESS"],
                             block_tokens=int(os.environ["KVPOOL_BLOCK_TOKENS"]))
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    with client:
        if sys.argv[1] == "write":
            print("put codes", sorted(set(client.put(keys, values, wait=True))), flush=True)
        with client.get(keys) as blocks:
            same = all(bytes(b) == v for b, v in zip(blocks, values))
        print("read", len(keys), "byte-exact", same, flush=True)
    sys.exit(0 if same else 1)
""")
IDLE = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(1)
""")


@dataclass
class Release:
    cluster: RealNodeCluster
    name: str
    namespace: str
    apps: str
    home: Path

    def helm(self, *args: str, timeout: float = 300) -> str:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.home),
               "KUBECONFIG": str(self.cluster.kubeconfig)}
        proc = subprocess.run([str(self.cluster.binaries.helm), *args, "-n", self.namespace],
                              env=env, text=True, capture_output=True, timeout=timeout)
        assert proc.returncode == 0, f"helm {' '.join(args)}: {proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 120) -> str:
        proc = self.cluster.kubectl(*args, input=input, check=False, timeout=timeout)
        assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def get(self, *args: str) -> Any:
        proc = self.cluster.kubectl("get", *args, "-o", "json", check=False)
        if proc.returncode != 0:
            assert "NotFound" in proc.stderr, proc.stderr
            return None
        return json.loads(proc.stdout)

    def engine_pod(self, name: str, command: list[str], restart: str = "Never") -> None:
        self.kubectl("apply", "-n", self.apps, "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"kvpool.io/pool": "minimal"}},
            "spec": {"restartPolicy": restart, "containers": [{
                "name": "engine", "image": self.cluster.image, "imagePullPolicy": "Never",
                "command": command}]}}))

    def wait_phase(self, name: str, phases: tuple[str, ...], timeout: float = 120) -> Any:
        def check() -> Any:
            pod = self.get("pod", name, "-n", self.apps)
            return pod if pod and pod["status"].get("phase") in phases else None

        return wait_for(check, timeout, f"pod {name} in {phases}", interval=0.5)


@pytest.fixture(scope="module")
def release(cluster: RealNodeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    tag = uuid.uuid4().hex[:6]
    rel = Release(cluster, "kvpool", f"kvpool-system-{tag}", f"apps-{tag}",
                  tmp_path_factory.mktemp("helm"))
    for ns in (rel.namespace, rel.apps):
        rel.kubectl("create", "namespace", ns)
        wait_for(lambda ns=ns: rel.get("serviceaccount", "default", "-n", ns), 30,  # type: ignore[misc]
                 f"the default ServiceAccount in {ns}")
    try:
        yield rel
    finally:
        cluster.kubectl("delete", "kvpools.kvpool.io", "--all", "-n", rel.apps, "--wait=true",
                        "--timeout=60s", check=False, timeout=90)
        subprocess.run([str(cluster.binaries.helm), "uninstall", rel.name, "-n", rel.namespace],
                       env={"HOME": str(rel.home), "KUBECONFIG": str(cluster.kubeconfig)},
                       capture_output=True, timeout=120)
        for ns in (rel.apps, rel.namespace):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_1_helm_install_runs_the_operator_from_the_local_image(release: Release) -> None:
    rel = release
    repo, tag = rel.cluster.image.rsplit(":", 1)
    rel.helm("install", rel.name, str(CHART), "--wait", "--timeout", "240s",
             "--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
             "--set", "image.pullPolicy=Never", "--set", "operator.reconcileIntervalSeconds=2")
    pods = rel.get("pods", "-n", rel.namespace, "-l", f"app.kubernetes.io/instance={rel.name}")
    assert len(pods["items"]) == 1
    status = pods["items"][0]["status"]["containerStatuses"][0]
    assert status["ready"] and status["containerID"].startswith("containerd://")
    assert status["image"].endswith(rel.cluster.image.split("/", 1)[1])
    ident = rel.kubectl("exec", "-n", rel.namespace, pods["items"][0]["metadata"]["name"], "--", "id")
    assert ident.startswith(KVPOOL_UID_GID), ident


def test_2_minimal_pool_is_ready_with_its_store_pod_in_a_container(release: Release) -> None:
    rel = release
    rel.kubectl("apply", "-n", rel.apps, "-f", str(ROOT / "examples" / "minimal.yaml"))

    def ready() -> bool:
        pool = rel.get("kvpools.kvpool.io", "minimal", "-n", rel.apps) or {}
        conds = (pool.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    wait_for(ready, 180, "KVPool minimal Ready", interval=1)
    store = rel.get("pod", "minimal-store-0", "-n", rel.apps)
    status = store["status"]["containerStatuses"][0]
    assert status["ready"] and status["containerID"].startswith("containerd://")
    ident = rel.kubectl("exec", "-n", rel.apps, "minimal-store-0", "--", "id")
    assert ident.startswith(KVPOOL_UID_GID), ident


def test_3_engine_writes_and_reads_byte_exact_through_its_native_sidecar(release: Release) -> None:
    rel = release
    rel.engine_pod("writer", ["python", "-u", "-c", ENGINE, "write"])
    pod = rel.wait_phase("writer", ("Succeeded", "Failed"))
    sidecars = [c for c in pod["spec"].get("initContainers", []) if c.get("restartPolicy") == "Always"]
    assert [c["name"] for c in sidecars] == ["kvpool-sidecar"], pod["spec"]
    assert "kvpool-shm" in [v["name"] for v in pod["spec"]["volumes"]]
    log = rel.kubectl("logs", "-n", rel.apps, "writer", "-c", "engine")
    assert pod["status"]["phase"] == "Succeeded", log
    assert "put codes [0]" in log and "byte-exact True" in log, log  # 0: OK, the pool's verdict
    # A fresh pod, an empty local tier: the bytes come from the store pod over the pod network.
    rel.engine_pod("reader", ["python", "-u", "-c", ENGINE, "read"])
    pod = rel.wait_phase("reader", ("Succeeded", "Failed"))
    log = rel.kubectl("logs", "-n", rel.apps, "reader", "-c", "engine")
    assert pod["status"]["phase"] == "Succeeded" and "read 32 byte-exact True" in log, log


def test_4_engine_pod_with_nothing_to_drain_goes_in_under_5s(release: Release) -> None:
    rel = release
    rel.engine_pod("idle", ["python", "-u", "-c", IDLE], restart="Always")
    rel.kubectl("wait", "-n", rel.apps, "pod/idle", "--for=condition=Ready", "--timeout=120s",
                timeout=150)
    for container in ("kvpool-sidecar", "engine"):
        ident = rel.kubectl("exec", "-n", rel.apps, "idle", "-c", container, "--", "id")
        assert ident.startswith(KVPOOL_UID_GID), (container, ident)
    start = time.monotonic()
    rel.kubectl("delete", "-n", rel.apps, "pod", "idle", "--wait=false")
    wait_for(lambda: rel.get("pod", "idle", "-n", rel.apps) is None, 60, "pod idle gone",
             interval=0.2)
    took = time.monotonic() - start
    assert took < 5, f"the engine pod took {took:.1f}s to go (grace period 30s)"


def test_5_uninstall_leaves_nothing(release: Release) -> None:
    rel = release
    # The engine pods only: a store pod deleted here is made again by its StatefulSet, and one
    # deleted while its Python starts ignores the SIGTERM that arrives before the handler is
    # installed (PID 1: no default action), so the kubelet waits out its 90 s grace period.
    rel.kubectl("delete", "pod", "-l", "kvpool.io/pool", "-n", rel.apps, "--wait=true",
                "--timeout=60s", timeout=90)
    rel.kubectl("delete", "kvpools.kvpool.io", "--all", "-n", rel.apps, "--wait=true",
                "--timeout=90s", timeout=120)
    wait_for(lambda: not rel.get("pods", "-n", rel.apps)["items"], 90, "the store pods gone",
             interval=0.5)
    rel.helm("uninstall", rel.name, "--wait", "--timeout", "120s")
    # `--wait` waits for the Deployment object; its pod goes after (garbage collection, then the
    # operator's SIGTERM handling): within a few seconds, well inside its grace period.
    start = time.monotonic()
    wait_for(lambda: not rel.get("pods", "-n", rel.namespace)["items"], 30,
             "the operator pod gone", interval=0.2)
    assert time.monotonic() - start < 10
    selector = f"app.kubernetes.io/instance={rel.name}"
    left = rel.get("all,secrets,configmaps,serviceaccounts,roles,rolebindings", "-n",
                   rel.namespace, "-l", selector)
    assert left["items"] == [], [i["metadata"]["name"] for i in left["items"]]
    cluster_wide = rel.get("clusterroles,clusterrolebindings,mutatingwebhookconfigurations", "-l",
                           selector)
    assert cluster_wide["items"] == [], [i["metadata"]["name"] for i in cluster_wide["items"]]
    assert not rel.get("all", "-n", rel.apps)["items"]
