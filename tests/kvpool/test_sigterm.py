"""Every long-running `kvpool` command stops promptly on SIGTERM when it is PID 1, as in a container.

The kernel applies no default action to the init process of a PID namespace: a signal it has no
handler for is dropped, also when it comes from the parent namespace (where the container runtime
sends it from).  A real kubelet therefore waited out the 30 s grace period on deleting a kvpool
pod.  Each test starts one command as PID 1 of a fresh PID namespace (``unshare --pid --fork``),
sends SIGTERM from outside once the command serves, and asserts a clean exit within seconds; the
control test shows the harness reproduces the kernel's rule.  Real processes, real sockets.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.apps.cluster import LocalCluster

UNSHARE = shutil.which("unshare")
pytestmark = [
    pytest.mark.skipif(UNSHARE is None, reason="needs util-linux unshare"),
    pytest.mark.skipif(os.geteuid() != 0, reason="a new PID namespace (unshare --pid) needs root"),
]

STOP_SECONDS = 10.0
"""How long a stop may take here: far below the 30 s grace period, generous for 2 loaded cores."""


class Init:
    """A command running as PID 1 of its own PID namespace; its stdout lines are collected."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        assert UNSHARE is not None
        with open(cwd / "stderr.log", "w") as err:
            self.popen = subprocess.Popen([UNSHARE, "--pid", "--fork", "--mount-proc", *argv], cwd=cwd,
                                          stdout=subprocess.PIPE, stderr=err, text=True,
                                          env={**os.environ, **(env or {})})
        self.cwd = cwd
        self.lines: list[str] = []
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._seen:
                self.lines.append(line.rstrip())
                self._seen.notify_all()
        with self._seen:
            self.lines.append("<EOF>")
            self._seen.notify_all()

    def wait_line(self, prefix: str, timeout: float = 60.0) -> str:
        """The first stdout line starting with ``prefix`` (fails on exit or after ``timeout``)."""
        def found() -> str | None:
            return next((ln for ln in self.lines if ln.startswith(prefix) or ln == "<EOF>"), None)
        with self._seen:
            line = self._seen.wait_for(found, timeout)
        assert line and line != "<EOF>", f"no {prefix!r} line within {timeout}s; stdout {self.lines}, " \
                                         f"stderr {self.stderr()[-2000:]}"
        return line

    def stderr(self) -> str:
        return (self.cwd / "stderr.log").read_text()

    def pid1(self, timeout: float = 10.0) -> int:
        """The host pid of the namespace's PID 1: unshare's only child."""
        deadline = time.monotonic() + timeout
        children = Path(f"/proc/{self.popen.pid}/task/{self.popen.pid}/children")
        while time.monotonic() < deadline:
            kids = children.read_text().split()
            if kids:
                return int(kids[0])
            time.sleep(0.02)
        raise AssertionError("unshare started no child")

    def handles_sigterm(self) -> bool:
        status = Path(f"/proc/{self.pid1()}/status").read_text()
        caught = int(next(ln for ln in status.splitlines() if ln.startswith("SigCgt:")).split()[1], 16)
        return bool(caught & (1 << (signal.SIGTERM - 1)))

    def terminate(self) -> tuple[int, float]:
        """SIGTERM to PID 1 from the parent namespace, as the runtime sends it: (exit code, seconds)."""
        t0 = time.monotonic()
        os.kill(self.pid1(), signal.SIGTERM)
        try:
            rc = self.popen.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_SECONDS}s after SIGTERM; stderr {self.stderr()[-2000:]}")
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid1(), signal.SIGKILL)  # PID 1 takes its namespace down with it
            self.popen.wait(10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


@pytest.fixture
def init(tmp_path: Path) -> Iterator[Callable[..., Init]]:
    started: list[Init] = []

    def start(*kvpool_argv: str, env: dict[str, str] | None = None, name: str = "p") -> Init:
        cwd = tmp_path / f"{name}{len(started)}"
        cwd.mkdir()
        p = Init([sys.executable, "-m", "kvpool", *kvpool_argv], cwd, env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalCluster]:
    with LocalCluster(stores=1, sidecars=1, store_bytes=32 << 20, local_bytes=16 << 20, tls=False) as lc:
        yield lc


def test_pid1_without_a_handler_ignores_sigterm(tmp_path: Path) -> None:
    """The control: what every kvpool process did before; the harness shows the kernel's rule."""
    p = Init([sys.executable, "-c", "import time; print('READY', flush=True); time.sleep(60)"], tmp_path)
    try:
        p.wait_line("READY")
        os.kill(p.pid1(), signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            p.popen.wait(1.5)
    finally:
        p.kill()


def test_store(init: Callable[..., Init]) -> None:
    p = init("store", "--listen", "127.0.0.1:0", "--transfer-port", "0", "--dram", "16MiB", "--node-id", "s")
    p.wait_line("READY")
    assert p.terminate()[0] == 0


def test_sidecar_flushes_and_exits(init: Callable[..., Init], pool: LocalCluster, tmp_path: Path) -> None:
    p = init("sidecar", "--socket", str(tmp_path / "kvpool.sock"), "--pool", ",".join(pool.stores),
             "--local", "8MiB", "--drain-seconds", "5")
    p.wait_line("READY")
    rc, _ = p.terminate()
    assert rc == 0
    assert any(ln.startswith("FLUSHED ") for ln in p.lines), p.lines  # the graceful path ran
    assert not (tmp_path / "kvpool.sock").exists()


def test_router_api(init: Callable[..., Init], pool: LocalCluster) -> None:
    p = init("router-api", "--pool", ",".join(pool.stores), "--listen", "127.0.0.1:0", "--http", "")
    p.wait_line("READY")
    assert p.terminate()[0] == 0


def test_loadgen_holding(init: Callable[..., Init], pool: LocalCluster) -> None:
    p = init("loadgen", "--address", pool.sidecars[0], "--prompts", "2", "--prompt-blocks", "2",
             "--block-tokens", "128", "--rounds", "1", "--hold")
    summary = p.wait_line("KVPOOL_LOADGEN {")
    assert json.loads(summary.split(" ", 1)[1])["rounds"] == 1
    assert p.terminate()[0] == 0


def test_up(init: Callable[..., Init]) -> None:
    """`kvpool up` stops its store node and sidecar too: PID 1 dying would kill them anyway, so
    the exit code says the graceful path ran."""
    p = init("up", "--stores", "1", "--sidecars", "1", "--store-bytes", "16MiB", "--local-bytes", "8MiB")
    p.wait_line("ready;", timeout=120)
    assert p.terminate()[0] == 0


class SilentApiServer:
    """A TCP listener that reads requests and never answers: an API server that hangs."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            if conn.recv(4096):
                self.requests.set()
        except OSError:
            pass

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
        return path

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def silent_api(tmp_path: Path) -> Iterator[tuple[SilentApiServer, dict[str, str]]]:
    api = SilentApiServer()
    env = {"KUBECONFIG": str(api.kubeconfig(tmp_path / "kubeconfig")), "KUBERNETES_SERVICE_HOST": ""}
    try:
        yield api, env
    finally:
        api.close()


OPERATOR_ARGS = ("operator", "--metrics-port", "0", "--liveness", "", "--namespace", "kvpool-system")


def test_operator_waiting_on_the_api_server_at_startup(init: Callable[..., Init],
                                                       silent_api: tuple[SilentApiServer, dict[str, str]]) -> None:
    """Before kopf runs (its peering check hangs on the API server, 30 s per call), SIGTERM
    ends the process at once with 143: `kvpool`'s own handler, there until a command installs its own."""
    api, env = silent_api
    p = init(*OPERATOR_ARGS, env=env)
    assert api.requests.wait(60), p.stderr()[-2000:]
    assert p.handles_sigterm()
    rc, took = p.terminate()
    assert rc == 128 + signal.SIGTERM
    assert took < STOP_SECONDS


def test_operator_running(init: Callable[..., Init], silent_api: tuple[SilentApiServer, dict[str, str]]) -> None:
    """Once kopf runs (standalone: its first request comes from kopf, after it installs its
    signal handlers), SIGTERM stops the operator through kopf, with exit code 0."""
    api, env = silent_api
    p = init(*OPERATOR_ARGS, "--standalone", env=env)
    assert api.requests.wait(60), p.stderr()[-2000:]
    rc, _ = p.terminate()
    assert rc == 0, p.stderr()[-2000:]
