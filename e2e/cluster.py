"""A real, throw-away Kubernetes control plane on 127.0.0.1, and the CLI to run one by hand.

``Cluster`` starts etcd, kube-apiserver (TLS, RBAC, admission webhooks on), kube-controller-manager
and the test node agent (``e2e.nodeagent``) as real processes on free loopback ports, with a
fresh PKI (``e2e.pki``), waits until each is ready, and writes a kubeconfig with embedded
credentials that the ``kubernetes`` client, kopf and kubectl all accept. ``stop()`` ends every
process it started (and every pod process the node agent started) and removes the work dir.

CLI::

    python -m e2e.cluster up --kubeconfig /tmp/kvpool.kubeconfig

builds what is missing (``e2e.build``), runs in the foreground, writes the kubeconfig once
everything is ready and stops all on SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from e2e import build, pki, procs
from kvpool.core.signals import stop_on_signals

SERVICE_CIDR = "10.96.0.0/16"
FIRST_SERVICE_IP = "10.96.0.1"
NODE_NAME = "kvpool-e2e"
# Every pod process carries this variable; stop() sweeps /proc for it so that nothing started
# by the node agent outlives the cluster, even when the agent itself died.
RUN_ID_ENV = "KVPOOL_E2E_RUN_ID"
# The real-node tier's apiserver runs in a network namespace of its own, so a fixed port is
# free there, and the harness's relay from the host knows where to connect before it starts.
REAL_NODE_APISERVER_PORT = 6443


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(what: str, check: Callable[[], bool], timeout: float,
               alive: Callable[[], None] | None = None, interval: float = 0.2) -> None:
    """Poll ``check`` until it is true; ``alive`` raises early if a component died."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        if alive is not None:
            alive()
        try:
            if check():
                return
        except Exception as exc:  # readiness probes fail in many ways until they don't
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"{what} not ready after {timeout:.0f}s (last error: {last_exc!r})")


@dataclasses.dataclass
class Component:
    """One started process and where its output goes."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise RuntimeError(f"{self.name} exited with {code}; log tail:\n{tail(self.log)}")


def tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig_text(server: str, ca: Path, cert: Path, key: Path, user: str) -> str:
    """A kubeconfig with embedded data, so it stays valid when copied elsewhere."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kvpool-e2e", "cluster": {
            "server": server, "certificate-authority-data": _b64(ca)}}],
        "users": [{"name": user, "user": {
            "client-certificate-data": _b64(cert), "client-key-data": _b64(key)}}],
        "contexts": [{"name": "kvpool-e2e", "context": {"cluster": "kvpool-e2e", "user": user}}],
        "current-context": "kvpool-e2e",
    }
    # JSON is valid YAML; every kubeconfig reader accepts it.
    return json.dumps(config, indent=2)


def sweep_processes(run_id: str) -> int:
    """SIGKILL every process whose environment carries ``RUN_ID_ENV=run_id``."""
    return procs.kill_marked(RUN_ID_ENV, run_id)


