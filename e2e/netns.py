"""The real-node tier's private namespace: one mount + network + PID namespace for a whole node.

containerd, the kubelet, the CNI bridge, kube-proxy's iptables rules and the control plane all
run inside it, so nothing reaches the host's network, sysctls, /run or /var/lib/kubelet, and
everything ends together: when the namespace's init (this module's ``init``) exits, the kernel
kills every process in the PID namespace, container processes and containerd shims included.

``namespace_argv`` is the command line that creates it::

    unshare --mount --net --pid --fork --mount-proc --propagation private \\
        python -m e2e.netns init --node-ip IP --relay-fd N --lifeline-fd M -- CMD...

``init`` runs as PID 1 of the new PID namespace. It prepares the namespace (``prepare``), starts
CMD (the node's supervisor), relays TCP connections from a listening socket the caller made on
the host's loopback to the apiserver inside (the tests, kubectl and helm reach the API so), reaps
orphans (containerd's shims are reparented to it) and exits, ending the namespace, when CMD
exits, on SIGTERM, or when the caller closes the lifeline pipe (a killed test run leaves
nothing behind).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

# The kubelet sets these at start, and they are global, not per network namespace. Bind-mounting
# a file holding the value it wants over each entry makes it find the value set and write
# nothing; the host keeps its own (REAL-NODE.md, setting 5).
KUBELET_GLOBAL_SYSCTLS = {"vm/overcommit_memory": "1", "kernel/panic": "10",
                          "kernel/panic_on_oops": "1"}
# Per network namespace: routing for the pod bridge, and iptables on bridged traffic, which
# kube-proxy's DNAT needs when a pod reaches a Service backed by a pod on the same bridge.
NETNS_SYSCTLS = {"net/ipv4/ip_forward": "1", "net/bridge/bridge-nf-call-iptables": "1"}
# Written by the kubelet and containerd whatever their configured roots say (kubelet: pki and
# device-plugins below /var/lib/kubelet, log links in /var/log/containers; containerd's shims:
# /run/containerd; CNI's IPAM leases: /var/lib/cni; network namespaces: /run/netns).
UPLINK = "kvpool-up"  # the default route's device (see prepare)
PRIVATE_DIRS = ["/run", "/var/lib/kubelet", "/var/log/containers", "/var/log/pods",
                "/var/lib/cni"]


def namespace_argv(node_ip: str, relay_fd: int, relay_port: int, lifeline_fd: int,
                   command: list[str]) -> list[str]:
    """The command that creates the namespace and runs ``command`` inside (pass both fds):
    connections to ``relay_fd`` reach ``relay_port`` on the namespace's loopback."""
    return ["unshare", "--mount", "--net", "--pid", "--fork", "--mount-proc",
            "--propagation", "private", "--",
            sys.executable, "-m", "e2e.netns", "init", "--node-ip", node_ip,
            "--relay-fd", str(relay_fd), "--target-port", str(relay_port),
            "--lifeline-fd", str(lifeline_fd), "--", *command]


def prepare(node_ip: str, scratch: Path) -> None:
    """Set the namespace up: loopback with the node IP, sysctls, private directories."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    # The kubelet refuses a node IP in 127.0.0.0/8; this one exists only in this namespace.
    subprocess.run(["ip", "addr", "add", f"{node_ip}/32", "dev", "lo"], check=True)
    # A default route, as every node has: a Service's ClusterIP that the node itself dials (the
    # apiserver calling an admission webhook's Service) is routed before kube-proxy's OUTPUT
    # DNAT rewrites it; with no route the connect fails at once ("network is unreachable"). The
    # route leads to one end of a veth pair whose other end is down: nothing leaves the node.
    subprocess.run(["ip", "link", "add", UPLINK, "type", "veth", "peer", "name", UPLINK + "-x"],
                   check=True)
    subprocess.run(["ip", "link", "set", UPLINK, "up"], check=True)
    subprocess.run(["ip", "route", "add", "default", "dev", UPLINK, "src", node_ip], check=True)
    # Mounts made below propagate between the node's components (the kubelet's volume mounts
    # reach containerd), never to the host: --propagation private cut the host's peer groups.
    subprocess.run(["mount", "--make-rshared", "/"], check=True)
    for key, value in NETNS_SYSCTLS.items():
        Path("/proc/sys", key).write_text(value)
    for directory in PRIVATE_DIRS:
        Path(directory).mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", directory], check=True)
    scratch.mkdir(parents=True, exist_ok=True)  # in the private /run, never the host's
    for key, value in KUBELET_GLOBAL_SYSCTLS.items():
        held = scratch / key.replace("/", ".")
        held.write_text(value + "\n")
        subprocess.run(["mount", "--bind", str(held), f"/proc/sys/{key}"], check=True)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy one direction until EOF, then half-close the other side."""
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def _relay_one(client: socket.socket, target: tuple[str, int]) -> None:
    with client:
        try:
            upstream = socket.create_connection(target, timeout=5)
        except OSError:
            return  # the apiserver is not up yet: the client sees a reset and retries
        with upstream:
            upstream.settimeout(None)
            back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
            back.start()
            _pump(client, upstream)
            back.join()


def relay(listener: socket.socket, target: tuple[str, int]) -> None:
    """Accept on ``listener`` (a socket of the host's namespace) and connect each client to
    ``target`` from inside this one: a socket keeps the namespace it was created in."""
    while True:
        try:
            client, _ = listener.accept()
        except OSError:  # the listener was closed: nothing more to relay
            return
        threading.Thread(target=_relay_one, args=(client, target), daemon=True).start()


def _watch_lifeline(fd: int) -> None:
    """Exit (ending the namespace) when the caller's end of the pipe closes."""
    with contextlib.suppress(OSError):
        os.read(fd, 1)
    os.kill(os.getpid(), signal.SIGTERM)


def init(args: argparse.Namespace) -> int:
    def on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    # PID 1 gets no default action for SIGTERM: without a handler it would be ignored.
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    prepare(args.node_ip, Path(args.scratch))
    listener = socket.socket(fileno=args.relay_fd)
    threading.Thread(target=relay, args=(listener, ("127.0.0.1", args.target_port)),
                     daemon=True).start()
    threading.Thread(target=_watch_lifeline, args=(args.lifeline_fd,), daemon=True).start()
    child = subprocess.Popen(args.command, pass_fds=())
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # cannot happen while the child lives; be safe
            return 1
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
            return child.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.netns")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("init", help="PID 1 of the node's namespace (see the module docstring)")
    p.add_argument("--node-ip", required=True)
    p.add_argument("--relay-fd", type=int, required=True)
    p.add_argument("--lifeline-fd", type=int, required=True)
    p.add_argument("--target-port", type=int, required=True)
    p.add_argument("--scratch", default="/run/kvpool-e2e-sysctl")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    return init(args)


if __name__ == "__main__":
    raise SystemExit(main())
