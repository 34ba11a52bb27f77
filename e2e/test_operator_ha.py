"""The operator is highly available (issue 19): the chart's `replicaCount: 2` on the harness
cluster, the active replica SIGKILLed in the middle of a scale-down drain.

`helm install` of charts/kvpool with two replicas. On the harness every pod shares the host's
network namespace, so the replicas listen on their own pod IPs (`listenAddress=$(POD_IP)`), and
a small TCP fan-out on 127.0.0.1 stands in for the webhook Service (the harness has no
kube-proxy): the API server's admission calls reach either replica.

What is shown:
* both replicas run (pods Running and Ready), kopf's ClusterKopfPeering lists both, exactly one
  is active (the other logged that it pauses in favour of it), and both serve the injection
  webhook correctly (a standby used to answer from kopf indexes that only the active one fills);
* a KVPool with data on both store nodes scales 2 -> 1; once the drain is running, the active
  replica's process is SIGKILLed and kept dead (as on a lost node). The standby takes over within
  the peering lifetime (15 s) plus a stated margin, and finishes the drain from `status.drain`;
* throughout, a data path outside the operator (two sidecars on this host over the store pods,
  as an engine's) keeps reading the data written before the drain and writing and reading back
  new objects, also while no operator runs at all: every failure and every wrong byte is counted;
* the killed replica, back, stands by: no second handover.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import random
import socket
import ssl
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

from e2e.cluster import Cluster, free_port
from e2e.test_e2e_chart import CHART, Release, cond, create_namespace, kvpool_doc, kvtier, sts_replicas
from e2e.test_operator_pool import CrashLoop
from e2e.testutil import list_pods, pool_client_tls, wait_for
from kvpool_operator.kube import Kube

pytestmark = pytest.mark.cluster

PEERING_LIFETIME = 15  # the operator's --peering-lifetime default (operator/kvpool_operator/main.py)
TAKEOVER_MARGIN = 8.0
"""Beyond the lifetime: the standby wakes at the dead record's deadline, patches its own record
and acts on the watch event of that patch; on this loaded 2-core machine that round trip and the
event loop's latency take seconds, not milliseconds."""
VALUE_BYTES = 64 << 10
PRELOAD = 768  # 48 MiB over two store nodes: ~24 MiB to drain at 1 MiB/s
LOG_RESUMED = "Resuming operations after the pause"
LOG_PAUSED = "Pausing operations in favour of"


# ------------------------------------------------------------------------------- webhook fan-out


class Fanout:
    """A TCP proxy on 127.0.0.1: each connection goes to the next backend, round-robin (what a
    Service does through kube-proxy). TLS passes through: the harness's webhook certificate is
    for 127.0.0.1, the address the API server is given."""

    def __init__(self, backends: Callable[[], list[tuple[str, int]]]) -> None:
        self.backends = backends
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.served: dict[str, int] = {}
        self._rr = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        targets = self.backends()
        if not targets:
            conn.close()
            return
        host, port = targets[next(self._rr) % len(targets)]
        try:
            up = socket.create_connection((host, port), timeout=5)
        except OSError:
            conn.close()
            return
        self.served[host] = self.served.get(host, 0) + 1
        up.settimeout(None)
        conn.settimeout(None)

        def pipe(a: socket.socket, b: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := a.recv(65536):
                    b.sendall(data)
            with contextlib.suppress(OSError):
                b.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=pipe, args=(up, conn), daemon=True)
        t.start()
        pipe(conn, up)
        t.join(30)
        conn.close()
        up.close()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(5)


# ------------------------------------------------------------------------------------ fixture


