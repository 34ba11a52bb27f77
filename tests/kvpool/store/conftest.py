"""Harness for store-node integration tests: real `kvpool store` processes on 127.0.0.1.

Every node is a subprocess (`python -m kvpool store --listen 127.0.0.1:0 ...`) whose READY line
gives its gRPC and transfer addresses.  The ``stores`` fixture owns every process it starts and
kills it at teardown whatever happened in the test (no orphans), removes its shared-memory
arena directory, and fails the test if the node printed a Python traceback (an unhandled error
inside the node is a bug even when the caller saw a clean status).
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvpool.pool.admin_client import AdminClient
from kvpool.pool.node_client import StoreClient
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.proto import store_pb2_grpc as pbg

READY_TIMEOUT = 30.0
HERE = Path(__file__).resolve().parent


@dataclass
class StoreProcess:
    """One running store node."""

    proc: subprocess.Popen[bytes]
    address: str
    transfer_address: str
    node_id: str
    stderr_path: Path
    argv: list[str]
    clients: list[StoreClient | AdminClient] = field(default_factory=list)
    channels: list[grpc.Channel] = field(default_factory=list)

    def client(self, token: str = "", **kw: Any) -> StoreClient:
        c = StoreClient(self.address, token, **kw)
        self.clients.append(c)
        return c

    def admin(self, token: str = "") -> AdminClient:
        c = AdminClient(self.address, token)
        self.clients.append(c)
        return c

    def stub(self) -> pbg.StoreDataStub:
        """The node's ``StoreData`` service by hand (its cold calls: the data moves over the
        data session, through :meth:`client`)."""
        return pbg.StoreDataStub(self._channel())  # type: ignore[no-untyped-call]

    def admin_stub(self) -> pbg.StoreAdminStub:
        return pbg.StoreAdminStub(self._channel())  # type: ignore[no-untyped-call]

    def _channel(self) -> grpc.Channel:
        ch = grpc.insecure_channel(self.address, options=[("grpc.enable_http_proxy", 0)])
        self.channels.append(ch)
        return ch

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def close_clients(self) -> None:
        for c in self.clients:
            c.close()
        self.clients.clear()
        for ch in self.channels:
            ch.close()
        self.channels.clear()

    def kill(self) -> None:
        """SIGKILL: the node dies without any cleanup (a crash)."""
        self.close_clients()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        _close_pipes(self.proc)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait for a clean exit (SIGKILL if it does not come)."""
        self.close_clients()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        _close_pipes(self.proc)
        return int(self.proc.returncode)


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for f in (proc.stdout, proc.stderr, proc.stdin):
        if f is not None:
            f.close()


def _read_ready(proc: subprocess.Popen[bytes], timeout: float) -> str:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no READY line within {timeout} s (got {buf!r})")
        r, _, _ = select.select([fd], [], [], min(left, 0.5))
        if r:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"store exited before READY (rc={proc.wait()}, stdout={buf!r})")
            buf += chunk
    return buf.split(b"\n", 1)[0].decode()


