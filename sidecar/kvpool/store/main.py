"""A store node's process (`kvpool store`): the node, its gRPC services and its data session.

:func:`start_store` assembles them: the :class:`StoreNode`; the ``StoreData`` and ``StoreAdmin``
services (:mod:`.data_service`, :mod:`.admin_service`) on one gRPC port, the admin one behind its
credential check; the one-round-trip data session (:mod:`.data_session`), the node's only wire for
bytes, served on the transfer port by a :class:`~kvpool.transfer.TransferServer` that exposes no
segment (no peer reaches the DRAM arena by offset).  :func:`serve_forever` runs it until SIGTERM,
with the housekeeping (expiry sweep, master-key reload).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc

from kvpool.store.admin_service import AdminGate, StoreAdminService
from kvpool.store.data_service import StoreDataService
from kvpool.store.data_session import DataSessionHandler
from kvpool.store.node import NodeConfig, StoreNode, Tenant
from kvpool.transfer import SegmentRegistry, TransferServer
from kvpool.wire.proto import store_pb2_grpc as pbg

log = logging.getLogger("kvpool.store")


@dataclass
class RunningStore:
    node: StoreNode
    server: grpc.Server
    transfer: TransferServer
    address: str
    transfer_address: str

    def stop(self, grace: float = 1.0) -> None:
        self.server.stop(grace).wait()
        self.transfer.stop()
        self.node.close()


def start_store(cfg: NodeConfig, listen: str, transfer_port: int | None = None, admin_token: str = "",
                workers: int = 8) -> RunningStore:
    host, _, port_s = listen.rpartition(":")
    host = host or "127.0.0.1"
    node = StoreNode(cfg)
    if cfg.events is not None:
        from kvpool.wire.kv_events import MEDIUM_POOL, EventPublisher
        node.events = EventPublisher(cfg.events, MEDIUM_POOL, node.events_snapshot)
    tport = transfer_port if transfer_port is not None else (int(port_s) + 1 if int(port_s) else 0)
    transfer = TransferServer(SegmentRegistry(), host=host, port=tport,
                              sessions={DataSessionHandler.magic: DataSessionHandler(node)})
    transfer.start()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc"),
                         interceptors=[AdminGate(admin_token)],
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20),
                                  ("grpc.so_reuseport", 0)])
    pbg.add_StoreDataServicer_to_server(StoreDataService(node, transfer.address, admin_token), server)
    pbg.add_StoreAdminServicer_to_server(StoreAdminService(node), server)
    bound = server.add_insecure_port(f"{host}:{port_s}")
    if bound == 0:
        transfer.stop()
        node.close()
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return RunningStore(node, server, transfer, f"{host}:{bound}", transfer.address)


def serve_forever(cfg: NodeConfig, listen: str, transfer_port: int | None, admin_token: str,
                  tenants: list[Tenant] | None = None, expire_interval: float = 30.0) -> int:
    try:
        running = start_store(cfg, listen, transfer_port, admin_token)
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
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"READY {running.address} transfer={running.transfer_address} node={cfg.node_id}", flush=True)
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