class Cluster:
    """etcd + kube-apiserver + kube-controller-manager + node agent, all on 127.0.0.1.

    Attributes worth using from tests: ``kubeconfig`` (admin), ``pki.webhook`` (a serving cert
    for 127.0.0.1 signed by ``pki.ca``), ``server`` (the API URL), ``binaries`` (kubectl, helm).
    """

    def __init__(self, workdir: Path | None = None, *, with_node: bool = True,
                 pod_ip_prefix: str = "127.0.10.", binaries: build.Binaries | None = None,
                 node_ip: str | None = None,
                 start_node: Callable[[Cluster], None] | None = None) -> None:
        """``node_ip`` and ``start_node`` make the real-node tier (``e2e.realnode``): the
        apiserver listens on every address of the node's own network namespace, on 6443, and
        advertises ``node_ip`` (its endpoint reconciler then fills the ``kubernetes``
        Service); ``start_node(self)`` starts the node instead of the node agent."""
        self._own_workdir = workdir is None
        self.node_ip = node_ip
        self.start_node = start_node
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvpool-e2e-"))
        self.with_node = with_node
        self.pod_ip_prefix = pod_ip_prefix
        self.run_id = uuid.uuid4().hex[:12]
        self.components: list[Component] = []
        self.binaries = binaries or build.ensure_binaries()
        self.pki: pki.Pki | None = None
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.server = ""
        self.apiserver_port = 0

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> Cluster:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.pki = p = pki.make_pki(self.workdir / "pki", service_ip=FIRST_SERVICE_IP,
                                    node_ip=self.node_ip)

        etcd_port, etcd_peer = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        etcd = self.spawn("etcd", [
            str(self.binaries.etcd),
            "--name", "e2e",
            "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", etcd_url,
            "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-cluster", f"e2e=http://127.0.0.1:{etcd_peer}",
            # Throw-away data: durability buys nothing and fsync latency slows every write.
            "--unsafe-no-fsync",
            "--log-level", "warn",
        ])
        wait_until("etcd", lambda: b'"health":"true"' in _http_get(f"{etcd_url}/health"),
                   timeout, etcd.check_alive)

        self.apiserver_port = REAL_NODE_APISERVER_PORT if self.node_ip else free_port()
        self.server = f"https://127.0.0.1:{self.apiserver_port}"
        address_args = [
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            # The default reconciler writes the apiserver's address into the `kubernetes`
            # Endpoints, and loopback addresses are refused there.
            "--endpoint-reconciler-type=none",
        ] if not self.node_ip else [
            "--bind-address=0.0.0.0",  # the node's own namespace: nothing else listens here
            f"--advertise-address={self.node_ip}",
        ]
        apiserver = self.spawn("kube-apiserver", [
            str(self.binaries.kube_apiserver),
            f"--etcd-servers={etcd_url}",
            *address_args,
            f"--secure-port={self.apiserver_port}",
            f"--tls-cert-file={p.apiserver.cert}",
            f"--tls-private-key-file={p.apiserver.key}",
            f"--client-ca-file={p.ca.cert}",
            "--authorization-mode=RBAC",
            # The defaults already include MutatingAdmissionWebhook and ValidatingAdmissionWebhook;
            # naming them keeps them on even if the defaults change.
            "--enable-admission-plugins=MutatingAdmissionWebhook,ValidatingAdmissionWebhook",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={p.sa_public}",
            f"--service-account-signing-key-file={p.sa_private}",
            "--allow-privileged=true",
            # `kubectl logs` goes through the apiserver to the node agent's kubelet API.
            f"--kubelet-client-certificate={p.kubelet_client.cert}",
            f"--kubelet-client-key={p.kubelet_client.key}",
            f"--kubelet-certificate-authority={p.ca.cert}",
            "--kubelet-preferred-address-types=InternalIP",
            "--profiling=false",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            "--v=1",
        ])
        self._write_kubeconfigs()
        ctx = self.admin_ssl()
        wait_until("kube-apiserver",
                   lambda: _http_get(f"{self.server}/readyz", ctx) == b"ok",
                   timeout, apiserver.check_alive)

        cm_port = free_port()
        cm = self.spawn("kube-controller-manager", [
            str(self.binaries.kube_controller_manager),
            f"--kubeconfig={self.workdir / 'controller-manager.kubeconfig'}",
            "--bind-address=127.0.0.1",
            f"--secure-port={cm_port}",
            f"--cert-dir={self.workdir / 'cm-certs'}",
            "--leader-elect=false",
            f"--service-account-private-key-file={p.sa_private}",
            f"--root-ca-file={p.ca.cert}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Fast resyncs matter more than load here; a test should not wait on a controller.
            "--concurrent-deployment-syncs=5",
            "--v=1",
        ])
        insecure = insecure_ssl()  # its serving cert is self-signed in cert-dir
        wait_until("kube-controller-manager",
                   lambda: _http_get(f"https://127.0.0.1:{cm_port}/healthz", insecure) == b"ok",
                   timeout, cm.check_alive)
        # Pods are refused until the serviceaccount controller made `default`; wait for it so
        # that the first test's pod does not race the controller.
        wait_until("default service account",
                   lambda: _http_ok(f"{self.server}/api/v1/namespaces/default/serviceaccounts/default",
                                    ctx), timeout, cm.check_alive)

        if self.with_node and self.start_node is not None:
            self.start_node(self)
        elif self.with_node:
            node = self.spawn("node-agent", [
                sys.executable, "-m", "e2e.nodeagent",
                "--kubeconfig", str(self.workdir / "node.kubeconfig"),
                "--node-name", NODE_NAME,
                "--state-dir", str(self.workdir / "node"),
                "--pod-ip-prefix", self.pod_ip_prefix,
                "--apiserver-port", str(self.apiserver_port),
                "--ca-file", str(p.ca.cert),
                "--run-id", self.run_id,
                "--kubelet-port", str(free_port()),
                "--serving-cert", str(p.kubelet.cert),
                "--serving-key", str(p.kubelet.key),
            ], cwd=Path(__file__).resolve().parent.parent)
            wait_until("node agent", lambda: self.node_ready(ctx), timeout, node.check_alive)

    def stop(self) -> None:
        """Stop every component (newest first) and remove the work dir if we made it."""
        for comp in reversed(self.components):
            _terminate(comp.proc, grace=15.0 if comp.name == "node-agent" else 5.0)
        self.components.clear()
        sweep_processes(self.run_id)
        # The agent removes its memory-backed emptyDirs itself, unless it was killed.
        shutil.rmtree(f"/dev/shm/kvpool-e2e-{self.run_id}", ignore_errors=True)
        if self._own_workdir and not os.environ.get("KVPOOL_E2E_KEEP"):
            _unmount_below(self.workdir)
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers ---------------------------------------------------------------------------

    def logs(self, lines: int = 60) -> str:
        """Tails of every component log and of every container log, for failure reports."""
        parts = [f"===== {c.name} ({c.log}) =====\n{tail(c.log, lines)}" for c in self.components]
        pods = self.workdir / "node" / "pods"
        if pods.is_dir():
            for log in sorted(pods.glob("*/*.log")):
                parts.append(f"===== pod {log.parent.name} / {log.stem} =====\n{tail(log, 20)}")
        return "\n".join(parts)

    def pod_dir(self, namespace: str, name: str, uid: str) -> Path:
        """The node agent's directory for one pod: container logs, ``volumes/<name>``."""
        return self.workdir / "node" / "pods" / f"{namespace}_{name}_{uid[:8]}"

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for the admin kubeconfig."""
        from kubernetes import config  # imported late: build/CLI paths need no client

        return config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(self.kubeconfig))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.binaries.kubectl), "--kubeconfig", str(self.kubeconfig),
                               *args], input=input, text=True, capture_output=True, check=check,
                              timeout=timeout)

    def spawn(self, name: str, argv: list[str], cwd: Path | None = None) -> Component:
        log = self.workdir / "logs" / f"{name}.log"
        env = dict(os.environ, **{RUN_ID_ENV: self.run_id})
        env.pop("KUBECONFIG", None)  # components get theirs explicitly
        with log.open("ab") as fh:
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                    stdin=subprocess.DEVNULL,
                                    # Own session: a Ctrl-C in the terminal reaches only us,
                                    # and we stop the components in order.
                                    start_new_session=True)
        comp = Component(name, proc, log)
        self.components.append(comp)
        return comp

    def _write_kubeconfigs(self) -> None:
        assert self.pki is not None
        p = self.pki
        for fname, pair, user in [
            ("admin.kubeconfig", p.admin, "admin"),
            ("controller-manager.kubeconfig", p.controller_manager, "controller-manager"),
            ("node.kubeconfig", p.node, "node"),
        ]:
            path = self.workdir / fname
            path.write_text(kubeconfig_text(self.server, p.ca.cert, pair.cert, pair.key, user))
            path.chmod(0o600)

    def admin_ssl(self) -> ssl.SSLContext:
        assert self.pki is not None
        ctx = ssl.create_default_context(cafile=str(self.pki.ca.cert))
        ctx.load_cert_chain(str(self.pki.admin.cert), str(self.pki.admin.key))
        return ctx

    def node_ready(self, ctx: ssl.SSLContext) -> bool:
        body = json.loads(_http_get(f"{self.server}/api/v1/nodes/{NODE_NAME}", ctx))
        conds = body.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def insecure_ssl() -> ssl.SSLContext:
    """A client context for the health endpoint of a component whose serving cert is
    self-signed (kube-controller-manager, kube-scheduler): no verification."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _http_status(url: str, ctx: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """GET ``url``; (status, body). Error responses are closed here: a leaked socket would be a
    ResourceWarning, which the test configuration turns into an error."""
    try:
        with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
            return int(resp.status), bytes(resp.read()).strip()
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), bytes(exc.read()).strip()


def _http_get(url: str, ctx: ssl.SSLContext | None = None) -> bytes:
    status, body = _http_status(url, ctx)
    if status != 200:
        raise RuntimeError(f"GET {url}: HTTP {status}: {body[:200]!r}")
    return body


def _http_ok(url: str, ctx: ssl.SSLContext) -> bool:
    return _http_status(url, ctx)[0] == 200


def _terminate(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the process group, then SIGKILL it after ``grace`` seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _unmount_below(root: Path) -> None:
    """Unmount anything mounted under ``root`` (the node agent's tmpfs), deepest first."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return
    prefix = str(root.resolve()) + "/"
    targets = [m.split()[1] for m in mounts if m.split()[1].startswith(prefix)]
    for target in sorted(targets, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)


@contextlib.contextmanager
def running_cluster(**kwargs: Any) -> Iterator[Cluster]:
    cluster = Cluster(**kwargs)
    with cluster:
        yield cluster


def stop_requested(*signums: int) -> Callable[[], bool]:
    """The returned call says whether one of ``signums`` has arrived (the
    stop condition of a foreground loop: ``python -m e2e.cluster up``, the real node's
    supervisor)."""
    return stop_on_signals(signums).is_set


def _cmd_up(args: argparse.Namespace) -> int:
    stopping = stop_requested(signal.SIGTERM, signal.SIGINT)
    start = time.monotonic()
    cluster = Cluster(Path(args.workdir) if args.workdir else None, with_node=not args.no_node)
    try:
        cluster.start()
        target = Path(args.kubeconfig)
        tmp = target.with_name(target.name + ".tmp")
        shutil.copyfile(cluster.kubeconfig, tmp)
        tmp.chmod(0o600)
        tmp.rename(target)  # atomic: a watcher never reads half a kubeconfig
        print(f"[e2e.cluster] ready in {time.monotonic() - start:.1f}s; kubeconfig={target}; "
              f"webhook cert={cluster.pki.webhook.cert if cluster.pki else ''}; "
              f"logs={cluster.workdir / 'logs'}", flush=True)
        while not stopping():
            for comp in cluster.components:
                comp.check_alive()
            time.sleep(0.5)
    finally:
        print("[e2e.cluster] stopping", flush=True)
        cluster.stop()
        with contextlib.suppress(FileNotFoundError):
            Path(args.kubeconfig).unlink()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="run a cluster in the foreground until SIGTERM/Ctrl-C")
    up.add_argument("--kubeconfig", required=True, help="where to write the admin kubeconfig")
    up.add_argument("--workdir", help="keep state here instead of a temp dir (not removed)")
    up.add_argument("--no-node", action="store_true", help="control plane only, no node agent")
    args = parser.parse_args(argv)
    return _cmd_up(args)


if __name__ == "__main__":
    raise SystemExit(main())
