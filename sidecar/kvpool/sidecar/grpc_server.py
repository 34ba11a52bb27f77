"""The sidecar's gRPC front end, for the client's cold calls: protobuf in, calls of the sidecar's
parts, protobuf out.

Every method checks the request's shape (a malformed one is refused with INVALID_ARGUMENT),
calls :class:`~kvpool.sidecar.reads.Reads`, :class:`~kvpool.sidecar.puts.Puts` or the
:class:`~kvpool.sidecar.handoff.HandoffService`, and builds the reply.  The hot calls (match,
read, write, release) have no gRPC form: the fast session (:mod:`kvpool.sidecar.session_server`)
serves them.  :class:`IncarnationCheck` refuses a call that names another life of the sidecar
before it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
import numpy as np

from kvpool.core import errors, ranges
from kvpool.core.keys import KEY_BYTES
from kvpool.core.version import __version__
from kvpool.pool.fanout import Pool
from kvpool.sidecar.config import SidecarConfig
from kvpool.sidecar.handoff import HandoffService
from kvpool.sidecar.puts import Puts
from kvpool.sidecar.reads import Reads
from kvpool.sidecar.status import Greeting, Stats
from kvpool.wire.proto import sidecar_pb2 as spb
from kvpool.wire.proto import sidecar_pb2_grpc as spbg
from kvpool.wire.proto import store_pb2 as pb


def _keys(blob: bytes, context: grpc.ServicerContext) -> tuple[list[bytes], np.ndarray]:
    if len(blob) % KEY_BYTES:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"keys blob of {len(blob)} bytes is not a multiple of {KEY_BYTES}")
    arr = np.frombuffer(blob, dtype=f"V{KEY_BYTES}")
    return arr.tolist(), arr


def _kind(kind: int, context: grpc.ServicerContext) -> int:
    if kind not in (pb.BLOCK, pb.STATE):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown object kind {kind}")
    return kind


class SidecarServicer(spbg.SidecarServicer):
    """The ``Sidecar`` gRPC service of one sidecar."""

    def __init__(self, *, cfg: SidecarConfig, greeting: Greeting, pool: Pool, reads: Reads, puts: Puts,
                 handoff: HandoffService, stats: Callable[[], Stats],
                 flush: Callable[[float], tuple[int, int, int]]) -> None:
        self.cfg, self.greeting, self.pool = cfg, greeting, pool
        self.reads, self.puts, self.handoff = reads, puts, handoff
        self._stats, self._flush = stats, flush

    def Hello(self, request: pb.Empty, context: grpc.ServicerContext) -> spb.HelloReply:
        g = self.greeting
        return spb.HelloReply(arena_path=g.arena_path, arena_bytes=g.arena_bytes, tenant_id=g.tenant_id,
                              version=__version__, ring_epoch=self.pool.ring.epoch, pool_nodes=len(self.pool.nodes),
                              handoff_address=g.handoff_address, instance_id=g.instance_id,
                              incarnation=g.incarnation, arena_generation=g.arena_generation)

    # -- reads --------------------------------------------------------------------------------

    def Probe(self, request: spb.ProbeRequest, context: grpc.ServicerContext) -> spb.ProbeReply:
        """Per-key presence, local tier or pool (:meth:`Reads.probe`)."""
        keys, arr = _keys(request.keys, context)
        present = self.reads.probe(keys, arr, _kind(request.kind, context))
        return spb.ProbeReply(present=present.astype(np.uint8).tobytes())

    def ReadRanges(self, request: spb.ReadRangesRequest, context: grpc.ServicerContext) -> spb.ReadRangesReply:
        """Byte ranges of objects (:meth:`Reads.read_ranges`)."""
        if request.release_lease_ids:  # the client's copies out of them are done
            self.reads.release_reads(list(request.release_lease_ids))
        keys, arr = _keys(request.keys, context)
        kind = _kind(request.kind, context)
        if len(request.counts) != len(keys):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} keys but {len(request.counts)} range counts")
        try:
            flat = ranges.decode(request.counts, request.ranges)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        r = self.reads.read_ranges(keys, arr, kind, request.counts, flat, self.cfg.lease(request.lease_ms),
                                   request.verify_object)
        return spb.ReadRangesReply(codes=r.codes, sizes=r.sizes, offsets=r.offsets, lease_id=r.lease_id,
                                   lease_expires_unix_ms=r.lease_expires_unix_ms, local_hits=r.local_hits,
                                   pool_hits=r.pool_hits, pool_bytes=r.pool_bytes)

    # -- writes ---------------------------------------------------------------------------------

    def Remove(self, request: pb.RemoveRequest, context: grpc.ServicerContext) -> pb.CodesReply:
        keys, _ = _keys(request.keys, context)
        return pb.CodesReply(codes=self.puts.remove(keys, _kind(request.kind, context)))

    def Flush(self, request: spb.FlushRequest, context: grpc.ServicerContext) -> spb.FlushReply:
        flushed, nbytes, dropped = self._flush(request.timeout_ms / 1000.0 if request.timeout_ms else 10.0)
        return spb.FlushReply(flushed_objects=flushed, flushed_bytes=nbytes, dropped_objects=dropped)

    # -- handoff and stats --------------------------------------------------------------------

    def PublishPrefill(self, request: spb.PublishPrefillRequest,
                       context: grpc.ServicerContext) -> spb.PublishPrefillReply:
        return self.handoff.publish(request)

    def AcceptHandoff(self, request: spb.AcceptHandoffRequest,
                      context: grpc.ServicerContext) -> spb.AcceptHandoffReply:
        return self.handoff.accept(request)

    def Stats(self, request: pb.Empty, context: grpc.ServicerContext) -> spb.SidecarStats:
        s = self._stats()
        r = s.reads
        return spb.SidecarStats(counters=s.counters, local_capacity_bytes=s.local_capacity_bytes,
                                local_used_bytes=s.local_used_bytes, local_objects=s.local_objects,
                                ring_epoch=s.ring_epoch, pool_nodes_up=s.pool_nodes_up,
                                pending_pool_bytes=s.pending_pool_bytes,
                                pool_read_bytes_per_s=r.pool_read_bytes_per_s,
                                local_read_bytes_per_s=r.local_read_bytes_per_s, lookup_seconds=r.lookup_seconds,
                                pool_read_samples=r.pool_read_samples, local_read_samples=r.local_read_samples,
                                lookup_samples=r.lookup_samples)


class IncarnationCheck(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses a call that names another sidecar life (``kvpool-incarnation`` metadata) with
    ABORTED before it runs: its lease ids, reservation id or the offsets it will apply belong to
    a dead process.  A call without the metadata (Hello itself) names no life, so it carries no
    id of one and is let through."""

    def __init__(self, incarnation: int) -> None:
        self.incarnation = str(incarnation)

        def refuse(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.ABORTED,
                          f"the sidecar was restarted (this life is {self.incarnation}): say Hello again")
        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        for key, value in details.invocation_metadata or ():
            if key == errors.INCARNATION_METADATA:
                if value != self.incarnation:
                    return self._refuse
                break
        return continuation(details)


def start(servicer: SidecarServicer, socket: str, incarnation: int) -> grpc.Server:
    """The gRPC server of ``servicer`` listening on the unix socket ``socket``, started."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="rpc"),
                         interceptors=[IncarnationCheck(incarnation)],
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20)])
    spbg.add_SidecarServicer_to_server(servicer, server)
    if server.add_insecure_port(f"unix://{socket}") == 0:
        raise SystemExit(f"kvpool sidecar: cannot listen on {socket}")
    server.start()
    return server