class Stores:
    """Starts store nodes for one test and guarantees they are gone afterwards."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[StoreProcess] = []
        self.shm_dir = tempfile.mkdtemp(prefix="kvpool-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self._n = 0
        self.allow_tracebacks = False

    def start(self, dram: str = "16MiB", **kw: Any) -> StoreProcess:
        sp = self._spawn(dram, **kw)
        self._await_ready(sp)
        return sp

    def start_many(self, specs: dict[str, dict[str, Any]]) -> dict[str, StoreProcess]:
        """Start several nodes at once (their imports overlap: much faster on a loaded machine)."""
        spawned = {name: self._spawn(**{"node_id": name, **spec}) for name, spec in specs.items()}
        for sp in spawned.values():
            self._await_ready(sp)
        return spawned

    def _spawn(self, dram: str = "16MiB", *, ssd: str | None = None, ssd_path: str | Path | None = None,
               sharedfs: str | Path | None = None, tenants: list[dict[str, Any]] | None = None,
               admin_token: str | None = None, config: dict[str, Any] | None = None,
               node_id: str | None = None, closed: bool = False, extra: Sequence[str] = ()) -> StoreProcess:
        self._n += 1
        node_id = node_id or f"node-{self._n}"
        # Reads and writes that wait for the disk (promotion, demotion) are bounded by the node
        # (tierReadSeconds, demoteWaitSeconds: a miss or NO_SPACE after that); on a loaded test
        # machine those bounds are generous, so that tests of bytes are not tests of latency.
        # The slow-disk tests set them explicitly.
        doc = {"shmDir": self.shm_dir, "tierReadSeconds": 10.0, "demoteWaitSeconds": 10.0, **(config or {})}
        cfg_path = self.tmp / f"{node_id}-{self._n}.json"
        cfg_path.write_text(json.dumps(doc))
        argv = [sys.executable, "-m", "kvpool", "store", "--listen", "127.0.0.1:0", "--dram", dram,
                "--node-id", node_id, "--config", str(cfg_path)]
        if ssd is not None:
            argv += ["--ssd", ssd, "--ssd-path", str(ssd_path or self.tmp / f"ssd-{node_id}-{self._n}")]
        if sharedfs is not None:
            argv += ["--sharedfs", str(sharedfs)]
        if tenants is not None:
            tpath = self.tmp / f"tenants-{node_id}-{self._n}.json"
            tpath.write_text(json.dumps(tenants))
            argv += ["--tenants", str(tpath)]
        if admin_token:
            argv += ["--admin-token", admin_token]
        if closed:
            argv += ["--closed"]
        argv += list(extra)
        stderr_path = self.tmp / f"{node_id}-{self._n}.stderr"
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        sp = StoreProcess(proc, "", "", node_id, stderr_path, argv)
        self.procs.append(sp)
        return sp

    def _await_ready(self, sp: StoreProcess) -> None:
        try:
            line = _read_ready(sp.proc, READY_TIMEOUT)
        except Exception as exc:
            raise RuntimeError(f"{exc}\nstderr:\n{sp.stderr()}") from None
        parts = line.split()
        assert parts[0] == "READY", line
        sp.address = parts[1]
        sp.transfer_address = parts[2].removeprefix("transfer=")
        assert parts[3] == f"node={sp.node_id}", line

    def cleanup(self) -> list[str]:
        """Kill everything; return the tracebacks the nodes printed."""
        problems = []
        for sp in self.procs:
            try:
                sp.kill()
            except Exception as exc:  # keep killing the others
                problems.append(f"{sp.node_id}: kill failed: {exc}")
            text = sp.stderr()
            if "Traceback" in text and not self.allow_tracebacks:
                problems.append(f"{sp.node_id} printed a traceback:\n{text[-4000:]}")
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        return problems


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[Stores]:
    s = Stores(tmp_path)
    try:
        yield s
    finally:
        problems = s.cleanup()
    if problems:
        pytest.fail("\n".join(problems))


@pytest.fixture(scope="module")
def module_stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stores]:
    """A :class:`Stores` whose nodes live for the whole module (start them with ``start_many``)."""
    s = Stores(tmp_path_factory.mktemp("module"))
    try:
        yield s
    finally:
        problems = s.cleanup()
    if problems:
        pytest.fail("\n".join(problems))


@pytest.fixture(scope="module")
def shared_store(module_stores: Stores) -> StoreProcess:
    """One node shared by the tests of a module that do not depend on node state.

    Module scope, not session: nothing of this suite may outlive its modules (other suites check
    that no kvpool process is left behind when they finish).
    """
    return module_stores.start("64MiB")


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """A seeded generator per test (the seed is the test's name: reruns are reproducible)."""
    return random.Random(request.node.nodeid)


def rand_keys(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(32) for _ in range(n)]


def rand_values(rng: random.Random, sizes: Sequence[int]) -> list[bytes]:
    return [rng.randbytes(s) for s in sizes]


def stats_tier(stats: pb.StatsReply, name: str) -> pb.TierStats:
    for t in stats.tiers:
        if t.name == name:
            return t  # type: ignore[no-any-return]
    raise AssertionError(f"no tier {name!r} in stats: {[t.name for t in stats.tiers]}")


def stats_tenant(stats: pb.StatsReply, tenant_id: str) -> pb.TenantStats:
    for t in stats.tenants:
        if t.tenant_id == tenant_id:
            return t  # type: ignore[no-any-return]
    raise AssertionError(f"no tenant {tenant_id!r} in stats: {[t.tenant_id for t in stats.tenants]}")


def wait_for(pred: Any, timeout: float = 10.0, interval: float = 0.05, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class H:
    """Helpers handed to tests through the ``h`` fixture (test modules cannot import conftest)."""

    rand_keys = staticmethod(rand_keys)
    rand_values = staticmethod(rand_values)
    stats_tier = staticmethod(stats_tier)
    stats_tenant = staticmethod(stats_tenant)
    wait_for = staticmethod(wait_for)
    bearer = staticmethod(bearer)
    here = HERE


@pytest.fixture
def h() -> type[H]:
    return H
