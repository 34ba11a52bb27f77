"""Harness basics without custom resources: pods really run, as a kubelet would run them.

Each test drives the real API server; the pods' processes report what they saw into a hostPath
directory of the test (the only channel that outlives the pod), and the test checks it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.cluster import Cluster
from e2e.testutil import (
    apps,
    core_api,
    finished,
    get_pod,
    is_ready,
    list_pods,
    python_cmd,
    wait_for,
    wait_pod,
)

pytestmark = pytest.mark.cluster

MOUNT = "/run/kvpool-e2e-test"  # a path that does not exist on the host


def report_volume(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    tmp_path.chmod(0o777)
    return ({"name": "report", "hostPath": {"path": str(tmp_path), "type": "Directory"}},
            {"name": "report", "mountPath": "/report"})


def pod_name_env() -> list[dict[str, Any]]:
    return [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # $(VAR) expansion of an earlier variable: each pod reports into its own file.
            {"name": "REPORT", "value": "/report/$(POD_NAME).log"}]


def read_events(path: Path) -> list[tuple[str, float]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        word, ts = line.split()
        out.append((word, float(ts)))
    return out


DEPLOYMENT_PROGRAM = f"""
    import os, signal, time, pathlib
    report = pathlib.Path(os.environ["REPORT"])
    def note(word):
        with report.open("a") as f:
            f.write(f"{{word}} {{time.time()}}\\n")
    # Ignore SIGTERM after noting it: only the SIGKILL at the end of the grace period ends us.
    signal.signal(signal.SIGTERM, lambda *_: note("sigterm"))
    note("start")
    time.sleep(1.5)  # long enough for the test to see the pod running but not ready
    pathlib.Path("{MOUNT}/data/ready").write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)
"""


def test_deployment_pod_emptydir_readiness_and_grace(cluster: Cluster, api: client.ApiClient,
                                                     namespace: str, tmp_path: Path) -> None:
    vol, mount = report_volume(tmp_path)
    grace = 3
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "writer"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "writer"}},
            "template": {
                "metadata": {"labels": {"app": "writer"}},
                "spec": {
                    "terminationGracePeriodSeconds": grace,
                    "volumes": [vol, {"name": "data", "emptyDir": {}}],
                    "containers": [{
                        "name": "writer", "image": "unused",
                        "command": python_cmd(DEPLOYMENT_PROGRAM),
                        "env": pod_name_env(),
                        "volumeMounts": [mount, {"name": "data", "mountPath": f"{MOUNT}/data"}],
                        "readinessProbe": {"exec": {"command": ["test", "-f", f"{MOUNT}/data/ready"]},
                                           "periodSeconds": 1, "failureThreshold": 1},
                    }],
                },
            },
        },
    }
    apps(api).create_namespaced_deployment(namespace, deployment)

    # The ReplicaSet controller (kube-controller-manager) creates the pod; the agent runs it.
    first = wait_for(lambda: list_pods(api, namespace, "app=writer"), 60, "the deployment's pod")[0]
    name, uid = first["metadata"]["name"], first["metadata"]["uid"]
    seen_running_unready = False
    deadline = time.monotonic() + 60
    while True:
        pod = get_pod(api, namespace, name)
        assert pod is not None
        state = pod["status"].get("containerStatuses", [{}])[0].get("state", {})
        if "running" in state and not is_ready(pod):
            seen_running_unready = True
        if is_ready(pod):
            break
        assert time.monotonic() < deadline, f"pod never became ready: {pod['status']}"
        time.sleep(0.1)
    assert seen_running_unready, "readiness never was False while the container ran"

    # The file the process wrote at /run/... inside its namespace is in the pod's emptyDir
    # directory on the host, and not at that path on the host.
    ready_file = cluster.pod_dir(namespace, name, uid) / "volumes" / "data" / "ready"
    pid = int(ready_file.read_text())
    assert not Path(f"{MOUNT}/data/ready").exists()
    os.kill(pid, 0)  # the container process is alive

    t_delete = time.monotonic()
    core_api(api).delete_namespaced_pod(name, namespace)
    wait_for(lambda: get_pod(api, namespace, name) is None, grace + 30, "pod object deleted",
             interval=0.05)
    gone_at, elapsed = time.time(), time.monotonic() - t_delete
    events = read_events(tmp_path / f"{name}.log")
    assert [w for w, _ in events] == ["start", "sigterm"], events
    # It ignored SIGTERM, so only the SIGKILL at the end of the grace period ended it: the
    # object went away no sooner than `grace` after the signal (and not much later on an
    # idle machine; the upper bound leaves room for a loaded one).
    sigterm_at = events[1][1]
    assert gone_at - sigterm_at >= grace - 0.3, (gone_at - sigterm_at)
    assert elapsed <= grace + 15, elapsed
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

    # The Deployment replaces the pod, and the new one runs and becomes ready too.
    def replacement() -> dict[str, Any] | None:
        pods = [p for p in list_pods(api, namespace, "app=writer") if p["metadata"]["uid"] != uid]
        return pods[0] if pods and is_ready(pods[0]) else None

    wait_for(replacement, 60, "a ready replacement pod")


SIDECAR_PROGRAM = """
    import os, signal, socket, sys, time
    def note(word):
        with open(os.environ["REPORT"], "a") as f:
            f.write(f"{word} {time.time()}\\n")
    note("sidecar-start")
    srv = socket.create_server((os.environ["POD_IP"], 9000))
    srv.settimeout(0.1)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    while not stopping:
        try:
            conn, _ = srv.accept()
            conn.close()
        except (socket.timeout, InterruptedError):
            pass
    note("sidecar-term")
    time.sleep(0.3)
    note("sidecar-exit")