@dataclass
class HA:
    rel: Release
    peering: str
    webhook_port: int
    fanout: Fanout
    tag: str
    pods_ready: list[dict[str, Any]] = field(default_factory=list)

    api: Any = None  # kubernetes ApiClient: polled often, kubectl would load the machine

    def operator_pods(self) -> list[dict[str, Any]]:
        pods = list_pods(self.api, self.rel.namespace, f"app.kubernetes.io/instance={self.rel.name}")
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    def ready_pods(self) -> list[dict[str, Any]]:
        return [p for p in self.operator_pods() if p["status"].get("phase") == "Running" and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]

    def peers(self) -> dict[str, dict[str, Any]]:
        """kopf's peering records by identity (the pod name: the chart sets POD_ID)."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            got = cast(dict[str, Any], client.CustomObjectsApi(self.api).get_cluster_custom_object(
                "kopf.dev", "v1", "clusterkopfpeerings", self.peering))
        except ApiException as exc:
            if exc.status == 404:
                return {}
            raise
        return {k: v for k, v in (got.get("status") or {}).items() if isinstance(v, dict)}

    def log_path(self, pod: dict[str, Any]) -> Path:
        return self.rel.cluster.pod_dir(self.rel.namespace, pod["metadata"]["name"],
                                        pod["metadata"]["uid"]) / "operator.log"

    def log(self, pod: dict[str, Any]) -> str:
        path = self.log_path(pod)
        return path.read_text(errors="replace") if path.exists() else ""


def live_peers(peers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Records whose lifetime has not run out (kopf's own test: lastseen + lifetime > now)."""
    from datetime import UTC, datetime, timedelta

    now = datetime.now(UTC)
    return {k: v for k, v in peers.items()
            if datetime.fromisoformat(v["lastseen"]) + timedelta(seconds=int(v["lifetime"])) > now}


def paused(log: str) -> bool:
    """What a replica's log says of it: kopf starts a peering replica paused and logs each change
    (a replica that peers before the other's record exists may resume for a moment at start-up,
    then pause in its favour)."""
    return log.rfind(LOG_RESUMED) <= log.rfind(LOG_PAUSED)


def active_of(peers: dict[str, dict[str, Any]]) -> str:
    """kopf's rule: of the live peers, the one of highest priority works, the others pause."""
    live = live_peers(peers)
    assert live, f"no live peering record: {peers}"
    prios = sorted((int(v["priority"]), k) for k, v in live.items())
    assert len({p for p, _ in prios}) == len(prios), f"equal priorities freeze kopf: {peers}"
    return prios[-1][1]


@pytest.fixture(scope="module")
def ha(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HA]:
    assert cluster.pki is not None
    tag = uuid.uuid4().hex[:6]
    rel = Release(cluster, "kvpool-ha", f"kvpool-ha-{tag}", f"apps-ha-{tag}", tmp_path_factory.mktemp("helm"),
                  free_port())
    create_namespace(cluster, rel.namespace)
    create_namespace(cluster, rel.apps)
    rel.kubectl("create", "secret", "tls", "kvpool-webhook-tls", "-n", rel.namespace,
                f"--cert={cluster.pki.webhook.cert}", f"--key={cluster.pki.webhook.key}")
    webhook_port = free_port()
    holder: dict[str, HA] = {}

    def backends() -> list[tuple[str, int]]:
        h = holder.get("ha")
        return [] if h is None else [(p["status"]["podIP"], webhook_port) for p in h.pods_ready]

    fanout = Fanout(backends)
    h = HA(rel, f"kvpool-ha-{tag}", webhook_port, fanout, tag, api=cluster.api_client())
    holder["ha"] = h
    stop = threading.Event()

    def refresh() -> None:  # the Service's endpoints: the ready replicas
        while not stop.wait(0.5):
            with contextlib.suppress(Exception):
                h.pods_ready = h.ready_pods()

    refresher = threading.Thread(target=refresh, daemon=True)
    refresher.start()
    try:
        rel.helm("install", rel.name, str(CHART), "--wait", "--timeout", "240s",
                 "--set", "replicaCount=2", "--set", f"peeringName={h.peering}",
                 "--set-string", "listenAddress=$(POD_IP)",
                 "--set", "webhook.mode=url", "--set", f"webhook.url=https://127.0.0.1:{fanout.port}",
                 "--set", f"webhook.port={webhook_port}", "--set", "webhook.certSecret=kvpool-webhook-tls",
                 "--set", f"webhook.caBundle={base64.b64encode(cluster.pki.ca.cert.read_bytes()).decode()}",
                 # The replicas bind their own pod IPs; other releases' pods share the host.
                 "--set", f"health.port={free_port()}", "--set", f"metrics.port={free_port()}",
                 "--set", "operator.reconcileIntervalSeconds=2", "--set", "operator.tenantIntervalSeconds=3",
                 timeout=300)
        yield h
    finally:
        cluster.kubectl("delete", "kvpools.kvpool.io", "--all", "-n", rel.apps, "--wait=true",
                        "--timeout=90s", check=False, timeout=120)
        cluster.kubectl("delete", "kvtiers.kvpool.io", f"ha-{rel.apps}", "--ignore-not-found", "--timeout=60s",
                        check=False, timeout=90)
        rel.helm("uninstall", rel.name, "--wait", "--timeout", "60s", check=False)
        cluster.kubectl("delete", "clusterkopfpeerings.kopf.dev", h.peering, "--ignore-not-found", check=False)
        for ns in (rel.apps, rel.namespace):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        stop.set()
        refresher.join(5)
        fanout.close()
        h.api.close()


