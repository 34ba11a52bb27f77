"""A store node's process (`kvpool store`): the node, its gRPC services and its data session.

:func:`start_store` assembles them: the :class:`StoreNode`; the ``StoreData`` and ``StoreAdmin``
services (:mod:`.data_service`, :mod:`.admin_service`) on one gRPC port, the admin one behind its
credential check; the one-round-trip data session (:mod:`.data_session`), the node's only wire for
bytes, served on the transfer port by a :class:`~kvpool.transfer.TransferServer` that exposes no
segment (no peer reaches the DRAM arena by offset).  With a TLS configuration (``--tls-dir`` or
``--tls-cert/--tls-key/--tls-ca``) both ports are mutual TLS against the pool's CA bundle
(:mod:`kvpool.wire.tls`) and the admin service also wants the operator's certificate; the node's
own clients (a drain's pushes) use the same files.  :func:`serve_forever` runs it until SIGTERM,
with the housekeeping (expiry sweep, master-key reload).  :func:`build_parser` and :func:`main` are
the command line (``kvpool store``; its flags in groups).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc

from kvpool.core.signals import stop_on_signals
from kvpool.core.tickets import TicketBook
from kvpool.core.units import parse_bytes
from kvpool.store.admin_service import AdminGate, StoreAdminService
from kvpool.store.data_service import StoreDataService
from kvpool.store.data_session import DataSessionHandler
from kvpool.store.metrics import StoreMetrics
from kvpool.store.node import NodeConfig, StoreNode, Tenant
from kvpool.store.rdma import StoreRdma
from kvpool.transfer import SegmentRegistry, TransferServer
from kvpool.wire import metrics_http
from kvpool.wire.kv_events import add_event_args
from kvpool.wire.proto import store_pb2_grpc as pbg
from kvpool.wire.tls import TlsConfig, TlsError, add_port, add_tls_args
from kvpool.wire.tls import from_args as tls_from_args
from kvpool.wire.tls import install as install_tls

log = logging.getLogger("kvpool.store")


@dataclass
class RunningStore:
    node: StoreNode
    server: grpc.Server
    transfer: TransferServer
    address: str
    transfer_address: str
    rdma: StoreRdma | None = None
    metrics: metrics_http.MetricsServer | None = None
    """The ``/metrics`` endpoint (None: ``--metrics-port 0``)."""

    def stop(self, grace: float = 1.0) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.server.stop(grace).wait()
        self.transfer.stop()
        if self.rdma is not None:
            self.rdma.close()
        self.node.close()


def start_store(cfg: NodeConfig, listen: str, transfer_port: int | None = None, admin_token: str = "",
                workers: int = 8, metrics_port: int = 0, tls: TlsConfig | None = None,
                plaintext_data: bool = False) -> RunningStore:
    """Start a node and its services on ``listen``; ``metrics_port``: its ``/metrics`` on the same
    host (0: none, :data:`~kvpool.wire.metrics_http.EPHEMERAL`: any free port); ``tls``: both ports
    mutual TLS (:mod:`kvpool.wire.tls`); ``plaintext_data``: the data session is not encrypted (a
    trusted network's opt-out), its connections authenticated by tickets from the (TLS) control
    channel instead."""
    host, _, port_s = listen.rpartition(":")
    host = host or "127.0.0.1"
    node = StoreNode(cfg)
    if cfg.events is not None:
        from kvpool.wire.kv_events import MEDIUM_POOL, EventPublisher
        node.events = EventPublisher(cfg.events, MEDIUM_POOL, node.events_snapshot)
    tport = transfer_port if transfer_port is not None else (int(port_s) + 1 if int(port_s) else 0)
    admin = StoreAdminService(node)
    metrics = StoreMetrics(node.stats, admin.drain.status, admin.warm.status) if metrics_port else None
    tickets = TicketBook() if plaintext_data else None
    handler = DataSessionHandler(node, observe=metrics.observe if metrics is not None else None, tickets=tickets)
    transfer = TransferServer(SegmentRegistry(), host=host, port=tport, sessions={DataSessionHandler.magic: handler},
                              tls=None if plaintext_data else tls)
    transfer.start()
    rdma = StoreRdma.open(node, cfg.rdma, cfg.rdma_shared_tenants)  # None: no device, TCP only
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc"),
                         interceptors=[AdminGate(admin_token, require_operator=tls is not None)],
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20),
                                  ("grpc.so_reuseport", 0)])
    data = StoreDataService(node, transfer.address, admin_token, rdma, tickets, require_operator=tls is not None)
    pbg.add_StoreDataServicer_to_server(data, server)
    pbg.add_StoreAdminServicer_to_server(admin, server)
    bound = add_port(server, f"{host}:{port_s}", tls)
    if bound == 0:
        transfer.stop()
        if rdma is not None:
            rdma.close()
        node.close()
        raise OSError(f"cannot listen on {listen}")
    server.start()
    running = RunningStore(node, server, transfer, f"{host}:{bound}", transfer.address, rdma)
    if metrics is not None:
        try:
            running.metrics = metrics_http.serve(metrics_port, host, metrics.registry)
        except OSError:
            running.stop(0)
            raise
    return running


def serve_forever(cfg: NodeConfig, listen: str, transfer_port: int | None, admin_token: str,
                  tenants: list[Tenant] | None = None, expire_interval: float = 30.0, metrics_port: int = 0,
                  tls: TlsConfig | None = None, plaintext_data: bool = False) -> int:
    try:
        running = start_store(cfg, listen, transfer_port, admin_token, metrics_port=metrics_port, tls=tls,
                              plaintext_data=plaintext_data)
    except (RuntimeError, OSError) as exc:  # a clear line, not a traceback, for a config problem
        print(f"kvpool store: cannot start: {exc}", file=sys.stderr, flush=True)
        return 2
    if tenants:
        running.node.set_tenants(tenants)
    watcher = None
    if cfg.master_key_file:
        from kvpool.store.keywatch import MasterKeyWatcher
        watcher = MasterKeyWatcher(running.node, cfg.master_key_file, cfg.previous_master_keys_file,
                                   cfg.master_key_reload_seconds).start()
    stop = stop_on_signals()
    print(f"READY {running.address} transfer={running.transfer_address} node={cfg.node_id}"
          + (f" metrics={running.metrics.address}" if running.metrics is not None else ""), flush=True)
    while not stop.wait(expire_interval):
        try:
            running.node.expire_sweep()
        except Exception:  # never let housekeeping kill the node
            log.exception("expire sweep failed")
    if watcher is not None:
        watcher.stop()
    running.stop()
    time.sleep(0)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpool store",
                                 description="Run a store node: a shard of the pool (DRAM, SSD, shared-fs tiers)")
    member = ap.add_argument_group("pool membership")
    member.add_argument("--listen", default="127.0.0.1:7400", help="HOST:PORT of the control API (gRPC)")
    member.add_argument("--transfer-port", type=int, default=None,
                        help="port of the transfer server (default: listen port + 1, or ephemeral for port 0)")
    member.add_argument("--node-id", default=None,
                        help="this node's id in the ring (default: the config's nodeId, $KVPOOL_NODE_ID "
                             "or the host name)")
    member.add_argument("--config", default=None, help="JSON node configuration (the operator's ConfigMap)")

    cap = ap.add_argument_group("capacity (tiers)")
    cap.add_argument("--dram", type=parse_bytes, default=None, help="DRAM arena payload capacity")
    cap.add_argument("--ssd-path", default=None, help="directory of the SSD tier")
    cap.add_argument("--ssd", type=parse_bytes, default=None, help="SSD tier capacity")
    cap.add_argument("--sharedfs", default=None, help="directory of a shared-filesystem tier")
    cap.add_argument("--rdma", default=None,
                     help="RDMA device serving one-sided reads of the DRAM arena: auto (default, also "
                          "$KVPOOL_RDMA), off, device:NAME, or sim:DIR (a simulated fabric, for tests)")
    cap.add_argument("--rdma-shared-tenants", action="store_true", default=None,
                     help="serve RDMA although several tenants share the node (one rkey reads the whole "
                          "arena: only for tenants that trust each other)")

    sec = ap.add_argument_group("security")
    sec.add_argument("--tenants", default=None, help="JSON file of tenants (id, token, salt, quota, ttl)")
    sec.add_argument("--closed", action="store_true", help="refuse calls without a tenant token")
    sec.add_argument("--admin-token", default=None, help="token of the admin calls (SetRing, Drain, ...)")
    sec.add_argument("--admin-token-file", default=None, help="file holding the admin token (a mounted Secret)")
    add_tls_args(sec)
    sec.add_argument("--plaintext-data-session", action="store_true",
                     help="do not encrypt the data session (bulk bytes), for a trusted network: its connections "
                          "are authenticated by one-use tickets from the TLS control channel, and no token "
                          "crosses it (the KVPool's spec.security.dataSession: Plaintext)")
    sec.add_argument("--master-key-file", default=None,
                     help="file holding the master key of encryption at rest (a mounted Secret, >= 32 bytes): "
                          "objects on the SSD and shared-filesystem tiers are encrypted per tenant")
    sec.add_argument("--previous-master-keys-file", default=None,
                     help="file of earlier master keys, one per line, still opened but never used to seal "
                          "(key rotation; a missing file holds none); both files are re-read when they change")

    obs = ap.add_argument_group("observability (metrics, KV events)")
    obs.add_argument("--metrics-port", type=metrics_http.parse_port, default=0,
                     help="port of the Prometheus /metrics endpoint, on the host of --listen (0: none; "
                          "auto: any free port, printed on the READY line)")
    add_event_args(obs)
    obs.add_argument("--events-tenant", default="default", help="the tenant whose block events are published")

    test = ap.add_argument_group("testing/fault injection")
    test.add_argument("--fault-tier-delay-file", default=None,
                      help="test hook: while this file exists, each SSD/shared-fs I/O sleeps the seconds it holds")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """`kvpool store ...`: parse the flags, load the configuration and tenants, serve."""
    from kvpool.store.config import load_node_config, load_tenants

    args = build_parser().parse_args(argv)
    try:
        tls = tls_from_args(args)
    except TlsError as exc:
        print(f"kvpool store: {exc}", file=sys.stderr, flush=True)
        return 2
    install_tls(tls)  # the node's own clients (drain and warm-up pushes) use it too
    cfg = load_node_config(args)
    tenants = load_tenants(args.tenants) if args.tenants else []
    admin = args.admin_token or ""
    if args.admin_token_file:
        with open(args.admin_token_file) as f:
            admin = f.read().strip()
    return serve_forever(cfg, args.listen, args.transfer_port, admin, tenants, metrics_port=args.metrics_port,
                         tls=tls, plaintext_data=args.plaintext_data_session)


if __name__ == "__main__":
    sys.exit(main())
