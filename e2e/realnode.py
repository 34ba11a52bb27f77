"""The real-node tier: the control plane plus a real node (containerd, runc, the kubelet,
kube-proxy, CoreDNS, kube-scheduler) in one private namespace (``e2e.netns``).

Two halves:

* ``start_node(cluster, images)`` runs *inside* the namespace, in the node's supervisor
  (``python -m e2e.realnode serve``), after ``Cluster`` has started etcd, the apiserver and the
  controller-manager there: it writes the configurations (pure functions below), starts
  containerd, imports the images, starts the kubelet, the scheduler, kube-proxy and CoreDNS and
  waits for each.
* ``RealNodeCluster`` runs in the test process: it creates the namespace with the supervisor
  inside, waits for it, and offers the ``Cluster`` API (``kubeconfig``, ``kubectl``,
  ``api_client``, ``pki``, ``binaries``, ``logs``) through a relay from the host's loopback to
  the apiserver.

The settings that are required on these machines (REAL-NODE.md) are marked where they are made.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from e2e import netns, pki
from e2e.cluster import (
    NODE_NAME,
    REAL_NODE_APISERVER_PORT,
    RUN_ID_ENV,
    Cluster,
    _http_get,
    insecure_ssl,
    stop_requested,
    tail,
    wait_until,
)

NODE_IP = "10.250.0.1"  # on `lo` of the node's namespace only; the kubelet refuses 127/8
POD_CIDR = "10.244.0.0/24"
CLUSTER_DOMAIN = "cluster.local"
# The packages the tier runs (Debian's): what is missing makes the fixture skip, saying so.
REQUIRED_COMMANDS = {"containerd": "containerd", "runc": "runc", "ctr": "containerd",
                     "iptables": "iptables", "unshare": "util-linux", "ip": "iproute2"}
REQUIRED_FILES = {"/usr/lib/cni/bridge": "containernetworking-plugins",
                  "/usr/lib/cni/host-local": "containernetworking-plugins",
                  "/usr/lib/cni/loopback": "containernetworking-plugins"}
CNI_BIN_DIR = "/usr/lib/cni"


@dataclasses.dataclass(frozen=True)
class Images:
    """OCI archives the node imports at start, and the references they carry
    (``tools/image.sh --print-env``)."""

    kvpool_archive: Path
    kvpool: str
    pause_archive: Path
    pause: str

    ENV = ("KVPOOL_IMAGE_ARCHIVE", "KVPOOL_IMAGE", "KVPOOL_PAUSE_ARCHIVE", "KVPOOL_PAUSE_IMAGE")

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Images:
        a, i, pa, p = (env[k] for k in cls.ENV)
        return cls(Path(a), i, Path(pa), p)

    def env(self) -> dict[str, str]:
        values = [str(self.kvpool_archive), self.kvpool, str(self.pause_archive), self.pause]
        return dict(zip(self.ENV, values, strict=True))


# -- configurations (pure) --------------------------------------------------------------------

def containerd_config(root: Path, sock: Path, pause_image: str, cni_conf_dir: Path) -> str:
    """containerd 1.6's config.toml (version 2) for a node whose state stays below ``root``."""
    return f"""version = 2
root = "{root / 'root'}"
state = "{root / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]
[grpc]
  address = "{sock}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{root / 'opt'}"
[plugins."io.containerd.grpc.v1.cri"]
  # No registry is reachable here: the pause image is imported, never pulled.
  sandbox_image = "{pause_image}"
  # Required here: the VM lacks CAP_SYS_RESOURCE, so a negative oom_score_adj fails every
  # sandbox ("can't get final child's PID from pipe: EOF"); restricted, it becomes 0.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        # runc, not crun: crun 1.8 refuses this hybrid cgroup layout.
        BinaryName = "/usr/sbin/runc"
        Root = "{root / 'runc'}"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni_conf_dir}"
"""