# ------------------------------------------------------------------------------------ helpers


def admission_review(ha: HA, pod_ip: str, pool: str) -> dict[str, Any]:
    """POST an AdmissionReview for a pod opting into ``pool`` to one replica's webhook, as the
    API server would (dry run), and return the response."""
    assert ha.rel.cluster.pki is not None
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "probe", "namespace": ha.rel.apps, "labels": {"kvpool.io/pool": pool}},
           "spec": {"containers": [{"name": "c", "image": "x", "command": ["true"]}]}}
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "operation": "CREATE",
        "namespace": ha.rel.apps, "name": "probe", "object": pod, "dryRun": True,
        "userInfo": {"username": "e2e"}}}
    ctx = ssl.create_default_context(cafile=str(ha.rel.cluster.pki.ca.cert))
    ctx.check_hostname = False  # the certificate names 127.0.0.1; each replica has its own IP
    req = urllib.request.Request(f"https://{pod_ip}:{ha.webhook_port}/kvpool-inject", data=json.dumps(review).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
        return dict(json.loads(resp.read())["response"])


def patched_annotations(response: dict[str, Any]) -> dict[str, str]:
    """The annotations a webhook response's JSON patch sets."""
    out: dict[str, str] = {}
    for op in json.loads(base64.b64decode(response.get("patch") or "W10=")):
        if op["path"] == "/metadata/annotations":
            out.update(op["value"])
        elif op["path"].startswith("/metadata/annotations/"):
            out[op["path"].rsplit("/", 1)[1].replace("~1", "/")] = op["value"]
    return out


class StatusTimeline:
    """Polls the pool's status and keeps what changed: the drain's progress over time."""

    def __init__(self, rel: Release, pool: str, t0: float) -> None:
        from kubernetes import client

        self.api = rel.cluster.api_client()
        self.custom = client.CustomObjectsApi(self.api)
        self.ns, self.pool, self.t0 = rel.apps, pool, t0
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _row(self, st: dict[str, Any]) -> dict[str, Any]:
        d, last = st.get("drain") or {}, st.get("lastDrain") or {}
        return {"phase": st.get("phase"), "draining": bool(d),
                "moved": d.get("movedObjects", last.get("movedObjects")),
                "movedBytes": d.get("movedBytes", last.get("movedBytes")),
                "remaining": d.get("remainingObjects"), "result": last.get("result") if not d else None,
                "members": [m["id"] for m in (st.get("ring") or {}).get("members", [])]}

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            try:
                body = cast(dict[str, Any], self.custom.get_namespaced_custom_object(
                    "kvpool.io", "v1alpha1", self.ns, "kvpools", self.pool))
            except Exception:  # noqa: BLE001 - a missed poll only thins the timeline
                continue
            row = self._row(body.get("status") or {})
            if not self.rows or {k: v for k, v in self.rows[-1].items() if k != "t"} != row:
                self.rows.append({"t": round(time.monotonic() - self.t0, 1), **row})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.api.close()


@dataclass
class Counts:
    ok: int = 0
    missing: int = 0
    """NOT_FOUND: the pool does not have it (a lost or not yet written object)."""
    shed: int = 0
    """UNAVAILABLE: a store node did not deliver it within the sidecar's read deadline, or was
    skipped as suspect after missing one (``Deadlines``; not NOT_FOUND: it may hold it)."""
    wrong: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"ok": self.ok, "missing": self.missing, "shed": self.shed, "wrong": self.wrong, "errors": self.errors}