"""

MAIN_PROGRAM = """
    import os, signal, socket, sys, time
    def note(word):
        with open(os.environ["REPORT"], "a") as f:
            f.write(f"{word} {time.time()}\\n")
    def sidecar_up():
        try:
            socket.create_connection((os.environ["POD_IP"], 9000), timeout=1).close()
            return True
        except OSError:
            return False
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    note("main-start" if sidecar_up() else "main-start-without-sidecar")
    while not stopping:
        time.sleep(0.05)
    note("main-term")
    time.sleep(0.5)
    # Still serving while the main container drains: the sidecar must stop only after us.
    note("main-sees-sidecar" if sidecar_up() else "main-lost-sidecar")
    note("main-exit")
"""


def test_native_sidecar_starts_first_and_stops_last(cluster: Cluster, api: client.ApiClient,
                                                    namespace: str, tmp_path: Path) -> None:
    vol, mount = report_volume(tmp_path)
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "with-sidecar"},
        "spec": {
            "terminationGracePeriodSeconds": 15,
            "volumes": [vol],
            "initContainers": [{
                "name": "proxy", "image": "unused", "restartPolicy": "Always",
                "command": python_cmd(SIDECAR_PROGRAM), "env": pod_name_env(),
                "volumeMounts": [mount],
                "startupProbe": {"tcpSocket": {"port": 9000}, "periodSeconds": 1,
                                 "failureThreshold": 30},
            }],
            "containers": [{
                "name": "engine", "image": "unused",
                "command": python_cmd(MAIN_PROGRAM), "env": pod_name_env(),
                "volumeMounts": [mount],
            }],
        },
    }
    core: Any = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, pod)
    wait_for(lambda: is_ready(get_pod(api, namespace, "with-sidecar")), 60, "pod ready")
    live = get_pod(api, namespace, "with-sidecar")
    assert live is not None
    (sidecar_status,) = live["status"]["initContainerStatuses"]
    assert sidecar_status["started"] and "running" in sidecar_status["state"]

    # Ready means running here (no readiness probe); wait until the program has installed its
    # SIGTERM handler, else the deletion below would race the interpreter's start-up.
    wait_for(lambda: "main-start" in [w for w, _ in read_events(tmp_path / "with-sidecar.log")],
             30, "main container started")
    core.delete_namespaced_pod("with-sidecar", namespace)
    wait_for(lambda: get_pod(api, namespace, "with-sidecar") is None, 30, "pod deleted")
    events = read_events(tmp_path / "with-sidecar.log")
    assert [w for w, _ in events] == [
        "sidecar-start", "main-start", "main-term", "main-sees-sidecar", "main-exit",
        "sidecar-term", "sidecar-exit",
    ]
    assert [t for _, t in events] == sorted(t for _, t in events)


ECHO_PROGRAM = """
    import os, socket
    srv = socket.create_server((os.environ["POD_IP"], 7000))
    while True:
        conn, _ = srv.accept()
        with conn:
            conn.sendall(b"echo:" + conn.recv(100))