def cni_config(ipam_dir: Path) -> dict[str, Any]:
    """A bridge with host-local IPAM. The kubelet keeps the Node NotReady without a CNI
    configuration, even for hostNetwork pods (required here)."""
    return {
        "cniVersion": "0.4.0",
        "name": "kvpool-e2e",
        "plugins": [{
            "type": "bridge", "bridge": "kvpool0", "isGateway": True, "ipMasq": False,
            # A pod reaching a Service backed by itself goes out and back the same port.
            "hairpinMode": True,
            "ipam": {"type": "host-local", "dataDir": str(ipam_dir),
                     "ranges": [[{"subnet": POD_CIDR}]], "routes": [{"dst": "0.0.0.0/0"}]},
        }],
    }


def kubelet_config(workdir: Path, p: pki.Pki, runtime_sock: Path, cgroup_root: str) -> dict[str, Any]:
    """KubeletConfiguration (JSON is YAML) for the node in ``workdir``."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # Required here: 1.35+ refuses cgroup v1 unless told; the driver is cgroupfs (no systemd).
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        # The pod cgroups of this node only, so that they can be removed at stop.
        "cgroupRoot": cgroup_root,
        "containerRuntimeEndpoint": f"unix://{runtime_sock}",
        "address": NODE_IP,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "tlsCertFile": str(p.kubelet.cert),
        "tlsPrivateKeyFile": str(p.kubelet.key),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(p.ca.cert)}},
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [NODE_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(workdir / "resolv.conf"),
        "podLogsDir": str(workdir / "pod-logs"),
        "failSwapOn": False,
        # A shared CI disk must not make the node evict test pods.
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "rotateCertificates": False,
    }


def kube_proxy_config(kubeconfig: Path) -> dict[str, Any]:
    """KubeProxyConfiguration: iptables mode inside the namespace; conntrack limits, which are
    global, left alone (zeros mean "do not set")."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "clusterCIDR": POD_CIDR,
        "hostnameOverride": NODE_NAME,
        "bindAddress": NODE_IP,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s"},
    }


def corefile(kubeconfig: Path) -> str:
    """CoreDNS on the node IP: cluster names from the API; nothing is forwarded (no upstream
    resolver is reachable from the namespace)."""
    return f""".:53 {{
    errors
    health 127.0.0.1:8080
    ready 127.0.0.1:8181
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} kvpool-e2e
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
    loadbalance
}}
"""


# -- inside the namespace ---------------------------------------------------------------------

def cgroup_root(run_id: str) -> str:
    return f"/kvpool-e2e-{run_id}"


def _cgroup_dirs(root: str) -> list[Path]:
    """This node's directory in every mounted cgroup hierarchy (v1 controllers and the v2 one)."""
    base = Path("/sys/fs/cgroup")
    hierarchies = [d for d in base.iterdir() if d.is_dir() and not d.is_symlink()]
    return [d / root.lstrip("/") for d in hierarchies]


def make_cgroup_root(root: str) -> None:
    for d in _cgroup_dirs(root):
        d.mkdir(exist_ok=True)
        # A new cpuset cgroup starts with no CPUs and no memory nodes: copy the parent's.
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (d / name).exists() and not (d / name).read_text().strip():
                (d / name).write_text((d.parent / name).read_text())


def remove_cgroup_root(root: str) -> None:
    """rmdir the node's cgroups, deepest first (their processes are gone with the namespace)."""
    for d in _cgroup_dirs(root):
        if not d.exists():
            continue
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                sub.rmdir()
        with contextlib.suppress(OSError):
            d.rmdir()


