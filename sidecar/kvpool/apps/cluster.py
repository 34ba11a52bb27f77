"""An embedded local pool: store nodes and sidecars as real processes on 127.0.0.1.

``LocalCluster`` is what tests, benchmarks and the demo run against, and ``kvpool up`` runs one
in the foreground.  Every process is started in a fresh temporary directory, dies with its parent
(PR_SET_PDEATHSIG) and is stopped on exit, exceptions included: no orphans.

TLS is on by default, as in a pool the operator runs: a throw-away CA in the cluster's directory
issues each store node a certificate (``node/<id>``, serving 127.0.0.1 and localhost), each
sidecar its tenant's (``tenant/<id>``), and the cluster's own admin calls the operator's
(:mod:`kvpool.core.pki`); clients of its nodes in this process use the operator's
(:func:`kvpool.wire.tls.use_for`).  ``tls=False`` runs every channel in plaintext (the capture
test's control, and a peer benchmark that needs the old wire).  ``kube_certs`` issues them in the
shapes the operator gives them in Kubernetes instead, where no certificate names the address a
client dials: the store nodes one certificate named by the pool's Service
(:data:`KUBE_SERVER_NAME`, which clients check with ``--tls-server-name``), sidecars and the
operator an identity and no serving name.  The default (``tls=None``) is TLS
wherever the ``cryptography`` package that makes the CA is importable (the project's environment;
an engine's venv built without the ``dataplane`` extra runs its clusters in plaintext).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any, cast

from kvpool.core import pki
from kvpool.core.deadlines import ClientDeadlines
from kvpool.core.push_status import WarmStatus
from kvpool.core.signals import stop_on_signals
from kvpool.pool.admin_client import AdminClient
from kvpool.wire import tls as wtls
from kvpool.wire.proto import store_pb2 as pb

KUBE_POOL, KUBE_NAMESPACE = "local", "kvpool"
"""The pool and namespace ``LocalCluster(kube_certs=True)`` names its certificates after."""
KUBE_SERVER_NAME = f"{KUBE_POOL}-store.{KUBE_NAMESPACE}.svc"
"""The store nodes' name clients check with ``kube_certs`` (the operator's ``--tls-server-name``)."""

# Children arm PR_SET_PDEATHSIG themselves (kvpool/__main__.py reads this variable) instead of
# through preexec_fn: preexec_fn forces a full fork() that runs gRPC's fork handlers, which abort
# the child when another thread of the parent has calls in flight (grpc/grpc#43055).
DIE_WITH_PARENT_ENV = "KVPOOL_DIE_WITH_PARENT"
SHM_DIR = "/dev/shm"
"""Where sidecars put their arenas (memory-backed, as the socket volume of a pod)."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    ready_line: str = ""
    log_path: str = ""
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid


def launch(name: str, argv: list[str], workdir: str, env: dict[str, str] | None = None) -> Proc:
    """Start a kvpool process (stderr goes to a log file); :func:`wait_ready` waits for it."""
    log_path = os.path.join(workdir, f"{name}.log")
    log_f: IO[str] = open(log_path, "w")  # noqa: SIM115 - handed to the child
    try:
        popen = subprocess.Popen([sys.executable, "-m", "kvpool", *argv], stdout=subprocess.PIPE, stderr=log_f,
                                 text=True, cwd=workdir,
                                 env={**os.environ, **(env or {}), DIE_WITH_PARENT_ENV: str(os.getpid())})
    finally:
        log_f.close()
    proc = Proc(name, popen, log_path=log_path)

    def reader() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            proc.lines.append(line.rstrip())
            if line.startswith("READY") and not proc.ready.is_set():
                proc.ready_line = line.strip()
                proc.ready.set()
        proc.ready.set()  # EOF: the process exited (or closed stdout) before or after READY

    proc.reader = threading.Thread(target=reader, name=f"{name}-stdout", daemon=True)
    proc.reader.start()
    return proc


