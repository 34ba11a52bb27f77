"""The real-node tier's pure parts, without a node: the settings REAL-NODE.md found required on
these machines stay in the generated configurations, and the namespace's API relay carries bytes
both ways over real sockets."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from e2e import netns, pki, realnode


def test_containerd_config_has_the_required_settings(tmp_path: Path) -> None:
    text = realnode.containerd_config(tmp_path / "c", tmp_path / "c.sock", "localhost/pause:1",
                                      tmp_path / "cni")
    assert "restrict_oom_score_adj = true" in text  # else every sandbox fails (no CAP_SYS_RESOURCE)
    assert 'BinaryName = "/usr/sbin/runc"' in text  # crun refuses the hybrid cgroup layout
    assert f'Root = "{tmp_path / "c" / "runc"}"' in text  # never the host's /run/runc
    assert 'sandbox_image = "localhost/pause:1"' in text  # nothing can be pulled
    assert "/run/containerd" not in text and "/var/lib/containerd" not in text


def test_kubelet_config_has_the_required_settings(tmp_path: Path) -> None:
    cfg = realnode.kubelet_config(tmp_path, pki.pki_paths(tmp_path / "pki"), tmp_path / "sock",
                                  realnode.cgroup_root("abc"))
    assert cfg["failCgroupV1"] is False and cfg["cgroupDriver"] == "cgroupfs"
    assert cfg["cgroupRoot"] == "/kvpool-e2e-abc"  # pod cgroups of this run only
    assert cfg["address"] == realnode.NODE_IP and not realnode.NODE_IP.startswith("127.")
    assert cfg["clusterDNS"] == [realnode.NODE_IP]


def test_cni_bridge_does_not_masquerade(tmp_path: Path) -> None:
    plugin = realnode.cni_config(tmp_path)["plugins"][0]
    assert plugin["type"] == "bridge" and plugin["ipMasq"] is False and plugin["hairpinMode"]
    assert plugin["ipam"]["dataDir"] == str(tmp_path)


def test_namespace_command_makes_every_namespace_and_passes_the_fds() -> None:
    argv = netns.namespace_argv("10.250.0.1", 7, 6443, 9, ["python", "-m", "x"])
    assert argv[:argv.index("--")] == ["unshare", "--mount", "--net", "--pid", "--fork",
                                       "--mount-proc", "--propagation", "private"]
    assert argv[-4:] == ["--", "python", "-m", "x"]
    for flag, value in [("--relay-fd", "7"), ("--target-port", "6443"), ("--lifeline-fd", "9")]:
        assert argv[argv.index(flag) + 1] == value


def test_relay_carries_bytes_both_ways_and_half_closes() -> None:
    upstream = socket.create_server(("127.0.0.1", 0))
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = upstream.accept()
        with conn:
            data = b""
            while chunk := conn.recv(65536):  # until the relay passes the client's half-close
                data += chunk
            got.append(data)
            conn.sendall(data[::-1])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    threading.Thread(target=netns.relay, args=(listener, upstream.getsockname()),
                     daemon=True).start()
    payload = bytes(range(256)) * 1000
    with upstream, listener, socket.create_connection(listener.getsockname(), timeout=10) as c:
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        back = b""
        while chunk := c.recv(65536):
            back += chunk
        server.join(10)
    assert got == [payload]
    assert back == payload[::-1]