def start_node(cluster: Cluster, images: Images) -> None:
    """Start the node's components in ``cluster`` (its control plane is up) and wait for each."""
    w, p, bins = cluster.workdir, cluster.pki, cluster.binaries
    assert p is not None
    timeout = 180.0
    node_dir = w / "node"
    (node_dir / "cni").mkdir(parents=True, exist_ok=True)
    (w / "pod-logs").mkdir(exist_ok=True)
    sock = node_dir / "containerd.sock"
    (node_dir / "containerd.toml").write_text(
        containerd_config(node_dir / "containerd", sock, images.pause, node_dir / "cni"))
    (node_dir / "cni" / "10-kvpool.conflist").write_text(
        json.dumps(cni_config(node_dir / "cni-ipam")))
    (w / "resolv.conf").write_text(f"nameserver {NODE_IP}\n")
    (node_dir / "kubelet.json").write_text(
        json.dumps(kubelet_config(w, p, sock, cgroup_root(cluster.run_id))))
    admin = cluster.kubeconfig  # scheduler, kube-proxy, CoreDNS: see README (one identity)
    (node_dir / "kube-proxy.json").write_text(json.dumps(kube_proxy_config(admin)))
    (node_dir / "Corefile").write_text(corefile(admin))
    make_cgroup_root(cgroup_root(cluster.run_id))

    began = time.monotonic()

    def took(what: str) -> None:
        print(f"[realnode] {what}: {time.monotonic() - began:.1f}s", flush=True)

    containerd = cluster.spawn("containerd", ["containerd", "--config",
                                              str(node_dir / "containerd.toml")])
    ctr = ["ctr", "--address", str(sock), "--namespace", "k8s.io"]
    wait_until("containerd", lambda: subprocess.run([*ctr, "version"], capture_output=True,
                                                    timeout=10).returncode == 0,
               timeout, containerd.check_alive)
    for archive in (images.pause_archive, images.kvpool_archive):
        done = subprocess.run([*ctr, "images", "import", str(archive)], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"ctr images import {archive}: {done.stdout}{done.stderr}")
        took(f"imported {archive.name}")

    kubelet = cluster.spawn("kubelet", [
        str(bins.kubelet), "--config", str(node_dir / "kubelet.json"),
        "--kubeconfig", str(w / "node.kubeconfig"),
        "--root-dir", str(node_dir / "kubelet"),
        "--hostname-override", NODE_NAME, "--node-ip", NODE_IP, "--v=2",
    ])
    scheduler = cluster.spawn("kube-scheduler", [
        str(bins.kube_scheduler), f"--kubeconfig={admin}", "--leader-elect=false",
        "--bind-address=127.0.0.1", "--secure-port=10259", "--v=1",
    ])
    proxy = cluster.spawn("kube-proxy", [
        str(bins.kube_proxy), f"--config={node_dir / 'kube-proxy.json'}", "--v=1"])
    coredns = cluster.spawn("coredns", [str(bins.coredns), "-conf", str(node_dir / "Corefile")])

    ctx = cluster.admin_ssl()
    wait_until("kubelet: Node Ready", lambda: cluster.node_ready(ctx), timeout,
               kubelet.check_alive)
    took("Node Ready")
    insecure = insecure_ssl()  # the scheduler's serving cert is self-signed
    wait_until("kube-scheduler", lambda: _http_get("https://127.0.0.1:10259/healthz", insecure)
               == b"ok", timeout, scheduler.check_alive)
    wait_until("kube-proxy", lambda: bool(_http_get("http://127.0.0.1:10256/healthz")),
               timeout, proxy.check_alive)
    wait_until("coredns", lambda: _http_get("http://127.0.0.1:8181/ready") == b"OK",
               timeout, coredns.check_alive)
    took("scheduler, kube-proxy, CoreDNS ready")


def serve(args: argparse.Namespace) -> int:
    """The node's supervisor (inside the namespace): start all, mark ready, wait for SIGTERM."""
    stopping = stop_requested(signal.SIGTERM)
    workdir = Path(args.workdir)
    images = Images.from_env(dict(os.environ))
    cluster = Cluster(workdir, node_ip=NODE_IP,
                      start_node=lambda c: start_node(c, images))
    cluster.run_id = args.run_id
    began = time.monotonic()
    try:
        cluster.start(timeout=180)
        print(f"[realnode] all ready in {time.monotonic() - began:.1f}s", flush=True)
        (workdir / "ready").write_text("ok\n")
        while not stopping():
            time.sleep(0.5)
    finally:
        cluster.stop()
    return 0


# -- in the test process ----------------------------------------------------------------------

def missing_packages() -> list[str]:
    """Debian packages the tier needs that are not installed (empty: all there)."""
    missing = {pkg for cmd, pkg in REQUIRED_COMMANDS.items() if shutil.which(cmd) is None}
    missing |= {pkg for f, pkg in REQUIRED_FILES.items() if not Path(f).exists()}
    return sorted(missing)


