"""gRPC adapter of the store node (`kvpool store`): protobuf in, :class:`StoreNode` calls, protobuf out.

Authentication happens here (the tenant comes from the token in the call's metadata, never from
the message); errors are mapped to gRPC status in exactly one place (``kvpool.core.errors``).  The
DRAM arena is served to peers by a :class:`~kvpool.transfer.TransferServer` with the node as
its guard; the same port serves the one-round-trip data session (:mod:`.data_session`).
The drain runs in a background thread and reports through ``GetDrainStatus``; so does the
scale-up warm-up push (``Warm``/``GetWarmStatus``, :mod:`.warm`).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from kvpool.core import errors
from kvpool.core.keys import unpack_keys
from kvpool.core.ring import Ring
from kvpool.store.data_session import DataSessionHandler
from kvpool.store.node import NodeConfig, StoreNode, Tenant
from kvpool.transfer import Segment, SegmentRegistry, TransferServer
from kvpool.wire import grpc_status
from kvpool.wire.convert import ring_from_pb, ring_to_pb
from kvpool.wire.proto import store_pb2 as pb
from kvpool.wire.proto import store_pb2_grpc as pbg

log = logging.getLogger("kvpool.store")

SEGMENT_NAME = "dram"
T = TypeVar("T")


def _bearer(context: grpc.ServicerContext) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == "authorization" and isinstance(v, str) and v.startswith("Bearer "):
            return v[7:]
    return ""


@dataclass
class DrainProgress:
    state: str = "idle"
    moved_objects: int = 0
    moved_bytes: int = 0
    dropped_objects: int = 0
    dropped_bytes: int = 0
    remaining_objects: int = 0
    deadline_unix_ms: int = 0
    epoch: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    """Set when a newer drain supersedes this one, or a newer ring makes the node active again
    (the scale-down was called off): its thread stops before its next batch."""
    stopped_as: str = "superseded"
    """The state a stopped drain ends in ("superseded" or "cancelled")."""

    def to_pb(self) -> pb.DrainStatus:
        return pb.DrainStatus(**{k: v for k, v in self.__dict__.items() if k not in ("stop", "stopped_as")})


@dataclass
class WarmProgress:
    state: str = "idle"
    planned_objects: int = 0
    planned_bytes: int = 0
    moved_objects: int = 0
    moved_bytes: int = 0
    skipped_objects: int = 0
    skipped_bytes: int = 0
    failed_objects: int = 0
    remaining_objects: int = 0
    deadline_unix_ms: int = 0
    epoch: int = 0
    cancelled: bool = False

    def to_pb(self) -> pb.WarmStatus:
        return pb.WarmStatus(**{k: v for k, v in self.__dict__.items() if k != "cancelled"})


class StoreService(pbg.StoreServicer):
    def __init__(self, node: StoreNode, transfer_address: str, admin_token: str = "") -> None:
        self.node = node
        self.transfer_address = transfer_address
        self.admin_token = admin_token
        self.location = pb.Location(segment=SEGMENT_NAME, transfer_address=transfer_address,
                                    shm_path=node.dram.path)
        self.drain = DrainProgress()
        self._drain_thread: threading.Thread | None = None
        self._drain_lock = threading.Lock()  # one Drain call at a time decides which drain runs
        self.warm = WarmProgress()

    # -- plumbing ---------------------------------------------------------------------------

    def _call(self, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except errors.KvpoolError as exc:
            context.abort(grpc_status.grpc_status_for(exc), str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise AssertionError("unreachable")

    def _tenant(self, context: grpc.ServicerContext) -> str:
        tid = self.node.authenticate(_bearer(context))
        if tid is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown or missing tenant token")
        return tid  # type: ignore[return-value]

    def _admin(self, context: grpc.ServicerContext) -> None:
        if self.admin_token and _bearer(context) != self.admin_token:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "admin token required")

    @staticmethod
    def _keys(blob: bytes) -> list[bytes]:
        try:
            return unpack_keys(blob)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None

    # -- data calls -------------------------------------------------------------------------

    def Exists(self, request: pb.ExistsRequest, context: grpc.ServicerContext) -> pb.ExistsReply:
        tenant = self._tenant(context)

        def run() -> pb.ExistsReply:
            prefix, present, lease = self.node.exists(
                tenant, self._keys(request.keys), request.kind, request.prefix_only, request.pin,
                request.lease_ms)
            return pb.ExistsReply(prefix=prefix, present=present, lease_id=lease.lease_id if lease else 0,
                                  lease_expires_unix_ms=int(lease.expires * 1000) if lease else 0,
                                  epoch=self.node.ring.epoch, incarnation=self.node.incarnation)
        return self._call(context, run)

    def PutStart(self, request: pb.PutStartRequest, context: grpc.ServicerContext) -> pb.PutStartReply:
        tenant = self._tenant(context)

        def run() -> pb.PutStartReply:
            codes, offsets, tokens, rid = self.node.put_start(
                tenant, self._keys(request.keys), list(request.sizes), request.traffic_class or "chatbot",
                request.kind, request.timeout_ms, request.epoch)
            return pb.PutStartReply(codes=codes, offsets=offsets, tokens=tokens, reservation_id=rid,
                                    location=self.location, epoch=self.node.ring.epoch,
                                    incarnation=self.node.incarnation)
        return self._call(context, run)

    def PutCommit(self, request: pb.PutCommitRequest, context: grpc.ServicerContext) -> pb.PutCommitReply:
        tenant = self._tenant(context)
        return self._call(context, lambda: pb.PutCommitReply(codes=self.node.put_commit(
            tenant, request.reservation_id, list(request.checksums), request.revoke, request.incarnation)))

    def PutRevoke(self, request: pb.PutRevokeRequest, context: grpc.ServicerContext) -> pb.Empty:
        tenant = self._tenant(context)
        self.node.put_revoke(tenant, request.reservation_id)
        return pb.Empty()

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.GetReply:
        tenant = self._tenant(context)

        def run() -> pb.GetReply:
            # Tokens are lease-scoped: they die with the lease.
            codes, offsets, sizes, sums, tokens, lease = self.node.get_plan(
                tenant, self._keys(request.keys), request.kind, request.lease_ms, request.lease_id)
            return pb.GetReply(codes=codes, offsets=offsets, sizes=sizes, checksums=sums, tokens=tokens,
                               lease_id=lease.lease_id if lease else 0,
                               lease_expires_unix_ms=int(lease.expires * 1000) if lease else 0,
                               location=self.location, epoch=self.node.ring.epoch,
                               incarnation=self.node.incarnation)
        return self._call(context, run)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.Empty:
        tenant = self._tenant(context)
        # Only the caller's own leases, of this life.
        self.node.release(list(request.lease_ids), tenant, request.incarnation)
        return pb.Empty()

    def Remove(self, request: pb.RemoveRequest, context: grpc.ServicerContext) -> pb.CodesReply:
        tenant = self._tenant(context)
        return self._call(context, lambda: pb.CodesReply(
            codes=self.node.remove(tenant, self._keys(request.keys), request.kind)))

    def Health(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.HealthReply:
        return pb.HealthReply(ok=True, node_id=self.node.node_id, epoch=self.node.ring.epoch,
                              transfer_address=self.transfer_address, incarnation=self.node.incarnation)

    def Stats(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.StatsReply:
        # The admin (operator) sees every tenant; a tenant sees only its own usage and counters.
        # Without an admin token (dev pools) an anonymous caller counts as the admin.
        token = _bearer(context)
        only: str | None = None
        if not (self.admin_token and token == self.admin_token):
            tid = self._tenant(context)
            if token or self.admin_token:
                only = tid
        s: dict[str, Any] = self.node.stats()
        if only is not None:
            s["tenants"] = [t for t in s["tenants"] if t[0] == only]
        counters = s["counters"]
        return pb.StatsReply(
            node_id=s["node_id"], epoch=s["epoch"], draining=s["draining"],
            tiers=[pb.TierStats(name=n, capacity_bytes=c, used_bytes=u, objects=o) for n, c, u, o in s["tiers"]],
            tenants=[pb.TenantStats(tenant_id=t, used_bytes=u, quota_bytes=q, objects=max(o, 0), counters=c,
                                    share_bytes=share)
                     for t, u, q, o, c, share in s["tenants"]],
            counters=counters, hit_blocks=counters.get("hit_blocks", 0),
            lookup_blocks=counters.get("lookup_blocks", 0), incarnation=s["incarnation"])

    # -- admin calls ------------------------------------------------------------------------

    def GetRing(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.Ring:
        return ring_to_pb(self.node.ring)

    def SetRing(self, request: pb.Ring, context: grpc.ServicerContext) -> pb.Ring:
        self._admin(context)
        ring = self._call(context, lambda: self.node.set_ring(ring_from_pb(request)))
        self._cancel_drain_if_active(ring)
        return ring_to_pb(ring)

    def _cancel_drain_if_active(self, ring: Ring) -> None:
        """A ring newer than the running drain's in which this node is an active member again
        calls the scale-down off: the drain stops before its next batch (what it pushed stays,
        as extra copies).  A ring without the node (removed mid-push) lets the drain go on."""
        me = ring.member(self.node.node_id)
        with self._drain_lock:
            d = self.drain
            if d.state == "running" and ring.epoch > d.epoch and me is not None and me.state == "active":
                d.stopped_as = "cancelled"
                d.stop.set()
                log.info("drain of epoch %d cancelled: epoch %d makes this node active again", d.epoch, ring.epoch)

    def SetTenants(self, request: pb.SetTenantsRequest, context: grpc.ServicerContext) -> pb.Empty:
        self._admin(context)
        self.node.set_tenants([Tenant(t.tenant_id, t.token, bytes(t.salt), t.quota_bytes,
                                      {k: float(v) for k, v in t.ttl_seconds.items()}, t.evict_own_on_quota)
                               for t in request.tenants], request.replace)
        return pb.Empty()

    def SetPolicy(self, request: pb.PolicyRequest, context: grpc.ServicerContext) -> pb.Empty:
        self._admin(context)
        self.node.set_policy({k: float(v) for k, v in request.ttl_seconds.items()},
                             request.high_watermark, request.low_watermark)
        return pb.Empty()

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainStatus:
        self._admin(context)
        ring = self._call(context, lambda: ring_from_pb(request.ring))
        self.node.set_ring(ring)
        with self._drain_lock:
            if ring.epoch <= self.drain.epoch and self.drain.state != "idle":
                # Idempotent (the operator may call again after a restart), and a call for an
                # older epoch than the drain at hand (a late retry) changes nothing.
                return self.drain.to_pb()
            # A newer epoch supersedes a drain still running by its older ring: it stops before
            # its next batch, and the new one starts once it has (never two pushers at once).
            before, before_thread = self.drain, self._drain_thread
            before.stop.set()
            self.drain = DrainProgress(state="running", deadline_unix_ms=request.deadline_unix_ms, epoch=ring.epoch)
            from kvpool.store.drain import run_drain  # the pusher needs the store client (a module cycle otherwise)

            def run(progress: DrainProgress) -> None:
                if before_thread is not None:
                    before_thread.join()
                run_drain(self.node, ring, progress, request.max_bytes_per_second)
            self._drain_thread = threading.Thread(target=run, args=(self.drain,), name="drain", daemon=True)
            self._drain_thread.start()
            return self.drain.to_pb()

    def GetDrainStatus(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DrainStatus:
        return self.drain.to_pb()

    def Warm(self, request: pb.WarmRequest, context: grpc.ServicerContext) -> pb.WarmStatus:
        """Start (once per epoch: idempotent, so an operator may call again) the warm-up push of
        the objects now owned by ``request.added``, or by the next owners in place of
        ``request.removed`` (replication restored); a warm-up of an older epoch is stopped."""
        self._admin(context)
        ring = self._call(context, lambda: ring_from_pb(request.ring))
        if not 0.0 <= request.fraction <= 1.0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fraction must be in [0, 1]")
        self.node.set_ring(ring)
        if self.warm.state in ("running", "done") and self.warm.epoch == ring.epoch:
            return self.warm.to_pb()
        self.warm.cancelled = True
        self.warm = WarmProgress(state="running", deadline_unix_ms=request.deadline_unix_ms, epoch=ring.epoch)
        from kvpool.store.warm import run_warm  # the pusher needs the store client (a module cycle otherwise)
        threading.Thread(target=run_warm, args=(self.node, ring, list(request.added), self.warm,
                                                request.max_bytes_per_second, request.fraction,
                                                list(request.removed)),
                         name="warm", daemon=True).start()
        return self.warm.to_pb()

    def GetWarmStatus(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.WarmStatus:
        return self.warm.to_pb()


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
    registry = SegmentRegistry()
    registry.register(Segment(SEGMENT_NAME, node.dram.view), guard=_Guard(node))
    tport = transfer_port if transfer_port is not None else (int(port_s) + 1 if int(port_s) else 0)
    sessions = {DataSessionHandler.magic: DataSessionHandler(node)} if cfg.data_session else None
    transfer = TransferServer(registry, host=host, port=tport, sessions=sessions)
    transfer.start()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc"),
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20),
                                  ("grpc.so_reuseport", 0)])
    service = StoreService(node, transfer.address, admin_token)
    pbg.add_StoreServicer_to_server(service, server)
    bound = server.add_insecure_port(f"{host}:{port_s}")
    if bound == 0:
        transfer.stop()
        node.close()
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return RunningStore(node, server, transfer, f"{host}:{bound}", transfer.address)


class _Guard:
    """Adapts the node to the transfer server's guard protocol."""

    def __init__(self, node: StoreNode) -> None:
        self.node = node

    def acquire(self, op: str, offset: int, length: int, token: int) -> object | None:
        return self.node.acquire(op, offset, length, token)

    def release(self, handle: object) -> None:
        self.node.release_guard(handle)  # type: ignore[arg-type]


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