def wait_ready(proc: Proc, timeout: float = 60.0) -> Proc:
    """Wait for ``proc``'s READY line; on failure kill it and raise with the tail of its log."""
    if not proc.ready.wait(timeout) or not proc.ready_line:
        proc.popen.kill()
        proc.popen.wait()
        close_pipes(proc)
        with open(proc.log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{proc.name} did not become ready (exit {proc.popen.returncode}):\n{tail}")
    return proc


def spawn(name: str, argv: list[str], workdir: str, timeout: float = 60.0,
          env: dict[str, str] | None = None) -> Proc:
    """Start a kvpool process and wait for its READY line (stderr goes to a log file)."""
    proc = launch(name, argv, workdir, env)
    try:
        return wait_ready(proc, timeout)
    except BaseException:
        stop_procs([proc], grace=0)
        raise


def stop_procs(procs: Sequence[Proc], grace: float = 10.0, sig: signal.Signals = signal.SIGTERM) -> None:
    """Send ``sig`` to each process still running, wait ``grace`` seconds for them all to exit
    (SIGKILL after), and close their pipes."""
    for p in procs:
        if p.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(sig)
    deadline = time.time() + grace
    for p in procs:
        try:
            p.popen.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()
    for p in procs:
        close_pipes(p)


def close_pipes(p: Proc) -> None:
    """After the process exited: let the reader see EOF, then close our end of its stdout."""
    if p.reader is not None:
        p.reader.join(timeout=5)
    if p.popen.stdout is not None and (p.reader is None or not p.reader.is_alive()):
        p.popen.stdout.close()


class LocalCluster:
    """N store nodes + M sidecars on 127.0.0.1; a context manager.

    ``store_bytes`` and ``local_bytes`` are payload capacities.  ``tenants`` names the tenant of
    each sidecar (default: one tenant for all).  Attributes: ``sidecars`` (addresses for
    ``kvpool.connect``), ``stores``, ``store_pids``, ``sidecar_pids``, and the ``/metrics``
    endpoints every process serves on an ephemeral 127.0.0.1 port: :meth:`metrics_url`.
    """

    def __init__(self, stores: int = 2, sidecars: int = 1, store_bytes: int = 256 << 20,
                 local_bytes: int = 64 << 20, ssd_bytes: int = 0, tenants: Sequence[str] | None = None,
                 block_tokens: int = 128, write_back: bool = False, drain_seconds: float = 10.0,
                 quotas: dict[str, int] | None = None, store_config: dict[str, Any] | None = None,
                 handoff: bool = True, replication: int = 1, sidecar_args: Sequence[str] = (),
                 tls: bool | None = None, store_args: Sequence[str] = (), kube_certs: bool = False,
                 client_deadlines: ClientDeadlines | None = None) -> None:
        if tenants is not None and len(tenants) != sidecars:
            raise ValueError(f"tenants names {len(tenants)} tenants for {sidecars} sidecars")
        self.n_stores, self.n_sidecars = stores, sidecars
        self.store_bytes, self.local_bytes, self.ssd_bytes = store_bytes, local_bytes, ssd_bytes
        self.tenant_ids = list(tenants) if tenants is not None else ["default"] * sidecars
        self.block_tokens = block_tokens
        self.write_back = write_back
        self.drain_seconds = drain_seconds
        self.quotas = quotas or {}
        self.store_config = store_config or {}
        self.handoff = handoff
        self.replication = replication
        self.sidecar_args = tuple(sidecar_args)  # flags every sidecar starts with (a test's deadlines)
        self.store_args = tuple(store_args)  # flags every store node starts with
        self.client_deadlines = client_deadlines  # the bounds of :meth:`connect`'s clients (None: defaults)
        self.tls = tls if tls is not None else importlib.util.find_spec("cryptography") is not None
        self.kube_certs = kube_certs
        if kube_certs and not self.tls:
            raise ValueError("kube_certs shapes TLS certificates: it needs tls")
        self.server_name = KUBE_SERVER_NAME if kube_certs else ""
        """The name clients check in store nodes' certificates ("": their address)."""
        self.ca: pki.KeyPair | None = None
        """The cluster's throw-away CA (with ``tls``)."""
        self.client_tls: wtls.TlsConfig | None = None
        """The operator's certificate: the cluster's admin calls and this process's clients."""
        """Copies of each block (the ring's ``replicas``, as ``spec.storage.replication``)."""
        self.admin_token = secrets.token_hex(16)
        self.tokens = {t: secrets.token_hex(16) for t in sorted(set(self.tenant_ids)) if t != "default"}
        self.store_procs: list[Proc] = []
        self.sidecar_procs: list[Proc] = []
        self._sidecar_launches: list[tuple[str, int | None, tuple[str, ...]]] = []
        self._dead_sidecars: list[Proc] = []
        """Earlier lives of restarted sidecars (``restart_sidecar``)."""
        self.stores: list[str] = []
        self.sidecars: list[str] = []
        self.store_ids: list[str] = []
        self.epoch = 0
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.workdir = ""

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvpool-local-")
        self.workdir = self._tmp.name
        try:
            if self.tls:
                self.ca = pki.make_ca("kvpool LocalCluster CA", days=7)
                self.client_tls = (self.issue("operator", pki.operator(), dns=(), ips=(), server=False)
                                   if self.kube_certs else self.issue("operator", pki.operator()))
            self._write_tenants()
            # Start the processes of each kind concurrently: most of a start is the interpreter
            # importing numpy and grpc, which overlaps well.
            stores = [self._launch_store() for _ in range(self.n_stores)]
            for proc, node_id in stores:
                self._register_store(proc, node_id)
            if self.n_stores:
                self.publish_ring()
            sidecars = [self._launch_sidecar(self.tenant_ids[i], extra_args=self.sidecar_args)
                        for i in range(self.n_sidecars)]
            for proc, addr in sidecars:
                self._register_sidecar(proc, addr)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop_procs(self.sidecar_procs, grace=self.drain_seconds + 5)
        stop_procs(self.store_procs)
        for addr in self.stores:
            wtls.use_for(addr, None)
        from kvpool.sidecar.journal import remove_files
        for addr in self.sidecars:
            # The arenas a sidecar keeps for its next life (in /dev/shm, outside the workdir).
            remove_files(SHM_DIR, addr[len("unix://"):])
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def issue(self, name: str, identity: pki.Identity | None, ca: pki.KeyPair | None = None, *,
              dns: Sequence[str] = ("localhost",), ips: Sequence[str] = ("127.0.0.1",),
              server: bool = True) -> wtls.TlsConfig:
        """A certificate of ``identity`` from the cluster's CA (or ``ca``), serving ``dns`` and
        ``ips`` (default 127.0.0.1 and localhost), written as a TLS directory ``tls/<name>`` that
        trusts the cluster's CA; its clients check store nodes by :attr:`server_name`."""
        assert self.ca is not None, "a cluster started with tls=False has no CA"
        pair = pki.issue(ca or self.ca, identity, dns=dns, ips=ips, days=7, server=server)
        directory = os.path.join(self.workdir, "tls", name)
        wtls.write_dir(directory, pair, self.ca.cert_pem)
        return wtls.TlsConfig.from_dir(directory, self.server_name)

    def _tls_args(self, name: str, identity: pki.Identity) -> list[str]:
        if not self.tls:
            return []
        d = os.path.join(self.workdir, "tls", name)
        if not os.path.isdir(d):  # a restart keeps its first life's certificate
            if not self.kube_certs:
                self.issue(name, identity)
            elif identity.role == pki.ROLE_NODE:  # every node the pool's one, named by its Service
                self.issue(name, pki.node(f"{KUBE_POOL}-store"), ips=(),
                           dns=(KUBE_SERVER_NAME, f"*.{KUBE_SERVER_NAME}"))
            else:
                self.issue(name, identity, dns=(), ips=())
        return ["--tls-dir", d, *(["--tls-server-name", self.server_name] if self.server_name else [])]

    def _write_tenants(self) -> None:
        doc = [{"tenantId": t, "token": tok, "salt": base64.b64encode(secrets.token_bytes(16)).decode(),
                "quotaBytes": self.quotas.get(t, 0)} for t, tok in self.tokens.items()]
        self.tenants_file = os.path.join(self.workdir, "tenants.json")
        with open(self.tenants_file, "w") as f:
            json.dump(doc, f)
        # One handoff key for all sidecars of the cluster (as a mounted secret would be).
        self.handoff_key_file = os.path.join(self.workdir, "handoff.key")
        with open(self.handoff_key_file, "w") as f:
            f.write(secrets.token_hex(32))
        os.chmod(self.handoff_key_file, 0o600)
        self.config_file = os.path.join(self.workdir, "store-config.json")
        with open(self.config_file, "w") as f:
            json.dump(self.store_config, f)

    def _launch_store(self) -> tuple[Proc, str]:
        i = len(self.store_procs)
        node_id = f"store-{i}"
        d = os.path.join(self.workdir, node_id)
        os.makedirs(d)
        argv = ["store", "--listen", "127.0.0.1:0", "--transfer-port", "0", "--dram", str(self.store_bytes),
                "--node-id", node_id, "--admin-token", self.admin_token, "--tenants", self.tenants_file,
                "--config", self.config_file, "--metrics-port", "auto",
                *self._tls_args(node_id, pki.node(node_id)), *self.store_args]
        if self.ssd_bytes:
            argv += ["--ssd-path", os.path.join(d, "ssd"), "--ssd", str(self.ssd_bytes)]
        if self.tokens and "default" not in self.tenant_ids:
            argv.append("--closed")
        proc = launch(node_id, argv, d)
        self.store_procs.append(proc)  # owned from now on: stopped by __exit__ whatever happens
        return proc, node_id

    def _register_store(self, proc: Proc, node_id: str) -> str:
        wait_ready(proc)
        addr = proc.ready_line.split()[1]
        wtls.use_for(addr, self.client_tls)
        self.stores.append(addr)
        self.store_ids.append(node_id)
        return addr

    def add_store(self, publish: bool = True) -> str:
        """Start one more store node; with ``publish`` a new ring epoch includes it."""
        addr = self._register_store(*self._launch_store())
        if publish:
            self.publish_ring()
        return addr

    def restart_store(self, i: int, timeout: float = 60.0) -> str:
        """Start store node ``i`` again on the same address, transfer port and node id, in its
        own directory (what a pod's ``restartPolicy: Always`` does after a crash), killing it
        first if it still runs; the current ring is pushed to it at the current epoch, as the
        operator re-pushes it to a node that restarted.  Its DRAM tier starts empty."""
        old = self.store_procs[i]
        stop_procs([old], timeout, signal.SIGKILL)
        node_id, addr = self.store_ids[i], self.stores[i]
        transfer = next((w.split("=", 1)[1] for w in old.ready_line.split() if w.startswith("transfer=")), "")
        argv = list(cast(list[str], old.popen.args))[3:]  # [python, -m, kvpool, *argv]
        argv[argv.index("--listen") + 1] = addr
        argv[argv.index("--transfer-port") + 1] = transfer.rpartition(":")[2] or "0"
        lives = sum(1 for name in os.listdir(os.path.dirname(old.log_path)) if name.startswith(f"{node_id}.")) + 1
        proc = launch(f"{node_id}.{lives}", argv, os.path.dirname(old.log_path))
        self.store_procs[i] = proc
        wait_ready(proc, timeout)
        if self.epoch:
            with self.admin(addr) as c:
                c.set_ring(self._ring_pb())
        return addr

    def _launch_sidecar(self, tenant: str, local_bytes: int | None = None,
                        extra_args: Sequence[str] = (), index: int | None = None) -> tuple[Proc, str]:
        """Start sidecar ``index`` (default: a new one) in its own directory; a restart
        (``index`` given) reuses the directory, and so the socket and the arena's name."""
        i = len(self.sidecar_procs) if index is None else index
        d = os.path.join(self.workdir, f"sidecar-{i}")
        os.makedirs(d, exist_ok=index is not None)
        sock = os.path.join(d, "kvpool.sock")
        local = self.local_bytes if local_bytes is None else local_bytes
        argv = ["sidecar", "--socket", sock, "--pool", ",".join(self.stores), "--local", str(local),
                "--drain-seconds", str(self.drain_seconds), "--log-level", "WARNING",
                "--metrics-port", "auto", "--metrics-addr", "127.0.0.1"]
        if tenant != "default":
            cred = os.path.join(d, "credentials.json")
            with open(cred, "w") as f:
                json.dump({"tenantId": tenant, "token": self.tokens[tenant]}, f)
            argv += ["--credentials", cred]
        if self.write_back:
            argv.append("--write-back")
        argv += self._tls_args(f"sidecar-{i}", pki.tenant(tenant))
        if self.handoff:
            argv += ["--handoff-listen", "127.0.0.1:0", "--handoff-key-file", self.handoff_key_file]
        if os.path.isdir(SHM_DIR) and "--arena-dir" not in extra_args:
            # As in a pod (the socket's emptyDir is medium Memory): the workdir may be on disk,
            # where every write to the arena would dirty page-cache pages bound for writeback.
            argv += ["--arena-dir", SHM_DIR]
        argv += list(extra_args)
        lives = sum(1 for p in self._dead_sidecars if p.log_path.startswith(d + os.sep))
        proc = launch(f"sidecar-{i}" if index is None else f"sidecar-{i}-life{lives + 1}", argv, d)
        if index is None:
            self.sidecar_procs.append(proc)
            self._sidecar_launches.append((tenant, local_bytes, tuple(extra_args)))
        else:
            self._dead_sidecars.append(self.sidecar_procs[i])
            self.sidecar_procs[i] = proc
        return proc, f"unix://{sock}"

    def _register_sidecar(self, proc: Proc, address: str) -> str:
        wait_ready(proc)
        self.sidecars.append(address)
        return address

    def add_sidecar(self, tenant: str = "default", local_bytes: int | None = None,
                    extra_args: Sequence[str] = ()) -> str:
        """Start one more sidecar (of ``tenant``; ``local_bytes`` defaults to the cluster's)."""
        return self._register_sidecar(*self._launch_sidecar(tenant, local_bytes, extra_args))

    def restart_sidecar(self, i: int, kill: bool = True, local_bytes: int | None = None,
                        extra_args: Sequence[str] | None = None, timeout: float = 60.0) -> str:
        """Stop sidecar ``i`` (SIGKILL with ``kill``, else SIGTERM and its drain) and start it
        again on the same socket and arena directory, as a pod's ``restartPolicy: Always``
        does; waits for READY.  ``local_bytes`` / ``extra_args`` (appended to the first
        start's) change its configuration for this life.  Its address is unchanged."""
        stop_procs([self.sidecar_procs[i]], self.drain_seconds + 10, signal.SIGKILL if kill else signal.SIGTERM)
        tenant, first_local, first_extra = self._sidecar_launches[i]
        extra = list(first_extra) + list(extra_args or ())
        new, addr = self._launch_sidecar(tenant, first_local if local_bytes is None else local_bytes, extra, index=i)
        wait_ready(new, timeout)
        return addr

    def _ring_pb(self, draining: Sequence[str] = ()) -> pb.Ring:
        return pb.Ring(epoch=self.epoch, replicas=self.replication, members=[
            pb.RingMember(id=nid, address=addr, state="draining" if nid in draining else "active")
            for nid, addr, p in zip(self.store_ids, self.stores, self.store_procs, strict=True)
            if p.popen.poll() is None])

    def publish_ring(self, draining: Sequence[str] = ()) -> int:
        """Push a new ring epoch to every live store node (what the operator does in Kubernetes)."""
        self.epoch += 1
        ring = self._ring_pb(draining)
        for addr, p in zip(self.stores, self.store_procs, strict=True):
            if p.popen.poll() is None:
                with self.admin(addr) as c:
                    c.set_ring(ring)
        return self.epoch

    def warm(self, added: Sequence[str], deadline_seconds: float = 60.0, max_bytes_per_second: int = 0,
             fraction: float = 0.0) -> dict[str, WarmStatus]:
        """After a scale-up: each previous owner pushes its hottest objects now owned by ``added``
        to them (what the operator does on scale-up); their first answers by node id."""
        ring = self._ring_pb()
        deadline = int((time.time() + deadline_seconds) * 1000)
        out = {}
        for nid, addr, p in zip(self.store_ids, self.stores, self.store_procs, strict=True):
            if nid not in added and p.popen.poll() is None:
                with self.admin(addr) as c:
                    out[nid] = c.warm(ring, added, deadline, max_bytes_per_second, fraction)
        return out

    def warm_status(self) -> dict[str, WarmStatus]:
        """Every live store node's warm-up progress by node id."""
        out = {}
        for nid, addr, p in zip(self.store_ids, self.stores, self.store_procs, strict=True):
            if p.popen.poll() is None:
                with self.admin(addr) as c:
                    out[nid] = c.warm_status()
        return out

    def metrics_url(self, kind: str, i: int) -> str:
        """The ``/metrics`` URL of store node or sidecar ``i`` (``kind`` "store" or "sidecar"; its
        current life: the address is on its READY line)."""
        procs = {"store": self.store_procs, "sidecar": self.sidecar_procs}[kind]
        addr = next((w.split("=", 1)[1] for w in procs[i].ready_line.split() if w.startswith("metrics=")), "")
        if not addr:
            raise RuntimeError(f"{kind} {i} serves no metrics")
        return f"http://{addr}/metrics"

    def admin(self, address: str) -> AdminClient:
        return AdminClient(address, self.admin_token, tls=self.client_tls or False)

    def connect(self, i: int = 0) -> Any:
        from kvpool.client.client import connect
        return connect(self.sidecars[i], block_tokens=self.block_tokens, deadlines=self.client_deadlines)

    @property
    def store_pids(self) -> list[int]:
        return [p.pid for p in self.store_procs]

    @property
    def sidecar_pids(self) -> list[int]:
        return [p.pid for p in self.sidecar_procs]

    @property
    def pids(self) -> list[int]:
        return self.store_pids + self.sidecar_pids


def build_parser() -> argparse.ArgumentParser:
    from kvpool.core.units import parse_bytes

    ap = argparse.ArgumentParser(prog="kvpool up", description=main.__doc__)
    shape = ap.add_argument_group("pool membership")
    shape.add_argument("--stores", type=int, default=2, help="store nodes (default 2)")
    shape.add_argument("--sidecars", type=int, default=1, help="sidecars, each on its own unix socket (default 1)")
    cap = ap.add_argument_group("capacity")
    cap.add_argument("--store-bytes", type=parse_bytes, default=256 << 20,
                     help="DRAM of each store node (default 256MiB)")
    cap.add_argument("--local-bytes", type=parse_bytes, default=64 << 20,
                     help="local tier of each sidecar (default 64MiB)")
    cap.add_argument("--ssd-bytes", type=parse_bytes, default=0,
                     help="SSD tier of each store node, in a temporary directory (default 0: none)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """`kvpool up`: run a LocalCluster in the foreground and print its addresses until Ctrl-C."""
    args = build_parser().parse_args(argv)
    stop = stop_on_signals()
    with LocalCluster(stores=args.stores, sidecars=args.sidecars, store_bytes=args.store_bytes,
                      local_bytes=args.local_bytes, ssd_bytes=args.ssd_bytes) as lc:
        for a, pid in zip(lc.stores, lc.store_pids, strict=True):
            print(f"store    {a}  pid {pid}")
        for a, pid in zip(lc.sidecars, lc.sidecar_pids, strict=True):
            print(f"sidecar  {a}  pid {pid}")
        print("ready; Ctrl-C to stop", flush=True)
        stop.wait()
    return 0