def find_images(repo: Path) -> Images | None:
    """The image archives: from the environment (``tools/image.sh --print-env`` already
    evaluated), else by running ``tools/image.sh`` (cached: a warm run only hashes)."""
    if all(os.environ.get(k) for k in Images.ENV):
        return Images.from_env(dict(os.environ))
    script = repo / "tools" / "image.sh"
    if not script.exists() or os.environ.get("KVPOOL_SKIP_IMAGE") == "1":
        return None
    out = subprocess.run(["bash", str(script), "--print-env"], cwd=repo, check=True,
                         capture_output=True, text=True, timeout=3600).stdout
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return Images.from_env(values)


class RealNodeCluster(Cluster):
    """The ``Cluster`` API over a control plane and a real node in a private namespace."""

    def __init__(self, images: Images, workdir: Path | None = None) -> None:
        super().__init__(workdir or Path(tempfile.mkdtemp(prefix="kvpool-rn-")),
                         node_ip=NODE_IP)
        self._own_workdir = workdir is None
        self.images = images
        self.image = images.kvpool
        self._holder: subprocess.Popen[bytes] | None = None
        self._lifeline = -1

    def start(self, timeout: float = 300.0) -> RealNodeCluster:
        try:
            self._start_namespace(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_namespace(self, timeout: float) -> None:
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        listener = socket.create_server(("127.0.0.1", 0))
        relay_port = listener.getsockname()[1]
        lifeline_r, self._lifeline = os.pipe()
        supervisor = [sys.executable, "-m", "e2e.realnode", "serve",
                      "--workdir", str(self.workdir), "--run-id", self.run_id]
        argv = netns.namespace_argv(NODE_IP, listener.fileno(), REAL_NODE_APISERVER_PORT,
                                    lifeline_r, supervisor)
        log = self.workdir / "logs" / "supervisor.log"
        env = dict(os.environ, **self.images.env(), **{RUN_ID_ENV: self.run_id})
        env.pop("KUBECONFIG", None)
        with log.open("ab") as fh, listener:
            self._holder = subprocess.Popen(
                argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                pass_fds=(listener.fileno(), lifeline_r), start_new_session=True,
                cwd=Path(__file__).resolve().parent.parent)
        os.close(lifeline_r)
        ready = self.workdir / "ready"

        def alive() -> None:
            assert self._holder is not None
            if self._holder.poll() is not None:
                raise RuntimeError(f"the node's namespace ended ({self._holder.returncode}):\n"
                                   f"{self.logs()}")

        wait_until("real node", ready.exists, timeout, alive, interval=0.5)
        self.pki = pki.pki_paths(self.workdir / "pki")
        self.server = f"https://127.0.0.1:{relay_port}"
        inside = json.loads((self.workdir / "admin.kubeconfig").read_text())
        inside["clusters"][0]["cluster"]["server"] = self.server
        self.kubeconfig = self.workdir / "admin-host.kubeconfig"
        self.kubeconfig.write_text(json.dumps(inside, indent=2))
        self.kubeconfig.chmod(0o600)

    def stop(self) -> None:
        """End the namespace (closing the lifeline makes its init exit: the kernel then kills
        every process in it), remove the node's cgroups and the work dir."""
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        if self._holder is not None:
            try:
                self._holder.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._holder.pid, signal.SIGKILL)
                self._holder.wait()
            self._holder = None
        remove_cgroup_root(cgroup_root(self.run_id))
        if self._own_workdir and not os.environ.get("KVPOOL_E2E_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def logs(self, lines: int = 60) -> str:
        parts = [f"===== {log.stem} ({log}) =====\n{tail(log, lines)}"
                 for log in sorted((self.workdir / "logs").glob("*.log"))]
        for log in sorted((self.workdir / "pod-logs").glob("*/*/*.log")):
            pod, container = log.parent.parent.name, log.parent.name
            parts.append(f"===== pod {pod} / {container} =====\n{tail(log, 20)}")
        return "\n".join(parts)

    def pod_dir(self, namespace: str, name: str, uid: str) -> Path:
        raise NotImplementedError("the real node keeps no agent pod dir: read logs through "
                                  "the API (kubectl logs) and files through the pod")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.realnode")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="the node's supervisor, inside its namespace")
    s.add_argument("--workdir", required=True)
    s.add_argument("--run-id", required=True)
    args = parser.parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    raise SystemExit(main())