class DataPath:
    """An engine's traffic while the operator fails: a reader sidecar (small local tier, so reads
    go to the pool) reads random objects written before the drain; a writer sidecar puts new
    objects, flushes them to the pool, and the reader reads them back. Each outcome is kept with
    its time, so the counts can be split by phase (before the kill, no operator, after)."""

    def __init__(self, reader: Any, writer: Any, preloaded: dict[bytes, bytes]) -> None:
        self.reader, self.writer, self.preloaded = reader, writer, preloaded
        self.keys = list(preloaded)
        self.events: list[tuple[float, str, str]] = []  # (monotonic, what, outcome)
        self.written: dict[bytes, tuple[bytes, float]] = {}  # acknowledged new objects: value, time
        self.first_errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._reads, daemon=True),
                         threading.Thread(target=self._writes, daemon=True)]
        for t in self._threads:
            t.start()

    def _note(self, what: str, outcome: str, detail: str = "") -> None:
        self.events.append((time.monotonic(), what, outcome))
        if outcome == "errors" and len(self.first_errors) < 5:
            self.first_errors.append(f"{what}: {detail}")

    def _check(self, what: str, keys: list[bytes], expected: dict[bytes, bytes]) -> None:
        """Read ``keys`` through the reader sidecar; one outcome per key."""
        from kvpool.core import errors
        from kvpool.wire.proto import store_pb2 as pb

        try:
            with self.reader.get_many(keys) as reads:
                for k, code, v in zip(keys, reads.codes, reads.views, strict=True):
                    if code == pb.OK:
                        self._note(what, "ok" if bytes(v) == expected[k] else "wrong")
                    elif code == pb.NOT_FOUND:
                        self._note(what, "missing")
                    elif code == pb.UNAVAILABLE:
                        self._note(what, "shed")
                    else:
                        self._note(what, "errors", errors.code_name(code))
        except Exception as exc:  # noqa: BLE001 - counted, and the first ones kept for the report
            for _ in keys:
                self._note(what, "errors", repr(exc))

    def _reads(self) -> None:
        rng = random.Random(1)
        while not self._stop.is_set():
            self._check("existing", rng.sample(self.keys, 4), self.preloaded)
            time.sleep(0.02)

    def _writes(self) -> None:
        while not self._stop.is_set():
            batch = {os.urandom(32): os.urandom(VALUE_BYTES) for _ in range(2)}
            keys = list(batch)
            try:
                codes = self.writer.put(keys, list(batch.values()))
                self.writer.flush(timeout_ms=5000)
            except Exception as exc:  # noqa: BLE001
                for _ in keys:
                    self._note("write", "errors", repr(exc))
                continue
            for k, c in zip(keys, codes, strict=True):
                self._note("write", "ok" if c == 0 else "errors", f"code {c}")
                if c == 0:
                    self.written[k] = (batch[k], time.monotonic())
            self._check("new", [k for k, c in zip(keys, codes, strict=True) if c == 0], batch)
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def counts(self, start: float = 0.0, end: float = float("inf")) -> dict[str, dict[str, int]]:
        out: dict[str, Counts] = {w: Counts() for w in ("existing", "new", "write")}
        for t, what, outcome in list(self.events):
            if start <= t < end:
                c = out[what]
                setattr(c, outcome, getattr(c, outcome) + 1)
        return {w: c.as_dict() for w, c in out.items()}


# ------------------------------------------------------------------------------------ tests