"""


def test_pod_ip_is_reachable_by_tcp(cluster: Cluster, api: client.ApiClient,
                                    namespace: str) -> None:
    core: Any = client.CoreV1Api(api)
    for name in ("echo-a", "echo-b"):
        core.create_namespaced_pod(namespace, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{
                "name": "echo", "image": "unused", "command": python_cmd(ECHO_PROGRAM),
                "env": pod_name_env(), "ports": [{"name": "echo", "containerPort": 7000}],
                "readinessProbe": {"tcpSocket": {"port": "echo"}, "periodSeconds": 1},
            }]},
        })
    ips = []
    for name in ("echo-a", "echo-b"):
        pod = wait_pod(api, namespace, name, is_ready, 60, f"{name} ready")
        ip = pod["status"]["podIP"]
        assert ipaddress.ip_address(ip) in ipaddress.ip_network("127.0.0.0/8")
        assert ip != "127.0.0.1" and ip == pod["status"]["podIPs"][0]["ip"]
        with socket.create_connection((ip, 7000), timeout=5) as conn:
            conn.sendall(name.encode())
            assert conn.recv(100) == b"echo:" + name.encode()
        ips.append(ip)
    assert ips[0] != ips[1]


REPORT_PROGRAM = """
    import json, os, sys
    from kubernetes import client, config
    config.load_incluster_config()  # token, CA and host from the pod's service-account mount
    review = client.AuthenticationV1Api().create_self_subject_review(
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    mountinfo = open("/proc/self/mountinfo").read().splitlines()
    def fstype(path):
        for line in mountinfo:
            pre, _, post = line.partition(" - ")
            if pre.split()[4] == path:
                return post.split()[0]
        return None
    out = {
        "argv": sys.argv[1:], "cwd": os.getcwd(),
        "env": {k: os.environ.get(k) for k in
                ["NAME", "NS", "IP", "GREETING", "TOKEN", "COMBINED", "ESCAPED", "FROMCM_greeting"]},
        "secret": open("/var/run/secrets/kvpool/token").read(),
        "configmap": open("/etc/kvpool-e2e/file.txt").read(),
        "shm_fstype": fstype("/run/kvpool"),
        "hostname": os.uname().nodename,
        "whoami": review.status.user_info.username,
    }
    with open(os.environ["REPORT"], "w") as f:
        json.dump(out, f)
"""


def test_env_volumes_and_in_cluster_access(cluster: Cluster, api: client.ApiClient,
                                           namespace: str, tmp_path: Path) -> None:
    core: Any = client.CoreV1Api(api)
    core.create_namespaced_config_map(namespace, {
        "metadata": {"name": "settings"}, "data": {"greeting": "hello", "file.txt": "cm-file"}})
    core.create_namespaced_secret(namespace, {
        "metadata": {"name": "creds"}, "stringData": {"token": "s3cret"}})
    vol, mount = report_volume(tmp_path)
    env = pod_name_env() + [
        {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "settings",
                                                               "key": "greeting"}}},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "COMBINED", "value": "$(GREETING)-$(NAME)"},
        {"name": "ESCAPED", "value": "$$(GREETING)"},
    ]
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "reporter"},
        "spec": {
            "restartPolicy": "Never",
            "volumes": [vol,
                        {"name": "creds", "secret": {"secretName": "creds"}},
                        {"name": "settings", "configMap": {"name": "settings"}},
                        {"name": "shm", "emptyDir": {"medium": "Memory"}}],
            "containers": [{
                "name": "report", "image": "unused",
                "command": python_cmd(REPORT_PROGRAM), "args": ["$(GREETING)", "plain"],
                "env": env,
                "envFrom": [{"prefix": "FROMCM_", "configMapRef": {"name": "settings"}}],
                "workingDir": f"{MOUNT}/work",
                "volumeMounts": [mount,
                                 {"name": "creds", "mountPath": "/var/run/secrets/kvpool",
                                  "readOnly": True},
                                 {"name": "settings", "mountPath": "/etc/kvpool-e2e"},
                                 {"name": "shm", "mountPath": "/run/kvpool"}],
            }],
        },
    })
    pod = wait_pod(api, namespace, "reporter", finished, 60, "pod done")
    assert pod["status"]["phase"] == "Succeeded", cluster.logs().rsplit("===== pod", 1)[-1]
    term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 0
    out = json.loads((tmp_path / "reporter.log").read_text())
    ip = pod["status"]["podIP"]
    assert out["argv"] == ["hello", "plain"]
    assert out["cwd"] == f"{MOUNT}/work"
    assert out["env"] == {"NAME": "reporter", "NS": namespace, "IP": ip, "GREETING": "hello",
                          "TOKEN": "s3cret", "COMBINED": "hello-reporter",
                          "ESCAPED": "$(GREETING)", "FROMCM_greeting": "hello"}
    assert out["secret"] == "s3cret" and out["configmap"] == "cm-file"
    assert out["shm_fstype"] == "tmpfs"
    assert out["hostname"] == "reporter"
    assert out["whoami"] == f"system:serviceaccount:{namespace}:default"


def test_init_container_and_liveness_restart(cluster: Cluster, api: client.ApiClient,
                                             namespace: str) -> None:
    core: Any = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "restarts"},
        "spec": {
            "volumes": [{"name": "work", "emptyDir": {}}],
            "initContainers": [{"name": "seed", "image": "unused",
                                "command": ["sh", "-c", f"echo seeded > {MOUNT}/seed"],
                                "volumeMounts": [{"name": "work", "mountPath": MOUNT}]}],
            "containers": [{
                "name": "main", "image": "unused",
                # Needs the init container's file; removes its liveness file after a moment,
                # so the liveness probe fails and the container is restarted.
                "command": ["sh", "-c", f"test -f {MOUNT}/seed || exit 7; touch {MOUNT}/alive;"
                            f" sleep 1; rm -f {MOUNT}/alive; exec sleep 600"],
                "volumeMounts": [{"name": "work", "mountPath": MOUNT}],
                "livenessProbe": {"exec": {"command": ["test", "-f", f"{MOUNT}/alive"]},
                                  "periodSeconds": 1, "failureThreshold": 2},
            }],
            "terminationGracePeriodSeconds": 1,
        },
    })

    def restarted() -> dict[str, Any] | None:
        p = get_pod(api, namespace, "restarts")
        if not p or not p["status"].get("containerStatuses"):
            return None
        st = p["status"]["containerStatuses"][0]
        return p if st["restartCount"] >= 1 else None

    pod = wait_for(restarted, 60, "a liveness restart")
    init = pod["status"]["initContainerStatuses"][0]
    assert init["state"]["terminated"]["exitCode"] == 0
    main = pod["status"]["containerStatuses"][0]
    # Killed by the kubelet (SIGTERM from the liveness failure), not exit 7: the seed was there.
    assert main["lastState"]["terminated"]["exitCode"] == 143
    assert condition_true(pod, "Initialized")


def condition_true(pod: dict[str, Any], ctype: str) -> bool:
    return any(c["type"] == ctype and c["status"] == "True" for c in pod["status"]["conditions"])


def test_configmap_volume_follows_updates(cluster: Cluster, api: client.ApiClient,
                                          namespace: str, tmp_path: Path) -> None:
    core: Any = client.CoreV1Api(api)
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "live"},
                                                  "data": {"value": "one"}})
    vol, mount = report_volume(tmp_path)
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "follower"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "volumes": [vol, {"name": "cfg", "configMap": {"name": "live"}}],
            "containers": [{
                "name": "c", "image": "unused",
                "command": ["sh", "-c", "while true; do cp /etc/live/value /report/seen; "
                            "sleep 0.2; done"],
                "volumeMounts": [mount, {"name": "cfg", "mountPath": "/etc/live"}],
            }],
        },
    })
    seen = tmp_path / "seen"
    wait_for(lambda: seen.exists() and seen.read_text() == "one", 60, "first value seen")
    core.patch_namespaced_config_map("live", namespace, {"data": {"value": "two"}})
    # The same mounted directory, new content: a process reading it sees the update.
    wait_for(lambda: seen.read_text() == "two", 30, "updated value seen in the pod")


def test_kubectl_logs_reach_the_container_output(cluster: Cluster, api: client.ApiClient,
                                                 namespace: str) -> None:
    core: Any = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "talker"},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
            "name": "c", "image": "unused",
            "command": ["sh", "-c", "echo line-one; echo line-two >&2; exec sleep 600"]}]},
    })
    wait_pod(api, namespace, "talker", is_ready, 60, "talker running")
    # apiserver -> node agent's kubelet API (TLS both ways) -> the container's log file.
    wait_for(lambda: "line-two" in cluster.kubectl("logs", "-n", namespace, "talker").stdout,
             20, "kubectl logs shows stderr too")
    out = cluster.kubectl("logs", "-n", namespace, "talker", "--tail=1").stdout
    assert out.strip() == "line-two"
    assert "line-one" in core.read_namespaced_pod_log("talker", namespace, container="c")


def test_sidecar_that_crashes_at_start_is_restarted_before_main(cluster: Cluster,
                                                                 api: client.ApiClient,
                                                                 namespace: str) -> None:
    core: Any = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "flaky-sidecar"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "volumes": [{"name": "w", "emptyDir": {}}],
            "initContainers": [{
                "name": "side", "image": "unused", "restartPolicy": "Always",
                # Fails its first start, works on the second.
                "command": ["sh", "-c", f"if [ ! -f {MOUNT}/once ]; then touch {MOUNT}/once;"
                            f" exit 1; fi; touch {MOUNT}/side-up; exec sleep 600"],
                "volumeMounts": [{"name": "w", "mountPath": MOUNT}],
                "startupProbe": {"exec": {"command": ["test", "-f", f"{MOUNT}/side-up"]},
                                 "periodSeconds": 1, "failureThreshold": 30},
            }],
            "containers": [{
                "name": "main", "image": "unused",
                # Exits 3 (and so never gets ready) if it was started before the sidecar was up.
                "command": ["sh", "-c", f"test -f {MOUNT}/side-up || exit 3; exec sleep 600"],
                "volumeMounts": [{"name": "w", "mountPath": MOUNT}],
            }],
        },
    })
    pod = wait_pod(api, namespace, "flaky-sidecar", is_ready, 60, "pod ready")
    side = pod["status"]["initContainerStatuses"][0]
    main = pod["status"]["containerStatuses"][0]
    assert side["restartCount"] == 1 and side["lastState"]["terminated"]["exitCode"] == 1
    assert main["restartCount"] == 0 and "running" in main["state"]