def test_1_two_replicas_run_one_active_both_serve_the_webhook(ha: HA) -> None:
    rel = ha.rel
    pods = wait_for(lambda: p if len(p := ha.ready_pods()) == 2 else None, 120, "two ready operator pods",
                    interval=0.5)
    names = sorted(p["metadata"]["name"] for p in pods)
    assert all(p["status"]["phase"] == "Running" for p in pods)
    assert len({p["status"]["podIP"] for p in pods}) == 2
    dep = rel.get("deployment", rel.name, "-n", rel.namespace)
    assert dep["spec"]["replicas"] == 2 and dep["status"].get("readyReplicas") == 2
    pdb = rel.get("poddisruptionbudget", rel.name, "-n", rel.namespace)
    assert pdb is not None and pdb["spec"]["minAvailable"] == 1

    # Both replicas peer in the ClusterKopfPeering; the older one is active, the other stands by.
    peers = wait_for(lambda: p if sorted(live_peers(p := ha.peers())) == names else None, 60,
                     "both replicas in the peering object", interval=0.5)
    active = active_of(peers)
    standby = next(n for n in names if n != active)
    by_name = {p["metadata"]["name"]: p for p in pods}
    wait_for(lambda: not paused(ha.log(by_name[active])), 60, f"{active} active", interval=0.5)
    wait_for(lambda: paused(ha.log(by_name[standby])), 30, f"{standby} standing by", interval=0.5)
    print(f"peering {ha.peering}: active {active}, standby {standby}: {json.dumps(peers)}")

    # Both replicas inject for a pool: the standby decides from the API server too.
    tier = f"ha-{rel.apps}"
    rel.kubectl("apply", "-f", "-", input=kvtier(tier, "128Mi"))
    rel.kubectl("apply", "-n", rel.apps, "-f", "-", input=kvpool_doc(
        "ha", storage={"replicas": 2, "tiers": [tier]},
        scaleDown={"gracePeriodSeconds": 240, "drainBandwidth": "1Mi"},
        tenancy={"defaultTenant": "public"}))
    rel.wait_pool("ha", lambda s: s.get("readyReplicas") == 2 and len((s.get("ring") or {}).get("members", [])) == 2,
                  180, "two ready store nodes in the ring")
    for name, pod in sorted(by_name.items()):
        resp = admission_review(ha, pod["status"]["podIP"], "ha")
        ann = patched_annotations(resp)
        assert resp["allowed"] and ann.get("kvpool.io/injected") == f"{rel.apps}.ha", (name, ann)
    # And through the API server (the fan-out stands in for the webhook Service).
    probe = json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe",
                        "labels": {"kvpool.io/pool": "ha"}},
                        "spec": {"containers": [{"name": "c", "image": "x", "command": ["true"]}]}})
    for _ in range(4):
        out = rel.kubectl("create", "--dry-run=server", "-o", "json", "-n", rel.apps, "-f", "-", input=probe)
        ann = json.loads(out.stdout)["metadata"].get("annotations", {})
        assert ann.get("kvpool.io/injected") == f"{rel.apps}.ha", ann
    print(f"webhook connections per replica IP through the fan-out: {ha.fanout.served}")


def test_2_active_killed_mid_drain_standby_takes_over_and_finishes(ha: HA, tmp_path: Path) -> None:
    import kvpool
    from kvpool.apps.cluster import spawn, stop_procs
    from kvpool.pool.node_client import StoreClient
    from kvpool.pool.routing import write_routes

    rel = ha.rel
    st = rel.wait_pool("ha", lambda s: s.get("readyReplicas") == 2 and s.get("phase") == "Ready", 120,
                       "the pool ready")
    ring = st["ring"]
    ids = [m["id"] for m in ring["members"]]
    address = {m["id"]: m["address"] for m in ring["members"]}
    assert ids == ["ha-store-0", "ha-store-1"]
    # The chart's default is TLS: this process reads and writes with the operator's certificate of
    # the pool, the sidecars below with the default tenant's, as injected ones would.
    kube = Kube(ha.api)
    cfg = pool_client_tls(kube, rel.apps, "ha", str(tmp_path / "tls-operator"))
    sidecar_tls = pool_client_tls(kube, rel.apps, "ha", str(tmp_path / "tls-sidecar"),
                                  secret=f"kvpool-default-tls-{rel.apps}.ha")

    # Data on both store nodes, written where a sidecar would write it.
    preloaded = {os.urandom(32): os.urandom(VALUE_BYTES) for _ in range(PRELOAD)}
    keys = list(preloaded)
    for nid, idx in write_routes(b"".join(keys), ids, int(ring.get("replicas", 1))).items():
        with StoreClient(address[nid], tls=cfg) as c:
            for lo in range(0, len(idx), 64):
                part = [keys[i] for i in idx[lo:lo + 64].tolist()]
                assert set(c.put(part, [preloaded[k] for k in part])) == {0}
    on_leaving = len(write_routes(b"".join(keys), ids, 1).get("ha-store-1", []))
    assert on_leaving > PRELOAD // 3, on_leaving
    rel.wait_pool("ha", lambda s: s.get("usedBytes", 0) >= PRELOAD * VALUE_BYTES, 60, "the data in status")

    # The data path: two sidecars on this host over the store pods, as in an engine pod.
    seeds = ",".join(address[i] for i in ids)
    sidecars = []
    for name, local in (("reader", 4 << 20), ("writer", 16 << 20)):
        d = tmp_path / name
        d.mkdir()
        sidecars.append(spawn(name, ["sidecar", "--socket", str(d / "s.sock"), "--pool", seeds, "--local",
                                     str(local), "--drain-seconds", "1", "--log-level", "WARNING",
                                     "--tls-dir", str(tmp_path / "tls-sidecar"),
                                     "--tls-server-name", sidecar_tls.server_name], str(d)))
    reader = kvpool.connect(f"unix://{tmp_path / 'reader' / 's.sock'}")
    writer = kvpool.connect(f"unix://{tmp_path / 'writer' / 's.sock'}")
    t0 = time.monotonic()
    timeline = StatusTimeline(rel, "ha", t0)
    load = DataPath(reader, writer, preloaded)
    crash = contextlib.ExitStack()  # the killed replica, kept dead until released below
    killed = False
    try:
        time.sleep(3)  # some traffic before anything happens
        pods = {p["metadata"]["name"]: p for p in ha.ready_pods()}
        assert len(pods) == 2
        active = active_of(ha.peers())
        standby = next(n for n in pods if n != active)
        victim, heir = pods[active], pods[standby]
        assert paused(ha.log(heir)) and not paused(ha.log(victim))
        heir_log_at_kill = len(ha.log(heir))

        # Scale down; once the leaving node is pushing (progress in status), kill the active.
        t_patch = time.monotonic()
        rel.kubectl("patch", "kvpools.kvpool.io", "ha", "-n", rel.apps, "--type=merge",
                    "-p", '{"spec":{"storage":{"replicas":1}}}')
        from kubernetes import client

        with rel.cluster.api_client() as api:
            custom = client.CustomObjectsApi(api)

            def drain() -> dict[str, Any] | None:
                body = cast(dict[str, Any], custom.get_namespaced_custom_object(
                    "kvpool.io", "v1alpha1", rel.apps, "kvpools", "ha"))
                d: dict[str, Any] = (body.get("status") or {}).get("drain") or {}
                return d if d.get("movedObjects", 0) > 0 else None

            at_kill = wait_for(drain, 90, "the drain moving objects (in status)", interval=0.1)
        crash.enter_context(CrashLoop(victim["metadata"]["uid"]))
        t_kill = time.monotonic()
        killed = True
        killed_drain = {k: at_kill.get(k) for k in ("movedObjects", "movedBytes", "remainingObjects")}

        # The standby takes over: its log says it resumes, and the dead record leaves the peering.
        t_log: float | None = None
        t_record: float | None = None
        deadline = t_kill + PEERING_LIFETIME + TAKEOVER_MARGIN + 30  # observe past the bound, then judge
        while time.monotonic() < deadline and (t_log is None or t_record is None):
            if t_log is None and LOG_RESUMED in ha.log(heir)[heir_log_at_kill:]:
                t_log = time.monotonic()
            if t_record is None and active not in ha.peers():
                t_record = time.monotonic()
            time.sleep(0.1)
        assert t_log is not None, f"{standby} never resumed; its log:\n{ha.log(heir)[-3000:]}"
        takeover = t_log - t_kill
        record_gone = None if t_record is None else t_record - t_kill
        peers_after = ha.peers()
        assert active_of(peers_after) == standby, peers_after

        # The new active replica finishes the drain from status.
        st = rel.wait_pool("ha", lambda s: bool(s.get("lastDrain")) and not s.get("drain"), 240,
                           "the drain finished by the standby")
        t_done = time.monotonic()
        last = st["lastDrain"]
        wait_for(lambda: sts_replicas(rel, "ha-store") == 1, 60, "the StatefulSet lowered", interval=0.5)
        time.sleep(3)  # traffic after the drain too
    finally:
        load.stop()
        timeline.close()
        crash.close()
        victim_log_at_release = len(ha.log(victim)) if killed else 0
        reader.close()
        writer.close()

    # Every object written before the drain, and every one the data path wrote (flushed: in the
    # pool) during the run, reads back from the node left.
    remaining = st["ring"]["members"][0]["address"]
    written = dict(load.written)
    want = {**preloaded, **{k: v for k, (v, _) in written.items()}}
    lost: list[str] = []
    with StoreClient(remaining, tls=cfg) as c:
        for lo in range(0, len(want), 128):
            part = list(want)[lo:lo + 128]
            for k, g in zip(part, c.get(part), strict=True):
                if g is None or bytes(g) != want[k]:
                    when = f"written at {written[k][1] - t_patch:+.1f}s from the scale-down" if k in written \
                        else "preloaded"
                    lost.append(f"{k.hex()[:16]} {'missing' if g is None else 'WRONG'} ({when})")
    gap = load.counts(t_kill, t_log)
    totals = load.counts()
    phases = {"before kill": load.counts(0, t_kill), "no operator": gap, "after takeover": load.counts(t_log)}
    report = {
        "takeoverSeconds": round(takeover, 2), "deadRecordRemovedSeconds": record_gone and round(record_gone, 2),
        "bound": PEERING_LIFETIME + TAKEOVER_MARGIN, "killedAt": round(t_kill - t0, 1),
        "scaleDownAt": round(t_patch - t0, 1), "drainDoneAt": round(t_done - t0, 1),
        "drainAtKill": killed_drain, "lastDrain": last, "dataPath": phases, "firstErrors": load.first_errors,
        "timeline": timeline.rows, "victim": active, "heir": standby, "lost": lost,
        "newObjectsWritten": len(written)}
    out = Path(os.environ.get("KVPOOL_E2E_ARTIFACTS", "/tmp")) / "kvpool-e2e-operator-ha.json"
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report, indent=1, default=str))
    stop_procs(sidecars)

    # Takeover within the peering lifetime (plus the stated margin).
    assert takeover <= PEERING_LIFETIME + TAKEOVER_MARGIN, report
    # The drain resumed from status and completed, nothing dropped, the ring down to one node.
    assert last["result"] == "Completed" and last["leaving"] == ["ha-store-1"], last
    assert not lost, f"{len(lost)} of {len(want)} objects not on the node left: {lost[:10]}"
    # What the drain counts as dropped is the store's accounting; what matters is checked above:
    # every acknowledged object is on the node left. (In 2 of 7 runs one 64 KiB object was
    # counted dropped while no object was lost: reported to the data plane's owners.)
    assert last["movedObjects"] + last["droppedObjects"] >= on_leaving, last
    assert [m["id"] for m in st["ring"]["members"]] == ["ha-store-0"]
    assert cond(st, "Draining") == ("False", "NotDraining")
    progressed_after = [r for r in timeline.rows if r["t"] > t_log - t0 and r["moved"] is not None]
    assert progressed_after, timeline.rows
    # The data path served throughout, the operator-less gap included.
    assert all(c["wrong"] == 0 for p in phases.values() for c in p.values()), report
    assert gap["existing"]["ok"] > 0 and gap["write"]["ok"] > 0 and gap["new"]["ok"] > 0, report
    for what in ("existing", "new"):
        assert totals[what]["missing"] == 0 and totals[what]["errors"] == 0, report
        # A read a store node does not deliver within the sidecar's deadline (~0.1 s here) is
        # shed as UNAVAILABLE and the node skipped until a probe answers (kvpool.core.deadlines:
        # the engine's path sheds rather than blocks); on this 2-core machine, shared with the
        # harness, other tests and the drain's TLS pushes, a few are the contract working, not a
        # lost object (what the pool holds is checked above).  More than 1% would be a real stall.
        served = sum(totals[what].values())
        assert totals[what]["shed"] <= max(5, served // 100), report
    assert totals["write"]["errors"] == 0, report

    # The killed replica comes back (its container restarts in the same pod) and stands by: it is
    # younger now, so no second handover.
    back = wait_for(lambda: p if len(p := ha.ready_pods()) == 2 else None, 120, "both replicas ready again",
                    interval=0.5)
    assert {p["metadata"]["name"] for p in back} == {active, standby}
    wait_for(lambda: active in live_peers(ha.peers()), 60, f"{active} back in the peering", interval=0.5)
    time.sleep(2 * 2)
    assert active_of(ha.peers()) == standby, ha.peers()
    wait_for(lambda: paused(ha.log(victim)[victim_log_at_release:]), 30, f"{active} standing by", interval=0.5)
    assert not paused(ha.log(heir)), f"the heir paused again: {ha.log(heir)[-3000:]}"
